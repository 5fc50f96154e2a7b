"""The entry point: `python -m evals.run [overrides]` evaluates a model x method x budget on datasets.

    python -m evals.run                                   # the embedded default: the canary model and task
    python -m evals.run model=r1_distill_llama_8b method=longflow budget=2400 dataset=all
    python -m evals.run -m method=vanilla,h2o,longflow budget=1024,2048 dataset=gsm8k limit=64

This module is the command line: the group choices, override keys and field values of every job
are checked before Hydra starts (torch-free checks first, so a typo answers at once), then Hydra's
main runs each job through `evals.pipeline.evaluate`. Errors are one `error:` line and exit code 2;
a job of a `-m` sweep that is refused does not stop the others (`_hydra_main`), and a run made by
other code is named with the command that redoes it alone (`redo_command`).
"""

from __future__ import annotations

import os
import shlex
import sys
import warnings
from pathlib import Path

from evals.checks import check_choices, check_fields, check_override_keys
from evals.configs import CONF_DIR, PRIMARY, VERSION_BASE, compose_config
from evals.hub import offline_unless_reachable
from evals.sweeps import split_overrides, sweep_jobs
from longflow.errors import UserError, report

INTERRUPTED = 130  # the exit code of a process ended by SIGINT
MULTIRUN = ("-m", "--multirun")


def check_overrides(argv: list[str]) -> None:
    """Compose the config of every job the command line asks for (each point of a `-m` sweep) and
    check it, before Hydra starts anything: a bad override or value fails here with one line, not
    with Hydra's multi-line report, nor halfway through a sweep. Command lines with Hydra's other
    flags (--cfg, --help, a config name...) are left to Hydra."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    flags = [argument for argument in argv if argument.startswith("-")]
    if set(flags) - set(MULTIRUN):
        return
    overrides = [argument for argument in argv if not argument.startswith("-")]
    check_choices(overrides)
    try:
        try:
            jobs = sweep_jobs(overrides) if flags else [overrides]
        except HydraException:  # composing the sweep's first job, to read an experiment's sweep params
            check_override_keys(split_overrides(overrides)[0])
            raise
        configs = []
        for job in jobs:
            try:
                configs.append(compose_config(job))
            except HydraException:
                check_override_keys(job)  # a mistyped key: named with the nearest one, not Hydra's advice
                raise
            check_fields(configs[-1])
    except (HydraException, OmegaConfBaseException) as error:
        raise UserError(_one_line(error)) from None
    offline_unless_reachable(configs)  # before the hub libraries are imported
    from evals.pipeline import Setup  # torch and the method classes: after the checks that need neither

    for cfg in configs:
        Setup.from_config(cfg)


def _one_line(error: BaseException) -> str:
    """Hydra's and OmegaConf's messages (and their causes) on one line."""
    parts = [str(error)]
    if error.__cause__ is not None:
        parts.append(str(error.__cause__))
    lines = [line.strip() for part in parts for line in part.splitlines()]
    return "; ".join(line for line in lines if line and not line.startswith(("full_key", "object_type", "See ")))


def redo_command(overrides: list[str], dataset: str, datasets: list[str]) -> str:
    """The command that starts the run of `dataset` again and no other: the job's `overrides` with
    `overwrite=true`, its datasets narrowed to that one (overwrite=true deletes every run of its
    command), and without `shard=` (a shard cannot be overwritten alone: the whole run is redone)."""

    def key(override: str) -> str:
        return override.partition("=")[0].lstrip("+~")

    kept = [override for override in overrides
            if key(override) not in ("overwrite", "allow_code_change", "shard", "dataset.names")
            and not (key(override).startswith("dataset.overrides.")
                     and key(override).split(".")[2] != dataset and len(datasets) > 1)]
    narrowed = [f"dataset.names=[{dataset}]"] if len(datasets) > 1 else []
    return shlex.join(["python", "-m", "evals.run", *kept, *narrowed, "overwrite=true"])


def _hydra_main() -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from evals.grading import GraderError
    from evals.pipeline import Interrupted, StaleRuns, evaluate

    # A job of a -m sweep that is refused is reported and the sweep goes on: every job's config was
    # checked before Hydra started, so what refuses one job (a run made by other code, a run locked by
    # another process, one item out of memory) is that job's own, and the others may hold hours of
    # work. Counted here when the jobs run in this process; a launcher's job that runs in another
    # exits with the error, and the launcher reports it as failed.
    this_process, jobs, refused = os.getpid(), [], []

    @hydra.main(version_base=VERSION_BASE, config_path=str(CONF_DIR), config_name=PRIMARY)
    def main(config) -> list[str]:
        """One job; returns its run directories (`results_dir` as given / run name: `evals.sweeps`)."""
        hydra_config = HydraConfig.get()
        goes_on = hydra_config.mode == RunMode.MULTIRUN and os.getpid() == this_process
        if goes_on:
            jobs.append(hydra_config.job.num)
        cfg = OmegaConf.to_container(config, resolve=True)
        try:
            metrics = evaluate(cfg, OmegaConf.to_yaml(config, resolve=True))
        except StaleRuns as stale:
            for dataset, error in stale.refused:
                command = redo_command(list(hydra_config.overrides.task), dataset, cfg["dataset"]["names"])
                print(f"error: {error.run} was made by other code ({error.changes}); to start this run alone "
                      f"again: {command} (allow_code_change=true in place of overwrite=true resumes it "
                      "knowingly)", file=sys.stderr)
            if not goes_on:
                sys.exit(2)
            refused.append(hydra_config.job.num)
            metrics = stale.metrics
        except UserError as error:
            if not goes_on:
                sys.exit(report(error))
            report(error)
            refused.append(hydra_config.job.num)
            metrics = []
        except GraderError as error:  # the grader's own failure: nothing was counted wrong for it
            print(f"error: grading failed, the run stopped: {error}", file=sys.stderr)
            sys.exit(1)
        except Interrupted as interrupted:
            print(interrupted, file=sys.stderr)
            sys.exit(INTERRUPTED)
        return [str(Path(cfg["results_dir"]) / run["run_id"]) for run in metrics]

    main()
    if refused:
        numbers = ", ".join(f"#{number}" for number in refused)
        raise UserError(f"{len(refused)} of {len(jobs)} jobs refused ({numbers}, their errors above); "
                        "the other jobs ran")


def readable_warnings() -> None:
    """Warnings as one `warning:` line without the source location (a method's warning points into
    the dataclass's generated `__init__`, `<string>:16`), and transformers' FutureWarnings about
    its own coming changes (nothing a user of this harness acts on) silenced."""
    warnings.formatwarning = lambda message, category, *args, **kwargs: f"warning: {message}\n"
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers(\.|$)")


def main(argv: list[str]) -> None:
    readable_warnings()
    try:
        check_overrides(argv)
        _hydra_main()
    except UserError as error:
        sys.exit(report(error))
    except KeyboardInterrupt:  # before any dataset run started: nothing to save
        print("interrupted; nothing was generated yet", file=sys.stderr)
        sys.exit(INTERRUPTED)


if __name__ == "__main__":
    main(sys.argv[1:])
