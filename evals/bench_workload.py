"""Evaluation-throughput benchmark: a queue of items with realistic output lengths, static batches
against continuous batching.

    python -m evals.bench_workload --model qwen3_8b --methods longflow,vanilla --budget 1024 --batch 64 --items 512
    python -m evals.bench_workload --model tiny_qwen3 --items 8 --batch 2 --median 8 --cap 16 --prompt 16

Reasoning outputs run from a few hundred tokens to the generation cap. Each item's output length
is drawn from a log-normal distribution (median `--median`, spread set so that a share `--at-cap`
of the draws reaches `--cap`, where they are cut), and its row stops there (EOS is ignored). The
model is built from `conf/model/<name>.yaml` with random weights and fed random prompts of
`--prompt` tokens. The same queue, in the same order, runs twice per method:

- static: batches of `--batch` items in queue order (`Engine.generate`), each until its longest row;
- continuous: `--batch` rows refilled as they finish (`Engine.serve`).

Printed and written to `--out` (CSV): wall time, items per hour and useful tokens/s (the drawn
lengths, not the padding steps) of each, and the ratio. No Hydra: the GPU image lacks it.
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from evals.configs import method_config, model_spec
from longflow.config import EngineConfig, GenerationConfig
from longflow.engine import Engine, synchronize
from longflow.methods import build_policy
from longflow.models import load_model, resolve_device


def normal_quantile(probability: float) -> float:
    """The standard normal quantile, by bisection on `math.erf`: the standard library has the CDF but
    not its inverse, and one number needs no SciPy."""
    low, high = -10.0, 10.0
    for _ in range(100):
        middle = (low + high) / 2
        if 0.5 * (1 + math.erf(middle / math.sqrt(2))) < probability:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def output_lengths(items: int, median: int, cap: int, at_cap: float, seed: int) -> list[int]:
    """`items` lengths from a log-normal of median `median` whose share `at_cap` lies at or above
    `cap`, cut to [1, cap]."""
    if not 0 < at_cap < 0.5 or not 1 <= median < cap:
        raise ValueError(f"need 0 < at_cap < 0.5 and 1 <= median < cap, got {at_cap}, {median}, {cap}")
    sigma = math.log(cap / median) / normal_quantile(1 - at_cap)
    draws = np.random.default_rng(seed).lognormal(math.log(median), sigma, items)
    return np.clip(np.round(draws), 1, cap).astype(int).tolist()


def timed(run):
    """(what `run()` returns, its wall seconds), device-synchronised."""
    synchronize_all()
    start = time.perf_counter()
    value = run()
    synchronize_all()
    return value, time.perf_counter() - start


def synchronize_all() -> None:
    if torch.cuda.is_available():
        synchronize(torch.device("cuda"))


def run_static(engine: Engine, prompts, lengths, generation, batch: int) -> list[int]:
    """Static batches in queue order; returns the tokens each item generated."""
    tokens = []
    for start in range(0, len(prompts), batch):
        rows = range(start, min(start + batch, len(prompts)))
        result = engine.generate([prompts[i] for i in rows], generation, list(rows),
                                 limits=[lengths[i] for i in rows])
        tokens += [len(t) for t in result.tokens]
    return tokens


def run_continuous(engine: Engine, prompts, lengths, generation) -> list[int]:
    """Continuous batching over the queue; returns the tokens each item generated, in queue order."""
    tokens = [0] * len(prompts)
    for round_ in engine.serve(prompts, generation, list(range(len(prompts))), limits=lengths):
        for item in round_.finished:
            tokens[item.index] = len(item.tokens)
    return tokens


def bench_method(model, method: str, budget: int, prompts, lengths, batch: int, cap: int) -> list[dict]:
    policy = build_policy(method_config(method), None if method == "vanilla" else budget)
    engine = Engine(model, lambda: copy.deepcopy(policy), eos_ids=[], pad_id=0,
                    config=EngineConfig(batch_size=batch))
    generation = GenerationConfig(max_new_tokens=cap, ignore_eos=True)
    engine.warm_up()
    useful = sum(lengths)
    rows = []
    for mode, run in (("static", lambda: run_static(engine, prompts, lengths, generation, batch)),
                      ("continuous", lambda: run_continuous(engine, prompts, lengths, generation))):
        generated, seconds = timed(run)
        if generated != lengths:
            raise RuntimeError(f"{method} {mode}: rows did not stop at their drawn lengths")
        rows.append({"method": method, "budget": None if method == "vanilla" else budget, "mode": mode,
                     "seconds": seconds, "items_per_hour": len(prompts) / seconds * 3600,
                     "useful_tokens_per_s": useful / seconds})
        print(f"{method} {mode}: {seconds:.1f} s, {rows[-1]['items_per_hour']:.0f} items/hour, "
              f"{rows[-1]['useful_tokens_per_s']:.0f} useful tokens/s", flush=True)
    rows[-1]["speedup"] = rows[-1]["items_per_hour"] / rows[-2]["items_per_hour"]
    return rows


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3_8b")
    parser.add_argument("--methods", default="longflow", help="comma-separated method configs of conf/method/")
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64, help="rows decoding together")
    parser.add_argument("--items", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens of every item")
    parser.add_argument("--median", type=int, default=2500, help="median output length")
    parser.add_argument("--cap", type=int, default=8192, help="longest output (max_new_tokens)")
    parser.add_argument("--at-cap", type=float, default=0.2, help="share of drawn lengths at or above the cap")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default="results/bench_workload.csv")
    args = parser.parse_args(argv)

    spec = model_spec(args.model, weights="random")
    device = resolve_device(args.device)
    model, _ = load_model(spec, device)
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(args.seed)
    # Ids from the lower half of the vocabulary, away from the special ids at its top.
    prompts = torch.randint(0, vocab // 2, (args.items, args.prompt), generator=generator).tolist()
    lengths = output_lengths(args.items, args.median, args.cap, args.at_cap, args.seed)
    print(f"{args.items} items, output lengths: mean {np.mean(lengths):.0f}, median {np.median(lengths):.0f}, "
          f"{np.mean(np.array(lengths) == args.cap):.0%} at the cap of {args.cap}", flush=True)

    rows = []
    for method in args.methods.split(","):
        rows += bench_method(model, method, args.budget, prompts, lengths, args.batch, args.cap)
    table = pd.DataFrame(rows)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\n{args.model} (random weights), {args.items} items, batch {args.batch}, prompt {args.prompt}, "
          f"output lengths log-normal (median {args.median}, {args.at_cap:.0%} at the cap {args.cap}), on {gpu}")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    setting = dict(model=args.model, items=args.items, batch=args.batch, prompt=args.prompt, median=args.median,
                   cap=args.cap, at_cap=args.at_cap, mean_length=float(np.mean(lengths)), device=gpu)
    table.assign(**setting).to_csv(out, index=False)
    print(f"wrote {out}")
    return table


if __name__ == "__main__":
    main()
