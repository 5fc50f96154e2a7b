"""The figures people read: the palette (a colour per method family, every method of conf/method/ its
own look), legends inside the canvas on figures of every method, the method x family heatmap, and
fidelity as a method x step heatmap; every figure written as PNG and PDF."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO
from helpers.reports import is_figure, write_generations, write_run
from matplotlib.image import AxesImage
from matplotlib.patches import Rectangle

from evals.report.figures import (
    main,
    plot_accuracy,
    plot_accuracy_by_method,
    plot_budget_grid,
    plot_fidelity,
    prepare,
    series_styles,
)
from evals.report.heatmap import plot_heatmap
from evals.report.palette import FAMILY_MEMBERS, family_of, method_style
from evals.report.runs import collect
from evals.report.stats import BootstrapConfig
from evals.report.table import build_table

METHODS = sorted(path.stem for path in (REPO / "conf" / "method").glob("*.yaml"))
FAMILIES = ("state", "lookup", "plan")


def test_palette_is_injective_over_every_method_config():
    looks = {method: method_style(method) for method in METHODS}
    assert None not in looks.values(), [m for m, s in looks.items() if s is None]
    assert len(set(looks.values())) == len(METHODS)
    # Every config is in a family, and a family's members share a hue (one colormap, or one colour).
    assert all(family_of(method) for method in METHODS)
    assert {method for members in FAMILY_MEMBERS.values() for method in members} == {
        m for m in METHODS if not m.startswith("ams_")}


def test_ams_over_x_is_x_dashed_and_variants_have_their_own_line():
    for method in (m for m in METHODS if m.startswith("ams_")):
        scorer, wrapped = method_style(method.removeprefix("ams_")), method_style(method)
        assert (wrapped.color, wrapped.marker, wrapped.linestyle) == (scorer.color, scorer.marker, "--")
    paper, authors, target = method_style("h2o"), method_style("h2o", "lf_repo"), method_style("rkv", "paper", "target")
    assert paper.linestyle == "-" and authors.linestyle == ":" and authors.color == paper.color
    assert target.linestyle == "-." and target.color == method_style("rkv").color


def suite_runs(root: Path, methods=METHODS, budgets=(96, 192), items=12) -> Path:
    """Every method at two budgets on three families of `items` items, with per-item records; method
    k solves the first (k + budget / 32) mod items items, FullKV all."""
    for family in FAMILIES:
        for k, method in enumerate(methods):
            for budget in [None] if method == "vanilla" else budgets:
                solved = items if budget is None else (k + budget // 32) % items
                run = write_run(root, "canary_suite", method, budget, f"canary_{family}", solved / items,
                                dataset_size=items, n_items=items, complete=True)
                write_generations(run, {f"{family}-{i}": i < solved for i in range(items)})
    return root


def inside(figure) -> bool:
    """Whether every legend of `figure` lies within its canvas once laid out and drawn."""
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    box = figure.bbox
    legends = figure.legends + [ax.get_legend() for ax in figure.axes if ax.get_legend()]
    return bool(legends) and all(
        (extent := legend.get_window_extent(renderer)).x0 >= box.x0 - 1 and extent.y0 >= box.y0 - 1
        and extent.x1 <= box.x1 + 1 and extent.y1 <= box.y1 + 1 for legend in legends)


@pytest.fixture
def drawn(monkeypatch):
    """The figures drawn, in order, instead of their files."""
    figures = []
    monkeypatch.setattr("evals.report.figures.save", lambda figure, path: figures.append(figure) or [path])
    monkeypatch.setattr("evals.report.figures.save_paper", lambda figure, stem: figures.append(figure) or [stem])
    monkeypatch.setattr("evals.report.heatmap.save_paper", lambda figure, stem: figures.append(figure) or [stem])
    return figures


def test_legends_of_every_method_stay_inside_the_figure(tmp_path, drawn):
    runs = prepare(collect(suite_runs(tmp_path / "runs")))
    plot_accuracy(runs, tmp_path)
    plot_accuracy_by_method(runs, tmp_path)
    plot_budget_grid(runs, tmp_path)
    assert len(drawn) == 3
    for figure in drawn:
        assert inside(figure)
    grid = drawn[2]
    assert [ax.get_title() for ax in grid.axes] == ["state (12)", "lookup (12)", "plan (12)", "Average"]
    # Every series drawn with its palette style: a line's colour, style and marker.
    looks = series_styles(runs)
    [panel] = [ax for ax in drawn[0].axes if ax.get_title().endswith("state (12)")]
    for line in panel.get_lines():
        if line.get_label() in looks and line.get_label() != "FullKV":
            style = looks[line.get_label()]
            assert line.get_linestyle() == style.linestyle and line.get_marker() == style.marker


def test_one_dataset_has_no_average_panel(tmp_path, drawn):
    runs = collect(suite_runs(tmp_path / "runs", methods=["vanilla", "h2o", "rkv"]))
    plot_budget_grid(prepare(runs[runs["dataset"] == "canary_lookup"]), tmp_path)
    assert [ax.get_title() for ax in drawn[0].axes] == ["lookup (12)"]


def test_heatmap(tmp_path, drawn):
    methods = ["vanilla", "streaming", "h2o", "rkv", "longflow"]
    table = build_table(collect(suite_runs(tmp_path / "runs", methods)), bootstrap=BootstrapConfig(resamples=500))
    plot_heatmap(table, tmp_path)
    [figure] = drawn
    panels = [ax for ax in figure.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == ["96 slots", "192 slots"]
    assert inside(figure)
    rows = ["FullKV", "StreamingLLM", "H2O", "R-KV", "LongFlow"]
    assert [t.get_text() for t in panels[0].get_yticklabels()] == rows  # the panels share them
    for ax, budget in zip(panels, ("96", "192"), strict=True):
        [image] = [child for child in ax.get_children() if isinstance(child, AxesImage)]
        assert image.get_array().shape == (len(methods), len(FAMILIES))  # FullKV and four methods
        boxes = [(round(p.get_x() + 0.5), round(p.get_y() + 0.5)) for p in ax.patches if isinstance(p, Rectangle)]
        bold = table.bold.xs(("canary_suite", budget), level=("Model", "Budget")).drop(columns="Avg.")
        expected = [(column, 1 + row) for row, column in zip(*np.nonzero(bold.to_numpy()), strict=True)]
        assert sorted(boxes) == sorted(expected)
        near = table.comparisons.near_best.xs(("canary_suite", budget), level=("Model", "Budget"))
        assert sum("≈" in t.get_text() for t in ax.texts) == int(near.drop(columns="Avg.").to_numpy().sum())


def test_heatmap_command_writes_png_and_pdf(tmp_path, capsys):
    root = suite_runs(tmp_path / "runs", ["vanilla", "h2o", "rkv"])
    assert main(["--runs", str(root), "--out", str(tmp_path / "figs"), "--only", "heatmap"]) == 0
    printed = capsys.readouterr().out.split()
    assert [Path(p).name for p in printed] == ["heatmap_canary_suite.png", "heatmap_canary_suite.pdf"]
    assert all(is_figure(Path(p)) for p in printed)


def test_fidelity_is_a_method_by_step_heatmap(tmp_path, drawn):
    root = tmp_path / "runs"
    write_run(root, "canary", "vanilla", None, "canary", 1.0)
    rng = np.random.default_rng(0)
    methods = ["streaming", "h2o", "rkv", "longflow", "ams_rkv"]
    for method in methods:
        run = write_run(root, "canary", method, 96, "canary", 0.5)
        records = [{"id": str(i), "agreement": (rng.random(n) < 0.9).astype(int).tolist(), "kl": rng.random(n).tolist()}
                   for i, n in enumerate((50, 80))]
        (run / "fidelity.jsonl").write_text("\n".join(map(json.dumps, records)) + "\n")
    plot_fidelity(collect(root), tmp_path)
    [figure] = drawn
    images = [child for ax in figure.axes for child in ax.get_children() if isinstance(child, AxesImage)]
    assert [image.get_array().shape for image in images] == [(len(methods), 80)] * 2
    assert inside(figure)


def test_every_figure_is_png_and_pdf(tmp_path, capsys):
    root = suite_runs(tmp_path / "runs", ["vanilla", "h2o", "rkv"])
    assert main(["--runs", str(root), "--out", str(tmp_path / "figs"), "--only", "sweep"]) == 0
    printed = [Path(p) for p in capsys.readouterr().out.split()]
    stems = {p.stem for p in printed}
    assert {p.suffix for p in printed} == {".png", ".pdf"} and len(printed) == 2 * len(stems)
    assert all(is_figure(p) for p in printed)


def test_acceptance_from_a_table_csv_keeps_its_cells_and_marks(tmp_path, capsys):
    """`--only acceptance --table`: a point per (method row, item-set column) of the CSV as written, the
    standard errors, intervals and average left out, a cell that `Partial` names drawn hollow."""
    from evals.report.figures import table_points

    csv = tmp_path / "acceptance.csv"
    csv.write_text(
        "Model,Budget,Method,canary (200),canary (200) SE,canary (200) vs FullKV,canary (200) vs FullKV low,"
        "state (20),Avg.,Partial,Dirty\n"
        "canary,96,H2O + VeriCache,15.25,0.4,-1.0,-2.0,9.5,12.375,state (20),\n"
        "canary,192,H2O + VeriCache,23.0,0.3,-0.5,-1.0,11.0,17.0,,\n"
        "canary,96,AMS (TOVA) + VeriCache,11.5,0.5,-2.0,-3.0,7.0,9.25,,\n")
    points = table_points(csv)
    assert sorted(points["items"].unique()) == ["canary (200)", "state (20)"]
    cells = {(row.series, row.budget, row.items): (row.accepted_per_round, row.complete) for row in points.itertuples()}
    assert cells == {("H2O + VeriCache", 96, "canary (200)"): (15.25, True),
                     ("H2O + VeriCache", 96, "state (20)"): (9.5, False),
                     ("H2O + VeriCache", 192, "canary (200)"): (23.0, True),
                     ("H2O + VeriCache", 192, "state (20)"): (11.0, True),
                     ("AMS (TOVA) + VeriCache", 96, "canary (200)"): (11.5, True),
                     ("AMS (TOVA) + VeriCache", 96, "state (20)"): (7.0, True)}
    assert set(zip(points["series"], points["method"], strict=True)) == {("H2O + VeriCache", "h2o"),
                                                                         ("AMS (TOVA) + VeriCache", "ams_tova")}
    assert main(["--only", "acceptance", "--table", str(csv), "--horizon", "25", "--out", str(tmp_path)]) == 0
    assert is_figure(tmp_path / "vericache_acceptance.png")
    assert is_figure(tmp_path / "vericache_acceptance.pdf")
    with pytest.raises(SystemExit):
        main(["--only", "sweep", "--table", str(csv)])
    assert main(["--only", "acceptance", "--table", str(tmp_path / "none.csv")]) == 2
