"""Shared fixtures: tiny random-weight models of the three supported families, and the data root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from longflow.models import ModelSpec, load_model

REPO = Path(__file__).resolve().parents[1]

TINY_ARCHITECTURES = {
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=384,
                  max_position_embeddings=4096, rope_theta=10000.0),
    "qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=384,
                  max_position_embeddings=4096, rope_theta=10000.0),
    "qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=16, vocab_size=384,
                  max_position_embeddings=4096, rope_theta=10000.0),
}


def tiny_model(family: str):
    """(model, tokenizer) with random float32 weights on the CPU, `kv_policy` attention set."""
    chat_format = "r1_distill" if family == "llama" else "qwen3"
    spec = ModelSpec(name=f"tiny_{family}", hub_id="none", architecture=TINY_ARCHITECTURES[family],
                     weights="random", dtype="float32", chat_format=chat_format)
    return load_model(spec, torch.device("cpu"))


@pytest.fixture(scope="session", params=sorted(TINY_ARCHITECTURES))
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
