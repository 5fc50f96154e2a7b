"""A run knows its code and says what resuming it does; a sweep lists the runs it made; the warnings
and the offline check that save a user hours."""

from __future__ import annotations

import json
import logging
import os
import shlex

import pytest
import torch
from helpers.runs import BASE, REPO, records, run_cli, run_dirs

from evals.configs import compose_config
from evals.fingerprint import grader_record
from evals.grading import Grade
from evals.hub import OFFLINE, offline_unless_reachable
from evals.pipeline import evaluate
from longflow.errors import UserError

EDITED = '''from baselines.streaming import StreamingPolicy


class EditedPolicy(StreamingPolicy):
    """StreamingLLM under another module: the method a user edits between two runs."""
'''


@pytest.fixture
def edited_method(tmp_path, monkeypatch):
    """A method module of its own on the path; returns its file."""
    folder = tmp_path / "methods"
    folder.mkdir()
    module = folder / "edited_method.py"
    module.write_text(EDITED)
    monkeypatch.syspath_prepend(str(folder))
    return module


def config(root, *overrides: str) -> dict:
    return compose_config([*BASE, "method=streaming", "method._target_=edited_method.EditedPolicy",
                           "dataset.names=[demo_math]", "limit=2", "generation.max_new_tokens=8",
                           f"results_dir={root}", *overrides])


def provenance(root) -> list[dict]:
    [run] = run_dirs(root)
    return json.loads((run / "provenance.json").read_text())


def test_editing_the_method_never_reports_the_old_numbers_silently(edited_method, tmp_path, capsys):
    root = tmp_path / "runs"
    [first] = evaluate(config(root))
    assert "accuracy" in capsys.readouterr().out

    edited_method.write_text(EDITED + "    n_sink: int = 4  # edited\n")
    with pytest.raises(UserError) as refused:
        evaluate(config(root))
    message = str(refused.value)
    assert "edited_method.py changed since" in message and "overwrite=true" in message
    assert "allow_code_change=true" in message and "\n" not in message
    assert "accuracy" not in capsys.readouterr().out  # no old numbers printed

    evaluate(config(root, "allow_code_change=true"))
    assert f"complete: nothing to generate in {root}" in capsys.readouterr().out
    codes = [entry["code"] for entry in provenance(root)]
    assert len(codes) == 2 and codes[0]["fingerprint"] != codes[1]["fingerprint"]
    assert {"git_commit", "dirty", "diff", "files"} <= set(codes[1])

    edited_method.write_text(EDITED + "    n_sink: int = 2  # edited again\n")
    [again] = evaluate(config(root, "overwrite=true"))
    out = capsys.readouterr().out
    assert "complete" not in out and "resuming" not in out
    assert len(provenance(root)) == 1 and again["n_items"] == first["n_items"] == 2


def test_a_changed_grader_grades_the_stored_outputs_again_on_resume(edited_method, tmp_path, capsys, monkeypatch):
    """A run extended under an edited grade() is graded by that grader alone, old items included, and
    grader.json says which grader that is; the generation code is the same, so nothing is refused."""
    root = tmp_path / "runs"
    evaluate(config(root, "limit=2"))
    [run] = run_dirs(root)
    assert json.loads((run / "grader.json").read_text()) == grader_record()
    assert not any(record["correct"] for record in records(run))  # random weights answer nothing

    def lenient(requests, workers, timeout):  # the edited grader: every answer right
        return [Grade(correct=True, extracted="2", reason="correct") for _ in requests]

    edited = grader_record()
    edited = {**edited, "fingerprint": "edited", "files": {**edited["files"], "evals/grading/verdict.py": "edited"}}
    monkeypatch.setattr("evals.pipeline.grade_many", lenient)
    monkeypatch.setattr("evals.grading.regrade.grade_many", lenient)
    monkeypatch.setattr("evals.pipeline.grader_record", lambda: edited)
    capsys.readouterr()
    [metrics] = evaluate(config(root, "limit=3"))
    assert "stored grades are from another grader (evals/grading/verdict.py changed since)" in capsys.readouterr().out
    assert len(records(run)) == 3 and all(record["correct"] for record in records(run))
    assert metrics["accuracy"] == 1.0
    assert json.loads((run / "grader.json").read_text()) == edited


def test_an_edited_prompt_is_generation_code(tmp_path, monkeypatch):
    """The prompts decide every token as the engine does: a run resumed after they changed is refused."""
    from baselines.streaming import StreamingPolicy
    from evals import fingerprint

    policy = StreamingPolicy(16)
    assert "evals/prompts.py" in fingerprint.code_record(policy)["files"]
    prompts = tmp_path / "prompts.py"
    prompts.write_text((fingerprint.REPO / fingerprint.PROMPTS).read_text())
    monkeypatch.setattr(fingerprint, "PROMPTS", str(prompts))
    before = fingerprint.code_record(policy)
    prompts.write_text(prompts.read_text() + 'MATH_INSTRUCTION = "Answer in \\boxed{}."\n')
    with pytest.raises(UserError, match="prompts.py changed since"):
        fingerprint.check_code(tmp_path / "run", [{"code": before}], fingerprint.code_record(policy), False)


def test_resuming_says_how_much_is_done(edited_method, tmp_path, capsys):
    root = tmp_path / "runs"
    evaluate(config(root, "limit=1"))
    capsys.readouterr()
    evaluate(config(root, "limit=3"))
    assert f"resuming {run_dirs(root)[0]}: 1 of 3 done, generating 2" in capsys.readouterr().out


def test_a_budget_that_holds_everything_is_warned(edited_method, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="evals.pipeline"):
        evaluate(config(tmp_path / "runs", "budget=4096"))
    assert any("never evicts" in record.getMessage() for record in caplog.records)


@pytest.fixture
def on_a_cpu_machine(monkeypatch):
    """device=auto finds no GPU, and loading the model fails the test."""

    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("evals.pipeline.job_device", lambda device: torch.device("cpu"))
    monkeypatch.setattr("evals.pipeline.load_model", load_model)


def large_model(root, device: str) -> dict:
    return compose_config(["model=qwen3_8b", "model.weights=random", "dataset=demo", "limit=1", f"device={device}",
                           f"results_dir={root}"])


def test_a_large_model_that_device_auto_puts_on_the_cpu_is_refused_before_loading(on_a_cpu_machine, tmp_path):
    """An 8B model's 16 GB read into a small machine's memory got its processes killed: its size is known
    from its config, so device=auto without a GPU refuses it, and device=cpu is the way to mean it."""
    with pytest.raises(UserError, match=r"model qwen3_8b \(8.2B parameters, 16 GB in bfloat16\) would run on the "
                                        r"CPU: device=auto found no GPU here; .*pass device=cpu"):
        evaluate(large_model(tmp_path, "auto"))


def test_a_large_model_on_the_cpu_asked_for_is_loaded_with_a_warning(on_a_cpu_machine, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="evals.pipeline"), pytest.raises(AssertionError, match="loaded"):
        evaluate(large_model(tmp_path, "cpu"))
    assert "model qwen3_8b (8.2B parameters, 16 GB in bfloat16) runs on the CPU: expect hours" in caplog.text


@pytest.mark.skipif(torch.cuda.is_available(), reason="device=auto finds a GPU here")
def test_a_large_model_on_a_cpu_machine_is_one_line(tmp_path):
    result = run_cli("model=qwen3_8b", "model.weights=random", "dataset=demo", f"results_dir={tmp_path}", timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert [line for line in result.stderr.splitlines() if line.strip()][-1].startswith("error: model qwen3_8b (8.2B")
    assert not run_dirs(tmp_path)


@pytest.fixture
def unreachable_hub(monkeypatch, tmp_path):
    """No hub (a local port nothing listens on: refused at once), and an empty hub cache."""
    from huggingface_hub import constants

    for name in OFFLINE:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    monkeypatch.delenv("https_proxy", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://127.0.0.1:9")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # for the processes a test starts
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def test_an_unreachable_hub_is_asked_once_then_offline(unreachable_hub):
    offline_unless_reachable([compose_config(["model=canary", "dataset=demo"])])  # needs no hub
    assert not any(os.environ.get(name) for name in OFFLINE)
    snapshot = unreachable_hub / "models--Qwen--Qwen3-8B" / "snapshots" / "abc"  # the model, cached
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (unreachable_hub / "models--Qwen--Qwen3-8B" / "refs").mkdir()
    (unreachable_hub / "models--Qwen--Qwen3-8B" / "refs" / "main").write_text("abc")
    offline_unless_reachable([compose_config(["model=qwen3_8b", "dataset=demo"])])
    assert all(os.environ.get(name) == "1" for name in OFFLINE)


def test_offline_a_model_that_is_not_cached_is_refused_before_hydra_starts(unreachable_hub, tmp_path):
    """`make table1` without the hub or the model: one line, before any of Hydra's launch lines."""
    with pytest.raises(UserError, match="deepseek-ai/DeepSeek-R1-Distill-Llama-8B .revision main. is not in the local"):
        offline_unless_reachable([compose_config(["experiment=table1", "method=vanilla"])])
    for name in OFFLINE:
        os.environ.pop(name)  # set by the probe above; the command below probes for itself
    result = run_cli("-m", "experiment=table1", "method=vanilla", f"results_dir={tmp_path / 'runs'}", timeout=120)
    assert result.returncode == 2 and result.stdout == "", result.stdout
    assert result.stderr.splitlines() == [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(result.stderr.splitlines()) == 1 and "is not in the local hub cache" in result.stderr


@pytest.mark.slow
def test_a_stale_run_in_a_sweep_names_its_own_command_and_the_sweep_goes_on(edited_method, tmp_path):
    """A run made by other code refuses its job's run alone: the sweep's other jobs and the job's other
    datasets run, the error gives the command that starts just that run again, and that command
    touches no other run."""
    env = {"PYTHONPATH": os.pathsep.join([str(edited_method.parent), str(REPO)])}
    runs, sweep = tmp_path / "runs", tmp_path / "sweep"
    common = [*BASE, "method=streaming", "method._target_=edited_method.EditedPolicy", "limit=1",
              "generation.max_new_tokens=4", f"results_dir={runs}"]
    first = run_cli(*common, "dataset.names=[demo_math]", "budget=32", env=env)
    assert first.returncode == 0, first.stderr
    [stale] = run_dirs(runs)
    edited_method.write_text(EDITED + "    n_sink: int = 4  # edited\n")

    result = run_cli("-m", *common, "budget=32,48", f"hydra.sweep.dir={sweep}", env=env)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2 and errors[-1].startswith("error: 1 of 2 jobs refused (#0")
    assert errors[0].startswith(f"error: {stale} was made by other code (")
    command = errors[0].split("to start this run alone again: ")[1].split(" (allow_code_change")[0]
    assert command.startswith("python -m evals.run ") and not {"-m", "--multirun"} & set(command.split()[3:])
    assert "budget=32" in command and command.endswith("overwrite=true")
    assert "dataset.names=[demo_math]" in command  # not the job's other dataset
    made = sorted(json.loads((sweep / "sweep.json").read_text())["runs"])
    assert len(run_dirs(runs)) == 4 and made == sorted(str(run) for run in run_dirs(runs) if run != stale)
    before = {run: records(run) for run in run_dirs(runs) if run != stale}

    redo = run_cli(*shlex.split(command)[3:], env=env)
    assert redo.returncode == 0, redo.stderr
    assert len(json.loads((stale / "provenance.json").read_text())) == 1  # started again, by this code
    assert {run: records(run) for run in run_dirs(runs) if run != stale} == before


@pytest.mark.slow
def test_a_sweep_lists_its_runs_and_prints_the_report_commands(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_cli("-m", *BASE, "method=streaming,h2o", "dataset.names=[demo_math]", "limit=1",
                     "generation.max_new_tokens=8", f"results_dir={tmp_path / 'runs'}", f"hydra.sweep.dir={sweep}")
    assert result.returncode == 0, result.stderr
    record = json.loads((sweep / "sweep.json").read_text())
    assert record["jobs"] == 2 and record["command"].startswith("python -m evals.run -m ")
    assert sorted(record["runs"]) == sorted(str(path) for path in run_dirs(tmp_path / "runs"))
    assert "job 1 of 2" in result.stdout and "job 2 of 2" in result.stdout
    assert f"python -m evals.report.table --sweep {sweep}" in result.stdout
    # The sweep's folder is its record, with no empty folder per job beside it.
    assert not [path for path in sweep.iterdir() if path.is_dir()]
