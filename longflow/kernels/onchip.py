"""LongFlow's decode attention with its score scratch on chip: a Gluon attention pass and a row argmin.

The fused call of `longflow.kernels.longflow_attention` writes every slot's logits to a scratch in
global memory inside its pipelined loop, and a second launch reads them back once the softmax
statistics are final; that write stream keeps the call 7-13% above cuDNN's decode attention from
batch 16 on, on an H100 (docs/engine.md, "Issue 27's targets"). Triton keeps no shared memory past a
loop, so this pass is written in Gluon (Triton's lower-level language; it has no interpreter and runs
on a GPU only):

1. `_onchip_pass_kernel`, grid `(B * Hkv,)`: one program per KV head over all of the row's slots (no
   split), K/V through a ring of `stages` asynchronous copies, the products on the tensor cores (16
   rows, the G = 4 query heads and padding). LongFlow's `t = logit * log2(e) + log2 ||v_j||_1` of the
   G real rows stays in shared memory, as fp16 relative to each tile's running maximum (fp32 maxima
   beside it): 8 bytes a slot. After its loop the program knows its heads' final softmax statistics
   and writes one partial score a slot, `sum_h p_hj ||v_j||_1` over its G heads, to `[B, Hkv, S]`.
2. `_onchip_argmin_kernel`, grid `(B,)`: the KV heads' partials summed in head order and the shared
   selection rule (`longflow.selection.choose_next`: the lowest free slot, else the unprotected valid
   slot of lowest score, ties to the lowest index), written to every KV head's next slot.

Where its programs fill the GPU's resident places in nearly whole waves it is faster than the Triton
call: in `make fig1`'s grid on an H100 1.03-1.08x cuDNN at batch 64 and 128, where the Triton call was
1.07-1.12x; in a sweep on an H200 1.07-1.17x wherever `tiling` takes it, the Triton call 1.11-1.32x
there. With one program a multiprocessor, too few bytes in flight for the card, or a part-empty last
wave it is slower (longflow/kernels/NOTES.md, "The scratch on chip", "Which tile, on which card").
`default_config` asks for it (`LaunchConfig.onchip`) where `tiling` expects it faster. What it
covers: LongFlow's score with one selection a row, 16-bit K/V with the head dim contiguous, head dim
128, G = 4 (the compact rows are taken out of the MMA's tile by in-thread reshapes for that G), up to
8192 slots (the scratch's shared memory).

Notation: B batch, Hq query heads, Hkv KV heads, G = Hq / Hkv, S slots, D head dim.
"""

from __future__ import annotations

import functools
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # `_onchip_argmin_kernel` on a CPU, as the others

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2  # noqa: E402

from longflow.kernels.longflow_attention import LOG2E, _mask_strides  # noqa: E402
from longflow.kernels.occupancy import GPU, SM90, WAVE_FILL, programs_per_sm, wave_fill  # noqa: E402
from longflow.kernels.reductions import reduce_min, reduce_sum  # noqa: E402

MAX_SLOTS = 8192  # the compact scratch and two stages of 32-slot tiles: two programs a multiprocessor
GROUP = 4
HEAD_DIM = 128
# Gluon's names as Triton 3.6 (the GPU image's) has them, or as later Tritons renamed them.
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
ROWS = gl.constexpr(16)  # the MMA's rows: a KV head's G query heads, zero-padded


@gluon.jit
def _onchip_pass_kernel(
    Q, K, V, VALID, OUT, PART,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_valid_b, stride_valid_h, stride_valid_s,
    n_slots, qk_scale,
    KV_HEADS: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, MAX_TILES: gl.constexpr, SCORE: gl.constexpr, NUM_WARPS: gl.constexpr,
):
    """Program b * Hkv + kv_head: the attention of its G heads over all slots into OUT `[B, Hq, D]`;
    with SCORE, their partial LongFlow score `sum_h p_hj ||v_j||_1` into PART `[B, Hkv, S]`."""
    gl.static_assert(GROUP == 4, "the compact scratch takes rows 0-3 of the MMA's tile")
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NUM_WARPS], instr_shape=[16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    io: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NUM_WARPS, 1], [1, 0])  # 16-byte vectors along D
    # A slot's 16 rows in one thread, so that rows 0-3 come out of a tile by reshapes and in-thread splits.
    column: gl.constexpr = gl.BlockedLayout([16, 1], [1, 32], [1, NUM_WARPS], [0, 1])
    walk: gl.constexpr = gl.BlockedLayout([1, 2], [4, 8], [1, NUM_WARPS], [1, 0])  # [G, BLOCK_N]
    kv_shared: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
    t_shared: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    r_shared: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

    pid = gl.program_id(0)
    b = (pid // KV_HEADS).to(gl.int64)
    kv_head = pid % KV_HEADS

    offs_row_io = gl.arange(0, ROWS, layout=gl.SliceLayout(1, io))
    offs_n_io = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, io))
    offs_d_io = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io))
    row_ok_io = (offs_row_io < GROUP)[:, None] & (offs_d_io < HEAD_DIM)[None, :]
    q_heads = kv_head * GROUP + offs_row_io
    q = gl.load(Q + b * stride_qb + q_heads[:, None] * stride_qh + offs_d_io[None, :], mask=row_ok_io, other=0.0)
    q = gl.convert_layout(q, a_op)

    k_tile = K + b * stride_kb + kv_head * stride_kh + offs_n_io[:, None] * stride_ks + offs_d_io[None, :]
    v_tile = V + b * stride_vb + kv_head * stride_vh + offs_n_io[:, None] * stride_vs + offs_d_io[None, :]
    d_all = (offs_d_io < HEAD_DIM)[None, :]
    k_smem = gl.allocate_shared_memory(K.dtype.element_ty, [STAGES, BLOCK_N, HEAD_DIM], kv_shared)
    v_smem = gl.allocate_shared_memory(V.dtype.element_ty, [STAGES, BLOCK_N, HEAD_DIM], kv_shared)
    n_tiles = gl.cdiv(n_slots, BLOCK_N)
    for i in gl.static_range(STAGES - 1):
        in_range = ((i * BLOCK_N + offs_n_io) < n_slots)[:, None] & d_all
        _async_load(k_smem.index(i), k_tile + i * BLOCK_N * stride_ks, mask=in_range)
        _async_load(v_smem.index(i), v_tile + i * BLOCK_N * stride_vs, mask=in_range)
        async_copy.commit_group()

    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, mma))
    l_i = gl.full([ROWS], 0.0, gl.float32, layout=gl.SliceLayout(1, mma))
    acc = gl.full([ROWS, HEAD_DIM], 0.0, gl.float32, layout=mma)
    zero_s = gl.full([ROWS, BLOCK_N], 0.0, gl.float32, layout=mma)
    ones = gl.full([ROWS, HEAD_DIM], 1.0, K.dtype.element_ty, layout=a_op)
    offs_n_mma = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
    valid_row = VALID + b * stride_valid_b + kv_head * stride_valid_h
    if SCORE:  # the scratch: rows 0-3 as fp16 relative to each tile's running maximum, and those maxima
        t_smem = gl.allocate_shared_memory(gl.float16, [MAX_TILES, GROUP, BLOCK_N], t_shared)
        r_smem = gl.allocate_shared_memory(gl.float32, [MAX_TILES, GROUP], r_shared)
    # The mask one tile ahead: a byte a slot is below an asynchronous copy's 4 bytes.
    ok_next = gl.load(valid_row + offs_n_mma * stride_valid_s, mask=offs_n_mma < n_slots, other=0)
    for tile in range(n_tiles):
        start = tile * BLOCK_N
        ok = (ok_next != 0) & (start + offs_n_mma < n_slots)
        following = start + BLOCK_N + offs_n_mma
        ok_next = gl.load(valid_row + following * stride_valid_s, mask=following < n_slots, other=0)
        async_copy.wait_group(STAGES - 2)
        _barrier()  # every thread's copies of this tile landed; the stage refilled below was read
        ahead = tile + STAGES - 1
        in_range = ((ahead * BLOCK_N + offs_n_io) < n_slots)[:, None] & d_all
        _async_load(k_smem.index(ahead % STAGES), k_tile + ahead * BLOCK_N * stride_ks, mask=in_range)
        _async_load(v_smem.index(ahead % STAGES), v_tile + ahead * BLOCK_N * stride_vs, mask=in_range)
        async_copy.commit_group()

        stage = tile % STAGES
        s = mma_v2(q, k_smem.index(stage).permute((1, 0)).load(b_op), zero_s)  # [ROWS, BLOCK_N]
        s = gl.where(ok[None, :], s * qk_scale, float("-inf"))
        # Online softmax; `m_use` stays finite so that fully masked tiles give 0, never NaN.
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        v = v_smem.index(stage).load(b_op)  # [BLOCK_N, D]
        acc = mma_v2(gl.convert_layout(p.to(v.dtype), a_op), v, acc * alpha[:, None])
        m_i = m_new
        if SCORE:
            # ||v_j||_1 on the tensor cores, ones @ |v|^T, in the logits' layout (rows equal); its
            # log2 the multi-function unit's, as the Triton pass's 16-bit path.
            vnorm = mma_v2(ones, gl.abs(v_smem.index(stage).permute((1, 0)).load(b_op)), zero_s)
            log_vnorm = gl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [gl.maximum(vnorm, 1e-30)],
                                                  dtype=gl.float32, is_pure=True, pack=1)
            t_smem.index(tile).store(_first_rows(s - m_use[:, None] + log_vnorm, column, BLOCK_N))
            r_smem.index(tile).store(_first_four(m_use, gl.BlockedLayout([1], [32], [NUM_WARPS], [0]), NUM_WARPS))
    async_copy.wait_group(0)

    l_safe = gl.where(l_i > 0, l_i, 1.0)
    out = gl.convert_layout((acc / l_safe[:, None]).to(OUT.dtype.element_ty), io)
    gl.store(OUT + (b * (KV_HEADS * GROUP) + q_heads)[:, None] * HEAD_DIM + offs_d_io[None, :], out, mask=row_ok_io)

    if SCORE:
        _barrier()  # every thread's scratch before the walk reads it
        m_fin = _first_four(gl.where(m_i == float("-inf"), 0.0, m_i), gl.SliceLayout(1, walk), NUM_WARPS)
        inv_l = _first_four(gl.where(l_i > 0, 1.0 / l_safe, 0.0), gl.SliceLayout(1, walk), NUM_WARPS)
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, walk))
        part_row = PART + (b * KV_HEADS + kv_head) * n_slots
        for tile in range(n_tiles):
            t = t_smem.index(tile).load(walk).to(gl.float32)  # [G, BLOCK_N]
            reference = r_smem.index(tile).load(gl.SliceLayout(1, walk))
            part = gl.sum(gl.exp2(t + (reference - m_fin)[:, None]) * inv_l[:, None], axis=0)
            slots = tile * BLOCK_N + offs_n
            gl.store(part_row + slots, part, mask=slots < n_slots)


@gluon.jit
def _first_rows(x, column: gl.constexpr, BLOCK_N: gl.constexpr):
    """Rows 0-3 of a `[16, BLOCK_N]` tile as fp16: row r = 8 i1 + 4 i0 + j, all in one thread after
    the conversion, so that i1 = i0 = 0 are two in-thread splits."""
    x = gl.reshape(gl.convert_layout(x.to(gl.float16), column), [2, 2, 4, BLOCK_N])
    x = gl.permute(x, [2, 3, 1, 0])  # [j, n, i0, i1]
    x, _ = gl.split(x)
    x, _ = gl.split(x)
    return x


@gluon.jit
def _first_four(x, layout: gl.constexpr, NUM_WARPS: gl.constexpr):
    """Elements 0-3 of a `[16]` vector, in `layout` (as `_first_rows`)."""
    x = gl.convert_layout(x, gl.BlockedLayout([16], [32], [NUM_WARPS], [0]))
    x = gl.permute(gl.reshape(x, [2, 2, 4]), [2, 1, 0])  # [j, i0, i1]
    x, _ = gl.split(x)
    x, _ = gl.split(x)
    return gl.convert_layout(x, layout)


@triton.jit
def _onchip_argmin_kernel(
    PART, VALID, PROTECT, NEXT_SLOT,
    stride_valid_b, stride_valid_s, stride_protect_b, stride_protect_s, stride_next_b, stride_next_h,
    n_slots,
    KV_HEADS: tl.constexpr, KV_HEADS_PAD: tl.constexpr, WRITE_HEADS: tl.constexpr, WRITE_HEADS_PAD: tl.constexpr,
    HAS_PROTECT: tl.constexpr, BLOCK: tl.constexpr,
):
    """Program b: row b's score (its KV heads' partials `[B, Hkv, S]` summed in head order) and the
    shared selection rule over head 0's masks, into the WRITE_HEADS columns of row b's next slot."""
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    offs_h = tl.arange(0, KV_HEADS_PAD)
    part_rows = PART + (b * KV_HEADS + offs_h)[:, None] * n_slots  # [KV_HEADS_PAD, 1]
    best_key = tl.full([BLOCK], float("inf"), tl.float32)
    best_idx = tl.full([BLOCK], 0, tl.int32)
    for start in range(0, n_slots, BLOCK):
        slots = start + offs
        in_range = slots < n_slots
        partials = tl.load(part_rows + slots[None, :], mask=(offs_h < KV_HEADS)[:, None] & in_range[None, :],
                           other=0.0)
        ok = tl.load(VALID + b * stride_valid_b + slots * stride_valid_s, mask=in_range, other=0) != 0
        key = tl.where(ok, reduce_sum(partials, 0), -1.0)  # free slots first: scores are >= 0
        if HAS_PROTECT:
            protected = tl.load(PROTECT + b * stride_protect_b + slots * stride_protect_s, mask=in_range, other=0)
            key = tl.where(ok & (protected != 0), float("inf"), key)
        key = tl.where(in_range, key, float("inf"))
        better = key < best_key  # strict: each lane keeps its earliest slot among ties
        best_key = tl.where(better, key, best_key)
        best_idx = tl.where(better, slots, best_idx)
    key_min = reduce_min(best_key, 0)
    chosen = reduce_min(tl.where(best_key == key_min, best_idx, 2147483647), 0).to(tl.int64)
    offs_w = tl.arange(0, WRITE_HEADS_PAD)
    tl.store(NEXT_SLOT + b * stride_next_b + offs_w * stride_next_h, chosen + tl.full([WRITE_HEADS_PAD], 0, tl.int64),
             mask=offs_w < WRITE_HEADS)


# The compiled pass's registers a thread at 4 warps, by slots a tile (Triton 3.6 for sm_90, the GPU
# image's; `tests/test_bench_sass_loop.py` holds them to its cubin).
REGISTERS = {32: 136, 64: 176}
# The bytes one multiprocessor's programs have in flight (the stage being copied, K and V) must cover
# its share of the memory bandwidth for this long. Fitted to the sweeps of both cards
# (longflow/kernels/NOTES.md, "Which tile, on which card"): 32 KB in flight keeps an H100's 25 GB/s a
# multiprocessor fed (1.04-1.07x cuDNN at 8192 slots) but not an H200's 36 (1.28x); 48 KB does.
LATENCY_S = 1.1e-6
PIPELINE_STAGES = 2  # at each of the 12 points of the first sweep the best tiling had two


def shared_bytes(block_n: int, stages: int, slots: int) -> int:
    """The pass's shared memory with the score: the K/V stages, the fp16 scratch of G rows and each
    tile's G maxima, and the layout conversions' buffer (the compiler's count, to the byte, at sm_90)."""
    tiles = triton.cdiv(slots, block_n)
    return stages * 2 * block_n * HEAD_DIM * 2 + tiles * (block_n * GROUP * 2 + GROUP * 4) + block_n * 32


def fits(block_n: int, stages: int, slots: int, on: GPU = SM90) -> bool:
    """Whether one program of the pass at this tiling gets its shared memory on `on`."""
    return shared_bytes(block_n, stages, slots) <= on.shared_per_program


def resident_programs(block_n: int, stages: int, slots: int, on: GPU = SM90) -> int:
    """Programs of the pass (4 warps) one multiprocessor of `on` holds at once (0: none fits)."""
    return min(programs_per_sm(REGISTERS[block_n], shared_bytes(block_n, stages, slots), 4, on).values())


def tiling(programs: int, slots: int, on: GPU) -> tuple[int, int] | None:
    """(slots a tile, stages) for the pass at `programs` = B * Hkv over `slots` on the GPU `on`; None
    where the Triton call is expected faster (or no tiling fits the GPU's shared memory).

    The pass has one program per (row, KV head), each over all of its row's slots, so it needs: at
    least two resident programs a multiprocessor (with one nothing hides the score's walk: 1.11-1.18x
    cuDNN at batch 16); enough bytes in flight for the card (`LATENCY_S`); and a last wave nearly full
    (at batch 48, 384 programs in two waves of 264 took 1.34-1.37x on an H200, in one of 396
    1.11-1.17x). 64-slot tiles first: they keep more bytes in flight."""
    for block_n in (64, 32):
        resident = resident_programs(block_n, PIPELINE_STAGES, slots, on)
        in_flight = resident * (PIPELINE_STAGES - 1) * 2 * block_n * HEAD_DIM * 2
        if resident < 2 or in_flight < on.bandwidth / on.multiprocessors * LATENCY_S:
            continue
        if wave_fill(programs, resident * on.multiprocessors) >= WAVE_FILL:
            return block_n, PIPELINE_STAGES
    return None


@functools.cache  # asked per layer and step when not under a CUDA graph
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the on-chip pass cannot take these inputs, or None."""
    batch, q_heads, head_dim = q.shape
    kv_heads, slots = k.shape[1], k.shape[2]
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"it takes 16-bit inputs, not {q.dtype}"
    if head_dim != HEAD_DIM or q_heads != GROUP * kv_heads:
        return (f"it takes head dim {HEAD_DIM} and {GROUP} query heads a KV head, not {head_dim} and "
                f"{q_heads / kv_heads:g}")
    if slots > MAX_SLOTS:
        return f"its scratch holds at most {MAX_SLOTS} slots, not {slots}"
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        # 16-byte asynchronous copies: contiguous head dims and rows the compiler knows to be aligned,
        # which it learns from strides that Triton's launch marks divisible by 16 (elements).
        if tensor.stride(-1) != 1 or tensor.data_ptr() % 16 or any(s % 16 for s in tensor.stride()[:-1]):
            return f"{name} needs a contiguous head dim and strides that are multiples of 16"
    if q.device.type == "cuda" and _capability(q.device) < (8, 0):
        return "it needs an sm_80 or newer GPU"
    return None


def onchip_attention(q, k, v, valid, next_slot, scale: float, protect=None, *, score: bool = True,
                     block_n: int = 64, stages: int = PIPELINE_STAGES, warps: int = 4) -> torch.Tensor:
    """LongFlow's decode attention and next slot, the scratch on chip (inputs as `scored_attention`'s
    with `score="longflow"`, checked by the caller, and `unsupported` None; next_slot `[B, W]`, each of
    its W columns written the row's slot). `score` False: the pass
    alone, without the score or the next slot (the benchmark's reference of its pace). `block_n`
    slots a tile, `stages` K/V copies in the ring, `warps` a program (`tiling` picks the first two).
    Returns out `[B, Hq, D]`; next_slot is written in place."""
    batch, q_heads, head_dim = q.shape
    kv_heads, slots = k.shape[1], k.shape[2]
    out = torch.empty(batch, q_heads, head_dim, dtype=q.dtype, device=q.device)
    # The partial scores; without the score the pointer is never touched.
    part = torch.empty(batch, kv_heads, slots, dtype=torch.float32, device=q.device) if score else out
    valid_u8 = valid.view(torch.uint8)
    valid_strides = _mask_strides(valid_u8)
    _onchip_pass_kernel[(batch * kv_heads,)](
        q, k, v, valid_u8, out, part, *q.stride()[:2], *k.stride()[:3], *v.stride()[:3], *valid_strides,
        slots, scale * LOG2E,
        KV_HEADS=kv_heads, GROUP=GROUP, HEAD_DIM=HEAD_DIM, BLOCK_N=block_n, STAGES=stages,
        MAX_TILES=triton.cdiv(slots, block_n), SCORE=score, NUM_WARPS=warps, num_warps=warps,
    )
    if not score:
        return out
    # The selection reads head 0's masks: the masks' own (batch, slot) strides from their start.
    protect_u8 = protect.view(torch.uint8) if protect is not None else valid_u8
    protect_strides = _mask_strides(protect_u8)
    _onchip_argmin_kernel[(batch,)](
        part, valid_u8, protect_u8, next_slot, valid_strides[0], valid_strides[2], protect_strides[0],
        protect_strides[2], *next_slot.stride(), slots,
        KV_HEADS=kv_heads, KV_HEADS_PAD=triton.next_power_of_2(kv_heads), WRITE_HEADS=next_slot.shape[1],
        WRITE_HEADS_PAD=max(2, triton.next_power_of_2(next_slot.shape[1])), HAS_PROTECT=protect is not None,
        BLOCK=1024, num_warps=8,
    )
    return out
