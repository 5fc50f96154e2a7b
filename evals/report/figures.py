"""Figures from run directories: the paper's budget sweep, speed per budget, output lengths,
accuracy across model sizes (the paper's Figure 4), teacher-forced fidelity, and where each method
wins (a method x dataset heatmap per budget).

    python -m evals.figures [--runs results/runs | --sweep DIR ...] [--out results/] [--model M ...]
                            [--method M ...] [--budget N ...] [--dataset D ...] [--limit N ...]
                            [--generation G] [--only sweep|lengths|sizes|fidelity|heatmap]
                            [--metric M] [--bootstrap B] [--recall FILE.csv]

`sweep` (drawn by default): with several KV budgets, `accuracy_vs_budget.png` (one panel per model
and item set, one line per method, FullKV as a dashed horizontal line), `accuracy_by_method.png` (the
same curves, one panel per method, each against the FullKV line), the paper's figure
`budget_grid_<model>.png|pdf` (a panel per item set, and one for their average when they are two
datasets or more, sized for a paper's text width) and `throughput_vs_budget.png` (tokens/s and
decode-step latency p50 per budget, means over the item sets its title names); with one budget,
`methods.png`, bars of accuracy and tokens/s per method. `lengths` (drawn by default):
`output_lengths_<model>.png|pdf`, the distribution of output lengths of each method, a panel per
budget on one y axis, titled with the item sets. `sizes` (only when asked, `make fig4`):
`model_sizes.png|pdf`, accuracy of each method across the models, smallest first, a panel per item
set and (two datasets or more) the average.

A panel is one dataset over one item set, titled with the items run ("canary (16 of 200)"): runs of
other limits are other panels. Every accuracy carries an error bar of one standard error (the run's
`accuracy_stderr`, else binomial from its item count; for an average, that of the mean of
independent datasets); FullKV's is a band around its line. Panels that are compared share their y
axis; a figure has one legend; a panel without a FullKV run says so. Hollow markers are incomplete
runs. Runs are read, filtered and deduplicated (newest wins) as for `evals.table`
(`evals.report.runs`); models, methods and datasets go by their display names (`evals.report.names`).
`fidelity` (drawn by default when runs have teacher-forced records, `fidelity=true`):
`fidelity_vs_step.png|pdf`, the running agreement with the full cache's greedy token and the running
KL(full || method) per output step as method x step heatmaps, a row of panels per (model, dataset,
budget). `heatmap` (only when asked): `heatmap_<model>.png|pdf` (`evals.report.heatmap`), the table
of `--metric` (accuracy; `--recall` for dependency recall) as a method x dataset heatmap, a panel per
budget, the best of each column boxed and, with `--bootstrap B`, the cells that cannot be told from
it marked.

`acceptance` (drawn by default when runs verify, `verify=vericache`): `vericache_acceptance.png|pdf`,
the drafts accepted per verify round against the budget. With `--table FILE.csv` (and `--horizon
H`) it draws the cells of a table's CSV (`evals.report.table --metric accepted_per_round`) instead
of runs: for a committed table whose runs are not at hand, or whose cells were edited after it was
written.

Every figure is written as PNG and PDF. A method is drawn in its family's colour, with a marker of
its own and a line style per variant (`evals.report.palette`: AMS over X in X's colour, dashed).
Legends sit outside the panels and the figure grows to hold them.

Figures are drawn on `matplotlib.figure.Figure` with an Agg canvas, never through pyplot: no global
state and no display needed.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.container import ErrorbarContainer
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from evals.metrics import FIDELITY_THRESHOLD, FIDELITY_WINDOW, trailing_mean
from evals.report.console import show
from evals.report.names import DEFAULT_VARIANT, model_size, parse_method_label
from evals.report.palette import Style, styles
from evals.report.runs import REFERENCE, add_filters, item_ids, items_sort_key, keep_newest, label, load
from evals.report.stats import SEED
from evals.report.table import AVG
from evals.store import FIDELITY, GENERATIONS, in_scope, peek_records, planned_items
from longflow.errors import UserError, report

REFERENCE_COLOR = "0.25"
PANEL = (4.0, 3.0)  # inches per panel
LATENCY = "step_latency_ms.p50"
HATCH = "//"  # bars of incomplete runs
BY_METHOD_COLUMNS = 3
ERROR = "accuracy_se"  # one standard error of `accuracy`, in percent
ERROR_LABEL = "±1 standard error"
NO_REFERENCE = "no FullKV run"
ACCEPTANCE_FIGURE = "vericache_acceptance.png"  # drawn from runs or from a table's CSV
TABLE_KEYS = ("Model", "Budget", "Method")  # the row keys of a table's CSV (`evals.report.table`)


def prepare(runs: pd.DataFrame) -> pd.DataFrame:
    """`collect`'s frame with display labels, one run per (model, series, budget, item set),
    `series`: the method's label, plus the generation config when the runs have several, and
    `accuracy_se`: one standard error of the accuracy (`standard_error`)."""
    if runs.empty:
        raise UserError("no runs to plot (check --runs or --sweep, and the filters)")
    runs = label(runs)
    # Hollow markers for runs short of the items their config asked for (`label`), not for every run
    # of a benchmark's first items.
    runs["complete"] = runs["finished"]
    several = runs["generation"].nunique() > 1
    runs["series"] = [f"{m} [{g}]" if several else m
                      for m, g in zip(runs["method_label"], runs["generation"], strict=True)]
    runs, notes = keep_newest(runs, ["model_label", "series", "budget_label", "items"])
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    for column in ("accuracy", "tokens_per_second", LATENCY):
        runs[column] = pd.to_numeric(runs[column], errors="coerce") if column in runs else float("nan")
    runs[ERROR] = standard_error(runs) * 100.0
    runs["accuracy"] = runs["accuracy"] * 100.0  # a fraction; shown in percent as in the table
    return runs.sort_values(["model_label", "method_rank", "method", "series", "budget_rank"])


def standard_error(runs: pd.DataFrame) -> pd.Series:
    """One standard error of each run's accuracy (a fraction): the run's own `accuracy_stderr` (over
    samples when it drew several), else the binomial sqrt(p (1 - p) / n) over its `n_items`."""
    accuracy = pd.to_numeric(runs["accuracy"], errors="coerce").astype(float)
    items = pd.to_numeric(runs["n_items"], errors="coerce").astype(float)
    binomial = (accuracy * (1.0 - accuracy) / items.where(items > 0)) ** 0.5
    if "accuracy_stderr" not in runs:
        return binomial
    return pd.to_numeric(runs["accuracy_stderr"], errors="coerce").astype(float).fillna(binomial)


def panel_order(runs: pd.DataFrame) -> list[str]:
    """The item sets of the runs, as panels: the paper's dataset order, then fewer items first."""
    order = items_sort_key(runs)
    return sorted(order, key=order.get)


def series_styles(runs: pd.DataFrame) -> dict[str, Style]:
    """A fixed style per series (`evals.report.palette`: a colour per method family, a line style
    per variant), in table order, so every figure of a call agrees; the full cache in
    `REFERENCE_COLOR`."""
    modes = runs["budget_mode"] if "budget_mode" in runs else pd.Series(None, index=runs.index, dtype=object)
    variants = runs["variant"] if "variant" in runs else pd.Series(DEFAULT_VARIANT, index=runs.index)
    keys = zip(runs["series"], runs["method"], variants, modes, strict=True)
    found = styles([(s, m, v, b if isinstance(b, str) else None) for s, m, v, b in keys])
    return {s: Style(REFERENCE_COLOR, style.linestyle, style.marker) if s in set(
        runs.loc[runs["method"] == REFERENCE, "series"]) else style for s, style in found.items()}


def colors(runs: pd.DataFrame) -> dict[str, str]:
    """The colour of each series' style (`series_styles`): for bars and violins, which have no line."""
    return {series: style.color for series, style in series_styles(runs).items()}


def new_figure(rows: int, columns: int, sharey: bool | str = False) -> tuple[Figure, list[list]]:
    figure = Figure(figsize=(PANEL[0] * columns + 1.8, PANEL[1] * rows), layout="constrained")
    FigureCanvasAgg(figure)
    return figure, figure.subplots(rows, columns, squeeze=False, sharey=sharey)


def draw_lines(ax, data: pd.DataFrame, column: str, palette: dict[str, Style], error: str | None = None) -> None:
    """One line per series over budget; the full cache as a dashed horizontal line; hollow markers
    for incomplete runs. With `error` (a column of standard errors), error bars on the lines and a
    band around the full cache's; and a note in the panel when it has no full-cache run."""
    if error is not None and not (data["method"] == REFERENCE).any():
        ax.text(0.02, 0.97, NO_REFERENCE, transform=ax.transAxes, ha="left", va="top", fontsize="small",
                color=REFERENCE_COLOR)
    for series, points in data.groupby("series", sort=False):
        points = points.dropna(subset=[column])
        if points.empty:
            continue
        style = palette[series]
        color = style.color
        if (points["method"] == REFERENCE).all():
            level = points[column].mean()
            ax.axhline(level, color=color, linestyle="--", linewidth=1.2, label=series)
            spread = points[error].mean() if error is not None else float("nan")
            if pd.notna(spread) and spread > 0:
                ax.axhspan(level - spread, level + spread, color=color, alpha=0.12, linewidth=0)
            continue
        points = points.dropna(subset=["budget"]).sort_values("budget")
        budgets = points["budget"].astype(float)
        look = {"marker": style.marker or "o", "linestyle": style.linestyle, "color": color, "label": series}
        if error is None:
            ax.plot(budgets, points[column], **look)
        else:
            ax.errorbar(budgets, points[column], yerr=points[error].fillna(0.0).to_numpy(), capsize=2.5,
                        elinewidth=0.9, **look)
        partial = ~points["complete"].to_numpy()
        if partial.any():
            ax.plot(budgets[partial], points[column][partial], linestyle="none", marker=style.marker or "o",
                    markerfacecolor="white", color=color)
    budgets = sorted(data["budget"].dropna().astype(int).unique())
    if budgets:
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets], minor=False)
        ax.minorticks_off()
    ax.set_xlabel("KV budget (slots)")
    ax.grid(alpha=0.3)


LEGEND_ROWS = 12
LEGEND_COLUMN_INCHES = 2.4
LEGEND_BELOW_COLUMNS = 7


def add_legend(figure: Figure, runs: pd.DataFrame, bars: bool = False, below: bool = False,
               only: set[str] | None = None) -> None:
    """One legend for the figure, beside the panels (in rows under them when `below`), of the series
    drawn (`only` those, when given); an entry for the error bars when there are any, and for
    incomplete runs when there are any."""
    handles, labels, errors = {}, [], False
    for ax in figure.axes:
        for handle, text in zip(*ax.get_legend_handles_labels(), strict=True):
            errors |= isinstance(handle, ErrorbarContainer)
            if isinstance(handle, ErrorbarContainer):
                handle = handle.lines[0]
            if text not in handles and (only is None or text in only):
                handles[text] = handle
                labels.append(text)
    if errors:
        handles[ERROR_LABEL] = Line2D([], [], linestyle="none", marker="|", markersize=10, color="0.4")
        labels.append(ERROR_LABEL)
    if not runs["complete"].all():
        hollow = Line2D([], [], linestyle="none", marker="o", color="0.4", markerfacecolor="white")
        handles["incomplete run"] = Patch(facecolor="white", edgecolor="0.4", hatch=HATCH) if bars else hollow
        labels.append("incomplete run")
    entries = [handles[t] for t in labels]
    if below:
        legend_below(figure, entries, labels)
        return
    # Beside the panels, a column holds LEGEND_ROWS entries: a taller one would run off the figure;
    # each further column widens the figure, so the panels keep their width.
    columns = -(-len(labels) // LEGEND_ROWS)
    figure.set_figwidth(figure.get_figwidth() + LEGEND_COLUMN_INCHES * (columns - 1))
    figure.legend(entries, labels, frameon=False, loc="outside right upper", ncols=columns)


def legend_below(figure: Figure, handles: list, labels: list[str]) -> None:
    """A legend under the panels in as many columns as fit the figure's width (at most
    `LEGEND_BELOW_COLUMNS`), the figure made taller by the legend's height so the panels keep theirs."""
    renderer = figure.canvas.get_renderer()
    for columns in range(min(len(labels), LEGEND_BELOW_COLUMNS), 0, -1):
        legend = figure.legend(handles, labels, frameon=False, loc="outside lower center", ncols=columns)
        extent = legend.get_window_extent(renderer)
        if extent.width <= figure.bbox.width or columns == 1:
            break
        legend.remove()
    figure.set_figheight(figure.get_figheight() + extent.height / figure.dpi)


def save(figure: Figure, path: Path, dpi: int = 150) -> list[Path]:
    """`path` (a PNG at `dpi`) and the same figure as a PDF beside it, without a creation date (a
    redrawn figure is the same file); returns both paths."""
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=dpi)
    figure.savefig(path.with_suffix(".pdf"), metadata={"CreationDate": None})
    return [path, path.with_suffix(".pdf")]


def plot_accuracy(runs: pd.DataFrame, out_dir: Path) -> list[Path]:
    """Accuracy vs KV budget: a panel per (model, item set), a line per method, one y axis."""
    models, panels = runs["model_label"].unique(), panel_order(runs)
    palette = series_styles(runs)
    figure, axes = new_figure(len(models), len(panels), sharey=True)
    for i, model in enumerate(models):
        for j, items in enumerate(panels):
            ax = axes[i][j]
            cell = runs[(runs["model_label"] == model) & (runs["items"] == items)]
            draw_lines(ax, cell, "accuracy", palette, ERROR)
            ax.set_title(f"{model}: {items}", fontsize=10)
            ax.set_ylabel("accuracy (%)" if j == 0 else "")
            ax.set_ylim(0, 105)
    add_legend(figure, runs)
    return save(figure, out_dir / "accuracy_vs_budget.png")


def plot_accuracy_by_method(runs: pd.DataFrame, out_dir: Path) -> list[Path]:
    """Accuracy vs KV budget, one panel per compressed method and (model, item set), each with the
    full cache as its reference line: one method's curve read alone, on a shared y axis. Panels wrap
    at `BY_METHOD_COLUMNS` per row; each is titled by its method, so the legend names only FullKV."""
    cells = list(runs[["model_label", "items"]].drop_duplicates().itertuples(index=False, name=None))
    order = panel_order(runs)
    cells.sort(key=lambda cell: (cell[0], order.index(cell[1])))
    methods = list(runs.loc[runs["method"] != REFERENCE, "series"].drop_duplicates())
    panels = [(cell, series) for cell in cells for series in methods]
    columns = min(BY_METHOD_COLUMNS, len(panels))
    palette = series_styles(runs)
    figure, axes = new_figure(-(-len(panels) // columns), columns, sharey=True)
    for index, ((model, items), series) in enumerate(panels):
        ax = axes[index // columns][index % columns]
        cell = runs[(runs["model_label"] == model) & (runs["items"] == items)]
        draw_lines(ax, cell[(cell["method"] == REFERENCE) | (cell["series"] == series)], "accuracy", palette, ERROR)
        ax.set_title(series if len(cells) == 1 else f"{series}: {model}, {items}", fontsize=10)
        ax.set_ylabel("accuracy (%)" if index % columns == 0 else "")
        ax.set_ylim(0, 105)
    for index in range(len(panels), len(axes) * columns):
        axes[index // columns][index % columns].set_visible(False)
    if len(cells) == 1:
        figure.suptitle(f"{cells[0][0]}: {cells[0][1]}", fontsize=10)
    add_legend(figure, runs, only=set(runs.loc[runs["method"] == REFERENCE, "series"]))
    return save(figure, out_dir / "accuracy_by_method.png")


def items_title(runs: pd.DataFrame) -> str:
    """The item sets of `runs` in panel order, for a title: "canary (4 of 200)", or "means over
    AIME24 (30), GSM8K (1319)" when a figure pools several."""
    panels = panel_order(runs)
    return panels[0] if len(panels) == 1 else f"means over {', '.join(panels)}"


def plot_throughput(runs: pd.DataFrame, out_dir: Path) -> list[Path]:
    """Tokens/s and decode-step latency p50 vs KV budget, per model, means over the item sets (named in
    the title); the models' panels of one quantity share its y axis."""
    models = runs["model_label"].unique()
    palette = series_styles(runs)
    means = (runs.groupby(["model_label", "series", "budget_label"], sort=False)
             .agg(method=("method", "first"), budget=("budget", "first"), complete=("complete", "all"),
                  tokens_per_second=("tokens_per_second", "mean"), latency=(LATENCY, "mean"))
             .reset_index())
    figure, axes = new_figure(len(models), 2, sharey="col")
    for i, model in enumerate(models):
        data = means[means["model_label"] == model]
        for ax, column, title, ylabel in ((axes[i][0], "tokens_per_second", "throughput", "tokens/s"),
                                          (axes[i][1], "latency", "decode step p50", "ms")):
            draw_lines(ax, data, column, palette)
            ax.set_ylabel(ylabel)
            ax.set_title(f"{model}: {title}", fontsize=10)
    figure.suptitle(items_title(runs), fontsize=10)
    add_legend(figure, runs)
    return save(figure, out_dir / "throughput_vs_budget.png")


def plot_methods(runs: pd.DataFrame, out_dir: Path) -> list[Path]:
    """One budget: accuracy bars per item set and method (error bars: one standard error), and tokens/s
    per method (mean over the item sets); the models' panels of one quantity share its y axis."""
    models, panels = runs["model_label"].unique(), panel_order(runs)
    palette = colors(runs)
    figure, axes = new_figure(len(models), 2, sharey="col")
    budgets = sorted(runs.loc[runs["method"] != REFERENCE, "budget"].dropna().astype(int).unique())
    budget = f"budget {budgets[0]}" if budgets else "full cache"
    for i, model in enumerate(models):
        data = runs[runs["model_label"] == model]
        series = list(data["series"].drop_duplicates())
        order = [d for d in panels if d in set(data["items"])]
        accuracy, complete, error = (data.pivot(index="items", columns="series", values=column)
                                     .reindex(index=order, columns=series)
                                     for column in ("accuracy", "complete", ERROR))
        width = 0.8 / len(series)
        ax = axes[i][0]
        for k, name in enumerate(series):
            positions = [x + (k - (len(series) - 1) / 2) * width for x in range(len(order))]
            hatches = [HATCH if done is False else None for done in complete[name]]
            ax.bar(positions, accuracy[name], width=width, color=palette[name], label=name, hatch=hatches,
                   edgecolor="white", yerr=error[name].astype(float).fillna(0.0).to_numpy(), capsize=2.5,
                   error_kw={"elinewidth": 0.9, "ecolor": "0.2"})
        ax.set_xticks(range(len(order)), order)
        ax.set_ylabel("accuracy (%), ±1 standard error")
        ax.set_ylim(0, 105)
        ax.set_title(f"{model}: accuracy, {budget}", fontsize=10)
        speed = data.groupby("series", sort=False)["tokens_per_second"].mean().reindex(series)
        ax = axes[i][1]
        ax.bar(range(len(series)), speed.to_numpy(), color=[palette[s] for s in series])
        ax.set_xticks(range(len(series)), series, rotation=30, ha="right")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{model}: throughput, {items_title(data)}", fontsize=10)
        for ax in axes[i]:
            ax.grid(axis="y", alpha=0.3)
    add_legend(figure, runs, bars=True)
    return save(figure, out_dir / "methods.png")


def plot_budget_sweep(runs: pd.DataFrame, out_dir: Path | str) -> list[Path]:
    """The figures for `collect`'s frame (filtered as wanted): the budget sweep and throughput
    figures when the compressed runs span several budgets, else the per-method bar chart."""
    runs, out_dir = prepare(runs), Path(out_dir)
    budgets = runs.loc[runs["method"] != REFERENCE, "budget"].dropna().unique()
    if len(budgets) <= 1:
        return plot_methods(runs, out_dir)
    return [*plot_accuracy(runs, out_dir), *plot_accuracy_by_method(runs, out_dir), *plot_budget_grid(runs, out_dir),
            *plot_throughput(runs, out_dir)]


# --- figures for a paper: text width, small type, PNG and PDF -------------------------------------

PAPER_WIDTH = 7.0  # inches: the text width of a two-column paper
TITLE_CHARACTERS = 100  # a line of a 9 pt title across PAPER_WIDTH; a longer one (many item sets) wraps
PAPER_STYLE = {"font.size": 8, "axes.titlesize": 8, "axes.labelsize": 8, "xtick.labelsize": 7,
               "ytick.labelsize": 7, "legend.fontsize": 7, "lines.markersize": 4, "lines.linewidth": 1.2}
AVERAGE = "Average"


def paper_figure(panels: int, x_label: str, y_label: str, columns: int | None = None,
                 panel_height: float = 1.75, sharey: bool = False) -> tuple[Figure, list]:
    """A figure `PAPER_WIDTH` wide with `panels` axes on a grid (3 columns up to 9 panels, then 4),
    unused axes removed, the axis labels on the outer panels only, one y axis for all when `sharey`;
    returns it and the axes in reading order. Draw inside `matplotlib.rc_context(PAPER_STYLE)`."""
    columns = min(columns or (3 if panels <= 9 else 4), panels)
    rows = -(-panels // columns)
    figure = Figure(figsize=(PAPER_WIDTH, panel_height * rows + 0.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = list(figure.subplots(rows, columns, squeeze=False, sharey=sharey).flat)
    for ax in axes[panels:]:
        ax.remove()
    for position, ax in enumerate(axes[:panels]):
        ax.set_ylabel(y_label if position % columns == 0 else "")
        ax.set_xlabel(x_label if position + columns >= panels else "")
    return figure, axes[:panels]


def save_paper(figure: Figure, stem: Path) -> list[Path]:
    """`<stem>.png` at 300 dpi and `<stem>.pdf` (`save`); `stem` may hold dots (a model's name)."""
    return save(figure, stem.with_name(stem.name + ".png"), dpi=300)


def averaged(runs: pd.DataFrame) -> bool:
    """Whether an "Average" panel says anything: two item sets or more, each of its own dataset (a
    mean of one panel repeats it; a mean of one dataset at two sizes counts items twice)."""
    first = runs.drop_duplicates("items")
    return len(first) > 1 and first["dataset_label"].is_unique


def with_average(runs: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """`runs` plus, per `keys` value, a row for the mean accuracy over the item sets (`items`
    `AVERAGE`), only where that value has every item set of the frame (a mean over some would not
    compare); complete only when all of its runs are; its standard error that of the mean of
    independent datasets, sqrt(sum of variances) / count."""
    panels = runs["items"].nunique()
    grouped = runs.assign(variance=runs[ERROR] ** 2).groupby(keys, sort=False, dropna=False)
    means = grouped.agg(accuracy=("accuracy", "mean"), complete=("complete", "all"),
                        count=("items", "nunique"), method=("method", "first"), budget=("budget", "first"),
                        variance=("variance", lambda v: v.sum(min_count=len(v))))
    means = means[means["count"] == panels].reset_index()
    means[ERROR] = means["variance"] ** 0.5 / means["count"]
    means = means.drop(columns=["count", "variance"])
    return pd.concat([runs, means.assign(items=AVERAGE, dataset_label=AVERAGE)], ignore_index=True)


def plot_budget_grid(runs: pd.DataFrame, out_dir: Path) -> list[Path]:
    """The paper's budget sweep, a figure per model at text width: a panel per item set and (for two
    datasets or more) one for the average over them, a line per method over KV budget, FullKV
    dashed, one y axis."""
    paths = []
    palette = series_styles(runs)
    for model, data in runs.groupby("model_label", sort=True):
        panels = panel_order(data)
        if averaged(data):
            data = with_average(data, ["series", "budget_label"])
            panels.append(AVERAGE)
        with matplotlib.rc_context(PAPER_STYLE):
            figure, axes = paper_figure(len(panels), "KV budget (slots)", "accuracy (%)", sharey=True)
            for ax, items in zip(axes, panels, strict=True):
                labels = ax.get_xlabel(), ax.get_ylabel()
                draw_lines(ax, data[data["items"] == items], "accuracy", palette, ERROR)
                ax.set_xlabel(labels[0])
                ax.set_ylabel(labels[1])
                ax.set_title(items)
                ax.set_ylim(0, 105)
            figure.suptitle(model, fontsize=9)
            add_legend(figure, data, below=True)
        paths += save_paper(figure, out_dir / f"budget_grid_{file_name(model)}")
    return paths


def file_name(text: str) -> str:
    return "".join(char if char.isalnum() or char in "-." else "_" for char in text)


VIOLINS_PER_HALF_WIDTH = 10  # more methods than this and their names overlap on half the text width


def output_lengths(run: Path, items: Sequence[str] | None = None) -> list[int]:
    """The output lengths (tokens) of a run's stored samples, of `items` (a frame's `item_ids`; by
    default the items its last config covers, items.json)."""
    scope = planned_items(run) if items is None else items
    return [record["output_tokens"] for record in in_scope(peek_records(run / GENERATIONS), scope)]


def plot_output_lengths(runs: pd.DataFrame, out_dir: Path) -> list[Path]:
    """Output lengths per method, a figure per model titled with the item sets: a panel per KV budget
    (FullKV in each, as the reference), a violin per method over every output of those items, its
    median marked, one y axis. A run reported over several item sets (a folder's run of two limits)
    counts its outputs once, over the largest. No figure for a model none of whose runs has
    generations.jsonl."""
    paths = []
    palette = colors(runs)
    runs = runs.sort_values("n_planned", na_position="first").drop_duplicates("path", keep="last")
    runs = runs.assign(lengths=[output_lengths(Path(path), items)
                                for path, items in zip(runs["path"], item_ids(runs), strict=True)])
    for model, data in runs.groupby("model_label", sort=True):
        if not data["lengths"].map(len).any():  # runs without their records (copied metrics only)
            continue
        reference = data[data["method"] == REFERENCE]
        budgets = [b for b in data.sort_values("budget_rank")["budget_label"].unique() if b != "-"] or ["-"]
        with matplotlib.rc_context(PAPER_STYLE):
            crowded = data["series"].nunique() > VIOLINS_PER_HALF_WIDTH  # a panel of the full width each
            figure, axes = paper_figure(len(budgets), "", "output length (tokens)", columns=1 if crowded else 2,
                                        panel_height=2.2, sharey=True)
            for ax, budget in zip(axes, budgets, strict=True):
                cell = pd.concat([reference, data[(data["budget_label"] == budget) & (data["method"] != REFERENCE)]])
                series = [s for s in cell["series"].drop_duplicates()
                          if sum(len(x) for x in cell.loc[cell["series"] == s, "lengths"])]
                samples = [np.concatenate(cell.loc[cell["series"] == s, "lengths"].map(np.asarray).to_list())
                           for s in series]
                if not samples:
                    ax.set_axis_off()
                    continue
                parts = ax.violinplot(samples, showmedians=True, showextrema=False)
                for body, name in zip(parts["bodies"], series, strict=True):
                    body.set_facecolor(palette[name])
                    body.set_alpha(0.6)
                parts["cmedians"].set_color("0.1")
                ax.set_xticks(range(1, len(series) + 1), series, rotation=45 if crowded else 30, ha="right",
                              rotation_mode="anchor")
                ax.set_title("full cache only" if budget == "-" else f"KV budget {budget}")
                ax.grid(axis="y", alpha=0.3)
            title = f"{model}: output lengths, every output of {', '.join(panel_order(data))}"
            figure.suptitle(textwrap.fill(title, TITLE_CHARACTERS), fontsize=9)
        paths += save_paper(figure, out_dir / f"output_lengths_{file_name(model)}")
    return paths


def plot_model_sizes(runs: pd.DataFrame, out_dir: Path | str) -> list[Path]:
    """The paper's Figure 4: accuracy of each method across the models of the runs, smallest first
    (`evals.report.names.model_size`), a panel per item set and (two datasets or more) one for the
    average, one y axis; FullKV dashed. The compressed runs must share one budget (select it:
    `--budget`)."""
    runs = prepare(runs)
    budgets = sorted(runs.loc[runs["method"] != REFERENCE, "budget"].dropna().astype(int).unique())
    if len(budgets) > 1:
        raise UserError(f"the runs have KV budgets {', '.join(map(str, budgets))}; choose one with --budget")
    sizes = runs.drop_duplicates("model_label").set_index("model_label")["model"].map(model_size)
    models = sorted(sizes.index, key=lambda m: (pd.isna(sizes[m]), 0.0 if pd.isna(sizes[m]) else sizes[m], m))
    position = {model: float(i) for i, model in enumerate(models)}
    runs["x"] = runs["model_label"].map(position)
    panels = panel_order(runs)
    if averaged(runs):
        runs = with_average(runs, ["series", "model_label", "x"])
        panels.append(AVERAGE)
    palette = series_styles(runs)
    with matplotlib.rc_context(PAPER_STYLE):
        figure, axes = paper_figure(len(panels), "", "accuracy (%)", sharey=True)
        for ax, items in zip(axes, panels, strict=True):
            cell = runs[runs["items"] == items]
            for series, points in cell.groupby("series", sort=False):
                points = points.dropna(subset=["accuracy"]).sort_values("x")
                style = palette[series]
                if (points["method"] == REFERENCE).all():
                    ax.plot(points["x"], points["accuracy"], color=style.color, label=series, linestyle="--")
                else:
                    ax.errorbar(points["x"], points["accuracy"], yerr=points[ERROR].fillna(0.0).to_numpy(),
                                color=style.color, label=series, marker=style.marker or "o",
                                linestyle=style.linestyle, capsize=2, elinewidth=0.8)
                hollow = ~points["complete"].astype(bool).to_numpy()
                if hollow.any():
                    ax.plot(points["x"][hollow], points["accuracy"][hollow], linestyle="none",
                            marker=style.marker or "o", markerfacecolor="white", color=style.color)
            ax.set_xticks(range(len(models)), models, rotation=30, ha="right")
            ax.set_xlim(-0.3, len(models) - 0.7)
            ax.set_title(items)
            ax.set_ylim(0, 105)
            ax.grid(alpha=0.3)
        if budgets:
            figure.suptitle(f"KV budget {budgets[0]}", fontsize=9)
        add_legend(figure, runs, below=True)
    return save_paper(figure, Path(out_dir) / "model_sizes")


FIGURES = ("sweep", "lengths", "sizes", "fidelity", "acceptance", "heatmap")


AGREEMENT_RANGE = (50.0, 100.0)  # % top-1 agreement: below half, a method has lost the thread anyway
KL_FLOOR = 1e-3  # nats: smaller running KL is drawn as this (a log scale has no 0)
ROW_INCHES = 0.22  # per method row of a heatmap
DIVERGENCE_COLOR = "red"  # stands out on both colour maps
COLORBAR_INCHES = 1.1  # the two colour bars under the columns, with their labels


def fidelity_curves(runs: pd.DataFrame, keys: tuple[str, ...]) -> tuple[list[str], list[np.ndarray]]:
    """The series of `runs` (one (model, item set, budget) cell, in table order) and, per key of
    `keys`, `[series, steps]` running means of it per output step (`trailing_mean`), NaN past a
    series' last step; each run's records are read once."""
    records = [in_scope(peek_records(Path(path) / FIDELITY), items)
               for path, items in zip(runs["path"], item_ids(runs), strict=True)]
    grids = []
    for key in keys:
        curves = [trailing_mean(run, key) if run else np.full(0, np.nan) for run in records]
        grid = np.full((len(curves), max(len(curve) for curve in curves)), np.nan)
        for row, curve in enumerate(curves):
            grid[row, :len(curve)] = curve
        grids.append(grid)
    return list(runs["series"]), grids


def divergence_steps(agreement: np.ndarray) -> list[float]:
    """Per row of running agreement (a fraction, `[series, steps]`), the first step below
    `FIDELITY_THRESHOLD`, NaN when it never falls below."""
    below = agreement < FIDELITY_THRESHOLD
    return [float(np.argmax(row)) if row.any() else float("nan") for row in below]


def plot_fidelity(runs: pd.DataFrame, out_dir: Path | str) -> list[Path]:
    """Running agreement and running KL per output step (`evals.metrics.trailing_mean`) as method x
    step heatmaps, from the fidelity.jsonl of `collect`'s runs that have one: a row of two panels per
    (model, item set, budget), a heatmap row per method, a tick where its agreement first falls below
    `FIDELITY_THRESHOLD` (the divergence step). Twenty lines on one axis cannot be told apart; rows
    can."""
    runs = prepare(runs)
    runs = runs[[(Path(path) / FIDELITY).exists() for path in runs["path"]]]
    if runs.empty:
        raise UserError(f"no selected run has {FIDELITY} (run evals.run with fidelity=true)")
    cells = list(runs.groupby(["model_label", "items", "budget_rank", "budget_label"], sort=False).groups)
    order = panel_order(runs)
    cells.sort(key=lambda cell: (cell[0], order.index(cell[1]), cell[2]))
    heights = [max(1.6, ROW_INCHES * len(runs[(runs["model_label"] == m) & (runs["items"] == i)
                                              & (runs["budget_rank"] == r)]) + 0.9) for m, i, r, _ in cells]
    figure = Figure(figsize=(2 * PANEL[0] + 1.2, sum(heights) + COLORBAR_INCHES), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(cells), 2, squeeze=False, gridspec_kw={"height_ratios": heights})
    agreement_map, kl_map = None, None
    for row, (model, dataset, rank, budget) in enumerate(cells):
        cell = runs[(runs["model_label"] == model) & (runs["items"] == dataset) & (runs["budget_rank"] == rank)]
        series, (agreement, kl) = fidelity_curves(cell, ("agreement", "kl"))
        extent = (-0.5, agreement.shape[1] - 0.5, len(series) - 0.5, -0.5)
        left, right = axes[row]
        agreement_map = left.imshow(agreement * 100.0, aspect="auto", interpolation="nearest", cmap="viridis",
                                    vmin=AGREEMENT_RANGE[0], vmax=AGREEMENT_RANGE[1], extent=extent)
        kl_map = right.imshow(np.clip(kl, KL_FLOOR, None), aspect="auto", interpolation="nearest", cmap="magma_r",
                              norm=matplotlib.colors.LogNorm(vmin=KL_FLOOR, vmax=max(1.0, np.nanmax(kl))),
                              extent=extent)
        steps = divergence_steps(agreement)
        for ax in (left, right):
            ax.plot(steps, range(len(series)), linestyle="none", marker="|", markersize=9, color=DIVERGENCE_COLOR,
                    markeredgewidth=1.5)
            ax.set_yticks(range(len(series)), series if ax is left else [""] * len(series))
            ax.set_xlabel(f"output step (mean over the last {FIDELITY_WINDOW})")
        left.set_title(f"{model}: {dataset}, budget {budget}: top-1 agreement (%)", fontsize=10)
        right.set_title(f"budget {budget}: KL(full || method), nats", fontsize=10)
    # Under each column: beside it, the first column's bar and label ran into the second's panels and
    # the second's label off the canvas.
    figure.colorbar(agreement_map, ax=axes[:, 0].tolist(), label="top-1 agreement (%)", location="bottom",
                    shrink=0.8, aspect=40)
    figure.colorbar(kl_map, ax=axes[:, 1].tolist(), label="KL(full || method), nats", location="bottom",
                    shrink=0.8, aspect=40)
    marker = Line2D([], [], linestyle="none", marker="|", markersize=9, color=DIVERGENCE_COLOR, markeredgewidth=1.5)
    figure.legend([marker], [f"first step below {FIDELITY_THRESHOLD:.0%} agreement"], loc="outside lower center",
                  frameon=False)
    return save(figure, Path(out_dir) / "fidelity_vs_step.png")


def plot_table_heatmap(args: argparse.Namespace) -> list[Path]:
    """`evals.report.heatmap` of the table that `evals.report.table` builds from the same arguments."""
    # Imported here: the heatmap draws with this module's helpers, so it imports this module.
    from evals.report.heatmap import plot_heatmap
    from evals.report.table import build_table, runs_and_bootstrap

    runs, bootstrap = runs_and_bootstrap(args)
    return plot_heatmap(build_table(runs, args.metric, bootstrap=bootstrap), args.out)


def has_fidelity(runs: pd.DataFrame) -> bool:
    return any((Path(path) / FIDELITY).exists() for path in runs["path"])


def has_verify(runs: pd.DataFrame) -> bool:
    return "verify" in runs and bool((runs["verify"] == "vericache").any())


def plot_acceptance(runs: pd.DataFrame, out_dir: Path | str) -> list[Path]:
    """VeriCache's acceptance against the KV budget: the drafts accepted per verify round
    (`accepted_per_round`), a line per drafting method, a panel per (model, item set), the horizon as
    a dotted line. Only the runs with `verify=vericache`."""
    if not has_verify(runs):
        raise UserError("no run with verify=vericache to plot")
    runs = prepare(runs[runs["verify"] == "vericache"])
    runs["accepted_per_round"] = pd.to_numeric(runs["accepted_per_round"], errors="coerce")
    horizons = [float(h) for h in runs["verify_horizon"].dropna().unique()]
    return save(acceptance_figure(runs, horizons), Path(out_dir) / ACCEPTANCE_FIGURE)


def acceptance_figure(points: pd.DataFrame, horizons: list[float]) -> Figure:
    """`plot_acceptance`'s figure of `points` (`model_label`, `items`, `series`, `method`, `budget`,
    `accepted_per_round`, `complete`, as `prepare` makes them), a dotted line at each horizon."""
    cells = list(points[["model_label", "items"]].drop_duplicates().itertuples(index=False, name=None))
    palette = series_styles(points)
    figure, axes = new_figure(1, len(cells), sharey=True)
    for ax, (model, items) in zip(axes[0], cells, strict=True):
        draw_lines(ax, points[(points["model_label"] == model) & (points["items"] == items)], "accepted_per_round",
                   palette)
        for horizon in horizons:
            ax.axhline(horizon, color=REFERENCE_COLOR, linestyle=":", linewidth=1.0)
        ax.set_title(f"{model}: {items}", fontsize=10)
        ax.set_ylabel("accepted drafts per verify round")
        ax.set_ylim(bottom=0)
    add_legend(figure, points)
    return figure


def table_points(path: Path) -> pd.DataFrame:
    """The cells of a table's CSV (`evals.report.table`'s `--out`), as `acceptance_figure`'s points:
    a point per (model, item-set column, method row), its method and variant read back from the row's
    label (`evals.report.names.parse_method_label`), incomplete where the row's `Partial` names the
    column. For a table whose runs are not at hand, or whose cells were edited after it was written;
    the averages and any standard-error or interval columns are left out."""
    try:
        table = pd.read_csv(path, dtype={"Partial": str, "Dirty": str}, keep_default_na=False,
                            na_values=[""])
    except FileNotFoundError as error:
        raise UserError(f"--table: no such file {path}") from error
    missing = [key for key in (*TABLE_KEYS, "Partial") if key not in table]
    if missing:
        raise UserError(f"--table: {path} is not a table's CSV (no {', '.join(missing)} column)")
    # `table_csv`'s other columns: "<column> SE", and the intervals "<column> vs FullKV|best[ low| high]".
    columns = [c for c in table.columns
               if c not in (*TABLE_KEYS, "Partial", "Dirty", AVG) and not c.endswith(" SE") and " vs " not in c]
    records = []
    for _, row in table.iterrows():
        method, variant, mode, _ = parse_method_label(row["Method"])
        partial = set(str(row["Partial"]).split("; ")) if pd.notna(row["Partial"]) else set()
        for column in columns:
            records.append({"model_label": row["Model"], "items": column, "series": row["Method"], "method": method,
                            "variant": variant, "budget_mode": mode, "budget": row["Budget"],
                            "accepted_per_round": row[column], "complete": column not in partial})
    points = pd.DataFrame(records)
    points["budget"] = pd.to_numeric(points["budget"], errors="coerce")
    points["accepted_per_round"] = pd.to_numeric(points["accepted_per_round"], errors="coerce")
    return points


def plot_runs(runs: pd.DataFrame, args: argparse.Namespace) -> list[Path]:
    """The figures `--only` asks for (all but sizes and heatmap by default) of the loaded runs."""
    paths = []
    if args.only in (None, "sweep"):
        paths += plot_budget_sweep(runs, args.out)
    if args.only in (None, "lengths"):
        paths += plot_output_lengths(prepare(runs), args.out)
    if args.only == "sizes":
        paths += plot_model_sizes(runs, args.out)
    if args.only in (None, "fidelity") and has_fidelity(runs):
        paths += plot_fidelity(runs, args.out)
    if args.only in (None, "acceptance") and has_verify(runs):
        paths += plot_acceptance(runs, args.out)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals.figures", description=__doc__.splitlines()[0])
    add_filters(parser)
    parser.add_argument("--out", type=Path, default=Path("results"), help="folder for the figures")
    parser.add_argument("--only", choices=FIGURES, help="draw only this figure (default: all but sizes and heatmap)")
    parser.add_argument("--metric", default="accuracy", help="the heatmap's metric (a table metric)")
    parser.add_argument("--bootstrap", type=int, metavar="B",
                        help="the heatmap marks the cells that cannot be told from the best (B resamples)")
    parser.add_argument("--seed", type=int, default=SEED, help="the bootstrap's seed (as evals.report.table's)")
    parser.add_argument("--recall", type=Path, nargs="+", metavar="FILE.csv",
                        help="the heatmap of evals.canary.recall's CSV (--metric recall_layers, ...)")
    parser.add_argument("--table", type=Path, metavar="FILE.csv",
                        help="with --only acceptance: draw the cells of this table's CSV (evals.report.table "
                             "--metric accepted_per_round) instead of runs")
    parser.add_argument("--horizon", type=float,
                        help="with --table: the verifier's horizon, drawn as a dotted line (a table does not hold it)")
    args = parser.parse_args(argv)
    if args.table is not None and args.only != "acceptance":
        parser.error("--table draws only --only acceptance")
    if args.horizon is not None and args.table is None:
        parser.error("--horizon goes with --table (runs hold their own)")
    try:
        if args.table is not None:
            figure = acceptance_figure(table_points(args.table), [] if args.horizon is None else [args.horizon])
            paths = save(figure, args.out / ACCEPTANCE_FIGURE)
        elif args.only == "heatmap":
            paths = plot_table_heatmap(args)
        else:
            paths = plot_runs(load(args), args)
    except UserError as error:
        return report(error)
    show("\n".join(map(str, paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
