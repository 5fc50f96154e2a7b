"""`evals.bench.mlp_fusion` times the block the model runs: its `block` against transformers' Qwen3
RMSNorm and MLP with the same weights, and its compiled settings (the product fused or stored between
two graphs) against that block."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

import evals.bench.mlp_fusion as mlp_fusion

HIDDEN, INTERMEDIATE = 64, 192


def layer(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(*shape, generator=generator) * scale
            for name, shape, scale in (("norm", (HIDDEN,), 0.5), ("gate", (INTERMEDIATE, HIDDEN), 0.1),
                                       ("up", (INTERMEDIATE, HIDDEN), 0.1), ("down", (HIDDEN, INTERMEDIATE), 0.1))}


def transformers_block(hidden: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    config = Qwen3Config(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, hidden_act="silu")
    norm, mlp = Qwen3RMSNorm(HIDDEN, eps=mlp_fusion.EPS), Qwen3MLP(config)
    with torch.no_grad():
        norm.weight.copy_(weights["norm"])
        for name in ("gate", "up", "down"):
            getattr(mlp, f"{name}_proj").weight.copy_(weights[name])
        return hidden + mlp(norm(hidden))


def test_the_block_is_qwen3s_norm_and_mlp():
    hidden = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(3))
    weights = layer(0)
    torch.testing.assert_close(mlp_fusion.block(hidden, **weights), transformers_block(hidden, weights))


def test_the_settings_compile_the_block():
    hidden = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(3))
    layers = [layer(0), layer(1)]
    reference = [transformers_block(hidden, weights) for weights in layers]
    settings = mlp_fusion.settings([{"realize_opcount_threshold": 4}])
    assert list(settings) == ["eager (cuBLAS)", "fused", "materialized", 'fused + {"realize_opcount_threshold": 4}']
    for name in ("eager (cuBLAS)", "materialized"):
        options, materialized = settings[name]
        torch._dynamo.reset()
        calls = mlp_fusion.layer_calls(layers, hidden, options, materialized)
        for call, expected in zip(calls, reference, strict=True):
            torch.testing.assert_close(call(), expected, rtol=1e-4, atol=1e-5)


def test_it_refuses_a_machine_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("sys.argv", ["mlp_fusion"])
    with pytest.raises(SystemExit) as exit_:
        mlp_fusion.run(mlp_fusion.main)
    assert exit_.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err
