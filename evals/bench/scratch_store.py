"""What a scratch store costs the single-split decode attention pass, and whether TMA loads help it.

    python -m evals.bench.scratch_store     # batch 64 and 128, 3200 and 8192 slots, Qwen3-8B shapes

A stand-alone copy of the attention pass's loop (`longflow.kernels.longflow_attention._partial_kernel`
at one split: one program per (row, KV head), online softmax over 64-slot tiles, the mask one tile
ahead) whose only switch is what it writes per tile besides the output (`STORE`):
  0: nothing (`flash_decode`'s pass);
  1: the tile's logits to a `[B * Hq, S]` float32 scratch, masked to the G real query heads
     (the score epilogues' layout);
  2: the same with `evict_last` (the kernel's L2 hint);
  3: the same bytes in a `[B * Hkv, S, G]` layout (each slot's G logits contiguous);
  4: `[B * Hq, S]` in float16 (half the bytes);
  5: as 1, each thread storing its own elements of the tensor-core result (inline PTX), with no
     conversion to a coalescing layout through shared memory first (`tl.store` makes one, with a
     barrier, in every iteration: longflow/kernels/NOTES.md). On the H200 it is no faster than 1
     (results/engine/scratch_store.txt): the conversion is not what the store costs;
  6: LongFlow's whole call with the score folded into the pass in its cheaper form: the scratch holds
     logit + log2 ||v||_1 (`ones @ |v|^T`, as the kernel's), and after its loop each program reads
     its own scratch back (just written, so from L2), scales it by the final softmax statistics and
     sums its G heads into a `[B * Hkv, S]` partial; a second launch, one program per row, sums the
     Hkv partials and takes the argmin (free slots first), reading 1/G of what the kernel's score
     launch reads (longflow/kernels/NOTES.md, "The cheaper fold"). On the
     H200 it is 1.53-2.00x cuDNN where the fused call is 1.13-1.15x
     (results/engine/scratch_store_fold.txt): the epilogue after the loop is not hidden;
  7: as 1, through a tensor descriptor: one bulk (TMA) store of the tile from shared memory, issued
     asynchronously, where `tl.store` has every thread store its elements; the descriptor's
     `[B * Hkv, G, S]` bounds clip the padding heads and the slots past the last;
and whether K and V come through tensor descriptors (TMA) instead of pointer loads. Each variant is
timed in CUDA graphs over input sets that overflow L2 (`evals.bench.attention`'s timing), next to
cuDNN SDPA and `flash_decode` in the same process. Needs a CUDA GPU.

    python -m evals.bench.scratch_store --fold   # store 6 against the fused call and cuDNN, in turns
    python -m evals.bench.scratch_store --stores 0 1 7   # only these store modes' variants
"""

from __future__ import annotations

import argparse
import os

import torch

if not torch.cuda.is_available():
    # The tests run these kernels through the interpreter, whose switch is read when a kernel is defined
    # (longflow/kernels/reductions.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from evals.bench.attention import (  # noqa: E402
    cache_sets,
    copy_bandwidth,
    floor_bytes,
    graph_ms,
    interleaved_ms,
    method_calls,
)
from longflow.kernels.longflow_attention import LOG2E  # noqa: E402
from longflow.kernels.reductions import reduce_max, reduce_min, reduce_sum  # noqa: E402

GROUP_PAD = 16  # a KV head's query heads, padded to the rows of a tensor-core tile
# (slots per tile, TMA loads, pipeline stages, warps, store mode): the kernel's own setting first.
VARIANTS = [(64, False, 4, 4, store) for store in range(5)] + [(64, True, 4, 4, 0), (64, True, 4, 4, 1),
                                                                (128, False, 3, 4, 1), (128, False, 3, 4, 3),
                                                                (64, False, 4, 4, 5), (128, False, 3, 4, 5),
                                                                (64, False, 4, 4, 7), (64, True, 4, 4, 7)]


@triton.jit
def _store_in_place(addresses, values, mask):
    """`tl.store` of float32 `values` at `addresses` (pointers as int64) where `mask`, from whatever
    layout `values` has: each thread stores its own elements (inline PTX, elementwise), where
    `tl.store` would first convert a tensor-core result to a coalescing layout through shared memory."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.f32 [$1], $2; mov.b32 $0, 0; }",
        "=r,l,f,r", [addresses, values, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _pass_kernel(Q, K, V, K_DESC, V_DESC, SCRATCH_DESC, VALID, OUT, SCRATCH, PARTIAL, slots, qk_scale,
                 KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_N: tl.constexpr, TMA: tl.constexpr, STAGES: tl.constexpr, STORE: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // KV_HEADS
    kv_head = pid % KV_HEADS
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    g_ok = offs_g < GROUP
    rows = b * (KV_HEADS * GROUP) + kv_head * GROUP + offs_g
    q = tl.load(Q + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=g_ok[:, None], other=0.0)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.full([GROUP_PAD], 0.0, tl.float32)
    acc = tl.full([GROUP_PAD, HEAD_DIM], 0.0, tl.float32)
    valid_row = VALID + b.to(tl.int64) * slots
    head = b.to(tl.int64) * KV_HEADS + kv_head
    scratch_rows = SCRATCH + rows.to(tl.int64)[:, None] * slots  # this program's G rows of the scratch
    ok_next = tl.load(valid_row + offs_n, mask=offs_n < slots, other=0)
    for start in tl.range(0, slots, BLOCK_N, num_stages=STAGES):
        cols = start + offs_n
        s_ok = cols < slots
        ok = (ok_next != 0) & s_ok
        ok_next = tl.load(valid_row + cols + BLOCK_N, mask=(cols + BLOCK_N) < slots, other=0)
        if TMA:
            k = K_DESC.load([b, kv_head, start, 0]).reshape(BLOCK_N, HEAD_DIM)
            v = V_DESC.load([b, kv_head, start, 0]).reshape(BLOCK_N, HEAD_DIM)
        else:
            kv = head * slots * HEAD_DIM + cols[:, None] * HEAD_DIM + offs_d[None, :]
            k = tl.load(K + kv, mask=s_ok[:, None], other=0.0, eviction_policy="evict_first")
            v = tl.load(V + kv, mask=s_ok[:, None], other=0.0, eviction_policy="evict_first")
        s = tl.where(ok[None, :], tl.dot(q, tl.trans(k)) * qk_scale, float("-inf"))  # [GROUP_PAD, BLOCK_N]
        t_mask = g_ok[:, None] & s_ok[None, :]
        by_head = scratch_rows + cols[None, :]
        if STORE == 1:
            tl.store(by_head, s, mask=t_mask)
        elif STORE == 2:
            tl.store(by_head, s, mask=t_mask, eviction_policy="evict_last")
        elif STORE == 3:
            tl.store(SCRATCH + (head * slots + cols[None, :]) * GROUP + offs_g[:, None], s, mask=t_mask)
        elif STORE == 4:
            tl.store(by_head, s.to(tl.float16), mask=t_mask)
        elif STORE == 5:
            _store_in_place(by_head.to(tl.int64), s, t_mask)
        elif STORE == 7:
            # The padding heads (G to GROUP_PAD) and the slots past the last fall outside the
            # descriptor's [B * Hkv, G, S] bounds, which the bulk store clips.
            SCRATCH_DESC.store([head.to(tl.int32), 0, start], s.reshape(1, GROUP_PAD, BLOCK_N))
        elif STORE == 6:
            ones = tl.full([GROUP_PAD, HEAD_DIM], 1.0, v.dtype)
            log_vnorm = tl.log2(tl.maximum(tl.dot(ones, tl.trans(tl.abs(v))), 1e-30))  # rows equal
            tl.store(by_head, s + log_vnorm, mask=t_mask, eviction_policy="evict_last")
        m_new = tl.maximum(m_i, reduce_max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + reduce_sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(OUT + rows[:, None] * HEAD_DIM + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=g_ok[:, None])
    if STORE == 6:
        # The program's own scratch, stored by its threads above: the barrier makes their global
        # stores visible to the whole program (as `compact_in_place` relies on), `.cg` reads at L2.
        tl.debug_barrier()
        m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
        inv_l = tl.where(g_ok & (l_i > 0), 1.0 / l_i, 0.0)
        for start in tl.range(0, slots, BLOCK_N):
            cols = start + offs_n
            t = tl.load(scratch_rows + cols[None, :], mask=g_ok[:, None] & (cols < slots)[None, :],
                        other=float("-inf"), cache_modifier=".cg")
            partial = reduce_sum(tl.exp2(t - m_use[:, None]) * inv_l[:, None], 0)  # p_hj ||v_j||_1 over G
            tl.store(PARTIAL + head * slots + cols, partial, mask=cols < slots)


@triton.jit
def _row_argmin_kernel(PARTIAL, VALID, NEXT_SLOT, slots, KV_HEADS: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per row: the LongFlow score of every slot (the sum of the row's Hkv partials),
    and the slot to overwrite, the first free one if any, else the lowest score (earliest on ties):
    `longflow.selection.choose_next`'s rule, as the kernel's score pass keys it (free -1, out of
    range +inf); the kernel's own pass cannot serve, its reads are of the `[B * Hq, S]` scratch."""
    b = tl.program_id(0)
    partial_rows = PARTIAL + (b * KV_HEADS + tl.arange(0, KV_HEADS)).to(tl.int64)[:, None] * slots
    offs_n = tl.arange(0, BLOCK_N)
    best_key = tl.full([BLOCK_N], float("inf"), tl.float32)
    best_idx = tl.full([BLOCK_N], 2147483647, tl.int32)
    for start in tl.range(0, slots, BLOCK_N):
        cols = start + offs_n
        s_ok = cols < slots
        score = reduce_sum(tl.load(partial_rows + cols[None, :], mask=s_ok[None, :], other=0.0), 0)
        ok = tl.load(VALID + b.to(tl.int64) * slots + cols, mask=s_ok, other=0) != 0
        key = tl.where(s_ok, tl.where(ok, score, -1.0), float("inf"))
        better = key < best_key
        best_key = tl.where(better, key, best_key)
        best_idx = tl.where(better, cols, best_idx)
    key_min = reduce_min(best_key, 0)
    tl.store(NEXT_SLOT + b, reduce_min(tl.where(best_key == key_min, best_idx, 2147483647), 0).to(tl.int64))


def pass_call(q, k, v, valid, block_n: int, tma: bool, stages: int, warps: int, store: int):
    """The pass over q `[B, Hq, D]`, contiguous k, v `[B, Hkv, S, D]` and valid `[B, S]`, as a
    zero-argument call returning out `[B, Hq, D]`; its scratch, allocated once, is the call's
    `scratch` attribute."""
    batch, q_heads, head_dim = q.shape
    _, kv_heads, slots, _ = k.shape
    out = torch.empty_like(q)
    scratch = torch.empty(batch * q_heads * slots, dtype=torch.float16 if store == 4 else torch.float32,
                          device=q.device)
    partial = torch.empty(batch * kv_heads * slots if store == 6 else 1, dtype=torch.float32, device=q.device)
    next_slot = torch.empty(batch, dtype=torch.int64, device=q.device)
    k_desc = TensorDescriptor.from_tensor(k, [1, 1, block_n, head_dim])
    scratch_desc = TensorDescriptor.from_tensor(scratch.view(batch * kv_heads, q_heads // kv_heads, slots),
                                                [1, GROUP_PAD, block_n]) if store == 7 else None
    v_desc = TensorDescriptor.from_tensor(v, [1, 1, block_n, head_dim])

    def run():
        _pass_kernel[(batch * kv_heads,)](
            q, k, v, k_desc, v_desc, scratch_desc, valid, out, scratch, partial, slots, head_dim**-0.5 * LOG2E,
            KV_HEADS=kv_heads, GROUP=q_heads // kv_heads, GROUP_PAD=GROUP_PAD, HEAD_DIM=head_dim, BLOCK_N=block_n,
            TMA=tma, STAGES=stages, STORE=store, num_warps=warps, num_stages=stages)
        if store == 6:
            _row_argmin_kernel[(batch,)](partial, valid, next_slot, slots, KV_HEADS=kv_heads, BLOCK_N=256)
        return out
    run.scratch, run.partial, run.next_slot = scratch, partial, next_slot
    return run


# Store 6's settings: the kernel's tile and stages at one split, and 3 stages for two programs an SM.
FOLD_VARIANTS = [(64, 4), (64, 3)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fold", action="store_true", help="store 6 against the fused call and cuDNN only")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--slots", type=int, nargs="+", default=[3200, 8192])
    parser.add_argument("--stores", type=int, nargs="+", default=sorted({v[-1] for v in VARIANTS}),
                        help="the store modes whose variants are timed (without --fold)")
    args = parser.parse_args(argv)
    unknown = set(args.stores) - {variant[-1] for variant in VARIANTS}
    if unknown:
        parser.error(f"--stores: no variant stores {sorted(unknown)}")
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s")
    for batch in args.batches:
        for slots in args.slots:
            sets = cache_sets(batch, slots, device)
            floor = floor_bytes(batch, slots) / bandwidth * 1e3
            if args.fold:
                fold_point(sets, batch, slots, floor)
            else:
                store_point(sets, batch, slots, floor, [v for v in VARIANTS if v[-1] in args.stores])
            del sets
            torch.cuda.empty_cache()


def fold_point(sets, batch: int, slots: int, floor: float) -> None:
    """Store 6 (pass, in-program partials, row argmin) against cuDNN and the fused call, timed in turns;
    its chosen slots against the fused call's on the first set with every slot valid."""
    methods = {"cuDNN": [method_calls("sdpa_cudnn", *s)[0] for s in sets],
               "fused": [method_calls("longflow_fused", *s)[0] for s in sets]}
    folds = {f"fold {block_n}/{stages}": (block_n, stages) for block_n, stages in FOLD_VARIANTS}
    for name, (block_n, stages) in folds.items():
        methods[name] = [pass_call(*s, block_n, False, stages, 4, 6) for s in sets]
    ms = interleaved_ms(methods)
    q, k, v, valid = sets[0]
    full = torch.ones_like(valid)
    _, want = method_calls("longflow_fused", q, k, v, full)[0]()
    line = f"batch {batch}, {slots} slots: floor {floor:.4f} ms, cuDNN {ms['cuDNN']:.4f} ms"
    for name, value in ms.items():
        if name == "cuDNN":
            continue
        agree = ""
        if name in folds:
            block_n, stages = folds[name]
            call = pass_call(q, k, v, full, block_n, False, stages, 4, 6)
            call()
            agree = f", slots as the fused call's: {(call.next_slot == want).float().mean().item():.3f}"
        line += f"\n  {name}: {value:.4f} ms, {value / ms['cuDNN']:.3f}x cuDNN{agree}"
    print(line, flush=True)


def store_point(sets, batch: int, slots: int, floor: float, variants: list[tuple]) -> None:
    """The `variants`' passes (of `VARIANTS`), timed after cuDNN and `flash_decode` in the same process;
    stores 5 and 7 checked against store 1's scratch where a store 1 variant of their tile ran first."""
    cudnn = graph_ms([method_calls("sdpa_cudnn", *s)[0] for s in sets])
    plain = graph_ms([method_calls("flash_decode", *s)[0] for s in sets])
    print(f"batch {batch}, {slots} slots: floor {floor:.4f} ms, cuDNN {cudnn:.4f} ms, "
          f"flash_decode {plain:.4f} ms ({plain / cudnn:.3f}x cuDNN)", flush=True)
    want = method_calls("flash_decode", *sets[0])[0]().float()
    plain_scratch = {}  # tile -> the first set's scratch by `tl.store` (store 1), which store 5 must match
    for block_n, tma, stages, warps, store in variants:
        calls = [pass_call(*s, block_n, tma, stages, warps, store) for s in sets]
        ms = graph_ms(calls)
        error = (calls[0]().float() - want).abs().max().item()
        if store == 1:
            plain_scratch[block_n] = calls[0].scratch
        elif store in (5, 7) and block_n in plain_scratch:
            written = plain_scratch[block_n].isfinite()
            error = max(error, (calls[0].scratch[written] - plain_scratch[block_n][written]).abs().max().item())
        print(f"  tile {block_n:>3}, TMA {tma!s:>5}, {stages} stages, {warps} warps, store {store}: "
              f"{ms:.4f} ms, {ms / cudnn:.3f}x cuDNN, {ms / floor:.3f}x floor (max error {error:.1e})",
              flush=True)


if __name__ == "__main__":
    main()
