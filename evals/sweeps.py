"""A `-m` sweep: its jobs, as Hydra's basic sweeper makes them (the config's `hydra.sweeper.params`,
an experiment's, first, then the command line's overrides, a later value of a key replacing an
earlier one, and every combination of the swept values in order), and the record of the runs it
made (`SweepRecord`, a Hydra callback)."""

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
from omegaconf import DictConfig

from evals.configs import compose_config
from evals.store import atomic_write


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


class SweepRecord(Callback):
    """`<sweep dir>/sweep.json` = `{"runs": [run directories, as given], "command": ..., "jobs": N}`,
    updated as each job ends (a killed sweep still lists what it made; `evals.report.table --sweep` reads
    it); `job i of N` with an estimate of the time left as each job starts; the report commands at
    the end. Set in conf/config.yaml (`hydra.callbacks`)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        jobs = len(sweep_jobs(list(config.hydra.overrides.task)))
        command = shlex.join(["python", "-m", "evals.run", *sys.argv[1:]])
        _update(Path(config.hydra.sweep.dir) / SWEEP,
                lambda _: {"runs": [], "command": command, "jobs": jobs, "finished": 0, "started": time.time()})

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        record = _update(Path(config.hydra.sweep.dir) / SWEEP, lambda value: value)
        if not record:
            return
        finished, jobs = record.get("finished", 0), record["jobs"]
        left = ""
        if finished:
            per_job = (time.time() - record["started"]) / finished
            left = f", about {_duration(per_job * (jobs - finished))} left"
        print(f"job {HydraConfig.get().job.num + 1} of {jobs}{left}", flush=True)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        runs = job_return.return_value if job_return.status == JobStatus.COMPLETED else None

        def add(record: dict) -> dict:
            made = [run for run in runs or [] if run not in record.get("runs", [])]
            return {**record, "runs": [*record.get("runs", []), *made], "finished": record.get("finished", 0) + 1}

        _update(Path(config.hydra.sweep.dir) / SWEEP, add)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        folder = Path(config.hydra.sweep.dir)
        record = _update(folder / SWEEP, lambda value: value)
        print(f"sweep: {len(record.get('runs', []))} runs listed in {folder / SWEEP}; report them with")
        for command in REPORT_COMMANDS:
            print(f"  {command.format(dir=shlex.quote(str(folder)))}")
