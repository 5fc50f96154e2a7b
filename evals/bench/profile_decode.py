"""Where a decode step's time goes: the kernels of replayed decode steps, by category.

    python -m evals.bench.profile_decode --model qwen3_8b --batch 128 --prompt 512 --budget 1024 --step 500

Runs the engine as `evals.bench.decode` does (random weights and prompt tokens, EOS ignored) up to
decode step `--step`, profiles the next `--steps` steps, CUDA-graph replays, with torch.profiler
(CUPTI records each kernel of a replayed graph), and prints, for each method and `--compile`
setting: the kernels of one step by category (count, summed time, share) next to the step's wall
time (the median of the 16 unprofiled replays just before), then the costliest kernels. At step 500 of
prompt 512 the full cache holds 1012 slots, about its mean over 1024 new tokens. Categories come
from the kernel names: cuBLAS matmuls, the policies' Triton attention kernels, the slot write,
Inductor's matmul templates (max-autotune's) and fused kernels, and PyTorch's own elementwise,
reduction, indexing and copy kernels. `--options` compiles with other `torch.compile` options than
the engine's (as `evals.bench.compile_options` times them), to see where such a setting moves the time.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
from collections import defaultdict

import numpy as np
import pandas as pd
import torch
from torch.autograd import DeviceType

from evals.bench.common import COMPILE_SETTINGS, compile_settings, method_policy, random_prompts, run
from evals.bench.compile_options import inductor_options
from evals.configs import model_spec
from longflow.config import EngineConfig, GenerationConfig
from longflow.engine import Engine
from longflow.models import load_model, resolve_device

# First match wins: Inductor's kernel names carry the fused ops' names ("triton_poi_fused_index_...").
CATEGORIES = (
    ("policy attention (Triton)", ("_partial_kernel", "_score_kernel", "_combine_kernel")),
    ("slot write (Triton)", ("_write_kernel",)),
    ("matmul (Inductor template)", ("triton_tem_",)),
    ("Inductor fused (Triton)", ("triton_",)),
    ("matmul (cuBLAS)", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "splitk")),
    ("indexing, scatter, gather", ("index", "scatter", "gather")),
    ("reductions", ("reduce",)),
    ("copies, casts, concatenation", ("copy", "cat", "memcpy", "memset")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)


def category(kernel: str) -> str:
    name = kernel.lower()
    return next((label for label, keys in CATEGORIES if any(key in name for key in keys)), "other")


def profiled_policy(policy, first: int, count: int, profiler):
    """`policy` with the profiler started before step `first` and stopped after `count` steps."""

    class Profiled(type(policy)):
        def before_step(self, step):
            eager = super().before_step(step)
            if step == first:
                torch.cuda.synchronize()
                profiler.start()
            return eager

        def after_step(self, step):
            super().after_step(step)
            if step == first + count - 1:
                torch.cuda.synchronize()
                profiler.stop()

    profiled = copy.deepcopy(policy)
    profiled.__class__ = Profiled
    return profiled


def profile(model, method: str, budget: int, prompts, first: int, count: int, compile_step: str,
            options: dict | None = None):
    """(kernel times `{name: [us per call]}` over the profiled steps, median wall ms of the 16 replays
    before: vanilla's step grows with the filled slots, so only the nearest steps compare). `options`:
    `torch.compile` options in place of the engine's, compiled afresh."""
    with inductor_options(model, options) if options is not None else contextlib.nullcontext():
        return _profile(model, method, budget, prompts, first, count, compile_step)


def _profile(model, method: str, budget: int, prompts, first: int, count: int, compile_step: str):
    policy = method_policy(method, budget)
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    engine = Engine(model, lambda: profiled_policy(policy, first, count, profiler), eos_ids=[], pad_id=0,
                    config=EngineConfig(batch_size=len(prompts), **COMPILE_SETTINGS[compile_step]))
    seeds = list(range(len(prompts)))
    engine.generate(prompts, GenerationConfig(max_new_tokens=4, ignore_eos=True), seeds)  # compiles, if asked
    result = engine.generate(prompts, GenerationConfig(max_new_tokens=first + count + 1, ignore_eos=True), seeds)
    if not result.cuda_graph:
        raise RuntimeError("the decode steps did not run as graph replays")
    kernels = defaultdict(list)
    for event in profiler.events():
        if event.device_type == DeviceType.CUDA:
            kernels[event.name].append(event.time_range.elapsed_us())
    wall_ms = float(np.median(result.step_seconds[max(2, first - 16):first])) * 1e3
    return kernels, wall_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3_8b")
    parser.add_argument("--methods", default="longflow,vanilla")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--step", type=int, default=500, help="first profiled decode step (>= 2: a replay)")
    parser.add_argument("--steps", type=int, default=5, help="profiled steps, averaged")
    parser.add_argument("--compile", default="off,on",
                        help="off, on, tuned, untuned (as evals.bench.decode), or several as off,on")
    parser.add_argument("--options", type=json.loads, default=None,
                        help="torch.compile options as a JSON object, in place of the engine's")
    parser.add_argument("--top", type=int, default=12, help="costliest kernels listed")
    parser.add_argument("--out", default="results/profile_decode.csv")
    args = parser.parse_args()
    if args.options is not None and (not isinstance(args.options, dict) or "off" in args.compile.split(",")):
        parser.error("--options takes a JSON object, and applies to compiled settings only (not --compile off)")
    if args.step < 3:
        parser.error("--step must be at least 3: steps 0 and 1 run eagerly and the wall time needs replays before it")
    try:
        settings = compile_settings(args.compile)
    except ValueError as error:
        parser.error(str(error))

    spec = model_spec(args.model, weights="random")
    device = resolve_device("cuda")
    model, _ = load_model(spec, device)
    prompts = random_prompts(args.batch, args.prompt, model.config.get_text_config().vocab_size)

    rows = []
    for setting in settings:
        for method in args.methods.split(","):
            kernels, wall_ms = profile(model, method, args.budget, prompts, args.step, args.steps, setting,
                                       args.options)
            by_category = defaultdict(lambda: [0, 0.0])
            for name, times in kernels.items():
                by_category[category(name)][0] += len(times) / args.steps
                by_category[category(name)][1] += sum(times) / args.steps / 1e3
            kernel_ms = sum(ms for _, ms in by_category.values())
            shown = setting if args.options is None else f"{setting} with options {json.dumps(args.options)}"
            print(f"\n{method}, compile {shown}: step {wall_ms:.2f} ms (replay wall time), kernels "
                  f"{kernel_ms:.2f} ms in {sum(n for n, _ in by_category.values()):.0f} launches")
            for label, (count, ms) in sorted(by_category.items(), key=lambda item: -item[1][1]):
                print(f"  {label:32s} {count:6.0f} kernels {ms:7.3f} ms  {ms / wall_ms:6.1%} of the step")
                rows.append(dict(method=method, compile=setting, options=json.dumps(args.options), category=label,
                                 kernels_per_step=count, ms_per_step=ms, step_ms=wall_ms))
            top = sorted(kernels.items(), key=lambda item: -sum(item[1]))[:args.top]
            for name, times in top:
                print(f"    {sum(times) / args.steps / 1e3:7.3f} ms  {len(times) / args.steps:5.0f}x  {name[:110]}")
    pd.DataFrame(rows).assign(model=args.model, batch=args.batch, prompt=args.prompt, step=args.step,
                              device=torch.cuda.get_device_name(device)).to_csv(args.out, index=False)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    run(main)
