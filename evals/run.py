"""The entry point: `python -m evals.run [overrides]` evaluates a model x method x budget on datasets.

    python -m evals.run                                   # the embedded default: the canary model and task
    python -m evals.run model=r1_distill_llama_8b method=longflow budget=2400 dataset=all
    python -m evals.run -m method=vanilla,h2o,longflow budget=1024,2048 dataset=gsm8k limit=64

This module is the command line: the group choices, override keys and field values of every job
are checked before Hydra starts (torch-free checks first, so a typo answers at once), then Hydra's
main runs each job through `evals.pipeline.evaluate`. Errors are one `error:` line and exit code 2.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from evals.checks import check_choices, check_fields, check_override_keys
from evals.configs import CONF_DIR, PRIMARY, VERSION_BASE, compose_config
from evals.hub import offline_unless_reachable
from evals.sweeps import sweep_jobs
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
        jobs = sweep_jobs(overrides) if flags else [overrides]
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


def _hydra_main() -> None:
    import hydra
    from omegaconf import OmegaConf

    from evals.grading import GraderError
    from evals.pipeline import Interrupted, evaluate

    @hydra.main(version_base=VERSION_BASE, config_path=str(CONF_DIR), config_name=PRIMARY)
    def main(config) -> list[str]:
        """One job; returns its run directories (`results_dir` as given / run name: `evals.sweeps`)."""
        try:
            cfg = OmegaConf.to_container(config, resolve=True)
            metrics = evaluate(cfg, OmegaConf.to_yaml(config, resolve=True))
            return [str(Path(cfg["results_dir"]) / run["run_id"]) for run in metrics]
        except UserError as error:
            sys.exit(report(error))
        except GraderError as error:  # the grader's own failure: nothing was counted wrong for it
            print(f"error: grading failed, the run stopped: {error}", file=sys.stderr)
            sys.exit(1)
        except Interrupted as interrupted:
            print(interrupted, file=sys.stderr)
            sys.exit(INTERRUPTED)

    main()


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
