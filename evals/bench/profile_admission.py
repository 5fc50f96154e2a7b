"""Where a continuous-batching admission's time goes: the host's part against the device's.

    python -m evals.bench.profile_admission --model qwen3_8b --method longflow --budget 512 --rows 1,2,4,8,16
    python -m evals.bench.profile_admission --model qwen3_8b --rows 1,2,4,8,16 --prefill eager,compiled
    python -m evals.bench.profile_admission --model tiny_qwen3 --device cpu --rows 1,2 --prompt 32

`Engine.serve` refills free rows by prefilling their prompts through a policy of their own and
copying it into the rows (`Engine.admit`). For each number of rows in `--rows`, this times the
admission's parts as `Engine.admit` runs them, on the model built from `conf/model/<name>.yaml` with
random weights and random prompts of `--prompt` tokens, into a serving cache of max(`--rows`) rows:

- allocate: the staged policy and its decode state (`Engine.stage`);
- prefill: the prompts' forward and first token (`Engine.prefill`);
- adopt: the copies into the rows (`Engine.adopt`);
- admit: the whole `Engine.admit`, as `serve` calls it.

Each part has two times, the best of `--repeats`: `host_ms`, until its Python returns (the kernels
enqueued), and `wall_ms`, until the device has run them too. A part whose two times agree waits on
the host (launch overhead); one whose wall time is longer waits on the device. `--profile N` also
prints torch.profiler's table of one admission of N rows, by device time. `--prefill` times the
prompt forward eagerly (`eager`, the default), through `torch.compile` (`compiled`,
`engine.compile_prefill`, on a GPU), or both in turn in one process, the compiled graphs built
before any timing. Configs are composed by Hydra (`evals.configs`): install hydra-core where the
GPU image lacks it.
"""

from __future__ import annotations

import argparse
import time

import pandas as pd
import torch

from evals.bench.common import bench_engine, bench_model, method_policy, random_prompts, run
from longflow.config import GenerationConfig
from longflow.engine import DecodeState, Engine, synchronize
from longflow.models import resolve_device

PARTS = ("allocate", "prefill", "adopt", "admit")
PREFILLS = ("eager", "compiled")


def timed_parts(engine: Engine, cache, state: DecodeState, prompts: list[list[int]], length: int,
                generation: GenerationConfig) -> dict[str, tuple[float, float]]:
    """{part: (host seconds, wall seconds)} of one admission of `prompts` into the first rows."""
    rows = list(range(len(prompts)))
    seeds, limits = rows, [generation.max_new_tokens] * len(rows)
    times = {}

    def run(part, call):
        synchronize(engine.device)
        start = time.perf_counter()
        value = call()
        host = time.perf_counter() - start
        synchronize(engine.device)
        times[part] = (host, time.perf_counter() - start)
        return value

    input_ids, pad = engine.batch_inputs(prompts)
    staged, staged_state = run("allocate", lambda: engine.stage(seeds, limits, length, generation,
                                                                track_seen=state.seen is not None))
    run("prefill", lambda: engine.prefill(staged, staged_state, input_ids, pad, generation))
    run("adopt", lambda: engine.adopt(cache, state, rows, staged, staged_state))
    run("admit", lambda: engine.admit(cache, state, rows, prompts, seeds, limits, length, generation))
    return times


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3_8b")
    parser.add_argument("--method", default="longflow", help="a method config of conf/method/")
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens of every item")
    parser.add_argument("--new", type=int, default=2048, help="max_new_tokens the caches are allocated for")
    parser.add_argument("--rows", default="1,2,4,8,16", help="rows admitted at once, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="admissions per row count; the best is kept")
    parser.add_argument("--profile", type=int, default=0, help="print torch.profiler's table of an admission "
                                                                "of this many rows (0: none)")
    parser.add_argument("--prefill", default="eager", help="eager, compiled or both (eager,compiled)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default=None, help="CSV path (default: print only)")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.rows.split(",")]
    if min(counts) < 1 or args.repeats < 1:
        parser.error("--rows and --repeats take positive numbers")
    prefills = args.prefill.split(",")
    if not prefills or not set(prefills) <= set(PREFILLS):
        parser.error(f"--prefill takes {', '.join(PREFILLS)} or both, got {args.prefill!r}")

    if "compiled" in prefills and resolve_device(args.device).type != "cuda":
        parser.error("--prefill compiled needs a GPU: the engine compiles on CUDA only")
    model, _, device = bench_model(args.model, args.device)
    batch = max(counts + [args.profile])
    rows = []
    for prefill in prefills:
        engine = bench_engine(model, method_policy(args.method, args.budget), batch_size=batch,
                              compile_prefill=prefill == "compiled")
        rows += [{"prefill": prefill, **row} for row in admissions(engine, counts, batch, args)]
    table = pd.DataFrame(rows)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{args.model} (random weights), {args.method} at {args.budget} slots, prompt {args.prompt}, on {gpu}")
    print(table.pivot(index=["prefill", "rows"], columns="part", values=["host_ms", "wall_ms"])
          .reindex(columns=PARTS, level=1).round(1).to_string())
    if args.out:
        table.assign(model=args.model, method=args.method, budget=args.budget, prompt=args.prompt,
                     device=gpu).to_csv(args.out, index=False)
        print(f"wrote {args.out}")
    return table


def admissions(engine: Engine, counts: list[int], batch: int, args) -> list[dict]:
    """The best of `args.repeats` timed admissions of each count of rows into a serving cache of
    `batch` rows, after admissions of one and of two rows that build what the timed ones reuse (the
    compiled prompt forward's graphs among them); with `args.profile`, its table printed."""
    device = engine.device
    generation = GenerationConfig(max_new_tokens=args.new, ignore_eos=True)
    prompts = random_prompts(batch, args.prompt, engine.vocab)
    length = engine.batch_inputs(prompts[:1])[0].shape[1]
    cache = engine.new_cache(engine.policy_factory, batch, length, generation)
    state = DecodeState(batch, args.new, engine.vocab, [0] * batch, engine.pad_id, device, track_seen=False,
                        finished=True)
    cache.policy.begin_serving(state.positions)
    rows = []
    with torch.inference_mode():
        for count in sorted({1, min(2, batch)}):  # warm-up
            timed_parts(engine, cache, state, prompts[:count], length, generation)
        for count in counts:
            runs = [timed_parts(engine, cache, state, prompts[:count], length, generation)
                    for _ in range(args.repeats)]
            for part in PARTS:
                rows.append({"rows": count, "part": part, "host_ms": min(r[part][0] for r in runs) * 1e3,
                             "wall_ms": min(r[part][1] for r in runs) * 1e3})
        if args.profile:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            admitted = list(range(args.profile))
            with torch.profiler.profile(activities=activities) as profiler:
                engine.admit(cache, state, admitted, prompts[:args.profile], admitted, [args.new] * args.profile,
                             length, generation)
                synchronize(device)
            sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
            print(profiler.key_averages().table(sort_by=sort, row_limit=20))
    return rows


if __name__ == "__main__":
    run(main)
