"""The Hydra config groups of `conf/`, read without Hydra: for benchmarks and tests, which also run
on machines without Hydra (the GPU image), and for checking group choices before Hydra starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from longflow.errors import UserError

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def group_options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))


def read_group(group: str, name: str) -> dict[str, Any]:
    """`conf/<group>/<name>.yaml` as a dict (no interpolation: the model and method groups need none).

    A `defaults` list of options of the same group (and `_self_`) is merged as Hydra merges it:
    each listed config in order, this file's own keys where `_self_` stands (last by default),
    nested mappings key by key.
    """
    path = CONF_DIR / group / f"{name}.yaml"
    if not path.exists():
        raise UserError(f"unknown {group} {name!r}; choose one of: {', '.join(group_options(group))}")
    own = yaml.safe_load(path.read_text()) or {}
    defaults = own.pop("defaults", [])
    if "_self_" not in defaults:
        defaults = [*defaults, "_self_"]
    merged: dict[str, Any] = {}
    for entry in defaults:
        merge(merged, own if entry == "_self_" else read_group(group, entry))
    return merged


def merge(target: dict[str, Any], source: dict[str, Any]) -> None:
    """`source` into `target`, in place, nested mappings key by key (OmegaConf's merge of plain configs)."""
    for key, value in source.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            merge(target[key], value)
        else:
            target[key] = value


def method_config(name: str) -> dict[str, Any]:
    """The config of method `name` (`_target_`, `name` and its fields), as Hydra composes it."""
    return read_group("method", name)


def model_spec(name: str, **overrides: Any):
    """The `longflow.models.ModelSpec` of `conf/model/<name>.yaml`, with fields replaced."""
    from longflow.models import ModelSpec

    return ModelSpec(**{**read_group("model", name), **overrides})
