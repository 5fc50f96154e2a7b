"""The entry point as the tests drive it: `python -m evals.run` on the tiny model and the demo data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BASE = ["model=tiny_qwen3", "dataset=demo", "generation.max_new_tokens=24", "budget=48", "device=cpu",
        "engine.batch_size=2", "grading.workers=1"]


def run_cli(*args: str, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evals.run", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def run_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "generations.jsonl").read_text().splitlines()]
