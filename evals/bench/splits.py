"""The scored Triton call with its attention pass's splits forced, against cuDNN's decode attention and
`flash_decode`, with each scratch dtype, in one process (CUDA graphs over input sets that overflow L2,
replays in turns): where splitting a KV head's slots over programs pays and where it does not.

    python -m evals.bench.splits                                  # batch 16, 24, 32 x 1024-8192 slots
    python -m evals.bench.splits --batches 16 --slots 1024 3200 --splits 1 3

Names: `s<splits><32|16>` = that many splits with an fp32 or fp16 scratch, the rest of the
`LaunchConfig` as `default_config` chooses; `longflow_fused` = the library's call as it chooses (the
on-chip pass where `longflow.kernels.onchip.tiling` takes it). Results: longflow/kernels/NOTES.md,
"Batch 16 on an H100"; `results/engine/splits_h100.txt`.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 24, 32])
    parser.add_argument("--slots", type=int, nargs="+", default=[1024, 2048, 3200, 4096, 5120, 6144, 8192])
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 3, 4],
                        help="splits to time, beside the default's own")
    args = parser.parse_args()
    from evals.bench.attention import HEAD_DIM, against_cudnn, cache_sets, heuristic_config
    from evals.bench.common import require_cuda
    from longflow.kernels import longflow_attention

    require_cuda("evals.bench.splits")
    device = torch.device("cuda")
    scale = HEAD_DIM**-0.5
    for batch in args.batches:
        for slots in args.slots:
            sets = cache_sets(batch, slots, device)
            base = heuristic_config(batch, slots, device)
            methods = {}
            for splits in sorted({*args.splits, base.splits}):
                for scratch in ("fp32", "fp16"):
                    config = replace(base, splits=splits, scratch=scratch)
                    methods[f"s{splits}{scratch[2:]}"] = [
                        lambda s=s, c=config: longflow_attention(*s, scale, config=c) for s in sets]
            print(f"batch {batch:>3}, {slots:>4} slots (default: {base.splits} splits, {base.scratch}): "
                  f"{against_cudnn(sets, methods)}", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    from evals.bench.common import run

    run(main)
