"""Where an interval method's compression spends its time: one cut of a batch, timed and profiled.

    python -m evals.bench.profile_compression --model qwen3_8b --methods rkv --batch 408 --budget 1744

Figure 3's setting (`evals.bench.throughput`): random weights and prompts, the batch allocated and
prefilled as `Engine.generate` does. Then, `--repeats` times, the cache is fast-forwarded
(`fast_forward`) to the step whose token fills every row, that step runs with the policy's host
hooks (the compression of every row at once, as when the rows are in step; the step of the base
class's schedule, `throughput.schedule`, so for the methods that cut by it), and so does the step
before it, which compresses nothing; the compression's cost is the difference of their medians,
as in Figure 3's `compression_ms`. One more compressing step runs under torch.profiler, whose
costliest kernels (GPU) or operators (CPU, self time) are printed. Steps run eagerly: a
compression is host code between replays, so graphs and compilation do not change its cost.
Writes `--out` (CSV): a row per method and batch with both step times and the compression's.
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np
import pandas as pd
import torch

from evals.bench.common import bench_engine, bench_model, method_policy, random_prompts, run, write_table
from evals.bench.throughput import fast_forward, schedule
from longflow.config import GenerationConfig
from longflow.engine import DecodeState, synchronize


def timed_step(engine, cache, state, generation, step: int) -> float:
    """Seconds of decode step `step` with the policy's host hooks, the device drained before and after."""
    policy = cache.policy
    synchronize(engine.device)
    start = time.perf_counter()
    policy.before_step(step)
    engine.decode_one_token(cache, state, generation)
    policy.after_step(step)
    synchronize(engine.device)
    return time.perf_counter() - start


@torch.inference_mode()
def profile_method(model, method: str, budget: int, batch: int, prompt: int, repeats: int, top: int) -> dict:
    """One method's row (see the module docstring), with its profile printed."""
    policy = method_policy(method, budget)
    if policy.schedule != "interval":
        raise SystemExit(f"{method} is not an interval method: it never compresses")
    engine = bench_engine(model, policy, compile=False, cuda_graph=False)
    generation = GenerationConfig(max_new_tokens=prompt + 4 * budget, ignore_eos=True)  # room for a first cut
    prompts = random_prompts(batch, prompt, engine.vocab)
    input_ids, pad = engine.batch_inputs(prompts)
    cache = engine.new_cache(engine.policy_factory, batch, pad.shape[1], generation)
    state = DecodeState(batch, generation.max_new_tokens, engine.vocab, list(range(batch)), engine.pad_id,
                        engine.device, track_seen=False)
    engine.prefill(cache, state, input_ids, pad, generation)
    policy, positions = cache.policy, state.positions.clone()
    held = int(policy.layers[0].valid[0].sum(dim=-1).max())
    before, compresses = schedule(policy, held, generation.max_new_tokens - 1)
    steps = np.flatnonzero(compresses[1:]) + 1  # step 0 is the engine's first, eager in any case
    if not len(steps):
        raise SystemExit(f"{method}: no compression within {generation.max_new_tokens} steps at budget {budget}")
    cut = int(steps[0])

    def run(step: int) -> float:
        fast_forward(policy, state, positions, int(before[step]), step)
        return timed_step(engine, cache, state, generation, step)

    run(cut - 1), run(cut)  # warm-up: the allocator's first blocks, kernels' first launches
    plain = float(np.median([run(cut - 1) for _ in range(repeats)]))
    compressing = float(np.median([run(cut) for _ in range(repeats)]))
    on_gpu = engine.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])
    fast_forward(policy, state, positions, int(before[cut]), cut)
    with torch.profiler.profile(activities=activities) as profiler:
        timed_step(engine, cache, state, generation, cut)
    print(f"\n{method}, batch {batch}, {policy.layers[0].slots} slots cut to {policy.keep_after}: compressing step "
          f"{compressing * 1e3:.2f} ms, plain step {plain * 1e3:.2f} ms, compression "
          f"{(compressing - plain) * 1e3:.2f} ms")
    print(profiler.key_averages().table(sort_by="self_device_time_total" if on_gpu else "self_cpu_time_total",
                                        row_limit=top))
    return {"method": method, "budget": policy.budget, "batch": batch, "slots": policy.layers[0].slots,
            "kept": policy.keep_after, "plain_step_ms": plain * 1e3, "compressing_step_ms": compressing * 1e3,
            "compression_ms": (compressing - plain) * 1e3}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3_8b")
    parser.add_argument("--methods", default="rkv", help="comma-separated interval methods of conf/method/")
    parser.add_argument("--batch", type=int, default=408)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--budget", type=int, default=1744, help="Figure 3's: 20%% of prompt 512 + 8192 new")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps of each kind (the median is kept)")
    parser.add_argument("--top", type=int, default=15, help="costliest kernels or operators listed")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default="results/profile_compression.csv")
    args = parser.parse_args(argv)
    model, spec, device = bench_model(args.model, args.device)
    rows = []
    for method in args.methods.split(","):
        rows.append(profile_method(model, method, args.budget, args.batch, args.prompt, args.repeats, args.top))
        gc.collect()  # the batch's cache, before the next method allocates its own
        if device.type == "cuda":
            torch.cuda.empty_cache()
    write_table(pd.DataFrame(rows), args.out, "compressions", dict(
        model=args.model, prompt=args.prompt, device=torch.cuda.get_device_name(device) if device.type == "cuda"
        else "cpu"))


if __name__ == "__main__":
    run(main)
