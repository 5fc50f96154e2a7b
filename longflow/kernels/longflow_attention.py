"""Fused LongFlow decode attention in Triton: attention output, slot scores and argmin in one pass.

LongFlow (Su et al. 2026, arXiv 2603.11504); the semantics are docs/methods.md's and
`longflow.kernels.reference`'s; the next slot follows the selection rule of every method
(`longflow.selection.choose_next`: free slots first, protected last, lowest score, lowest index).
Kernel ideas follow FlashAttention-2 / flash-decoding (Dao et al.; triton-lang/triton
`python/tutorials/06-fused-attention.py` for the style).

Decode attention is memory-bound: every byte of K and V must be read once and nothing else should
cost as much. The work is split in two launches (no memset, no host sync):

1. `_partial_kernel`, grid `(B * Hkv, splits)`: one program per KV head and slot range reads each
   K/V slot once for all G query heads of its group (`[G_PAD, D]` query tile), runs the online
   softmax, and writes its partial (m, l, acc). When `splits == 1` it writes the output itself.
   The LongFlow score needs the FINAL softmax normaliser, unknown during the pass, so the program
   also writes, per slot and query head, `t = logit * log2(e) + log2 ||v_j||_1` to a scratch
   buffer: then `p_hj ||v_j||_1 = exp2(t_hj - m_h) / l_h`, and K/V are never read twice.
   Scratch costs Hq * 4 bytes per slot written and read (fp32), against 4 * Hkv * D bytes of K/V
   (bf16): 6% at Qwen3-8B shapes. K/V are loaded `evict_first` and the scratch stored
   `evict_last`, so the score kernel mostly reads it from L2. `scratch="fp16"` halves the bytes by
   storing `t - m_running` and the running max of each tile (`TREF`), with ~1e-3 relative error
   on the scores, below the bf16 rounding of the logits' inputs; `default_config` picks it where
   the fp32 scratch overflows its share of L2 at small batch (NOTES.md). ||v_j||_1 is computed on
   the tensor cores as `ones @ |v|^T`, which lands in the logits' layout: a reduction over D cost
   20-30% more time.
2. `_score_kernel`, grid `(B, score_splits)`: combines the (m, l) partials into the final softmax
   statistics of every query head, combines the partial outputs (its share of heads), then scores
   its slot range and reduces the argmin with free slots first (key -1) and protected slots last
   (key +inf); ties go to the lowest index. With several ranges per row, each range's (key,
   index) goes into one int64 by `atomic_min` and the last range to finish writes the slot, so
   no third launch is needed (the attention pass initialises that state).

The score pass also serves the other step methods whose score is a function of the step's
probabilities and per-slot state (`scored_attention`, `SCORES`): compile-time switches choose the
epilogue (the bare logit in the scratch instead of logit + log2 ||v||_1; a per-slot accumulator
updated in place, H2O's; a per-slot value norm, VATP's), and the grid has one program per selection:
per row, or per KV head over its G query heads (`SELECTIONS`), each with its own argmin.

The attention pass also serves plain decode attention (`flash_decode`, vanilla's): with `SCORE`
off it writes no scratch, and with `BOUNDED` each program reads its row's filled length from a
device tensor and splits only those slots among the grid's programs, so the grid stays static (one
CUDA graph for the whole generation) while the bytes read follow the filled slots, not the
allocated capacity; `_combine_kernel` (the score kernel's combine alone) merges the splits.

Notation: B batch, Hq query heads, Hkv KV heads, G = Hq / Hkv, S slots, D head dim.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():
    # A CPU-only machine can run Triton only through its interpreter, whose switch is read when a
    # kernel is defined (below); an explicit TRITON_INTERPRET=0 is respected.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from longflow.kernels import occupancy  # noqa: E402
from longflow.kernels.fast_math import log2_approx  # noqa: E402
from longflow.kernels.occupancy import GPU  # noqa: E402
from longflow.kernels.precision import ieee_products  # noqa: E402
from longflow.kernels.reductions import reduce_max, reduce_min, reduce_sum  # noqa: E402
from longflow.kernels.slot_write import check_token_write  # noqa: E402

LOG2E = 1.4426950408889634
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _partial_kernel(
    Q, K, V, VALID, LENGTHS, T, TREF, M_PART, L_PART, ACC, OUT, BEST, ARRIVED,
    NEW_K, NEW_V, POSITIONS, TOKEN_POSITIONS, SPLITS_ARRIVED,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_valid_b, stride_valid_h, stride_valid_s, stride_lengths, stride_lengths_h,
    stride_new_k_b, stride_new_k_h, stride_new_v_b, stride_new_v_h, stride_positions_b, stride_positions_h,
    n_slots, n_tiles, chunk, n_splits, qk_scale,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    ONE_SPLIT: tl.constexpr, SCRATCH_FP16: tl.constexpr, FP32_DOT: tl.constexpr, PREFETCH: tl.constexpr,
    VNORM_MMA: tl.constexpr, KV_EVICT: tl.constexpr, T_EVICT: tl.constexpr,
    SCORE: tl.constexpr, BOUNDED: tl.constexpr, VNORM: tl.constexpr, SELECTIONS: tl.constexpr,
    COMBINE: tl.constexpr, APPEND: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_TILE: tl.constexpr,
):
    """Program (b * Hkv + kv_head, split); see the module docstring. COMBINE and APPEND serve
    `flash_decode` and `append_decode` only (SCORE off; BOUNDED on for APPEND); SPLITS_PAD and
    HEAD_TILE tile the combine:

    COMBINE: the program of a KV head that finishes last (a counter per (b, kv_head) in
    SPLITS_ARRIVED, left at 0 again) combines the head's splits, so that no second launch is needed.
    APPEND: the decode token `NEW_K`/`NEW_V` `[B, Hkv, 1, D]` goes to slot `LENGTHS[b, kv_head]`
    (the row's next slot, also its filled length) with its validity and position; the programs
    read the slots before it, and split 0 starts its softmax from the token itself, held in
    registers, so that no program reads a slot that another one writes. The next slot moves on
    (to at most the last) once every program of the head has read it: by the last to arrive.
    """
    tl.static_assert(GROUP_PAD >= 16, "tl.dot needs at least 16 rows")
    tl.static_assert(BLOCK_N >= 16, "tl.dot needs at least 16 columns")
    tl.static_assert(GROUP <= GROUP_PAD)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid // KV_HEADS).to(tl.int64)
    kv_head = pid % KV_HEADS
    if SCORE:
        if (kv_head < SELECTIONS) & (split == 0):
            # The score kernel's cross-program argmin state of selection (b, kv_head) (it runs after
            # this grid): one per row when the heads share a selection, one per KV head otherwise.
            tl.store(BEST + b * SELECTIONS + kv_head, 9223372036854775807)
            tl.store(ARRIVED + b * SELECTIONS + kv_head, 0)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    rows = b * (KV_HEADS * GROUP) + kv_head * GROUP + offs_g  # flat (b, h) index, [G_PAD]

    # The G query heads of this KV head stay in registers for the whole pass.
    q_ptrs = Q + b * stride_qb + (kv_head * GROUP + offs_g)[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [G_PAD, D]
    k_base = K + b * stride_kb + kv_head * stride_kh + offs_d[None, :] * stride_kd
    v_base = V + b * stride_vb + kv_head * stride_vh + offs_d[None, :] * stride_vd
    t_rows = T + rows[:, None] * n_slots  # [G_PAD, 1] row pointers of the scratch

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.full([GROUP_PAD], 0.0, tl.float32)
    acc = tl.full([GROUP_PAD, HEAD_DIM_PAD], 0.0, tl.float32)

    if BOUNDED:
        # Only the row's first `filled` slots: the splits share them (whole tiles each), so the
        # static grid spreads the bytes actually read; a split past them runs no iteration and
        # writes an empty partial (m = -inf, l = 0) that the combine weighs 0.
        length_ptr = LENGTHS + b * stride_lengths
        if APPEND:  # the next slot of each KV head
            length_ptr += kv_head * stride_lengths_h
        next_slot = tl.load(length_ptr)
        filled = tl.minimum(next_slot.to(tl.int32), n_slots)
        if APPEND:
            # Branch-free: every program loads the token (a few hundred bytes, from L2), split 0 writes it
            # and takes it as its first slot: m = its logit, l = 1, acc = its value.
            first = split == 0
            # The write's mask as a vector: Triton's interpreter takes no scalar broadcast into one.
            writes = d_ok & (tl.full([HEAD_DIM_PAD], 0, tl.int32) + split == 0)
            new_k = tl.load(NEW_K + b * stride_new_k_b + kv_head * stride_new_k_h + offs_d, mask=d_ok, other=0.0)
            new_v = tl.load(NEW_V + b * stride_new_v_b + kv_head * stride_new_v_h + offs_d, mask=d_ok, other=0.0)
            tl.store(k_base + next_slot * stride_ks, new_k[None, :], mask=writes[None, :])
            tl.store(v_base + next_slot * stride_vs, new_v[None, :], mask=writes[None, :])
            tl.store(VALID + b * stride_valid_b + kv_head * stride_valid_h + next_slot * stride_valid_s,
                     tl.full([], 1, tl.uint8), mask=first)
            tl.store(POSITIONS + b * stride_positions_b + kv_head * stride_positions_h + next_slot,
                     tl.load(TOKEN_POSITIONS + b), mask=first)
            logit = reduce_sum(q.to(tl.float32) * new_k.to(tl.float32)[None, :], 1) * qk_scale  # [G_PAD]
            m_i = tl.where(first, logit, m_i)
            l_i = tl.where(first, 1.0, l_i)
            acc = tl.where(first, acc + new_v.to(tl.float32)[None, :], acc)
        tiles = (filled + BLOCK_N - 1) // BLOCK_N  # by hand: tl.cdiv is one of the jit wrappers above
        chunk = (tiles + n_splits - 1) // n_splits * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, filled)
    else:
        lo = split * chunk
        hi = tl.minimum(lo + chunk, n_slots)
    valid_row = VALID + b * stride_valid_b + kv_head * stride_valid_h
    # The mask is loaded one tile ahead (PREFETCH): a byte per slot is below the 4 bytes of an
    # asynchronous copy, so the compiler does not pipeline it, and an in-loop load would stall
    # every iteration for a full memory latency.
    ok_next = tl.load(valid_row + (lo + offs_n) * stride_valid_s, mask=(lo + offs_n) < hi, other=0)
    for start in range(lo, hi, BLOCK_N):
        slots = start + offs_n
        s_ok = slots < hi
        if PREFETCH:
            ok = ok_next != 0
            ok_next = tl.load(valid_row + (slots + BLOCK_N) * stride_valid_s, mask=(slots + BLOCK_N) < hi, other=0)
        else:
            ok = tl.load(valid_row + slots * stride_valid_s, mask=s_ok, other=0) != 0
        if HEAD_DIM == HEAD_DIM_PAD:
            kv_mask = s_ok[:, None]
        else:
            kv_mask = s_ok[:, None] & d_ok[None, :]
        # K/V are read once: `evict_first` keeps them from pushing the scratch out of L2.
        k = tl.load(k_base + slots[:, None] * stride_ks, mask=kv_mask, other=0.0, eviction_policy=KV_EVICT)
        v = tl.load(v_base + slots[:, None] * stride_vs, mask=kv_mask, other=0.0, eviction_policy=KV_EVICT)

        # Logits in base 2: exp2(x * log2 e) = exp(x).
        if FP32_DOT:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))  # [G_PAD, BLOCK_N]

        # Online softmax; `m_use` stays finite so that fully masked tiles give 0, never NaN.
        m_new = tl.maximum(m_i, reduce_max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + reduce_sum(p, 1)
        if FP32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

        if SCORE:
            # Score scratch: t = logit (+ log2 ||v||_1 for LongFlow's score, VNORM), so that
            # p (* ||v||_1) = exp2(t - m) / l later.
            # ||v_j||_1 comes from the tensor cores, ones @ |v|^T, already in the layout of the logits
            # (every row equal): a reduction over D would need shuffles and a layout conversion.
            # Floored at 1e-30 so that zero vectors and padding give a very negative number, not -inf.
            # With 16-bit inputs its log2 is the multi-function unit's approximation (`log2_approx`):
            # libdevice's accurate one was a third of the loop's instructions. Float32 inputs keep it,
            # so that their scores stay within rounding of the eager path's.
            if not VNORM:
                log_vnorm = 0.0
            elif not VNORM_MMA:  # the plain reduction, kept for comparison (NOTES.md)
                vnorm = reduce_sum(tl.abs(v.to(tl.float32)), 1)[None, :]
                log_vnorm = tl.log2(tl.maximum(vnorm, 1e-30))  # [1, BLOCK_N]
            elif FP32_DOT:
                ones = tl.full([GROUP_PAD, HEAD_DIM_PAD], 1.0, tl.float32)
                vnorm = tl.dot(ones, tl.trans(tl.abs(v.to(tl.float32))), input_precision="ieee")
                log_vnorm = tl.log2(tl.maximum(vnorm, 1e-30))  # [G_PAD, BLOCK_N], rows equal
            else:
                ones = tl.full([GROUP_PAD, HEAD_DIM_PAD], 1.0, v.dtype)
                vnorm = tl.dot(ones, tl.trans(tl.abs(v)))
                log_vnorm = log2_approx(tl.maximum(vnorm, 1e-30))  # [G_PAD, BLOCK_N], rows equal
            t_mask = g_ok[:, None] & s_ok[None, :]
            if SCRATCH_FP16:
                # Relative to the running max, which is <= 0 + log2 ||v||: small numbers, fp16 is enough.
                u = s - m_use[:, None] + log_vnorm
                tl.store(t_rows + slots[None, :], u.to(tl.float16), mask=t_mask, eviction_policy=T_EVICT)
                tl.store(TREF + rows * n_tiles + start // BLOCK_N, m_use, mask=g_ok)
            else:
                tl.store(t_rows + slots[None, :], s + log_vnorm, mask=t_mask, eviction_policy=T_EVICT)

    tl.store(M_PART + rows * n_splits + split, m_i, mask=g_ok)
    tl.store(L_PART + rows * n_splits + split, l_i, mask=g_ok)
    out_mask = g_ok[:, None] & d_ok[None, :]
    if ONE_SPLIT:
        out = (acc / tl.where(l_i > 0, l_i, 1.0)[:, None]).to(OUT.dtype.element_ty)
        tl.store(OUT + rows[:, None] * HEAD_DIM + offs_d[None, :], out, mask=out_mask)
        if APPEND:
            tl.store(length_ptr, tl.minimum(next_slot + 1, n_slots - 1))
    else:
        tl.store(ACC + (rows[:, None] * n_splits + split) * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)
        if COMBINE:
            # Every thread's stores above before the counter's release (the barrier), and the
            # partials read after its acquire past L1 (.cg), which other programs' stores bypass.
            tl.debug_barrier()
            arrived = tl.atomic_add(SPLITS_ARRIVED + pid, 1, sem="acq_rel")
            if arrived == n_splits - 1:
                tl.debug_barrier()
                _combine_heads(M_PART, L_PART, ACC, OUT, b, kv_head, GROUP, n_splits, KV_HEADS * GROUP, HEAD_DIM,
                               HEAD_DIM_PAD, SPLITS_PAD, HEAD_TILE, ".cg")
                tl.store(SPLITS_ARRIVED + pid, 0)
                if APPEND:
                    tl.store(length_ptr, tl.minimum(next_slot + 1, n_slots - 1))


@triton.jit
def _score_kernel(
    T, TREF, M_PART, L_PART, ACC, OUT, VALID, PROTECT, RECEIVED, NORMS, BEST, ARRIVED, NEXT_SLOT,
    stride_valid_b, stride_valid_h, stride_valid_s, stride_protect_b, stride_protect_h, stride_protect_s,
    stride_received_b, stride_received_h, stride_received_s, stride_norms_b, stride_norms_h, stride_norms_s,
    stride_next_b, stride_next_h,
    n_slots, n_tiles, chunk, n_splits, n_parts, heads_per_part, weight,
    Q_HEADS: tl.constexpr, SEL_HEADS: tl.constexpr, SEL_HEADS_PAD: tl.constexpr, SELECTIONS: tl.constexpr,
    KV_HEADS: tl.constexpr, KV_HEADS_PAD: tl.constexpr, WRITE_HEADS: tl.constexpr, WRITE_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr, HEAD_TILE: tl.constexpr, BLOCK_S: tl.constexpr, SUBTILE: tl.constexpr,
    SUBTILES: tl.constexpr, ONE_SPLIT: tl.constexpr, ONE_PART: tl.constexpr, SCRATCH_FP16: tl.constexpr,
    HAS_PROTECT: tl.constexpr, ACCUMULATE: tl.constexpr, NORMS_MODE: tl.constexpr,
):
    """One program per selection (row b, and KV head `sel` when each KV head selects its own slot) and
    slot range. The selection's SEL_HEADS query heads give p_hj; its score is, by the constexprs:
    `weight * sum_h p_hj` (LongFlow's scratch folds ||v_j||_1 into p), optionally accumulated into
    RECEIVED in place (ACCUMULATE: score = the accumulated attention) and weighed by NORMS
    (NORMS_MODE 1: the selection's own KV head's norm, 2: the mean over the KV heads)."""
    pid = tl.program_id(0)
    b = (pid // SELECTIONS).to(tl.int64)
    sel = pid % SELECTIONS
    part = tl.program_id(1)
    offs_h = tl.arange(0, SEL_HEADS_PAD)
    offs_p = tl.arange(0, SPLITS_PAD)
    h_ok = offs_h < SEL_HEADS
    p_ok = offs_p < n_splits

    # Final softmax statistics of the selection's query heads from the per-split partials.
    rows = b * Q_HEADS + sel * SEL_HEADS + offs_h
    part_off = rows[:, None] * n_splits + offs_p[None, :]
    part_mask = h_ok[:, None] & p_ok[None, :]
    m_part = tl.load(M_PART + part_off, mask=part_mask, other=float("-inf"))  # [SEL_HEADS_PAD, SPLITS_PAD]
    l_part = tl.load(L_PART + part_off, mask=part_mask, other=0.0)
    m_fin = reduce_max(m_part, 1)
    m_use = tl.where(m_fin == float("-inf"), 0.0, m_fin)
    l_fin = reduce_sum(l_part * tl.exp2(m_part - m_use[:, None]), 1)
    inv_l = tl.where(l_fin > 0, 1.0 / tl.where(l_fin > 0, l_fin, 1.0), 0.0)

    if not ONE_SPLIT:  # the row's heads are shared out over all its programs, whatever their selection
        _combine_heads(M_PART, L_PART, ACC, OUT, b, sel * n_parts + part, heads_per_part, n_splits,
                       Q_HEADS, HEAD_DIM, HEAD_DIM_PAD, SPLITS_PAD, HEAD_TILE, "")

    # Scores of this program's slot range and their argmin: free slots first (key -1, scores are
    # >= 0), protected slots last (+inf), the lowest index among ties. A tile is [SUBTILES, SUBTILE]
    # slots; with fp16 scratch a sub-tile is one attention tile, so its reference is one value per
    # head instead of a gather per element.
    offs_j = tl.arange(0, SUBTILES)
    tile = offs_j[:, None] * SUBTILE + tl.arange(0, SUBTILE)[None, :]  # [SUBTILES, SUBTILE]
    best_key = tl.full([SUBTILES, SUBTILE], float("inf"), tl.float32)
    best_idx = tl.full([SUBTILES, SUBTILE], 0, tl.int32)
    t_rows = T + rows[:, None, None] * n_slots
    tref_rows = TREF + rows[:, None] * n_tiles
    valid_row = VALID + b * stride_valid_b + sel * stride_valid_h
    protect_row = PROTECT + b * stride_protect_b + sel * stride_protect_h
    received_row = RECEIVED + b * stride_received_b + sel * stride_received_h
    if NORMS_MODE == 2:  # every KV head's norm of a slot, [KV_HEADS_PAD, 1, 1] row pointers
        offs_kv = tl.arange(0, KV_HEADS_PAD)
        norms_rows = NORMS + b * stride_norms_b + offs_kv[:, None, None] * stride_norms_h
        kv_ok = offs_kv < KV_HEADS
    else:
        norms_rows = NORMS + b * stride_norms_b + sel * stride_norms_h
        kv_ok = h_ok
    lo = part * chunk
    hi = tl.minimum(lo + chunk, n_slots)
    # Every load is issued one tile ahead (no dot here, so the compiler pipelines nothing).
    t_next, ok_next, protect_next, received_next, norms_next = _score_tile_loads(
        t_rows, tref_rows, valid_row, protect_row, received_row, norms_rows, lo, tile, offs_j, hi,
        stride_valid_s, stride_protect_s, stride_received_s, stride_norms_s, h_ok, kv_ok,
        SUBTILE, BLOCK_S, SCRATCH_FP16, HAS_PROTECT, ACCUMULATE, NORMS_MODE, KV_HEADS)
    for start in range(lo, hi, BLOCK_S):
        slots = start + tile
        s_ok = slots < hi
        t, ok, protected = t_next, ok_next != 0, protect_next != 0
        received, norms = received_next, norms_next
        t_next, ok_next, protect_next, received_next, norms_next = _score_tile_loads(
            t_rows, tref_rows, valid_row, protect_row, received_row, norms_rows, start + BLOCK_S, tile, offs_j,
            hi, stride_valid_s, stride_protect_s, stride_received_s, stride_norms_s, h_ok, kv_ok,
            SUBTILE, BLOCK_S, SCRATCH_FP16, HAS_PROTECT, ACCUMULATE, NORMS_MODE, KV_HEADS)
        # p_hj (times ||v_j||_1 for LongFlow), [SEL_HEADS_PAD, SUBTILES, SUBTILE], summed over the heads
        attention = reduce_sum(tl.exp2(t - m_use[:, None, None]) * inv_l[:, None, None], 0)
        if ACCUMULATE:
            # Every slot of the range, as the eager `received += attention` (0 on free slots).
            score = received + attention
            tl.store(received_row + slots * stride_received_s, score, mask=s_ok)
        else:
            score = attention * weight
        if NORMS_MODE != 0:
            score = score * norms
        key = tl.where(ok, score, -1.0)
        if HAS_PROTECT:
            key = tl.where(ok & protected, float("inf"), key)
        key = tl.where(s_ok, key, float("inf"))
        better = key < best_key  # strict: each lane keeps its earliest slot among ties
        best_key = tl.where(better, key, best_key)
        best_idx = tl.where(better, slots, best_idx)
    key_min = reduce_min(reduce_min(best_key, 1), 0)
    idx_min = reduce_min(reduce_min(tl.where(best_key == key_min, best_idx, 2147483647), 1), 0)
    # The chosen slot goes to WRITE_HEADS entries of the row's next-slot buffer: its own KV head's
    # (one per head), or every head's when they share the selection.
    offs_w = tl.arange(0, WRITE_HEADS_PAD)
    next_ptrs = NEXT_SLOT + b * stride_next_b + (sel + offs_w) * stride_next_h
    if ONE_PART:
        tl.store(next_ptrs, idx_min.to(tl.int64) + tl.full([WRITE_HEADS_PAD], 0, tl.int64), mask=offs_w < WRITE_HEADS)
    else:
        # The argmin over parts without another launch: (key, index) packed in one int64 whose
        # order is the key's, then the index's (keys are -1 or >= 0: their float bits as int32
        # order the same way), reduced by atomic_min; the last part to arrive writes the result.
        packed = (key_min.to(tl.int32, bitcast=True).to(tl.int64) << 32) | idx_min.to(tl.int64)
        tl.atomic_min(BEST + pid, packed, sem="relaxed")
        arrived = tl.atomic_add(ARRIVED + pid, 1, sem="acq_rel")
        if arrived == n_parts - 1:
            best = tl.atomic_min(BEST + pid, packed, sem="acquire")  # the minimum over every part
            tl.store(next_ptrs, (best & 2147483647) + tl.full([WRITE_HEADS_PAD], 0, tl.int64),
                     mask=offs_w < WRITE_HEADS)


@triton.jit
def _combine_heads(M_PART, L_PART, ACC, OUT, b, part, heads_per_part, n_splits,
                   Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                   SPLITS_PAD: tl.constexpr, HEAD_TILE: tl.constexpr, CACHE: tl.constexpr):
    """Flash-decoding combine of the partial outputs of row b, for part `part`'s share of the heads,
    HEAD_TILE heads at a time with all their splits in one load ([HEAD_TILE, SPLITS_PAD, D]): a loop
    over the splits would wait a full memory latency per split. `CACHE`: the loads' cache modifier
    (".cg" where the partials were written by other programs of the same launch)."""
    offs_p = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    p_ok = offs_p < n_splits
    d_ok = offs_d < HEAD_DIM
    offs_ht = tl.arange(0, HEAD_TILE)
    for h0 in range(0, heads_per_part, HEAD_TILE):
        local = h0 + offs_ht
        heads = part * heads_per_part + local
        ht_ok = (heads < Q_HEADS) & (local < heads_per_part)
        ht_rows = b * Q_HEADS + heads
        ht_off = ht_rows[:, None] * n_splits + offs_p[None, :]  # [HEAD_TILE, SPLITS_PAD]
        ht_mask = ht_ok[:, None] & p_ok[None, :]
        m_ht = tl.load(M_PART + ht_off, mask=ht_mask, other=float("-inf"), cache_modifier=CACHE)
        l_ht = tl.load(L_PART + ht_off, mask=ht_mask, other=0.0, cache_modifier=CACHE)
        m_ht_fin = reduce_max(m_ht, 1)
        weight = tl.exp2(m_ht - tl.where(m_ht_fin == float("-inf"), 0.0, m_ht_fin)[:, None])
        l_ht_fin = reduce_sum(l_ht * weight, 1)
        acc = tl.load(ACC + ht_off[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                      mask=ht_mask[:, :, None] & d_ok[None, None, :], other=0.0, cache_modifier=CACHE)
        out = reduce_sum(acc * weight[:, :, None], 1) / tl.where(l_ht_fin > 0, l_ht_fin, 1.0)[:, None]
        tl.store(OUT + ht_rows[:, None] * HEAD_DIM + offs_d[None, :], out.to(OUT.dtype.element_ty),
                 mask=ht_ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_kernel(M_PART, L_PART, ACC, OUT, heads_per_part, n_splits,
                    Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                    SPLITS_PAD: tl.constexpr, HEAD_TILE: tl.constexpr):
    """The combine alone, grid `(B, parts)`: the second launch of `flash_decode`."""
    _combine_heads(M_PART, L_PART, ACC, OUT, tl.program_id(0).to(tl.int64), tl.program_id(1), heads_per_part,
                   n_splits, Q_HEADS, HEAD_DIM, HEAD_DIM_PAD, SPLITS_PAD, HEAD_TILE, "")


@triton.jit
def _score_tile_loads(t_rows, tref_rows, valid_row, protect_row, received_row, norms_rows, start, tile, offs_j,
                      hi, stride_valid_s, stride_protect_s, stride_received_s, stride_norms_s, h_ok, kv_ok,
                      SUBTILE: tl.constexpr, BLOCK_S: tl.constexpr, SCRATCH_FP16: tl.constexpr,
                      HAS_PROTECT: tl.constexpr, ACCUMULATE: tl.constexpr, NORMS_MODE: tl.constexpr,
                      KV_HEADS: tl.constexpr):
    """One score tile from `start`: scratch `[SEL_HEADS_PAD, SUBTILES, SUBTILE]` as fp32 (absolute),
    mask and protect bytes, the accumulated attention and the value norm (the mean over the KV heads
    for NORMS_MODE 2) `[SUBTILES, SUBTILE]`; a state the score does not read comes back as the mask."""
    slots = start + tile
    s_ok = slots < hi
    t_mask = h_ok[:, None, None] & s_ok[None, :, :]
    t = tl.load(t_rows + slots[None, :, :], mask=t_mask, other=float("-inf"), eviction_policy="evict_first")
    t = t.to(tl.float32)
    if SCRATCH_FP16:
        # The attention tile of each sub-tile: `start` is a multiple of the tile size SUBTILE.
        tref = tl.load(tref_rows + start // SUBTILE + offs_j[None, :],
                       mask=h_ok[:, None] & (start + offs_j * SUBTILE < hi)[None, :], other=0.0)
        t += tref[:, :, None]
    ok = tl.load(valid_row + slots * stride_valid_s, mask=s_ok, other=0)
    protected = ok
    if HAS_PROTECT:
        protected = tl.load(protect_row + slots * stride_protect_s, mask=s_ok, other=0)
    received = ok
    if ACCUMULATE:
        received = tl.load(received_row + slots * stride_received_s, mask=s_ok, other=0.0)
    norms = ok
    if NORMS_MODE == 1:
        norms = tl.load(norms_rows + slots * stride_norms_s, mask=s_ok, other=0.0)
    elif NORMS_MODE == 2:
        every = tl.load(norms_rows + slots[None, :, :] * stride_norms_s, mask=kv_ok[:, None, None] & s_ok[None, :, :],
                        other=0.0)  # [KV_HEADS_PAD, SUBTILES, SUBTILE]
        norms = reduce_sum(every, 0) / KV_HEADS
    return t, ok, protected, received, norms


# ---- host side ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchConfig:
    """Tiling of one call. `splits`/`score_splits` are upper bounds, rounded to whole tiles."""

    block_n: int = 64  # slots per tile of the attention pass
    num_warps: int = 4
    num_stages: int = 3
    splits: int = 1  # slot ranges per KV head in the attention pass (flash-decoding)
    score_splits: int = 1  # slot ranges per batch row in the score pass
    block_s: int = 128  # slots per tile of the score pass
    score_warps: int = 4
    scratch: str = "fp32"  # "fp32" | "fp16"
    prefetch: bool = True  # load the validity mask one tile ahead in the attention pass
    vnorm: str = "mma"  # ||v||_1 as ones @ |v|^T on the tensor cores ("mma") or a reduction ("reduce")
    l2_hints: bool = True  # K/V loaded `evict_first`, the scratch stored `evict_last`
    # LongFlow's score with its scratch on chip (`longflow.kernels.onchip`, Gluon). Its pass then takes
    # `block_n`, `num_stages` and `num_warps`; the other fields are unused.
    onchip: bool = False

    def __post_init__(self):
        for name in ("block_n", "block_s"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.splits < 1 or self.score_splits < 1:
            raise ValueError(f"splits and score_splits must be >= 1, got {self.splits}, {self.score_splits}")
        if self.scratch not in ("fp32", "fp16"):
            raise ValueError(f"scratch must be 'fp32' or 'fp16', got {self.scratch!r}")
        if self.vnorm not in ("mma", "reduce"):
            raise ValueError(f"vnorm must be 'mma' or 'reduce', got {self.vnorm!r}")


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # interpreter: a small pretend GPU, so that CPU tests also cover the split paths
    return occupancy.gpu(device).multiprocessors


@functools.cache
def _l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 64 * 2**20
    return torch.cuda.get_device_properties(device).L2_cache_size


@functools.cache  # called per layer and decode step when not under a CUDA graph
def default_config(
    batch: int, kv_heads: int, q_heads: int, slots: int, head_dim: int, sms: int, l2_bytes: int = 50 * 2**20,
    selections: int = 1, onchip: GPU | None = None, scored: bool = True,
) -> LaunchConfig:
    """Heuristic launch configuration; constants from H200 and H100 sweeps (longflow/kernels/NOTES.md).
    `selections`: next slots chosen per row (1 when the KV heads share one, `kv_heads` otherwise).
    `onchip`: the GPU (`longflow.kernels.occupancy.gpu`) where the call can take the on-chip pass
    (`longflow.kernels.onchip.unsupported` None, LongFlow's score, one selection), else None; the
    pass is then chosen where `onchip.tiling` expects it faster. `scored`: a score pass follows the
    attention pass (the scored call), False for `flash_decode`, whose last program combines the splits."""
    if onchip is not None:
        from longflow.kernels import onchip as onchip_pass  # Gluon, which the rest does not need

        tile = onchip_pass.tiling(batch * kv_heads, slots, onchip)
        if tile is not None:
            return LaunchConfig(block_n=tile[0], num_stages=tile[1], onchip=True)
    block_n = 64
    programs = batch * kv_heads
    # Attention pass: split the slots (down to one tile per program) until about 2 programs per
    # multiprocessor; B * Hkv >= 2 * SMs fills the GPU without the combine step. With that many
    # programs a 4th pipeline stage pays (fewer programs per SM, more bytes in flight each); below,
    # 3 stages keep 3 programs per SM resident in one wave.
    split_regime = programs < 2 * sms
    num_stages = 3 if split_regime else 4
    # Score pass: 128 (small batches) or 256 slots per program, at most ~4 programs per multiprocessor
    # (a row's selections each have programs of their own). With one split its tiles are 64 slots
    # (1-2% faster than 128 at batch 64 and 128, `python -m evals.bench.attention --sweep`).
    per_part = 128 if split_regime else 256
    score_splits = max(1, min(triton.cdiv(slots, per_part), triton.cdiv(4 * sms, batch * selections)))
    block_s = 128 if split_regime else 64
    # In the split regime the pass must run at SDPA's speed on its own, and an fp32 scratch that
    # overflows its share of L2 (a quarter) goes to DRAM: half the bytes in fp16 then win
    # (longflow/kernels/NOTES.md). With fewer, larger programs fp32 is as fast or faster.
    fp32_scratch_bytes = batch * q_heads * slots * 4
    scratch = "fp16" if split_regime and fp32_scratch_bytes > l2_bytes // 4 else "fp32"
    # Where B * Hkv programs already fill one or two a multiprocessor in a nearly whole wave (batch
    # 16 and 32 at 8 KV heads on 132 multiprocessors), the scored call is faster unsplit: its score
    # pass then combines no splits. On an H100, 1.06-1.07x cuDNN against the splits' 1.08-1.11x at
    # batch 16 over 1024-3200 slots (slower at 5120, where every unsplit pass is), 1.04-1.10x against
    # 1.11-1.20x at batch 32. At one program a multiprocessor the fp16 scratch's per-tile work shows
    # (1.16-1.18x), so there only with fp32 (longflow/kernels/NOTES.md, "Batch 16 on an H100").
    per_multiprocessor = 1 if programs <= sms else 2
    whole_wave = occupancy.wave_fill(programs, per_multiprocessor * sms) >= occupancy.WAVE_FILL
    unsplit = scored and whole_wave and (per_multiprocessor == 2 or scratch == "fp32")
    splits = 1 if unsplit else max(1, min(triton.cdiv(2 * sms, programs), triton.cdiv(slots, block_n)))
    return LaunchConfig(block_n=block_n, num_stages=num_stages, splits=splits, score_splits=score_splits,
                        block_s=block_s, scratch=scratch)


def _check_inputs(q, k, v, valid, protect) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, q_heads, head_dim], got shape {tuple(q.shape)}")
    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [batch, kv_heads, slots, head_dim], got {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    batch, q_heads, head_dim = q.shape
    _, kv_heads, slots, k_dim = k.shape
    if k.shape[0] != batch or k_dim != head_dim:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head_dim")
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")
    if slots == 0:
        raise ValueError("the cache has no slots")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype of {_DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, mask in (("valid", valid), ("protect", protect)):
        if mask is None:
            continue
        if mask.dtype != torch.bool or tuple(mask.shape) != (batch, slots):
            raise ValueError(f"{name} must be a [batch, slots] = [{batch}, {slots}] bool tensor, "
                             f"got {mask.dtype} {tuple(mask.shape)}")
    tensors = [t for t in (q, k, v, valid, protect) if t is not None]
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"all inputs must be on one device, got {[str(t.device) for t in tensors]}")
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"the Triton kernel needs CUDA tensors (got {q.device}); use longflow.kernels."
                         "reference on the CPU, or set TRITON_INTERPRET=1 before importing triton")


def _even_split(slots: int, splits: int, block_n: int) -> tuple[int, int]:
    """(slots per split, splits launched) of a pass over all `slots` cut into at most `splits` runs
    of whole tiles: the attention pass's split when it reads every slot (`BOUNDED` off)."""
    chunk = triton.cdiv(triton.cdiv(slots, splits), block_n) * block_n
    return chunk, triton.cdiv(slots, chunk)


def _mask_strides(mask: torch.Tensor) -> tuple[int, int, int]:
    """(batch, KV head, slot) strides of a `[B, S]` mask shared by the heads (head stride 0) or a
    `[B, Hkv, S]` mask of one per head."""
    return mask.stride() if mask.dim() == 3 else (mask.stride(0), 0, mask.stride(1))


def longflow_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    valid: torch.Tensor,
    scale: float | None = None,
    *,
    protect: torch.Tensor | None = None,
    config: LaunchConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LongFlow decode attention with the next slot to overwrite, in two launches and no host sync.

    Args:
        q: `[B, Hq, D]` current query (after RoPE); k, v: `[B, Hkv, S, D]` slot caches, any strides.
        valid: `[B, S]` bool, False for free or padding slots; may be a strided view (`valid3d[:, 0]`).
        scale: softmax scale, `D ** -0.5` when None.
        protect: optional `[B, S]` bool: valid slots never chosen for eviction (free ones still are).
        config: tiling override (tuning and tests); the heuristic `default_config` when None.

    Returns:
        out: `[B, Hq, D]` in the dtype of q.
        next_slot: `[B]` int64, the lowest free slot, else the valid unprotected slot of lowest score.
    """
    _check_inputs(q, k, v, valid, protect)
    next_slot = torch.empty(q.shape[0], 1, dtype=torch.long, device=q.device)
    out = _run(q, k, v, valid, scale, protect, config, epilogue=Epilogue(SCORES["longflow"], False, next_slot))
    return out, next_slot[:, 0]


@dataclass(frozen=True)
class Score:
    """How the score pass turns the step's probabilities p_hj into slot scores (compile-time switches).

    `vnorm`: the scratch holds logit + log2 ||v_j||_1, so p becomes p ||v_j||_1 (LongFlow);
    `accumulate`: the step's attention is added in place to a per-slot accumulator, which is the score;
    `norms`: the score is multiplied by a per-slot value norm: 0 none, 1 the selection's own KV head's,
    2 the mean over the KV heads.
    """

    vnorm: bool = False
    accumulate: bool = False
    norms: int = 0


# The score epilogues, by name: slot j's score from this step's probabilities p_hj of the selection's
# query heads (all Hq of a row, or the G of one KV head) and per-slot state, times `weight`
# (`scored_attention`) where nothing is accumulated:
#   longflow:              sum_h p_hj ||v_j||_1 (LongFlow; ||v_j||_1 from the values in the pass)
#   attention:             sum_h p_hj (TOVA, with weight 1 / Hq: the mean; H2O lf_repo)
#   accumulated:           received_j += sum_h p_hj, score received_j (H2O paper)
#   accumulated_vnorm:     received_j += sum_h p_hj, score received_j * norms_j (VATP paper)
#   attention_vnorm_mean:  sum_h p_hj * the mean over KV heads of norms_j (VATP lf_repo, weight 1 / Hq)
SCORES = {
    "longflow": Score(vnorm=True),
    "attention": Score(),
    "accumulated": Score(accumulate=True),
    "accumulated_vnorm": Score(accumulate=True, norms=1),
    "attention_vnorm_mean": Score(norms=2),
}


@dataclass(frozen=True)
class Epilogue:
    """What one call of `_run` scores and where the result goes (see `scored_attention`)."""

    score: Score
    per_kv_head: bool
    next_slot: torch.Tensor  # [B, Hkv] or [B, 1] int64, written in place
    weight: float = 1.0
    received: torch.Tensor | None = None
    norms: torch.Tensor | None = None


def scored_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    valid: torch.Tensor,
    next_slot: torch.Tensor,
    scale: float | None = None,
    *,
    score: str,
    per_kv_head: bool = False,
    protect: torch.Tensor | None = None,
    received: torch.Tensor | None = None,
    norms: torch.Tensor | None = None,
    weight: float = 1.0,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """Decode attention with a step method's score and its next slot, in LongFlow's two launches.

    The attention pass is LongFlow's; the score pass applies the epilogue `score` (a key of `SCORES`)
    to the step's probabilities and chooses the next slot by the shared rule (`longflow.selection.
    choose_next`: the lowest free slot, else the valid unprotected slot of lowest score, ties to the
    lowest index), per row (`per_kv_head` False: the scores summed over all query heads) or per KV
    head (over its G query heads). No host sync; every output is written in place.

    Args:
        q: `[B, Hq, D]`; k, v: `[B, Hkv, S, D]` slot caches, any strides.
        valid: `[B, Hkv, S]` bool, or `[B, S]` when the heads share it; a shared selection reads head 0.
        next_slot: `[B, Hkv]` int64 (any strides), written in place: each KV head's choice, or the
            row's for every head.
        protect: optional bool like `valid`: valid slots never chosen (free ones still are).
        received: `[B, Hkv, S]` float32, the accumulator of the `accumulated*` scores, updated in place
            on every slot (free slots receive 0).
        norms: `[B, Hkv, S]` float32 value norms of the `*vnorm*` scores (besides `longflow`).
        weight: the factor of a score that is not accumulated.
        config: tiling override (tests); the heuristic `default_config` when None.

    Returns:
        out: `[B, Hq, D]` in the dtype of q.
    """
    if score not in SCORES:
        raise ValueError(f"score must be one of {tuple(SCORES)}, got {score!r}")
    epilogue = SCORES[score]
    batch, kv_heads, slots = k.shape[:3]
    shapes = ((batch, slots), (batch, kv_heads, slots))
    for name, mask in {"valid": valid, "protect": protect}.items():
        if mask is not None and (mask.dtype != torch.bool or mask.shape not in shapes):
            raise ValueError(f"{name} must be a [batch, slots] or [batch, kv_heads, slots] = {shapes[1]} bool tensor, "
                             f"got {mask.dtype} {tuple(mask.shape)}")
        if per_kv_head and mask is not None and mask.dim() != 3:
            raise ValueError(f"a selection per KV head needs {name} per KV head, [batch, kv_heads, slots]")
    _check_inputs(q, k, v, valid if valid.dim() == 2 else valid[:, 0], None)
    states = {"received": (received, epilogue.accumulate), "norms": (norms, epilogue.norms != 0)}
    for name, (state, needed) in states.items():
        if needed != (state is not None):
            raise ValueError(f"score {score!r} {'needs' if needed else 'takes no'} {name}")
        if state is not None and (state.dtype != torch.float32 or state.shape != (batch, kv_heads, slots)
                                  or state.device != q.device):
            raise ValueError(f"{name} must be a [batch, kv_heads, slots] = {(batch, kv_heads, slots)} float32 tensor "
                             f"on {q.device}, got {state.dtype} {tuple(state.shape)} on {state.device}")
    if epilogue.accumulate and not per_kv_head:
        raise ValueError(f"score {score!r} accumulates per KV head: it needs per_kv_head=True")
    if next_slot.dtype != torch.long or next_slot.shape != (batch, kv_heads) or next_slot.device != q.device:
        raise ValueError(f"next_slot must be a [batch, kv_heads] = {(batch, kv_heads)} int64 tensor on {q.device}, "
                         f"got {next_slot.dtype} {tuple(next_slot.shape)} on {next_slot.device}")
    return _run(q, k, v, valid, scale, protect, config,
                epilogue=Epilogue(epilogue, per_kv_head, next_slot, weight, received, norms))


def _run(q, k, v, valid, scale, protect, config, attention_only=False, epilogue: Epilogue | None = None):
    """The launches of `longflow_attention` and `scored_attention` (inputs checked); returns out.
    `attention_only` stops after the attention pass, for the benchmark's accounting (out is then
    unfinished when split). `epilogue` None: LongFlow's score, its next slot discarded (benchmarks)."""
    batch, q_heads, head_dim = q.shape
    _, kv_heads, slots, _ = k.shape
    group = q_heads // kv_heads
    scale = head_dim**-0.5 if scale is None else float(scale)
    if epilogue is None:
        epilogue = Epilogue(SCORES["longflow"], False, torch.empty(batch, 1, dtype=torch.long, device=q.device))
    per_kv_head = epilogue.per_kv_head
    selections = kv_heads if per_kv_head else 1
    score = epilogue.score
    chosen = config is None  # by `call_config`, which takes the on-chip pass only where it can run
    if chosen:
        config = call_config(q, k, v, score, per_kv_head)
    if config.onchip:
        if not chosen:
            _check_onchip(q, k, v, config, epilogue)
        return _onchip_call(q, k, v, valid, scale, protect, epilogue, attention_only, config)

    # Whole tiles per split; the split counts actually launched follow from the rounding.
    chunk, splits = _even_split(slots, config.splits, config.block_n)
    fp16_scratch = config.scratch == "fp16"
    # fp16 scratch: a score tile is whole attention tiles, whose running maxima its references are.
    block_s = max(config.block_s, config.block_n) if fp16_scratch else config.block_s
    subtile = config.block_n if fp16_scratch else block_s
    score_chunk = triton.cdiv(triton.cdiv(slots, config.score_splits), block_s) * block_s
    score_splits = triton.cdiv(slots, score_chunk)
    n_tiles = triton.cdiv(slots, config.block_n)
    fp32_dot = ieee_products(q.dtype)

    device, f32 = q.device, torch.float32
    out = torch.empty(batch, q_heads, head_dim, dtype=q.dtype, device=device)
    scratch = torch.empty(batch, q_heads, slots, dtype=torch.float16 if fp16_scratch else f32, device=device)
    tile_ref = torch.empty(batch, q_heads, n_tiles, dtype=f32, device=device) if fp16_scratch else scratch
    m_part = torch.empty(batch, q_heads, splits, dtype=f32, device=device)
    l_part = torch.empty_like(m_part)
    acc = torch.empty(batch, q_heads, splits, head_dim, dtype=f32, device=device) if splits > 1 else m_part
    # Written by the attention pass before the score kernel reads them: no memset launch.
    best = torch.empty(batch * selections, dtype=torch.int64, device=device)
    arrived = torch.empty(batch * selections, dtype=torch.int32, device=device)
    # Bool tensors go in as bytes; a same-size dtype view keeps any strides.
    valid_u8 = valid.view(torch.uint8)
    protect_u8 = protect.view(torch.uint8) if protect is not None else valid_u8

    head_dim_pad = triton.next_power_of_2(head_dim)
    _partial_kernel[(batch * kv_heads, splits)](
        q, k, v, valid_u8, valid_u8, scratch, tile_ref, m_part, l_part, acc, out, best, arrived,
        # The token's and the combine counters' pointers and strides are never touched with APPEND and COMBINE off.
        *(m_part,) * 5, *q.stride(), *k.stride(), *v.stride(), *_mask_strides(valid_u8), *(0,) * 8,
        slots, n_tiles, chunk, splits, scale * LOG2E,
        KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_N=config.block_n,
        ONE_SPLIT=splits == 1, SCRATCH_FP16=fp16_scratch, FP32_DOT=fp32_dot, PREFETCH=config.prefetch,
        VNORM_MMA=config.vnorm == "mma", KV_EVICT="evict_first" if config.l2_hints else "",
        T_EVICT="evict_last" if config.l2_hints else "", SCORE=True, BOUNDED=False, VNORM=score.vnorm,
        SELECTIONS=selections, COMBINE=False, APPEND=False, SPLITS_PAD=1, HEAD_TILE=1,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if attention_only:
        return out
    sel_heads = q_heads // selections
    heads_per_part = triton.cdiv(q_heads, selections * score_splits)
    splits_pad = triton.next_power_of_2(splits)
    head_tile = _head_tile(heads_per_part, splits_pad, head_dim_pad)
    next_slot = epilogue.next_slot
    # A shared selection writes its slot to every column of next_slot; one per KV head, to its own.
    write_heads = 1 if per_kv_head else next_slot.shape[1]
    received = epilogue.received if epilogue.received is not None else scratch
    norms = epilogue.norms if epilogue.norms is not None else scratch
    state_strides = [*(received.stride() if epilogue.received is not None else (0, 0, 0)),
                     *(norms.stride() if epilogue.norms is not None else (0, 0, 0))]
    _score_kernel[(batch * selections, score_splits)](
        scratch, tile_ref, m_part, l_part, acc, out, valid_u8, protect_u8, received, norms, best, arrived,
        next_slot, *_mask_strides(valid_u8), *_mask_strides(protect_u8), *state_strides, *next_slot.stride(),
        slots, n_tiles, score_chunk, splits, score_splits, heads_per_part, epilogue.weight,
        Q_HEADS=q_heads, SEL_HEADS=sel_heads, SEL_HEADS_PAD=triton.next_power_of_2(sel_heads),
        SELECTIONS=selections, KV_HEADS=kv_heads, KV_HEADS_PAD=triton.next_power_of_2(kv_heads),
        WRITE_HEADS=write_heads, WRITE_HEADS_PAD=max(2, triton.next_power_of_2(write_heads)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, SPLITS_PAD=splits_pad,
        HEAD_TILE=head_tile, BLOCK_S=block_s, SUBTILE=subtile, SUBTILES=block_s // subtile,
        ONE_SPLIT=splits == 1, ONE_PART=score_splits == 1, SCRATCH_FP16=fp16_scratch,
        HAS_PROTECT=protect is not None, ACCUMULATE=score.accumulate, NORMS_MODE=score.norms,
        num_warps=config.score_warps,
    )
    return out


def call_config(q, k, v, score: Score | None = None, per_kv_head: bool = False) -> LaunchConfig:
    """`default_config` for a call on these inputs with this score (LongFlow's when None): what a
    `config` of None means."""
    batch, q_heads, head_dim = q.shape
    _, kv_heads, slots, _ = k.shape
    onchip = None
    if (score is None or score == SCORES["longflow"]) and not per_kv_head and _onchip_takes(q, k, v):
        onchip = occupancy.gpu(q.device)
    return default_config(batch, kv_heads, q_heads, slots, head_dim, _multiprocessors(q.device), _l2_bytes(q.device),
                          kv_heads if per_kv_head else 1, onchip)


def _onchip_takes(q, k, v) -> bool:
    """Whether the on-chip pass can take these inputs (on a CUDA GPU: it has no interpreter)."""
    if not q.is_cuda:
        return False
    from longflow.kernels import onchip

    return onchip.unsupported(q, k, v) is None


def _check_onchip(q, k, v, config, epilogue) -> None:
    """Why a given `LaunchConfig(onchip=True)` cannot run this call, as a ValueError."""
    from longflow.kernels import onchip

    if epilogue.score != SCORES["longflow"] or epilogue.per_kv_head:
        raise ValueError("LaunchConfig(onchip=True) takes LongFlow's score with one selection a row only")
    # The shared memory before the device: on a CPU it is checked against sm_90's, so that tests see it.
    card = occupancy.gpu(q.device) if q.is_cuda else occupancy.SM90
    if not onchip.fits(config.block_n, config.num_stages, k.shape[2], card):
        shared = onchip.shared_bytes(config.block_n, config.num_stages, k.shape[2])
        raise ValueError(f"LaunchConfig(onchip=True): {config.block_n}-slot tiles at {config.num_stages} stages over "
                         f"{k.shape[2]} slots take {shared} bytes of shared memory, more than the GPU gives a program "
                         f"({card.shared_per_program})")
    if not q.is_cuda:
        raise ValueError("LaunchConfig(onchip=True) needs CUDA tensors: Gluon kernels have no interpreter")
    reason = onchip.unsupported(q, k, v)
    if reason is not None:
        raise ValueError(f"LaunchConfig(onchip=True): the on-chip pass cannot take these inputs: {reason}")


def _onchip_call(q, k, v, valid, scale, protect, epilogue, attention_only, config):
    """`_run` through `longflow.kernels.onchip` (imported here: it needs Gluon, which the rest does not)."""
    from longflow.kernels import onchip

    return onchip.onchip_attention(q, k, v, valid, epilogue.next_slot, scale, protect, score=not attention_only,
                                   block_n=config.block_n, stages=config.num_stages, warps=config.num_warps)


def _head_tile(heads_per_part: int, splits_pad: int, head_dim_pad: int) -> int:
    """Heads combined at once: all splits of HEAD_TILE heads in at most 8192 fp32 registers' worth."""
    return min(triton.next_power_of_2(heads_per_part), max(1, 8192 // (splits_pad * head_dim_pad)))


def flash_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    valid: torch.Tensor,
    lengths: torch.Tensor | None,
    scale: float | None = None,
    *,
    config: LaunchConfig | None = None,
    arrivals: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain decode attention over each row's filled slots (flash-decoding), no score, no host sync.

    The attention pass of `longflow_attention` without its scratch: the grid is static (the splits
    of the heuristic for the whole capacity, so that a CUDA graph can hold it), and each program
    reads row b's filled length on the device and takes its share of slots [0, lengths[b]) only:
    the bytes read per step follow the filled slots, not the capacity. The splits' partial
    softmaxes are combined by a second launch, or, given `arrivals`, by the last program of each KV
    head to finish (none when the heuristic gives one split).

    Args:
        q: `[B, Hq, D]`; k, v: `[B, Hkv, S, D]` slot caches, any strides.
        valid: `[B, S]` bool, False for free or padding slots, or `[B, Hkv, S]` when each KV head
            holds its own slots; may be a strided view.
        lengths: `[B]` int32 or int64, slots filled per row (clamped to S); slots from lengths[b] on are never
            read, whatever `valid` says. May be a strided view (`next_slot[:, 0]`). None: every slot
            is read, `valid` alone masks (caches whose free slots lie anywhere).
        scale: softmax scale, `D ** -0.5` when None.
        config: tiling override (tests); `block_n`, `num_warps`, `num_stages` and `splits` are used.
        arrivals: `[B * Hkv]` int32 zeros, kept by the caller across calls (each call leaves them
            at 0): the counters of the one-launch combine.

    Returns:
        `[B, Hq, D]` in the dtype of q: the softmax over the valid slots among the filled ones
        (0 for a row with none).
    """
    per_head = valid.dim() == 3
    if per_head and (valid.dtype != torch.bool or valid.shape != (k.shape[0], k.shape[1], k.shape[2])):
        raise ValueError(f"a per-head valid must be a [batch, kv_heads, slots] = {tuple(k.shape[:3])} bool tensor, "
                         f"got {valid.dtype} {tuple(valid.shape)}")
    _check_inputs(q, k, v, valid[:, 0] if per_head else valid, None)
    batch = q.shape[0]
    if lengths is not None:
        if lengths.dim() != 1 or lengths.shape[0] != batch or lengths.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"lengths must be a [batch] = [{batch}] int32 or int64 tensor, got {lengths.dtype} "
                             f"{tuple(lengths.shape)}")
        if lengths.device != q.device:
            raise ValueError(f"lengths is on {lengths.device}, q on {q.device}")
    _check_arrivals(arrivals, batch * k.shape[1], q.device)
    return _decode_pass(q, k, v, valid, lengths, scale, config, arrivals)


def append_decode(
    q: torch.Tensor,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    positions: torch.Tensor,
    next_slot: torch.Tensor,
    token_positions: torch.Tensor,
    arrivals: torch.Tensor,
    scale: float | None = None,
    *,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """A cache filled in order (vanilla's) at one decode step of one layer, in one launch: the token's
    write (`longflow.kernels.write_token` with `advance`), then `flash_decode` over the filled slots
    with the combine in the pass (`arrivals`). Per layer that is one launch where there were three;
    at batch 1 the step is about 450 short kernels and their ramps and tails are part of its time.

    Row b, KV head h: slot `s = next_slot[b, h]` gets `new_k[b, h, 0]`, `new_v[b, h, 0]`, its
    validity and position `token_positions[b]`; the output is the softmax over the valid slots of
    [0, s) and the token (as `flash_decode` with lengths `s + 1` after the write); then `next_slot[b,
    h]` moves to `s + 1`, at most the last slot (where a row past its end keeps writing, its output
    then reading slots [0, S - 1) and the token). No host sync, static launch.

    Args:
        q: `[B, Hq, D]`; new_k, new_v: `[B, Hkv, 1, D]`, the last dim contiguous.
        keys, values: `[B, Hkv, S, D]` slot caches, the last dim contiguous; written in place.
        valid: `[B, Hkv, S]` bool, contiguous slots; the token's slot set in place.
        positions: `[B, Hkv, S]` int64, contiguous slots; the token's slot set in place.
        next_slot: `[B, Hkv]` int64, each in [0, S); advanced in place.
        token_positions: `[B]` int64, contiguous.
        arrivals: `[B * Hkv]` int32 zeros, kept across calls (left at 0).
        scale, config: as `flash_decode`'s.

    Returns:
        `[B, Hq, D]` in the dtype of q.
    """
    _check_inputs(q, keys, values, valid[:, 0], None)
    check_token_write(keys, values, valid, positions, next_slot, new_k, new_v, token_positions, ("new_k", "new_v"))
    _check_arrivals(arrivals, keys.shape[0] * keys.shape[1], q.device)
    tensors = (q, new_k, new_v, positions, next_slot, token_positions)
    if len({tensor.device for tensor in tensors}) != 1:
        raise ValueError(f"all inputs must be on one device, got {[str(t.device) for t in tensors]}")
    return _decode_pass(q, keys, values, valid, next_slot, scale, config, arrivals,
                        append=(new_k, new_v, positions, token_positions))


def _check_arrivals(arrivals: torch.Tensor | None, programs: int, device: torch.device) -> None:
    if arrivals is not None and (arrivals.dtype != torch.int32 or arrivals.shape != (programs,)
                                 or arrivals.device != device):
        raise ValueError(f"arrivals must be a [batch * kv_heads] = [{programs}] int32 tensor on {device}, "
                         f"got {arrivals.dtype} {tuple(arrivals.shape)} on {arrivals.device}")


def _decode_pass(q, k, v, valid, lengths, scale, config, arrivals, append=None) -> torch.Tensor:
    """The launches of `flash_decode` and `append_decode` (inputs checked). lengths: `[B]`, or the
    next slots `[B, Hkv]` with `append` = (new_k, new_v, positions, token_positions)."""
    batch, q_heads, head_dim = q.shape
    _, kv_heads, slots, _ = k.shape
    scale = head_dim**-0.5 if scale is None else float(scale)
    sms = _multiprocessors(q.device)
    if config is None:
        config = default_config(batch, kv_heads, q_heads, slots, head_dim, sms, _l2_bytes(q.device), scored=False)
    if lengths is None:
        chunk, splits = _even_split(slots, config.splits, config.block_n)
    else:  # the kernel cuts each row's filled slots itself
        chunk, splits = 0, min(config.splits, triton.cdiv(slots, config.block_n))
    fp32_dot = ieee_products(q.dtype)
    group = q_heads // kv_heads

    f32 = torch.float32
    out = torch.empty(batch, q_heads, head_dim, dtype=q.dtype, device=q.device)
    m_part = torch.empty(batch, q_heads, splits, dtype=f32, device=q.device)
    l_part = torch.empty_like(m_part)
    acc = torch.empty(batch, q_heads, splits, head_dim, dtype=f32, device=q.device) if splits > 1 else m_part
    valid_u8 = valid.view(torch.uint8)
    head_dim_pad = triton.next_power_of_2(head_dim)
    splits_pad = triton.next_power_of_2(splits)
    combine = arrivals is not None and splits > 1
    if append is None:
        # Pointers of the token's buffers are never touched with APPEND off.
        new_k = new_v = positions = token_positions = m_part
        append_strides = (0,) * 6
        length_strides = (0, 0) if lengths is None else (lengths.stride(0), 0)
    else:
        new_k, new_v, positions, token_positions = append
        append_strides = (*new_k.stride()[:2], *new_v.stride()[:2], *positions.stride()[:2])
        length_strides = lengths.stride()
    # Pointers of the score's buffers (T, TREF, BEST, ARRIVED) are never touched with SCORE off.
    _partial_kernel[(batch * kv_heads, splits)](
        q, k, v, valid_u8, valid_u8 if lengths is None else lengths, m_part, m_part, m_part, l_part, acc, out,
        m_part, m_part, new_k, new_v, positions, token_positions, arrivals if combine else m_part,
        *q.stride(), *k.stride(), *v.stride(), *_mask_strides(valid_u8), *length_strides, *append_strides,
        slots, 1, chunk, splits, scale * LOG2E,
        KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_N=config.block_n,
        ONE_SPLIT=splits == 1, SCRATCH_FP16=False, FP32_DOT=fp32_dot, PREFETCH=config.prefetch,
        VNORM_MMA=False, KV_EVICT="evict_first" if config.l2_hints else "", T_EVICT="",
        SCORE=False, BOUNDED=lengths is not None, VNORM=False, SELECTIONS=1,
        COMBINE=combine, APPEND=append is not None, SPLITS_PAD=splits_pad,
        HEAD_TILE=_head_tile(group, splits_pad, head_dim_pad),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if splits == 1 or combine:
        return out
    # The combine spread over about 4 programs per multiprocessor: at batch 1 one program per head.
    parts = max(1, min(q_heads, triton.cdiv(4 * sms, batch)))
    heads_per_part = triton.cdiv(q_heads, parts)
    _combine_kernel[(batch, triton.cdiv(q_heads, heads_per_part))](
        m_part, l_part, acc, out, heads_per_part, splits,
        Q_HEADS=q_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, SPLITS_PAD=splits_pad,
        HEAD_TILE=_head_tile(heads_per_part, splits_pad, head_dim_pad), num_warps=config.score_warps,
    )
    return out


__all__ = ["SCORES", "LaunchConfig", "append_decode", "default_config", "flash_decode", "longflow_attention",
           "scored_attention"]
