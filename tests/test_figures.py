"""`evals.figures` on fake run directories: which PNGs are written, and that they are real images."""

from __future__ import annotations

import json

import pytest

from evals.figures import main, plot_budget_sweep, prepare
from evals.table import collect
from longflow.errors import UserError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(root, model, method, budget, dataset, accuracy, *, complete=True, variant="paper",
              generation="greedy"):
    size = {"gsm8k": 1319, "aime24": 30}[dataset]
    tag = "full" if budget is None else f"b{budget}"
    run_id = f"{model}__{method}__{tag}__{generation}__{dataset}__{variant}"
    metrics = {
        "run_id": run_id, "model": model, "method": method, "variant": variant, "budget": budget,
        "generation": generation, "dataset": dataset, "dataset_size": size,
        "n_items": size if complete else 2, "n_samples": 1, "complete": complete, "accuracy": accuracy,
        "tokens_per_second": 50.0 + (budget or 4096) / 100, "ttft_seconds_mean": 0.05,
        "step_latency_ms": {"p50": 3.0 + (budget or 4096) / 1000, "p99": 5.0, "mean": 3.5},
    }
    (root / run_id).mkdir(parents=True)
    (root / run_id / "metrics.json").write_text(json.dumps(metrics))


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


def is_png(path) -> bool:
    return path.stat().st_size > 1000 and path.read_bytes()[:8] == PNG_MAGIC


def test_budget_sweep(tmp_path):
    runs = collect(sweep(tmp_path / "runs", [128, 256, 512]))
    paths = plot_budget_sweep(runs, tmp_path / "figs")
    assert [p.name for p in paths] == ["accuracy_vs_budget.png", "accuracy_by_method.png", "throughput_vs_budget.png"]
    assert all(is_png(p) for p in paths)
    prepared = prepare(runs)
    assert set(prepared["series"]) == {"FullKV", "StreamingLLM", "H2O", "H2O (lf_repo)", "R-KV", "LongFlow"}
    assert prepared.loc[prepared["method"] == "vanilla", "accuracy"].eq(60.0).all()


def test_single_budget_bars(tmp_path, capsys):
    root = sweep(tmp_path / "runs", [256])
    assert main(["--runs", str(root), "--out", str(tmp_path / "figs"), "--model", "tiny_qwen3"]) == 0
    printed = capsys.readouterr().out.split()
    assert [p.rsplit("/", 1)[-1] for p in printed] == ["methods.png"]
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
