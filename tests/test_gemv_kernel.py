"""`longflow.kernels.gemv` against `F.linear` over the weights stacked, transformers' Qwen3 RMSNorm
for a normed input and PyTorch's SiLU for SwiGLU, in float64: one to three weights (rows that no
program's block divides in the last), rows of a length no head or step divides, and a block that
must shrink so that a program reads one weight. Through Triton's interpreter on a machine without
CUDA (set before Triton defines the kernel), at small shapes."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm  # noqa: E402

from longflow.kernels.gemv import GemvConfig, gemv  # noqa: E402

pytestmark = pytest.mark.kernels

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = 1e-6
SMALL = GemvConfig(block_n=4, block_k=16, head_k=32, warps=4)


def weights_of(rows: list[int], k: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, k, generator=generator) / k**0.5).to(DEVICE) for n in rows]


def vector(n: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(n, generator=torch.Generator().manual_seed(seed))).to(DEVICE)


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """transformers' Qwen3RMSNorm, in float64."""
    norm = Qwen3RMSNorm(weight.numel(), eps=EPS).double().to(weight.device)
    with torch.no_grad():
        norm.weight.copy_(weight.double())
        return norm(x.double())


def stacked(weights: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(weights).double()


@pytest.mark.parametrize("config", [SMALL, GemvConfig(block_n=1, block_k=32, head_k=64, warps=4),
                                    GemvConfig(block_n=8, block_k=64, head_k=128, warps=8)])
@pytest.mark.parametrize("rows", [[10], [8, 4, 6], [16, 5]])
def test_the_stacked_product(config, rows):
    weights = weights_of(rows, 96, seed=len(rows))
    x = vector(96, seed=1)
    out = gemv(x, weights, config=config)
    assert out.shape == (sum(rows),) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), F.linear(x.double(), stacked(weights)), rtol=1e-5, atol=1e-5)


def test_rows_no_block_divides_shrink_the_block():
    """Rows 6 then 4: a program of 4 rows would read both weights, so the launch uses blocks of 2."""
    weights = weights_of([6, 4, 3], 64, seed=2)
    x = vector(64, seed=3)
    torch.testing.assert_close(gemv(x, weights, config=SMALL).double(), F.linear(x.double(), stacked(weights)),
                               rtol=1e-5, atol=1e-5)


def test_a_normed_input_with_a_residual():
    """q, k and v of a normed input, the residual added: the decoder layer's RMSNorm then the product."""
    weights = weights_of([8, 4, 4], 96, seed=4)
    x, norm, residual = vector(96, seed=5, scale=3.0), 1 + vector(96, seed=6, scale=0.3), vector(16, seed=7)
    out = gemv(x, weights, norm=norm, residual=residual, eps=EPS, config=SMALL)
    expected = F.linear(rms_norm(x, norm), stacked(weights)) + residual.double()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_swiglu_reads_silu_gate_times_up():
    weights = weights_of([6], 64, seed=8)
    x, residual = vector(128, seed=9), vector(6, seed=10)
    out = gemv(x, weights, residual=residual, swiglu=True, config=SMALL)
    expected = F.linear(F.silu(x[:64].double()) * x[64:].double(), stacked(weights)) + residual.double()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_weights_sum_in_float32(dtype):
    weights = [w.to(dtype) for w in weights_of([8, 8], 96, seed=11)]
    x, norm = vector(96, seed=12).to(dtype), (1 + vector(96, seed=13, scale=0.3)).to(dtype)
    out = gemv(x, weights, norm=norm, eps=EPS, config=SMALL)
    assert out.dtype == dtype
    expected = F.linear(rms_norm(x, norm), stacked(weights))
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2)


def test_the_output_buffer_given_is_written():
    weights = weights_of([5], 32, seed=14)
    out = torch.full((5,), float("nan"), device=DEVICE)
    assert gemv(vector(32, seed=15), weights, out, config=SMALL) is out
    assert out.isfinite().all()


def test_mismatched_arguments_are_refused():
    weights = weights_of([4, 4], 32, seed=16)
    with pytest.raises(ValueError, match="1 to 3"):
        gemv(vector(32, seed=0), weights * 2)
    with pytest.raises(ValueError, match="one K"):
        gemv(vector(32, seed=0), [weights[0], weights_of([4], 16, seed=0)[0]])
    with pytest.raises(ValueError, match="elements"):
        gemv(vector(32, seed=0), weights, swiglu=True)
    with pytest.raises(ValueError, match="residual"):
        gemv(vector(32, seed=0), weights, residual=vector(4, seed=0))
