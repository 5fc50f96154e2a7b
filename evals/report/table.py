"""The paper's Table 1 from run directories: rows grouped by KV budget, one column per item set.

    python -m evals.table [--runs results/runs | --sweep DIR ...] [--out results/table]
                          [--model M ...] [--method M ...] [--budget N ...] [--dataset D ...]
                          [--limit N ...] [--generation G] [--metric accuracy] [--stderr]
                          [--bootstrap B] [--paired-against fullkv|best] [--recall FILE.csv ...]
                          [--caption TEXT] [--label tab:x] [--wide]

Reads every run under the runs folder, or exactly the runs of a sweep over the items its jobs ran
(`--sweep`, its `sweep.json`), each run's metrics computed from its stored records over those items,
keeps those the filters select (`evals.report.runs`), one run per table cell (runs that differ in
a setting are rows of their own, labelled by it, `evals.report.settings`; of copies of one
configuration the newest by file mtime, said under the table), and writes `<out>.md`, `<out>.tex` (a LaTeX `table`
with booktabs rules and a caption) and `<out>.csv` (the same cells as raw numbers).

As in the paper: FullKV (the full cache, the reference) first, then one block of rows per KV budget,
methods in a fixed order. A column is one dataset over one set of items, its header giving how many
("GSM8K (8 of 1319)"): runs of other limits on the same dataset are other columns, never one. Bold
marks the best compressed method within each budget and column, compared only between cells over
the same items: a cell whose run is unfinished (a dagger, listed in a footnote) is not a candidate,
nor is FullKV, nor the "Avg." of a row that lacks a column its block has. "Avg." (with two columns
or more, of different datasets) is the mean over the columns a row has. A cell whose records were
made by uncommitted code (a Python source the start that made them ran differs from its commit,
`evals.report.provenance`) carries a double dagger (a line under the table says so instead when
every run was). A column without a FullKV run is named in a note.
Accuracy is shown in percent with one decimal. `--stderr` adds each cell's standard error
(`evals.metrics.accuracy_stderr`; for Avg., that of the mean of independent datasets, when every
cell of the row has one).

`--bootstrap B` compares runs item by item (`evals.report.stats`): for every compressed cell, the
95% paired bootstrap interval (B resamples of the items, seeded) of its difference from FullKV over
the same items, and of its difference from the best method of its budget and column. A `*` marks a
cell whose difference from FullKV excludes 0, a `≈` a cell that cannot be told from the best (its
interval includes 0); a line under the table says so. `--paired-against fullkv|best` also writes
that interval in each cell; the CSV has both intervals as columns. The per-item numbers come from
each run's generations.jsonl (accuracy) or from the recall file's JSON (recall metrics).

`--metric recall_layers` (or `recall_layer0`, `complete_items`) tabulates the dependency recall of
`evals.canary.recall` from its CSVs (`--recall results/canary_suite/recall/*.csv`, each `.json` beside
it for the bootstrap; `evals.report.recall_runs`), a cell per method, family and budget; without
`--recall` the runs' own metrics.json are read for that key.

A method variant other than "paper" is part of the method's name ("H2O (lf_repo)"); a generation
config becomes a row key ("Gen.") only when the selected runs have more than one. Where a method has
runs in both variants ("paper", its own paper's implementation, and "lf_repo", the LongFlow authors'),
a row "Δ H2O (paper − lf_repo)" follows them: how much of the score comes from the implementation.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from evals.report.console import show
from evals.report.names import DEFAULT_VARIANT, METHOD_NAMES
from evals.report.recall_runs import RECALL_METRICS, recall_frame
from evals.report.runs import (
    REFERENCE,
    add_filters,
    item_ids,
    items_sort_key,
    keep_newest,
    label,
    load,
    select_filtered,
)
from evals.report.settings import setting_columns
from evals.report.significance import Comparisons, compare
from evals.report.stats import BootstrapConfig, Difference, ItemScores, run_accuracy_scores
from longflow.errors import UserError, report

AUTHORS_VARIANT = "lf_repo"  # the LongFlow authors' implementation of a baseline
# Fractions, shown in percent.
PERCENT_PREFIXES = ("accuracy", "pass_at_k", "fidelity.agreement", "recall_", "complete_items")
LOWER_IS_BETTER = ("latency", "ttft", "memory", "seconds", "kv_slots", "fidelity.kl")  # substrings of metric names
AVG = "Avg."
DAGGER = "†"
DIRTY = "‡"
DIFFERS = "*"  # the interval of the difference from FullKV excludes 0
NEAR_BEST = "≈"  # the interval of the difference from the best method includes 0
MARKDOWN_MARKS = {DIFFERS: r"\*"}  # a bare * next to ** bold would be read as emphasis
LATEX_MARKS = {DIFFERS: r"$^{*}$", NEAR_BEST: r"$^{\approx}$"}
PAIRED_AGAINST = ("fullkv", "best")
LATEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                 "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
                 "Δ": r"$\Delta$", "−": r"$-$", "±": r"$\pm$", "†": r"$^\dagger$", "‡": r"$^\ddagger$",
                 "≈": r"$\approx$"}
ROW_KEYS = {"model_label": "Model", "budget_label": "Budget", "method_label": "Method", "generation": "Gen."}
METRIC_TITLES = {"accuracy": "Accuracy (%)", "tokens_per_second": "Throughput (tokens/s)",
                 "peak_kv_slots": "Peak KV slots", "mean_output_tokens": "Mean output length (tokens)",
                 "recall_layers": "Dependency recall, all layers (%)",
                 "recall_layer0": "Dependency recall, layer 0 (%)",
                 "complete_items": "Items with every read held (%)"}
BOLD_NOTE = ("bold: the best compressed method of its budget and column, among finished runs over the "
             "same items (a † cell covers fewer, and an Avg. over fewer columns is not compared)")


def is_percent(metric: str) -> bool:
    return metric.startswith(PERCENT_PREFIXES)


def lower_is_better(metric: str) -> bool:
    return any(word in metric for word in LOWER_IS_BETTER)


@dataclass
class Table:
    """A built table: numbers, and where each cell is bold, partial or dirty. All frames share the
    index (row keys, named as in the output: Model, Budget, Method, and Gen. when there are several)
    and the columns (item-set headers, then "Avg." when there is one)."""

    metric: str
    values: pd.DataFrame  # floats, in percent for accuracy-like metrics
    bold: pd.DataFrame  # bool
    partial: pd.DataFrame  # bool: an unfinished run, over fewer items than its column's
    dirty: pd.DataFrame  # bool: made by uncommitted code (`evals.report.provenance`)
    delta: pd.Series  # bool per row: a difference between two variants of a method, shown signed
    stderr: pd.DataFrame | None  # standard errors, in the values' unit (--stderr); NaN on difference rows
    footnotes: list[str]  # one line for the partial cells, one for the dirty ones, when there are any
    notes: list[str]  # what bold compares, missing FullKV runs, subsets, duplicates that were dropped
    decimals: int
    comparisons: Comparisons | None = None  # paired bootstrap intervals (--bootstrap)
    paired_against: str | None = None  # "fullkv" | "best": whose interval each cell writes

    def interval(self, row: int, column: int) -> Difference | None:
        """The interval a cell writes (`paired_against`), or None."""
        if self.comparisons is None or self.paired_against is None:
            return None
        frame = self.comparisons.vs_reference if self.paired_against == "fullkv" else self.comparisons.vs_best
        found = frame.iat[row, column]
        return found if isinstance(found, Difference) else None

    def significance(self, row: int, column: int) -> str:
        """The cell's bootstrap marks: `DIFFERS`, `NEAR_BEST`, both or none."""
        if self.comparisons is None:
            return ""
        return ((DIFFERS if self.comparisons.differs.iat[row, column] else "")
                + (NEAR_BEST if self.comparisons.near_best.iat[row, column] else ""))

    def display(self, markup: str) -> pd.DataFrame:
        """Cells as text, `markup` "markdown" or "latex"; missing cells are "-"."""
        def cell(row: int, column: int) -> str:
            value = self.values.iat[row, column]
            if pd.isna(value):
                return "-"
            text = f"{value:+.{self.decimals}f}" if self.delta.iat[row] else f"{value:.{self.decimals}f}"
            error = None if self.stderr is None else self.stderr.iat[row, column]
            marks = ((DAGGER if self.partial.iat[row, column] else "")
                     + (DIRTY if self.dirty.iat[row, column] else "") + self.significance(row, column))
            span = self.interval(row, column)
            span = None if span is None else f"[{span.low:+.{self.decimals}f}, {span.high:+.{self.decimals}f}]"
            if markup == "latex":
                text = rf"\textbf{{{text}}}" if self.bold.iat[row, column] else text
                text += "" if error is None or pd.isna(error) else rf"{{\scriptsize $\pm${error:.{self.decimals}f}}}"
                text += "".join(LATEX_MARKS.get(mark) or LATEX_SPECIAL[mark] for mark in marks)
                return text + ("" if span is None else rf" {{\scriptsize {span}}}")
            text = f"**{text}**" if self.bold.iat[row, column] else text
            text += "" if error is None or pd.isna(error) else f" ± {error:.{self.decimals}f}"
            text += "".join(MARKDOWN_MARKS.get(mark, mark) for mark in marks)
            return text + ("" if span is None else f" {span}")

        frame = self.values.astype(object)
        for row, column in ((r, c) for r in range(frame.shape[0]) for c in range(frame.shape[1])):
            frame.iat[row, column] = cell(row, column)
        return frame

    @property
    def models(self) -> list[str]:
        return list(dict.fromkeys(self.values.index.get_level_values("Model")))


def build_table(runs: pd.DataFrame, metric: str = "accuracy", decimals: int | None = None,
                stderr: bool = False, bootstrap: BootstrapConfig | None = None,
                paired_against: str | None = None) -> Table:
    """Table 1 from `evals.report.runs.collect`'s frame (already `select`ed; or `recall_frame`'s).
    With `bootstrap`, every compressed cell compared with FullKV and with the best of its block
    (`evals.report.significance`), from the frame's `item_scores` column when it has one, else (for
    accuracy) each run's generations.jsonl; `paired_against` ("fullkv" or "best") writes one of the
    intervals in each cell. Raises UserError when it is empty, no run has a number for `metric`,
    `stderr` is asked for a metric other than accuracy, or `bootstrap` for a metric without
    per-item numbers."""
    if runs.empty:
        raise UserError("no runs to tabulate (check --runs or --sweep, and the filters)")
    if metric not in runs:
        numeric = sorted(c for c in runs.columns if pd.api.types.is_numeric_dtype(runs[c]) and c != "mtime"
                         and c not in setting_columns(runs))
        raise UserError(f"unknown metric {metric!r}; the runs have {', '.join(numeric)}")
    if stderr and metric != "accuracy":
        raise UserError(f"--stderr is for --metric accuracy, not {metric!r}")
    if bootstrap is not None and metric != "accuracy" and "item_scores" not in runs:
        raise UserError(f"--bootstrap needs per-item numbers: --metric accuracy, or a recall metric with --recall, "
                        f"not {metric!r}")
    if paired_against is not None and (bootstrap is None or paired_against not in PAIRED_AGAINST):
        raise UserError(f"--paired-against takes {' or '.join(PAIRED_AGAINST)}, with --bootstrap")
    value = pd.to_numeric(runs[metric], errors="coerce").astype(float)
    if value.isna().all():
        raise UserError(f"no selected run has a number for {metric!r}")
    runs = label(runs)
    scale = 100.0 if is_percent(metric) else 1.0
    runs["value"] = value * scale
    if stderr:
        error = runs["accuracy_stderr"] if "accuracy_stderr" in runs else pd.Series(float("nan"), index=runs.index)
        runs["stderr"] = pd.to_numeric(error, errors="coerce").astype(float) * scale
    row_keys = ["model_label", "budget_label", "method_label"]
    if runs["generation"].nunique() > 1:
        row_keys.append("generation")
    runs, duplicates = keep_newest(runs, row_keys + ["items"])

    runs["partial"] = ~runs["finished"]
    dirty_runs = runs["dirty"].eq(True) if "dirty" in runs else pd.Series(False, index=runs.index)
    # A mark on every cell tells nothing a line under the table does not: cells are marked when some are.
    runs["dirty_cell"] = dirty_runs & ~dirty_runs.all()
    order = items_sort_key(runs)
    columns = sorted(order, key=order.get)
    rows = (runs.sort_values(["model_label", "budget_rank", "method_rank", "method", "method_label", "generation"])
            [row_keys + ["method", "variant"]].drop_duplicates(row_keys))
    index = pd.MultiIndex.from_frame(rows[row_keys], names=[ROW_KEYS[k] for k in row_keys])

    def grid(column: str) -> pd.DataFrame:
        wide = runs.pivot(index=row_keys, columns="items", values=column)
        wide.index.names = index.names
        return wide.reindex(index=index, columns=columns).rename_axis(columns=None)

    values = grid("value").astype(float)
    partial = grid("partial").eq(True)  # a missing cell (NaN) is not partial
    dirty = grid("dirty_cell").eq(True)
    rows = rows.set_index(index)
    values, partial, dirty, delta = add_variant_deltas(values, partial, dirty, rows)
    datasets = runs.drop_duplicates("items").set_index("items")["dataset_label"]
    averaged = len(columns) > 1 and datasets.is_unique
    if averaged:
        values[AVG] = values.mean(axis=1, skipna=True)
        partial[AVG] = partial.any(axis=1)
        dirty[AVG] = dirty.any(axis=1)
    errors = None
    if stderr:
        errors = grid("stderr").astype(float).reindex(values.index)
        if averaged:
            # The mean of independent datasets: sqrt(sum of variances) / count; none when a cell lacks one.
            shown = values[columns].notna()
            known = (errors.notna() | ~shown).all(axis=1)
            errors[AVG] = ((errors**2).sum(axis=1) ** 0.5 / shown.sum(axis=1)).where(known)
    decimals = decimals if decimals is not None else (1 if is_percent(metric) else 2)
    candidate_row = ~delta & (rows["method"].reindex(values.index) != REFERENCE)
    candidate = candidates(values, partial, candidate_row, columns)
    bold = best_in_group(values, candidate, decimals, lower_is_better(metric))
    comparisons = None
    if bootstrap is not None:
        scores = grid_scores(runs, row_keys, index, columns).reindex(values.index)
        comparisons = compare(values, scores, rows["method"].reindex(values.index), candidate,
                              AVG if averaged else None, REFERENCE, bootstrap, scale, decimals)
        comparisons.near_best &= ~bold  # a cell tied for best is bold, not "near" it

    keys = row_keys[1:] if runs["model_label"].nunique() == 1 else row_keys
    footnotes = []
    order_keys = ["model_label", "budget_rank", "method_rank", "method_label", "generation", "items"]
    unfinished = runs[runs["partial"]].sort_values(order_keys)
    if not unfinished.empty:
        cells = [" / ".join(str(run[k]) for k in keys + ["items"]) + ": "
                 + f"{'?' if pd.isna(run['n_items']) else int(run['n_items'])} of "
                 + f"{'?' if pd.isna(run['n_planned']) else int(run['n_planned'])} items"
                 for _, run in unfinished.iterrows()]
        footnotes.append(f"{DAGGER} incomplete: " + "; ".join(cells))
    unclean = runs[runs["dirty_cell"]].sort_values(order_keys)
    if not unclean.empty:
        where = "; ".join(" / ".join(str(run[k]) for k in keys + ["items"]) for _, run in unclean.iterrows())
        footnotes.append(f"{DIRTY} made by uncommitted code (provenance.json): {where}")
    elif dirty_runs.any():
        footnotes.append("every run was made by uncommitted code (provenance.json)")

    notes = []
    if bold.to_numpy().any() or partial.to_numpy().any():
        notes.append(BOLD_NOTE)
    notes += missing_reference(runs, row_keys)
    subsets = [c for c in columns if " of " in c]
    if subsets:
        notes.append("a column of N of M items holds the first N of its benchmark: " + ", ".join(subsets))
    if len(columns) > 1 and not averaged:
        notes.append("no Avg.: the columns hold one dataset over different item sets")
    if comparisons is not None:
        footnotes.append(bootstrap_legend(comparisons, paired_against))
        if comparisons.missing:
            notes.append(f"{comparisons.missing} compressed cells have no per-item records: no interval, no mark")
    return Table(metric, values, bold, partial, dirty, delta, errors, footnotes, notes + duplicates, decimals,
                 comparisons, paired_against)


def grid_scores(runs: pd.DataFrame, row_keys: list[str], index: pd.MultiIndex, columns: list[str]) -> pd.DataFrame:
    """Each cell's `ItemScores` (None where its run has no per-item records), indexed like the table
    without its difference rows and "Avg.": the frame's `item_scores`, else each run's accuracy per
    item (`run_accuracy_scores`, for `metric` accuracy)."""
    scores = runs["item_scores"] if "item_scores" in runs else pd.Series(
        [run_accuracy_scores(path, items) for path, items in zip(runs["path"], item_ids(runs), strict=True)],
        index=runs.index)
    cells = runs.assign(item_scores=scores.where(scores.map(lambda s: isinstance(s, ItemScores)), None))
    wide = cells.pivot(index=row_keys, columns="items", values="item_scores")
    wide.index.names = index.names
    return wide.reindex(index=index, columns=columns).astype(object).where(lambda frame: frame.notna(), None)


def bootstrap_legend(comparisons: Comparisons, paired_against: str | None) -> str:
    """The line under a table that says what the bootstrap marks (and intervals) mean."""
    config = comparisons.config
    level = f"{100 * config.confidence:g}%"
    text = (f"marks: {DIFFERS} the {level} paired bootstrap interval of the cell's difference from FullKV "
            f"excludes 0; {NEAR_BEST} that of its difference from the best method of its budget and column (the "
            f"highest cell) includes 0 (items paired by id, {config.resamples} resamples, seed {config.seed})")
    if paired_against is not None:
        whom = "FullKV" if paired_against == "fullkv" else "the best method of its budget and column"
        text += f"; [low, high]: the interval of the cell's difference from {whom}, in the cell's unit"
    return text


def missing_reference(runs: pd.DataFrame, row_keys: list[str]) -> list[str]:
    """A note per model (and generation config, when a row key) naming the columns with compressed
    runs and no FullKV run: nothing there says what the full cache scores."""
    group_keys = [k for k in row_keys if k not in ("budget_label", "method_label")]
    notes = []
    for key, group in runs.groupby(group_keys, sort=True):
        compressed = set(group.loc[group["method"] != REFERENCE, "items"])
        missing = sorted(compressed - set(group.loc[group["method"] == REFERENCE, "items"]))
        if missing:
            where = " / ".join(str(k) for k in (key if isinstance(key, tuple) else (key,)))
            notes.append(f"no FullKV run of {where} over {', '.join(missing)}: no full-cache reference there")
    return notes


def candidates(values: pd.DataFrame, partial: pd.DataFrame, rows: pd.Series, columns: list[str]) -> pd.DataFrame:
    """The cells that may be bold: of a candidate row (`rows`), with a value, and over the items of
    their column (not partial). An Avg. only where its row has every column that a candidate row of
    its block (the index without Method) has, none partial: a mean over fewer datasets is another
    mean."""
    cells = values.notna() & ~partial & pd.DataFrame({c: rows for c in values.columns}, index=values.index)
    if AVG not in values:
        return cells
    levels = [name for name in values.index.names if name != "Method"]
    for _, block in cells.groupby(level=levels, sort=False):
        needed = block[columns].any(axis=0)
        cells.loc[block.index, AVG] &= block[columns].loc[:, needed].all(axis=1)
    return cells


def add_variant_deltas(values: pd.DataFrame, partial: pd.DataFrame, dirty: pd.DataFrame, rows: pd.DataFrame):
    """`values`, `partial` and `dirty` with a row "Δ <method> (paper − lf_repo)" after the lf_repo row
    of every method that has rows in both variants (same model, budget and generation); and the
    boolean Series that marks those rows. A difference is partial (dirty) where either of its cells is.

    rows: indexed like `values` (paper rows sort before their lf_repo rows), with columns `method` and
    `variant`.
    """
    method_level = values.index.names.index("Method")
    faithful, order, deltas = {}, [], {}
    for key, row in rows.iterrows():
        order.append(key)
        group = (row["method"], *(part for level, part in enumerate(key) if level != method_level))
        if row["variant"] == DEFAULT_VARIANT:
            faithful[group] = key
        elif row["variant"] == AUTHORS_VARIANT and group in faithful:
            name = METHOD_NAMES.get(row["method"], row["method"])
            label = (*key[:method_level], f"Δ {name} ({DEFAULT_VARIANT} − {AUTHORS_VARIANT})",
                     *key[method_level + 1:])
            other = faithful[group]
            deltas[label] = (values.loc[other] - values.loc[key], partial.loc[other] | partial.loc[key],
                             dirty.loc[other] | dirty.loc[key])
            order.append(label)
    index = pd.MultiIndex.from_tuples(order, names=values.index.names)
    frames = [values, partial, dirty]
    if deltas:
        frames = [pd.concat([frame, pd.DataFrame([d[i] for d in deltas.values()], index=list(deltas))])
                  for i, frame in enumerate(frames)]
    values, partial, dirty = (frame.reindex(index) for frame in frames)
    return (values.astype(float), partial.astype(bool), dirty.astype(bool),
            pd.Series(index.isin(list(deltas)), index=index))


def best_in_group(values: pd.DataFrame, candidate: pd.DataFrame, decimals: int, lower: bool) -> pd.DataFrame:
    """True where a cell is the best of its column among the candidate cells (`candidate`, bool like
    `values`) of its group (the rows of one model, budget, and generation config when there are
    several), compared as displayed (ties for best are all bold). No bold in a column with a single
    candidate or where every candidate ties."""
    shown = values.round(decimals).where(candidate)
    bold = pd.DataFrame(False, index=values.index, columns=values.columns)
    levels = [name for name in values.index.names if name != "Method"]
    for _, block in shown.groupby(level=levels, sort=False):
        for column in block.columns:
            cells = block[column].dropna()
            if cells.nunique() < 2:  # one candidate, or all tied: nothing stands out
                continue
            best = cells.min() if lower else cells.max()
            bold.loc[cells.index[cells == best], column] = True
    return bold


def blank_repeats(flat: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """`flat` with each of `columns` blank where it repeats the row above within the same values of
    the columns before it (a model named once, a budget once per block)."""
    blank = flat.copy()
    for position, column in enumerate(columns):
        same = pd.Series(True, index=flat.index)
        for key in columns[:position + 1]:
            same &= flat[key] == flat[key].shift()
        blank[column] = flat[column].where(~same, "")
    return blank


def markdown_table(frame: pd.DataFrame) -> str:
    """A pipe table of a frame of strings, index as the first columns (left-aligned), blank where a
    model or budget repeats the row above. Written here because DataFrame.to_markdown needs
    `tabulate`, which the project does not otherwise use."""
    flat = blank_repeats(frame.reset_index(), [k for k in ("Model", "Budget") if k in frame.index.names])
    n_keys = frame.index.nlevels
    header = [str(c) for c in flat.columns]
    rule = ["---"] * n_keys + ["---:"] * (len(header) - n_keys)
    cells = flat.astype(str).apply(lambda column: column.str.replace("|", r"\|")).to_numpy().tolist()
    lines = [header, rule, *cells]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def latex_escape(text: str) -> str:
    return "".join(LATEX_SPECIAL.get(char, char) for char in text)


def render_markdown(table: Table) -> str:
    lines = [markdown_table(table.display("markdown"))]
    extra = table.footnotes + [f"note: {note}" for note in table.notes]
    if extra:
        lines.append("")
        lines.extend(line + "  " for line in extra[:-1])  # two spaces: a Markdown line break
        lines.append(extra[-1])
    return "\n".join(lines) + "\n"


def default_caption(table: Table) -> str:
    """What the table shows, for a reader of the paper (LaTeX): the metric and models, how rows are
    grouped, what bold and ± mean."""
    title = METRIC_TITLES.get(table.metric, table.metric)
    text = latex_escape(f"{title} of {', '.join(table.models)}, rows grouped by KV budget (slots per sequence "
                        "and layer). Bold: the best compressed method within each budget and column, among "
                        "finished runs over the same items; FullKV, the full cache, is the reference.")
    if table.stderr is not None:
        text += r" $\pm$: one standard error."
    return text + " Column headers give the number of items run."


def render_latex(table: Table, caption: str | None = None, label: str = "tab:table1", wide: bool = False) -> str:
    """A LaTeX `table` (`table*` when `wide`, spanning both columns of a two-column paper) with booktabs
    rules: a caption (`default_caption` unless given, LaTeX as is), FullKV first, a rule between budget
    blocks, each budget named once, a row naming the model before its rows when there are several, and
    the footnote under the tabular. Needs \\usepackage{booktabs}."""
    frame = table.display("latex")
    several = len(table.models) > 1
    keys = [name for name in frame.index.names if name != "Model"]
    header = [latex_escape(str(c)) for c in [*keys, *frame.columns]]
    environment = "table*" if wide else "table"
    lines = [rf"\begin{{{environment}}}[t]", r"\centering", rf"\caption{{{caption or default_caption(table)}}}",
             rf"\label{{{label}}}", r"\small", r"\setlength{\tabcolsep}{4pt}",
             rf"\begin{{tabular}}{{{'l' * len(keys)}{'r' * len(frame.columns)}}}", r"\toprule",
             " & ".join(header) + r" \\", r"\midrule"]
    flat = blank_repeats(frame.reset_index(), ["Model", "Budget"])
    groups = frame.index.droplevel("Method").to_list()
    for position, row in flat.iterrows():
        if several and row["Model"]:
            if position:
                lines.append(r"\midrule")
            lines.append(rf"\multicolumn{{{len(header)}}}{{l}}{{\textit{{{latex_escape(row['Model'])}}}}} \\")
        elif position and groups[position] != groups[position - 1]:
            lines.append(r"\midrule")
        keys_text = [latex_escape(str(row[key])) for key in keys]
        lines.append(" & ".join(keys_text + [str(row[c]) for c in frame.columns]) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    lines += [r"\par\smallskip{\footnotesize " + latex_escape(line) + "}" for line in table.footnotes]
    lines.append(rf"\end{{{environment}}}")
    return "\n".join(lines) + "\n"


def table_csv(table: Table) -> pd.DataFrame:
    """The table as raw numbers: row keys (budget empty for the full cache), one column per item-set
    header and Avg. (written to 12 significant digits), with `--stderr` a "<column> SE" column after each, with
    `--bootstrap` the intervals after each (`interval_columns`), and `Partial` and `Dirty`: the
    headers of the row's incomplete cells, and of its cells made by uncommitted code."""
    flat = table.values.reset_index()
    if table.stderr is not None or table.comparisons is not None:
        keys = list(table.values.index.names)
        flat = flat[keys]
        for column in table.values.columns:
            flat[column] = table.values[column].to_numpy()
            if table.stderr is not None:
                flat[f"{column} SE"] = table.stderr[column].to_numpy()
            if table.comparisons is not None:
                for name, numbers in interval_columns(table.comparisons, column).items():
                    flat[name] = numbers
    flat["Budget"] = pd.to_numeric(flat["Budget"].replace("-", None), errors="coerce").astype("Int64")
    columns = [c for c in table.partial.columns if c != AVG]
    for name, marks in (("Partial", table.partial), ("Dirty", table.dirty)):
        flat[name] = ["; ".join(c for c in columns if row[c]) for _, row in marks.iterrows()]
    return flat


def interval_columns(comparisons: Comparisons, column: str) -> dict[str, list[float]]:
    """The CSV's columns of one table column's intervals: "<column> vs FullKV" (the difference), its
    "low" and "high", and the same "vs best"; NaN where a cell was not compared."""
    found = {}
    for name, frame in (("FullKV", comparisons.vs_reference), ("best", comparisons.vs_best)):
        cells = frame[column].tolist()
        for part in ("estimate", "low", "high"):
            header = f"{column} vs {name}" + ("" if part == "estimate" else f" {part}")
            found[header] = [getattr(c, part) if isinstance(c, Difference) else float("nan") for c in cells]
    return found


def write_table(table: Table, out: Path, caption: str | None = None, label: str = "tab:table1",
                wide: bool = False) -> list[Path]:
    """`<out>.md`, `<out>.tex`, `<out>.csv`; returns their paths."""
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = [out.parent / f"{out.name}{suffix}" for suffix in (".md", ".tex", ".csv")]
    paths[0].write_text(render_markdown(table))
    paths[1].write_text(render_latex(table, caption, label, wide))
    # 12 significant digits: every digit the items can give, without percent scaling's float noise
    # (3.5000000000000004 for 7 of 200).
    table_csv(table).to_csv(paths[2], index=False, float_format="%.12g")
    return paths


def runs_and_bootstrap(args: argparse.Namespace) -> tuple[pd.DataFrame, BootstrapConfig | None]:
    """What a table is built from, as `--recall` (recall files, else the runs' filters), `--bootstrap`
    and `--seed` ask: the table's command line and the heatmap's (`evals.report.figures`) share it."""
    bootstrap = None if args.bootstrap is None else BootstrapConfig(resamples=args.bootstrap, seed=args.seed)
    return (load(args) if args.recall is None else load_recall(args)), bootstrap


def load_recall(args: argparse.Namespace) -> pd.DataFrame:
    """The recall file's rows as runs (`recall_frame`), filtered as runs are (`select_filtered`)."""
    return select_filtered(recall_frame(args.recall, args.metric), args, ", ".join(map(str, args.recall)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals.table", description=__doc__.splitlines()[0])
    add_filters(parser)
    # Not results/table1: that is `make table1`'s Table 1, which a quick look at some runs must not replace.
    parser.add_argument("--out", type=Path, help="output path without suffix (default results/table, as make "
                                                  "table, or results/table_<metric> for another metric)")
    parser.add_argument("--metric", default="accuracy",
                        help="a metrics.json key, nested keys joined with dots "
                             "(tokens_per_second, step_latency_ms.p50, pass_at_k.4)")
    parser.add_argument("--stderr", action="store_true", help="each accuracy with its standard error")
    parser.add_argument("--bootstrap", type=int, metavar="B",
                        help="paired bootstrap intervals of B resamples (10000 is usual): marks cells that differ "
                             "from FullKV and cells that cannot be told from the best")
    parser.add_argument("--paired-against", choices=PAIRED_AGAINST,
                        help="with --bootstrap: write each cell's interval of its difference from FullKV or the best")
    parser.add_argument("--seed", type=int, default=BootstrapConfig.seed, help="the bootstrap's seed")
    parser.add_argument("--recall", type=Path, nargs="+", metavar="FILE.csv",
                        help="tabulate evals.canary.recall's CSVs instead of runs "
                             f"(--metric {'|'.join(RECALL_METRICS)})")
    parser.add_argument("--caption", help="the LaTeX caption (LaTeX as is; default: says what the table shows)")
    parser.add_argument("--label", default="tab:table1", help="the LaTeX label")
    parser.add_argument("--wide", action="store_true", help="table* (both columns of a two-column paper)")
    args = parser.parse_args(argv)
    try:
        runs, bootstrap = runs_and_bootstrap(args)
        table = build_table(runs, args.metric, stderr=args.stderr, bootstrap=bootstrap,
                            paired_against=args.paired_against)
    except UserError as error:
        return report(error)
    out = args.out or Path("results") / ("table" if args.metric == "accuracy" else f"table_{args.metric}")
    paths = write_table(table, out, args.caption, args.label, args.wide)
    show(render_markdown(table))
    show("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
