"""The configs of `conf/`, composed by Hydra's compose API: the one composer for the entry point's
checks, the benchmark scripts and the tests (the entry point's own run is composed by `hydra.main`).

The top-level keys a run config takes are those of the composed primary config (`conf/config.yaml`
with its default groups), so a new key is added in one place: that file.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from longflow.errors import UserError

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
PRIMARY = "config"
VERSION_BASE = "1.3"


def group_options(group: str) -> list[str]:
    """The options of a config group (`conf/<group>/*.yaml`), sorted."""
    return sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))


def compose_config(overrides: Sequence[str] = (), hydra_fields: bool = False) -> dict[str, Any]:
    """The primary config with command-line `overrides`, resolved to plain containers; `hydra_fields`
    keeps the `hydra` node (its sweeper params). Inside a running Hydra app its own config search is
    used; elsewhere Hydra is initialised on `conf/` for this call only."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    def composed() -> dict[str, Any]:
        config = compose(PRIMARY, overrides=list(overrides), return_hydra_config=hydra_fields)
        return OmegaConf.to_container(config, resolve=not hydra_fields)

    if GlobalHydra.instance().is_initialized():
        return composed()
    with initialize_config_dir(version_base=VERSION_BASE, config_dir=str(CONF_DIR)):
        return composed()


@functools.cache
def _default_config() -> dict[str, Any]:
    return compose_config()


def default_config() -> dict[str, Any]:
    """The primary config as composed with no overrides (a copy: callers may change it)."""
    return copy.deepcopy(_default_config())


@functools.cache
def _group_config(group: str, name: str) -> dict[str, Any]:
    options = group_options(group)
    if name not in options:
        raise UserError(f"unknown {group} {name!r}; choose one of: {', '.join(options)}")
    return compose_config([f"{group}={name}"])[group]


def method_config(name: str) -> dict[str, Any]:
    """The config of method `name` (`_target_`, `name` and its fields), as the entry point composes it."""
    return copy.deepcopy(_group_config("method", name))


def group_config(group: str, name: str) -> dict[str, Any]:
    """The `group` section of the primary config composed with `group=name` (a copy)."""
    return copy.deepcopy(_group_config(group, name))


def model_spec(name: str, **overrides: Any):
    """The `longflow.models.ModelSpec` of `conf/model/<name>.yaml`, with fields replaced."""
    from longflow.models import ModelSpec

    return ModelSpec(**{**group_config("model", name), **overrides})
