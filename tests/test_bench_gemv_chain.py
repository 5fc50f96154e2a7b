"""`evals.bench.gemv_chain`'s Triton GEMV against `F.linear` (and PyTorch's SwiGLU for the down product),
on rows that are not a multiple of the program's, with a head of columns shorter than the row; its
chain layer against the same layer through cuBLAS. Through Triton's interpreter on a machine without
CUDA (set before Triton defines the kernel), at small shapes."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

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


def test_the_chain_layer_is_the_cublas_layer(monkeypatch):
    hidden, qkv, intermediate = 32, 48, 64
    monkeypatch.setattr(gemv_chain, "HIDDEN", hidden)
    monkeypatch.setattr(gemv_chain, "QKV", qkv)
    monkeypatch.setattr(gemv_chain, "INTERMEDIATE", intermediate)
    generator = torch.Generator().manual_seed(3)
    weights = {name: (torch.randn(n, k, generator=generator) / k**0.5).to(DEVICE)
               for name, (n, k) in gemv_chain.layer_shapes().items()}
    x = torch.randn(hidden, generator=generator).to(DEVICE)
    small = GemvConfig(block_n=4, block_k=16, head_k=16)
    chain = gemv_chain.TritonChain(dict.fromkeys(weights, small), pdl=False, device=DEVICE, dtype=torch.float32)
    torch.testing.assert_close(chain.layer(x, **weights), gemv_chain.eager_layer(x[None], **weights)[0],
                               rtol=1e-4, atol=1e-4)
