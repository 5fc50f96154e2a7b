"""Which items each run is reported over: the item sets a sweep's jobs covered (`sweep.json`, written by
`evals.sweeps.SweepRecord`), or, for every run under a folder, the items of its last config (items.json)
and every item set a sweep under that folder recorded for it.

A run directory does not depend on `limit` or `shard`, so its items.json and metrics.json follow the
last config that ran there: a report that trusted them would change an earlier sweep's numbers after
the fact. An item set here is a list of item ids, or None for "the items of the run's last config"
(a sweep written before item sets were recorded, or a run found under a folder).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from longflow.errors import UserError

SWEEP = "sweep.json"

ItemSet = list[str] | None


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def read_sweep(sweep_dir: Path) -> dict:
    """A sweep folder's sweep.json; UserError when it is missing or malformed."""
    path = sweep_dir / SWEEP
    try:
        sweep = json.loads(path.read_text(encoding="utf-8"))
    except OSError:
        raise UserError(f"{path} does not exist (--sweep takes the folder evals.run -m wrote it in)") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"{path} is not JSON ({error})") from None
    runs = sweep.get("runs") if isinstance(sweep, dict) else None
    if not isinstance(runs, list) or not all(isinstance(run, str) for run in runs):
        raise UserError(f"{path} has no list of run directories under \"runs\"")
    return sweep


def run_path(sweep_dir: Path, run: str) -> Path:
    """A run directory as sweep.json gives it: absolute, or relative to the working directory the
    sweep ran in (tried from here first), or to the sweep folder."""
    path = Path(run)
    return (path if path.is_absolute() or path.exists() else sweep_dir / path).resolve()


def recorded_item_sets(sweep_dir: Path, sweep: dict) -> dict[Path, list[ItemSet]]:
    """`{run directory: the item sets the sweep's finished jobs covered there}` from `job_runs`, in job
    order; {} for a sweep.json written before item sets were recorded."""
    found: dict[Path, list[ItemSet]] = {}
    jobs = sweep.get("job_runs")
    if not isinstance(jobs, dict):
        return found
    item_sets = sweep.get("item_sets") or {}
    for job in sorted(jobs, key=lambda number: int(number) if str(number).isdigit() else -1):
        for entry in (jobs[job] or {}).get("runs", []):
            items = item_sets.get(entry.get("items")) if entry.get("items") is not None else None
            found.setdefault(run_path(sweep_dir, entry["run"]), []).append(items)
    return found


def sweep_item_sets(sweep_dir: Path) -> dict[Path, list[ItemSet]]:
    """The runs of one sweep and the item sets its jobs covered there; a warning line when some of
    its jobs did not finish (stopped by a refusal, a failure or Ctrl-C: the table lacks their runs),
    and when its sweep.json records no item sets (its runs are then reported over the items of their
    last config, which a later command may have changed)."""
    sweep = read_sweep(sweep_dir)
    jobs = sweep.get("jobs")
    finished = len(sweep["job_runs"]) if isinstance(sweep.get("job_runs"), dict) else sweep.get("finished")
    if isinstance(jobs, int) and isinstance(finished, int) and finished < jobs:
        warn(f"sweep {sweep_dir}: {finished} of {jobs} jobs finished")
    if "job_runs" in sweep:
        return recorded_item_sets(sweep_dir, sweep)
    warn(f"{sweep_dir / SWEEP} records no item sets (written by an older evals.run): its runs are reported "
         "over the items of the last config run in each, which a later command may have changed")
    return {run_path(sweep_dir, run): [None] for run in sweep["runs"]}


def folder_item_sets(runs_dir: Path, runs: list[Path]) -> dict[Path, list[ItemSet]]:
    """The item sets of each of `runs` (directories under `runs_dir`): its last config's, then every
    one that a sweep.json anywhere under `runs_dir` (Hydra's hidden sweep folders included) recorded
    for it."""
    found: dict[Path, list[ItemSet]] = {run: [None] for run in runs}
    by_path = {run.resolve(): run for run in runs}
    for path in sorted(runs_dir.rglob(SWEEP)):
        try:
            sweep = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue  # a sweep's record only adds item sets; without it, every item a run holds still shows
        if isinstance(sweep, dict):
            for run, item_sets in recorded_item_sets(path.parent, sweep).items():
                if run in by_path:
                    found[by_path[run]] += item_sets
    return found
