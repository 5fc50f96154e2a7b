"""One path from a method's config to its object: every conf/method/ config composes with Hydra into
the class its `_target_` names, and a bad field is one line of UserError."""

from __future__ import annotations

import pytest

from baselines.streaming import StreamingPolicy
from evals.configs import group_options, method_config
from longflow.errors import UserError
from longflow.methods import build_policy, locate
from longflow.policy import KVPolicy

# Small budgets shrink the compression interval of interval methods, with a warning expected here.
pytestmark = pytest.mark.filterwarnings("ignore:.*leaves no room:UserWarning")


@pytest.mark.parametrize("name", group_options("method"))
def test_every_method_config_builds_its_class(name):
    config = method_config(name)
    assert config["name"] == name
    policy = build_policy(config, 1024)
    assert isinstance(policy, KVPolicy) and type(policy) is locate(config["_target_"])
    assert policy.budget == (1024 if type(policy).uses_budget else None)


@pytest.mark.parametrize("config,needle", [
    ({"name": "h2o", "_target_": "baselines.h2o.H2OPolicy", "heavy_ratio": 2.0}, "h2o: heavy_ratio must be"),
    ({"name": "h2o", "_target_": "baselines.h2o.H2OPolicy", "beta": 1}, "unexpected keyword argument 'beta'"),
    ({"name": "x", "_target_": "baselines.nothing.Policy"}, "method class 'baselines.nothing.Policy' not found"),
    ({"name": "x", "_target_": "builtins.dict"}, "is not a KVPolicy"),
    ({"name": "h2o", "heavy_ratio": 0.5}, "names no class"),
])
def test_bad_configs_are_one_user_error(config, needle):
    with pytest.raises(UserError) as raised:
        build_policy(config, 64)
    assert needle in str(raised.value) and "\n" not in str(raised.value)


def test_an_unknown_method_names_the_choices():
    with pytest.raises(UserError, match="unknown method 'nothing'; choose one of: .*longflow"):
        method_config("nothing")


class OwnStreaming(StreamingPolicy):
    """A user's method built on StreamingLLM's class, which writes its variants as classes."""


def test_a_subclass_of_a_variant_class_stays_its_own_class():
    policy = build_policy({**method_config("streaming"), "_target_": f"{__name__}.OwnStreaming"}, 64)
    assert type(policy) is OwnStreaming
    assert type(build_policy(method_config("streaming"), 64)).__name__ == "StreamingPolicy"
