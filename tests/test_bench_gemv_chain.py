"""`evals.bench.gemv_chain`: its chain layer through `longflow.kernels.gemv` (tested on its own in
tests/test_gemv_kernel.py) against the same layer through cuBLAS, that layer's `--norms` form against
transformers' RMSNorm and the residual adds, and its sweep's candidates. Through Triton's interpreter
on a machine without CUDA (set before Triton defines the kernel), at small shapes."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm  # noqa: E402

from evals.bench import gemv_chain  # noqa: E402
from longflow.kernels.gemv import GemvConfig  # noqa: E402

pytestmark = pytest.mark.kernels

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_the_candidates_tile_each_row():
    for _, k in gemv_chain.layer_shapes().values():
        for full in (False, True):
            configs = gemv_chain.candidate_configs(k, full)
            assert configs
            assert all(c.head_k <= k and (k - c.head_k) % c.block_k == 0 for c in configs)


def qwen3_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    norm = Qwen3RMSNorm(weight.numel(), eps=gemv_chain.EPS).to(weight.device)
    with torch.no_grad():
        norm.weight.copy_(weight)
        return norm(x)


def small_layer(monkeypatch, norms: bool, seed: int = 3):
    hidden, qkv, intermediate = 32, 48, 64
    monkeypatch.setattr(gemv_chain, "HIDDEN", hidden)
    monkeypatch.setattr(gemv_chain, "QKV", qkv)
    monkeypatch.setattr(gemv_chain, "INTERMEDIATE", intermediate)
    generator = torch.Generator().manual_seed(seed)
    weights = {name: (torch.randn(n, k, generator=generator) / k**0.5).to(DEVICE)
               for name, (n, k) in gemv_chain.layer_shapes().items()}
    if norms:
        weights |= {name: (1 + 0.3 * torch.randn(hidden, generator=generator)).to(DEVICE) for name in ("ln1", "ln2")}
    return weights, torch.randn(hidden, generator=generator).to(DEVICE)


@pytest.mark.parametrize("norms", [False, True])
def test_the_chain_layer_is_the_cublas_layer(monkeypatch, norms):
    weights, x = small_layer(monkeypatch, norms)
    small = GemvConfig(block_n=4, block_k=16, head_k=16)
    chain = gemv_chain.TritonChain(dict.fromkeys(gemv_chain.layer_shapes(), small), pdl=False, device=DEVICE,
                                   dtype=torch.float32)
    torch.testing.assert_close(chain.layer(x, **weights), gemv_chain.eager_layer(x[None], **weights)[0],
                               rtol=1e-4, atol=1e-4)


def test_the_norms_computed_apart_give_the_same_layer(monkeypatch):
    weights, x = small_layer(monkeypatch, norms=True)
    small = GemvConfig(block_n=4, block_k=16, head_k=16)
    calls = []

    def norm_kernel(hidden, weight):
        calls.append(weight)
        return qwen3_norm(hidden, weight)

    chain = gemv_chain.TritonChain(dict.fromkeys(gemv_chain.layer_shapes(), small), pdl=False, device=DEVICE,
                                   dtype=torch.float32, norm_kernel=norm_kernel)
    torch.testing.assert_close(chain.layer(x, **weights), gemv_chain.eager_layer(x[None], **weights)[0],
                               rtol=1e-4, atol=1e-4)
    assert [w.data_ptr() for w in calls] == [weights["ln1"].data_ptr(), weights["ln2"].data_ptr()]


def test_the_normed_layer_is_the_decoder_layers_norms_and_residual_adds(monkeypatch):
    weights, x = small_layer(monkeypatch, norms=True)
    hidden = x[None]
    attended = F.linear(qwen3_norm(hidden, weights["ln1"]), weights["qkv"])[:, :gemv_chain.HIDDEN]
    hidden = hidden + F.linear(attended, weights["o"])
    gate, up = F.linear(qwen3_norm(hidden, weights["ln2"]), weights["gate_up"]).chunk(2, dim=-1)
    expected = hidden + F.linear(F.silu(gate) * up, weights["down"])
    torch.testing.assert_close(gemv_chain.eager_layer(x[None], **weights), expected)
