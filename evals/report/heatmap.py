"""Where each method wins: a table's metric as a method x item-set heatmap, a panel per KV budget.

    python -m evals.report.figures --runs DIR --out DIR --only heatmap [--bootstrap B]
    python -m evals.report.figures --recall FILE.csv --metric recall_layers --out DIR --only heatmap

A figure per model, `heatmap_<model>.png|pdf` (`heatmap_<model>_<metric>` for a metric other than
accuracy): the rows are FullKV and the compressed methods in the table's order, the columns the item
sets (the canary suite's families), one panel per budget on a shared colour scale, each cell
annotated with its number. A box marks the best compressed cell of its budget and column (the
table's bold); with `--bootstrap`, a `≈` the cells that cannot be told from it (the interval of
their paired difference includes 0, `evals.report.significance`).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from evals.report.figures import file_name, save_paper
from evals.report.table import AVG, METRIC_TITLES, NEAR_BEST, Table, is_percent

CELL_INCHES = (0.7, 0.24)  # width and height of one cell
LABEL_INCHES = 1.7  # room for the method names left of the first panel
COLOURMAP = "viridis"
PERCENT_RANGE = (0.0, 100.0)
MISSING = "-"
MIN_WIDTH = 6.0  # inches: room for the legend's lines under the panels


def row_label(key) -> str:
    return " ".join(map(str, key)) if isinstance(key, tuple) else str(key)


def panel_frame(table: Table, model: str, budget: str, rows: list[str] | None = None) -> pd.DataFrame:
    """`[rows, item sets]` values of one model's budget block, FullKV's row on top (`rows`: method
    labels, the same for every panel, default the block's own); NaN where a method has no run."""
    values = table.values[~table.delta.to_numpy()].drop(columns=[AVG], errors="ignore")
    block = values.xs(model, level="Model")
    reference = block.xs("-", level="Budget") if "-" in block.index.get_level_values("Budget") else None
    compressed = block.xs(budget, level="Budget")
    frame = compressed if reference is None else pd.concat([reference, compressed])
    frame.index = [row_label(key) for key in frame.index]
    frame = frame[~frame.index.duplicated()]
    return frame if rows is None else frame.reindex(rows)


def marks_frame(frame: pd.DataFrame, table: Table, model: str, budget: str, which: str) -> pd.DataFrame:
    """The table's `bold` or the comparisons' `near_best` cells of one budget block, like `frame`."""
    source = table.bold if which == "bold" else table.comparisons.near_best
    block = source.drop(columns=[AVG], errors="ignore").xs((model, budget), level=("Model", "Budget"))
    block.index = [row_label(key) for key in block.index]
    return block[~block.index.duplicated()].reindex(index=frame.index, columns=frame.columns).fillna(False).astype(bool)


def text_colour(rgba) -> str:
    """Black on light cells, white on dark ones (relative luminance, ITU-R BT.709 weights)."""
    red, green, blue = rgba[:3]
    return "black" if 0.2126 * red + 0.7152 * green + 0.0722 * blue > 0.5 else "white"


def plot_heatmap(table: Table, out_dir: Path | str) -> list[Path]:
    """The heatmaps of a built table (`evals.report.table.build_table`), a figure per model."""
    paths = []
    scale = PERCENT_RANGE if is_percent(table.metric) else (float(np.nanmin(table.values)),
                                                             float(np.nanmax(table.values)))
    norm = matplotlib.colors.Normalize(*scale)
    colours = matplotlib.colormaps[COLOURMAP]
    title = METRIC_TITLES.get(table.metric, table.metric)
    for model in table.models:
        budgets = [b for b in dict.fromkeys(table.values.xs(model, level="Model").index.get_level_values("Budget"))
                   if b != "-"]
        rows = list(dict.fromkeys(label for budget in budgets for label in panel_frame(table, model, budget).index))
        columns = [c for c in table.values.columns if c != AVG]
        width = max(MIN_WIDTH, LABEL_INCHES + len(budgets) * (CELL_INCHES[0] * len(columns) + 0.25) + 1.0)
        height = CELL_INCHES[1] * len(rows) + 1.6
        figure = Figure(figsize=(width, height), layout="constrained")
        FigureCanvasAgg(figure)
        axes = figure.subplots(1, len(budgets), squeeze=False, sharey=True)[0]
        for ax, budget in zip(axes, budgets, strict=True):
            frame = panel_frame(table, model, budget, rows)
            bold = marks_frame(frame, table, model, budget, "bold")
            near = (marks_frame(frame, table, model, budget, "near") if table.comparisons is not None
                    else pd.DataFrame(False, index=frame.index, columns=frame.columns))
            image = ax.imshow(frame.to_numpy(dtype=float), cmap=colours, norm=norm, aspect="auto",
                              interpolation="nearest")
            for (i, j), value in np.ndenumerate(frame.to_numpy(dtype=float)):
                if np.isnan(value):
                    ax.text(j, i, MISSING, ha="center", va="center", fontsize=7, color="0.4")
                    continue
                text = f"{value:.{table.decimals}f}" + (NEAR_BEST if near.iat[i, j] else "")
                ax.text(j, i, text, ha="center", va="center", fontsize=7, color=text_colour(colours(norm(value))),
                        fontweight="bold" if bold.iat[i, j] else "normal")
                if bold.iat[i, j]:
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.6))
            ax.set_xticks(range(len(columns)), columns, rotation=40, ha="right", fontsize=8)
            ax.set_yticks(range(len(rows)), rows, fontsize=8)
            ax.set_title(f"{budget} slots", fontsize=9)
            ax.tick_params(length=0)
        figure.colorbar(image, ax=list(axes), label=title, shrink=0.9, pad=0.01)
        figure.suptitle(f"{model}: {title}", fontsize=9)
        handles = [Patch(facecolor="white", edgecolor="red", linewidth=1.6)]
        labels = ["the best compressed method of its budget and column"]
        if table.comparisons is not None:
            handles.append(Patch(facecolor="white", edgecolor="white"))
            level = f"{100 * table.comparisons.config.confidence:g}%"
            labels.append(f"{NEAR_BEST} cannot be told from it: the {level} paired bootstrap interval\n"
                          "of the difference includes 0")
        figure.legend(handles, labels, loc="outside lower center", frameon=False, fontsize=8)
        suffix = "" if table.metric == "accuracy" else f"_{table.metric}"
        paths += save_paper(figure, Path(out_dir) / f"heatmap_{file_name(model)}{suffix}")
    return paths
