"""`make demo`: it writes only git-ignored files, and what it computes on the CPU is what the
committed reference, results/demo/, says: accuracies and KV slots held, cell for cell (tokens/s
depends on the machine and is not compared)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "results" / "demo"
FRESH = Path(os.environ.get("LONGFLOW_DEMO_OUT", REPO / "build" / "demo"))  # where `make demo` writes
DETERMINISTIC = {"table.csv": 0.0, "table_kv_slots.csv": 0.0, "table_agreement.csv": 1e-6}  # file: tolerance
KEYS = ["Model", "Budget", "Method"]


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=60)


def written_paths(commands: str) -> list[str]:
    """The paths a printed make recipe writes or deletes: every results_dir=, --out and rm -rf argument."""
    return re.findall(r"(?:results_dir=|--out |rm -rf )(\S+)", commands)


@pytest.mark.skipif(shutil.which("make") is None or shutil.which("git") is None, reason="needs make and git")
def test_demo_writes_only_ignored_paths():
    if git("rev-parse", "--is-inside-work-tree").returncode != 0:
        pytest.skip("not a git checkout")
    recipe = subprocess.run(["make", "-n", "demo", f"PY={sys.executable}"], cwd=REPO, capture_output=True,
                            text=True, timeout=60, check=True).stdout
    paths = written_paths(recipe)
    assert len(paths) >= 8  # two sweeps, four tables, the figures, the CSV
    for path in paths:
        assert git("check-ignore", "-q", "--no-index", path).returncode == 0, f"make demo writes {path}, not ignored"
    config = (REPO / "conf" / "experiment" / "demo.yaml").read_text()
    [default] = re.findall(r"^results_dir: (\S+)", config, flags=re.MULTILINE)
    assert git("check-ignore", "-q", "--no-index", default).returncode == 0


def cells(path: Path) -> pd.DataFrame:
    """A table CSV as one number per (row keys, column), item-set columns only (no SE, no Avg.)."""
    frame = pd.read_csv(path)
    columns = [c for c in frame.columns if c not in {*KEYS, "Partial", "Dirty", "Avg."} and not c.endswith(" SE")]
    return frame.assign(Budget=frame["Budget"].fillna(-1)).set_index(KEYS)[columns].stack().sort_index()


@pytest.mark.parametrize("name", sorted(DETERMINISTIC))
def test_fresh_demo_matches_reference(name):
    """After `make demo`: its tables equal the committed ones, cell for cell."""
    if not (FRESH / name).exists():
        pytest.skip(f"no fresh demo output in {FRESH} (run make demo)")
    fresh, reference = cells(FRESH / name), cells(REFERENCE / name)
    assert list(fresh.index) == list(reference.index)
    same = ((fresh - reference).abs() <= DETERMINISTIC[name]) | (fresh.isna() & reference.isna())
    assert same.all(), f"{name} differs from results/demo/ at {list(same.index[~same])}"


@pytest.mark.slow
def test_one_demo_run_reproduces_the_reference(tmp_path):
    """R-KV at 96 slots over the demo's 16 items, on the CPU, solves what the committed table says."""
    out = tmp_path / "runs"
    result = subprocess.run([sys.executable, "-m", "evals.run", "experiment=demo", "method=rkv", "budget=96",
                             f"results_dir={out}"], cwd=REPO, capture_output=True, text=True, timeout=900,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    [metrics] = out.glob("*/metrics.json")
    accuracy = pd.read_json(metrics, typ="series")["accuracy"]
    reference = cells(REFERENCE / "table.csv")
    assert 100 * accuracy == pytest.approx(reference[("canary", 96, "R-KV", "canary (16)")], abs=1e-9)
