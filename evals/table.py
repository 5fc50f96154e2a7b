"""The paper's Table 1 from run directories: one row per (model, method, budget), one column per dataset.

    python -m evals.table [--runs results/runs] [--out results/table1] [--model M ...]
                          [--dataset D ...] [--generation G] [--metric accuracy]

Reads every `metrics.json` under the runs folder (`collect`), keeps one run per table cell (the
newest by file mtime, said under the table), and writes `<out>.md`, `<out>.tex`
(booktabs) and `<out>.csv` (the same cells as raw numbers). Accuracy is shown in percent with one
decimal; "Avg." is the mean over the datasets a row has. As in the paper, bold marks the best
compressed method of each model in each column (FullKV is the reference, not a competitor); a
cell from an incomplete run carries a dagger and a footnote with its item count.

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

from longflow.errors import UserError, report

METRICS = "metrics.json"

# Run keys -> the paper's column names, in the paper's column order. Aliases cover hub-style keys.
DATASET_NAMES = {
    "aime24": "AIME24", "aime25": "AIME25", "amc": "AMC", "amc23": "AMC", "gpqa": "GPQA",
    "gpqa_diamond": "GPQA", "gsm8k": "GSM8K", "math500": "MATH-500", "math-500": "MATH-500",
    "math_500": "MATH-500", "minerva": "Minerva", "minerva_math": "Minerva", "olympiad": "OlympiadBench",
    "olympiadbench": "OlympiadBench",
}
DATASET_ORDER = ["AIME24", "AIME25", "AMC", "GPQA", "GSM8K", "MATH-500", "Minerva", "OlympiadBench"]
# Registry names -> display names, in the table's row order; other methods follow alphabetically.
METHOD_NAMES = {"vanilla": "FullKV", "streaming": "StreamingLLM", "h2o": "H2O", "vatp": "VATP",
                "rkv": "R-KV", "longflow": "LongFlow"}
REFERENCE = "vanilla"  # the full cache: budget "-", listed first, not a candidate for bold
DEFAULT_VARIANT = "paper"
AUTHORS_VARIANT = "lf_repo"  # the LongFlow authors' implementation of a baseline
PERCENT_PREFIXES = ("accuracy", "pass_at_k", "fidelity.agreement")  # fractions, shown in percent
LOWER_IS_BETTER = ("latency", "ttft", "memory", "seconds", "kv_slots", "fidelity.kl")  # substrings of metric names
AVG = "Avg."
DAGGER = "†"
LATEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                 "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}
ROW_KEYS = {"model": "Model", "method_label": "Method", "budget_label": "Budget", "generation": "Gen."}


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def collect(runs_dir: Path | str) -> pd.DataFrame:
    """Every readable `metrics.json` under `runs_dir`, one row each, nested dicts flattened with dots
    (`step_latency_ms.p50`, `pass_at_k.4`), plus `path` (the run directory) and `mtime`.

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
        records.append({**record, "path": str(path.parent), "mtime": path.stat().st_mtime})
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
    for column in ("budget", "n_items", "dataset_size"):
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


def dataset_name(key: str) -> str:
    return DATASET_NAMES.get(str(key).lower(), str(key))


def dataset_sort_key(name: str) -> tuple[int, str]:
    """The paper's column order for known datasets (display names), then the others by name."""
    return (DATASET_ORDER.index(name), "") if name in DATASET_ORDER else (len(DATASET_ORDER), name)


def method_rank(method: str) -> int:
    """Position in the table's method order; unknown methods after all known ones (then by name)."""
    order = list(METHOD_NAMES)
    return order.index(method) if method in order else len(order)


def method_label(method: str, variant: str) -> str:
    name = METHOD_NAMES.get(method, method)
    return name if variant == DEFAULT_VARIANT else f"{name} ({variant})"


def is_percent(metric: str) -> bool:
    return metric.startswith(PERCENT_PREFIXES)


def lower_is_better(metric: str) -> bool:
    return any(word in metric for word in LOWER_IS_BETTER)


def label(runs: pd.DataFrame) -> pd.DataFrame:
    """`runs` plus display columns: method_label, budget_label ("-" for the full cache), dataset_label,
    and sort keys, shared by the table and the figures."""
    runs = runs.copy()
    runs["method_label"] = [method_label(m, v) for m, v in zip(runs["method"], runs["variant"], strict=True)]
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
    (row keys, named as in the output) and the columns (dataset headers, then "Avg.")."""

    metric: str
    values: pd.DataFrame  # floats, in percent for accuracy-like metrics
    bold: pd.DataFrame  # bool
    partial: pd.DataFrame  # bool
    delta: pd.Series  # bool per row: a difference between two variants of a method, shown signed
    footnotes: list[str]  # one line each, for every partial cell
    notes: list[str]  # duplicates that were dropped
    decimals: int

    def display(self, markup: str) -> pd.DataFrame:
        """Cells as text, `markup` "markdown" or "latex"; missing cells are "-"."""
        def cell(value: float, bold: bool, partial: bool, delta: bool) -> str:
            if pd.isna(value):
                return "-"
            text = f"{value:+.{self.decimals}f}" if delta else f"{value:.{self.decimals}f}"
            if markup == "latex":
                return (rf"\textbf{{{text}}}" if bold else text) + (r"$^\dagger$" if partial else "")
            return (f"**{text}**" if bold else text) + (DAGGER if partial else "")

        frame = self.values.astype(object)
        for row, column in ((r, c) for r in range(frame.shape[0]) for c in range(frame.shape[1])):
            frame.iat[row, column] = cell(self.values.iat[row, column], self.bold.iat[row, column],
                                          self.partial.iat[row, column], self.delta.iat[row])
        return frame


def build_table(runs: pd.DataFrame, metric: str = "accuracy", decimals: int | None = None) -> Table:
    """Table 1 from `collect`'s frame (already `select`ed). Raises UserError when it is empty or
    no run has a number for `metric`."""
    if runs.empty:
        raise UserError("no runs to tabulate (check --runs and the --model/--dataset/--generation filters)")
    if metric not in runs:
        numeric = sorted(c for c in runs.columns if pd.api.types.is_numeric_dtype(runs[c]) and c != "mtime")
        raise UserError(f"unknown metric {metric!r}; the runs have {', '.join(numeric)}")
    value = pd.to_numeric(runs[metric], errors="coerce").astype(float)
    if value.isna().all():
        raise UserError(f"no selected run has a number for {metric!r}")
    runs = label(runs)
    runs["value"] = value * (100.0 if is_percent(metric) else 1.0)
    row_keys = ["model", "method_label", "budget_label"]
    if runs["generation"].nunique() > 1:
        row_keys.append("generation")
    runs, notes = keep_newest(runs, row_keys + ["dataset_label"])

    sizes = runs.groupby("dataset_label")["dataset_size"].max()
    datasets = sorted(sizes.index, key=dataset_sort_key)
    headers = {d: d if pd.isna(sizes[d]) else f"{d} ({int(sizes[d])})" for d in datasets}
    rows = (runs.sort_values(["model", "method_rank", "method", "method_label", "budget_rank", "generation"])
            [row_keys + ["method", "variant"]].drop_duplicates(row_keys))
    index = pd.MultiIndex.from_frame(rows[row_keys], names=[ROW_KEYS[k] for k in row_keys])

    def grid(column: str) -> pd.DataFrame:
        wide = runs.pivot(index=row_keys, columns="dataset_label", values=column)
        wide.index.names = index.names
        return wide.reindex(index=index, columns=datasets).rename(columns=headers).rename_axis(columns=None)

    values = grid("value").astype(float)
    values[AVG] = values.mean(axis=1, skipna=True)
    partial = grid("complete").eq(False)  # a missing cell (NaN) is not partial
    partial[AVG] = partial.any(axis=1)
    rows = rows.set_index(index)
    values, partial, delta = add_variant_deltas(values, partial, rows)
    decimals = decimals if decimals is not None else (1 if is_percent(metric) else 2)
    candidate = ~delta & (rows["method"].reindex(values.index) != REFERENCE)
    bold = best_per_model(values, candidate, decimals, lower_is_better(metric))

    footnotes = []
    for _, run in runs[~runs["complete"]].sort_values(row_keys + ["dataset_label"]).iterrows():
        where = " / ".join(str(run[k]) for k in row_keys + ["dataset_label"])
        total = "?" if pd.isna(run["dataset_size"]) else int(run["dataset_size"])
        done = "?" if pd.isna(run["n_items"]) else int(run["n_items"])
        footnotes.append(f"{DAGGER} partial: {where}: {done} of {total} items")
    return Table(metric, values, bold, partial, delta, footnotes, notes, decimals)


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


def best_per_model(values: pd.DataFrame, candidate, decimals: int, lower: bool) -> pd.DataFrame:
    """True where a cell is the best of its column among the candidate rows of its model, compared
    as displayed (ties for best are all bold). No bold in a column with a single candidate or where
    every candidate ties."""
    shown = values.round(decimals).where(pd.Series(candidate, index=values.index), axis=0)
    bold = pd.DataFrame(False, index=values.index, columns=values.columns)
    for _, block in shown.groupby(level="Model", sort=False):
        for column in block.columns:
            cells = block[column].dropna()
            if cells.nunique() < 2:  # one candidate, or all tied: nothing stands out
                continue
            best = cells.min() if lower else cells.max()
            bold.loc[cells.index[cells == best], column] = True
    return bold


def markdown_table(frame: pd.DataFrame) -> str:
    """A pipe table of a frame of strings, index as the first columns (left-aligned), blank where a
    model repeats the row above. Written here because DataFrame.to_markdown needs `tabulate`, which
    the project does not otherwise use."""
    flat = frame.reset_index()
    if "Model" in flat:
        flat["Model"] = flat["Model"].where(flat["Model"] != flat["Model"].shift(), "")
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


def render_latex(table: Table) -> str:
    """A booktabs tabular, a rule between models, the model named once; footnotes follow it."""
    frame = table.display("latex").reset_index()
    keys = list(table.values.index.names)
    first = frame["Model"] != frame["Model"].shift()
    frame["Model"] = frame["Model"].where(first, "")
    styler = (frame.style.hide(axis="index").format(escape="latex", subset=keys)
              .format_index(escape="latex", axis=1))
    lines = styler.to_latex(hrules=True, column_format="l" * len(keys) + "r" * (frame.shape[1] - len(keys)))
    lines = lines.splitlines()
    body = lines.index(r"\midrule") + 1  # one line per row from here (no cell holds a newline)
    for row in reversed(frame.index[first][1:]):
        lines.insert(body + row, r"\midrule")
    lines += [r"\par{\footnotesize $^\dagger$" + latex_escape(line.removeprefix(DAGGER)) + "}"
              for line in table.footnotes]
    return "\n".join(lines) + "\n"


def table_csv(table: Table) -> pd.DataFrame:
    """The table as raw numbers: row keys (budget empty for the full cache), one column per dataset
    header and Avg. at full precision, and `Partial`: the headers of the row's incomplete cells."""
    flat = table.values.reset_index()
    flat["Budget"] = pd.to_numeric(flat["Budget"].replace("-", None), errors="coerce").astype("Int64")
    columns = [c for c in table.partial.columns if c != AVG]
    flat["Partial"] = ["; ".join(c for c in columns if row[c]) for _, row in table.partial.iterrows()]
    return flat


def write_table(table: Table, out: Path) -> list[Path]:
    """`<out>.md`, `<out>.tex`, `<out>.csv`; returns their paths."""
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = [out.parent / f"{out.name}{suffix}" for suffix in (".md", ".tex", ".csv")]
    paths[0].write_text(render_markdown(table))
    paths[1].write_text(render_latex(table))
    table_csv(table).to_csv(paths[2], index=False)
    return paths


def add_filters(parser: argparse.ArgumentParser) -> None:
    """--runs and the run filters, shared with `evals.figures`."""
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
    args = parser.parse_args(argv)
    try:
        table = build_table(load(args), args.metric)
    except UserError as error:
        return report(error)
    out = args.out or Path("results") / ("table1" if args.metric == "accuracy" else f"table1_{args.metric}")
    paths = write_table(table, out)
    print(render_markdown(table))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
