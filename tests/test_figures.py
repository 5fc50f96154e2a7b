"""`evals.report.figures` on fake run directories: which figures are written (real PNG and PDF files), the
panels of the paper's figures, the averages they plot, and the output lengths they read."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from helpers.reports import is_figure, is_png
from matplotlib.container import ErrorbarContainer

from evals.report.figures import (
    AVERAGE,
    colors,
    main,
    output_lengths,
    plot_budget_grid,
    plot_budget_sweep,
    plot_model_sizes,
    plot_output_lengths,
    prepare,
    with_average,
)
from evals.report.runs import collect
from longflow.errors import UserError


def write_run(root, model, method, budget, dataset, accuracy, *, complete=True, variant="paper",
              generation="greedy", tag=""):
    size = {"gsm8k": 1319, "aime24": 30, "math500": 500}[dataset]
    budget_tag = "full" if budget is None else f"b{budget}"
    run_id = f"{model}__{method}__{budget_tag}__{generation}__{dataset}__{variant}{tag}"
    metrics = {
        "run_id": run_id, "model": model, "method": method, "variant": variant, "budget": budget,
        "generation": generation, "dataset": dataset, "dataset_size": size,
        "n_items": size if complete else 2, "n_samples": 1, "complete": complete, "accuracy": accuracy,
        "tokens_per_second": 50.0 + (budget or 4096) / 100, "ttft_seconds_mean": 0.05,
        "step_latency_ms": {"p50": 3.0 + (budget or 4096) / 1000, "p99": 5.0, "mean": 3.5},
    }
    (root / run_id).mkdir(parents=True)
    (root / run_id / "metrics.json").write_text(json.dumps(metrics))
    return root / run_id


def sweep(root, budgets):
    for model in ("tiny_qwen3", "tiny_llama"):
        for dataset in ("gsm8k", "aime24"):
            write_run(root, model, "vanilla", None, dataset, 0.6)
            for budget in budgets:
                for rank, method in enumerate(("streaming", "h2o", "rkv", "longflow")):
                    write_run(root, model, method, budget, dataset, min(1.0, budget / 1024 + rank / 20),
                              complete=not (method == "h2o" and budget == budgets[0]))
            write_run(root, model, "h2o", budgets[-1], dataset, 0.3, variant="lf_repo")
    return root


def test_budget_sweep(tmp_path):
    runs = collect(sweep(tmp_path / "runs", [128, 256, 512]))
    paths = plot_budget_sweep(runs, tmp_path / "figs")
    assert [p.name for p in paths] == ["accuracy_vs_budget.png", "accuracy_vs_budget.pdf",
                                       "accuracy_by_method.png", "accuracy_by_method.pdf",
                                       "budget_grid_tiny_llama.png", "budget_grid_tiny_llama.pdf",
                                       "budget_grid_tiny_qwen3.png", "budget_grid_tiny_qwen3.pdf",
                                       "throughput_vs_budget.png", "throughput_vs_budget.pdf"]
    assert all(is_figure(p) for p in paths)
    prepared = prepare(runs)
    assert set(prepared["series"]) == {"FullKV", "StreamingLLM", "H2O", "H2O (lf_repo)", "R-KV", "LongFlow"}
    assert prepared.loc[prepared["method"] == "vanilla", "accuracy"].eq(60.0).all()


def test_single_budget_bars(tmp_path, capsys):
    root = sweep(tmp_path / "runs", [256])
    assert main(["--runs", str(root), "--out", str(tmp_path / "figs"), "--model", "tiny_qwen3"]) == 0
    printed = capsys.readouterr().out.split()
    assert [p.rsplit("/", 1)[-1] for p in printed] == ["methods.png", "methods.pdf"]
    assert is_png(tmp_path / "figs" / "methods.png")


def test_several_generations_are_separate_series(tmp_path):
    root = sweep(tmp_path / "runs", [128, 256])
    write_run(root, "tiny_qwen3", "longflow", 128, "gsm8k", 0.5, generation="sampling")
    prepared = prepare(collect(root))
    assert {"LongFlow [sampling]", "LongFlow [greedy]", "FullKV [greedy]"} <= set(prepared["series"])


def test_no_runs(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError):
        plot_budget_sweep(collect(tmp_path / "empty"), tmp_path / "figs")
    assert main(["--runs", str(tmp_path / "empty")]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_budget_grid_has_a_panel_per_dataset_and_the_average(tmp_path, monkeypatch):
    root = sweep(tmp_path / "runs", [128, 256])
    for method in ("vanilla", "h2o"):
        write_run(root, "tiny_qwen3", method, None if method == "vanilla" else 128, "math500", 0.1)
    figures = []
    monkeypatch.setattr("evals.report.figures.save_paper", lambda figure, stem: figures.append(figure) or [stem])
    plot_budget_grid(prepare(collect(root).query("model == 'tiny_qwen3'")), tmp_path)
    [figure] = figures
    assert [ax.get_title() for ax in figure.axes] == ["AIME24 (30)", "GSM8K (1319)", "MATH-500 (500)", AVERAGE]
    assert figure.get_size_inches()[0] == pytest.approx(7.0)  # a paper's text width


def test_average_is_over_every_dataset():
    runs = pd.DataFrame({"series": ["A", "A", "B", "B", "C"], "budget_label": ["64"] * 5,
                         "items": ["x", "y", "x", "y", "x"], "accuracy": [10.0, 30.0, 50.0, 70.0, 90.0],
                         "accuracy_se": [3.0, 4.0, 1.0, float("nan"), 1.0],
                         "complete": [True, True, True, False, True], "method": ["a", "a", "b", "b", "c"],
                         "budget": [64] * 5})
    average = with_average(runs, ["series", "budget_label"]).query(f"items == '{AVERAGE}'").set_index("series")
    assert average["accuracy"].to_dict() == {"A": 20.0, "B": 60.0}  # C lacks y
    assert average["complete"].to_dict() == {"A": True, "B": False}
    assert average.loc["A", "accuracy_se"] == pytest.approx(2.5)  # sqrt(3^2 + 4^2) / 2
    assert pd.isna(average.loc["B", "accuracy_se"])  # one dataset without one: none for the mean


def test_output_lengths(tmp_path, capsys):
    root = sweep(tmp_path / "runs", [128, 256])
    run = write_run(root, "tiny_qwen3", "longflow", 512, "gsm8k", 0.5)
    lines = [json.dumps({"id": str(i), "sample": 0, "output_tokens": 100 * i}) for i in range(4)]
    generations = run / "generations.jsonl"
    generations.write_text("\n".join(lines) + "\n" + '{"id": "4", "sam')  # a live run's torn last line
    (run / "items.json").write_text(json.dumps(["1", "2", "3"]))  # item 0 was a larger limit's
    assert output_lengths(run) == [100, 200, 300]
    assert generations.read_text().endswith('"sam')  # read only: a writer's half line is left alone
    paths = plot_output_lengths(prepare(collect(root)), tmp_path / "figs")
    # tiny_llama's runs have no generations.jsonl: no figure of nothing
    assert [p.name for p in paths] == ["output_lengths_tiny_qwen3.png", "output_lengths_tiny_qwen3.pdf"]
    assert all(is_figure(p) for p in paths)


def test_model_sizes(tmp_path, monkeypatch, capsys):
    root = tmp_path / "runs"
    for model in ("r1_distill_qwen_14b", "r1_distill_qwen_1_5b", "r1_distill_llama_8b"):
        for method, budget in (("vanilla", None), ("h2o", 256), ("longflow", 256)):
            for dataset in ("gsm8k", "aime24"):
                write_run(root, model, method, budget, dataset, 0.5)
    figures = []
    monkeypatch.setattr("evals.report.figures.save_paper", lambda figure, stem: figures.append(figure) or [stem])
    plot_model_sizes(collect(root), tmp_path)
    [figure] = figures
    assert [ax.get_title() for ax in figure.axes] == ["AIME24 (30)", "GSM8K (1319)", AVERAGE]
    assert [t.get_text() for t in figure.axes[0].get_xticklabels()] == [
        "R1-Distill-Qwen-1.5B", "R1-Distill-Llama-8B", "R1-Distill-Qwen-14B"]  # smallest first
    write_run(root, "r1_distill_qwen_14b", "h2o", 512, "gsm8k", 0.5)
    with pytest.raises(UserError, match="budgets 256, 512; choose one with --budget"):
        plot_model_sizes(collect(root), tmp_path)
    monkeypatch.undo()
    assert main(["--runs", str(root), "--out", str(tmp_path / "f"), "--only", "sizes", "--budget", "256"]) == 0
    assert [p.rsplit("/", 1)[-1] for p in capsys.readouterr().out.split()] == ["model_sizes.png", "model_sizes.pdf"]
    assert is_figure(tmp_path / "f" / "model_sizes.pdf")


@pytest.mark.parametrize("methods", [6, 14])
def test_every_series_has_its_own_colour(methods):
    """Up to 20 compressed series get distinct colours (matplotlib's default cycle has only 10)."""
    runs = pd.DataFrame({"method": ["vanilla"] + [f"m{i}" for i in range(methods)],
                         "series": ["FullKV"] + [f"M{i}" for i in range(methods)]})
    palette = colors(runs)
    assert len(set(palette.values())) == methods + 1


def canary_run(root, method, budget, accuracy, items, *, mtime=None):
    """A canary run of the first `items` of the 200-item split, its items.json written."""
    run = write_run(root, "canary", method, budget, "gsm8k", accuracy, tag=f"{items}{mtime or ''}")
    metrics = json.loads((run / "metrics.json").read_text())
    metrics.update(dataset="canary", dataset_size=200, n_items=items, complete=False)
    (run / "metrics.json").write_text(json.dumps(metrics))
    (run / "items.json").write_text(json.dumps([str(i) for i in range(items)]))
    return run


def drawn(monkeypatch):
    """The figures drawn, in order, instead of their files."""
    figures = []
    monkeypatch.setattr("evals.report.figures.save", lambda figure, path: figures.append(figure) or [path])
    monkeypatch.setattr("evals.report.figures.save_paper", lambda figure, stem: figures.append(figure) or [stem])
    return figures


def test_figures_count_what_was_run(tmp_path, monkeypatch):
    """Issue 28's traps: runs of 16 and of 8 canary items are separate panels titled with the items
    run; every accuracy has an error bar; compared panels share a y axis; one legend per figure; no
    "Average" of one dataset; a panel without a FullKV run says so."""
    root = tmp_path / "runs"
    canary_run(root, "vanilla", None, 1.0, 16)
    for budget, accuracy in ((96, 0.25), (192, 0.5)):
        canary_run(root, "h2o", budget, accuracy, 16)
        canary_run(root, "longflow", budget, accuracy / 2, 16)
        canary_run(root, "h2o", budget, accuracy, 8)
    figures = drawn(monkeypatch)
    plot_budget_sweep(collect(root), tmp_path)
    by_budget, by_method, grid, _ = figures
    assert [ax.get_title() for ax in by_budget.axes] == ["canary: canary (8 of 200)", "canary: canary (16 of 200)"]
    assert [ax.get_title() for ax in grid.axes] == ["canary (8 of 200)", "canary (16 of 200)"]  # no Average
    assert by_method._suptitle is None and [ax.get_title() for ax in by_method.axes if ax.get_visible()] == [
        "H2O: canary, canary (8 of 200)", "LongFlow: canary, canary (8 of 200)",
        "H2O: canary, canary (16 of 200)", "LongFlow: canary, canary (16 of 200)"]
    for figure in (by_budget, by_method, grid):
        assert len(figure.legends) == 1 and not any(ax.get_legend() for ax in figure.axes)
        first, *others = [ax for ax in figure.axes if ax.get_visible()]
        assert all(first.get_shared_y_axes().joined(first, ax) for ax in others)
    eight, sixteen = by_budget.axes
    [h2o] = [c for c in sixteen.containers if isinstance(c, ErrorbarContainer) and c.get_label() == "H2O"]
    _, caps, (bars,) = h2o.lines
    # Binomial standard errors of 4 and 8 correct of 16, in percent, around the points.
    lengths = sorted(float(segment[1][1] - segment[0][1]) / 2 for segment in bars.get_segments())
    assert lengths == pytest.approx([100 * (0.25 * 0.75 / 16) ** 0.5, 100 * (0.5 * 0.5 / 16) ** 0.5])
    assert [t.get_text() for t in eight.texts] == ["no FullKV run"] and not sixteen.texts
    legend = [t.get_text() for t in by_method.legends[0].get_texts()]
    assert legend == ["FullKV", "±1 standard error"]  # each panel's title names its method


def test_average_panel_needs_two_datasets(tmp_path, monkeypatch):
    root = sweep(tmp_path / "runs", [128, 256])
    figures = drawn(monkeypatch)
    plot_budget_grid(prepare(collect(root).query("model == 'tiny_qwen3' and dataset == 'gsm8k'")), tmp_path)
    [figure] = figures
    assert [ax.get_title() for ax in figure.axes] == ["GSM8K (1319)"]


def test_lengths_and_throughput_are_titled_with_the_items_run_and_share_their_y_axes(tmp_path, monkeypatch):
    """README: every figure is titled with the items run, and panels that are compared share a y axis
    (the output lengths of two budgets, the throughput of two models)."""
    root = tmp_path / "runs"
    for method, budget, length in (("vanilla", None, 900), ("h2o", 96, 100), ("h2o", 192, 400)):
        run = canary_run(root, method, budget, 0.5, 16)
        (run / "generations.jsonl").write_text("".join(
            json.dumps({"id": str(i), "sample": 0, "output_tokens": length + i}) + "\n" for i in range(16)))
    other = canary_run(root, "h2o", 96, 0.5, 16, mtime=1)
    metrics = json.loads((other / "metrics.json").read_text())
    (other / "metrics.json").write_text(json.dumps({**metrics, "model": "tiny_llama", "tokens_per_second": 9e3}))
    figures = drawn(monkeypatch)
    runs = collect(root)
    plot_budget_sweep(runs, tmp_path)
    plot_output_lengths(prepare(runs), tmp_path)
    throughput, lengths = figures[-2], figures[-1]
    assert throughput._suptitle.get_text() == "canary (16 of 200)"
    speed = [ax for ax in throughput.axes if ax.get_ylabel() == "tokens/s"]
    assert len(speed) == 2 and speed[0].get_shared_y_axes().joined(*speed)
    assert lengths._suptitle.get_text() == "canary: output lengths, every output of canary (16 of 200)"
    first, second = lengths.axes
    assert first.get_shared_y_axes().joined(first, second) and first.get_ylim() == second.get_ylim()
