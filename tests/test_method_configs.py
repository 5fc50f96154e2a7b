"""One path from a method's config to its object: every conf/method/ config composes with Hydra as
`evals.configs.method_config` reads it without Hydra, and builds the same policy through Hydra's
`instantiate` and through the small resolver used where Hydra is absent."""

from __future__ import annotations

import builtins
import dataclasses

import pytest
from helpers import method_names
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from evals.configs import CONF_DIR, method_config
from longflow.errors import UserError
from longflow.methods import build_policy, resolve
from longflow.policy import KVPolicy

# Small budgets shrink the compression interval of interval methods, with a warning expected here.
pytestmark = pytest.mark.filterwarnings("ignore:.*leaves no room:UserWarning")


@pytest.fixture
def without_hydra(monkeypatch):
    """Imports of hydra fail, as on the GPU image."""
    real_import = builtins.__import__

    def refuse(name, *args, **kwargs):
        if name == "hydra" or name.startswith("hydra."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", refuse)


def fields_of(policy: KVPolicy) -> dict:
    return {"class": type(policy), **dataclasses.asdict(policy)}


@pytest.mark.parametrize("name", method_names())
def test_hydra_composes_what_the_reader_reads(name):
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        composed = OmegaConf.to_container(compose("config", overrides=[f"method={name}"]), resolve=True)
    assert composed["method"] == method_config(name)
    assert composed["method"]["name"] == name


@pytest.mark.parametrize("name", method_names())
def test_instantiate_and_the_resolver_build_the_same_policy(name, request):
    config = method_config(name)
    with_hydra = build_policy(config, 1024)
    request.getfixturevalue("without_hydra")
    without = build_policy(config, 1024)
    assert fields_of(with_hydra) == fields_of(without)
    assert fields_of(resolve({key: value for key, value in config.items() if key != "name"}, partial=True)(
        budget=1024)) == fields_of(with_hydra)


@pytest.mark.parametrize("hydra", [True, False])
@pytest.mark.parametrize("config,needle", [
    ({"name": "h2o", "_target_": "baselines.h2o.H2OPolicy", "heavy_ratio": 2.0}, "h2o: heavy_ratio must be"),
    ({"name": "h2o", "_target_": "baselines.h2o.H2OPolicy", "beta": 1}, "unexpected keyword argument 'beta'"),
    ({"name": "x", "_target_": "baselines.nothing.Policy"}, "method class 'baselines.nothing.Policy' not found"),
    ({"name": "x", "_target_": "builtins.dict"}, "is not a KVPolicy"),
    ({"name": "h2o", "heavy_ratio": 0.5}, "names no class"),
])
def test_bad_configs_are_one_user_error(config, needle, hydra, request):
    if not hydra:
        request.getfixturevalue("without_hydra")
    with pytest.raises(UserError) as raised:
        build_policy(config, 64)
    assert needle in str(raised.value) and "\n" not in str(raised.value)
