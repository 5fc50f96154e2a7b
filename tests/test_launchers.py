"""Sweeps through Hydra launchers: submitit's local executor and joblib run a sweep's jobs as separate
processes with correct grades; the SLURM config resolves; a job that sees several GPUs claims one."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers.runs import BASE, REPO, records, run_cli, run_dirs

from evals import gpus
from evals.grading import grade

SWEEP = ["-m", *BASE, "method=h2o,streaming", "dataset.names=[demo_math],[demo_gpqa]", "limit=2"]


def has_plugin(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package (hydra_plugins) is not installed either
        return False


def assert_graded_sweep(root: Path) -> None:
    """Four run directories (2 methods x 2 datasets), every item done and graded as this process's
    grader grades the stored output."""
    runs = run_dirs(root)
    assert len(runs) == 4
    for run in runs:
        identity = json.loads((run / "run.json").read_text())
        metrics = json.loads((run / "metrics.json").read_text())
        assert metrics["n_items"] == 2
        for row in records(run):
            expected = grade(identity["kind"], row["output"], row["gold"], finish_reason=row["finish_reason"],
                             thinks=identity["thinks"])
            assert (row["correct"], row["extracted"], row["reason"]) == (
                expected.correct, expected.extracted, expected.reason)
    assert {json.loads((run / "run.json").read_text())["method"] for run in runs} == {"h2o", "streaming"}


@pytest.mark.slow
@pytest.mark.skipif(not has_plugin("hydra_plugins.hydra_submitit_launcher"),
                    reason='hydra-submitit-launcher is not installed (pip install ".[cluster]")')
def test_submitit_local_sweep(tmp_path):
    result = run_cli(*SWEEP, "hydra/launcher=local_gpus", f"results_dir={tmp_path}",
                     f"hydra.sweep.dir={tmp_path / '.hydra'}", timeout=600)
    assert result.returncode == 0, result.stderr
    assert_graded_sweep(tmp_path)
    jobs = [path for path in (tmp_path / ".hydra" / ".submitit").rglob("*_result.pkl")]
    assert len(jobs) == 4  # four submitit jobs, each its own process


@pytest.mark.slow
@pytest.mark.skipif(not has_plugin("hydra_plugins.hydra_joblib_launcher"),
                    reason='hydra-joblib-launcher is not installed (pip install ".[cluster]")')
def test_joblib_sweep(tmp_path):
    result = run_cli(*SWEEP, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", f"results_dir={tmp_path}",
                     f"hydra.sweep.dir={tmp_path / '.hydra'}", timeout=600)
    assert result.returncode == 0, result.stderr
    assert_graded_sweep(tmp_path)


@pytest.mark.skipif(not has_plugin("hydra_plugins.hydra_submitit_launcher"),
                    reason='hydra-submitit-launcher is not installed (pip install ".[cluster]")')
def test_slurm_config_resolves():
    result = subprocess.run(
        [sys.executable, "-m", "evals.run", "experiment=table1", "hydra/launcher=slurm", "hydra.launcher.partition=gpu",
         "hydra.launcher.account=lab", "hydra.launcher.timeout_min=720", "--cfg", "hydra", "--resolve"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    launcher = yaml.safe_load(result.stdout)["hydra"]["launcher"]
    assert launcher["_target_"].endswith("SlurmLauncher")
    assert (launcher["partition"], launcher["account"], launcher["timeout_min"]) == ("gpu", "lab", 720)
    assert launcher["gpus_per_node"] == 1 and launcher["tasks_per_node"] == 1 and launcher["nodes"] == 1


# --- claiming a GPU ---------------------------------------------------------------------------------

CLAIMER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from evals.gpus import claim_gpu
    gpu = claim_gpu(sys.argv[2].split(","), Path(sys.argv[1]), wait_seconds=0.05)
    print(gpu, time.time(), flush=True)
    time.sleep(float(sys.argv[3]))
    print(time.time(), flush=True)
""")


def claimer(folder: Path, gpus: str, hold: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CLAIMER, str(folder), gpus, str(hold)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)


def test_parallel_jobs_claim_different_gpus_and_wait_for_a_free_one(tmp_path):
    first, second = claimer(tmp_path, "0,1", 3.0), claimer(tmp_path, "0,1", 3.0)
    time.sleep(1.5)  # both hold their GPU now; a third job must wait for one of them
    third = claimer(tmp_path, "0,1", 0.0)
    outputs = [process.communicate(timeout=60)[0].split() for process in (first, second, third)]
    (gpu_a, _, end_a), (gpu_b, _, end_b), (gpu_c, start_c, _) = outputs
    assert {gpu_a, gpu_b} == {"0", "1"}
    assert float(start_c) >= min(float(end_a), float(end_b))  # only once a GPU was free again
    assert gpu_c in {"0", "1"}


@pytest.fixture
def fake_gpus(monkeypatch, tmp_path):
    """A machine whose driver shows the GPUs that CUDA_VISIBLE_DEVICES lists (`started`: CUDA already
    started with `started` GPUs, so that narrowing no longer changes what it sees)."""
    state = {"started": None}

    def device_count():
        listed = os.environ.get("CUDA_VISIBLE_DEVICES", "0,1,2,3")
        return state["started"] or len(listed.split(","))

    monkeypatch.setattr(torch.cuda, "device_count", device_count)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(gpus, "lock_dir", lambda: tmp_path / "locks")
    monkeypatch.setattr(gpus, "_claim", {})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    return state


def hold(path: Path):
    """A lock on `path` as another job's claim holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a")  # noqa: SIM115  (closed by the caller)
    fcntl.flock(handle, fcntl.LOCK_EX)
    return handle


def test_a_job_that_sees_several_gpus_sees_one_after_its_claim(fake_gpus):
    with hold(gpus.lock_dir() / "gpu-3.lock"):  # another job holds GPU 3
        assert gpus.job_device("auto") == torch.device("cuda", 0)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5"
    assert gpus.job_device("auto") == torch.device("cuda", 0)  # a later job of the same process keeps it
    assert gpus.device_record(torch.device("cpu"))["claimed"] == "5"


def test_a_claim_after_cuda_started_uses_the_gpu_by_index(fake_gpus):
    fake_gpus["started"] = 2
    with hold(gpus.lock_dir() / "gpu-3.lock"):
        assert gpus.job_device("auto") == torch.device("cuda", 1)  # "5", the second of "3,5"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3,5"  # left as CUDA sees it


def test_no_claim_with_one_gpu_or_an_explicit_device(fake_gpus, monkeypatch):
    monkeypatch.setattr(gpus, "resolve_device", lambda device: device)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    assert gpus.job_device("auto") == "auto"  # resolved as ever: the one GPU
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert gpus.job_device("cuda:1") == "cuda:1"
    assert gpus._claim == {} and not gpus.lock_dir().exists()


def test_device_record_on_the_cpu():
    record = gpus.device_record(torch.device("cpu"))
    assert record["name"] == "cpu" and record["index"] is None and "cuda_visible_devices" in record
