"""Which cells of a table differ from the full cache, and which cannot be told from the best method:
paired bootstrap intervals (`evals.report.stats`) of each compressed cell's difference from FullKV's
cell of its column, and from the best cell of its budget block and column.

Frames here are indexed like a table's values (Model, Budget, Method, and Gen. when a row key) with
its columns (item sets, then "Avg."): `scores` holds each cell's `ItemScores` (None where the run has
no per-item records), and the results hold a `Difference` in the values' unit, or None.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from evals.report.stats import BootstrapConfig, Difference, ItemScores, mean_difference, paired_difference

METHOD_LEVEL = "Method"
BUDGET_LEVEL = "Budget"


@dataclass
class Comparisons:
    """Each compressed cell against FullKV (`vs_reference`) and against the best cell of its block and
    column (`vs_best`), and the marks they give: `differs` (the interval of the difference from
    FullKV excludes 0) and `near_best` (a cell other than the best whose interval from it includes 0).
    `missing`: how many candidate cells had no per-item records to compare."""

    config: BootstrapConfig
    vs_reference: pd.DataFrame
    vs_best: pd.DataFrame
    differs: pd.DataFrame
    near_best: pd.DataFrame
    missing: int


def scaled(difference: Difference, scale: float) -> Difference:
    return Difference(difference.estimate * scale, difference.low * scale, difference.high * scale,
                      difference.items)


def cell_difference(mine: pd.Series, theirs: pd.Series, column: str, columns: list[str], average_column: str | None,
                    config: BootstrapConfig, scale: float) -> Difference | None:
    """Row `mine`'s cell `column` minus row `theirs`'s (each row: `ItemScores` or None per item-set
    column, in the table's order). The "Avg." column is the mean of the differences over the item-set
    `columns` that `mine` has a value in, each dataset resampled apart; None when either row lacks
    per-item records of a cell it needs. Each item-set column draws on its own stream of the seed (its
    position), so that a cell and the Avg. over it share their draws."""
    needed = [column] if column != average_column else columns
    if not needed or not all(isinstance(mine[c], ItemScores) and isinstance(theirs[c], ItemScores) for c in needed):
        return None
    streams = [list(mine.index).index(c) for c in needed]
    if column != average_column:
        return scaled(paired_difference(mine[column], theirs[column], config, streams[0]), scale)
    return scaled(mean_difference([(mine[c], theirs[c]) for c in needed], config, streams), scale)


def reference_row(index: pd.MultiIndex, methods: pd.Series, key: tuple, reference: str) -> tuple | None:
    """The full cache's row for row `key`: the row of method `reference` that shares every row key
    but Budget and Method (the model, and the generation config when it is one)."""
    same = [position for position, name in enumerate(index.names) if name not in (METHOD_LEVEL, BUDGET_LEVEL)]
    for other in index:
        if methods[other] == reference and all(other[p] == key[p] for p in same):
            return other
    return None


def compare(values: pd.DataFrame, scores: pd.DataFrame, methods: pd.Series, candidate: pd.DataFrame,
            average_column: str | None, reference: str, config: BootstrapConfig, scale: float,
            decimals: int) -> Comparisons:
    """Comparisons of every candidate cell (`candidate`, bool like `values`: compressed, finished, over
    its column's items). The best of a block and column is its highest candidate as displayed
    (`decimals`), the first such row on a tie; it is not marked `near_best` itself.

    values: the table's numbers; scores: `ItemScores` or None per cell, item-set columns only (an
    "Avg." is over the columns where its row has a value); methods: the method key of each row;
    average_column: "Avg." when the table has one; scale: from the scores' unit to the values' (100
    for a fraction shown in percent)."""
    vs_reference = pd.DataFrame(None, index=values.index, columns=values.columns, dtype=object)
    vs_best = vs_reference.copy()
    items = list(scores.columns)

    def difference(key: tuple, other: tuple, column: str) -> Difference | None:
        present = [c for c in items if pd.notna(values.at[key, c])]
        return cell_difference(scores.loc[key], scores.loc[other], column, present, average_column, config, scale)

    for key in values.index[candidate.any(axis=1).to_numpy()]:
        other = reference_row(values.index, methods, key, reference)
        for column in values.columns[candidate.loc[key].to_numpy()] if other is not None else []:
            vs_reference.at[key, column] = difference(key, other, column)
    levels = [name for name in values.index.names if name != METHOD_LEVEL]
    for _, block in values.round(decimals).where(candidate).groupby(level=levels, sort=False):
        for column in block.columns:
            cells = block[column].dropna()
            if len(cells) > 1:
                best = cells.idxmax()
                for key in cells.index.drop(best):
                    vs_best.at[key, column] = difference(key, best, column)
    differs = vs_reference.map(lambda d: isinstance(d, Difference) and d.excludes_zero).astype(bool)
    near_best = vs_best.map(lambda d: isinstance(d, Difference) and not d.excludes_zero).astype(bool)
    missing = int(sum(not isinstance(scores.at[key, c], ItemScores)
                      for key in values.index for c in items if candidate.at[key, c]))
    return Comparisons(config, vs_reference, vs_best, differs, near_best, missing)
