"""A `-m` sweep: its jobs, as Hydra's basic sweeper makes them (the config's `hydra.sweeper.params`,
an experiment's, first, then the command line's overrides, a later value of a key replacing an
earlier one, and every combination of the swept values in order), and the record of the runs it
made and of the items each job ran them over (`SweepRecord`, a Hydra callback).

`<sweep dir>/sweep.json` (the same command started again keeps the entries of the jobs its earlier
starts finished; another command into the same folder starts a new record):

    {"command": "python -m evals.run -m ...", "jobs": 8, "finished": 8, "started": <time of this start>,
     "runs": [every run directory a finished job made, as given, each once],
     "job_runs": {"<job number>": {"ended": <time>, "runs": [{"run": <run directory>, "items": <key>}]}},
     "item_sets": {<key>: [the item ids, in the dataset's order]}}

A run directory does not depend on `limit` or `shard`: a later command with another `limit` reruns
the same directories over other items, and rewrites their items.json and metrics.json. What a
job covered is therefore recorded here, when it ends (the ids its run's items.json holds then: the
items of the job's config, every shard's), so that a report of this sweep
(`evals.report.runs`) computes each run's metrics over this sweep's items from the stored records,
whatever ran there later.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from evals.configs import compose_config
from evals.store import atomic_write, planned_items, stable_hash


def split_overrides(arguments: Sequence[str]) -> list[list[str]]:
    """Every job of the overrides `arguments` (`key=a,b` sweeps; `key=a` holds), each as its overrides."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    values: dict[str, list[str]] = {}
    for override in OverridesParser.create().parse_overrides(list(arguments)):
        key = override.get_key_element()
        if override.is_sweep_override():
            if not override.is_discrete_sweep():
                raise HydraException(f"only sweeps over listed values are supported: {override.input_line}")
            values[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        else:
            values[key] = [f"{key}={override.get_value_element_as_str()}"]
    return [list(job) for job in itertools.product(*values.values())]


def sweep_jobs(arguments: Sequence[str]) -> list[list[str]]:
    """The overrides of each job of `python -m evals.run -m <arguments>`, the sweep params of the
    config they select included (`experiment=demo` sweeps methods and budgets)."""
    first = split_overrides(arguments)[0]
    params = (compose_config(first, hydra_fields=True)["hydra"].get("sweeper") or {}).get("params") or {}
    return split_overrides([*(f"{key}={value}" for key, value in params.items()), *arguments])


SWEEP = "sweep.json"
# What a finished sweep prints for its runs (`{dir}`: the sweep folder).
REPORT_COMMANDS = ("python -m evals.report.table --sweep {dir} --out {dir}/table",
                   "python -m evals.report.figures --sweep {dir} --out {dir}")


def _update(path: Path, change: Callable[[dict], dict]) -> dict:
    """Rewrites the JSON object at `path` as `change(it)` under a lock (the jobs of a parallel
    launcher finish at once); returns the new object."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        value = change(json.loads(path.read_text()) if path.exists() else {})
        atomic_write(path, json.dumps(value, indent=2) + "\n")
    return value


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"


def job_entry(runs: list[str], item_sets: dict[str, list[str]]) -> dict:
    """A finished job's entry of `job_runs`: each of its runs with the key of the items it covered (the
    run's items.json now, added to `item_sets`; None when the run has none)."""
    entries = []
    for run in runs:
        items = planned_items(Path(run))
        key = None if items is None else stable_hash(sorted(map(str, items)))
        if key is not None:
            item_sets[key] = items
        entries.append({"run": run, "items": key})
    return {"ended": time.time(), "runs": entries}


class SweepRecord(Callback):
    """`<sweep dir>/sweep.json` (the module's docstring), updated as each job ends (a killed sweep
    still lists what it made; `evals.report.table --sweep` reads it); `job i of N` with an estimate of
    the time left as each job starts; the report commands at the end. Set in conf/config.yaml
    (`hydra.callbacks`)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        jobs = len(sweep_jobs(list(config.hydra.overrides.task)))
        command = shlex.join(["python", "-m", "evals.run", *sys.argv[1:]])
        path = Path(config.hydra.sweep.dir) / SWEEP
        replaced = []

        def start(record: dict) -> dict:
            # The same command again (after a refusal, a Ctrl-C, or to resume) keeps what its earlier
            # starts' jobs recorded: a job it stops before this time still made its runs over its items.
            same = record.get("command") == command and record.get("jobs") == jobs
            if record and not same:
                replaced.append(record.get("command"))
            kept = record if same else {}
            job_runs = kept.get("job_runs", {})
            return {"command": command, "jobs": jobs, "finished": len(job_runs), "started": time.time(),
                    "runs": kept.get("runs", []), "job_runs": job_runs, "item_sets": kept.get("item_sets", {})}

        _update(path, start)
        if replaced:
            print(f"note: {path} recorded another command ({replaced[0]}); it now records this one", flush=True)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN:  # a single run has no sweep to record, nor a folder to write
            return
        record = _update(Path(config.hydra.sweep.dir) / SWEEP, lambda value: value)
        number, jobs = HydraConfig.get().job.num, record["jobs"]
        ended = sum(entry["ended"] >= record["started"] for entry in record.get("job_runs", {}).values())
        left = ""
        if ended:
            per_job = (time.time() - record["started"]) / ended
            left = f", about {_duration(per_job * (jobs - number))} left"
        print(f"job {number + 1} of {jobs}{left}", flush=True)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN or job_return.status != JobStatus.COMPLETED:
            return
        runs = job_return.return_value or []

        def add(record: dict) -> dict:
            item_sets = dict(record.get("item_sets", {}))
            job_runs = {**record.get("job_runs", {}), str(config.hydra.job.num): job_entry(runs, item_sets)}
            return {**record, "runs": list(dict.fromkeys([*record.get("runs", []), *runs])), "job_runs": job_runs,
                    "item_sets": item_sets, "finished": len(job_runs)}

        _update(Path(config.hydra.sweep.dir) / SWEEP, add)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        folder = Path(config.hydra.sweep.dir)
        record = _update(folder / SWEEP, lambda value: value)
        print(f"sweep: {len(record.get('runs', []))} runs listed in {folder / SWEEP}; report them with")
        for command in REPORT_COMMANDS:
            print(f"  {command.format(dir=shlex.quote(str(folder)))}")
