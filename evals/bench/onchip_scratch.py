"""An experiment: LongFlow's attention pass with its score scratch held in shared memory (Gluon).

The fused call's pass (`longflow.kernels.longflow_attention`) writes every slot's logits to a scratch
in global memory inside its pipelined loop, and a second launch reads them back once the softmax
statistics are final; that write stream is what keeps the pass above `flash_decode`'s pace
(docs/engine.md, "Issue 27's targets"). Triton keeps no shared memory past a loop, so here the pass
is written in Gluon: one program per (row, KV head), all of the row's slots (one split), its G
heads' `t = logit + log2 ||v||_1` kept in shared memory as fp16 relative to each tile's running
maximum (as the kernel's `scratch="fp16"`), and after the loop the program reduces its G heads into
one partial score a slot, `[B, Hkv, S]` fp32; the row's argmin (free slots first, the lowest index
among ties) sums the KV heads' partials in head order, in the row's last program to finish or in a
second launch. `compact` keeps only the G = 4 real rows of the 16 the MMA computes (a quarter of the
shared memory), taken out of the tile by in-thread reshapes and splits.

    python -m evals.bench.onchip_scratch             # checks against float32, then times (CUDA GPU)
    python -m evals.bench.onchip_scratch --compile   # compiles for sm_90 only, any machine

Gluon has no interpreter: the kernel runs on a GPU only, and the CPU tests compile it for sm_90
with the installed Triton and the GPU image's 3.6 (`tests/test_bench_onchip_scratch.py`), whose
Gluon names two of its operations differently (below). Results and what they mean:
longflow/kernels/NOTES.md, "The scratch on chip".
"""

from __future__ import annotations

import argparse
import json
import os

import torch

if not torch.cuda.is_available():
    # `_row_argmin` runs through Triton's interpreter on a CPU (its switch is read when a kernel is
    # defined); an explicit TRITON_INTERPRET=0, as `--compile` is run with, is respected.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402

from longflow.kernels.reductions import reduce_min  # noqa: E402

# Gluon's names as Triton 3.6 (the GPU image's) has them, or as later Tritons renamed them.
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
ROWS = gl.constexpr(16)  # the MMA's rows: a KV head's G query heads, zero-padded


@gluon.jit
def _onchip_pass(Q, K, V, VALID, OUT, PART, ARRIVED, NEXT, n_slots, qk_scale,
                 KV_HEADS: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr, MAX_TILES: gl.constexpr, SCORE: gl.constexpr, COMPACT: gl.constexpr,
                 FUSED_ARGMIN: gl.constexpr, NUM_WARPS: gl.constexpr):
    """Program b * Hkv + kv_head: attention of its G heads over all slots; with SCORE, their partial
    LongFlow score `sum_h p_hj ||v_j||_1` into PART `[B, Hkv, S]`; with FUSED_ARGMIN the row's last
    program to finish (a counter per row in ARRIVED, left at 0 again) takes the row's argmin into NEXT."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NUM_WARPS], instr_shape=[16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    io: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NUM_WARPS, 1], [1, 0])  # 16-byte vectors along D
    walk: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NUM_WARPS, 1], [1, 0])  # [ROWS, BLOCK_N]
    # COMPACT: a slot's 16 rows in one thread, so that the 4 real ones come out by reshapes and splits
    column: gl.constexpr = gl.BlockedLayout([16, 1], [1, 32], [1, NUM_WARPS], [0, 1])
    walk4: gl.constexpr = gl.BlockedLayout([1, 2], [4, 8], [1, NUM_WARPS], [1, 0])  # [4, BLOCK_N]
    kv_shared: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
    t_shared: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    r_shared: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

    pid = gl.program_id(0)
    b = pid // KV_HEADS
    kv_head = pid % KV_HEADS
    head0 = b * (KV_HEADS * GROUP) + kv_head * GROUP

    offs_row_io = gl.arange(0, ROWS, layout=gl.SliceLayout(1, io))
    offs_n_io = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, io))
    offs_d_io = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io))
    row_ok_io = offs_row_io < GROUP
    q = gl.load(Q + (head0 + offs_row_io)[:, None] * HEAD_DIM + offs_d_io[None, :],
                mask=row_ok_io[:, None] & (offs_d_io < HEAD_DIM)[None, :], other=0.0)
    q = gl.convert_layout(q, a_op)

    kv_base = (b * KV_HEADS + kv_head).to(gl.int64) * n_slots * HEAD_DIM
    tile_offs = offs_n_io[:, None] * HEAD_DIM + offs_d_io[None, :]  # [BLOCK_N, D]
    d_all = (offs_d_io < HEAD_DIM)[None, :]
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], kv_shared)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], kv_shared)
    n_tiles = gl.cdiv(n_slots, BLOCK_N)
    for i in gl.static_range(STAGES - 1):
        in_range = ((i * BLOCK_N + offs_n_io) < n_slots)[:, None] & d_all
        _async_load(k_smem.index(i), K + kv_base + i * BLOCK_N * HEAD_DIM + tile_offs,
                                               mask=in_range)
        _async_load(v_smem.index(i), V + kv_base + i * BLOCK_N * HEAD_DIM + tile_offs,
                                               mask=in_range)
        async_copy.commit_group()

    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, mma))
    l_i = gl.full([ROWS], 0.0, gl.float32, layout=gl.SliceLayout(1, mma))
    acc = gl.full([ROWS, HEAD_DIM], 0.0, gl.float32, layout=mma)
    zero_s = gl.full([ROWS, BLOCK_N], 0.0, gl.float32, layout=mma)
    ones = gl.full([ROWS, HEAD_DIM], 1.0, gl.bfloat16, layout=a_op)
    offs_n_mma = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
    valid_row = VALID + b.to(gl.int64) * n_slots
    if SCORE:  # the scratch: fp16 relative to each tile's running maximum, and those maxima
        if COMPACT:
            gl.static_assert(GROUP == 4, "the compact scratch keeps rows 0-3")
            t_smem = gl.allocate_shared_memory(gl.float16, [MAX_TILES, 4, BLOCK_N], t_shared)
        else:
            t_smem = gl.allocate_shared_memory(gl.float16, [MAX_TILES, ROWS, BLOCK_N], t_shared)
        if COMPACT:
            r_smem = gl.allocate_shared_memory(gl.float32, [MAX_TILES, 4], r_shared)
        else:
            r_smem = gl.allocate_shared_memory(gl.float32, [MAX_TILES, ROWS], r_shared)
    # The mask one tile ahead: a byte a slot is below an asynchronous copy's 4 bytes.
    ok_next = gl.load(valid_row + offs_n_mma, mask=offs_n_mma < n_slots, other=0)
    for tile in range(n_tiles):
        start = tile * BLOCK_N
        ok = ok_next != 0
        ok_next = gl.load(valid_row + start + BLOCK_N + offs_n_mma, mask=start + BLOCK_N + offs_n_mma < n_slots,
                          other=0)
        async_copy.wait_group(STAGES - 2)
        _barrier()  # every thread's copies of this tile landed; the stage reused below is read
        ahead = tile + STAGES - 1
        in_range = ((ahead * BLOCK_N + offs_n_io) < n_slots)[:, None] & d_all
        _async_load(k_smem.index(ahead % STAGES),
                                               K + kv_base + ahead * BLOCK_N * HEAD_DIM + tile_offs, mask=in_range)
        _async_load(v_smem.index(ahead % STAGES),
                                               V + kv_base + ahead * BLOCK_N * HEAD_DIM + tile_offs, mask=in_range)
        async_copy.commit_group()

        stage = tile % STAGES
        k_t = k_smem.index(stage).permute((1, 0)).load(b_op)  # [D, BLOCK_N]
        s = mma_v2(q, k_t, zero_s)
        s = gl.where((ok & (start + offs_n_mma < n_slots))[None, :], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        v = v_smem.index(stage).load(b_op)  # [BLOCK_N, D]
        acc = mma_v2(gl.convert_layout(p.to(gl.bfloat16), a_op), v, acc * alpha[:, None])
        m_i = m_new
        if SCORE:
            # ||v_j||_1 on the tensor cores, ones @ |v|^T, in the logits' layout (rows equal).
            abs_v_t = gl.abs(v_smem.index(stage).permute((1, 0)).load(b_op))
            vnorm = mma_v2(ones, abs_v_t, zero_s)
            log_vnorm = gl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [gl.maximum(vnorm, 1e-30)],
                                                  dtype=gl.float32, is_pure=True, pack=1)
            u = s - m_use[:, None] + log_vnorm
            if COMPACT:
                # row r = 8 i1 + 4 i0 + j: keep i1 = i0 = 0, all in-thread after the conversion
                u4 = gl.reshape(gl.convert_layout(u.to(gl.float16), column), [2, 2, 4, BLOCK_N])
                u4 = gl.permute(u4, [2, 3, 1, 0])  # [j, n, i0, i1]
                u4, _ = gl.split(u4)
                u4, _ = gl.split(u4)
                t_smem.index(tile).store(u4)
                r_smem.index(tile).store(_first_four(m_use, gl.BlockedLayout([1], [32], [NUM_WARPS], [0]), NUM_WARPS))
            else:
                t_smem.index(tile).store(u.to(gl.float16))
                r_smem.index(tile).store(m_use)
    async_copy.wait_group(0)

    l_safe = gl.where(l_i > 0, l_i, 1.0)
    out = gl.convert_layout((acc / l_safe[:, None]).to(gl.bfloat16), io)
    gl.store(OUT + (head0 + offs_row_io)[:, None] * HEAD_DIM + offs_d_io[None, :], out,
             mask=row_ok_io[:, None] & d_all)

    if SCORE:
        _barrier()  # every thread's scratch stores before the walk reads them
        m_fin = gl.where(m_i == float("-inf"), 0.0, m_i)
        inv_l = gl.where(l_i > 0, 1.0 / l_safe, 0.0)
        part_row = PART + (b * KV_HEADS + kv_head).to(gl.int64) * n_slots
        if COMPACT:
            m_fin4 = _first_four(m_fin, gl.SliceLayout(1, walk4), NUM_WARPS)
            inv_l4 = _first_four(inv_l, gl.SliceLayout(1, walk4), NUM_WARPS)
            offs_n4 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, walk4))
            for tile in range(n_tiles):
                u = t_smem.index(tile).load(walk4).to(gl.float32)  # [4, BLOCK_N]
                ref = r_smem.index(tile).load(gl.SliceLayout(1, walk4))
                part = gl.sum(gl.exp2(u + (ref - m_fin4)[:, None]) * inv_l4[:, None], axis=0)
                slots = tile * BLOCK_N + offs_n4
                gl.store(part_row + slots, part, mask=slots < n_slots)
        else:
            m_fin = gl.convert_layout(m_fin, gl.SliceLayout(1, walk))
            inv_l = gl.convert_layout(inv_l, gl.SliceLayout(1, walk))
            row_ok = gl.arange(0, ROWS, layout=gl.SliceLayout(1, walk)) < GROUP
            offs_n_w = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, walk))
            for tile in range(n_tiles):
                u = t_smem.index(tile).load(walk).to(gl.float32)
                ref = r_smem.index(tile).load(gl.SliceLayout(1, walk))
                p = gl.exp2(u + (ref - m_fin)[:, None]) * inv_l[:, None]
                part = gl.sum(gl.where(row_ok[:, None], p, 0.0), axis=0)
                slots = tile * BLOCK_N + offs_n_w
                gl.store(part_row + slots, part, mask=slots < n_slots)
        if FUSED_ARGMIN:
            # Every thread's partials before the counter's release; the last program reads them past L1.
            _barrier()
            arrived = gl.atomic_add(ARRIVED + b, 1, sem="acq_rel")
            if arrived == KV_HEADS - 1:
                _row_argmin_tail(PART, VALID, NEXT, b, n_slots, KV_HEADS, NUM_WARPS)
                gl.store(ARRIVED + b, 0)


@gluon.jit
def _row_argmin_tail(PART, VALID, NEXT, b, n_slots, KV_HEADS: gl.constexpr, NUM_WARPS: gl.constexpr):
    """Row b's argmin of the KV heads' partials summed in head order, free slots first, the lowest index
    among ties, into NEXT[b]."""
    heads: gl.constexpr = gl.BlockedLayout([KV_HEADS, 2], [1, 32], [1, NUM_WARPS], [1, 0])
    BLOCK: gl.constexpr = 64 * NUM_WARPS
    offs_h = gl.arange(0, KV_HEADS, layout=gl.SliceLayout(1, heads))
    offs_s = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, heads))
    part_rows = PART + (b * KV_HEADS + offs_h).to(gl.int64)[:, None] * n_slots
    valid_row = VALID + b.to(gl.int64) * n_slots
    best_key = gl.full([BLOCK], float("inf"), gl.float32, layout=gl.SliceLayout(0, heads))
    best_idx = gl.full([BLOCK], 0, gl.int32, layout=gl.SliceLayout(0, heads))
    for start in range(0, n_slots, BLOCK):
        slots = start + offs_s
        in_range = slots < n_slots
        part = gl.load(part_rows + slots[None, :], mask=(offs_h < KV_HEADS)[:, None] & in_range[None, :], other=0.0,
                       cache_modifier=".cg")
        ok = gl.load(valid_row + slots, mask=in_range, other=0) != 0
        key = gl.where(in_range, gl.where(ok, gl.sum(part, axis=0), -1.0), float("inf"))
        better = key < best_key
        best_key = gl.where(better, key, best_key)
        best_idx = gl.where(better, slots, best_idx)
    key_min = gl.min(best_key, axis=0)
    gl.store(NEXT + b, gl.min(gl.where(best_key == key_min, best_idx, 2147483647), axis=0).to(gl.int64))


@gluon.jit
def _first_four(x, layout: gl.constexpr, NUM_WARPS: gl.constexpr):
    """Elements 0-3 of a `[16]` vector, in `layout`: in one thread, index r = 8 i1 + 4 i0 + j."""
    x = gl.convert_layout(x, gl.BlockedLayout([16], [32], [NUM_WARPS], [0]))
    x = gl.permute(gl.reshape(x, [2, 2, 4]), [2, 1, 0])  # [j, i0, i1]
    x, _ = gl.split(x)
    x, _ = gl.split(x)
    return gl.convert_layout(x, layout)


@triton.jit
def _row_argmin(PART, VALID, NEXT, n_slots, KV_HEADS: tl.constexpr, BLOCK: tl.constexpr):
    """Program b: the KV heads' partials summed, free slots first (key -1), the lowest index among ties."""
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    best_key = tl.full([BLOCK], float("inf"), tl.float32)
    best_idx = tl.full([BLOCK], 0, tl.int32)
    for start in range(0, n_slots, BLOCK):
        slots = start + offs
        in_range = slots < n_slots
        score = tl.full([BLOCK], 0.0, tl.float32)
        for h in tl.static_range(KV_HEADS):
            score += tl.load(PART + (b * KV_HEADS + h) * n_slots + slots, mask=in_range, other=0.0)
        ok = tl.load(VALID + b * n_slots + slots, mask=in_range, other=0) != 0
        key = tl.where(in_range, tl.where(ok, score, -1.0), float("inf"))
        better = key < best_key
        best_key = tl.where(better, key, best_key)
        best_idx = tl.where(better, slots, best_idx)
    key_min = reduce_min(best_key, 0)
    tl.store(NEXT + b, reduce_min(tl.where(best_key == key_min, best_idx, 2147483647), 0).to(tl.int64))


def onchip_call(q, k, v, valid, scale: float, score: bool = True, compact: bool = True, stages: int = 3,
                num_warps: int = 4, block_n: int = 64, fused_argmin: bool = True):
    """`call()` -> (out `[B, Hq, D]`, next slot `[B]`): q `[B, Hq, D]`, k/v `[B, Hkv, S, D]` bf16,
    valid `[B, S]`. Buffers are allocated once, so that the call can be captured in a CUDA graph.
    Without `fused_argmin` the argmin is a second launch (`_row_argmin`)."""
    batch, q_heads, head_dim = q.shape
    kv_heads, slots = k.shape[1], k.shape[2]
    out = torch.empty_like(q)
    part = torch.empty(batch, kv_heads, slots, dtype=torch.float32, device=q.device)
    next_slot = torch.empty(batch, dtype=torch.int64, device=q.device)
    arrived = torch.zeros(batch, dtype=torch.int32, device=q.device)
    valid_bytes = valid.to(torch.uint8).contiguous()
    max_tiles = triton.cdiv(slots, block_n)
    qk_scale = scale * 1.4426950408889634

    def call():
        _onchip_pass[(batch * kv_heads,)](
            q, k, v, valid_bytes, out, part, arrived, next_slot, slots, qk_scale,
            KV_HEADS=kv_heads, GROUP=q_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_N=block_n, STAGES=stages,
            MAX_TILES=max_tiles, SCORE=score, COMPACT=compact, FUSED_ARGMIN=score and fused_argmin,
            NUM_WARPS=num_warps, num_warps=num_warps)
        if score and not fused_argmin:
            _row_argmin[(batch,)](part, valid_bytes, next_slot, slots, KV_HEADS=kv_heads, BLOCK=1024, num_warps=8)
        return out, next_slot

    return call


def float32_reference(q, k, v, valid, scale: float):
    """(out `[B, Hq, D]`, score `[B, S]`, next slot `[B]`) in float32: LongFlow's score
    `sum_h p_hj ||v_j||_1` over every query head, free slots first, the lowest index among ties."""
    batch, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group = q_heads // kv_heads
    qf = q.float().view(batch, kv_heads, group, head_dim)
    logits = torch.einsum("bhgd,bhsd->bhgs", qf, k.float()) * scale
    logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = logits.softmax(-1)  # [B, Hkv, G, S]
    out = torch.einsum("bhgs,bhsd->bhgd", p, v.float()).reshape(batch, q_heads, head_dim)
    score = (p * v.float().abs().sum(-1)[:, :, None, :]).sum((1, 2))  # [B, S]
    key = torch.where(valid, score, torch.full_like(score, -1.0))
    return out, score, key.argmin(-1)


def check(batch: int, slots: int, device: torch.device, tie: float = 0.02, **options) -> str:
    """Output and chosen slot against `float32_reference`; a chosen slot other than the reference's
    passes if its score is within `tie` (relative) of the minimum (the fp16 scratch's rounding)."""
    from evals.bench.attention import HEAD_DIM, make_cache

    q, k, v, valid = make_cache(batch, slots, device, seed=1)
    valid[::2] = True  # rows without free slots, whose next slot is chosen by its score
    scale = HEAD_DIM**-0.5
    name = f"batch {batch}, {slots} slots, {options}"
    try:
        call = onchip_call(q, k, v, valid, scale, **options)
        call()
        out, next_slot = call()  # twice: the row counters must have been left at 0
    except OutOfResources as error:
        return f"{name}: {error}"
    ref_out, ref_score, ref_next = float32_reference(q, k, v, valid, scale)
    out_err = (out.float() - ref_out).abs().max().item()
    chosen = ref_score.gather(1, next_slot[:, None])[:, 0]
    best = ref_score.gather(1, ref_next[:, None])[:, 0]
    free_first = valid.gather(1, ref_next[:, None])[:, 0] == valid.gather(1, next_slot[:, None])[:, 0]
    equal = (next_slot == ref_next).float().mean().item()
    within = (free_first & (chosen <= best * (1 + tie) + 1e-12)).all().item()
    ok = out_err < 3e-2 and within
    return (f"{name}: output max error {out_err:.2e}, next slot equal in {equal:.1%} of rows, "
            f"{'all' if within else 'NOT all'} within {tie:.0%} of the minimum score: {'ok' if ok else 'FAILED'}")


# The configurations `main` times: (block_n, stages), each with the fused argmin unless named otherwise.
TIMED = {f"compact{block_n}_s{stages}": dict(block_n=block_n, stages=stages)
         for block_n, stages in ((64, 2), (64, 3), (32, 2), (32, 3), (32, 4))}
TIMED["compact64_s2_row_launch"] = dict(stages=2, fused_argmin=False)
TIMED["no_score64_s2"] = dict(stages=2, score=False, compact=False)


def compile_sm90(slots: int, block_n: int = 64, stages: int = 3, score: bool = True, compact: bool = True,
                 fused_argmin: bool = True, batch: int = 128) -> int:
    """The pass compiled for sm_90 at Qwen3-8B's head shapes, as a launch would specialise it; its
    shared memory in bytes. Needs TRITON_INTERPRET=0 before this module is imported."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from evals.bench.aot import TARGET

    pointers = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "VALID": "*u8", "OUT": "*bf16", "PART": "*fp32",
                "ARRIVED": "*i32", "NEXT": "*i64"}
    constexprs = dict(KV_HEADS=8, GROUP=4, HEAD_DIM=128, BLOCK_N=block_n, STAGES=stages,
                      MAX_TILES=triton.cdiv(slots, block_n), SCORE=score, COMPACT=compact,
                      FUSED_ARGMIN=score and fused_argmin, NUM_WARPS=4)
    signature = pointers | {"n_slots": "i32", "qk_scale": "fp32"} | {name: "constexpr" for name in constexprs}
    aligned = {(index,): [["tt.divisibility", 16]] for index in range(len(pointers) + 1)}  # and n_slots
    source = GluonASTSource(fn=_onchip_pass, signature=signature, constexprs=constexprs, attrs=aligned)
    return triton.compile(source, target=TARGET, options={"num_warps": 4}).metadata.shared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile", action="store_true",
                        help="compile every timed configuration for sm_90 and print its shared memory (JSON)")
    parser.add_argument("--batches", type=int, nargs="+", default=[128, 64, 16])
    parser.add_argument("--slots", type=int, nargs="+", default=[3200, 1024, 8192])
    args = parser.parse_args()
    if args.compile:
        from evals.bench.aot import SHARED_BYTES

        for slots in args.slots:
            for name, options in TIMED.items():
                shared = compile_sm90(slots, **options)
                print(json.dumps({"slots": slots, "name": name, "shared": shared, "fits": shared <= SHARED_BYTES}))
        return
    from evals.bench.attention import HEAD_DIM, cache_sets, interleaved_ms, method_calls
    from evals.bench.common import require_cuda

    require_cuda("evals.bench.onchip_scratch")
    device = torch.device("cuda")
    checks = [dict(), dict(block_n=32), dict(compact=False), dict(fused_argmin=False)]
    for batch in args.batches:
        for slots in args.slots:
            for options in checks:
                print(check(batch, slots, device, **options), flush=True)
    scale = HEAD_DIM**-0.5
    for batch in args.batches:
        for slots in args.slots:
            sets = cache_sets(batch, slots, device)
            methods = {name: [method_calls(name, *s)[0] for s in sets]
                       for name in ("sdpa_cudnn", "flash_decode", "longflow_fused")}
            for name, options in TIMED.items():
                calls = [onchip_call(*s, scale, **options) for s in sets]
                try:  # a configuration over the shared memory a program may take fails at launch
                    calls[0]()
                    torch.cuda.synchronize()
                except OutOfResources:
                    print(f"batch {batch}, {slots} slots, {name}: out of shared memory", flush=True)
                    continue
                methods[name] = calls
            times = interleaved_ms(methods)
            cudnn = times["sdpa_cudnn"]
            print(f"batch {batch:>3}, {slots:>4} slots: cuDNN {cudnn:.4f} ms; x cuDNN: "
                  + ", ".join(f"{name} {ms / cudnn:.3f}" for name, ms in times.items() if name != "sdpa_cudnn"),
                  flush=True)


if __name__ == "__main__":
    from evals.bench.common import run

    run(main)
