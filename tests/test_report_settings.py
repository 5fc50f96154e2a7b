"""Runs that differ in a swept setting are rows (series) of their own, labelled by it
(`evals.report.settings`); only copies of one configuration are reduced to the newest; the results CSV
carries every setting as a column."""

from __future__ import annotations

import shutil

import pandas as pd
from helpers.reports import write_recorded_run

from evals.report.figures import prepare
from evals.report.results import main as results_main
from evals.report.runs import collect
from evals.report.table import build_table

ITEMS = {"canary-0": True, "canary-1": False, "canary-2": True, "canary-3": False}
HERE, OTHER = "evals/canary/model", "/ckpt/other"


def rows(table) -> list[tuple[str, ...]]:
    return list(table.values.index)


def test_a_method_parameter_and_a_checkpoint_split_rows(tmp_path):
    root = tmp_path / "runs"
    write_recorded_run(root, "vanilla", None, ITEMS)
    write_recorded_run(root, "h2o", 96, ITEMS, method_params={"heavy_ratio": 0.5})
    write_recorded_run(root, "h2o", 96, dict.fromkeys(ITEMS, False), method_params={"heavy_ratio": 0.25})
    write_recorded_run(root, "h2o", 96, dict.fromkeys(ITEMS, True), method_params={"heavy_ratio": 0.5},
                       hub_id=OTHER, checkpoint="c2")
    table = build_table(collect(root))
    here, other = f"canary (hub_id={HERE})", f"canary (hub_id={OTHER})"
    assert rows(table) == [(other, "96", "H2O"), (here, "-", "FullKV"), (here, "96", "H2O (heavy_ratio=0.25)"),
                           (here, "96", "H2O (heavy_ratio=0.5)")]
    assert table.values["canary (4 of 200)"].tolist() == [100.0, 50.0, 0.0, 50.0]
    assert not [note for note in table.notes if "kept the newest" in note]
    assert f"no FullKV run of {other} over canary (4 of 200): no full-cache reference there" in table.notes
    assert {"H2O (heavy_ratio=0.5)", "H2O (heavy_ratio=0.25)", "H2O"} <= set(prepare(collect(root))["series"])


def test_a_setting_that_differs_only_between_datasets_splits_nothing(tmp_path):
    """The canary bounds the output length: its max_new_tokens is not the other datasets', and that
    is no reason for another row."""
    root = tmp_path / "runs"
    write_recorded_run(root, "h2o", 96, ITEMS)
    write_recorded_run(root, "h2o", 96, {"gsm8k-0": True}, dataset="gsm8k", generation_params={"max_new_tokens": 512})
    assert rows(build_table(collect(root))) == [("canary", "96", "H2O")]


def test_only_copies_of_one_configuration_keep_the_newest_and_say_what_matched(tmp_path):
    root = tmp_path / "runs"
    run = write_recorded_run(root, "h2o", 96, ITEMS)
    shutil.copytree(run, tmp_path / "elsewhere" / "runs" / run.name)
    (root / "copies").mkdir()
    shutil.move(tmp_path / "elsewhere" / "runs" / run.name, root / "copies" / run.name)
    table = build_table(collect(root))
    assert rows(table) == [("canary", "96", "H2O")]
    assert any("2 runs with the same model, method and generation settings, every field of their run.json, "
               "kept the newest" in note for note in table.notes)


def test_the_results_csv_has_the_settings_as_columns(tmp_path, capsys):
    root = tmp_path / "runs"
    write_recorded_run(root, "h2o", 96, ITEMS, method_params={"heavy_ratio": 0.25})
    write_recorded_run(root, "vanilla", None, ITEMS)
    assert results_main(["--runs", str(root), "--out", str(tmp_path / "r.csv")]) == 0
    frame = pd.read_csv(tmp_path / "r.csv")
    assert {"method.heavy_ratio", "model.hub_id", "model.revision", "generation.max_new_tokens",
            "generation.protocol", "template"} <= set(frame.columns)
    assert set(frame.loc[frame["method"] == "h2o", "method.heavy_ratio"]) == {0.25}
    assert frame.loc[frame["method"] == "vanilla", "method.heavy_ratio"].isna().all()
    assert "method.heavy_ratio" not in set(frame["metric"])
