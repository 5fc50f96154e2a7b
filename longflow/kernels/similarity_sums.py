"""R-KV's column sums of the keys' cosine similarities, from 16-bit keys as stored, in two reads of them.

R-KV's redundancy (baselines/rkv.py, docs/methods.md "R-KV") needs, per head, the inverse key norms
r = held / (||k|| + 1e-8) (the duplicate search reads them too) and the column sums of the unit
keys' similarities without the diagonal, c_j = sum_{i != j} u_i . u_j = r_j k_j . t - (r_j ||k_j||)^2
with t = sum_i r_i k_i. In PyTorch that is a float32 copy of the keys (the products with float32 r
need it), a norm and two matrix-vector products over the copy: at Figure 3's batch, six passes over
twice the keys' bytes. Here one program per head reads the keys twice as stored (accumulating in
float32): once for r and t, once for the products with t.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # As in longflow_attention: the interpreter's switch is read when a kernel is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from longflow.kernels.reductions import reduce_sum  # noqa: E402


@triton.jit
def _key_block(keys, HELD, start, slots, stride_keys_s,
               HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """Slots `start + [0, BLOCK)` of one head: (slots, in range, keys as float32 `[BLOCK, HEAD_DIM_PAD]`,
    norms, r = held / (norm + 1e-8))."""
    rows = start + tl.arange(0, BLOCK)
    row_ok = rows < slots
    dims = tl.arange(0, HEAD_DIM_PAD)
    block = tl.load(keys + rows[:, None] * stride_keys_s + dims[None, :],
                    mask=row_ok[:, None] & (dims < HEAD_DIM)[None, :], other=0.0).to(tl.float32)
    held = tl.load(HELD + rows, mask=row_ok, other=0) != 0
    norms = tl.sqrt(reduce_sum(block * block, 1))
    return rows, row_ok, block, norms, tl.where(held, 1.0 / (norms + 1e-8), 0.0)


@triton.jit
def _similarity_sums_kernel(
    KEYS, HELD, INVERSE_NORMS, SUMS,
    stride_keys_n, stride_keys_s, stride_held_n, stride_out_n,
    slots,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    keys, held = KEYS + n * stride_keys_n, HELD + n * stride_held_n
    total = tl.zeros([HEAD_DIM_PAD], tl.float32)  # t = sum_i r_i k_i
    for start in range(0, slots, BLOCK):
        rows, row_ok, block, _, inverse = _key_block(keys, held, start, slots, stride_keys_s,
                                                     HEAD_DIM, HEAD_DIM_PAD, BLOCK)
        tl.store(INVERSE_NORMS + n * stride_out_n + rows, inverse, mask=row_ok)
        total += reduce_sum(block * inverse[:, None], 0)
    for start in range(0, slots, BLOCK):  # r recomputed, not read back: other threads stored it
        rows, row_ok, block, norms, inverse = _key_block(keys, held, start, slots, stride_keys_s,
                                                         HEAD_DIM, HEAD_DIM_PAD, BLOCK)
        sums = inverse * reduce_sum(block * total[None, :], 1) - (inverse * norms) * (inverse * norms)
        tl.store(SUMS + n * stride_out_n + rows, sums, mask=row_ok)


def similarity_sums(keys: torch.Tensor, held: torch.Tensor, *, block: int = 64,
                    num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse norms r = held / (||k|| + 1e-8) and the column sums c_j = sum_{i != j} u_i . u_j of
    the unit keys u = r k, per head of `keys` `[..., S, D]` (any float dtype, products in float32);
    `held` `[..., S]` bool. Returns (r, c), each `[..., S]` float32, as `baselines.rkv`'s PyTorch path
    to float32 rounding (the sums in another order)."""
    *lead, slots, head_dim = keys.shape
    if tuple(held.shape) != (*lead, slots):
        raise ValueError(f"held has shape {tuple(held.shape)}, expected {(*lead, slots)}")
    flat = keys.reshape(-1, slots, head_dim)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    mask = held.reshape(-1, slots).contiguous().view(torch.uint8)
    inverse = torch.empty(mask.shape, dtype=torch.float32, device=keys.device)
    sums = torch.empty_like(inverse)
    if mask.shape[0]:
        _similarity_sums_kernel[(mask.shape[0],)](
            flat, mask, inverse, sums, flat.stride(0), flat.stride(1), mask.stride(0), inverse.stride(0), slots,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK=block, num_warps=num_warps,
        )
    return inverse.view(*lead, slots), sums.view(*lead, slots)


__all__ = ["similarity_sums"]
