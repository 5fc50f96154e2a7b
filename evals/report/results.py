"""Every run in one long-format CSV, one row per run and metric, for your own analysis.

    python -m evals.results [--runs results/runs | --sweep DIR ...] [--out results/results.csv]
                            [--model M ...] [--method M ...] [--budget N ...] [--dataset D ...]
                            [--limit N ...] [--generation G]

Columns: the run's keys (`RUN_KEYS`: run_id, model, method, variant, budget, generation, dataset,
item counts and `item_set` (a hash of the item ids: a run reported over two item sets is two runs
here), complete, dirty (made by uncommitted code, `evals.report.provenance`), path), the run's settings
from its run.json (`evals.report.settings`: `model.hub_id`, `model.checkpoint`, ..., `method.<parameter>`,
`generation.<parameter>`, `template`, ...; empty for a run without one), then `metric`,
a numeric metrics.json key with nested keys joined by dots (accuracy, accuracy_stderr, pass_at_k.4,
tokens_per_second, step_latency_ms.p50, finish_reasons.length, grade_reasons.truncated, ...), and
`value`. Runs are read as for `evals.table` (`evals.report.runs`, the same filters), every run kept
(reruns and duplicates included: `run_id` and `path` tell them apart).
In pandas: `pd.read_csv(path).pivot_table(index=[...], columns="metric")`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from evals.report.console import show
from evals.report.runs import add_filters, load
from evals.report.settings import PREFIX, setting_columns
from longflow.errors import UserError, report

RUN_KEYS = ["run_id", "model", "hub_id", "method", "variant", "budget_mode", "budget", "generation", "dataset",
            "dataset_size", "n_planned", "item_set", "n_items", "n_samples", "complete", "dirty", "path"]
NOT_METRICS = {*RUN_KEYS, "mtime"}


def long_format(runs: pd.DataFrame) -> pd.DataFrame:
    """`collect`'s frame as one row per run and numeric metric (booleans and text are not metrics);
    missing values dropped. Sorted by run keys, then metric."""
    if runs.empty:
        raise UserError("no runs to write")
    configs = setting_columns(runs)
    keys = [key for key in RUN_KEYS if key in runs] + configs
    metrics = [column for column in runs.columns if column not in NOT_METRICS and column not in configs
               and pd.api.types.is_numeric_dtype(runs[column]) and not pd.api.types.is_bool_dtype(runs[column])]
    long = runs.melt(id_vars=keys, value_vars=metrics, var_name="metric", value_name="value")
    long = long.rename(columns={column: column.removeprefix(PREFIX) for column in configs})
    long = long.dropna(subset=["value"])
    long["value"] = long["value"].astype(float)
    return long.sort_values(["model", "method", "variant", "budget", "generation", "dataset", "run_id", "metric"],
                            na_position="first", kind="stable").reset_index(drop=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals.results", description=__doc__.splitlines()[0])
    add_filters(parser)
    parser.add_argument("--out", type=Path, default=Path("results/results.csv"), help="the CSV file to write")
    args = parser.parse_args(argv)
    try:
        long = long_format(load(args))
    except UserError as error:
        return report(error)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    long.to_csv(args.out, index=False)
    show(f"wrote {args.out}: {len(long)} rows, {long['run_id'].nunique()} runs, {long['metric'].nunique()} metrics")
    return 0


if __name__ == "__main__":
    sys.exit(main())
