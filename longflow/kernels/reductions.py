"""Reductions for the kernels of this package that the Triton interpreter can also run.

`tl.sum` / `tl.max` / `tl.min` are @triton.jit wrappers: when Triton was imported before
TRITON_INTERPRET was set (transformers' model loading imports torch._dynamo, which imports Triton)
they are compiled-only functions that the interpreter cannot call. `tl.reduce` with Triton's own
combine functions works either way; the interpreter still reduces with numpy.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # A CPU-only machine runs Triton through its interpreter, whose switch is read when a kernel is
    # defined; an explicit TRITON_INTERPRET=0 is respected.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def reduce_sum(x, AXIS: tl.constexpr):
    return tl.reduce(x, AXIS, tl.standard._sum_combine)


@triton.jit
def reduce_max(x, AXIS: tl.constexpr):
    return tl.reduce(x, AXIS, tl.standard._elementwise_max)


@triton.jit
def reduce_min(x, AXIS: tl.constexpr):
    return tl.reduce(x, AXIS, tl.standard._elementwise_min)
