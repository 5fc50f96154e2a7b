"""The experiment configs compose as their headers say (Table 1 runs the LongFlow authors' setting),
and every experiment's every sweep point composes into a checked run setup (as
lightning-hydra-template's test_sweeps)."""

from __future__ import annotations

import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
import yaml
from helpers.runs import REPO

from evals.configs import CONF_DIR, compose_config, group_options
from evals.pipeline import Job, Setup
from evals.sweeps import sweep_jobs

TABLE1_METHODS = yaml.safe_load((CONF_DIR / "experiment" / "table1.yaml").read_text())["hydra"]["sweeper"]["params"][
    "method"].split(",")
# Small budgets shrink the compression interval of interval methods, with a warning expected here.
pytestmark = pytest.mark.filterwarnings("ignore:.*leaves no room:UserWarning")


def composed(*overrides: str) -> dict:
    return compose_config(overrides)


@pytest.mark.parametrize("experiment", group_options("experiment"))
def test_every_experiment_sweep_point_composes_and_checks(experiment):
    jobs = sweep_jobs([f"experiment={experiment}"])
    swept = yaml.safe_load((CONF_DIR / "experiment" / f"{experiment}.yaml").read_text())["hydra"]["sweeper"]["params"]
    assert len(jobs) == math.prod(len(str(values).split(",")) for values in swept.values())
    for job in jobs:
        cfg = composed(*job)
        setup = Setup.from_config(cfg)
        for key, value in (override.split("=", 1) for override in job if not override.startswith("experiment=")):
            assert str(cfg[key]["name"] if isinstance(cfg[key], dict) else cfg[key]) == value
        assert setup.method == cfg["method"]["name"]


def test_the_command_line_replaces_an_experiments_sweep():
    jobs = sweep_jobs(["experiment=demo", "method=h2o,longflow", "budget=96"])
    assert [sorted(job) for job in jobs] == [["budget=96", "experiment=demo", "method=h2o"],
                                             ["budget=96", "experiment=demo", "method=longflow"]]


def test_table1_sweeps_every_method():
    assert sorted(TABLE1_METHODS) == sorted(["vanilla", "streaming", "h2o", "vatp", "rkv", "longflow"])


@pytest.mark.parametrize("method", TABLE1_METHODS)
def test_table1_is_the_authors_experiment(method):
    cfg = composed("experiment=table1", f"method={method}")
    assert cfg["method"]["name"] == method and cfg["method"]["variant"] == "lf_repo"
    assert cfg["model"]["name"] == "r1_distill_llama_8b" and cfg["budget"] == 2400
    assert cfg["generation"]["name"] == "lf_repo" and cfg["generation"]["protocol"] == "lf_repo"
    assert cfg["dataset"]["names"] == ["aime24", "aime25", "amc", "gpqa", "gsm8k", "math500", "minerva", "olympiad"]
    faithful = composed("experiment=table1", f"method={method}", "method.variant=paper")
    assert faithful["method"]["variant"] == "paper"
    assert {**faithful, "method": None} == {**cfg, "method": None}  # only the implementation changes


def test_table1_cfg_job_shows_the_variant():
    """The acceptance's own command (Hydra refuses --cfg with -m)."""
    result = subprocess.run([sys.executable, "-m", "evals.run", "experiment=table1", "method=rkv", "--cfg", "job"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["method"]["variant"] == "lf_repo"


def test_vanilla_variants_are_one_run():
    """The full cache has no variants: Table 1's paper and lf_repo sweeps share its runs."""
    job = Job(name="gsm8k", kind="math", items=[], size=1, fingerprint="f")
    tokenizer = SimpleNamespace(chat_template="t")
    identities = [Setup.from_config(composed("experiment=table1", "method=vanilla", f"method.variant={variant}"))
                  .identity(job, tokenizer) for variant in ("paper", "lf_repo")]
    assert identities[0] == identities[1]
    h2o = [Setup.from_config(composed("experiment=table1", "method=h2o", f"method.variant={variant}"))
           .identity(job, tokenizer) for variant in ("paper", "lf_repo")]
    assert h2o[0] != h2o[1]
