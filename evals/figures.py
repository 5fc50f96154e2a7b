"""Figures from run directories: the paper's budget sweep, speed per budget, teacher-forced fidelity.

    python -m evals.figures [--runs results/runs] [--out results/] [--model M ...] [--dataset D ...]
                            [--generation G]

With several KV budgets: `accuracy_vs_budget.png` (one panel per model and dataset, one line per
method, FullKV as a dashed horizontal line), `accuracy_by_method.png` (the same curves, one panel per
method, each against the FullKV line) and `throughput_vs_budget.png` (tokens/s and decode-step
latency p50 per budget, means over the datasets). With one budget: `methods.png`, bars of accuracy
and tokens/s per method. Hollow markers are incomplete runs. When runs have teacher-forced records
(`fidelity=true`), also `fidelity_vs_step.png`: the running agreement with the full cache's greedy
token and the running KL(full || method) per output step, a line per method, a row per (model,
dataset, budget). Runs are read, filtered and deduplicated (newest wins) as for `evals.table`.

Figures are drawn on `matplotlib.figure.Figure` with an Agg canvas, never through pyplot: no global
state and no display needed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from evals.metrics import FIDELITY_THRESHOLD, FIDELITY_WINDOW, trailing_mean
from evals.store import FIDELITY, read_records
from evals.table import REFERENCE, add_filters, dataset_sort_key, keep_newest, label, load
from longflow.errors import UserError, report

REFERENCE_COLOR = "0.25"
PANEL = (4.0, 3.0)  # inches per panel
LATENCY = "step_latency_ms.p50"
HATCH = "//"  # bars of incomplete runs
BY_METHOD_COLUMNS = 3


def prepare(runs: pd.DataFrame) -> pd.DataFrame:
    """`collect`'s frame with display labels, one run per (model, series, budget, dataset), and
    `series`: the method's label, plus the generation config when the runs have several."""
    if runs.empty:
        raise UserError("no runs to plot (check --runs and the --model/--dataset/--generation filters)")
    runs = label(runs)
    several = runs["generation"].nunique() > 1
    runs["series"] = [f"{m} [{g}]" if several else m
                      for m, g in zip(runs["method_label"], runs["generation"], strict=True)]
    runs, notes = keep_newest(runs, ["model", "series", "budget_label", "dataset_label"])
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    for column in ("accuracy", "tokens_per_second", LATENCY):
        runs[column] = pd.to_numeric(runs[column], errors="coerce") if column in runs else float("nan")
    runs["accuracy"] = runs["accuracy"] * 100.0  # a fraction; shown in percent as in the table
    return runs.sort_values(["model", "method_rank", "method", "series", "budget_rank"])


def colors(runs: pd.DataFrame) -> dict[str, str]:
    """A fixed colour per series, in table order, so every figure of a call agrees."""
    compressed = list(runs.loc[runs["method"] != REFERENCE, "series"].drop_duplicates())
    mapping = {s: f"C{i % 10}" for i, s in enumerate(compressed)}
    mapping.update({s: REFERENCE_COLOR for s in runs.loc[runs["method"] == REFERENCE, "series"].unique()})
    return mapping


def dataset_order(runs: pd.DataFrame) -> list[str]:
    return sorted(runs["dataset_label"].unique(), key=dataset_sort_key)


def new_figure(rows: int, columns: int) -> tuple[Figure, list[list]]:
    figure = Figure(figsize=(PANEL[0] * columns + 1.8, PANEL[1] * rows), layout="constrained")
    FigureCanvasAgg(figure)
    return figure, figure.subplots(rows, columns, squeeze=False)


def draw_lines(ax, data: pd.DataFrame, column: str, palette: dict[str, str]) -> None:
    """One line per series over budget; the full cache as a dashed horizontal line; hollow markers
    for incomplete runs."""
    for series, points in data.groupby("series", sort=False):
        points = points.dropna(subset=[column])
        if points.empty:
            continue
        color = palette[series]
        if (points["method"] == REFERENCE).all():
            ax.axhline(points[column].mean(), color=color, linestyle="--", linewidth=1.2, label=series)
            continue
        points = points.dropna(subset=["budget"]).sort_values("budget")
        budgets = points["budget"].astype(float)
        ax.plot(budgets, points[column], marker="o", color=color, label=series)
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


def add_legend(figure: Figure, runs: pd.DataFrame, bars: bool = False) -> None:
    """One legend for the figure, beside the panels; an entry for incomplete runs when there are any."""
    handles, labels = {}, []
    for ax in figure.axes:
        for handle, text in zip(*ax.get_legend_handles_labels(), strict=True):
            if text not in handles:
                handles[text] = handle
                labels.append(text)
    if not runs["complete"].all():
        hollow = Line2D([], [], linestyle="none", marker="o", color="0.4", markerfacecolor="white")
        handles["incomplete run"] = Patch(facecolor="white", edgecolor="0.4", hatch=HATCH) if bars else hollow
        labels.append("incomplete run")
    figure.legend([handles[t] for t in labels], labels, loc="outside right upper", frameon=False)


def save(figure: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=150)
    return path


def plot_accuracy(runs: pd.DataFrame, out_dir: Path) -> Path:
    """Accuracy vs KV budget: a panel per (model, dataset), a line per method."""
    models, datasets = runs["model"].unique(), dataset_order(runs)
    palette = colors(runs)
    figure, axes = new_figure(len(models), len(datasets))
    for i, model in enumerate(models):
        for j, dataset in enumerate(datasets):
            ax = axes[i][j]
            cell = runs[(runs["model"] == model) & (runs["dataset_label"] == dataset)]
            draw_lines(ax, cell, "accuracy", palette)
            size = cell["dataset_size"].max()
            ax.set_title(f"{model}: {dataset}" + ("" if pd.isna(size) else f" ({int(size)})"), fontsize=10)
            ax.set_ylabel("accuracy (%)")
            ax.set_ylim(bottom=0)
    add_legend(figure, runs)
    return save(figure, out_dir / "accuracy_vs_budget.png")


def plot_accuracy_by_method(runs: pd.DataFrame, out_dir: Path) -> Path:
    """Accuracy vs KV budget, one panel per compressed method and (model, dataset), each with the full
    cache as its reference line: one method's curve read alone, on a shared y axis. Panels wrap at
    `BY_METHOD_COLUMNS` per row."""
    cells = list(runs[["model", "dataset_label"]].drop_duplicates().itertuples(index=False, name=None))
    methods = list(runs.loc[runs["method"] != REFERENCE, "series"].drop_duplicates())
    panels = [(cell, series) for cell in cells for series in methods]
    columns = min(BY_METHOD_COLUMNS, len(panels))
    palette = colors(runs)
    figure, axes = new_figure(-(-len(panels) // columns), columns)
    for index, ((model, dataset), series) in enumerate(panels):
        ax = axes[index // columns][index % columns]
        cell = runs[(runs["model"] == model) & (runs["dataset_label"] == dataset)]
        draw_lines(ax, cell[(cell["method"] == REFERENCE) | (cell["series"] == series)], "accuracy", palette)
        ax.set_title(series if len(cells) == 1 else f"{series}: {model}, {dataset}", fontsize=10)
        ax.set_ylabel("accuracy (%)")
        ax.set_ylim(0, 105)
    for index in range(len(panels), len(axes) * columns):
        axes[index // columns][index % columns].set_visible(False)
    if len(cells) == 1:
        size = runs["dataset_size"].max()
        figure.suptitle(f"{cells[0][0]}: {cells[0][1]}" + ("" if pd.isna(size) else f" ({int(size)})"), fontsize=10)
    add_legend(figure, runs)
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
    """One budget: accuracy bars per dataset and method, and tokens/s per method (mean over datasets)."""
    models, datasets = runs["model"].unique(), dataset_order(runs)
    palette = colors(runs)
    figure, axes = new_figure(len(models), 2)
    budgets = sorted(runs.loc[runs["method"] != REFERENCE, "budget"].dropna().astype(int).unique())
    budget = f"budget {budgets[0]}" if budgets else "full cache"
    for i, model in enumerate(models):
        data = runs[runs["model"] == model]
        series = list(data["series"].drop_duplicates())
        order = [d for d in datasets if d in set(data["dataset_label"])]
        accuracy, complete = (data.pivot(index="dataset_label", columns="series", values=column)
                              .reindex(index=order, columns=series) for column in ("accuracy", "complete"))
        width = 0.8 / len(series)
        ax = axes[i][0]
        for k, name in enumerate(series):
            positions = [x + (k - (len(series) - 1) / 2) * width for x in range(len(order))]
            hatches = [HATCH if done is False else None for done in complete[name]]
            ax.bar(positions, accuracy[name], width=width, color=palette[name], label=name, hatch=hatches,
                   edgecolor="white")
        ax.set_xticks(range(len(order)), order)
        ax.set_ylabel("accuracy (%)")
        ax.set_ylim(0, max(100.0, float(accuracy.max().max()) if accuracy.size else 0.0))
        ax.set_title(f"{model}: accuracy, {budget}", fontsize=10)
        speed = data.groupby("series", sort=False)["tokens_per_second"].mean().reindex(series)
        ax = axes[i][1]
        ax.bar(range(len(series)), speed.to_numpy(), color=[palette[s] for s in series])
        ax.set_xticks(range(len(series)), series, rotation=30, ha="right")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{model}: throughput, mean over datasets", fontsize=10)
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
    return [plot_accuracy(runs, out_dir), plot_accuracy_by_method(runs, out_dir), plot_throughput(runs, out_dir)]


def plot_fidelity(runs: pd.DataFrame, out_dir: Path | str) -> Path:
    """Running agreement and running KL vs output step (`evals.metrics.trailing_mean`), from the
    fidelity.jsonl of `collect`'s runs that have one: a row per (model, dataset, budget), a line per method."""
    runs = prepare(runs)
    runs = runs[[(Path(path) / FIDELITY).exists() for path in runs["path"]]]
    if runs.empty:
        raise UserError(f"no selected run has {FIDELITY} (run evals.run with fidelity=true)")
    palette = colors(runs)
    cells = list(runs.groupby(["model", "dataset_label", "budget_rank", "budget_label"], sort=False).groups)
    cells.sort(key=lambda cell: (cell[0], dataset_sort_key(cell[1]), cell[2]))
    figure, axes = new_figure(len(cells), 2)
    for row, (model, dataset, rank, budget) in enumerate(cells):
        cell = runs[(runs["model"] == model) & (runs["dataset_label"] == dataset) & (runs["budget_rank"] == rank)]
        for _, run in cell.iterrows():
            records = read_records(Path(run["path"]) / FIDELITY)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals.figures", description=__doc__.splitlines()[0])
    add_filters(parser)
    parser.add_argument("--out", type=Path, default=Path("results"), help="folder for the PNG files")
    args = parser.parse_args(argv)
    try:
        runs = load(args)
        paths = plot_budget_sweep(runs, args.out)
        if has_fidelity(runs):
            paths.append(plot_fidelity(runs, args.out))
    except UserError as error:
        return report(error)
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
