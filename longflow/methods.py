"""From a method's config to its policy object, in one hop.

A method config (`conf/method/<name>.yaml`) names its class with `_target_` and lists its fields;
a field may itself be a config with a `_target_` (AMS's scorer). The object is built with Hydra's
`instantiate` from a plain dict (library users need no Hydra config tree). The class checks its
fields once, in `__post_init__`, and raises `UserError`; nothing else validates a method.

The config key `name` is the method's label in runs and tables, not a field of the class.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from typing import Any

from longflow.errors import UserError
from longflow.policy import KVPolicy

TARGET = "_target_"


def locate(path: str) -> Callable:
    """The class or function at a dotted path (`baselines.h2o.H2OPolicy`)."""
    module, _, attribute = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError, ValueError):
        raise UserError(f"method class {path!r} not found") from None


def _instantiate(config: dict[str, Any]) -> functools.partial:
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(config, _partial_=True, _convert_="all")
    except InstantiationException as error:
        # Hydra wraps what the classes raise; a UserError (a nested scorer's bad field) stays one.
        cause = error.__cause__
        if isinstance(cause, UserError):
            raise cause from None
        if "Error locating target" in str(error):
            raise UserError(f"method class {config[TARGET]!r} not found") from None
        raise UserError(str(error).splitlines()[0]) from None


def method_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a method config, `_target_` the class of its variant where the class it names
    writes its variants as classes of their own (`KVPolicy.variant_classes`)."""
    fields = {key: value for key, value in config.items() if key != "name"}
    if TARGET not in fields:
        raise UserError(f"method {config.get('name', '?')!r}: its config names no class (`_target_`)")
    variants = getattr(locate(fields[TARGET]), "variant_classes", {})
    # Only a config that names one of the family's own classes is redirected: a user's subclass of
    # one (a method of one's own built on StreamingLLM) stays the class it names.
    if fields.get("variant") in variants and fields[TARGET] in variants.values():
        fields[TARGET] = variants[fields["variant"]]
    return fields


def without_execution_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """A method config without the fields its class declares execution-only (`KVPolicy.execution_fields`),
    in every field that is a method config itself (AMS's scorer): what decides the method's outputs."""
    execution = getattr(locate(method_fields(config)[TARGET]), "execution_fields", frozenset())
    return {key: without_execution_fields(value) if isinstance(value, Mapping) and TARGET in value else value
            for key, value in config.items() if key not in execution}


def method_factory(config: Mapping[str, Any]) -> functools.partial:
    """The class `config` names (or its variant's) with its fields bound: call it with the run's budget."""
    return _instantiate(method_fields(config))


def uses_budget(config: Mapping[str, Any]) -> bool:
    """Whether the run's budget bounds the method of `config` (its class's `uses_budget`)."""
    return getattr(locate(method_fields(config)[TARGET]), "uses_budget", True)


def build_policy(config: Mapping[str, Any], budget: int | None) -> KVPolicy:
    """The policy of a method config with the run's budget (dropped for a method that takes none,
    so `policy.budget` is the budget to record); a bad field is a UserError."""
    factory = method_factory(config)
    if not uses_budget(config):
        budget = None
    try:
        policy = factory(budget=budget)
    except TypeError as error:  # an unknown field, or a missing one
        raise UserError(f"method {config.get('name', '?')!r}: {error}") from None
    if not isinstance(policy, KVPolicy):
        raise UserError(f"method {config.get('name', '?')!r}: {config[TARGET]} is not a KVPolicy")
    return policy
