"""The decode token's slot write as one kernel: key, value, validity and position of `next_slot`.

`SlotCache.write` stores each row's new token into the slot its method chose: four scatters in
PyTorch (keys, values, valid, positions), each a kernel of a few microseconds that moves a few
hundred kilobytes. Per layer and step that is four launches for what is one write of 2 * D values
per KV head; inside the engine's CUDA graph the launches, not the bytes, are the cost
(longflow/kernels/NOTES.md). One program per (row, KV head) does the four writes, and
for a cache filled in order (vanilla) the next slot's advance too.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # As in longflow_attention: the interpreter's switch is read when a kernel is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _write_kernel(
    KEYS, VALUES, VALID, POSITIONS, NEXT_SLOT, K, V, TOKEN_POSITIONS,
    stride_keys_b, stride_keys_h, stride_keys_s,
    stride_values_b, stride_values_h, stride_values_s,
    stride_valid_b, stride_valid_h,
    stride_positions_b, stride_positions_h,
    stride_next_b, stride_next_h,
    stride_k_b, stride_k_h,
    stride_v_b, stride_v_h,
    last_slot,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, ADVANCE: tl.constexpr,
):
    program = tl.program_id(0)
    b = program // KV_HEADS
    h = program % KV_HEADS
    slot = tl.load(NEXT_SLOT + b * stride_next_b + h * stride_next_h)
    dims = tl.arange(0, HEAD_DIM_PAD)
    inside = dims < HEAD_DIM
    key = tl.load(K + b * stride_k_b + h * stride_k_h + dims, mask=inside)
    value = tl.load(V + b * stride_v_b + h * stride_v_h + dims, mask=inside)
    tl.store(KEYS + b * stride_keys_b + h * stride_keys_h + slot * stride_keys_s + dims, key, mask=inside)
    tl.store(VALUES + b * stride_values_b + h * stride_values_h + slot * stride_values_s + dims, value,
             mask=inside)
    tl.store(VALID + b * stride_valid_b + h * stride_valid_h + slot, tl.full([], 1, tl.uint8))
    tl.store(POSITIONS + b * stride_positions_b + h * stride_positions_h + slot, tl.load(TOKEN_POSITIONS + b))
    if ADVANCE:
        tl.store(NEXT_SLOT + b * stride_next_b + h * stride_next_h, tl.minimum(slot + 1, last_slot))


def write_token(keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor,
                next_slot: torch.Tensor, k: torch.Tensor, v: torch.Tensor, token_positions: torch.Tensor,
                advance: bool = False) -> None:
    """Row b, KV head h: `keys[b, h, next_slot[b, h]] = k[b, h, 0]`, the same for values; that slot
    becomes valid and holds position `token_positions[b]`. With `advance`, `next_slot[b, h]` then
    moves to the following slot, at most the last (a cache filled in order: vanilla). No host sync,
    static launch.

    Args:
        keys, values: `[B, Hkv, S, D]`, the last dim contiguous.
        valid: `[B, Hkv, S]` bool; positions: `[B, Hkv, S]` int64; both with contiguous slots.
        next_slot: `[B, Hkv]` int64, each in [0, S).
        k, v: `[B, Hkv, 1, D]`, the last dim contiguous (any other strides: the transposed views
            that the attention modules hand over).
        token_positions: `[B]` int64, contiguous.
    """
    batch, kv_heads, _, head_dim = keys.shape
    for name, tensor in (("keys", keys), ("values", values), ("k", k), ("v", v)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim, got strides {tensor.stride()}")
    for name, tensor in (("valid", valid), ("positions", positions)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} needs contiguous slots, got strides {tensor.stride()}")
    if k.shape != (batch, kv_heads, 1, head_dim) or v.shape != k.shape:
        raise ValueError(f"k and v must be [{batch}, {kv_heads}, 1, {head_dim}], "
                         f"got {tuple(k.shape)}, {tuple(v.shape)}")
    if token_positions.shape != (batch,) or token_positions.stride(0) != 1:
        raise ValueError(f"token_positions must be a contiguous [{batch}], got {tuple(token_positions.shape)}")
    valid_u8 = valid.view(torch.uint8)
    _write_kernel[(batch * kv_heads,)](
        keys, values, valid_u8, positions, next_slot, k, v, token_positions,
        keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        valid_u8.stride(0), valid_u8.stride(1),
        positions.stride(0), positions.stride(1),
        next_slot.stride(0), next_slot.stride(1),
        k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        keys.shape[2] - 1,
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim), ADVANCE=advance,
        num_warps=1,
    )


__all__ = ["write_token"]
