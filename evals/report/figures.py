"""Figures from run directories: the paper's budget sweep, speed per budget, output lengths,
accuracy across model sizes (the paper's Figure 4), and teacher-forced fidelity.

    python -m evals.figures [--runs results/runs | --sweep DIR ...] [--out results/] [--model M ...]
                            [--method M ...] [--budget N ...] [--dataset D ...] [--limit N ...]
                            [--generation G] [--only sweep|lengths|sizes|fidelity]

`sweep` (drawn by default): with several KV budgets, `accuracy_vs_budget.png` (one panel per model
and item set, one line per method, FullKV as a dashed horizontal line), `accuracy_by_method.png` (the
same curves, one panel per method, each against the FullKV line), the paper's figure
`budget_grid_<model>.png|pdf` (a panel per item set, and one for their average when they are two
datasets or more, sized for a paper's text width) and `throughput_vs_budget.png` (tokens/s and
decode-step latency p50 per budget, means over the datasets); with one budget, `methods.png`, bars
of accuracy and tokens/s per method. `lengths` (drawn by default): `output_lengths_<model>.png|pdf`,
the distribution of output lengths of each method, a panel per budget. `sizes` (only when asked,
`make fig4`): `model_sizes.png|pdf`, accuracy of each method across the models, smallest first, a
panel per item set and (two datasets or more) the average.

A panel is one dataset over one item set, titled with the items run ("canary (16 of 200)"): runs of
other limits are other panels. Every accuracy carries an error bar of one standard error (the run's
`accuracy_stderr`, else binomial from its item count; for an average, that of the mean of
independent datasets); FullKV's is a band around its line. Panels that are compared share their y
axis; a figure has one legend; a panel without a FullKV run says so. Hollow markers are incomplete
runs. Runs are read, filtered and deduplicated (newest wins) as for `evals.table`
(`evals.report.runs`); models, methods and datasets go by their display names (`evals.report.names`).
`fidelity` (drawn by default when runs have teacher-forced records, `fidelity=true`):
`fidelity_vs_step.png`, the running agreement with the full cache's greedy token and the running
KL(full || method) per output step, a line per method, a row per (model, dataset, budget).

Figures are drawn on `matplotlib.figure.Figure` with an Agg canvas, never through pyplot: no global
state and no display needed.
"""

from __future__ import annotations

import argparse
import sys
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
from evals.report.names import model_size
from evals.report.runs import REFERENCE, add_filters, items_sort_key, keep_newest, label, load
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
    runs, notes = keep_newest(runs, ["model", "series", "budget_label", "items"])
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    for column in ("accuracy", "tokens_per_second", LATENCY):
        runs[column] = pd.to_numeric(runs[column], errors="coerce") if column in runs else float("nan")
    runs[ERROR] = standard_error(runs) * 100.0
    runs["accuracy"] = runs["accuracy"] * 100.0  # a fraction; shown in percent as in the table
    return runs.sort_values(["model", "method_rank", "method", "series", "budget_rank"])


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


def colors(runs: pd.DataFrame) -> dict[str, str]:
    """A fixed colour per series, in table order, so every figure of a call agrees."""
    compressed = list(runs.loc[runs["method"] != REFERENCE, "series"].drop_duplicates())
    if len(compressed) <= 10:
        mapping = {s: f"C{i}" for i, s in enumerate(compressed)}
    else:  # matplotlib's default cycle has 10 colours: beyond that, 20 distinct ones (then they repeat)
        tab20 = matplotlib.colormaps["tab20"].colors  # hue pairs (dark, light): the dark ones first
        palette = [matplotlib.colors.to_hex(c) for c in tab20[0::2] + tab20[1::2]]
        mapping = {s: palette[i % 20] for i, s in enumerate(compressed)}
    mapping.update({s: REFERENCE_COLOR for s in runs.loc[runs["method"] == REFERENCE, "series"].unique()})
    return mapping


def new_figure(rows: int, columns: int, sharey: bool = False) -> tuple[Figure, list[list]]:
    figure = Figure(figsize=(PANEL[0] * columns + 1.8, PANEL[1] * rows), layout="constrained")
    FigureCanvasAgg(figure)
    return figure, figure.subplots(rows, columns, squeeze=False, sharey=sharey)


def draw_lines(ax, data: pd.DataFrame, column: str, palette: dict[str, str], error: str | None = None) -> None:
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
        color = palette[series]
        if (points["method"] == REFERENCE).all():
            level = points[column].mean()
            ax.axhline(level, color=color, linestyle="--", linewidth=1.2, label=series)
            spread = points[error].mean() if error is not None else float("nan")
            if pd.notna(spread) and spread > 0:
                ax.axhspan(level - spread, level + spread, color=color, alpha=0.12, linewidth=0)
            continue
        points = points.dropna(subset=["budget"]).sort_values("budget")
        budgets = points["budget"].astype(float)
        if error is None:
            ax.plot(budgets, points[column], marker="o", color=color, label=series)
        else:
            ax.errorbar(budgets, points[column], yerr=points[error].fillna(0.0).to_numpy(), marker="o",
                        color=color, label=series, capsize=2.5, elinewidth=0.9)
        partial = ~points["complete"].to_numpy()
        if partial.any():
            ax.plot(budgets[partial], points[column][partial], linestyle="none", marker="o",
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
    # Beside the panels, a column holds LEGEND_ROWS entries: a taller one would run off the figure.
    where = ({"loc": "outside lower center", "ncols": min(len(labels), 7)} if below
             else {"loc": "outside right upper", "ncols": -(-len(labels) // LEGEND_ROWS)})
    if not below:  # each further column widens the figure, so the panels keep their width
        figure.set_figwidth(figure.get_figwidth() + LEGEND_COLUMN_INCHES * (where["ncols"] - 1))
    figure.legend([handles[t] for t in labels], labels, frameon=False, **where)


def save(figure: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=150)
    return path


def plot_accuracy(runs: pd.DataFrame, out_dir: Path) -> Path:
    """Accuracy vs KV budget: a panel per (model, item set), a line per method, one y axis."""
    models, panels = runs["model"].unique(), panel_order(runs)
    palette = colors(runs)
    figure, axes = new_figure(len(models), len(panels), sharey=True)
    for i, model in enumerate(models):
        for j, items in enumerate(panels):
            ax = axes[i][j]
            cell = runs[(runs["model"] == model) & (runs["items"] == items)]
            draw_lines(ax, cell, "accuracy", palette, ERROR)
            ax.set_title(f"{label_of(runs, model)}: {items}", fontsize=10)
            ax.set_ylabel("accuracy (%)" if j == 0 else "")
            ax.set_ylim(0, 105)
    add_legend(figure, runs)
    return save(figure, out_dir / "accuracy_vs_budget.png")


def plot_accuracy_by_method(runs: pd.DataFrame, out_dir: Path) -> Path:
    """Accuracy vs KV budget, one panel per compressed method and (model, item set), each with the
    full cache as its reference line: one method's curve read alone, on a shared y axis. Panels wrap
    at `BY_METHOD_COLUMNS` per row; each is titled by its method, so the legend names only FullKV."""
    cells = list(runs[["model", "items"]].drop_duplicates().itertuples(index=False, name=None))
    order = panel_order(runs)
    cells.sort(key=lambda cell: (cell[0], order.index(cell[1])))
    methods = list(runs.loc[runs["method"] != REFERENCE, "series"].drop_duplicates())
    panels = [(cell, series) for cell in cells for series in methods]
    columns = min(BY_METHOD_COLUMNS, len(panels))
    palette = colors(runs)
    figure, axes = new_figure(-(-len(panels) // columns), columns, sharey=True)
    for index, ((model, items), series) in enumerate(panels):
        ax = axes[index // columns][index % columns]
        cell = runs[(runs["model"] == model) & (runs["items"] == items)]
        draw_lines(ax, cell[(cell["method"] == REFERENCE) | (cell["series"] == series)], "accuracy", palette, ERROR)
        ax.set_title(series if len(cells) == 1 else f"{series}: {label_of(runs, model)}, {items}", fontsize=10)
        ax.set_ylabel("accuracy (%)" if index % columns == 0 else "")
        ax.set_ylim(0, 105)
    for index in range(len(panels), len(axes) * columns):
        axes[index // columns][index % columns].set_visible(False)
    if len(cells) == 1:
        figure.suptitle(f"{label_of(runs, cells[0][0])}: {cells[0][1]}", fontsize=10)
    add_legend(figure, runs, only=set(runs.loc[runs["method"] == REFERENCE, "series"]))
    return save(figure, out_dir / "accuracy_by_method.png")


def plot_throughput(runs: pd.DataFrame, out_dir: Path) -> Path:
    """Tokens/s and decode-step latency p50 vs KV budget, per model, means over the datasets."""
    models = runs["model"].unique()
    palette = colors(runs)
    means = (runs.groupby(["model", "series", "budget_label"], sort=False)
             .agg(method=("method", "first"), budget=("budget", "first"), complete=("complete", "all"),
                  tokens_per_second=("tokens_per_second", "mean"), latency=(LATENCY, "mean"))
             .reset_index())
    figure, axes = new_figure(len(models), 2)
    for i, model in enumerate(models):
        data = means[means["model"] == model]
        for ax, column, title, ylabel in ((axes[i][0], "tokens_per_second", "throughput", "tokens/s"),
                                          (axes[i][1], "latency", "decode step p50", "ms")):
            draw_lines(ax, data, column, palette)
            ax.set_ylabel(ylabel)
            ax.set_title(f"{model}: {title}", fontsize=10)
    figure.suptitle("means over datasets", fontsize=10)
    add_legend(figure, runs)
    return save(figure, out_dir / "throughput_vs_budget.png")


def plot_methods(runs: pd.DataFrame, out_dir: Path) -> Path:
    """One budget: accuracy bars per item set and method (error bars: one standard error), and tokens/s
    per method (mean over datasets); the accuracy panels of the models share their y axis."""
    models, panels = runs["model"].unique(), panel_order(runs)
    palette = colors(runs)
    figure, axes = new_figure(len(models), 2)
    budgets = sorted(runs.loc[runs["method"] != REFERENCE, "budget"].dropna().astype(int).unique())
    budget = f"budget {budgets[0]}" if budgets else "full cache"
    for i, model in enumerate(models):
        data = runs[runs["model"] == model]
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
        ax.set_title(f"{label_of(runs, model)}: accuracy, {budget}", fontsize=10)
        speed = data.groupby("series", sort=False)["tokens_per_second"].mean().reindex(series)
        ax = axes[i][1]
        ax.bar(range(len(series)), speed.to_numpy(), color=[palette[s] for s in series])
        ax.set_xticks(range(len(series)), series, rotation=30, ha="right")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{label_of(runs, model)}: throughput, mean over datasets", fontsize=10)
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
        return [plot_methods(runs, out_dir)]
    return [plot_accuracy(runs, out_dir), plot_accuracy_by_method(runs, out_dir), *plot_budget_grid(runs, out_dir),
            plot_throughput(runs, out_dir)]


# --- figures for a paper: text width, small type, PNG and PDF -------------------------------------

PAPER_WIDTH = 7.0  # inches: the text width of a two-column paper
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
    """`<stem>.png` (300 dpi) and `<stem>.pdf` (without a creation date, so that a redrawn figure is
    the same file)."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_name(stem.name + ".png"), stem.with_name(stem.name + ".pdf")]
    figure.savefig(paths[0], dpi=300)
    figure.savefig(paths[1], metadata={"CreationDate": None})  # the same figure, the same file
    return paths


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
    palette = colors(runs)
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


def output_lengths(run: Path) -> list[int]:
    """The output lengths (tokens) of a run's stored samples, of the items its config covers."""
    return [record["output_tokens"] for record in in_scope(peek_records(run / GENERATIONS), planned_items(run))]


def plot_output_lengths(runs: pd.DataFrame, out_dir: Path) -> list[Path]:
    """Output lengths per method, a figure per model: a panel per KV budget (FullKV in each, as the
    reference), a violin per method over every output of the selected datasets, its median marked.
    No figure for a model none of whose runs has generations.jsonl."""
    paths = []
    palette = colors(runs)
    runs = runs.assign(lengths=[output_lengths(Path(path)) for path in runs["path"]])
    for model, data in runs.groupby("model_label", sort=True):
        if not data["lengths"].map(len).any():  # runs without their records (copied metrics only)
            continue
        reference = data[data["method"] == REFERENCE]
        budgets = [b for b in data.sort_values("budget_rank")["budget_label"].unique() if b != "-"] or ["-"]
        with matplotlib.rc_context(PAPER_STYLE):
            figure, axes = paper_figure(len(budgets), "", "output length (tokens)", columns=2, panel_height=2.2)
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
                ax.set_xticks(range(1, len(series) + 1), series, rotation=30, ha="right")
                ax.set_title("full cache only" if budget == "-" else f"KV budget {budget}")
                ax.grid(axis="y", alpha=0.3)
            datasets = data["dataset_label"].unique()
            figure.suptitle(f"{model}: output lengths, every output of {len(datasets)} "
                            f"dataset{'s' if len(datasets) > 1 else ''}", fontsize=9)
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
    models = sorted(runs["model"].unique(), key=lambda m: (model_size(m) is None, model_size(m) or 0.0, m))
    position = {model: float(i) for i, model in enumerate(models)}
    runs["x"] = runs["model"].map(position)
    panels = panel_order(runs)
    if averaged(runs):
        runs = with_average(runs, ["series", "model", "x"])
        panels.append(AVERAGE)
    palette = colors(runs)
    with matplotlib.rc_context(PAPER_STYLE):
        figure, axes = paper_figure(len(panels), "", "accuracy (%)", sharey=True)
        for ax, items in zip(axes, panels, strict=True):
            cell = runs[runs["items"] == items]
            for series, points in cell.groupby("series", sort=False):
                points = points.dropna(subset=["accuracy"]).sort_values("x")
                if (points["method"] == REFERENCE).all():
                    ax.plot(points["x"], points["accuracy"], color=palette[series], label=series, linestyle="--")
                else:
                    ax.errorbar(points["x"], points["accuracy"], yerr=points[ERROR].fillna(0.0).to_numpy(),
                                color=palette[series], label=series, marker="o", capsize=2, elinewidth=0.8)
                hollow = ~points["complete"].astype(bool).to_numpy()
                if hollow.any():
                    ax.plot(points["x"][hollow], points["accuracy"][hollow], linestyle="none", marker="o",
                            markerfacecolor="white", color=palette[series])
            ax.set_xticks(range(len(models)), [label_of(runs, m) for m in models], rotation=30, ha="right")
            ax.set_xlim(-0.3, len(models) - 0.7)
            ax.set_title(items)
            ax.set_ylim(0, 105)
            ax.grid(alpha=0.3)
        if budgets:
            figure.suptitle(f"KV budget {budgets[0]}", fontsize=9)
        add_legend(figure, runs, below=True)
    return save_paper(figure, Path(out_dir) / "model_sizes")


def label_of(runs: pd.DataFrame, model: str) -> str:
    return runs.loc[runs["model"] == model, "model_label"].dropna().iloc[0]


FIGURES = ("sweep", "lengths", "sizes", "fidelity", "acceptance")


def plot_fidelity(runs: pd.DataFrame, out_dir: Path | str) -> Path:
    """Running agreement and running KL vs output step (`evals.metrics.trailing_mean`), from the
    fidelity.jsonl of `collect`'s runs that have one: a row per (model, item set, budget), a line per method."""
    runs = prepare(runs)
    runs = runs[[(Path(path) / FIDELITY).exists() for path in runs["path"]]]
    if runs.empty:
        raise UserError(f"no selected run has {FIDELITY} (run evals.run with fidelity=true)")
    palette = colors(runs)
    cells = list(runs.groupby(["model", "items", "budget_rank", "budget_label"], sort=False).groups)
    order = panel_order(runs)
    cells.sort(key=lambda cell: (cell[0], order.index(cell[1]), cell[2]))
    figure, axes = new_figure(len(cells), 2)
    for row, (model, dataset, rank, budget) in enumerate(cells):
        cell = runs[(runs["model"] == model) & (runs["items"] == dataset) & (runs["budget_rank"] == rank)]
        for _, run in cell.iterrows():
            records = peek_records(Path(run["path"]) / FIDELITY)
            for ax, key in zip(axes[row], ("agreement", "kl"), strict=True):
                curve = trailing_mean(records, key)
                ax.plot(range(len(curve)), curve * (100.0 if key == "agreement" else 1.0), color=palette[run["series"]],
                        label=run["series"])
        agreement, kl = axes[row]
        agreement.axhline(FIDELITY_THRESHOLD * 100.0, color=REFERENCE_COLOR, linestyle=":", linewidth=1.0)
        agreement.set_ylim(0, 101)
        agreement.set_ylabel("top-1 agreement (%)")
        kl.set_yscale("symlog", linthresh=1e-3)
        kl.set_ylabel("KL(full || method), nats")
        for ax, what in ((agreement, "agreement"), (kl, "KL")):
            ax.set_title(f"{model}: {dataset}, budget {budget}: {what}", fontsize=10)
            ax.set_xlabel(f"output step (mean over the last {FIDELITY_WINDOW})")
            ax.grid(alpha=0.3)
    add_legend(figure, runs.assign(complete=True))
    return save(figure, Path(out_dir) / "fidelity_vs_step.png")


def has_fidelity(runs: pd.DataFrame) -> bool:
    return any((Path(path) / FIDELITY).exists() for path in runs["path"])


def has_verify(runs: pd.DataFrame) -> bool:
    return "verify" in runs and bool((runs["verify"] == "vericache").any())


def plot_acceptance(runs: pd.DataFrame, out_dir: Path | str) -> Path:
    """VeriCache's acceptance against the KV budget: the drafts accepted per verify round
    (`accepted_per_round`), a line per drafting method, a panel per (model, item set), the horizon as
    a dotted line. Only the runs with `verify=vericache`."""
    if not has_verify(runs):
        raise UserError("no run with verify=vericache to plot")
    runs = prepare(runs[runs["verify"] == "vericache"])
    runs["accepted_per_round"] = pd.to_numeric(runs["accepted_per_round"], errors="coerce")
    cells = list(runs[["model", "items"]].drop_duplicates().itertuples(index=False, name=None))
    palette = colors(runs)
    figure, axes = new_figure(1, len(cells), sharey=True)
    for ax, (model, items) in zip(axes[0], cells, strict=True):
        draw_lines(ax, runs[(runs["model"] == model) & (runs["items"] == items)], "accepted_per_round", palette)
        for horizon in runs["verify_horizon"].dropna().unique():
            ax.axhline(float(horizon), color=REFERENCE_COLOR, linestyle=":", linewidth=1.0)
        ax.set_title(f"{label_of(runs, model)}: {items}", fontsize=10)
        ax.set_ylabel("accepted drafts per verify round")
        ax.set_ylim(bottom=0)
    add_legend(figure, runs)
    return save(figure, Path(out_dir) / "vericache_acceptance.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals.figures", description=__doc__.splitlines()[0])
    add_filters(parser)
    parser.add_argument("--out", type=Path, default=Path("results"), help="folder for the figures")
    parser.add_argument("--only", choices=FIGURES, help="draw only this figure (default: all but sizes)")
    args = parser.parse_args(argv)
    try:
        runs, paths = load(args), []
        if args.only in (None, "sweep"):
            paths += plot_budget_sweep(runs, args.out)
        if args.only in (None, "lengths"):
            paths += plot_output_lengths(prepare(runs), args.out)
        if args.only == "sizes":
            paths += plot_model_sizes(runs, args.out)
        if args.only in (None, "fidelity") and has_fidelity(runs):
            paths.append(plot_fidelity(runs, args.out))
        if args.only in (None, "acceptance") and has_verify(runs):
            paths.append(plot_acceptance(runs, args.out))
    except UserError as error:
        return report(error)
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
