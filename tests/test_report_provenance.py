"""The ‡ of a table (`evals.report.provenance`): a run is marked when a start that made its records ran
Python sources that its commit does not hold, not for uncommitted files it never ran (the scaffold
`evals.new_method` leaves) nor for a restart that made nothing; a commit this checkout cannot read
falls back to the start's `git_dirty`."""

from __future__ import annotations

import hashlib
import json
import subprocess

from helpers.reports import write_recorded_run

from evals.fingerprint import REPO
from evals.report.provenance import uncommitted
from evals.report.runs import collect
from evals.report.table import build_table

SOURCE = "longflow/policy.py"
HEAD = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                      check=True).stdout.strip()
COMMITTED = hashlib.sha256(subprocess.run(["git", "-C", str(REPO), "show", f"{HEAD}:{SOURCE}"], capture_output=True,
                                          check=True).stdout).hexdigest()[:16]


def start(files: dict[str, str], dirty: bool, commit: str = HEAD) -> dict:
    """A provenance.json entry as a run start writes it (`evals.store.provenance`)."""
    return {"git_commit": commit, "git_dirty": dirty,
            "code": {"files": files, "git_commit": commit, "dirty": dirty, "fingerprint": "f", "diff": None}}


def run_with(tmp_path, starts: list[dict], makers: list[int | None]):
    """A run whose records were made by the starts `makers` (one per record; None: a record from before
    records named their start), and whose provenance.json holds `starts`."""
    items = {f"canary-{i}": True for i in range(len(makers))}
    run = write_recorded_run(tmp_path / "runs", "h2o", 96, items)
    lines = [json.loads(line) for line in (run / "generations.jsonl").read_text().splitlines()]
    for record, maker in zip(lines, makers, strict=True):
        if maker is not None:
            record["start"] = maker
    (run / "generations.jsonl").write_text("".join(json.dumps(record) + "\n" for record in lines))
    (run / "provenance.json").write_text(json.dumps(starts))
    return run, lines


def test_an_untracked_scaffold_elsewhere_marks_nothing(tmp_path):
    """The checkout was dirty (`evals.new_method` left files), but every source the start ran is the
    commit's."""
    run, records = run_with(tmp_path, [start({SOURCE: COMMITTED, "/abs/calibration.pt": "x"}, dirty=True)], [0, 0])
    assert uncommitted(run, records) is False
    assert not build_table(collect(tmp_path / "runs")).footnotes


def test_a_source_the_commit_does_not_hold_marks_the_run(tmp_path):
    edited = start({SOURCE: "0" * 16}, dirty=True)
    assert uncommitted(run_with(tmp_path / "a", [edited], [0])[0], None) is True
    new_method = start({SOURCE: COMMITTED, "baselines/not_committed_yet.py": "1" * 16}, dirty=True)
    run, records = run_with(tmp_path / "b", [new_method], [0])
    assert uncommitted(run, records) is True


def test_only_the_starts_that_made_the_records_count(tmp_path):
    """A restart with edited sources (allow_code_change=true) that generated nothing leaves the run
    clean; once it makes a record, the run is marked."""
    starts = [start({SOURCE: COMMITTED}, dirty=False), start({SOURCE: "0" * 16}, dirty=True)]
    run, records = run_with(tmp_path, starts, [0, 0])
    assert uncommitted(run, records) is False
    assert uncommitted(run, [*records, {**records[0], "start": 1}]) is True
    assert uncommitted(run, [{key: value for key, value in record.items() if key != "start"}
                             for record in records]) is True  # older records: every start counts


def test_a_commit_this_checkout_cannot_read_falls_back_to_git_dirty(tmp_path):
    unknown = "f" * 40
    run, records = run_with(tmp_path / "a", [start({SOURCE: COMMITTED}, dirty=True, commit=unknown)], [0])
    assert uncommitted(run, records) is True
    run, records = run_with(tmp_path / "b", [start({SOURCE: "0" * 16}, dirty=False, commit=unknown)], [0])
    assert uncommitted(run, records) is False
