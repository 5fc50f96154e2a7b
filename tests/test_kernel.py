"""The fused LongFlow kernel against its PyTorch reference (docs/methods.md, LongFlow).

On a machine without CUDA the kernels run in Triton's interpreter, whose switch must be set before
Triton defines them, hence the environment line above the imports; shapes stay small there.
On CUDA the same tests run on the GPU.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from helpers.kernel_checks import DEVICE, assert_longflow, make_inputs  # noqa: E402

from longflow.kernels import longflow_attention, reference  # noqa: E402
from longflow.kernels.longflow_attention import LaunchConfig  # noqa: E402
from longflow.kernels.reference import longflow_scores  # noqa: E402

pytestmark = pytest.mark.kernels

GROUPS = {1: (2, 2), 4: (8, 2), 8: (16, 2)}  # G -> (q_heads, kv_heads)


CASES = [
    (group, head_dim, mask)
    for group in GROUPS
    for head_dim in (64, 128)
    for mask in ("padding", "all_valid", "one_free")
]


@pytest.mark.parametrize("group,head_dim,mask", CASES)
def test_matches_reference(group, head_dim, mask):
    index = CASES.index((group, head_dim, mask))
    dtype = (torch.bfloat16, torch.float16, torch.float32)[index // 3 % 3]
    slots = (37, 100, 130)[index // 2 % 3]  # none a multiple of the 64-slot tile
    batch = (1, 7)[index % 2]
    q_heads, kv_heads = GROUPS[group]
    q, k, v, valid = make_inputs(batch, q_heads, kv_heads, slots, head_dim, dtype, mask, seed=index)
    out, next_slot = longflow_attention(q, k, v, valid)
    assert_longflow(q, k, v, valid, out, next_slot)


@pytest.mark.parametrize("batch", [1, 7])
@pytest.mark.parametrize("slots", [16, 64, 200, 257])
def test_batch_and_slot_counts(batch, slots):
    q, k, v, valid = make_inputs(batch, 8, 2, slots, 64, torch.bfloat16, "padding", seed=1000 + slots + batch)
    out, next_slot = longflow_attention(q, k, v, valid, scale=0.1)
    ref_out, _ = reference(q, k, v, valid, scale=0.1)
    assert ((out.float() - ref_out.float()).norm() / ref_out.float().norm()) < 1e-2
    _, expected = reference(q, k, v, valid, scale=0.1)
    free = ~valid.all(dim=1)
    assert torch.equal(next_slot[free], expected[free])


CONFIGS = [
    LaunchConfig(block_n=16, splits=3, score_splits=2, block_s=32),
    LaunchConfig(block_n=32, splits=5, score_splits=4, block_s=16, num_warps=8),
    LaunchConfig(block_n=128, splits=1, score_splits=3, block_s=64),
    LaunchConfig(block_n=16, splits=2, score_splits=2, block_s=16, scratch="fp16"),
    LaunchConfig(block_n=16, splits=3, score_splits=3, block_s=64, scratch="fp16"),
    LaunchConfig(block_n=64, splits=2, score_splits=2, block_s=16, scratch="fp16"),
    LaunchConfig(block_n=32, splits=3, score_splits=1, block_s=32, vnorm="reduce", prefetch=False),
]


def rtol_for(config: LaunchConfig) -> float:
    """fp16 scratch carries ~1e-3 relative error per score term (the module docstring)."""
    return 2e-2 if config.scratch == "fp16" else 1e-3


def config_id(config: LaunchConfig) -> str:
    return f"n{config.block_n}-s{config.splits}x{config.score_splits}-{config.scratch}-{config.vnorm}"


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
@pytest.mark.parametrize("mask", ["padding", "all_valid"])
def test_launch_configs(config, mask):
    """Every path: split attention with the combine step, split scores with the argmin step, fp16 scratch."""
    q, k, v, valid = make_inputs(3, 8, 2, 150, 64, torch.bfloat16, mask, seed=2000 + CONFIGS.index(config))
    out, next_slot = longflow_attention(q, k, v, valid, config=config)
    assert_longflow(q, k, v, valid, out, next_slot, score_rtol=rtol_for(config))


def test_many_splits_combine_one_head_at_a_time():
    """128 one-tile splits: the combine takes its heads one by one (HEAD_TILE = 1)."""
    q, k, v, valid = make_inputs(1, 4, 2, 2048, 64, torch.bfloat16, "padding", seed=11)
    config = LaunchConfig(block_n=16, splits=128, score_splits=8, block_s=128)
    out, next_slot = longflow_attention(q, k, v, valid, config=config)
    assert_longflow(q, k, v, valid, out, next_slot)


def test_strided_views_and_protect():
    """valid as `valid3d[:, 0]`, K/V as slices of larger buffers, and protected slots."""
    batch, q_heads, kv_heads, slots, head_dim = 4, 8, 2, 90, 64
    q, k, v, _ = make_inputs(batch, q_heads, kv_heads, slots + 6, head_dim, torch.bfloat16, "all_valid", 7)
    k, v = k[:, :, 3:-3], v.transpose(0, 1).contiguous().transpose(0, 1)[:, :, :slots]
    valid3d = torch.ones(batch, kv_heads, slots, dtype=torch.bool, device=DEVICE)
    valid3d[1, :, 10] = False  # row 1 has one free slot
    valid = valid3d[:, 0]
    assert not valid.is_contiguous()
    _, score = longflow_scores(q.float(), k.float(), v.float(), valid)
    protect = torch.zeros(batch, slots, dtype=torch.bool, device=DEVICE)
    protect[:, :4] = True
    protect[torch.arange(batch), score.argmin(dim=1)] = True  # the unprotected choice becomes illegal
    protect[1, 10] = True  # a free slot is chosen even if marked protected
    out, next_slot = longflow_attention(q, k, v, valid, protect=protect)
    assert_longflow(q, k, v, valid, out, next_slot, protect=protect)
    assert int(next_slot[1]) == 10


@pytest.mark.parametrize("config", [None, LaunchConfig(block_n=64, splits=2, score_splits=2, block_s=32)],
                         ids=["heuristic", "split"])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(6, 2, 80), (2, 2, 128)], ids=["g3-d80", "g1-d128"])
def test_padded_heads_and_dims(q_heads, kv_heads, head_dim, config):
    """Three query heads a group (padded to 16 rows) and a head dim of 80 (padded to 128), or one head
    a group: the masks of the padding rows and dims, against the float32 reference."""
    q, k, v, valid = make_inputs(3, q_heads, kv_heads, 170, head_dim, torch.bfloat16, "padding", seed=head_dim)
    out, next_slot = longflow_attention(q, k, v, valid, config=config)
    assert_longflow(q, k, v, valid, out, next_slot)


def test_rejects_bad_inputs():
    q, k, v, valid = make_inputs(2, 8, 2, 32, 64, torch.bfloat16, "all_valid", seed=3)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        longflow_attention(q[:, :7], k, v, valid)
    with pytest.raises(ValueError, match="bool tensor"):
        longflow_attention(q, k, v, valid.float())
    with pytest.raises(TypeError, match="share one dtype"):
        longflow_attention(q, k.float(), v, valid)
    with pytest.raises(ValueError, match="k and v"):
        longflow_attention(q, k, v[:, :, :5], valid)


@pytest.mark.parametrize("batch,slots,splits,scratch", [
    (16, 1024, 1, "fp32"),  # 128 programs, one a multiprocessor in one wave: unsplit
    (16, 4096, 1, "fp32"),
    (16, 8192, 3, "fp16"),  # the fp32 scratch overflows a quarter of L2: fp16, which pays only split
    (32, 8192, 1, "fp16"),  # 256 programs, two a multiprocessor in one wave
    (24, 1024, 2, "fp32"),  # 192 programs: 73% of two a multiprocessor, so split
    (8, 1024, 5, "fp32"),   # 64 programs: half the multiprocessors idle unsplit
])
def test_default_config_splits_only_where_the_programs_leave_places_idle(batch, slots, splits, scratch):
    """The scored call is split only where B * Hkv programs would leave more than a tenth of one or
    two places a multiprocessor idle (132 multiprocessors, 50 MB of L2, 8 KV heads); `flash_decode`,
    which combines its splits in its last program, keeps its splits (2 programs a multiprocessor)."""
    from longflow.kernels.longflow_attention import default_config

    config = default_config(batch, 8, 32, slots, 128, sms=132, l2_bytes=50 * 2**20)
    assert (config.splits, config.scratch) == (splits, scratch)
    unscored = default_config(batch, 8, 32, slots, 128, sms=132, l2_bytes=50 * 2**20, scored=False)
    assert unscored.splits == max(1, -(-2 * 132 // (batch * 8)))


@pytest.mark.gpu
@pytest.mark.parametrize("batch,slots", [(1, 8192), (16, 1024), (16, 8192), (64, 3200)])
def test_default_config_at_benchmark_shapes(batch, slots):
    """The heuristic's choice (fp16 scratch at batch 16 / 8192 slots) at Qwen3-8B decode shapes."""
    from longflow.kernels.longflow_attention import _l2_bytes, _multiprocessors, default_config

    q, k, v, valid = make_inputs(batch, 32, 8, slots, 128, torch.bfloat16, "padding", seed=batch + slots)
    config = default_config(batch, 8, 32, slots, 128, _multiprocessors(DEVICE), _l2_bytes(DEVICE))
    out, next_slot = longflow_attention(q, k, v, valid)
    assert_longflow(q, k, v, valid, out, next_slot, score_rtol=rtol_for(config))
    valid = torch.ones_like(valid)  # no free slot: the argmin over scores decides
    out, next_slot = longflow_attention(q, k, v, valid)
    assert_longflow(q, k, v, valid, out, next_slot, score_rtol=rtol_for(config))
