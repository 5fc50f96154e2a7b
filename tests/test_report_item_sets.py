"""Which items a report counts (`evals.report.item_sets`, `evals.report.runs.read_run`): a sweep's table
depends on that sweep's jobs only, whatever ran in its run directories later; a folder's table shows
every item set its runs were run over, none of the items on disk lost; and what `evals.sweeps` records."""

from __future__ import annotations

import json

import pytest
from helpers.reports import write_recorded_run, write_sweep
from helpers.runs import BASE, records, run_cli, run_dirs
from hydra.core.utils import JobReturn, JobStatus
from hydra.types import RunMode
from omegaconf import OmegaConf

from evals.report.runs import collect, collect_sweeps
from evals.report.table import build_table, main
from evals.sweeps import SweepRecord

FOUR = [f"canary-{i}" for i in range(4)]
TWO = FOUR[:2]


@pytest.fixture
def two_sweeps(tmp_path):
    """The walkthrough's trap: sweep A ran vanilla, H2O and R-KV over 4 items; sweep B then ran vanilla,
    H2O and StreamingLLM over 2 into the same folder, which rewrote the items.json and metrics.json of
    the runs both share."""
    root = tmp_path / "runs"
    vanilla = write_recorded_run(root, "vanilla", None, dict.fromkeys(FOUR, True), planned=TWO)
    h2o = write_recorded_run(root, "h2o", 96, {"canary-0": True, "canary-1": False, "canary-2": True,
                                               "canary-3": True}, planned=TWO)
    rkv = write_recorded_run(root, "rkv", 96, {"canary-0": True, "canary-1": False, "canary-2": False,
                                               "canary-3": False})
    streaming = write_recorded_run(root, "streaming", 96, {"canary-0": False, "canary-1": False})
    first = write_sweep(root / "first", [[(vanilla, FOUR)], [(h2o, FOUR)], [(rkv, FOUR)]])
    second = write_sweep(root / "second", [[(vanilla, TWO)], [(h2o, TWO)], [(streaming, TWO)]])
    return root, first, second


def cells(table) -> dict[tuple[str, str], float]:
    """`{(method, column): value}` of the table's filled cells."""
    stacked = table.values.stack()
    return {(key[-2], key[-1]): value for key, value in stacked.items()}


def test_a_sweep_is_reported_over_its_own_items_whatever_ran_later(two_sweeps, capsys):
    root, first, second = two_sweeps
    table = build_table(collect_sweeps([first]))
    assert cells(table) == {("FullKV", "canary (4 of 200)"): 100.0, ("H2O", "canary (4 of 200)"): 75.0,
                            ("R-KV", "canary (4 of 200)"): 25.0}
    assert not [note for note in table.notes if "no FullKV" in note]
    assert cells(build_table(collect_sweeps([second]))) == {
        ("FullKV", "canary (2 of 200)"): 100.0, ("StreamingLLM", "canary (2 of 200)"): 0.0,
        ("H2O", "canary (2 of 200)"): 50.0}
    assert "warning" not in capsys.readouterr().err


def test_a_folder_shows_every_item_set_of_its_runs(two_sweeps):
    """`--runs` keeps each item set a column, the full cache in both, and `--limit 4` keeps it too."""
    root, first, second = two_sweeps
    runs = collect(root)
    table = build_table(runs)
    assert list(table.values.columns) == ["canary (2 of 200)", "canary (4 of 200)"]
    assert table.values.loc[("canary", "96", "H2O")].tolist() == [50.0, 75.0]
    assert table.values.loc[("canary", "-", "FullKV")].tolist() == [100.0, 100.0]
    assert not [note for note in table.notes if "no FullKV" in note or "kept the newest" in note]
    assert cells(build_table(runs[runs["n_planned"] == 4]))[("FullKV", "canary (4 of 200)")] == 100.0


def test_items_on_disk_beyond_every_recorded_set_are_a_column(two_sweeps):
    """Without the sweeps' records, the 4 items a later `limit=2` left in the full cache's run are still
    shown: every item the run holds is an item set of its own."""
    root, first, second = two_sweeps
    for sweep in (first, second):
        (sweep / "sweep.json").unlink()
    table = build_table(collect(root))
    assert table.values.loc[("canary", "-", "FullKV")].tolist() == [100.0, 100.0]
    assert table.values.loc[("canary", "96", "H2O")].tolist() == [50.0, 75.0]


def test_one_sweep_named_twice_is_read_once(two_sweeps, tmp_path, capsys, monkeypatch):
    root, first, second = two_sweeps
    monkeypatch.chdir(root)
    assert main(["--sweep", str(first), "first", "--out", str(tmp_path / "t")]) == 0
    assert "kept the newest" not in capsys.readouterr().out


def test_a_sweep_of_the_old_format_is_reported_with_a_warning(two_sweeps, capsys):
    root, first, second = two_sweeps
    record = json.loads((first / "sweep.json").read_text())
    (first / "sweep.json").write_text(json.dumps({key: record[key] for key in ("runs", "command", "jobs")}))
    table = build_table(collect_sweeps([first]))
    assert "canary (2 of 200)" in table.values.columns  # the last config's items: all it can know
    assert "records no item sets" in capsys.readouterr().err


def job_config(sweep_dir, number: int, task=("method=vanilla,h2o", "limit=2"), mode=RunMode.MULTIRUN):
    return OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep_dir)}, "job": {"num": number}, "mode": mode,
                                       "overrides": {"task": list(task)}}})


def test_each_job_records_the_items_its_runs_covered(tmp_path):
    root = tmp_path / "runs"
    vanilla = write_recorded_run(root, "vanilla", None, dict.fromkeys(TWO, True))
    h2o = write_recorded_run(root, "h2o", 96, dict.fromkeys(TWO, False))
    callback, sweep = SweepRecord(), tmp_path / "sweep"
    callback.on_multirun_start(job_config(sweep, 0))
    for number, run in enumerate((vanilla, h2o)):
        callback.on_job_end(job_config(sweep, number), JobReturn(status=JobStatus.COMPLETED, _return_value=[str(run)]))
    (vanilla / "items.json").write_text(json.dumps(FOUR))  # a later command: its record stays
    record = json.loads((sweep / "sweep.json").read_text())
    assert record["jobs"] == 2 and record["finished"] == 2 and record["runs"] == [str(vanilla), str(h2o)]
    assert [entry["runs"][0]["run"] for entry in record["job_runs"].values()] == [str(vanilla), str(h2o)]
    assert all(record["item_sets"][entry["runs"][0]["items"]] == TWO for entry in record["job_runs"].values())


@pytest.mark.slow
def test_a_later_sweep_of_another_limit_leaves_an_earlier_sweeps_table_as_it_was(tmp_path):
    common = [*BASE, "dataset.names=[demo_math]", "generation.max_new_tokens=8", f"results_dir={tmp_path / 'runs'}"]
    first, second, out = tmp_path / "first", tmp_path / "second", tmp_path / "table"
    result = run_cli("-m", *common, "method=vanilla,h2o", "limit=3", f"hydra.sweep.dir={first}")
    assert result.returncode == 0, result.stderr
    assert main(["--sweep", str(first), "--out", str(out)]) == 0
    before = out.with_suffix(".md").read_text()
    result = run_cli("-m", *common, "method=vanilla,h2o", "limit=2", f"hydra.sweep.dir={second}")
    assert result.returncode == 0, result.stderr
    assert main(["--sweep", str(first), "--out", str(out)]) == 0
    assert out.with_suffix(".md").read_text() == before and "(3 of " in before
    assert main(["--sweep", str(second), "--out", str(out)]) == 0
    assert "(2 of " in out.with_suffix(".md").read_text()
    for run in run_dirs(tmp_path / "runs"):  # each record names the start that made it: the first
        assert len(json.loads((run / "provenance.json").read_text())) == 2
        assert {record["start"] for record in records(run)} == {0}


def test_the_same_command_again_keeps_what_its_earlier_start_recorded(tmp_path, monkeypatch):
    """A rerun stopped at its second job (a refusal, Ctrl-C) leaves the three jobs of the first start
    recorded; another command into the folder starts a record of its own."""
    root = tmp_path / "runs"
    made = [write_recorded_run(root, method, 96, dict.fromkeys(TWO, True)) for method in ("h2o", "rkv", "tova")]
    callback, sweep = SweepRecord(), tmp_path / "sweep"
    task = ["method=h2o,rkv,tova", "limit=2"]
    monkeypatch.setattr("sys.argv", ["evals.run", "-m", *task])
    callback.on_multirun_start(job_config(sweep, 0, task))
    for number, run in enumerate(made):
        callback.on_job_end(job_config(sweep, number, task), JobReturn(status=JobStatus.COMPLETED,
                                                                       _return_value=[str(run)]))
    callback.on_multirun_start(job_config(sweep, 0, task))
    callback.on_job_end(job_config(sweep, 0, task), JobReturn(status=JobStatus.COMPLETED, _return_value=[str(made[0])]))
    record = json.loads((sweep / "sweep.json").read_text())
    assert record["finished"] == 3 and sorted(record["job_runs"]) == ["0", "1", "2"]
    assert len(collect_sweeps([sweep])) == 3
    monkeypatch.setattr("sys.argv", ["evals.run", "-m", "method=h2o,rkv", "limit=2"])
    callback.on_multirun_start(job_config(sweep, 0, ["method=h2o,rkv", "limit=2"]))
    assert json.loads((sweep / "sweep.json").read_text())["job_runs"] == {}


def test_a_sweep_with_unfinished_jobs_says_so(tmp_path, capsys):
    root = tmp_path / "runs"
    runs = [write_recorded_run(root, method, 96, dict.fromkeys(TWO, True)) for method in ("h2o", "rkv", "tova")]
    sweep = write_sweep(tmp_path / "sweep", [[(run, TWO)] for run in runs], total=8)
    assert len(collect_sweeps([sweep])) == 3
    assert f"warning: sweep {sweep}: 3 of 8 jobs finished" in capsys.readouterr().err


def test_a_single_run_leaves_no_sweep_record_and_stray_ones_are_ignored(tmp_path, capsys):
    root = tmp_path / "runs"
    run = write_recorded_run(root, "h2o", 96, dict.fromkeys(TWO, True))
    callback, sweep = SweepRecord(), root / ".hydra" / "single"
    single = job_config(sweep, 0, mode=RunMode.RUN)
    callback.on_job_start(single)
    callback.on_job_end(single, JobReturn(status=JobStatus.COMPLETED, _return_value=[str(run)]))
    assert not sweep.exists()
    (root / ".hydra" / "old").mkdir(parents=True)
    (root / ".hydra" / "old" / "sweep.json").write_text("{}")  # what single runs used to leave
    assert len(collect(root)) == 1 and "warning" not in capsys.readouterr().err
