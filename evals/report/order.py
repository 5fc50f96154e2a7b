"""Does the order of methods change from one dataset to another? Confident reversals of pairs of
methods between a reference item set and each other one, at each KV budget.

    python -m evals.report.order [--runs DIR | --sweep DIR ...] --reference state [--bootstrap 10000]
                                 [--out results/canary_suite/order] [filters as for evals.report.table]

For every budget, every other item set and every pair of compressed methods (a, b), the paired
bootstrap interval (`evals.report.stats`, items paired by id) of accuracy(a) - accuracy(b) on the
reference and on the other item set. A pair is a confident reversal when both intervals exclude 0
and their signs differ: a beats b on one with 95% confidence and b beats a on the other. Under no
change, each interval excludes 0 on the wrong side at most 2.5% of the time and the two item sets
are independent samples, so a listed reversal is a false one with probability about 0.025^2 per
pair (with 78 pairs of 13 methods, fewer than 0.05 expected per item set and budget). Also per item
set and budget: Spearman's rank correlation of the methods' accuracies with the reference's.

Writes `<out>.md` (one row per budget and item set: the correlation, the number of confident
reversals, the largest of them) and `<out>.csv` (every confident reversal with both intervals, in
points).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from evals.report.console import show
from evals.report.names import dataset_name
from evals.report.runs import REFERENCE, add_filters, item_ids, keep_newest, label, load
from evals.report.significance import scaled
from evals.report.stats import BootstrapConfig, Difference, ItemScores, paired_difference, run_accuracy_scores
from longflow.errors import UserError, report

SHOWN = 3  # reversals named per row of the markdown table, the largest first


@dataclass(frozen=True)
class Reversal:
    """Methods `a` and `b` at `budget`: a - b on the reference and on `dataset` (points)."""

    budget: str
    dataset: str
    a: str
    b: str
    on_reference: Difference
    on_dataset: Difference

    @property
    def size(self) -> float:
        """How clear the reversal is: the smaller of the two differences' magnitudes."""
        return min(abs(self.on_reference.estimate), abs(self.on_dataset.estimate))


def scored_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """The compressed runs, one per (model, budget, method label, dataset), with their per-item
    accuracy (`item_scores`); UserError when a run has no generations.jsonl records."""
    runs = label(runs[runs["method"] != REFERENCE])
    runs, _ = keep_newest(runs, ["model_label", "budget_label", "method_label", "dataset_label"])
    runs = runs.assign(item_scores=[run_accuracy_scores(path, items)
                                    for path, items in zip(runs["path"], item_ids(runs), strict=True)])
    lacking = runs[~runs["item_scores"].map(lambda s: isinstance(s, ItemScores))]
    if not lacking.empty:
        raise UserError(f"{len(lacking)} runs have no per-item records (generations.jsonl), "
                        f"e.g. {lacking['path'].iloc[0]}")
    return runs.sort_values(["budget_rank", "method_rank", "method_label"])


def reversals(runs: pd.DataFrame, reference: str, config: BootstrapConfig) -> tuple[list[Reversal], pd.DataFrame]:
    """Every confident reversal against the `reference` item set (a display name: "state"), and a
    summary row per (model, budget, other item set): Spearman's correlation with the reference, the
    pairs compared, the reversals."""
    found, rows = [], []
    for (model, budget), block in runs.groupby(["model_label", "budget_label"], sort=False):
        scores = block.pivot(index="method_label", columns="dataset_label", values="item_scores")
        accuracy = block.pivot(index="method_label", columns="dataset_label", values="accuracy").astype(float)
        if reference not in scores:
            raise UserError(f"no runs of {model} on the reference {reference!r} at budget {budget}")
        order = list(dict.fromkeys(block["method_label"]))
        on_reference: dict[tuple[str, str], Difference] = {}  # a pair's interval on the reference, drawn once
        for dataset in (d for d in dict.fromkeys(block["dataset_label"]) if d != reference):
            methods = [m for m in order if isinstance(scores.at[m, reference], ItemScores)
                       and isinstance(scores.at[m, dataset], ItemScores)]
            count = 0
            for a, b in itertools.combinations(methods, 2):
                if (a, b) not in on_reference:
                    on_reference[a, b] = paired_difference(scores.at[a, reference], scores.at[b, reference], config)
                there = on_reference[a, b]
                here = paired_difference(scores.at[a, dataset], scores.at[b, dataset], config)
                if there.excludes_zero and here.excludes_zero and (there.estimate > 0) != (here.estimate > 0):
                    count += 1
                    found.append(Reversal(budget, dataset, a, b, scaled(there, 100), scaled(here, 100)))
            # Spearman's rho: Pearson's correlation of the ranks (ties share their mean rank).
            correlation = accuracy.loc[methods, reference].rank().corr(accuracy.loc[methods, dataset].rank())
            rows.append({"model": model, "budget": budget, "dataset": dataset, "methods": len(methods),
                         "pairs": len(methods) * (len(methods) - 1) // 2, "spearman": correlation,
                         "confident_reversals": count})
    return found, pd.DataFrame(rows)


def interval_text(difference: Difference) -> str:
    return f"{difference.estimate:+.1f} [{difference.low:+.1f}, {difference.high:+.1f}]"


def render(found: list[Reversal], summary: pd.DataFrame, reference: str, config: BootstrapConfig) -> str:
    lines = [f"| model | budget | item set | methods | Spearman vs {reference} | confident reversals | largest "
             f"(a − b on {reference}; on the item set, points, {100 * config.confidence:g}% intervals) |",
             "| --- | ---: | --- | ---: | ---: | ---: | --- |"]
    for row in summary.itertuples(index=False):
        here = sorted((r for r in found if r.budget == row.budget and r.dataset == row.dataset),
                      key=lambda r: -r.size)[:SHOWN]
        named = "; ".join(f"{r.a} − {r.b}: {interval_text(r.on_reference)}; {interval_text(r.on_dataset)}"
                          for r in here) or "-"
        lines.append(f"| {row.model} | {row.budget} | {row.dataset} | {row.methods} | {row.spearman:.2f} | "
                     f"{row.confident_reversals} of {row.pairs} | {named} |")
    lines += ["", f"A confident reversal: both {100 * config.confidence:g}% paired bootstrap intervals of "
              f"accuracy(a) − accuracy(b) exclude 0, with opposite signs ({config.resamples} resamples, seed "
              f"{config.seed}; items paired by id)."]
    return "\n".join(lines) + "\n"


def table_of(found: list[Reversal]) -> pd.DataFrame:
    return pd.DataFrame([{"budget": r.budget, "dataset": r.dataset, "a": r.a, "b": r.b,
                          "reference_difference": r.on_reference.estimate, "reference_low": r.on_reference.low,
                          "reference_high": r.on_reference.high, "difference": r.on_dataset.estimate,
                          "low": r.on_dataset.low, "high": r.on_dataset.high} for r in found],
                        columns=["budget", "dataset", "a", "b", "reference_difference", "reference_low",
                                 "reference_high", "difference", "low", "high"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals.report.order", description=__doc__.splitlines()[0])
    add_filters(parser)
    parser.add_argument("--reference", required=True, help="the item set others are compared with (a dataset key "
                                                           "or display name: canary_state or state)")
    parser.add_argument("--bootstrap", type=int, default=BootstrapConfig.resamples, metavar="B")
    parser.add_argument("--seed", type=int, default=BootstrapConfig.seed)
    parser.add_argument("--out", type=Path, default=Path("results/order"), help="writes <out>.md and <out>.csv")
    args = parser.parse_args(argv)
    try:
        config = BootstrapConfig(resamples=args.bootstrap, seed=args.seed)
        found, summary = reversals(scored_runs(load(args)), dataset_name(args.reference), config)
    except UserError as error:
        return report(error)
    text = render(found, summary, dataset_name(args.reference), config)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    table_of(found).to_csv(args.out.with_suffix(".csv"), index=False)
    show(text)
    show(f"wrote {args.out.with_suffix('.md')}, {args.out.with_suffix('.csv')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
