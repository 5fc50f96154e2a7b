"""R-KV's inverse key norms and column sums of cosine similarities as a Triton kernel
(`longflow.kernels.similarity_sums`; on the CPU through Triton's interpreter) against the formula
written out in float64 (docs/methods.md, "R-KV": u = held k / (||k|| + 1e-8), c_j = sum_{i != j} u_i . u_j)."""

from __future__ import annotations

import pytest
import torch

from longflow.kernels import similarity_sums

pytestmark = pytest.mark.kernels

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("slots, head_dim, block", [(1, 8, 16), (37, 24, 16), (100, 32, 64)])
def test_matches_the_formula(dtype, slots, head_dim, block):
    """Slots that no block divides, a head dim that is no power of two, slots not held (r = 0: they add
    nothing), keys around a shared direction (large sums)."""
    generator = torch.Generator().manual_seed(slots)
    keys = (torch.randn(2, 3, slots, head_dim, generator=generator)
            + torch.randn(2, 3, 1, head_dim, generator=generator)).to(dtype)
    held = torch.rand(2, 3, slots, generator=generator) > 0.2
    exact = keys.double()
    inverse = held / (exact.norm(dim=-1) + 1e-8)
    unit = exact * inverse[..., None]
    similarity = unit @ unit.transpose(-1, -2)
    expected = similarity.sum(dim=-2) - similarity.diagonal(dim1=-2, dim2=-1)
    got_inverse, got_sums = (t.cpu() for t in similarity_sums(keys.to(DEVICE), held.to(DEVICE), block=block))
    assert got_inverse.dtype == got_sums.dtype == torch.float32
    torch.testing.assert_close(got_inverse.double(), inverse, rtol=1e-6, atol=0)
    torch.testing.assert_close(got_sums.double(), expected, rtol=1e-5, atol=1e-5)
    assert got_sums[~held].eq(0).all()


def test_rejects_a_mismatched_mask():
    with pytest.raises(ValueError, match="held"):
        similarity_sums(torch.zeros(2, 5, 8, device=DEVICE), torch.ones(2, 4, dtype=torch.bool, device=DEVICE))
