"""`evals.report.results`: every run's metrics in one long-format CSV, checked against each run's metrics.json."""

from __future__ import annotations

import json

import pandas as pd
from helpers.reports import write_run

from evals.report.results import main


def flattened(metrics: dict, prefix: str = "") -> dict[str, float]:
    """The numeric leaves of a metrics.json, nested keys joined with dots (booleans are not numbers)."""
    leaves = {}
    for key, value in metrics.items():
        if isinstance(value, dict):
            leaves.update(flattened(value, f"{prefix}{key}."))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            leaves[f"{prefix}{key}"] = float(value)
    return leaves


KEYS = {"budget", "dataset_size", "n_items", "n_samples"}  # run keys, not metrics


def test_one_row_per_run_and_metric(tmp_path):
    root = tmp_path / "runs"
    runs = [write_run(root, "m", "vanilla", None, "gsm8k", 0.75, accuracy_stderr=0.01),
            write_run(root, "m", "h2o", 64, "gsm8k", 0.5, n_items=8, planned=8),
            write_run(root, "m", "h2o", 64, "math500", 0.25, variant="lf_repo", **{"pass_at_k": {"1": 0.25}})]
    out = tmp_path / "out" / "results.csv"
    assert main(["--runs", str(root), "--out", str(out)]) == 0
    long = pd.read_csv(out)
    assert list(long.columns[-2:]) == ["metric", "value"]
    assert not long.duplicated(["run_id", "metric"]).any()
    for run in runs:
        metrics = json.loads((run / "metrics.json").read_text())
        expected = {k: v for k, v in flattened(metrics).items() if k not in KEYS}
        rows = long[long["run_id"] == metrics["run_id"]]
        assert dict(zip(rows["metric"], rows["value"], strict=True)) == expected
        assert (rows["variant"] == metrics["variant"]).all() and (rows["dataset"] == metrics["dataset"]).all()
    h2o = long[(long["method"] == "h2o") & (long["variant"] == "paper")]
    assert (h2o["n_planned"] == 8).all() and not h2o["complete"].any()
    assert {"pass_at_k.1", "step_latency_ms.p50", "finish_reasons.length", "accuracy_stderr"} <= set(long["metric"])


def test_filters(tmp_path, capsys):
    root = tmp_path / "runs"
    write_run(root, "m", "h2o", 64, "gsm8k", 0.5)
    write_run(root, "n", "h2o", 64, "gsm8k", 0.5)
    out = tmp_path / "r.csv"
    assert main(["--runs", str(root), "--out", str(out), "--model", "n"]) == 0
    assert set(pd.read_csv(out)["model"]) == {"n"}
    assert main(["--runs", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.startswith("error: runs folder")
    assert main(["--runs", str(root), "--out", str(out), "--model", "o"]) == 2
    assert capsys.readouterr().err == f"error: --model o matches nothing in {root}, which has model m, n\n"
