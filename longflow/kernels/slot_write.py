"""The decode token's slot write as one kernel: key, value, validity and position of `next_slot`.

`SlotCache.write` stores each row's new token into the slot its method chose: four scatters in
PyTorch (keys, values, valid, positions), each a kernel of a few microseconds that moves a few
hundred kilobytes. Per layer and step that is four launches for what is one write of 2 * D values
per KV head; inside the engine's CUDA graph the launches, not the bytes, are the cost
(longflow/kernels/NOTES.md). One program per (row, KV head) does the four writes, and then
moves the next slot: on by one for a cache filled in order (vanilla), or to the first free slot for
the interval methods, whose step otherwise ran that search (a reduction over every slot) and its
copy as two more launches per layer.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # As in longflow_attention: the interpreter's switch is read when a kernel is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from longflow.kernels.reductions import reduce_min  # noqa: E402

SCAN = 1024  # slots read at once by the first-free search


@triton.jit
def _write_kernel(
    KEYS, VALUES, VALID, POSITIONS, NEXT_SLOT, K, V, TOKEN_POSITIONS, USABLE,
    stride_keys_b, stride_keys_h, stride_keys_s,
    stride_values_b, stride_values_h, stride_values_s,
    stride_valid_b, stride_valid_h,
    stride_positions_b, stride_positions_h,
    stride_next_b, stride_next_h,
    stride_k_b, stride_k_h,
    stride_v_b, stride_v_h,
    stride_usable_h, last_slot,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, ADVANCE: tl.constexpr,
    FIRST_FREE: tl.constexpr, HAS_USABLE: tl.constexpr, SCAN_BLOCK: tl.constexpr,
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
    if FIRST_FREE:
        # The lowest free (and usable) slot after this write, `longflow.selection.first_free`'s, 0 when none
        # is. The slot just written counts as held without reading it back; the scan stops at the first
        # block that holds a free slot, in a cache filled in order the written slot's or the next.
        slots = last_slot + 1
        offs = tl.arange(0, SCAN_BLOCK)
        found = slots
        start = 0
        while (start < slots) & (found == slots):
            index = start + offs
            in_cache = index < slots
            held = tl.load(VALID + b * stride_valid_b + h * stride_valid_h + index, mask=in_cache, other=1)
            free = (held == 0) & (index != slot) & in_cache
            if HAS_USABLE:
                free = free & (tl.load(USABLE + h * stride_usable_h + index, mask=in_cache, other=0) != 0)
            found = tl.minimum(found, reduce_min(tl.where(free, index, slots), 0))
            start += SCAN_BLOCK
        tl.store(NEXT_SLOT + b * stride_next_b + h * stride_next_h, tl.where(found == slots, 0, found).to(tl.int64))


def check_token_write(keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor,
                      next_slot: torch.Tensor, k: torch.Tensor, v: torch.Tensor, token_positions: torch.Tensor,
                      token_names: tuple[str, str] = ("k", "v")) -> None:
    """The inputs of a decode token's write, as `write_token` documents them (`append_decode` writes the
    same way and calls its token's key and value `token_names`); ValueError or TypeError otherwise."""
    batch, kv_heads, slots, head_dim = keys.shape
    k_name, v_name = token_names
    for name, tensor in (("keys", keys), ("values", values), (k_name, k), (v_name, v)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim, got strides {tensor.stride()}")
    if k.shape != (batch, kv_heads, 1, head_dim) or v.shape != k.shape:
        raise ValueError(f"{k_name} and {v_name} must be [{batch}, {kv_heads}, 1, {head_dim}], "
                         f"got {tuple(k.shape)}, {tuple(v.shape)}")
    if k.dtype != keys.dtype or v.dtype != keys.dtype:
        raise TypeError(f"{k_name} and {v_name} must be {keys.dtype}, got {k.dtype}, {v.dtype}")
    for name, tensor, dtype in (("valid", valid, torch.bool), ("positions", positions, torch.int64)):
        if tensor.dtype != dtype or tensor.shape != (batch, kv_heads, slots) or tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be a [batch, kv_heads, slots] = {(batch, kv_heads, slots)} {dtype} tensor "
                             f"with contiguous slots, got {tensor.dtype} {tuple(tensor.shape)}")
    if next_slot.dtype != torch.long or next_slot.shape != (batch, kv_heads):
        raise ValueError(f"next_slot must be a [batch, kv_heads] = {(batch, kv_heads)} int64 tensor, "
                         f"got {next_slot.dtype} {tuple(next_slot.shape)}")
    if token_positions.shape != (batch,) or token_positions.dtype != torch.long or token_positions.stride(0) != 1:
        raise ValueError(f"token_positions must be a contiguous [{batch}] int64 tensor, got "
                         f"{token_positions.dtype} {tuple(token_positions.shape)}")


def write_token(keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor,
                next_slot: torch.Tensor, k: torch.Tensor, v: torch.Tensor, token_positions: torch.Tensor,
                advance: bool = False, find_free: bool = False, usable: torch.Tensor | None = None) -> None:
    """Row b, KV head h: `keys[b, h, next_slot[b, h]] = k[b, h, 0]`, the same for values; that slot
    becomes valid and holds position `token_positions[b]`. With `advance`, `next_slot[b, h]` then
    moves to the following slot, at most the last (a cache filled in order: vanilla); with
    `find_free`, to the lowest free slot that `usable[h]` allows, 0 when there is none
    (`longflow.selection.first_free` after the write: the interval methods). No host sync, static
    launch.

    Args:
        keys, values: `[B, Hkv, S, D]`, the last dim contiguous.
        valid: `[B, Hkv, S]` bool; positions: `[B, Hkv, S]` int64; both with contiguous slots.
        next_slot: `[B, Hkv]` int64, each in [0, S).
        k, v: `[B, Hkv, 1, D]`, the last dim contiguous (any other strides: the transposed views
            that the attention modules hand over).
        token_positions: `[B]` int64, contiguous.
        usable: `[Hkv, S]` bool with contiguous slots, the slots each KV head may hold, or None (all).
    """
    if advance and find_free:
        raise ValueError("advance and find_free are two rules for the next slot: take one")
    check_token_write(keys, values, valid, positions, next_slot, k, v, token_positions)
    batch, kv_heads, _, head_dim = keys.shape
    if usable is not None and (usable.dtype != torch.bool or usable.shape != (kv_heads, keys.shape[2])
                               or usable.stride(-1) != 1):
        raise ValueError(f"usable must be a [kv_heads, slots] = {(kv_heads, keys.shape[2])} bool tensor with "
                         f"contiguous slots, got {usable.dtype} {tuple(usable.shape)}")
    valid_u8 = valid.view(torch.uint8)
    usable_u8 = valid_u8 if usable is None else usable.view(torch.uint8)  # not read without HAS_USABLE
    _write_kernel[(batch * kv_heads,)](
        keys, values, valid_u8, positions, next_slot, k, v, token_positions, usable_u8,
        keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        valid_u8.stride(0), valid_u8.stride(1),
        positions.stride(0), positions.stride(1),
        next_slot.stride(0), next_slot.stride(1),
        k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        0 if usable is None else usable_u8.stride(0), keys.shape[2] - 1,
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim), ADVANCE=advance,
        FIRST_FREE=find_free, HAS_USABLE=usable is not None,
        SCAN_BLOCK=min(SCAN, triton.next_power_of_2(keys.shape[2])), num_warps=1,
    )


__all__ = ["check_token_write", "write_token"]
