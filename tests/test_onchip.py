"""LongFlow's on-chip pass (`longflow.kernels.onchip`, `LaunchConfig(onchip=True)`) against the float32
reference and the shared selection rule.

Its attention pass is Gluon, which has no interpreter: those tests are marked `gpu`. Its row argmin is
Triton and runs through the interpreter on a CPU; the pass compiles for sm_90 in
`tests/test_kernels_compile.py`.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from helpers.kernel_checks import DEVICE, assert_longflow, make_inputs  # noqa: E402

pytest.importorskip("triton")

from longflow.kernels import longflow_attention, scored_attention  # noqa: E402
from longflow.kernels.longflow_attention import LaunchConfig, call_config, default_config  # noqa: E402
from longflow.kernels.occupancy import GPU, gpu  # noqa: E402
from longflow.kernels.onchip import (  # noqa: E402
    _onchip_argmin_kernel,
    resident_programs,
    shared_bytes,
    tiling,
    unsupported,
)
from longflow.selection import choose_next  # noqa: E402

pytestmark = pytest.mark.kernels

ONCHIP = LaunchConfig(onchip=True, block_n=64, num_stages=2)
SMS = 132
H100, H200 = GPU(bandwidth=3.35e12), GPU(bandwidth=4.8e12)
# Smaller GPUs, by their CUDA attributes: an A100 (164 KB a multiprocessor, 163 a program) and an
# RTX 4090 (100 KB and 99).
A100 = GPU(multiprocessors=108, shared=167936, shared_per_program=166912, warps=64, bandwidth=2.04e12)
RTX4090 = GPU(multiprocessors=128, shared=102400, shared_per_program=101376, warps=48, bandwidth=1.01e12)
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def argmin(partials, valid, protect, next_slot):
    """`_onchip_argmin_kernel` as `onchip_attention` launches it (head 0's masks), on DEVICE's copies;
    next_slot is written in place."""
    partials, valid, next_on_device = partials.to(DEVICE), valid.to(DEVICE), next_slot.to(DEVICE)
    protect = None if protect is None else protect.to(DEVICE)
    valid0 = (valid[:, 0] if valid.dim() == 3 else valid).to(torch.uint8)
    protect0 = valid0 if protect is None else protect[:, 0].to(torch.uint8)
    write = next_slot.shape[1]
    _onchip_argmin_kernel[(partials.shape[0],)](
        partials, valid0, protect0, next_on_device, *valid0.stride(), *protect0.stride(),
        *next_on_device.stride(), partials.shape[2], KV_HEADS=partials.shape[1], KV_HEADS_PAD=partials.shape[1],
        WRITE_HEADS=write, WRITE_HEADS_PAD=max(2, write), HAS_PROTECT=protect is not None, BLOCK=1024)
    next_slot.copy_(next_on_device.cpu())


def test_the_row_argmin_is_the_shared_rule_over_head_zero():
    """The KV heads' partials summed, then `choose_next` over head 0's masks: free slots first, protected
    valid slots never, ties to the lowest slot; the slot in every column of a strided next-slot buffer."""
    batch, slots = 5, 1100  # more than one 1024-slot tile
    gen = torch.Generator().manual_seed(0)
    partials = torch.rand(batch, KV_HEADS, slots, generator=gen)
    partials[0, :, 1074] = partials[0, :, 50] = 0.0  # a tie, in one lane of the loop (1024 apart)
    valid = torch.ones(batch, KV_HEADS, slots, dtype=torch.bool)
    valid[1, 0, 1050] = False  # head 0's free slot, in the last, partial tile
    valid[2, 1:, 7] = False  # other heads' holes: not the selection's
    protect = torch.zeros(batch, KV_HEADS, slots, dtype=torch.bool)
    lowest = partials[3].sum(0).argmin()
    protect[3, 0, lowest] = True  # the best slot protected: the next best
    protect[4, 0, :] = valid[4, 0]  # every valid slot protected
    next_slot = torch.full((KV_HEADS, batch), -1, dtype=torch.long).t()  # [B, Hkv], strided
    argmin(partials, valid, protect, next_slot)
    expected = choose_next(partials.sum(1), valid[:, 0], protect[:, 0])
    assert torch.equal(next_slot, expected[:, None].expand(batch, KV_HEADS))
    assert next_slot[0, 0] == 50 and next_slot[1, 0] == 1050 and next_slot[3, 0] != lowest

    one_column = torch.full((batch, 2), -1, dtype=torch.long)
    argmin(partials, valid[:, 0], None, one_column[:, :1])  # longflow_attention's [B, 1]
    assert torch.equal(one_column[:, 0], choose_next(partials.sum(1), valid[:, 0]))
    assert (one_column[:, 1] == -1).all()  # only the buffer's own column


def test_resident_programs_are_the_compilers():
    """Shared memory as Triton 3.6 compiled the pass for sm_90 (longflow/kernels/NOTES.md), and the
    programs a multiprocessor holds: 64-slot tiles two up to 5120 slots (registers), one from 6144
    (shared memory); 32-slot tiles three up to 4096 slots (registers), two from 5120."""
    assert shared_bytes(64, 2, 1024) == 76032 and shared_bytes(32, 2, 8192) == 103424
    assert shared_bytes(64, 2, 3200) == 93984 and shared_bytes(64, 2, 8192) == 135168
    assert [resident_programs(64, 2, slots) for slots in (1024, 5120, 6144, 8192)] == [2, 2, 1, 1]
    assert [resident_programs(32, 2, slots) for slots in (1024, 4096, 5120, 8192)] == [3, 3, 2, 2]


@pytest.mark.parametrize("batch,slots,h100,h200", [
    (64, 3072, (64, 2), (64, 2)),  # 512 programs: two waves of 264, nearly full
    (128, 1024, (64, 2), (64, 2)),
    (32, 5120, (64, 2), (64, 2)),  # 256 programs in one wave of 264
    (48, 3072, (32, 2), (32, 2)),  # 384: one wave of 396 with three 32-slot programs a multiprocessor
    (48, 5120, None, None),  # 384 in two waves of 264: 73% full
    (128, 8192, (32, 2), None),  # 32 KB in flight a multiprocessor: enough for an H100 only
    (16, 1024, None, None),  # 128 programs: one a multiprocessor
])
def test_tiling_follows_the_sweeps(batch, slots, h100, h200):
    """The sweeps' winners (longflow/kernels/NOTES.md, "Which tile, on which card"), at 8 KV heads on
    132 multiprocessors; None where the Triton call was the faster."""
    assert tiling(batch * KV_HEADS, slots, H100) == h100
    assert tiling(batch * KV_HEADS, slots, H200) == h200


@pytest.mark.parametrize("on", [A100, RTX4090], ids=["a100", "rtx4090"])
def test_tiling_on_smaller_gpus_takes_only_what_fits_twice(on):
    """Every tiling it takes fits a program's shared memory there and two programs a multiprocessor,
    whatever an H100 would take: on an RTX 4090 64-slot tiles fit one program a multiprocessor at
    most, and none past 4096 slots."""
    taken = 0
    for batch in (8, 16, 24, 27, 32, 48, 54, 64, 96, 128, 256):
        for slots in (512, 1024, 2048, 3200, 4096, 5120, 6144, 8192):
            tile = tiling(batch * KV_HEADS, slots, on)
            if tile is not None:
                taken += 1
                assert shared_bytes(*tile, slots) <= on.shared_per_program
                assert resident_programs(*tile, slots, on) >= 2
    assert taken  # it is not simply off
    assert tiling(32 * KV_HEADS, 5120, H100) == (64, 2) and tiling(32 * KV_HEADS, 5120, RTX4090) is None


def test_default_config_asks_for_the_pass_only_where_it_can_take_the_call():
    shape = (64, KV_HEADS, Q_HEADS, 3072, HEAD_DIM, SMS)
    assert default_config(*shape, onchip=H200) == LaunchConfig(block_n=64, num_stages=2, onchip=True)
    assert not default_config(*shape).onchip  # the caller found that the pass cannot take the inputs
    assert not default_config(16, *shape[1:], onchip=H200).onchip
    q = torch.zeros(64, Q_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)
    k = torch.zeros(64, KV_HEADS, 3072, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)
    assert not call_config(q.float(), k.float(), k.float()).onchip  # float32: the Triton call
    assert not call_config(q, k, k, per_kv_head=True).onchip
    if not torch.cuda.is_available():
        assert not call_config(q, k, k).onchip  # no Gluon without a GPU


def test_what_the_pass_cannot_take():
    q = torch.zeros(2, Q_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    k = torch.zeros(2, KV_HEADS, 64, HEAD_DIM, dtype=torch.bfloat16)
    assert unsupported(q, k, k) is None
    assert "16-bit" in unsupported(q.float(), k.float(), k.float())
    assert "head dim" in unsupported(q[..., :64], k[..., :64], k[..., :64])
    assert "query heads a KV head" in unsupported(q, k[:, :4], k[:, :4])  # G = 8
    long = torch.zeros(1, KV_HEADS, 8200, HEAD_DIM, dtype=torch.bfloat16)
    assert "8192 slots" in unsupported(q[:1], long, long)
    strided = torch.zeros(2, KV_HEADS, 64, 2 * HEAD_DIM, dtype=torch.bfloat16)[..., ::2]
    assert "contiguous head dim" in unsupported(q, strided, strided)
    padded_rows = torch.zeros(2, KV_HEADS, 64, HEAD_DIM + 8, dtype=torch.bfloat16)[..., :HEAD_DIM]
    assert "multiples of 16" in unsupported(q, padded_rows, padded_rows)  # rows 8 elements apart


def test_the_launch_config_asks_for_what_it_can_do():
    q = torch.zeros(2, Q_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)
    k = torch.zeros(2, KV_HEADS, 64, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)
    valid = torch.ones(2, KV_HEADS, 64, dtype=torch.bool, device=DEVICE)
    next_slot = torch.zeros(2, KV_HEADS, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="LongFlow's score with one selection a row"):
        scored_attention(q, k, k, valid, next_slot, score="attention", config=ONCHIP)
    with pytest.raises(ValueError, match="LongFlow's score with one selection a row"):
        scored_attention(q, k, k, valid, next_slot, score="longflow", per_kv_head=True, config=ONCHIP)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            longflow_attention(q, k, k, valid[:, 0], config=ONCHIP)
    long_k = torch.zeros(2, KV_HEADS, 8192, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)
    wide = LaunchConfig(onchip=True, block_n=128, num_stages=3)  # 267264 bytes at 8192 slots
    with pytest.raises(ValueError, match="more than the GPU gives a program"):
        longflow_attention(q, long_k, long_k, torch.ones(2, 8192, dtype=torch.bool, device=DEVICE), config=wide)


@pytest.mark.gpu
@pytest.mark.parametrize("block_n", [64, 32])
@pytest.mark.parametrize("batch,slots,dtype,mask", [
    (3, 100, torch.bfloat16, "padding"),  # a partial tile
    (2, 3200, torch.bfloat16, "all_valid"),
    (5, 777, torch.float16, "one_free"),
    (40, 2000, torch.bfloat16, "all_valid"),
    (2, 8192, torch.bfloat16, "padding"),  # the most slots the scratch holds
])
def test_longflow_attention_on_chip(batch, slots, dtype, mask, block_n):
    q, k, v, valid = make_inputs(batch, Q_HEADS, KV_HEADS, slots, HEAD_DIM, dtype, mask, seed=slots)
    out, next_slot = longflow_attention(q, k, v, valid, config=LaunchConfig(onchip=True, block_n=block_n,
                                                                            num_stages=2))
    assert_longflow(q, k, v, valid, out, next_slot, score_rtol=1e-2)  # the fp16 scratch's rounding


@pytest.mark.gpu
def test_the_default_call_takes_the_pass_where_its_tiling_says():
    """Without a config the call asks `tiling` (on a 132-multiprocessor H100/H200 it takes the pass at
    this shape) and its result is still LongFlow's."""
    batch, slots = 64, 1024
    q, k, v, valid = make_inputs(batch, Q_HEADS, KV_HEADS, slots, HEAD_DIM, torch.bfloat16, "one_free", seed=3)
    valid[::2] = True
    expected = tiling(batch * KV_HEADS, slots, gpu(DEVICE))
    config = call_config(q, k, v)
    assert config.onchip == (expected is not None)
    if gpu(DEVICE).multiprocessors == SMS:
        assert config == LaunchConfig(block_n=64, num_stages=2, onchip=True)
    out, next_slot = longflow_attention(q, k, v, valid)
    assert_longflow(q, k, v, valid, out, next_slot, score_rtol=1e-2)


@pytest.mark.gpu
def test_scored_attention_on_chip_with_protection_and_masks_per_head():
    """Each head attends over its own slots; the row's selection reads head 0's masks; every column
    of a strided next-slot buffer gets it. Against the Triton call, which the reference tests cover."""
    batch, slots = 6, 500
    q, k, v, _ = make_inputs(batch, Q_HEADS, KV_HEADS, slots, HEAD_DIM, torch.bfloat16, "all_valid", seed=1)
    gen = torch.Generator().manual_seed(2)
    valid = (torch.rand(batch, KV_HEADS, slots, generator=gen) > 0.1).to(DEVICE)
    valid[1::2] = True  # rows whose next slot is chosen by score
    protect = (torch.rand(batch, KV_HEADS, slots, generator=gen) < 0.3).to(DEVICE)
    next_slot = torch.full((KV_HEADS, batch), -1, dtype=torch.long, device=DEVICE).t()
    out = scored_attention(q, k, v, valid, next_slot, score="longflow", protect=protect, config=ONCHIP)
    triton_slot = torch.full((batch, KV_HEADS), -1, dtype=torch.long, device=DEVICE)
    triton_out = scored_attention(q, k, v, valid, triton_slot, score="longflow", protect=protect)
    torch.testing.assert_close(out, triton_out, atol=2e-2, rtol=2e-2)
    assert (next_slot == next_slot[:, :1]).all()
    # LongFlow's score with each head's own slots: sum over every query head of p_hj ||v_j||_1.
    grouped = q.float().view(batch, KV_HEADS, Q_HEADS // KV_HEADS, HEAD_DIM)
    logits = (grouped @ k.float().transpose(-1, -2) * HEAD_DIM**-0.5).masked_fill(~valid[:, :, None], float("-inf"))
    score = (logits.softmax(-1) * v.float().abs().sum(-1)[:, :, None]).sum((1, 2))  # [B, S]
    for b in range(batch):
        got, want = int(next_slot[b, 0]), int(triton_slot[b, 0])
        if got != want:
            assert valid[b, 0].all() and not protect[b, 0, got]
            assert score[b, got] <= score[b, want] * 1.01, f"row {b}: slot {got}, not {want}"
