"""An interval method's compaction of K and V, in place: each kept slot moved down once, the rest zeroed.

After a compression the kept slots of a row and KV head move to the low slots, in position order,
and the freed ones are zeroed (`SlotCache.compact`). In PyTorch that is a gather of the whole
buffer into a temporary, then its write back through `torch.where` with the freed slots zeroed: two
full passes over K and V, the gather reading an int64 index per element. At Figure 3's batch (408
rows, 8 KV heads, 1744 slots, bf16) the two took about 300 ms of an R-KV compression's 1.2 s, and
the temporary is a whole layer's keys (1.5 GB).

An interval method's slots hold their tokens in position order (prefill stores the prompt so,
decode appends to the first free slot), so a kept slot never moves up: the j-th kept slot lies at
slot j or above. One program per (row, KV head) then walks its destination slots from the lowest,
a block at a time, loads the block's sources (which lie in this block or above, none of them yet
overwritten), waits for every thread's loads, and stores. A kept slot already in place is neither
read nor written, and no temporary is allocated.
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
def _compact_kernel(
    KEYS, VALUES, ORDER, KEPT, ROWS,
    stride_keys_b, stride_keys_h, stride_keys_s,
    stride_values_b, stride_values_h, stride_values_s,
    stride_order_n, stride_order_h, stride_kept_n, stride_kept_h,
    slots,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK: tl.constexpr,
    HAS_ROWS: tl.constexpr,
):
    program = tl.program_id(0)
    n = program // KV_HEADS
    h = program % KV_HEADS
    if HAS_ROWS:
        b = tl.load(ROWS + n).to(tl.int64)
    else:
        b = n.to(tl.int64)
    keys = KEYS + b * stride_keys_b + h * stride_keys_h
    values = VALUES + b * stride_values_b + h * stride_values_h
    order = ORDER + n.to(tl.int64) * stride_order_n + h * stride_order_h
    kept = KEPT + n.to(tl.int64) * stride_kept_n + h * stride_kept_h
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    for start in range(0, slots, BLOCK):
        dest = start + tl.arange(0, BLOCK)
        inside = dest < slots
        source = tl.load(order + dest, mask=inside, other=0)
        keep = (tl.load(kept + dest, mask=inside, other=0) != 0) & inside
        move = keep & (source != dest)
        read = move[:, None] & dim_ok[None, :]
        moved_keys = tl.load(keys + source[:, None] * stride_keys_s + dims[None, :], mask=read, other=0.0)
        moved_values = tl.load(values + source[:, None] * stride_values_s + dims[None, :], mask=read, other=0.0)
        # A source may be another thread's destination in this block: every load before any store.
        tl.debug_barrier()
        write = (move | (inside & ~keep))[:, None] & dim_ok[None, :]  # moved, or freed (zeros)
        tl.store(keys + dest[:, None] * stride_keys_s + dims[None, :], moved_keys, mask=write)
        tl.store(values + dest[:, None] * stride_values_s + dims[None, :], moved_values, mask=write)


def compact_in_place(keys: torch.Tensor, values: torch.Tensor, order: torch.Tensor, kept: torch.Tensor,
                     rows: torch.Tensor | None = None, *, block: int = 64, num_warps: int = 4) -> None:
    """Destination slot j of row `rows[i]` (row i when None) and KV head h receives the key and value
    of slot `order[i, h, j]` where `kept[i, h, j]`, and zeros elsewhere; other rows are untouched.

    Requires `order[i, h, j] >= j` wherever `kept[i, h, j]` (kept slots move down, never up: the
    kept slots taken in their slot order, as an interval method's position order is); a source below
    its destination may already have been overwritten. No host sync, no temporary.

    Args:
        keys, values: `[B, Hkv, S, D]`, the last dim contiguous, modified in place.
        order: `[n, Hkv, S]` int64, the source slot of each destination slot; kept: `[n, Hkv, S]` bool.
        rows: `[n]` int64 row indices, or None for every row (n = B).
    """
    batch, kv_heads, slots, head_dim = keys.shape
    count = batch if rows is None else rows.shape[0]
    for name, tensor in (("keys", keys), ("values", values)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim, got strides {tensor.stride()}")
    if values.shape != keys.shape:
        raise ValueError(f"values has shape {tuple(values.shape)}, keys {tuple(keys.shape)}")
    for name, tensor in (("order", order), ("kept", kept)):
        if tuple(tensor.shape) != (count, kv_heads, slots) or tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be a [{count}, {kv_heads}, {slots}] tensor with contiguous slots, "
                             f"got {tuple(tensor.shape)} with strides {tensor.stride()}")
    if count == 0:
        return
    has_rows = rows is not None
    kept = kept.view(torch.uint8)
    rows = rows.contiguous() if has_rows else order  # without rows the kernel never reads the pointer
    _compact_kernel[(count * kv_heads,)](
        keys, values, order, kept, rows,
        keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        order.stride(0), order.stride(1), kept.stride(0), kept.stride(1),
        slots,
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK=block,
        HAS_ROWS=has_rows, num_warps=num_warps,
    )


__all__ = ["compact_in_place"]
