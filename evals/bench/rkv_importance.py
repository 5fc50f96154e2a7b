"""R-KV's window importance kernel against the PyTorch form, at Figure 3's shapes.

    python -m evals.bench.rkv_importance      # 408 rows, 8 KV heads of 4, window 8, 1744 slots

`baselines.rkv.window_importance` on the 16-bit GPU path is one bf16 product with float32 output and
about seven PyTorch kernels over its maximum; `longflow.kernels.window_importance`, which
`rkv_scores` takes there, is one Triton kernel in two passes (its docstring has the bytes). Both are
CUDA-graph timed (`evals.bench.attention`'s timing), a layer at a time, for each tile size given,
with the largest difference next to the times. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse

import torch

from evals.bench.common import require_cuda, run
from longflow import kernels


def main(argv: list[str] | None = None) -> None:
    from baselines.rkv import window_importance
    from evals.bench.attention import graph_ms

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=408)
    parser.add_argument("--slots", type=int, default=1744)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--blocks", type=int, nargs="+", default=[32, 64, 128], help="slots of one tile")
    args = parser.parse_args(argv)
    require_cuda("evals.bench.rkv_importance")
    device = torch.device("cuda")
    q_heads, kv_heads, head_dim = 32, 8, 128  # Qwen3-8B
    generator = torch.Generator(device=device).manual_seed(0)
    queries = torch.randn(args.batch, q_heads, args.window, head_dim, device=device, dtype=torch.bfloat16,
                          generator=generator)
    keys = torch.randn(args.batch, kv_heads, args.slots, head_dim, device=device, dtype=torch.bfloat16,
                       generator=generator)
    index = torch.arange(args.slots, device=device)
    older = (index < args.slots - args.window).expand(args.batch, kv_heads, -1).contiguous()
    older[:, :, :7] = False  # left padding
    query_valid = torch.ones(args.batch, args.window, dtype=torch.bool, device=device)
    scale = head_dim**-0.5
    want = window_importance(queries, query_valid, keys, older, scale)
    eager = graph_ms([lambda: window_importance(queries, query_valid, keys, older, scale)])
    print(f"batch {args.batch}, {args.slots} slots, window {args.window}: PyTorch {eager:.3f} ms a layer, "
          f"{36 * eager:.1f} ms for 36 layers", flush=True)
    for block in args.blocks:
        got = kernels.window_importance(queries, query_valid, keys, older, scale, block=block)
        finite = want.isfinite()
        same_inf = bool(torch.equal(finite, got.isfinite()))
        error = ((got - want).abs()[finite] / want.abs()[finite].clamp(min=1e-30)).max().item()
        fused = graph_ms([lambda b=block: kernels.window_importance(queries, query_valid, keys, older, scale, block=b)])
        print(f"  kernel, {block} slots a tile: {fused:.3f} ms a layer ({eager / fused:.2f}x), "
              f"largest relative difference {error:.1e}, -inf where PyTorch's: {same_inf}", flush=True)


if __name__ == "__main__":
    run(main)
