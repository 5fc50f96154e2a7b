"""Offline calibration files that a method names in its config (query statistics, head or layer scores).

A calibration file is a dict of named tensors saved with `torch.save` (`.pt`) or safetensors
(`.safetensors`), made once per model by a method's own script. Its path comes from the method's
config, relative to the working directory like every other path of a run; the method loads it
when it is built, so that a missing or malformed file is a one-line error before any model loads,
and checks the shapes against the model when it allocates (`check_shape`). A file may record the
model it was made for (`made_for`): a `.pt` dict's `hub_id` and `checkpoint` entries, a
`.safetensors` file's metadata of the same names; the run checks them against its model
(`evals.pipeline.check_method_files`), since a file made for another checkpoint of the same shape
would load without an error.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path

import torch

from longflow.errors import UserError


def load_calibration(path: str, method: str, keys: Iterable[str]) -> dict[str, torch.Tensor]:
    """The tensors `keys` of the calibration file at `path` (on the CPU), or a UserError naming what is wrong."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"{method}: calibration file {path!r} not found")
    try:
        tensors = _read(file.resolve(), file.stat().st_mtime_ns)
    except Exception as error:  # noqa: BLE001 - any unreadable file is the user's to replace
        raise UserError(f"{method}: calibration file {path!r} is unreadable ({type(error).__name__})") from None
    if not isinstance(tensors, dict):
        raise UserError(f"{method}: calibration file {path!r} must hold a dict of tensors")
    missing = [key for key in keys if not isinstance(tensors.get(key), torch.Tensor)]
    if missing:
        raise UserError(f"{method}: calibration file {path!r} lacks the tensor {missing[0]!r}")
    return {key: tensors[key] for key in keys}


MADE_FOR = ("model", "hub_id", "checkpoint")  # what a file may record of the model it was made for


def made_for(path: str | Path) -> dict[str, str]:
    """What the file at `path` records of the model it was made for (`MADE_FOR` keys present), or {}."""
    file = Path(path)
    if file.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(file), "pt") as handle:
            recorded = handle.metadata() or {}
    else:
        recorded = _read(file.resolve(), file.stat().st_mtime_ns)
        recorded = recorded if isinstance(recorded, dict) else {}
    return {key: recorded[key] for key in MADE_FOR if isinstance(recorded.get(key), str)}


@functools.cache
def _read(file: Path, modified: int) -> object:
    """A file's content, read once per version: every batch's policy (a copy) reuses it."""
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(file))
    return torch.load(file, map_location="cpu", weights_only=True)


def check_shape(tensor: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    """A calibration tensor made for another model is a UserError, not a shape error deep in a step."""
    if tuple(tensor.shape) != tuple(shape):
        raise UserError(f"{what} has shape {tuple(tensor.shape)}, the model needs {tuple(shape)}: "
                        "was the calibration file made for another model?")
