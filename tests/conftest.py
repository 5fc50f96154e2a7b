"""Shared fixtures: tiny random-weight models of the three supported families, and the data root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers import FAMILIES, REPO, tiny_model


@pytest.fixture(scope="session", params=FAMILIES)
def tiny(request):
    """Each tiny family in turn: (model, tokenizer)."""
    return tiny_model(request.param)


@pytest.fixture(scope="session")
def data_root() -> Path:
    """The benchmark JSONL folder: $LONGFLOW_DATA_ROOT, else ../shared/data beside the repo."""
    root = Path(os.environ.get("LONGFLOW_DATA_ROOT", REPO.parent / "shared" / "data"))
    if not (root / "gsm8k.jsonl").exists():
        pytest.skip(f"benchmark data not found under {root} (set LONGFLOW_DATA_ROOT)")
    return root


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA: skipped on CPU machines (CI), run on the GPU through `device`."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
