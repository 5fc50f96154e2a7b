"""The experiment configs compose as their headers say: Table 1 runs the LongFlow authors' setting."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from evals.configs import CONF_DIR
from evals.run import Job, Setup

REPO = Path(__file__).resolve().parents[1]
TABLE1_METHODS = yaml.safe_load((CONF_DIR / "experiment" / "table1.yaml").read_text())["hydra"]["sweeper"]["params"][
    "method"].split(",")


def composed(*overrides: str) -> dict:
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        return OmegaConf.to_container(compose("config", overrides=list(overrides)), resolve=True)


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
