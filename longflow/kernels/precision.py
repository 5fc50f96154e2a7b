"""Which products a kernel's `tl.dot` takes in IEEE float32 rather than on 16-bit tensor-core inputs."""

from __future__ import annotations

import os

import torch


def ieee_products(dtype: torch.dtype) -> bool:
    """True for float32 inputs, whose products must not drop to TF32, and whenever Triton runs
    through its interpreter: its 16-bit `tl.dot` goes through numpy, which has no bfloat16 (on
    Triton 3.9 it multiplies the raw bit patterns), so the tiles are widened to float32 first.
    On a GPU, bf16 and fp16 products are exact in the float32 accumulator either way."""
    return dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
