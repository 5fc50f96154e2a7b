"""R-KV's window importance in one launch: the window queries' attention over the older keys.

R-KV's importance (baselines/rkv.py `window_importance`, docs/methods.md "R-KV") is, per KV head,
the mean over the valid window queries of the softmax over the older keys of the max, over the
head's G query heads, of the scaled logits. In PyTorch that is one product with float32 output,
`[B, Hkv, G * W, S]` (728 MB a layer at Figure 3's batch: 408 rows, 8 KV heads of 4, window 8, 1744
slots), then about seven kernels over its `[B, Hkv, W, S]` maximum (the max, the scale, the mask,
the softmax, its NaN fix, the valid queries, the mean): about 5 GB of traffic a layer.

Here one program per (row, KV head) runs two passes. The first reads the keys once, takes the G * W
products on the tensor cores, the max over the G heads, the scale and the mask, stores the `[W, S]`
logits to a float32 scratch, and keeps each window query's softmax statistics online; the second
reads the scratch back and writes the importance. About 1.8 GB a layer, and 2.8x faster on the H200
(`python -m evals.bench.rkv_importance`). Equal to the PyTorch form to float32 rounding: the
softmax's sums run in another order.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # As in longflow_attention: the interpreter's switch is read when a kernel is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from longflow.kernels.precision import ieee_products  # noqa: E402
from longflow.kernels.reductions import reduce_max, reduce_sum  # noqa: E402


@triton.jit
def _window_importance_kernel(
    Q, K, OLDER, QUERY_VALID, SCRATCH, OUT,
    stride_qb, stride_qh, stride_qw, stride_qd, stride_kb, stride_kh, stride_ks, stride_kd,
    slots, scale,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, WINDOW: tl.constexpr,
    WINDOW_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_S: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // KV_HEADS).to(tl.int64)
    kv_head = pid % KV_HEADS
    head = b * KV_HEADS + kv_head
    # Row r of the query block is window query w = r % WINDOW_PAD of head g = r // WINDOW_PAD of the group.
    rows = tl.arange(0, GROUP_PAD * WINDOW_PAD)
    g, w = rows // WINDOW_PAD, rows % WINDOW_PAD
    row_ok = (g < GROUP) & (w < WINDOW)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    offs_w = tl.arange(0, WINDOW_PAD)
    offs_s = tl.arange(0, BLOCK_S)
    w_ok = offs_w < WINDOW
    q = tl.load(Q + b * stride_qb + (kv_head * GROUP + g)[:, None] * stride_qh + w[:, None] * stride_qw
                + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = K + b * stride_kb + kv_head * stride_kh + offs_d[None, :] * stride_kd
    older_row = OLDER + head * slots
    scratch_rows = SCRATCH + (head * WINDOW + offs_w)[:, None] * slots  # [W_PAD, 1]
    m_i = tl.full([WINDOW_PAD], float("-inf"), tl.float32)
    l_i = tl.full([WINDOW_PAD], 0.0, tl.float32)
    for start in range(0, slots, BLOCK_S):
        cols = start + offs_s
        s_ok = cols < slots
        k = tl.load(k_base + cols[:, None] * stride_ks, mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        if IEEE:
            logits = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            logits = tl.dot(q, tl.trans(k))
        logits = tl.where(row_ok[:, None], logits, float("-inf"))
        # The KV head's logit of window query w: the max over its G heads, then scaled.
        x = reduce_max(tl.reshape(logits, [GROUP_PAD, WINDOW_PAD, BLOCK_S]), 0) * scale  # [W_PAD, BLOCK_S]
        older = tl.load(older_row + cols, mask=s_ok, other=0) != 0
        x = tl.where(older[None, :], x, float("-inf"))
        tl.store(scratch_rows + cols[None, :], x, mask=w_ok[:, None] & s_ok[None, :])
        m_new = tl.maximum(m_i, reduce_max(x, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp(m_i - m_use) + reduce_sum(tl.exp(x - m_use[:, None]), 1)
        m_i = m_new
    # The scratch rows this program stored, read back by the same program.
    tl.debug_barrier()
    valid = (tl.load(QUERY_VALID + b * WINDOW + offs_w, mask=w_ok, other=0) != 0).to(tl.float32)
    count = tl.maximum(reduce_sum(valid, 0), 1.0)
    m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
    # A window query without older keys has l = 0: its softmax is NaN in PyTorch, set to 0 there.
    weight = tl.where(l_i > 0, valid / tl.where(l_i > 0, l_i, 1.0), 0.0) / count  # [W_PAD]
    for start in range(0, slots, BLOCK_S):
        cols = start + offs_s
        s_ok = cols < slots
        x = tl.load(scratch_rows + cols[None, :], mask=w_ok[:, None] & s_ok[None, :], other=float("-inf"))
        importance = reduce_sum(tl.exp(x - m_use[:, None]) * weight[:, None], 0)  # [BLOCK_S]
        older = tl.load(older_row + cols, mask=s_ok, other=0) != 0
        tl.store(OUT + head * slots + cols, tl.where(older, importance, float("-inf")), mask=s_ok)


def window_importance(queries: torch.Tensor, query_valid: torch.Tensor, keys: torch.Tensor, older: torch.Tensor,
                      scale: float, *, block: int = 64) -> torch.Tensor:
    """`baselines.rkv.window_importance` in one launch: queries `[B, Hq, W, D]`, query_valid `[B, W]`
    bool, keys `[B, Hkv, S, D]` (any strides, the dtype of queries; float32 is multiplied in IEEE
    float32, no TF32), older `[B, Hkv, S]` bool: the keys the window scores. Returns `[B, Hkv, S]`
    float32, -inf where not older. `block` (a power of two >= 16) is the slots of one tile; 64 is
    the H200's best at Figure 3's shapes (`evals.bench.rkv_importance`)."""
    batch, q_heads, window, head_dim = queries.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    if keys.dtype != queries.dtype:
        raise ValueError(f"keys are {keys.dtype} and queries {queries.dtype}: the kernel takes one dtype")
    if tuple(older.shape) != (batch, kv_heads, slots) or tuple(query_valid.shape) != (batch, window):
        raise ValueError(f"older {tuple(older.shape)} and query_valid {tuple(query_valid.shape)} do not fit "
                         f"queries {tuple(queries.shape)} and keys {tuple(keys.shape)}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    group = q_heads // kv_heads
    window_pad = triton.next_power_of_2(window)
    # tl.dot takes at least 16 rows: padding heads (masked) make up the block.
    group_pad = max(triton.next_power_of_2(group), triton.cdiv(16, window_pad))
    scratch = torch.empty(batch, kv_heads, window, slots, dtype=torch.float32, device=keys.device)
    out = torch.empty(batch, kv_heads, slots, dtype=torch.float32, device=keys.device)
    if out.numel() == 0:
        return out
    ieee = ieee_products(queries.dtype)
    _window_importance_kernel[(batch * kv_heads,)](
        queries, keys, older.contiguous().view(torch.uint8), query_valid.contiguous().view(torch.uint8), scratch,
        out, *queries.stride(), *keys.stride(), slots, float(scale),
        KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=group_pad, WINDOW=window, WINDOW_PAD=window_pad,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_S=block, IEEE=ieee,
    )
    return out


__all__ = ["window_importance"]
