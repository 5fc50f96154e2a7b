"""The entry point end to end on the tiny model: outputs, resumption after a kill, identity, errors."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.runs import BASE, REPO, records, run_cli, run_dirs

from evals.configs import compose_config as composed
from evals.fingerprint import grader_record
from evals.pipeline import evaluate
from evals.run import check_overrides
from longflow.errors import UserError


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


def identity_of(*overrides: str) -> dict:
    """The identity `evals.run` gives the demo_math run of `overrides` (the tiny model: no checkpoint to hash)."""
    from types import SimpleNamespace

    from evals.pipeline import Job, Setup

    job = Job(name="demo_math", kind="math", items=[], size=1, fingerprint="f")
    return Setup.from_config(compose_config(*BASE, *overrides)).identity(job, SimpleNamespace(chat_template=None))


@pytest.mark.parametrize("method, execution, output", [
    ("h2o", "+method.use_kernel=eager", "method.heavy_ratio=0.25"),
    ("longflow", "method.use_kernel=reference", "method.n_sink=2"),
    ("ams_tova", "+method.scorer.use_kernel=eager", "method.n_sink=2"),  # a scorer's kernel, one level down
])
def test_the_decode_kernel_is_no_part_of_a_runs_identity(method, execution, output):
    """A switch that picks another implementation of the same method (`KVPolicy.execution_fields`) resumes the
    same run; a field that changes what the method computes starts another."""
    plain = identity_of(f"method={method}")
    assert identity_of(f"method={method}", execution) == plain
    assert identity_of(f"method={method}", output) != plain


@pytest.mark.parametrize(
    "args,needle",
    [
        (["model=gpt5"], "unknown model 'gpt5'; choose one of: "),
        (["method=magic"], "unknown method 'magic'; choose one of: "),
        (["dataset=imagenet"], "unknown dataset 'imagenet'; choose one of: "),
        (["-m", "method=h2o,magic"], "unknown method 'magic'"),
        (["method=h2o", "budget=0"], "budget must be a positive integer"),
        (["budgte=96"], "unknown key budgte (did you mean budget?)"),
        (["method=h2o", "budget=-5"], "budget must be a positive integer"),
        (["dataset=gsm8k", "dataset.root=/nonexistent/data"], "gsm8k.jsonl"),
        (["generation.max_new_tokens=abc"], "generation.max_new_tokens must be an integer, got 'abc'"),
        (["+generation.foo=1"], "unknown key generation.foo; generation takes: max_new_tokens"),
        (["generation.foo=1"], "unknown key generation.foo; generation takes: ignore_eos"),
        (["grading.timeout=2.5"], "grading.timeout must be a positive integer, got 2.5"),
        (["-m", "method=h2o,vanilla", "budget=64,abc"], "budget must be a positive integer"),
        (["method=rkv", "budget=8"], "rkv: budget 8 too small"),
        (["model=canary", "model.hub_id=/nonexistent"], "model.hub_id='/nonexistent': no such folder"),
        (["model=canary", "model.hub_id=evals/canary/no_model"], "model.hub_id='evals/canary/no_model': no such"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(args, needle, tmp_path):
    result = run_cli(*BASE, *args, f"results_dir={tmp_path}", timeout=120)
    assert_refused_before_loading(result, needle, tmp_path)


def assert_refused_before_loading(result: subprocess.CompletedProcess, needle: str, results_dir: Path) -> None:
    """One `error:` line, exit code 2, and no run directory: it stopped before the model loaded."""
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not results_dir.exists() or not run_dirs(results_dir)


@pytest.mark.parametrize("args,needle", [
        (["generation.max_new_tokens=abc"], "generation.max_new_tokens must be an integer, got 'abc'"),
        (["engine.batch_size=abc"], "engine.batch_size must be an integer, got 'abc'"),
        (["generation.temperature=hot"], "generation.temperature must be a number"),
        (["device=foo"], "device must be auto, cpu, cuda or cuda:N, got 'foo'"),
        (["+generation.foo=1"], "unknown key generation.foo; generation takes: max_new_tokens"),
        (["generation.foo=1"], "unknown key generation.foo; generation takes: ignore_eos"),
        (["+foo=1"], "unknown key foo"),
        (["+grading.retries=1"], "unknown key grading.retries"),
        (["grading.workers=0"], "grading.workers must be a positive integer, got 0"),
        (["grading.timeout=0"], "grading.timeout must be a positive integer, got 0"),
        (["grading.timeout=2.5"], "grading.timeout must be a positive integer, got 2.5"),
        (["limit=abc"], "limit must be a positive integer"),
        (["method=h2o", "budget=[1,2"], "no viable alternative"),
        (["-m", "method=h2o,vanilla", "budget=64,abc"], "budget must be a positive integer"),
        (["method=rkv", "budget=8"], "rkv: budget 8 too small"),
        (["method=h2o", "method.heavy_ratio=1.5"], "h2o: heavy_ratio must be in [0, 1), got 1.5"),
        (["method=h2o", "+method.beta=1"], "method 'h2o': H2OPolicy.__init__() got an unexpected keyword argument"),
        (["method=h2o", "method._target_=baselines.h2o.Nothing"], "method class 'baselines.h2o.Nothing' not found"),
        (["budgte=96"], "unknown key budgte (did you mean budget?); the config takes: "),
        (["generation.max_new_tokenz=3"], "unknown key generation.max_new_tokenz (did you mean max_new_tokens?)"),
        (["-m", "method=h2p,h2o"], "unknown method 'h2p' (did you mean h2o?); choose one of: "),
        (["-m", "method=h2o,vanilla", "fooo=1"], "unknown key fooo; the config takes: "),
        (["-m", "method=h2o,vanilla", "budgte=96"], "unknown key budgte (did you mean budget?); the config takes: "),
        (["overwrite=yes"], "overwrite must be true or false, got 'yes'"),
        (["shard=0/2", "overwrite=true"], "overwrite=true with shard= would delete the other shards' samples"),
        (["budget=0"], "budget must be a positive integer"),
])
def test_every_config_value_is_checked_before_anything_runs(args, needle):
    """The checks `python -m evals.run` makes before Hydra starts (the cases above, end to end)."""
    with pytest.raises(UserError) as raised:
        check_overrides([*BASE, *args])
    assert needle in str(raised.value) and "\n" not in str(raised.value)


def compose_config(*overrides: str) -> dict:
    return composed(overrides)


@pytest.fixture
def no_model(monkeypatch):
    """`load_model` made to fail the test: what is refused must be refused before it."""

    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("evals.pipeline.load_model", load_model)


GOOD_ROW = '{"index": 0, "question": "1+1?", "true_answer": "2"}\n'


@pytest.mark.parametrize("content, needle", [
    (b'{"index": 0, "question": "caf\xe9?", "true_answer": "2"}\n', "gsm8k.jsonl: line 1: not UTF-8 text"),
    (b"", "gsm8k.jsonl holds no items"),
    (b"\n\n", "gsm8k.jsonl holds no items"),
    ((GOOD_ROW + '{"index": 1, "question": "  ", "true_answer": "3"}\n').encode(), "(id 1): the question is empty"),
    ((GOOD_ROW + '{"index": 0, "question": "2+2?", "true_answer": "4"}\n').encode(),
     "rows 1 and 2 have the same id '0'"),
])
def test_bad_data_files_are_refused_before_loading(content, needle, tmp_path, no_model):
    (tmp_path / "gsm8k.jsonl").write_bytes(content)
    cfg = compose_config(*BASE, "dataset=gsm8k", f"dataset.root={tmp_path}", f"results_dir={tmp_path / 'runs'}")
    with pytest.raises(UserError, match=re.escape(needle)):
        evaluate(cfg)


def test_unwritable_results_dir_is_refused_before_loading(tmp_path, no_model):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(UserError, match="is not a writable folder"):
        evaluate(compose_config(*BASE, f"results_dir={tmp_path / 'a_file' / 'runs'}"))


def test_max_new_tokens_beyond_the_models_positions_is_refused_before_loading(tmp_path, no_model):
    cfg = compose_config(*BASE, "model.architecture.max_position_embeddings=256", "generation.max_new_tokens=300",
                         f"results_dir={tmp_path}")
    with pytest.raises(UserError, match="max_new_tokens=300 leaves no room for a prompt: model tiny_qwen3 has 256"):
        evaluate(cfg)


def test_a_bad_data_file_from_the_command_line(tmp_path):
    (tmp_path / "gsm8k.jsonl").write_bytes(b'{"index": 0, "question": "caf\xe9?", "true_answer": "2"}\n')
    runs = tmp_path / "runs"
    result = run_cli(*BASE, "dataset=gsm8k", f"dataset.root={tmp_path}", f"results_dir={runs}", timeout=120)
    assert_refused_before_loading(result, "gsm8k.jsonl: line 1: not UTF-8 text", runs)


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
        result = subprocess.run([sys.executable, "-m", "evals.grading", str(directory)], cwd=REPO, capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert records(directory) == before
        assert json.loads((directory / "metrics.json").read_text())["accuracy"] == 0.0


def test_regrade_rejects_a_non_run_directory(tmp_path):
    result = subprocess.run([sys.executable, "-m", "evals.grading", str(tmp_path)], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.startswith("error: ") and "Traceback" not in result.stderr


def test_a_run_leaves_nothing_of_hydras_beside_its_run_directory(tmp_path):
    """Started from any folder, a single run writes its run directory and nothing else there: no
    `.hydra/<timestamp>/` folder per run."""
    where = tmp_path / "cwd"
    where.mkdir()
    result = subprocess.run([sys.executable, "-m", "evals.run", *BASE, "dataset.names=[demo_math]", "limit=1",
                             "generation.max_new_tokens=4", f"results_dir={tmp_path / 'runs'}"], cwd=where,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    assert list(where.iterdir()) == []
    assert [path.name for path in (tmp_path / "runs").iterdir()] == [run.name for run in run_dirs(tmp_path / "runs")]


def test_over_long_prompts_are_recorded_and_the_run_goes_on(tmp_path):
    result = run_cli(*BASE, "model.architecture.max_position_embeddings=256", f"results_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    rows = [row for run in run_dirs(tmp_path) for row in records(run)]
    reasons = {row["reason"] for row in rows}
    assert "prompt_too_long" in reasons and len(reasons) > 1  # short prompts still generated
    assert all(not row["correct"] for row in rows if row["reason"] == "prompt_too_long")


# --- out of memory, scope, locking, corrupt files, Ctrl-C -----------------------------------------


def fail_above(monkeypatch, limit: int, error: Exception) -> list[int]:
    """Make the engine raise `error` (as CUDA does when out of memory) for static batches and serving
    passes of more than `limit` rows; returns the row counts it was asked for."""
    from longflow.engine import Engine

    sizes, generate, serve = [], Engine.generate, Engine.serve

    def generate_or_fail(engine, prompts, generation, seeds):
        sizes.append(len(prompts))
        if len(prompts) > limit:
            raise error
        return generate(engine, prompts, generation, seeds)

    def serve_or_fail(engine, prompts, generation, seeds):
        sizes.append(min(engine.config.batch_size, len(prompts)))
        if sizes[-1] > limit:
            raise error
        yield from serve(engine, prompts, generation, seeds)

    monkeypatch.setattr(Engine, "generate", generate_or_fail)
    monkeypatch.setattr(Engine, "serve", serve_or_fail)
    return sizes


@pytest.mark.slow
@pytest.mark.parametrize("continuous,expected_sizes", [("false", [4, 2, 1, 1, 1, 1, 1]), ("true", [4, 2, 1])])
@pytest.mark.parametrize("error", [__import__("torch").OutOfMemoryError("CUDA out of memory. Tried to allocate"),
                                   RuntimeError("CUDA error: out of memory")])
def test_out_of_memory_halves_the_batch_and_loses_nothing(monkeypatch, tmp_path, error, continuous, expected_sizes):
    sizes = fail_above(monkeypatch, 1, error)
    monkeypatch.setattr("longflow.engine.Engine.warm_up", lambda engine, rows=None: None)
    [metrics] = evaluate(compose_config(*BASE, "engine.batch_size=4", "limit=5", "dataset.names=[demo_math]",
                                        f"engine.continuous={continuous}", f"results_dir={tmp_path}"))
    [run] = run_dirs(tmp_path)
    batches = [json.loads(line) for line in (run / "batches.jsonl").read_text().splitlines()]
    assert sizes == expected_sizes  # 4 -> 2 -> 1, then 1 for good
    assert [batch["batch_size"] for batch in batches] == [1] * 5 and all(b["size"] == 1 for b in batches)
    rows = records(run)
    assert sorted(r["id"] for r in rows) == sorted({r["id"] for r in rows}) and len(rows) == 5
    assert metrics["n_items"] == 5


@pytest.mark.slow
def test_static_batches_and_continuous_batching_give_the_same_records(reference, tmp_path):
    result = run_cli(*BASE, "method=h2o", "engine.continuous=false", f"results_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    for run in run_dirs(tmp_path):
        dataset = json.loads((run / "run.json").read_text())["dataset"]
        assert by_key(records(run)) == by_key(reference[dataset])
        batches = [json.loads(line) for line in (run / "batches.jsonl").read_text().splitlines()]
        assert not any(batch["continuous"] for batch in batches)


def test_warm_up_runs_at_the_first_batch_size_and_only_when_something_is_generated(monkeypatch, tmp_path):
    sizes = []
    monkeypatch.setattr("longflow.engine.Engine.warm_up", lambda engine, rows=None: sizes.append(rows))
    config = compose_config(*BASE, "engine.batch_size=8", "limit=3", "dataset.names=[demo_math]",
                            f"results_dir={tmp_path}")
    evaluate(config)
    assert sizes == [3]  # three items: no compilation for eight rows
    evaluate(config)  # complete: nothing to generate, nothing to warm up
    assert sizes == [3]


def test_out_of_memory_at_batch_size_1_is_one_clear_line(monkeypatch, tmp_path):
    fail_above(monkeypatch, 0, __import__("torch").OutOfMemoryError("CUDA out of memory"))
    monkeypatch.setattr("longflow.engine.Engine.warm_up", lambda engine, rows=None: None)
    with pytest.raises(UserError, match="out of memory on cpu generating one sequence"):
        evaluate(compose_config(*BASE, "engine.batch_size=2", "limit=1", "dataset.names=[demo_math]",
                                f"results_dir={tmp_path}"))


@pytest.mark.slow
def test_a_smaller_limit_reports_only_its_items(tmp_path):
    overrides = [*BASE, "dataset.names=[demo_math]", f"results_dir={tmp_path}"]
    [wide] = evaluate(compose_config(*overrides, "limit=4"))
    [narrow] = evaluate(compose_config(*overrides, "limit=2"))
    [run] = run_dirs(tmp_path)
    assert wide["n_items"] == 4 and narrow["n_items"] == 2
    assert len(records(run)) == 4  # the other items' records stay in the file
    subprocess.run([sys.executable, "-m", "evals.grading", str(run)], cwd=REPO, check=True, timeout=120,
                   capture_output=True)
    assert json.loads((run / "metrics.json").read_text())["n_items"] == 2


def fake_run(path: Path, records_text: str, identity_text: str | None = None) -> Path:
    """A run directory as evals.run leaves it, without running a model."""
    path.mkdir()
    identity = {"kind": "math", "thinks": True, "generation_params": {"n_samples": 1}, "model": "m", "hub_id": "h",
                "method": "vanilla", "variant": "paper", "budget": None, "generation": "greedy", "dataset": "d",
                "dataset_size": 1}
    (path / "run.json").write_text(identity_text if identity_text is not None else json.dumps(identity))
    (path / "generations.jsonl").write_text(records_text)
    return path


RECORD = {"id": "0", "sample": 0, "output": "</think>\\boxed{2}", "finish_reason": "eos", "gold": "2",
          "extracted": None, "correct": False, "reason": "mismatch", "output_tokens": 3, "peak_slots": 8}


def regrade_cli(run: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evals.grading", str(run)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_regrade_refuses_a_run_being_written(tmp_path):
    """evals.grading rewrites generations.jsonl: while a run holds the lock, it must not."""
    from evals.store import lock_run

    run = fake_run(tmp_path / "run", json.dumps(RECORD) + "\n")
    before = (run / "generations.jsonl").read_text()
    with lock_run(run):
        result = regrade_cli(run)
    assert result.returncode == 2 and "being written by another process" in result.stderr, result.stderr
    assert (run / "generations.jsonl").read_text() == before
    result = regrade_cli(run)
    assert result.returncode == 0, result.stderr
    assert records(run)[0]["correct"] is True  # re-graded once the lock was free
    assert json.loads((run / "grader.json").read_text()) == grader_record()  # and by which grader


def test_regrade_of_a_live_run_before_its_first_batch_says_it_is_being_written(tmp_path):
    """A run directory holds run.json from its start, generations.jsonl only from its first batch."""
    from evals.store import lock_run

    run = fake_run(tmp_path / "run", "")
    (run / "generations.jsonl").unlink()
    with lock_run(run):
        result = regrade_cli(run)
    assert result.returncode == 2 and "being written by another process" in result.stderr, result.stderr
    result = regrade_cli(run)  # a run killed before its first batch: nothing to grade
    assert result.returncode == 2 and "holds no outputs yet" in result.stderr, result.stderr


@pytest.mark.parametrize("identity_text, records_text, needle", [
    ("{not json", json.dumps(RECORD) + "\n", "run.json is corrupt"),
    (None, "[1, 2]\n", "generations.jsonl:1: corrupt record (a JSON list, not an object)"),
    (None, json.dumps(RECORD) + "\n\"text\"\n", "generations.jsonl:2: corrupt record (a JSON str"),
])
def test_corrupt_run_files_are_one_line(tmp_path, identity_text, records_text, needle):
    result = regrade_cli(fake_run(tmp_path / "run", records_text, identity_text))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1 and needle in result.stderr


def test_a_corrupt_run_json_is_a_user_error_when_a_run_resumes(tmp_path):
    from evals.store import IDENTITY, RunDir, run_name

    identity = {"model": "m", "method": "vanilla", "budget": None, "generation": "greedy", "dataset": "d"}
    (tmp_path / run_name(identity)).mkdir()
    (tmp_path / run_name(identity) / IDENTITY).write_text("\x00garbage")
    with pytest.raises(UserError, match="run.json is corrupt"):
        RunDir(tmp_path, identity)
    with RunDir(tmp_path / "other", identity):  # and the failed attempt did not keep the lock
        pass


@pytest.mark.slow
def test_ctrl_c_is_one_line_and_the_run_resumes(tmp_path):
    # Long enough outputs that the run is still going when the first records appear.
    longer = ["generation.max_new_tokens=160", "generation.ignore_eos=true"]
    # Started as from a terminal: SIGINT at its default. A test runner started in the background of a
    # non-interactive shell ignores SIGINT, and its children would inherit that (and never stop).
    process = subprocess.Popen([sys.executable, "-m", "evals.run", *BASE, *longer, "method=h2o",
                                f"results_dir={tmp_path}"],
                               cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 240
    while time.time() < deadline and process.poll() is None:  # Ctrl-C once the first batch is stored
        found = list(tmp_path.glob("*/generations.jsonl"))
        if found and found[0].read_text().count("\n") >= 2:
            break
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGINT)  # as a terminal does: the whole process group
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    lines = [line for line in stderr.splitlines() if line.strip() and "sample/s" not in line and "%|" not in line]
    assert "Traceback" not in stderr and len(lines) == 1, stderr
    match = re.fullmatch(r"interrupted; (\d+) samples saved in (\S+); run the same command to resume", lines[0])
    assert match and Path(match.group(2)).is_dir()
    assert int(match.group(1)) == len(records(Path(match.group(2))))
    result = run_cli(*BASE, *longer, "method=h2o", f"results_dir={tmp_path}")
    assert result.returncode == 0, result.stderr


def test_a_local_checkpoint_is_part_of_the_identity(tmp_path):
    """A local folder has no revision: its weights' content names the run, so a retrained model starts
    new runs instead of resuming the old model's."""
    from evals.fingerprint import checkpoint_fingerprint

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "train_log.json").write_text("{}")
    before = checkpoint_fingerprint(str(tmp_path))
    (tmp_path / "train_log.json").write_text('{"note": 1}')  # not the model
    assert checkpoint_fingerprint(str(tmp_path)) == before
    (tmp_path / "model.safetensors").write_bytes(b"retrained")
    assert checkpoint_fingerprint(str(tmp_path)) not in (before, None)
    assert checkpoint_fingerprint("Qwen/Qwen3-8B") is None
