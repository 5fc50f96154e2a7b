"""Evaluation-throughput benchmark: a queue of items with realistic output lengths, static batches
against continuous batching.

    python -m evals.bench.workload --model qwen3_8b --methods longflow,vanilla --budget 1024 --batch 64 --items 512
    python -m evals.bench.workload --model tiny_qwen3 --items 8 --batch 2 --median 8 --cap 16 --prompt 16
    python -m evals.bench.workload --combine static_a.csv static_b.csv continuous.csv --out results/bench_workload.csv

Reasoning outputs run from a few hundred tokens to the generation cap. Each item's output length
is drawn from a log-normal distribution (median `--median`, spread set so that a share `--at-cap`
of the draws reaches `--cap`, where they are cut), and its row stops there (EOS is ignored). The
model is built from `conf/model/<name>.yaml` with random weights and fed random prompts of
`--prompt` tokens. The same queue, in the same order, runs twice per method:

- static: batches of `--batch` items in queue order (`Engine.generate`), each until its longest row;
- continuous: `--batch` rows refilled as they finish (`Engine.serve`).

`--modes` runs one of them alone, for a scale whose two runs outlast one sitting (the ratio then
comes from two processes), and `--static-batches START:STOP` a range of the static run's batches,
for a static run that alone outlasts one; `--combine` adds the parts' tables up into the setting's
table (each mode's seconds, steps and tokens summed, the rates and the speedup recomputed), and
refuses parts of different settings or static ranges that miss or repeat a batch.

Printed and written to `--out` (CSV): wall time, items per hour and useful tokens/s (the drawn
lengths, not the padding steps) of each, and the ratio; and where the time went: decode steps
(with the count the engine's rules predict, `predicted_steps`), ms per step, prefill seconds and
the rest (graph captures, host checks). `--compile-prefill` compiles the prompt forwards
(`engine.compile_prefill`), and `--overlap-admissions` prefills admissions beside the decoding
rows' next round (`engine.overlap_admissions`; its `prefill_seconds` are then what the admissions
add to the rounds' time), for the admissions' share. `--predict` prints the predicted step
counts alone, and the number of admissions (prefills of refilled rows) continuous batching makes,
with no model; with `--refill-rows 1,2,4,8` for each value, the trade-off of refilling sooner
(fewer idle row-steps) against prefilling fewer rows at a time (more admissions, each with a fixed
cost). Configs are composed by Hydra (`evals.configs`): install hydra-core where the GPU image
lacks it.
"""

from __future__ import annotations

import argparse
import math
import time
from collections import deque
from collections.abc import Callable

import numpy as np
import pandas as pd
import torch

from evals.bench.common import bench_engine, bench_model, method_policy, random_prompts, run, save_table, write_table
from longflow.config import EngineConfig, GenerationConfig
from longflow.engine import Engine, synchronize


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


def timed(run, device: torch.device):
    """(what `run()` returns, its wall seconds), device-synchronised."""
    synchronize(device)
    start = time.perf_counter()
    value = run()
    synchronize(device)
    return value, time.perf_counter() - start


def run_static(engine: Engine, prompts, lengths, generation, batch: int) -> tuple[list[int], int, float, float]:
    """Static batches of `batch` items in the order of `prompts`; returns (the tokens each item
    generated, decode steps, prefill seconds, decode-step seconds)."""
    tokens, steps, prefill, decode = [], 0, 0.0, 0.0
    for start in range(0, len(prompts), batch):
        rows = range(start, min(start + batch, len(prompts)))
        result = engine.generate([prompts[i] for i in rows], generation, list(rows),
                                 limits=[lengths[i] for i in rows])
        tokens += [len(t) for t in result.tokens]
        steps, prefill, decode = steps + len(result.step_seconds), prefill + result.prefill_seconds, \
            decode + sum(result.step_seconds)
    return tokens, steps, prefill, decode


def run_continuous(engine: Engine, prompts, lengths, generation) -> tuple[list[int], int, float, float]:
    """Continuous batching over the queue; returns what `run_static` does, tokens in queue order."""
    tokens, steps, prefill, decode = [0] * len(prompts), 0, 0.0, 0.0
    for round_ in engine.serve(prompts, generation, list(range(len(prompts))), limits=lengths):
        for item in round_.finished:
            tokens[item.index] = len(item.tokens)
        steps, prefill, decode = steps + len(round_.step_seconds), prefill + round_.prefill_seconds, \
            decode + sum(round_.step_seconds)
    return tokens, steps, prefill, decode


def predicted_steps(lengths: list[int], rows: int, cap: int, check_every: int, refill_rows: int) -> tuple[int, int]:
    """The decode steps of static batches and of continuous batching over `lengths`, by the engine's
    rules (`static_steps`, `continuous_schedule`)."""
    return static_steps(lengths, rows, cap, check_every), continuous_schedule(lengths, rows, check_every,
                                                                              refill_rows)[0]


def static_steps(lengths: list[int], rows: int, cap: int, check_every: int) -> int:
    """`Engine.generate`'s decode steps over `lengths` in batches of `rows`: a batch's steps run in
    chunks of `check_every` until every row has finished, at most cap - 1."""
    steps = 0
    for start in range(0, len(lengths), rows):
        longest = max(lengths[start:start + rows])
        steps += min(max(1, -(-(longest - 1) // check_every)) * check_every, cap - 1)
    return steps


def continuous_schedule(lengths: list[int], rows: int, check_every: int, refill_rows: int,
                        overlap: bool = False) -> tuple[int, list[int]]:
    """`Engine.serve`'s decode steps over `lengths`, and the rows each admission prefilled: rows are
    refilled once `refill_rows` are free (fewer when the queue holds fewer), each sequence's first
    token comes from its prefill, and finished rows are found at the next check. With `overlap`
    (`engine.overlap_admissions`), an admission made while some row decodes is prefilled beside the
    next round and its rows decode from the round after."""
    rows = min(rows, len(lengths))
    queue, left = deque(lengths), [None] * rows  # decode steps each row still owes
    steps, admissions = 0, []
    while True:
        free = [row for row in range(rows) if left[row] is None]
        pending = {}
        if queue and len(free) >= min(refill_rows, rows, len(queue)):
            admitted = free[:len(queue)]
            beside = overlap and any(owed is not None for owed in left)
            for row in admitted:
                owed = queue.popleft() - 1
                if beside:
                    pending[row] = owed
                else:
                    left[row] = owed
            admissions.append(len(admitted))
        if all(owed is None for owed in left):
            return steps, admissions
        steps += check_every
        left = [None if owed is None or owed <= check_every else owed - check_every for owed in left]
        for row, owed in pending.items():
            left[row] = owed


MODES = ("static", "continuous")
# The columns of a run's setting, which its parts must share (`combine`).
SETTING = ("model", "items", "batch", "refill_rows", "compile_prefill", "overlap_admissions", "prompt", "median",
           "cap", "at_cap", "seed", "mean_length", "device")
# What a run sums over its parts (`combine`); the rates are recomputed from them.
SUMMED = ("items_timed", "useful_tokens", "seconds", "decode_steps", "predicted_steps", "decode_seconds",
          "prefill_seconds", "other_seconds")


def batch_count(items: int, batch: int) -> int:
    """The static batches of a queue of `items`, the last one partial."""
    return -(-items // batch)


def batch_range(value: str, batches: int) -> range:
    """A `--static-batches` argument, `START:STOP` (either side may be left out), as the range of the
    queue's static batches it names, within its `batches`."""
    start, colon, stop = value.partition(":")
    if not colon:
        raise ValueError(f"--static-batches takes START:STOP, got {value!r}")
    chosen = range(batches)[slice(int(start) if start else None, int(stop) if stop else None)]
    if not chosen or chosen.step != 1:
        raise ValueError(f"--static-batches {value!r} names none of the queue's {batches} batches")
    return chosen


def rates(row: dict) -> dict:
    """`row` with its items per hour, useful tokens/s and ms per step from its sums."""
    return {**row, "items_per_hour": row["items_timed"] / row["seconds"] * 3600,
            "useful_tokens_per_s": row["useful_tokens"] / row["seconds"],
            "ms_per_step": row["decode_seconds"] / max(row["decode_steps"], 1) * 1e3}


def add_speedups(rows: list[dict]) -> list[dict]:
    """Each method's continuous row gets `speedup`, its items per hour over the static row's, whichever
    mode ran first."""
    by_key = {(row["method"], row["mode"]): row for row in rows}  # a run's methods share one budget
    for (method, mode), row in by_key.items():
        static = by_key.get((method, "static"))
        if mode == "continuous" and static is not None:
            row["speedup"] = row["items_per_hour"] / static["items_per_hour"]
    return rows


def bench_method(model, method: str, budget: int, prompts, lengths, batch: int, cap: int,
                 refill_rows: int = EngineConfig.refill_rows, modes: tuple[str, ...] = MODES,
                 compile_prefill: bool = False, static_batches: range | None = None,
                 on_row: Callable[[dict], None] | None = None, overlap_admissions: bool = False) -> list[dict]:
    """Rows of `modes` for one method, each handed to `on_row` as soon as it is measured.
    `static_batches`: the static run's batches of the queue (default every one), for a scale whose
    static run outlasts one sitting (`combine` adds them up)."""
    policy = method_policy(method, budget)
    engine = bench_engine(model, policy, batch_size=batch, refill_rows=refill_rows, compile_prefill=compile_prefill,
                          overlap_admissions=overlap_admissions)
    config = engine.config
    generation = GenerationConfig(max_new_tokens=cap, ignore_eos=True)
    engine.warm_up()
    static_batches = static_batches or range(batch_count(len(prompts), batch))
    static_items = slice(static_batches.start * batch, static_batches.stop * batch)
    static_prompts, static_lengths = prompts[static_items], lengths[static_items]
    runs = {"static": (lambda: run_static(engine, static_prompts, static_lengths, generation, batch), static_lengths,
                       static_steps(static_lengths, batch, cap, config.check_every)),
            "continuous": (lambda: run_continuous(engine, prompts, lengths, generation), lengths,
                           continuous_schedule(lengths, batch, config.check_every, config.refill_rows,
                                               overlap_admissions)[0])}
    rows = []
    for mode in modes:
        run, drawn, steps_expected = runs[mode]
        (generated, steps, prefill, decode), seconds = timed(run, engine.device)
        if generated != drawn:
            raise RuntimeError(f"{method} {mode}: rows did not stop at their drawn lengths")
        rows.append(rates({
            "method": method, "budget": policy.budget, "mode": mode,
            "static_batches": f"{static_batches.start}:{static_batches.stop}" if mode == "static" else None,
            "items_timed": len(drawn), "useful_tokens": sum(drawn), "seconds": seconds, "decode_steps": steps,
            "predicted_steps": steps_expected, "decode_seconds": decode, "prefill_seconds": prefill,
            "other_seconds": seconds - prefill - decode}))
        print(f"{method} {mode}: {seconds:.1f} s, {rows[-1]['items_per_hour']:.0f} items/hour, "
              f"{rows[-1]['useful_tokens_per_s']:.0f} useful tokens/s, {steps} decode steps", flush=True)
        if on_row is not None:
            on_row(rows[-1])
    return add_speedups(rows)


def combine(tables: list[pd.DataFrame]) -> pd.DataFrame:
    """The workload tables of one setting's parts (runs of one mode, static runs of disjoint batch
    ranges) as that setting's table: each method's mode summed over its parts, its rates recomputed,
    the speedup of continuous over static. Refuses parts of different settings, overlapping or missing
    static batches, and a mode run twice."""
    table = pd.concat(tables, ignore_index=True)
    setting = [column for column in SETTING if column in table]
    if len(table[setting].drop_duplicates()) != 1:
        raise ValueError(f"the parts are of different settings:\n{table[setting].drop_duplicates().to_string()}")
    batches = batch_count(int(table["items"].iloc[0]), int(table["batch"].iloc[0]))
    rows = []
    for (method, mode), parts in table.groupby(["method", "mode"], sort=False):
        if mode == "static":
            covered = sorted(index for value in parts["static_batches"] for index in batch_range(value, batches))
            if covered != list(range(batches)):
                raise ValueError(f"{method} static: the parts' batches {list(parts['static_batches'])} do not "
                                 f"cover the queue's {batches} batches once each")
        elif len(parts) != 1:
            raise ValueError(f"{method} {mode} was run {len(parts)} times")
        row = {"method": method, "budget": parts["budget"].iloc[0], "mode": mode,
               "static_batches": f"0:{batches}" if mode == "static" else None,
               **{column: parts[column].sum() for column in SUMMED}}
        rows.append(rates(row))
    methods = list(table["method"].unique())
    rows.sort(key=lambda row: (methods.index(row["method"]), MODES.index(row["mode"])))
    return pd.DataFrame(add_speedups(rows)).assign(**table[setting].iloc[0].to_dict())


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
    parser.add_argument("--refill-rows", default=str(EngineConfig.refill_rows),
                        help="engine.refill_rows; with --predict, several as 1,2,4,8 (default: the engine's)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="static, continuous or both (default), run in the order given: one mode alone "
                             "fits a scale whose two runs would outlast one sitting, and continuous,static "
                             "shows what running second does to a mode's step")
    parser.add_argument("--compile-prefill", action="store_true",
                        help="engine.compile_prefill: the prompt forwards through torch.compile (GPU only)")
    parser.add_argument("--overlap-admissions", action="store_true",
                        help="engine.overlap_admissions: admissions prefilled beside the decoding rows' next round")
    parser.add_argument("--static-batches", default=":",
                        help="START:STOP, the static run's batches of the queue (default every one): a static "
                             "run that outlasts one sitting runs in parts, which --combine adds up")
    parser.add_argument("--predict", action="store_true",
                        help="only print the decode steps each mode takes by the engine's rules, and the "
                             "admissions of continuous batching (no model)")
    parser.add_argument("--combine", nargs="+", metavar="CSV",
                        help="no run: the tables of one setting's parts (one mode each, static batch ranges) "
                             "as one table, written to --out")
    args = parser.parse_args(argv)
    if args.combine:
        table = combine([pd.read_csv(path) for path in args.combine])
        write_table(table, args.out, f"{len(args.combine)} parts combined", {}, decimals=2)
        return table
    lengths = output_lengths(args.items, args.median, args.cap, args.at_cap, args.seed)
    print(f"{args.items} items, output lengths: mean {np.mean(lengths):.0f}, median {np.median(lengths):.0f}, "
          f"{np.mean(np.array(lengths) == args.cap):.0%} at the cap of {args.cap}", flush=True)
    refills = [int(value) for value in args.refill_rows.split(",")]
    if args.predict:
        check_every = EngineConfig.check_every
        rows = []
        static = static_steps(lengths, args.batch, args.cap, check_every)
        for refill_rows in refills:
            continuous, admissions = continuous_schedule(lengths, args.batch, check_every, refill_rows,
                                                         args.overlap_admissions)
            print(f"decode steps at batch {args.batch}, refill_rows {refill_rows}: static {static}, continuous "
                  f"{continuous} ({static / continuous:.2f}x fewer), in {len(admissions)} admissions")
            rows += [{"refill_rows": refill_rows, "mode": "static", "predicted_steps": static, "admissions": None},
                     {"refill_rows": refill_rows, "mode": "continuous", "predicted_steps": continuous,
                      "admissions": len(admissions)}]
        return pd.DataFrame(rows)
    if len(refills) != 1:
        parser.error("--refill-rows takes one value unless --predict")
    modes = tuple(args.modes.split(","))
    if not modes or not set(modes) <= set(MODES) or len(set(modes)) != len(modes):
        parser.error(f"--modes takes static, continuous or both, got {args.modes!r}")
    try:
        static_batches = batch_range(args.static_batches, batch_count(args.items, args.batch))
    except ValueError as error:
        parser.error(str(error))

    model, spec, device = bench_model(args.model, args.device)
    prompts = random_prompts(args.items, args.prompt, model.config.get_text_config().vocab_size, args.seed)

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    setting = dict(model=args.model, items=args.items, batch=args.batch, refill_rows=refills[0],
                   compile_prefill=args.compile_prefill, overlap_admissions=args.overlap_admissions,
                   prompt=args.prompt, median=args.median, cap=args.cap,
                   at_cap=args.at_cap, seed=args.seed, mean_length=float(np.mean(lengths)), device=gpu)
    rows = []

    def keep(row: dict) -> None:  # the CSV after every row: a run stopped by a time limit keeps what it measured
        rows.append(row)
        save_table(pd.DataFrame(rows), args.out, setting)

    for method in args.methods.split(","):
        bench_method(model, method, args.budget, prompts, lengths, args.batch, args.cap, refill_rows=refills[0],
                     modes=modes, compile_prefill=args.compile_prefill, static_batches=static_batches, on_row=keep,
                     overlap_admissions=args.overlap_admissions)
    heading = (f"{args.model} (random weights), {args.items} items, batch {args.batch}, prompt {args.prompt}, "
               f"output lengths log-normal (median {args.median}, {args.at_cap:.0%} at the cap {args.cap}), on {gpu}")
    table = pd.DataFrame(add_speedups(rows))
    write_table(table, args.out, heading, setting, decimals=2)
    return table


if __name__ == "__main__":
    run(main)
