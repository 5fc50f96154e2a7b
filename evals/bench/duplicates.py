"""R-KV's newest-duplicate search (`longflow.kernels.newest_duplicates`) alone, at one layer's shape.

    python -m evals.bench.duplicates                      # Figure 3's compression: 408 rows, 8 KV heads, 1744 slots
    python -m evals.bench.duplicates --sweep              # the tile shapes and warps, the default first
    python -m evals.bench.duplicates --shared 1.2         # keys around a shared direction: tiles stop early

One compression of R-KV searches every layer's keys `[B, Hkv, S, D]` (bf16, as the cache stores
them). With `--shared 0` the keys are independent Gaussians, as a random-weight model's: almost no
pair passes the threshold, so every program walks all its column tiles, the worst case and Figure
3's (`evals.bench.throughput`); `--shared` adds that multiple of one direction per head, so most keys
find a newer duplicate in the first tiles, as a trained model's keys do. Each configuration is timed
over `--repeats` launches between CUDA events after a warm-up, the median kept; `tflops` counts the
products of a full walk (2 D S^2 per head), whatever the early exits skipped. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import inspect
import itertools

import numpy as np
import pandas as pd
import torch

from evals.bench.common import require_cuda, run, write_table
from longflow.kernels import newest_duplicates

DEFAULT = {name: parameter.default for name, parameter in inspect.signature(newest_duplicates).parameters.items()
           if parameter.kind is inspect.Parameter.KEYWORD_ONLY}  # the kernel's own launch defaults


def launch_ms(call, repeats: int) -> tuple[float, object]:
    """(median milliseconds of `call` over `repeats` launches, each between two CUDA events; what the
    warm-up call returned)."""
    result = call()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return float(np.median(times)), result


def layer_keys(batch: int, kv_heads: int, slots: int, head_dim: int, shared: float, device) -> tuple:
    """(keys `[B, Hkv, S, D]` bf16, inverse norms `[B, Hkv, S]` float32) of one layer, every slot held."""
    generator = torch.Generator(device).manual_seed(0)
    keys = torch.randn(batch, kv_heads, slots, head_dim, device=device, generator=generator)
    if shared:
        keys += shared * torch.randn(batch, kv_heads, 1, head_dim, device=device, generator=generator)
    keys = keys.to(torch.bfloat16)
    return keys, 1.0 / (keys.float().norm(dim=-1) + 1e-8)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=408)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--slots", type=int, default=1744, help="Figure 3's cut: the budget's slots, full")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--threshold", type=float, default=0.5)
    parser.add_argument("--shared", type=float, default=0.0, help="a shared direction's weight in every key")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sweep", action="store_true", help="time tile shapes and warps besides the default")
    parser.add_argument("--out", default="results/bench_duplicates.csv")
    args = parser.parse_args(argv)
    require_cuda("evals.bench.duplicates")
    device = torch.device("cuda")
    keys, inverse = layer_keys(args.batch, args.kv_heads, args.slots, args.head_dim, args.shared, device)
    configs = [DEFAULT]
    if args.sweep:
        configs += [dict(block_rows=rows, block_cols=cols, num_warps=warps)
                    for rows, cols, warps in itertools.product((32, 64, 128, 256), (32, 64, 128), (4, 8))
                    if dict(block_rows=rows, block_cols=cols, num_warps=warps) != DEFAULT]
    flops = 2 * args.head_dim * args.slots**2 * args.batch * args.kv_heads
    expected, rows = None, []
    for config in configs:
        try:
            ms, (index, _) = launch_ms(lambda c=config: newest_duplicates(keys, inverse, args.threshold, **c),
                                       args.repeats)
        except Exception as error:  # a tile that needs more shared memory or registers than the GPU has
            print(f"{config}: {type(error).__name__}: {str(error).splitlines()[0]}", flush=True)
            continue
        if expected is None:
            expected = index
        rows.append(dict(**config, ms=ms, tflops=flops / ms / 1e9, same_as_default=bool(torch.equal(index, expected)),
                         found=float((index != args.slots - 1).float().mean())))
        print(rows[-1], flush=True)
    table = pd.DataFrame(rows).sort_values("ms")
    write_table(table, args.out, "newest_duplicates, one layer", dict(
        batch=args.batch, kv_heads=args.kv_heads, slots=args.slots, head_dim=args.head_dim, shared=args.shared,
        threshold=args.threshold, device=torch.cuda.get_device_name(device)))


if __name__ == "__main__":
    run(main)
