"""`longflow.kernels.fast_math.log2_approx` against torch's float64 log2: on a GPU the multi-function
unit's approximation, within its documented 2^-22 relative error (plus a few ulps of the argument); on
the CPU, through Triton's interpreter, numpy's log2."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from longflow.kernels.fast_math import log2_approx  # noqa: E402

pytestmark = pytest.mark.kernels

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@triton.jit
def _log2_kernel(X, OUT, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=1.0)
    tl.store(OUT + offs, log2_approx(x), mask=offs < n)


def test_log2_approx_is_log2_to_the_units_accuracy():
    """Arguments from the kernels' floor 1e-30 to 1e30, around 1 (where log2 is near 0 and a relative
    bound would be meaningless, the bound is absolute there), and the powers of two."""
    generator = torch.Generator().manual_seed(0)
    x = torch.cat([10.0 ** torch.empty(4000).uniform_(-30, 30, generator=generator),
                   1.0 + torch.empty(1000).uniform_(-1e-3, 1e-3, generator=generator),
                   2.0 ** torch.arange(-99, 100, dtype=torch.float64)]).float()
    x = x.to(DEVICE)
    out = torch.empty_like(x)
    _log2_kernel[(triton.cdiv(x.numel(), 256),)](x, out, x.numel(), BLOCK=256)
    want = torch.log2(x.double())
    error = (out.double() - want).abs()
    assert (error <= 2**-21 * want.abs() + 2**-21).all(), f"largest error {error.max():.3e}"
