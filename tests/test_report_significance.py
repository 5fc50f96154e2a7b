"""`evals.report.table --bootstrap` and `--metric recall_*`: which cells are marked as differing from
FullKV or as indistinguishable from the best, the intervals in cells and CSV, and the dependency
recall file as a table; intervals checked against cases whose answer is known."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from helpers.reports import write_generations, write_run

from evals.report.recall_runs import recall_frame
from evals.report.runs import collect
from evals.report.stats import BootstrapConfig
from evals.report.table import build_table, main, render_latex, render_markdown, table_csv
from longflow.errors import UserError

ITEMS = [f"q{i}" for i in range(8)]
MANY = [f"q{i}" for i in range(40)]
CONFIG = BootstrapConfig(resamples=2000)


def run(root, method, budget, dataset, correct):
    """A run of `correct` (one bool per item, named q0, q1, ...) with its records."""
    path = write_run(root, "m", method, budget, dataset, float(np.mean(correct)), dataset_size=len(correct),
                     n_items=len(correct), complete=True)
    return write_generations(path, {f"q{i}": mark for i, mark in enumerate(correct)})


@pytest.fixture
def runs(tmp_path):
    """FullKV solves all 40 items; at budget 64 R-KV 38 (the best; a resample misses both lost items
    with probability (38/40)^40 = 0.13, so its interval from FullKV reaches 0), H2O 36, a subset of
    R-KV's (misses its 4 with probability 0.015: it differs from FullKV, but its 2 beyond R-KV's
    leave it indistinguishable from R-KV), StreamingLLM none."""
    root = tmp_path / "runs"
    run(root, "vanilla", None, "demo", [True] * 40)
    run(root, "rkv", 64, "demo", [True] * 38 + [False] * 2)
    run(root, "h2o", 64, "demo", [True] * 36 + [False] * 4)
    run(root, "streaming", 64, "demo", [False] * 40)
    return root


def test_marks_and_intervals(runs):
    table = build_table(collect(runs), bootstrap=CONFIG)
    column = "demo (40)"
    versus = table.comparisons.vs_reference[column]
    # StreamingLLM loses every item: each resample's difference from FullKV is -100 points exactly.
    streaming = versus[("m", "64", "StreamingLLM")]
    assert (streaming.estimate, streaming.low, streaming.high) == (-100.0, -100.0, -100.0)
    rkv = versus[("m", "64", "R-KV")]
    assert rkv.estimate == pytest.approx(-5.0) and rkv.high == 0.0 and rkv.low == pytest.approx(-12.5)
    differs = table.comparisons.differs[column]
    assert differs[("m", "64", "StreamingLLM")] and differs[("m", "64", "H2O")] and not differs[("m", "64", "R-KV")]
    near = table.comparisons.near_best[column]
    assert near[("m", "64", "H2O")] and not near[("m", "64", "StreamingLLM")] and not near[("m", "64", "R-KV")]
    assert pd.isna(table.comparisons.vs_best.loc[("m", "64", "R-KV"), column])  # the best is not compared
    md = render_markdown(table)
    assert "|  | 64 | StreamingLLM | 0.0\\* |" in md and "|  |  | H2O | 90.0\\*≈ |" in md
    assert "|  |  | R-KV | **95.0** |" in md and "| m | - | FullKV | 100.0 |" in md
    assert "marks: * the 95% paired bootstrap interval" in md and "2000 resamples, seed 0" in md
    tex = render_latex(table)
    assert r"90.0$^{*}$$^{\approx}$" in tex and r"$\approx$ that of its difference" in tex


def test_intervals_in_cells_and_csv(runs):
    table = build_table(collect(runs), bootstrap=CONFIG, paired_against="fullkv")
    md = render_markdown(table)
    assert "|  | 64 | StreamingLLM | 0.0\\* [-100.0, -100.0] |" in md
    assert "interval of the cell's difference from FullKV" in md
    csv = table_csv(table)
    row = csv[csv["Method"] == "StreamingLLM"].iloc[0]
    assert (row["demo (40) vs FullKV"], row["demo (40) vs FullKV low"], row["demo (40) vs FullKV high"]) == (
        -100.0, -100.0, -100.0)
    assert row["demo (40) vs best"] == pytest.approx(-95.0)
    assert csv.loc[csv["Method"] == "FullKV", "demo (40) vs FullKV"].isna().all()


def test_average_column_is_the_mean_of_the_datasets_differences(tmp_path):
    root = tmp_path / "runs"
    for dataset in ("demo", "canary"):
        run(root, "vanilla", None, dataset, [True] * 8)
        run(root, "streaming", 64, dataset, [False] * 8 if dataset == "demo" else [True] * 8)
        run(root, "rkv", 64, dataset, [True] * 8)
    table = build_table(collect(root), bootstrap=CONFIG)
    average = table.comparisons.vs_reference.loc[("m", "64", "StreamingLLM"), "Avg."]
    assert (average.estimate, average.low, average.high) == (-50.0, -50.0, -50.0)
    assert table.comparisons.differs.loc[("m", "64", "StreamingLLM"), "Avg."]
    assert not table.comparisons.differs.loc[("m", "64", "R-KV")].any()


def test_runs_without_records_are_not_marked(tmp_path):
    root = tmp_path / "runs"
    write_run(root, "m", "vanilla", None, "demo", 1.0)
    write_run(root, "m", "h2o", 64, "demo", 0.0)
    write_run(root, "m", "rkv", 64, "demo", 0.5)
    table = build_table(collect(root), bootstrap=CONFIG)
    assert not table.comparisons.differs.to_numpy().any() and not table.comparisons.near_best.to_numpy().any()
    assert "2 compressed cells have no per-item records: no interval, no mark" in table.notes


def test_bootstrap_options_are_checked(runs, tmp_path, capsys):
    with pytest.raises(UserError, match="--bootstrap needs per-item numbers"):
        build_table(collect(runs), "tokens_per_second", bootstrap=CONFIG)
    with pytest.raises(UserError, match="--paired-against takes"):
        build_table(collect(runs), paired_against="best")
    assert main(["--runs", str(runs), "--out", str(tmp_path / "t"), "--paired-against", "best"]) == 2
    assert main(["--runs", str(runs), "--out", str(tmp_path / "t"), "--bootstrap", "0"]) == 2
    assert "at least 1" in capsys.readouterr().err
    assert main(["--runs", str(runs), "--out", str(tmp_path / "t"), "--bootstrap", "500", "--paired-against",
                 "best"]) == 0
    assert "demo (40) vs best low" in (tmp_path / "t.csv").read_text()


def write_recall(path, rows, reads):
    """A recall CSV as `evals.canary.recall.write` makes it, and its JSON of every read."""
    header = "family,method,budget,items,reads,recall_layer0,recall_layers,complete_items"
    lines = [header] + [",".join("" if v is None else str(v) for v in row) for row in rows]
    path.with_suffix(".csv").write_text("\n".join(lines) + "\n")
    path.with_suffix(".json").write_text(json.dumps(reads))


def test_recall_table(tmp_path):
    """Two families, FullKV and two methods at one budget; StreamingLLM's lookup item 0 holds 1 of 4
    reads in every layer, item 1 both of its 2: recall_layers 3/6 pooled over reads."""
    full = [{"layer0": [1.0] * 4, "layers": [1.0] * 4}, {"layer0": [1.0] * 2, "layers": [1.0] * 2}]
    lossy = [{"layer0": [1.0, 0.0, 0.0, 0.0], "layers": [1.0, 0.0, 0.0, 0.0]},
             {"layer0": [1.0, 1.0], "layers": [1.0, 1.0]}]
    rows, reads = [], {}
    for family in ("lookup", "chain"):
        rows.append((family, "vanilla", None, 2, 6, 1.0, 1.0, 1.0))
        reads[f"{family}/vanilla/None"] = full
        rows.append((family, "streaming", 96, 2, 6, 0.5, 0.5, 0.5))
        reads[f"{family}/streaming/96"] = lossy if family == "lookup" else full
        rows.append((family, "h2o", 96, 2, 6, 1.0, 1.0, 1.0))
        reads[f"{family}/h2o/96"] = full
    rows[4] = ("chain", "streaming", 96, 2, 6, 1.0, 1.0, 1.0)
    write_recall(tmp_path / "recall", rows, reads)
    out = tmp_path / "table_recall"
    assert main(["--recall", str(tmp_path / "recall.csv"), "--metric", "recall_layers", "--out", str(out),
                 "--bootstrap", "500"]) == 0
    table = pd.read_csv(out.with_suffix(".csv"))
    assert list(table.columns[:4]) == ["Model", "Budget", "Method", "lookup (2 of 200)"]
    streaming = table[table["Method"] == "StreamingLLM"].iloc[0]
    assert streaming["lookup (2 of 200)"] == pytest.approx(50.0) and streaming["chain (2 of 200)"] == 100.0
    # Resampling the 2 items: item 0 twice gives 2/8 held, item 1 twice 4/4, one of each 3/6.
    assert streaming["lookup (2 of 200) vs FullKV low"] == pytest.approx(-75.0)
    assert streaming["lookup (2 of 200) vs FullKV high"] == pytest.approx(0.0)
    assert "Dependency recall" not in out.with_suffix(".md").read_text()  # the caption is LaTeX's
    assert "Dependency recall, all layers" in out.with_suffix(".tex").read_text()
    complete = build_table(recall_frame(tmp_path / "recall.csv", "complete_items"), "complete_items",
                           bootstrap=CONFIG)
    assert complete.values.loc[("canary_suite", "96", "StreamingLLM"), "lookup (2 of 200)"] == 50.0
