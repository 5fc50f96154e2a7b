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

from longflow.kernels import longflow_attention, reference  # noqa: E402
from longflow.kernels.longflow_attention import LaunchConfig  # noqa: E402
from longflow.kernels.reference import longflow_scores  # noqa: E402

pytestmark = pytest.mark.kernels

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
OUT_TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1e-2}
GROUPS = {1: (2, 2), 4: (8, 2), 8: (16, 2)}  # G -> (q_heads, kv_heads)


def make_inputs(batch, q_heads, kv_heads, slots, head_dim, dtype, mask, seed):
    """Random q, k, v (never zeros) and a validity mask of the given kind."""
    gen = torch.Generator().manual_seed(seed)
    q = 2 * torch.randn(batch, q_heads, head_dim, generator=gen)  # peakier softmax than randn alone
    k = torch.randn(batch, kv_heads, slots, head_dim, generator=gen)
    v = torch.randn(batch, kv_heads, slots, head_dim, generator=gen)
    if mask == "all_valid":
        valid = torch.ones(batch, slots, dtype=torch.bool)
    elif mask == "padding":  # left padding of a different length per row, never the whole row
        pad = torch.randint(0, slots, (batch,), generator=gen)
        valid = torch.arange(slots)[None, :] >= pad[:, None]
    elif mask == "one_free":
        valid = torch.ones(batch, slots, dtype=torch.bool)
        valid[torch.arange(batch), torch.randint(0, slots, (batch,), generator=gen)] = False
    else:
        raise ValueError(mask)
    to = dict(device=DEVICE)
    return q.to(dtype=dtype, **to), k.to(dtype=dtype, **to), v.to(dtype=dtype, **to), valid.to(**to)


def check(q, k, v, valid, out, next_slot, protect=None, score_rtol=1e-3):
    """Output to the dtype's tolerance; next slot = the reference's, or tied with it in score."""
    assert out.shape == q.shape and out.dtype == q.dtype
    assert next_slot.shape == (q.shape[0],) and next_slot.dtype == torch.long
    assert torch.isfinite(out).all()
    ref_out, score = longflow_scores(q.float(), k.float(), v.float(), valid)  # float32 truth
    error = (out.float() - ref_out).norm() / ref_out.norm()
    assert error < OUT_TOLERANCE[q.dtype], f"relative error {error:.2e}"
    _, expected = reference(q, k, v, valid, protect=protect)
    score, next_slot, expected = score.cpu(), next_slot.cpu(), expected.cpu()
    valid, protect = valid.cpu(), None if protect is None else protect.cpu()
    for b in range(q.shape[0]):
        got, want = int(next_slot[b]), int(expected[b])
        if not valid[b].all() or got == want:
            assert got == want, f"row {b}: a free slot exists, expected the lowest {want}, got {got}"
            continue
        assert valid[b, got], f"row {b}: chose invalid slot {got}"
        if protect is not None and not protect[b].all():
            assert not protect[b, got], f"row {b}: chose protected slot {got}"
        tolerance = score_rtol * score[b, want] + 1e-6 * score[b].mean()
        assert score[b, got] <= score[b, want] + tolerance, (
            f"row {b}: slot {got} scores {score[b, got]:.6e}, the minimum is {score[b, want]:.6e} at {want}"
        )


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
    check(q, k, v, valid, out, next_slot)


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
    check(q, k, v, valid, out, next_slot, score_rtol=rtol_for(config))


def test_many_splits_combine_one_head_at_a_time():
    """128 one-tile splits: the combine takes its heads one by one (HEAD_TILE = 1)."""
    q, k, v, valid = make_inputs(1, 4, 2, 2048, 64, torch.bfloat16, "padding", seed=11)
    config = LaunchConfig(block_n=16, splits=128, score_splits=8, block_s=128)
    out, next_slot = longflow_attention(q, k, v, valid, config=config)
    check(q, k, v, valid, out, next_slot)


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
    check(q, k, v, valid, out, next_slot, protect=protect)
    assert int(next_slot[1]) == 10


@pytest.mark.parametrize("config", [None, LaunchConfig(block_n=64, splits=2, score_splits=2, block_s=32)],
                         ids=["heuristic", "split"])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(6, 2, 80), (2, 2, 128)], ids=["g3-d80", "g1-d128"])
def test_padded_heads_and_dims(q_heads, kv_heads, head_dim, config):
    """Three query heads a group (padded to 16 rows) and a head dim of 80 (padded to 128), or one head
    a group: the masks of the padding rows and dims, against the float32 reference."""
    q, k, v, valid = make_inputs(3, q_heads, kv_heads, 170, head_dim, torch.bfloat16, "padding", seed=head_dim)
    out, next_slot = longflow_attention(q, k, v, valid, config=config)
    check(q, k, v, valid, out, next_slot)


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


@pytest.mark.gpu
@pytest.mark.parametrize("batch,slots", [(1, 8192), (16, 1024), (16, 8192), (64, 3200)])
def test_default_config_at_benchmark_shapes(batch, slots):
    """The heuristic's choice (fp16 scratch at batch 16 / 8192 slots) at Qwen3-8B decode shapes."""
    from longflow.kernels.longflow_attention import _l2_bytes, _multiprocessors, default_config

    q, k, v, valid = make_inputs(batch, 32, 8, slots, 128, torch.bfloat16, "padding", seed=batch + slots)
    config = default_config(batch, 8, 32, slots, 128, _multiprocessors(DEVICE), _l2_bytes(DEVICE))
    out, next_slot = longflow_attention(q, k, v, valid)
    check(q, k, v, valid, out, next_slot, score_rtol=rtol_for(config))
    valid = torch.ones_like(valid)  # no free slot: the argmin over scores decides
    out, next_slot = longflow_attention(q, k, v, valid)
    check(q, k, v, valid, out, next_slot, score_rtol=rtol_for(config))
