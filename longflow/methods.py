"""The registry of KV-cache methods: a config's `method.name` -> its policy class.

Entries are import paths so that a method's module (and its kernel) is imported only when used.
Adding a method: write one module with a `KVPolicy` subclass, add a line here and a
`conf/method/<name>.yaml` with its defaults.
"""

from __future__ import annotations

import importlib

from longflow.errors import UserError
from longflow.policy import KVPolicy

METHODS = {
    "vanilla": "baselines.vanilla:VanillaPolicy",
    "streaming": "baselines.streaming:StreamingPolicy",
    "h2o": "baselines.h2o:H2OPolicy",
    "vatp": "baselines.vatp:VATPPolicy",
    "rkv": "baselines.rkv:RKVPolicy",
    "longflow": "longflow.method:LongFlowPolicy",
}


def policy_class(name: str) -> type[KVPolicy]:
    if name not in METHODS:
        raise UserError(f"unknown method {name!r}; choose one of {', '.join(sorted(METHODS))}")
    module, attribute = METHODS[name].split(":")
    return getattr(importlib.import_module(module), attribute)


def build_policy(name: str, budget: int | None, **params) -> KVPolicy:
    """A fresh policy; `params` are the method config's fields (besides `name`)."""
    if budget is not None and budget <= 0:
        raise UserError(f"budget must be a positive number of KV slots, got {budget}")
    try:
        return policy_class(name)(budget=budget, **params)
    except TypeError as error:
        raise UserError(f"method {name!r}: {error}") from error
