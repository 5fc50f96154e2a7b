"""The entry point end to end on the tiny model: outputs, resumption after a kill, identity, errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BASE = ["model=tiny_qwen3", "dataset=demo", "generation.max_new_tokens=24", "budget=48", "device=cpu",
        "engine.batch_size=2", "grading.workers=1"]


def run_cli(*args: str, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evals.run", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def run_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "generations.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, list[dict]]:
    """An uninterrupted run of the demo set: records per dataset."""
    root = tmp_path_factory.mktemp("reference")
    result = run_cli(*BASE, "method=h2o", f"results_dir={root}")
    assert result.returncode == 0, result.stderr
    return {json.loads((d / "run.json").read_text())["dataset"]: records(d) for d in run_dirs(root)}


def by_key(rows: list[dict]) -> dict:
    return {(r["id"], r["sample"]): (r["output"], r["correct"], r["reason"]) for r in rows}


@pytest.mark.slow
def test_run_writes_records_and_metrics(reference, tmp_path):
    assert set(reference) == {"demo_math", "demo_gpqa"}
    for rows in reference.values():
        for row in rows:
            assert {"id", "prompt_tokens", "output", "output_tokens", "finish_reason", "extracted", "gold",
                    "correct", "reason", "seconds", "peak_slots"} <= set(row)
            assert row["peak_slots"] <= 48


@pytest.mark.slow
def test_killed_run_resumes_without_loss_or_duplicates(reference, tmp_path):
    process = subprocess.Popen([sys.executable, "-m", "evals.run", *BASE, "method=h2o", f"results_dir={tmp_path}"],
                               cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    generations = None
    while time.time() < deadline and process.poll() is None:  # kill -9 once the first batch is stored
        found = list(tmp_path.glob("*/generations.jsonl"))
        if found and found[0].read_text().count("\n") >= 2:
            generations = found[0]
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert generations is not None, "the run finished or stalled before a batch was stored"
    with open(generations, "a") as handle:  # and a torn line, as if killed mid-write
        handle.write('{"id": "torn", "sam')

    result = run_cli(*BASE, "method=h2o", f"results_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    for run in run_dirs(tmp_path):
        rows = records(run)
        dataset = json.loads((run / "run.json").read_text())["dataset"]
        keys = [(r["id"], r["sample"]) for r in rows]
        assert len(keys) == len(set(keys)), "duplicated items"
        assert by_key(rows) == by_key(reference[dataset])
        metrics = json.loads((run / "metrics.json").read_text())
        assert metrics["complete"] and metrics["n_items"] == len(reference[dataset])


@pytest.mark.slow
def test_identity_ignores_batch_size_but_not_budget(reference, tmp_path):
    first = run_cli(*BASE, "method=h2o", "limit=1", f"results_dir={tmp_path}")
    assert first.returncode == 0, first.stderr
    again = run_cli(*BASE, "method=h2o", "limit=1", "engine.batch_size=5", f"results_dir={tmp_path}")
    assert again.returncode == 0, again.stderr
    assert len(run_dirs(tmp_path)) == 2  # demo_math and demo_gpqa, nothing new
    other = run_cli(*BASE, "method=h2o", "limit=1", "budget=40", f"results_dir={tmp_path}")
    assert other.returncode == 0, other.stderr
    assert len(run_dirs(tmp_path)) == 4


@pytest.mark.parametrize(
    "args,needle",
    [
        (["model=gpt5"], "unknown model 'gpt5'; choose one of: "),
        (["method=magic"], "unknown method 'magic'; choose one of: "),
        (["dataset=imagenet"], "unknown dataset 'imagenet'; choose one of: "),
        (["-m", "method=h2o,magic"], "unknown method 'magic'"),
        (["method=h2o", "budget=0"], "budget must be a positive integer"),
        (["method=h2o", "budget=-5"], "budget must be a positive integer"),
        (["dataset=gsm8k", "dataset.root=/nonexistent/data"], "gsm8k.jsonl"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(args, needle, tmp_path):
    result = run_cli(*args, f"results_dir={tmp_path}", timeout=120)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_malformed_jsonl_names_file_and_line(tmp_path):
    (tmp_path / "gsm8k.jsonl").write_text('{"index": 0, "question": "1+1?", "true_answer": "2"}\n{"index": 1, "qu\n')
    result = run_cli("dataset=gsm8k", f"dataset.root={tmp_path}", f"results_dir={tmp_path / 'runs'}", timeout=120)
    assert result.returncode == 2, result.stderr
    assert "gsm8k.jsonl" in result.stderr and "line 2" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_regrade_reproduces_stored_grades(reference, tmp_path):
    run = run_cli(*BASE, "method=streaming", "limit=2", f"results_dir={tmp_path}")
    assert run.returncode == 0, run.stderr
    for directory in run_dirs(tmp_path):
        before = records(directory)
        result = subprocess.run([sys.executable, "-m", "evals.grade", str(directory)], cwd=REPO, capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert records(directory) == before
        assert json.loads((directory / "metrics.json").read_text())["accuracy"] == 0.0


def test_regrade_rejects_a_non_run_directory(tmp_path):
    result = subprocess.run([sys.executable, "-m", "evals.grade", str(tmp_path)], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.startswith("error: ") and "Traceback" not in result.stderr


def test_over_long_prompts_are_recorded_and_the_run_goes_on(tmp_path):
    result = run_cli(*BASE, "model.architecture.max_position_embeddings=256", f"results_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    rows = [row for run in run_dirs(tmp_path) for row in records(run)]
    reasons = {row["reason"] for row in rows}
    assert "prompt_too_long" in reasons and len(reasons) > 1  # short prompts still generated
    assert all(not row["correct"] for row in rows if row["reason"] == "prompt_too_long")


def test_a_local_checkpoint_is_part_of_the_identity(tmp_path):
    """A local folder has no revision: its weights' content names the run, so a retrained model starts
    new runs instead of resuming the old model's."""
    from evals.run import checkpoint_fingerprint

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "train_log.json").write_text("{}")
    before = checkpoint_fingerprint(str(tmp_path))
    (tmp_path / "train_log.json").write_text('{"note": 1}')  # not the model
    assert checkpoint_fingerprint(str(tmp_path)) == before
    (tmp_path / "model.safetensors").write_bytes(b"retrained")
    assert checkpoint_fingerprint(str(tmp_path)) not in (before, None)
    assert checkpoint_fingerprint("Qwen/Qwen3-8B") is None
