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
    """`conf/<group>/<name>.yaml` as a dict (no interpolation: the model and method groups need none)."""
    path = CONF_DIR / group / f"{name}.yaml"
    if not path.exists():
        raise UserError(f"unknown {group} {name!r}; choose one of: {', '.join(group_options(group))}")
    return yaml.safe_load(path.read_text()) or {}


def method_params(name: str) -> dict[str, Any]:
    """A method's config fields besides `name`: the keyword arguments of its policy."""
    fields = read_group("method", name)
    fields.pop("name", None)
    return fields


def model_spec(name: str, **overrides: Any):
    """The `longflow.models.ModelSpec` of `conf/model/<name>.yaml`, with fields replaced."""
    from longflow.models import ModelSpec

    return ModelSpec(**{**read_group("model", name), **overrides})
