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
and whether K and V come through tensor descriptors (TMA) instead of pointer loads. Each variant is
timed in CUDA graphs over input sets that overflow L2 (`evals.bench.attention`'s timing), next to
cuDNN SDPA and `flash_decode` in the same process. Needs a CUDA GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from evals.bench.attention import cache_sets, copy_bandwidth, floor_bytes, graph_ms, method_calls
from longflow.kernels.longflow_attention import LOG2E

# (slots per tile, TMA loads, pipeline stages, warps, store mode): the kernel's own setting first.
VARIANTS = [(64, False, 4, 4, store) for store in range(5)] + [(64, True, 4, 4, 0), (64, True, 4, 4, 1),
                                                                (128, False, 3, 4, 1), (128, False, 3, 4, 3),
                                                                (64, False, 4, 4, 5), (128, False, 3, 4, 5)]


@triton.jit
def _store_in_place(addresses, values, mask):
    """`tl.store` of float32 `values` at `addresses` (pointers as int64) where `mask`, from whatever
    layout `values` has: each thread stores its own elements (inline PTX, elementwise), where
    `tl.store` would first convert a tensor-core result to a coalescing layout through shared memory."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.f32 [$1], $2; mov.b32 $0, 0; }",
        "=r,l,f,r", [addresses, values, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _pass_kernel(Q, K, V, K_DESC, V_DESC, VALID, OUT, SCRATCH, slots, qk_scale,
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
        by_head = SCRATCH + rows.to(tl.int64)[:, None] * slots + cols[None, :]
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
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(OUT + rows[:, None] * HEAD_DIM + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=g_ok[:, None])


def pass_call(q, k, v, valid, block_n: int, tma: bool, stages: int, warps: int, store: int):
    """The pass over q `[B, Hq, D]`, contiguous k, v `[B, Hkv, S, D]` and valid `[B, S]`, as a
    zero-argument call returning out `[B, Hq, D]`; its scratch, allocated once, is the call's
    `scratch` attribute."""
    batch, q_heads, head_dim = q.shape
    _, kv_heads, slots, _ = k.shape
    out = torch.empty_like(q)
    scratch = torch.empty(batch * q_heads * slots, dtype=torch.float16 if store == 4 else torch.float32,
                          device=q.device)
    k_desc = TensorDescriptor.from_tensor(k, [1, 1, block_n, head_dim])
    v_desc = TensorDescriptor.from_tensor(v, [1, 1, block_n, head_dim])

    def run():
        _pass_kernel[(batch * kv_heads,)](
            q, k, v, k_desc, v_desc, valid, out, scratch, slots, head_dim**-0.5 * LOG2E, KV_HEADS=kv_heads,
            GROUP=q_heads // kv_heads, GROUP_PAD=16, HEAD_DIM=head_dim, BLOCK_N=block_n, TMA=tma, STAGES=stages,
            STORE=store, num_warps=warps, num_stages=stages)
        return out
    run.scratch = scratch
    return run


def main() -> None:
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s")
    for batch in (64, 128):
        for slots in (3200, 8192):
            sets = cache_sets(batch, slots, device)
            floor = floor_bytes(batch, slots) / bandwidth * 1e3
            cudnn = graph_ms([method_calls("sdpa_cudnn", *s)[0] for s in sets])
            plain = graph_ms([method_calls("flash_decode", *s)[0] for s in sets])
            print(f"batch {batch}, {slots} slots: floor {floor:.4f} ms, cuDNN {cudnn:.4f} ms, "
                  f"flash_decode {plain:.4f} ms ({plain / cudnn:.3f}x cuDNN)", flush=True)
            want = method_calls("flash_decode", *sets[0])[0]().float()
            plain_scratch = {}  # tile -> the first set's scratch by `tl.store` (store 1), which store 5 must match
            for block_n, tma, stages, warps, store in VARIANTS:
                calls = [pass_call(*s, block_n, tma, stages, warps, store) for s in sets]
                ms = graph_ms(calls)
                error = (calls[0]().float() - want).abs().max().item()
                if store == 1:
                    plain_scratch[block_n] = calls[0].scratch
                elif store == 5:
                    written = plain_scratch[block_n].isfinite()
                    error = max(error, (calls[0].scratch[written] - plain_scratch[block_n][written]).abs().max().item())
                print(f"  tile {block_n:>3}, TMA {tma!s:>5}, {stages} stages, {warps} warps, store {store}: "
                      f"{ms:.4f} ms, {ms / cudnn:.3f}x cuDNN, {ms / floor:.3f}x floor (max error {error:.1e})",
                      flush=True)
            del sets, plain_scratch
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
