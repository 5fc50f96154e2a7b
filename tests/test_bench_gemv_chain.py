"""`evals.bench.gemv_chain`'s Triton GEMV against `F.linear` (and PyTorch's SwiGLU for the down product,
transformers' Qwen3 RMSNorm for a normed input), on rows that are not a multiple of the program's,
with a head of columns shorter than the row; its chain layer against the same layer through cuBLAS,
and that layer's `--norms` form against transformers' RMSNorm and the residual adds. Through Triton's
interpreter on a machine without CUDA (set before Triton defines the kernel), at small shapes."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm  # noqa: E402

from evals.bench import gemv_chain  # noqa: E402
from evals.bench.gemv_chain import GemvConfig, gemv  # noqa: E402

pytestmark = pytest.mark.kernels

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def inputs(n: int, k: int, x_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator) / k**0.5
    return weight.to(DEVICE), torch.randn(x_len, generator=generator).to(DEVICE)


@pytest.mark.parametrize("config", [GemvConfig(block_n=4, block_k=16, head_k=32, warps=4),
                                    GemvConfig(block_n=1, block_k=32, head_k=64, warps=4),
                                    GemvConfig(block_n=8, block_k=32, head_k=128, warps=8)])
def test_gemv_is_the_matrix_vector_product(config):
    weight, x = inputs(n=10, k=96 if config.head_k < 96 else 128, x_len=128, seed=0)
    k = weight.shape[1]
    x = x[:k]
    out = gemv(weight, x, torch.empty(10, device=DEVICE), config)
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_the_down_product_reads_silu_gate_times_up():
    weight, x = inputs(n=6, k=64, x_len=128, seed=1)
    out = gemv(weight, x, torch.empty(6, device=DEVICE), GemvConfig(block_n=4, block_k=16, head_k=32), swiglu=True)
    torch.testing.assert_close(out, F.linear(F.silu(x[:64]) * x[64:], weight), rtol=1e-5, atol=1e-5)


def test_a_config_that_does_not_tile_the_row_is_refused():
    weight, x = inputs(n=4, k=96, x_len=96, seed=2)
    with pytest.raises(ValueError, match="does not tile"):
        gemv(weight, x, torch.empty(4, device=DEVICE), GemvConfig(block_k=64, head_k=64))
    with pytest.raises(ValueError, match="does not tile"):
        gemv(weight, x, torch.empty(4, device=DEVICE), GemvConfig(block_k=16, head_k=48))


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


def test_a_normed_input_with_a_residual_is_qwen3s_rmsnorm_then_the_product_plus_the_residual():
    weight, x = inputs(n=10, k=96, x_len=96, seed=4)
    generator = torch.Generator().manual_seed(5)
    norm = (1 + 0.3 * torch.randn(96, generator=generator)).to(DEVICE)
    residual = torch.randn(10, generator=generator).to(DEVICE)
    config = GemvConfig(block_n=4, block_k=16, head_k=32)
    out = gemv(weight, 3 * x, torch.empty(10, device=DEVICE), config, norm=norm, residual=residual)
    expected = F.linear(qwen3_norm(3 * x, norm), weight) + residual
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


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
