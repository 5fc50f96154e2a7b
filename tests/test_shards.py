"""Shards (`shard=i/n`): the split, shared writes to one run directory, and a killed shard that resumes
and merges into the table of an unsharded run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers.runs import BASE, REPO, records, run_cli, run_dirs

from evals.report.runs import collect
from evals.report.table import build_table
from evals.shards import Shard
from evals.store import GENERATIONS, RunDir, lock_run, run_name
from longflow.errors import UserError

SHARDED = [*BASE, "method=h2o", "dataset.names=[demo_math]"]


@pytest.mark.parametrize("value, parsed", [(None, None), ("0/1", None), ("0/4", Shard(0, 4)), ("3/4", Shard(3, 4)),
                                           (" 1/2 ", Shard(1, 2))])
def test_parse(value, parsed):
    assert Shard.parse(value) == parsed


@pytest.mark.parametrize("value", ["4/4", "1", 1, "a/b", "-1/2", "1/0", "1/2/3"])
def test_parse_refuses(value):
    with pytest.raises(UserError, match="shard must be i/n with 0 <= i < n"):
        Shard.parse(value)


def test_shards_partition_the_items():
    items = list(range(23))
    for count in (1, 2, 3, 5, 23, 30):
        parts = [Shard(index, count).select(items) for index in range(count)]
        assert sorted(x for part in parts for x in part) == items  # every item once
        assert max(map(len, parts)) - min(map(len, parts)) <= 1  # balanced
        assert parts[0][:2] == items[0:2 * count:count]  # interleaved: every shard gets early and late items


IDENTITY = {"model": "m", "method": "h2o", "budget": 8, "generation": "greedy", "dataset": "d"}


def record(item: int, sample: int = 0) -> dict:
    return {"id": str(item), "sample": sample, "correct": item % 2 == 0, "output": "x" * 2000}


def test_shards_write_one_run_together(tmp_path):
    """Four shards commit batches at once: every record lands once, whole, and the last metrics
    written cover every shard's records."""
    def count(stored, batches, fidelity):
        return {"records": len(stored), "batches": len(batches)}

    def write(shard):
        with RunDir(tmp_path, IDENTITY, shard) as run:
            for item in shard.select(range(200)):
                run.commit([record(item)], {"size": 1}, count)

    threads = [threading.Thread(target=write, args=(Shard(i, 4),)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    run = tmp_path / run_name(IDENTITY)
    lines = (run / GENERATIONS).read_text().splitlines()
    assert sorted(int(json.loads(line)["id"]) for line in lines) == list(range(200))
    assert json.loads((run / "metrics.json").read_text()) == {"records": 200, "batches": 200}


def test_commit_drops_records_already_stored(tmp_path):
    with RunDir(tmp_path, IDENTITY, Shard(0, 2)) as run:
        run.commit([record(0), record(1)], {"size": 2}, lambda stored, batches, fidelity: {})
    with RunDir(tmp_path, IDENTITY, Shard(1, 3)) as run:  # overlaps: a shard of another count
        metrics = run.commit([record(1), record(2)], {"size": 2}, lambda stored, batches, fidelity: {
            "ids": [r["id"] for r in stored], "batches": len(batches)})
        assert metrics == {"ids": ["0", "1", "2"], "batches": 2}
        run.commit([record(2)], {"size": 1}, lambda stored, batches, fidelity: {})
        assert len(run.batches()) == 2  # the batch of a record already stored is not counted


def test_shard_locks(tmp_path):
    with RunDir(tmp_path, IDENTITY, Shard(0, 2)):
        with RunDir(tmp_path, IDENTITY, Shard(1, 2)):  # two shards at once: yes
            pass
        with pytest.raises(UserError, match="shard 0/2 of .* is being written by another process"):
            RunDir(tmp_path, IDENTITY, Shard(0, 2))
        with pytest.raises(UserError, match="is being written by another process"):
            RunDir(tmp_path, IDENTITY)  # the whole run while a shard writes it: no
        with pytest.raises(UserError, match="is being written by another process"):
            lock_run(tmp_path / run_name(IDENTITY))  # nor a re-grade (evals.grading)
    with RunDir(tmp_path, IDENTITY), pytest.raises(UserError, match="is being written by another process"):
        RunDir(tmp_path, IDENTITY, Shard(1, 2))


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("unsharded")
    result = run_cli(*SHARDED, f"results_dir={root}")
    assert result.returncode == 0, result.stderr
    return root


def start_shard(shard: str, root: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "evals.run", *SHARDED, f"shard={shard}", f"results_dir={root}"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_killed_shard_resumes_and_the_table_is_the_unsharded_one(unsharded, tmp_path):
    first = start_shard("0/2", tmp_path)
    deadline, generations = time.time() + 240, None
    while time.time() < deadline and first.poll() is None:  # kill -9 once its first batch is stored
        found = list(tmp_path.glob("*/metrics.json"))
        if found:
            generations = found[0].parent / GENERATIONS
            break
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert generations is not None, "shard 0/2 finished or stalled before a batch was stored"
    with open(generations, "a") as handle:  # and a torn line, as if killed mid-write
        handle.write('{"id": "torn", "sam')
    [partial] = run_dirs(tmp_path)
    assert not json.loads((partial / "metrics.json").read_text())["complete"]
    assert build_table(collect(tmp_path)).partial.to_numpy().any()

    shards = [start_shard("1/2", tmp_path), start_shard("0/2", tmp_path)]  # the other, and the killed one again
    for shard in shards:
        _, stderr = shard.communicate(timeout=300)
        assert shard.returncode == 0, stderr

    [run], [reference] = run_dirs(tmp_path), run_dirs(unsharded)
    assert run.name == reference.name  # one run directory, the unsharded run's
    rows = records(run)
    assert sorted((r["id"], r["sample"]) for r in rows) == sorted({(r["id"], r["sample"]) for r in rows})
    same = ("output", "output_tokens", "finish_reason", "extracted", "correct", "reason", "peak_slots")
    assert ({(r["id"], r["sample"]): [r[k] for k in same] for r in rows}
            == {(r["id"], r["sample"]): [r[k] for k in same] for r in records(reference)})
    for metric in ("accuracy", "mean_output_tokens", "peak_kv_slots"):
        sharded, whole = build_table(collect(tmp_path), metric), build_table(collect(unsharded), metric)
        assert sharded.values.equals(whole.values) and not sharded.partial.to_numpy().any(), metric
    provenance = json.loads((run / "provenance.json").read_text())
    assert len(provenance) == 3 and all(entry["device"]["name"] == "cpu" for entry in provenance)


def test_a_bad_shard_is_refused_before_anything_runs():
    from evals.run import check_overrides

    with pytest.raises(UserError, match="shard must be i/n with 0 <= i < n .* got '2/2'"):
        check_overrides(["-m", *BASE, "shard=0/2,1/2,2/2"])
