"""R-KV's window importance fused into one kernel, against the PyTorch form a compression runs today.

    python -m evals.bench.rkv_importance      # Figure 3's shapes: 408 rows, 8 KV heads of 4, window 8, 1744 slots

`baselines.rkv.window_importance` on the GPU's 16-bit path is one bf16 product with float32 output,
`[B, Hkv, G * W, S]` (728 MB a layer at Figure 3's batch), then about seven PyTorch kernels over its
`[B, Hkv, W, S]` maximum (the max over the G query heads, the scale, the mask, the softmax, its NaN
fix, the valid queries, the mean): about 5 GB of traffic a layer, 36 times a compression. The fused
form is one program per (row, KV head): its first pass reads the keys once, takes the product on
the tensor cores, the max over the G heads, the scale and the mask, stores the `[W, S]` logits to a
float32 scratch and keeps each window query's softmax statistics online; its second pass reads the
scratch back and writes the importance. About 1.8 GB a layer. Exact to float32 rounding (the
online softmax sums in another order); this benchmark prints the largest difference next to both
times, CUDA-graph timed (`evals.bench.attention`'s timing). An experiment: `baselines.rkv` takes it
if it pays. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import os

import torch

if not torch.cuda.is_available():
    # The tests run the kernel through the interpreter, whose switch is read when a kernel is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from longflow.kernels.reductions import reduce_max, reduce_sum  # noqa: E402


@triton.jit
def _importance_kernel(
    Q, K, OLDER, QUERY_VALID, SCRATCH, OUT,
    stride_qb, stride_qh, stride_qw, stride_qd, stride_kb, stride_kh, stride_ks, stride_kd,
    slots, scale,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, WINDOW: tl.constexpr,
    WINDOW_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, FP32_DOT: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // KV_HEADS).to(tl.int64)
    kv_head = pid % KV_HEADS
    head = b * KV_HEADS + kv_head
    # Row r of the query block is query w = r % WINDOW_PAD of head g = r // WINDOW_PAD of the group.
    rows = tl.arange(0, GROUP_PAD * WINDOW_PAD)
    g, w = rows // WINDOW_PAD, rows % WINDOW_PAD
    row_ok = (g < GROUP) & (w < WINDOW)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_w = tl.arange(0, WINDOW_PAD)
    offs_s = tl.arange(0, BLOCK_S)
    w_ok = offs_w < WINDOW
    q = tl.load(Q + b * stride_qb + (kv_head * GROUP + g)[:, None] * stride_qh + w[:, None] * stride_qw
                + offs_d[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)  # [G_PAD * W_PAD, D]
    k_base = K + b * stride_kb + kv_head * stride_kh + offs_d[None, :] * stride_kd
    older_row = OLDER + head * slots
    scratch_rows = SCRATCH + (head * WINDOW + offs_w)[:, None] * slots  # [W_PAD, 1]
    m_i = tl.full([WINDOW_PAD], float("-inf"), tl.float32)
    l_i = tl.full([WINDOW_PAD], 0.0, tl.float32)
    for start in range(0, slots, BLOCK_S):
        cols = start + offs_s
        s_ok = cols < slots
        k = tl.load(k_base + cols[:, None] * stride_ks, mask=s_ok[:, None], other=0.0)
        if FP32_DOT:
            logits = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            logits = tl.dot(q, tl.trans(k))
        logits = tl.where(row_ok[:, None], logits, float("-inf"))
        # The KV head's logit of window query w = the max over its G heads, then scaled.
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


def fused_window_importance(queries: torch.Tensor, query_valid: torch.Tensor, keys: torch.Tensor,
                            older: torch.Tensor, scale: float, block_s: int = 64) -> torch.Tensor:
    """`baselines.rkv.window_importance` in one launch: queries `[B, Hq, W, D]`, query_valid `[B, W]`
    bool, keys `[B, Hkv, S, D]` (any strides, the dtype of queries), older `[B, Hkv, S]` bool ->
    `[B, Hkv, S]` float32, -inf where not older."""
    batch, q_heads, window, head_dim = queries.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    group = q_heads // kv_heads
    window_pad = triton.next_power_of_2(window)
    # tl.dot takes at least 16 rows: padding heads (masked) make up the block.
    group_pad = max(triton.next_power_of_2(group), triton.cdiv(16, window_pad))
    scratch = torch.empty(batch, kv_heads, window, slots, dtype=torch.float32, device=keys.device)
    out = torch.empty(batch, kv_heads, slots, dtype=torch.float32, device=keys.device)
    fp32_dot = queries.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
    _importance_kernel[(batch * kv_heads,)](
        queries, keys, older.contiguous().view(torch.uint8), query_valid.contiguous().view(torch.uint8), scratch, out,
        *queries.stride(), *keys.stride(), slots, scale,
        KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=group_pad, WINDOW=window, WINDOW_PAD=window_pad,
        HEAD_DIM=head_dim, BLOCK_S=block_s, FP32_DOT=fp32_dot,
    )
    return out


def main(argv: list[str] | None = None) -> None:
    from baselines.rkv import window_importance
    from evals.bench.attention import graph_ms

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=408)
    parser.add_argument("--slots", type=int, default=1744)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--block-s", type=int, nargs="+", default=[32, 64, 128])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("evals.bench.rkv_importance needs a CUDA GPU")
    device = torch.device("cuda")
    q_heads, kv_heads, head_dim = 32, 8, 128  # Qwen3-8B
    generator = torch.Generator(device=device).manual_seed(0)
    queries = torch.randn(args.batch, q_heads, args.window, head_dim, device=device, dtype=torch.bfloat16,
                          generator=generator)
    keys = torch.randn(args.batch, kv_heads, args.slots, head_dim, device=device, dtype=torch.bfloat16,
                       generator=generator)
    index = torch.arange(args.slots, device=device)
    older = (index < args.slots - args.window).expand(args.batch, kv_heads, -1).contiguous()
    older[:, :, :7] = False  # left padding
    query_valid = torch.ones(args.batch, args.window, dtype=torch.bool, device=device)
    scale = head_dim**-0.5
    want = window_importance(queries, query_valid, keys, older, scale)
    eager = graph_ms([lambda: window_importance(queries, query_valid, keys, older, scale)])
    print(f"batch {args.batch}, {args.slots} slots, window {args.window}: PyTorch {eager:.3f} ms a layer, "
          f"{36 * eager:.1f} ms for 36 layers", flush=True)
    for block_s in args.block_s:
        got = fused_window_importance(queries, query_valid, keys, older, scale, block_s)
        finite = want.isfinite()
        same_inf = bool(torch.equal(finite, got.isfinite()))
        error = ((got - want).abs()[finite] / want.abs()[finite].clamp(min=1e-30)).max().item()
        fused = graph_ms([lambda b=block_s: fused_window_importance(queries, query_valid, keys, older, scale, b)])
        print(f"  fused, {block_s} slots a tile: {fused:.3f} ms a layer ({eager / fused:.2f}x), "
              f"largest relative difference {error:.1e}, -inf where PyTorch's: {same_inf}", flush=True)


if __name__ == "__main__":
    main()
