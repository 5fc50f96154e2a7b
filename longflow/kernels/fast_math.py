"""Device math on the GPU's multi-function unit where Triton would call libdevice's accurate routine.

`tl.log2` of float32 compiles to libdevice's `log2f`: a range reduction and a degree-10 polynomial,
about twenty instructions an element (`cuobjdump -sass` of the attention pass, longflow/kernels/NOTES.md),
where `tl.exp2` is already the unit's one-instruction approximation. `log2_approx` is that unit's
`lg2.approx.f32` (libdevice's `fast_log2f`): one instruction, relative error about 2^-22, as accurate
as the `exp2` that reads its result back. Triton's interpreter has no libdevice, so there it is numpy's
log2; the switch is read when this module is imported, as the kernels' own (`longflow.kernels.reductions`).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra import libdevice  # noqa: E402

INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def log2_approx(x):
    """log2 of float32 `x` (positive normal numbers: the callers floor it)."""
    if INTERPRETED:
        return tl.log2(x)
    else:
        return libdevice.fast_log2f(x)
