"""End-to-end decode benchmark: every method's generation speed and memory on one model, next to HF.

    python -m evals.bench.decode --model qwen3_8b --batch 64 --prompt 512 --new 2048 --budget 1024
    python -m evals.bench.decode --model tiny_qwen3 --batch 4 --prompt 64 --new 32 --budget 48 --hf-generate

The model is built from `conf/model/<name>.yaml` with random weights (no download) and fed random
prompt tokens; EOS is ignored so every row generates exactly `--new` tokens. For each method it
prints tokens/s, ms per decode step (p50, p99), time to first token and peak device memory;
`--hf-generate` adds transformers' `model.generate` (SDPA attention, DynamicCache) on the same
model, batch and lengths. Writes a CSV beside the printed table. Configs are composed by Hydra
(`evals.configs`): install hydra-core where the GPU image lacks it.
`--compile off,on` times every method with the decode forward eager, then compiled
(`longflow.compile`, the engine's `compile` option); `tuned` and `untuned` compile with and without
Inductor's kernel tuning (`engine.compile_tuning`; `on` tunes at batch 1 only, as the engine does).
`compile_s` is the time spent compiling in that row's runs (the first compiled run of a batch size
compiles, the others reuse its graph).

Before timing, the first method runs `--settle` times untimed at full length: on an H200 the first
method timed in a fresh process ran about 0.9 ms per step faster than the same method timed after
another one (README, "Benchmarks"), so without it the first row of a list is not comparable to the
others.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pandas as pd
import torch

from evals.bench.common import (
    COMPILE_SETTINGS,
    bench_engine,
    bench_model,
    compile_settings,
    method_policy,
    random_prompts,
    run,
    save_table,
    write_table,
)
from evals.configs import group_options
from longflow.cache import ATTENTION_NAME
from longflow.config import EngineConfig, GenerationConfig
from longflow.engine import synchronize


def time_engine(model, method: str, budget: int, prompts, new_tokens: int, cuda_graph: bool,
                compile_step: str) -> dict:
    policy = method_policy(method, budget)
    engine = bench_engine(model, policy, batch_size=len(prompts), cuda_graph=cuda_graph,
                          **COMPILE_SETTINGS[compile_step])
    compiled = engine.decode_forward
    compile_before = compiled.compile_seconds if compiled else 0.0
    generation = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
    seeds = list(range(len(prompts)))
    engine.generate(prompts, GenerationConfig(max_new_tokens=4, ignore_eos=True), seeds)  # warm-up
    capture_before = engine.capture_seconds
    result = engine.generate(prompts, generation, seeds)
    steps = np.array(result.step_seconds)
    total = result.prefill_seconds + steps.sum()
    return {
        "method": method, "budget": policy.budget,
        "tokens_per_s": len(prompts) * new_tokens / total,
        "step_ms_p50": float(np.percentile(steps, 50) * 1e3), "step_ms_p99": float(np.percentile(steps, 99) * 1e3),
        "ttft_s": result.prefill_seconds,
        "peak_memory_gb": result.peak_memory_bytes / 2**30 if result.peak_memory_bytes else None,
        "peak_kv_slots": max(result.peak_slots), "cuda_graph": result.cuda_graph, "new_tokens": new_tokens,
        "compiled": bool(compiled and not compiled.failed), "tuned": compiled is not None and compiled.tuning,
        "compile_s": compiled.compile_seconds - compile_before if compiled else 0.0,
        "capture_ms": (engine.capture_seconds - capture_before) * 1e3,
    }


def time_hf_generate(model, prompts, new_tokens: int) -> dict:
    """transformers' own loop: SDPA attention, DynamicCache, greedy, no EOS."""
    input_ids = torch.tensor(prompts, device=model.device)
    model.set_attn_implementation("sdpa")
    device = model.device
    try:
        kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
        model.generate(input_ids, max_new_tokens=4, min_new_tokens=4, **kwargs)  # warm-up
        synchronize(device)
        start = time.perf_counter()
        model.generate(input_ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        synchronize(device)
        prefill = time.perf_counter() - start
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        model.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        synchronize(device)
        total = time.perf_counter() - start
    finally:
        model.set_attn_implementation(ATTENTION_NAME)
    step = (total - prefill) / max(new_tokens - 1, 1)
    return {
        "method": "hf_generate (vanilla)", "budget": None, "tokens_per_s": len(prompts) * new_tokens / total,
        "step_ms_p50": step * 1e3, "step_ms_p99": None, "ttft_s": prefill,
        "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "peak_kv_slots": None, "cuda_graph": False, "new_tokens": new_tokens, "compiled": False, "tuned": False,
        "compile_s": 0.0, "capture_ms": 0.0,
    }


def report(row: dict) -> None:
    """One line as each method finishes: the runs of a full-size model take minutes."""
    compiled = ""
    if row["compiled"]:
        tuning = " with kernel tuning" if row["tuned"] else ""
        compiled = f", compiled{tuning} (compiling took {row['compile_s']:.1f} s)"
    memory = f", peak memory {row['peak_memory_gb']:.1f} GiB" if row["peak_memory_gb"] else ""
    captured = f", graph captured in {row['capture_ms']:.1f} ms" if row["cuda_graph"] else ""
    print(f"{row['method']}: {row['tokens_per_s']:.0f} tokens/s, {row['step_ms_p50']:.2f} ms per step"
          f"{memory}{compiled}{captured}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3_8b")
    parser.add_argument("--methods", default=",".join(group_options("method")),
                        help="comma-separated method configs of conf/method/ (default: all of them)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default=None, help="default: the model config's")
    parser.add_argument("--no-cuda-graph", action="store_true")
    parser.add_argument("--compile", default="on" if EngineConfig.compile else "off",
                        help="off, on (as the engine compiles), tuned or untuned (with or without Inductor's "
                             "kernel tuning, engine.compile_tuning), or several as off,on: every method timed in "
                             "each setting (default: the engine's)")
    parser.add_argument("--hf-generate", action="store_true", help="also time model.generate")
    parser.add_argument("--hf-new", type=int, default=None,
                        help="new tokens for model.generate (default --new); its step time barely depends on it")
    parser.add_argument("--out", default="results/bench_decode.csv")
    parser.add_argument("--settle", type=int, default=1,
                        help="untimed full-length runs of the first method before any is timed (default 1)")
    args = parser.parse_args()

    model, spec, device = bench_model(args.model, args.device, args.dtype)
    prompts = random_prompts(args.batch, args.prompt, model.config.get_text_config().vocab_size)

    methods = args.methods.split(",")
    try:
        settings = compile_settings(args.compile)
    except ValueError as error:
        parser.error(str(error))
    for _ in range(args.settle):
        report(time_engine(model, methods[0], args.budget, prompts, args.new, not args.no_cuda_graph, settings[0])
               | {"method": f"{methods[0]} (settling run, not in the table)"})
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    setting = dict(model=args.model, batch=args.batch, prompt=args.prompt, device=gpu)
    rows = []

    def record(row: dict) -> None:
        rows.append(row)
        report(row)
        save_table(pd.DataFrame(rows), args.out, setting)

    for compile_step in settings:
        for method in methods:
            record(time_engine(model, method, args.budget, prompts, args.new, not args.no_cuda_graph, compile_step))
    if args.hf_generate:
        record(time_hf_generate(model, prompts, args.hf_new or args.new))

    heading = (f"{args.model} (random weights, {spec.dtype}), batch {args.batch}, prompt {args.prompt}, "
               f"{args.new} new tokens, budget {args.budget}, on {gpu}")
    write_table(pd.DataFrame(rows), args.out, heading, setting)


if __name__ == "__main__":
    run(main)
