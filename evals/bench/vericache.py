"""VeriCache's cost model: a draft step, a verify round and a replay step, timed, and the ms per token
they make at a given acceptance, against the full cache and the compressor alone.

    python -m evals.bench.vericache --model qwen3_8b --batch 1,16,64 --prompt 512 --new 1024 \
        --budget 1024 --methods h2o,longflow,streaming --runs results/canary --canary-budget 192
    python -m evals.bench.vericache --model tiny_qwen3 --batch 2 --prompt 16 --new 24 --budget 16 --horizon 4

Random weights (no download) accept almost no drafts, so the rounds are timed for their parts, not
for their throughput: per method and batch size, one run of `--new` tokens after a `--prompt`-token
prompt with `verify=vericache` gives the median draft step (the method's ordinary decode step), the
median verify forward (h + 1 tokens over the full cache) and the median replay step; a run of the
method alone and one of the full cache give their median decode steps. The projected ms per
generated token at a mean acceptance a (drafts accepted per round, docs/engine.md) is

    (h * draft + verify + replay(a) * replay_step) / (a + 1),   replay(a) = a + 1 (1 when a = h),

for each `--acceptance` value and, with `--runs`, at the acceptance each method reached in the
runs found there (`accepted_per_round` of its `verify=vericache` run at `--canary-budget`, e.g. the
canary's). Snapshot and restore of the compressed state are the rest of a round (`other_ms`).
Writes a CSV beside the printed table.
"""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd

from evals.bench.common import (
    COMPILE_SETTINGS,
    bench_engine,
    bench_model,
    method_policy,
    random_prompts,
    run,
    save_table,
    write_table,
)
from longflow.config import GenerationConfig, VerifyConfig


def median_ms(seconds: list[float]) -> float:
    return float(np.median(seconds) * 1e3) if seconds else float("nan")


def projected_ms(draft: float, verify: float, replay: float, horizon: int, accepted: float) -> float:
    """ms per generated token at a mean of `accepted` drafts per round (the module's formula)."""
    replays = 1.0 if accepted >= horizon else accepted + 1.0
    return (horizon * draft + verify + replays * replay) / (accepted + 1.0)


def step_ms(model, method: str, budget: int | None, prompts, new_tokens: int, verify: VerifyConfig | None = None,
            compile_step: str = "on"):
    """(the engine's result, median seconds per decode step or round) of one run after a warm-up."""
    policy = method_policy(method, budget)
    engine = bench_engine(model, policy, verify, batch_size=len(prompts), **COMPILE_SETTINGS[compile_step])
    seeds = list(range(len(prompts)))
    engine.generate(prompts, GenerationConfig(max_new_tokens=2 * (verify.horizon + 1) if verify else 4,
                                              ignore_eos=True), seeds)
    result = engine.generate(prompts, GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True), seeds)
    return result, median_ms(result.step_seconds)


def canary_acceptance(runs: str | None, budget: int | None) -> dict[str, float]:
    """method -> `accepted_per_round` of its `verify=vericache` run at `budget` under `runs` (newest)."""
    if runs is None:
        return {}
    from evals.report.runs import collect

    found = collect(runs)
    if found.empty or "verify" not in found:
        return {}
    found = found[(found["verify"] == "vericache") & (found["budget"] == budget)].sort_values("mtime")
    return dict(zip(found["method"], pd.to_numeric(found["accepted_per_round"], errors="coerce"), strict=True))


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(prog="python -m evals.bench.vericache", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3_8b")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch", default="1,16,64", help="batch sizes, comma-separated")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=1024, help="tokens generated per run (the run's length)")
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--methods", default="h2o,longflow,streaming")
    parser.add_argument("--horizon", type=int, default=25)
    parser.add_argument("--full-cache", default="gpu", choices=("gpu", "host"))
    parser.add_argument("--acceptance", default="0,5,10,15,20,25",
                        help="mean drafts accepted per round to project at (values above --horizon are dropped)")
    parser.add_argument("--runs", default=None, help="a runs folder whose vericache runs give each method's acceptance")
    parser.add_argument("--canary-budget", type=int, default=None, help="the budget of those runs to read")
    parser.add_argument("--compile", default="on", choices=tuple(COMPILE_SETTINGS),
                        help="the decode forward as the engine compiles it (on), eager (off: no compilation per "
                             "batch size, 40-55 s each on an H200), or with or without Inductor's tuning")
    parser.add_argument("--out", default="results/bench/vericache.csv")
    args = parser.parse_args(argv)

    model, _, device = bench_model(args.model, args.device)
    vocab = model.config.get_text_config().vocab_size
    verify = VerifyConfig(name="vericache", horizon=args.horizon, full_cache=args.full_cache)
    levels = [float(a) for a in args.acceptance.split(",") if float(a) <= args.horizon]
    measured = canary_acceptance(args.runs, args.canary_budget)
    setting = {"model": args.model, "prompt": args.prompt, "new": args.new, "compile": args.compile,
               "device": str(device)}
    rows = []
    for batch in [int(b) for b in args.batch.split(",")]:
        prompts = random_prompts(batch, args.prompt, vocab)
        _, vanilla = step_ms(model, "vanilla", None, prompts, args.new, compile_step=args.compile)
        for method in args.methods.split(","):
            _, alone = step_ms(model, method, args.budget, prompts, args.new, compile_step=args.compile)
            result, round_ms = step_ms(model, method, args.budget, prompts, args.new, verify, args.compile)
            parts = result.round_seconds
            draft, check, replay = median_ms(parts.draft), median_ms(parts.verify), median_ms(parts.replay)
            replays = len(parts.replay) / max(1, len(result.step_seconds))
            row = {
                "method": method, "budget": args.budget, "batch": batch, "horizon": args.horizon,
                "vanilla_step_ms": vanilla, "compressor_step_ms": alone, "draft_ms": draft, "verify_ms": check,
                "replay_ms": replay, "round_ms": round_ms,
                "other_ms": round_ms - args.horizon * draft - check - replays * replay,
                "transfer_s": parts.transfer,
            }
            for accepted in levels:
                row[f"ms_per_token_a{accepted:g}"] = projected_ms(draft, check, replay, args.horizon, accepted)
            if method in measured:
                accepted = float(measured[method])
                row["canary_accepted"] = accepted
                row["ms_per_token_canary"] = projected_ms(draft, check, replay, args.horizon, accepted)
                row["speedup_vs_vanilla"] = vanilla / row["ms_per_token_canary"]
            rows.append(row)
            save_table(pd.DataFrame(rows), args.out, setting)
    table = pd.DataFrame(rows)
    write_table(table, args.out, f"VeriCache on {args.model} (random weights), prompt {args.prompt}, "
                f"{args.new} new tokens, ms", setting)
    return table


if __name__ == "__main__":
    run(main)
