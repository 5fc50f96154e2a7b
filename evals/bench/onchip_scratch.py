"""The on-chip LongFlow pass (`longflow.kernels.onchip`, `LaunchConfig(onchip=True)`) against float32,
then timed against cuDNN's decode attention, `flash_decode`, the library's fused call as it chooses
(`longflow_fused`) and its Triton call (`triton_fused`), at each tile size and stage count, in one
process (CUDA graphs over input sets that overflow L2, replays in turns).

    python -m evals.bench.onchip_scratch            # checks, then times (CUDA GPU)
    python -m evals.bench.onchip_scratch --no-check --batches 128 64 256 --slots 3200 1024 8192 1744
    python -m evals.bench.onchip_scratch --no-check --tiles 32x2 64x2 --batches 64 --slots 2560 3584  # a sweep

The pass keeps LongFlow's score scratch in shared memory (Gluon) where the Triton call writes it to
global memory inside its loop. Results and what they mean: longflow/kernels/NOTES.md, "The scratch
on chip"; `results/engine/onchip_scratch_h100.txt` and `onchip_scratch_sweep_h100.txt` were taken
while the pass was an experiment in this module, before it moved into the library (cc55134, f37db7b).
"""

from __future__ import annotations

import argparse
import re

import torch

# The pass's configurations `main` times by default: <slots a tile>x<stages>, and the pass without a score.
TIMED = {f"onchip{block_n}x{stages}": dict(block_n=block_n, stages=stages) for block_n in (64, 32) for stages in (2, 3)}
TIMED["no_score64x2"] = dict(block_n=64, stages=2, score=False)


def onchip_call(q, k, v, valid, scale: float, **options):
    """`call()` -> (out `[B, Hq, D]`, next slot `[B]`) through `longflow.kernels.onchip`; `options` as
    `onchip_attention`'s. The next slot's buffer is allocated once, so that a CUDA graph can hold the call."""
    from longflow.kernels.onchip import onchip_attention

    next_slot = torch.empty(q.shape[0], 1, dtype=torch.long, device=q.device)

    def call():
        return onchip_attention(q, k, v, valid, next_slot, scale, **options), next_slot[:, 0]

    return call


def check(batch: int, slots: int, device: torch.device, tie: float = 0.02, **options) -> str:
    """Output and chosen slot against the library's reference in float32 (`longflow_scores`,
    `choose_next`); a chosen slot other than the reference's passes if its score is within `tie`
    (relative) of the minimum (the fp16 scratch's rounding)."""
    from evals.bench.attention import HEAD_DIM, make_cache
    from longflow.kernels.reference import longflow_scores
    from longflow.selection import choose_next

    q, k, v, valid = make_cache(batch, slots, device, seed=1)
    valid[::2] = True  # rows without free slots, whose next slot is chosen by its score
    scale = HEAD_DIM**-0.5
    name = f"batch {batch}, {slots} slots, {options}"
    out, next_slot = onchip_call(q, k, v, valid, scale, **options)()
    ref_out, ref_score = longflow_scores(q.float(), k.float(), v.float(), valid, scale)
    ref_next = choose_next(ref_score, valid)
    out_err = (out.float() - ref_out).abs().max().item()
    chosen = ref_score.gather(1, next_slot[:, None])[:, 0]
    best = ref_score.gather(1, ref_next[:, None])[:, 0]
    free_first = valid.gather(1, ref_next[:, None])[:, 0] == valid.gather(1, next_slot[:, None])[:, 0]
    equal = (next_slot == ref_next).float().mean().item()
    within = (free_first & (chosen <= best * (1 + tie) + 1e-12)).all().item()
    ok = out_err < 3e-2 and within
    return (f"{name}: output max error {out_err:.2e}, next slot equal in {equal:.1%} of rows, "
            f"{'all' if within else 'NOT all'} within {tie:.0%} of the minimum score: {'ok' if ok else 'FAILED'}")


def parse_tile(text: str) -> dict:
    """"64x2" -> `onchip_attention`'s options for 64-slot tiles and 2 stages; "64x2w8" with 8 warps."""
    match = re.fullmatch(r"(\d+)x(\d+)(?:w(\d+))?", text)
    if match is None:
        raise SystemExit(f"--tiles takes SLOTSxSTAGES[wWARPS] such as 64x2 or 64x2w8, not {text!r}")
    block_n, stages, warps = match.groups()
    return dict(block_n=int(block_n), stages=int(stages), warps=int(warps or 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[128, 64, 16])
    parser.add_argument("--slots", type=int, nargs="+", default=[3200, 1024, 8192])
    parser.add_argument("--no-check", action="store_true", help="time only, without the checks against float32")
    parser.add_argument("--tiles", nargs="+", metavar="SLOTSxSTAGES[wWARPS]",
                        help="time the pass at these tilings only (e.g. 32x2 64x2w8), instead of TIMED's")
    args = parser.parse_args()
    timed = TIMED if not args.tiles else {f"onchip{t}": parse_tile(t) for t in args.tiles}
    from evals.bench.attention import HEAD_DIM, against_cudnn, cache_sets, heuristic_config
    from evals.bench.common import require_cuda
    from longflow.kernels import longflow_attention, occupancy
    from longflow.kernels.onchip import fits

    require_cuda("evals.bench.onchip_scratch")
    device = torch.device("cuda")
    card = occupancy.gpu(device)
    for batch in [] if args.no_check else args.batches:
        for slots in args.slots:
            for options in (dict(block_n=64), dict(block_n=32)):
                print(check(batch, slots, device, **options), flush=True)
    scale = HEAD_DIM**-0.5
    for batch in args.batches:
        for slots in args.slots:
            sets = cache_sets(batch, slots, device)
            triton_config = heuristic_config(batch, slots, device)  # the Triton call, whatever the default
            methods = {"triton_fused": [lambda s=s, c=triton_config: longflow_attention(*s, scale, config=c)
                                        for s in sets]}
            for name, options in timed.items():
                if not fits(options["block_n"], options["stages"], slots, card):
                    print(f"batch {batch:>3}, {slots:>4} slots: {name} needs more shared memory than a program gets")
                    continue
                methods[name] = [onchip_call(*s, scale, **options) for s in sets]
            print(f"batch {batch:>3}, {slots:>4} slots: {against_cudnn(sets, methods)}", flush=True)

if __name__ == "__main__":
    from evals.bench.common import run

    run(main)
