"""Table 1's generation time on one GPU, projected with and without `reuse_full_cache`.

    python -m evals.bench.projection                       # from the assumed output lengths below
    python -m evals.bench.projection --runs results/runs   # from the full cache's own runs, once they exist

Per dataset run, the decode steps of continuous batching (`evals.bench.workload.continuous_schedule`,
the engine's rule: 64 rows, refilled 4 at a time, finished rows found every 16 steps) over the
items a method generates, times its measured step time; prefill and grading are left out. With
reuse, a method generates only the items whose full-cache record it cannot copy, by its own rule
(`KVPolicy.compresses_within`, at Table 1's budget, on the model's shapes) or, for `lf_repo`, the
authors' (`evals.reuse.LF_REPO_BELOW`). The full cache generates everything in both.

Lengths: `--runs` reads the prompt and output length of every record of the full cache's Table 1
runs (R1-Distill-Llama-8B, generation lf_repo). Without it, ASSUMED: no output lengths of that
model are measured in this repository yet, so each dataset's outputs are drawn from a log-normal
(`evals.bench.workload.output_lengths`) of the median and share at the 8192 cap listed there, and
every prompt has the length listed (the lf_repo protocol cuts prompts to 1000 tokens).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from evals.bench.workload import continuous_schedule, output_lengths, static_steps
from evals.configs import method_config, model_spec
from evals.reuse import LF_REPO_BELOW
from evals.store import GENERATIONS, METRICS, peek_records
from longflow.methods import build_policy
from longflow.policy import ALIGN, CacheSpec, round_up

BUDGET = 2400
CAP = 8192  # generation lf_repo's max_new_tokens
MODEL = "r1_distill_llama_8b"
ROWS, CHECK_EVERY, REFILL_ROWS = 64, 16, 4  # conf/config.yaml's engine
# (items, prompt tokens, median output tokens, share at the cap) per dataset. Items: the benchmarks'
# sizes. Prompts: the question plus the authors' system prompt and the chat template. Outputs: an
# assumption, chosen to agree with the observation that at budget 2400 most GSM8K answers
# and many MATH-500 and Minerva answers stay below the budget, and that the competition sets
# (AIME, AMC, OlympiadBench) and GPQA mostly think past it.
ASSUMED = {
    "gsm8k": (1319, 150, 900, 0.02), "math500": (500, 150, 2400, 0.10), "minerva": (272, 200, 2400, 0.10),
    "amc": (40, 200, 4500, 0.25), "olympiad": (675, 250, 4500, 0.25), "gpqa": (198, 300, 4500, 0.25),
    "aime24": (30, 200, 6500, 0.40), "aime25": (30, 200, 6500, 0.40),
}
# Milliseconds per decode step at batch 64: LongFlow's measured on the R1-Distill-Llama-8B
# architecture (docs/protocol.md, "Table 1's cost"), the others by their step-time ratio to LongFlow measured on
# Qwen3-8B (results/bench_decode_qwen3_8b.csv, run a); the full cache's, reading every allocated
# slot, extrapolated from its KV-read time (an upper bound since it reads only the filled ones).
MS_PER_STEP = {"vanilla": 30.0, "longflow": 13.9, "streaming": 13.9 * 1.167, "h2o": 13.9 * 1.209,
               "vatp": 13.9 * 1.245, "rkv": 13.9 * 1.077}


def assumed_lengths(seed: int = 0) -> dict[str, list[tuple[int, int]]]:
    """(prompt tokens, output tokens) of every item of each dataset, under ASSUMED."""
    return {name: [(prompt, length) for length in output_lengths(items, median, CAP, at_cap, seed)]
            for name, (items, prompt, median, at_cap) in ASSUMED.items()}


def measured_lengths(runs: Path) -> dict[str, list[tuple[int, int]]]:
    """(prompt tokens, output tokens) of every generated record of the full cache's Table 1 runs."""
    lengths: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for path in sorted(runs.glob(f"*/{METRICS}")):
        metrics = json.loads(path.read_text())
        if (metrics.get("method"), metrics.get("model"), metrics.get("generation")) != ("vanilla", MODEL, "lf_repo"):
            continue
        for record in peek_records(path.parent / GENERATIONS):
            if record.get("output_tokens"):
                lengths[metrics["dataset"]].append((record["prompt_tokens"], record["output_tokens"]))
    return dict(lengths)


def copy_rule(method: str, variant: str, mode: str):
    """`(prompt tokens, output tokens) -> bool`: whether `method` copies the full cache's record of
    an item of these lengths under `mode`."""
    if mode == "lf_repo":
        return lambda prompt, output: output < LF_REPO_BELOW
    policy = build_policy({**method_config(method), "variant": variant}, BUDGET)
    shape = model_spec(MODEL).architecture

    def copies(prompt: int, output: int) -> bool:
        spec = CacheSpec(batch=1, layers=shape["num_hidden_layers"], q_heads=shape["num_attention_heads"],
                         kv_heads=shape["num_key_value_heads"], head_dim=shape["head_dim"],
                         prompt_len=round_up(prompt, ALIGN), max_new_tokens=CAP, dtype=None, device=None)
        return not policy.compresses_within(prompt, prompt + output, spec)

    return copies


def hours(method: str, lengths: dict[str, list[tuple[int, int]]], copies, static: bool) -> tuple[float, float]:
    """(hours of generation, share of items copied) of `method` over every dataset; `copies`: a
    `copy_rule`, or None to generate everything; `static`: in static batches (`engine.continuous=false`)."""
    steps, items, generated = 0, 0, 0
    for pairs in lengths.values():
        # In the pipeline's order: longest prompt first (equal prompts keep the dataset's order).
        todo = [output for prompt, output in sorted(pairs, key=lambda pair: -pair[0])
                if copies is None or not copies(prompt, output)]
        items, generated = items + len(pairs), generated + len(todo)
        if todo:
            steps += (static_steps(todo, ROWS, CAP, CHECK_EVERY) if static
                      else continuous_schedule(todo, ROWS, CHECK_EVERY, REFILL_ROWS)[0])
    return steps * MS_PER_STEP[method] / 3.6e6, 1 - generated / items


def projection(lengths: dict[str, list[tuple[int, int]]], variant: str, mode: str, static: bool) -> list[dict]:
    """One row per Table 1 method: hours without reuse and with `mode`, share of items copied."""
    rows = []
    for method in MS_PER_STEP:
        alone, _ = hours(method, lengths, None, static)
        if method == "vanilla":
            rows.append({"method": method, "hours": alone, "hours_reused": alone, "copied": 0.0})
            continue
        with_reuse, copied = hours(method, lengths, copy_rule(method, variant, mode), static)
        rows.append({"method": method, "hours": alone, "hours_reused": with_reuse, "copied": copied})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, help="runs folder with the full cache's Table 1 runs (default: ASSUMED)")
    parser.add_argument("--variant", default="lf_repo", choices=("lf_repo", "paper"))
    parser.add_argument("--mode", default="exact", choices=("exact", "lf_repo"))
    parser.add_argument("--static", action="store_true", help="static batches (engine.continuous=false)")
    args = parser.parse_args(argv)
    lengths = measured_lengths(args.runs) if args.runs else assumed_lengths()
    rows = projection(lengths, args.variant, args.mode, args.static)
    print(f"{'method':<10} {'hours':>6} {'with reuse':>10} {'copied':>7}")
    for row in rows:
        print(f"{row['method']:<10} {row['hours']:>6.2f} {row['hours_reused']:>10.2f} {row['copied']:>7.1%}")
    print(f"{'total':<10} {sum(r['hours'] for r in rows):>6.2f} {sum(r['hours_reused'] for r in rows):>10.2f}")


if __name__ == "__main__":
    main()
