"""The paper's Table 1 from run directories: rows grouped by KV budget, one column per dataset.

    python -m evals.table [--runs results/runs] [--out results/table1] [--model M ...]
                          [--dataset D ...] [--generation G] [--metric accuracy] [--stderr]
                          [--caption TEXT] [--label tab:x] [--wide]

Reads every `metrics.json` under the runs folder (`collect`), keeps one run per table cell (the
newest by file mtime, said under the table), and writes `<out>.md`, `<out>.tex` (a LaTeX `table`
with booktabs rules and a caption) and `<out>.csv` (the same cells as raw numbers).

As in the paper: FullKV (the full cache, the reference) first, then one block of rows per KV budget,
methods in a fixed order; bold marks the best compressed method within each budget (FullKV is not a
candidate). Accuracy is shown in percent with one decimal; "Avg." is the mean over the datasets a row
has. A column header gives the number of items run (the most any run of that column covers); a
cell whose run covers fewer, or is unfinished, carries a dagger, and one footnote lists them.
`--stderr` adds each cell's standard error (`evals.metrics.accuracy_stderr`; for Avg., that of the
mean of independent datasets, when every cell of the row has one).

A method variant other than "paper" is part of the method's name ("H2O (lf_repo)"); a generation
config becomes a row key ("Gen.") only when the selected runs have more than one. Where a method has
runs in both variants ("paper", its own paper's implementation, and "lf_repo", the LongFlow authors'),
a row "Δ H2O (paper − lf_repo)" follows them: how much of the score comes from the implementation.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from evals.names import (
    DEFAULT_VARIANT,
    METHOD_NAMES,
    dataset_name,
    dataset_sort_key,
    method_label,
    method_rank,
    model_name,
)
from evals.store import METRICS, planned_items
from longflow.errors import UserError, report

REFERENCE = "vanilla"  # the full cache: budget "-", listed first, not a candidate for bold
AUTHORS_VARIANT = "lf_repo"  # the LongFlow authors' implementation of a baseline
PERCENT_PREFIXES = ("accuracy", "pass_at_k", "fidelity.agreement")  # fractions, shown in percent
LOWER_IS_BETTER = ("latency", "ttft", "memory", "seconds", "kv_slots", "fidelity.kl")  # substrings of metric names
AVG = "Avg."
DAGGER = "†"
LATEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                 "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
                 "Δ": r"$\Delta$", "−": r"$-$", "±": r"$\pm$", "†": r"$^\dagger$"}
ROW_KEYS = {"model_label": "Model", "budget_label": "Budget", "method_label": "Method", "generation": "Gen."}
METRIC_TITLES = {"accuracy": "Accuracy (%)", "tokens_per_second": "Throughput (tokens/s)",
                 "peak_kv_slots": "Peak KV slots", "mean_output_tokens": "Mean output length (tokens)"}


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def collect(runs_dir: Path | str) -> pd.DataFrame:
    """Every readable `metrics.json` under `runs_dir`, one row each, nested dicts flattened with dots
    (`step_latency_ms.p50`, `pass_at_k.4`), plus `path` (the run directory), `mtime`, and
    `n_planned`: the items its config covers (items.json; the dataset's size when it has none).

    Unreadable or partial files (bad JSON, not an object, no model/method/dataset) are skipped with
    a warning line. Hidden folders (Hydra's `.hydra/`) are not searched. May return an empty frame.
    """
    runs_dir = Path(runs_dir)
    records = []
    for path in sorted(runs_dir.rglob(METRICS)):
        if any(part.startswith(".") for part in path.relative_to(runs_dir).parts):
            continue
        try:
            record = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            warn(f"skipping {path}: unreadable ({error})")
            continue
        if not isinstance(record, dict):
            warn(f"skipping {path}: not a JSON object")
            continue
        missing = [key for key in ("model", "method", "dataset") if record.get(key) is None]
        if missing:
            warn(f"skipping {path}: no {', '.join(missing)}")
            continue
        planned = planned_items(path.parent)
        records.append({**record, "path": str(path.parent), "mtime": path.stat().st_mtime,
                        "n_planned": None if planned is None else len(planned)})
    if not records:
        return pd.DataFrame()
    frame = pd.json_normalize(records)
    for column, default in (("variant", DEFAULT_VARIANT), ("generation", "-"), ("budget", None),
                            ("complete", True), ("n_items", None), ("dataset_size", None)):
        if column not in frame:
            frame[column] = default
    frame["variant"] = frame["variant"].fillna(DEFAULT_VARIANT)
    frame["generation"] = frame["generation"].fillna("-")
    frame["complete"] = frame["complete"].fillna(True).astype(bool)
    frame["n_planned"] = frame["n_planned"].fillna(frame["dataset_size"])  # runs from before items.json
    for column in ("budget", "n_items", "dataset_size", "n_planned"):
        frame[column] = pd.to_numeric(frame[column], errors="coerce").astype("Int64")
    return frame


def select(runs: pd.DataFrame, models=None, datasets=None, generation: str | None = None) -> pd.DataFrame:
    """The runs of the given models, datasets (run keys or display names) and generation config."""
    if runs.empty:
        return runs
    keep = pd.Series(True, index=runs.index)
    if models:
        keep &= runs["model"].isin(models)
    if datasets:
        wanted = set(datasets) | {dataset_name(d) for d in datasets}
        keep &= runs["dataset"].isin(wanted) | runs["dataset"].map(dataset_name).isin(wanted)
    if generation:
        keep &= runs["generation"] == generation
    return runs[keep]


def is_percent(metric: str) -> bool:
    return metric.startswith(PERCENT_PREFIXES)


def lower_is_better(metric: str) -> bool:
    return any(word in metric for word in LOWER_IS_BETTER)


def label(runs: pd.DataFrame) -> pd.DataFrame:
    """`runs` plus display columns: model_label, method_label, budget_label ("-" for the full cache),
    dataset_label, sort keys, and `finished`: whether a run did every item its config asked for (a
    run of the first items, `limit`, is finished when it has them; a run of a whole benchmark when it
    is complete, every sample included). Shared by the table and the figures."""
    runs = runs.copy()
    done, planned, size = (runs[column].astype("Float64").fillna(float("nan")).astype(float)
                           for column in ("n_items", "n_planned", "dataset_size"))
    runs["finished"] = runs["complete"] | ((planned < size) & (done >= planned))
    runs["model_label"] = runs["model"].map(model_name)
    modes = runs["budget_mode"] if "budget_mode" in runs else pd.Series(None, index=runs.index, dtype=object)
    runs["method_label"] = [method_label(m, v, b) for m, v, b in zip(runs["method"], runs["variant"], modes,
                                                                      strict=True)]
    runs["method_rank"] = runs["method"].map(method_rank)
    runs["budget_label"] = [
        "-" if method == REFERENCE or pd.isna(budget) else str(int(budget))
        for method, budget in zip(runs["method"], runs["budget"], strict=True)
    ]
    # Full cache sorts before every budget; the budget is ignored by that method anyway.
    budget = runs["budget"].astype("Float64").fillna(-1.0)
    runs["budget_rank"] = budget.where(runs["method"] != REFERENCE, -1.0)
    runs["dataset_label"] = runs["dataset"].map(dataset_name)
    return runs


def keep_newest(runs: pd.DataFrame, keys: list[str]) -> tuple[pd.DataFrame, list[str]]:
    """One run per `keys` value, the newest by metrics.json mtime; and a note for each key that had
    several (other seeds, reruns with a changed config)."""
    runs = runs.sort_values("mtime", kind="stable")
    notes = []
    for key, group in runs.groupby(keys, sort=True):
        if len(group) > 1:
            where = " / ".join(str(k) for k in key)
            notes.append(f"{where}: {len(group)} runs, kept the newest ({Path(group['path'].iloc[-1]).name})")
    return runs.drop_duplicates(keys, keep="last"), notes


@dataclass
class Table:
    """A built table: numbers, and where each cell is bold or partial. All frames share the index
    (row keys, named as in the output: Model, Budget, Method, and Gen. when there are several) and
    the columns (dataset headers with their item counts, then "Avg.")."""

    metric: str
    values: pd.DataFrame  # floats, in percent for accuracy-like metrics
    bold: pd.DataFrame  # bool
    partial: pd.DataFrame  # bool
    delta: pd.Series  # bool per row: a difference between two variants of a method, shown signed
    stderr: pd.DataFrame | None  # standard errors, in the values' unit (--stderr); NaN on difference rows
    footnotes: list[str]  # one line for the partial cells, when there are any
    notes: list[str]  # columns of fewer items than their dataset has; duplicates that were dropped
    decimals: int

    def display(self, markup: str) -> pd.DataFrame:
        """Cells as text, `markup` "markdown" or "latex"; missing cells are "-"."""
        def cell(row: int, column: int) -> str:
            value = self.values.iat[row, column]
            if pd.isna(value):
                return "-"
            text = f"{value:+.{self.decimals}f}" if self.delta.iat[row] else f"{value:.{self.decimals}f}"
            error = None if self.stderr is None else self.stderr.iat[row, column]
            if markup == "latex":
                text = rf"\textbf{{{text}}}" if self.bold.iat[row, column] else text
                text += "" if error is None or pd.isna(error) else rf"{{\scriptsize $\pm${error:.{self.decimals}f}}}"
                return text + (r"$^\dagger$" if self.partial.iat[row, column] else "")
            text = f"**{text}**" if self.bold.iat[row, column] else text
            text += "" if error is None or pd.isna(error) else f" ± {error:.{self.decimals}f}"
            return text + (DAGGER if self.partial.iat[row, column] else "")

        frame = self.values.astype(object)
        for row, column in ((r, c) for r in range(frame.shape[0]) for c in range(frame.shape[1])):
            frame.iat[row, column] = cell(row, column)
        return frame

    @property
    def models(self) -> list[str]:
        return list(dict.fromkeys(self.values.index.get_level_values("Model")))


def build_table(runs: pd.DataFrame, metric: str = "accuracy", decimals: int | None = None,
                stderr: bool = False) -> Table:
    """Table 1 from `collect`'s frame (already `select`ed). Raises UserError when it is empty, no
    run has a number for `metric`, or `stderr` is asked for a metric other than accuracy."""
    if runs.empty:
        raise UserError("no runs to tabulate (check --runs and the --model/--dataset/--generation filters)")
    if metric not in runs:
        numeric = sorted(c for c in runs.columns if pd.api.types.is_numeric_dtype(runs[c]) and c != "mtime")
        raise UserError(f"unknown metric {metric!r}; the runs have {', '.join(numeric)}")
    if stderr and metric != "accuracy":
        raise UserError(f"--stderr is for --metric accuracy, not {metric!r}")
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
    runs, notes = keep_newest(runs, row_keys + ["dataset_label"])

    # A column counts the items its runs were asked for (the most of any: a killed run covers fewer).
    counts = runs.groupby("dataset_label")["n_planned"].max()
    done = runs["n_items"].astype("Float64").fillna(float("nan")).astype(float)
    runs["partial"] = ~runs["finished"] | (done < runs["dataset_label"].map(counts).astype(float))
    datasets = sorted(counts.index, key=dataset_sort_key)
    headers = {d: d if pd.isna(counts[d]) else f"{d} ({int(counts[d])})" for d in datasets}
    rows = (runs.sort_values(["model_label", "budget_rank", "method_rank", "method", "method_label", "generation"])
            [row_keys + ["method", "variant"]].drop_duplicates(row_keys))
    index = pd.MultiIndex.from_frame(rows[row_keys], names=[ROW_KEYS[k] for k in row_keys])

    def grid(column: str) -> pd.DataFrame:
        wide = runs.pivot(index=row_keys, columns="dataset_label", values=column)
        wide.index.names = index.names
        return wide.reindex(index=index, columns=datasets).rename(columns=headers).rename_axis(columns=None)

    values = grid("value").astype(float)
    values[AVG] = values.mean(axis=1, skipna=True)
    partial = grid("partial").eq(True)  # a missing cell (NaN) is not partial
    partial[AVG] = partial.any(axis=1)
    rows = rows.set_index(index)
    values, partial, delta = add_variant_deltas(values, partial, rows)
    errors = None
    if stderr:
        errors = grid("stderr").astype(float)
        # The mean of independent datasets: sqrt(sum of variances) / count; none when a cell lacks one.
        shown = values.loc[index, errors.columns].notna()
        known = (errors.notna() | ~shown).all(axis=1)
        errors[AVG] = ((errors**2).sum(axis=1) ** 0.5 / shown.sum(axis=1)).where(known)
        errors = errors.reindex(values.index)
    decimals = decimals if decimals is not None else (1 if is_percent(metric) else 2)
    candidate = ~delta & (rows["method"].reindex(values.index) != REFERENCE)
    bold = best_in_group(values, candidate, decimals, lower_is_better(metric))

    footnotes = []
    unfinished = runs[runs["partial"]].sort_values(row_keys + ["dataset_label"])
    if not unfinished.empty:
        keys = row_keys[1:] if runs["model_label"].nunique() == 1 else row_keys
        cells = [" / ".join(str(run[k]) for k in keys + ["dataset_label"]) + ": "
                 + f"{'?' if pd.isna(run['n_items']) else int(run['n_items'])} of "
                 + f"{int(counts[run['dataset_label']]) if pd.notna(counts[run['dataset_label']]) else '?'} items"
                 for _, run in unfinished.iterrows()]
        footnotes.append(f"{DAGGER} incomplete: " + "; ".join(cells))
    sizes = runs.groupby("dataset_label")["dataset_size"].max()
    subsets = [f"{d} {int(counts[d])} of {int(sizes[d])}" for d in datasets
               if pd.notna(counts[d]) and pd.notna(sizes[d]) and counts[d] < sizes[d]]
    if subsets:
        notes.insert(0, "columns of fewer items than their benchmark has (its first items): " + ", ".join(subsets))
    return Table(metric, values, bold, partial, delta, errors, footnotes, notes, decimals)


def add_variant_deltas(values: pd.DataFrame, partial: pd.DataFrame, rows: pd.DataFrame):
    """`values` and `partial` with a row "Δ <method> (paper − lf_repo)" after the lf_repo row of every
    method that has rows in both variants (same model, budget and generation); and the boolean Series
    that marks those rows. A difference is partial where either of its cells is; its Avg. is the mean
    of its differences.

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
            difference = values.loc[other] - values.loc[key]
            # Over the datasets both variants have, not the difference of two averages over others.
            difference[AVG] = difference.drop(AVG).mean(skipna=True)
            deltas[label] = (difference, partial.loc[other] | partial.loc[key])
            order.append(label)
    index = pd.MultiIndex.from_tuples(order, names=values.index.names)
    if deltas:
        values = pd.concat([values, pd.DataFrame([d[0] for d in deltas.values()], index=list(deltas))])
        partial = pd.concat([partial, pd.DataFrame([d[1] for d in deltas.values()], index=list(deltas))])
    return (values.reindex(index), partial.reindex(index).astype(bool),
            pd.Series(index.isin(list(deltas)), index=index))


def best_in_group(values: pd.DataFrame, candidate, decimals: int, lower: bool) -> pd.DataFrame:
    """True where a cell is the best of its column among the candidate rows of its group (the rows
    of one model, budget, and generation config when there are several), compared as displayed
    (ties for best are all bold). No bold in a column with a single candidate or where every
    candidate ties."""
    shown = values.round(decimals).where(pd.Series(candidate, index=values.index), axis=0)
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
                        "and layer). Bold: the best compressed method within each budget; FullKV, the full "
                        "cache, is the reference.")
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
    """The table as raw numbers: row keys (budget empty for the full cache), one column per dataset
    header and Avg. at full precision, with `--stderr` a "<column> SE" column after each, and
    `Partial`: the headers of the row's incomplete cells."""
    flat = table.values.reset_index()
    if table.stderr is not None:
        keys = list(table.values.index.names)
        flat = flat[keys]
        for column in table.values.columns:
            flat[column] = table.values[column].to_numpy()
            flat[f"{column} SE"] = table.stderr[column].to_numpy()
    flat["Budget"] = pd.to_numeric(flat["Budget"].replace("-", None), errors="coerce").astype("Int64")
    columns = [c for c in table.partial.columns if c != AVG]
    flat["Partial"] = ["; ".join(c for c in columns if row[c]) for _, row in table.partial.iterrows()]
    return flat


def write_table(table: Table, out: Path, caption: str | None = None, label: str = "tab:table1",
                wide: bool = False) -> list[Path]:
    """`<out>.md`, `<out>.tex`, `<out>.csv`; returns their paths."""
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = [out.parent / f"{out.name}{suffix}" for suffix in (".md", ".tex", ".csv")]
    paths[0].write_text(render_markdown(table))
    paths[1].write_text(render_latex(table, caption, label, wide))
    table_csv(table).to_csv(paths[2], index=False)
    return paths


def add_filters(parser: argparse.ArgumentParser) -> None:
    """--runs and the run filters, shared with `evals.figures` and `evals.results`."""
    parser.add_argument("--runs", type=Path, default=Path("results/runs"), help="folder of run directories")
    parser.add_argument("--model", nargs="+", help="only these models (run keys)")
    parser.add_argument("--dataset", nargs="+", help="only these datasets (run keys or display names)")
    parser.add_argument("--generation", help="only this generation config (greedy, sampling, ...)")


def load(args: argparse.Namespace) -> pd.DataFrame:
    """`collect` then `select` from parsed filter arguments; UserError when nothing is left."""
    if not args.runs.is_dir():
        raise UserError(f"runs folder {args.runs} does not exist (pass --runs)")
    runs = collect(args.runs)
    if runs.empty:
        raise UserError(f"no {METRICS} found under {args.runs}")
    runs = select(runs, args.model, args.dataset, args.generation)
    if runs.empty:
        raise UserError(f"no runs under {args.runs} match the --model/--dataset/--generation filters")
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals.table", description=__doc__.splitlines()[0])
    add_filters(parser)
    parser.add_argument("--out", type=Path, help="output path without suffix (default results/table1, "
                                                  "or results/table1_<metric> for another metric)")
    parser.add_argument("--metric", default="accuracy",
                        help="a metrics.json key, nested keys joined with dots "
                             "(tokens_per_second, step_latency_ms.p50, pass_at_k.4)")
    parser.add_argument("--stderr", action="store_true", help="each accuracy with its standard error")
    parser.add_argument("--caption", help="the LaTeX caption (LaTeX as is; default: says what the table shows)")
    parser.add_argument("--label", default="tab:table1", help="the LaTeX label")
    parser.add_argument("--wide", action="store_true", help="table* (both columns of a two-column paper)")
    args = parser.parse_args(argv)
    try:
        table = build_table(load(args), args.metric, stderr=args.stderr)
    except UserError as error:
        return report(error)
    out = args.out or Path("results") / ("table1" if args.metric == "accuracy" else f"table1_{args.metric}")
    paths = write_table(table, out, args.caption, args.label, args.wide)
    print(render_markdown(table))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
