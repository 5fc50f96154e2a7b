"""The fused kernel's score epilogues (`scored_attention`) against a plain PyTorch transcription of each
score: H2O's accumulated attention, VATP's accumulated attention x ||v||_1 and its lf_repo score, the
step's attention (TOVA, H2O lf_repo) and LongFlow's, chosen per row or per KV head.

On a machine without CUDA the kernels run in Triton's interpreter (the environment line above the
imports); shapes stay small there.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from longflow.kernels import scored_attention  # noqa: E402
from longflow.kernels.longflow_attention import SCORES, LaunchConfig  # noqa: E402
from longflow.selection import choose_next  # noqa: E402

pytestmark = pytest.mark.kernels

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (score, per_kv_head, weight): the methods' epilogues, and LongFlow's per KV head
METHOD_SCORES = [
    ("accumulated", True, 1.0),  # H2O paper
    ("attention", False, 1.0),  # H2O lf_repo
    ("attention", False, 1 / 8),  # TOVA (the mean over 8 query heads)
    ("accumulated_vnorm", True, 1.0),  # VATP paper
    ("attention_vnorm_mean", False, 1 / 8),  # VATP lf_repo
    ("longflow", True, 1.0),
]


def expected(q, k, v, valid, score, per_kv_head, weight, protect=None, received=None, norms=None, scale=None):
    """The formula in float32: (out `[B, Hq, D]`, scores `[B, Hkv, S]`, accumulator after the step or
    None, next slot `[B, Hkv]`)."""
    batch, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    scale = head_dim**-0.5 if scale is None else scale
    grouped = q.float().view(batch, kv_heads, q_heads // kv_heads, head_dim)
    logits = torch.einsum("bhgd,bhsd->bhgs", grouped, k.float()) * scale
    probs = torch.softmax(logits.masked_fill(~valid[:, :, None], float("-inf")), dim=-1)  # [B, Hkv, G, S]
    out = torch.einsum("bhgs,bhsd->bhgd", probs, v.float()).reshape(batch, q_heads, head_dim)
    if score == "longflow":
        probs = probs * v.float().abs().sum(dim=-1)[:, :, None]  # p_hj ||v_j||_1
    attention = probs.sum(dim=2)  # [B, Hkv, S], over each KV head's query heads
    if not per_kv_head:
        attention = attention.sum(dim=1, keepdim=True).expand_as(attention)
    after = None
    if SCORES[score].accumulate:
        after = received + attention
        scores = after.clone()
    else:
        scores = attention * weight
    if SCORES[score].norms == 1:
        scores = scores * norms
    elif SCORES[score].norms == 2:
        scores = scores * norms.mean(dim=1, keepdim=True)
    if per_kv_head:
        chosen = choose_next(scores, valid, protect)
    else:
        chosen = choose_next(scores[:, 0], valid[:, 0], None if protect is None else protect[:, 0])
        chosen = chosen[:, None].expand(-1, kv_heads)
    return out, scores, after, chosen


def make_case(batch, q_heads, kv_heads, slots, head_dim, per_kv_head, seed, dtype=torch.float32):
    """Random q, k, v, a validity per KV head (rows filled to different levels, a free slot here and
    there, different per head for a per-head selection), protected sinks and recent slots, an
    accumulator and value norms."""
    gen = torch.Generator().manual_seed(seed)
    q = 2 * torch.randn(batch, q_heads, head_dim, generator=gen)
    k = torch.randn(batch, kv_heads, slots, head_dim, generator=gen)
    v = torch.randn(batch, kv_heads, slots, head_dim, generator=gen)
    filled = torch.linspace(slots // 3, slots, batch).long()  # the last row full
    valid = (torch.arange(slots)[None, :] < filled[:, None])[:, None].expand(-1, kv_heads, -1).clone()
    heads = range(kv_heads) if per_kv_head else [slice(None)]
    for b in range(batch - 1):  # a hole in each head (all heads alike for a shared selection)
        for h in heads:
            valid[b, h, int(torch.randint(0, int(filled[b]), (1,), generator=gen))] = False
    if per_kv_head:  # and one full row whose first head alone has a free slot
        valid[-1, 0, slots // 2] = False
    protect = torch.zeros_like(valid)
    protect[..., :2] = True  # sinks
    protect[torch.arange(batch), :, (filled - 1).clamp(min=0)] = True  # the newest
    received = torch.rand(batch, kv_heads, slots, generator=gen) * 3 * valid
    norms = torch.rand(batch, kv_heads, slots, generator=gen) * 4 * valid
    to = dict(device=DEVICE)
    return (q.to(dtype=dtype, **to), k.to(dtype=dtype, **to), v.to(dtype=dtype, **to), valid.to(**to),
            protect.to(**to), received.to(**to), norms.to(**to))


def run_case(score, per_kv_head, weight, case, config=None, use_protect=True, rtol=1e-5):
    q, k, v, valid, protect, received, norms = case
    spec = SCORES[score]
    protect = protect if use_protect else None
    received = received if spec.accumulate else None
    norms = norms if spec.norms else None
    want_out, want_scores, want_after, want_next = expected(q, k, v, valid, score, per_kv_head, weight, protect,
                                                            received, norms)
    state = None if received is None else received.clone()
    next_slot = torch.full(valid.shape[:2], -1, dtype=torch.long, device=DEVICE)
    out = scored_attention(q, k, v, valid if per_kv_head else valid[:, 0], next_slot, score=score,
                           per_kv_head=per_kv_head, protect=None if protect is None else
                           (protect if per_kv_head else protect[:, 0]), received=state, norms=norms, weight=weight,
                           config=config)
    tolerance = 1e-4 if q.dtype == torch.float32 else 1e-2
    assert (out.float() - want_out).norm() / want_out.norm() < tolerance
    if want_after is not None:  # the accumulator, every slot
        torch.testing.assert_close(state, want_after, rtol=rtol, atol=1e-6)
    assert_chosen(next_slot.cpu(), want_next.cpu(), want_scores.cpu(), valid.cpu(),
                  None if protect is None else protect.cpu(), rtol)


def assert_chosen(got, want, scores, valid, protect, rtol):
    """The expected slot, or one whose score ties with it within `rtol` (where rounding can swap them);
    a free slot must be the lowest one exactly."""
    for b, h in zip(*torch.nonzero(got != want, as_tuple=True), strict=True):
        slot, best = int(got[b, h]), int(want[b, h])
        assert valid[b, h].all() or not valid[b, h, best], f"({b}, {h}): free slot {best} expected, got {slot}"
        assert valid[b, h, slot] and (protect is None or not protect[b, h, slot]), f"({b}, {h}): slot {slot}"
        assert scores[b, h, slot] <= scores[b, h, best] * (1 + rtol) + 1e-7, (
            f"({b}, {h}): slot {slot} scores {float(scores[b, h, slot]):.6e}, the minimum "
            f"{float(scores[b, h, best]):.6e} is at {best}")


@pytest.mark.parametrize("score,per_kv_head,weight", METHOD_SCORES)
@pytest.mark.parametrize("group", [4, 1])
def test_scores_match_the_formula(score, per_kv_head, weight, group):
    kv_heads = 2
    case = make_case(4, group * kv_heads, kv_heads, 45, 16, per_kv_head, seed=METHOD_SCORES.index(
        (score, per_kv_head, weight)) + 10 * group)
    run_case(score, per_kv_head, weight if group == 4 else weight * 4, case)


CONFIGS = [
    LaunchConfig(block_n=16, splits=3, score_splits=2, block_s=16),  # split pass, split scores (atomics)
    LaunchConfig(block_n=16, splits=2, score_splits=3, block_s=16, scratch="fp16"),
    LaunchConfig(block_n=32, splits=1, score_splits=1, block_s=64),  # one program for everything
]


@pytest.mark.parametrize("config", CONFIGS, ids=["split", "fp16", "single"])
@pytest.mark.parametrize("score,per_kv_head", [("accumulated", True), ("accumulated_vnorm", True),
                                               ("attention_vnorm_mean", False)])
def test_launch_configs(config, score, per_kv_head):
    case = make_case(3, 8, 2, 70, 16, per_kv_head, seed=100 + CONFIGS.index(config))
    run_case(score, per_kv_head, 1 / 8, case, config, rtol=2e-2 if config.scratch == "fp16" else 1e-5)


def test_bf16_without_protection():
    case = make_case(3, 8, 2, 50, 32, True, seed=7, dtype=torch.bfloat16)
    run_case("accumulated", True, 1.0, case, use_protect=False)


@pytest.mark.parametrize("per_kv_head", [True, False])
def test_ties_go_to_the_lowest_slot(per_kv_head):
    """One key for every slot: every probability equal, so scores tie exactly where the accumulator
    does; the shared rule takes the lowest unprotected index among them. Small integers make every
    logit exact, whatever order a tile's products are summed in (the interpreter's numpy products may
    round two rows of one tile differently, which broke the ties of Gaussian logits at random)."""
    batch, kv_heads, slots, head_dim = 2, 2, 20, 16
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(-2, 3, (batch, 4, head_dim), generator=generator).float().to(DEVICE)
    k = torch.randint(-2, 3, (1, 1, 1, head_dim), generator=generator).float().expand(
        batch, kv_heads, slots, head_dim).contiguous().to(DEVICE)
    v = torch.randn(batch, kv_heads, slots, head_dim, device=DEVICE)
    valid = torch.ones(batch, kv_heads, slots, dtype=torch.bool, device=DEVICE)
    protect = torch.zeros_like(valid)
    protect[:, :, 5] = True
    received = torch.full((batch, kv_heads, slots), 2.0, device=DEVICE)
    received[:, 0, [5, 9, 13]] = 1.0  # slot 5 protected: 9 wins for head 0
    received[:, 1, [3, 4]] = 0.5  # head 1: slot 3
    next_slot = torch.empty(batch, kv_heads, dtype=torch.long, device=DEVICE)
    if per_kv_head:
        scored_attention(q, k, v, valid, next_slot, score="accumulated", per_kv_head=True, protect=protect,
                         received=received)
        assert next_slot.tolist() == [[9, 3]] * batch
    else:  # the step's attention alone: all slots tie, slot 5 is protected
        protect[:, :, :5] = True
        scored_attention(q, k, v, valid[:, 0], next_slot, score="attention", protect=protect[:, 0])
        assert next_slot.tolist() == [[6, 6]] * batch


def test_writes_into_a_strided_next_slot():
    """The policies' `next_slot[layer]` may be a view; a shared choice lands in every head's column."""
    q, k, v, valid, _, _, _ = make_case(3, 8, 2, 30, 16, False, seed=5)
    buffer = torch.full((3, 5), -1, dtype=torch.long, device=DEVICE)
    next_slot = buffer[:, 1:5:2]
    scored_attention(q, k, v, valid[:, 0], next_slot, score="attention", weight=1 / 8)
    _, _, _, want = expected(q, k, v, valid, "attention", False, 1 / 8)
    assert torch.equal(next_slot.cpu(), want.cpu())
    assert (buffer[:, [0, 2, 4]] == -1).all()


def test_rejects_bad_inputs():
    q, k, v, valid, _, received, norms = make_case(2, 8, 2, 20, 16, True, seed=3)
    next_slot = torch.zeros(2, 2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="score must be one of"):
        scored_attention(q, k, v, valid, next_slot, score="h2o")
    with pytest.raises(ValueError, match="needs received"):
        scored_attention(q, k, v, valid, next_slot, score="accumulated", per_kv_head=True)
    with pytest.raises(ValueError, match="takes no norms"):
        scored_attention(q, k, v, valid, next_slot, score="accumulated", per_kv_head=True, received=received,
                         norms=norms)
    with pytest.raises(ValueError, match="per_kv_head=True"):
        scored_attention(q, k, v, valid, next_slot, score="accumulated", received=received)
    with pytest.raises(ValueError, match="per KV head"):
        scored_attention(q, k, v, valid[:, 0], next_slot, score="attention", per_kv_head=True)
    with pytest.raises(ValueError, match="next_slot"):
        scored_attention(q, k, v, valid, next_slot[:, 0], score="attention")


def test_uniform_attention_leaves_the_choice_to_the_norms():
    """With one key everywhere the attention is uniform, so VATP lf_repo's choice is the slot of the
    lowest mean norm over the KV heads (not the lowest of either head's, nor of their maximum), and VATP
    paper's the lowest of each head's own norm (times its equal accumulator)."""
    batch, kv_heads, slots, head_dim = 2, 2, 20, 16
    q = torch.randn(batch, 8, head_dim, device=DEVICE)
    k = torch.randn(1, 1, 1, head_dim, device=DEVICE).expand(batch, kv_heads, slots, head_dim).contiguous()
    v = torch.randn(batch, kv_heads, slots, head_dim, device=DEVICE)
    valid = torch.ones(batch, kv_heads, slots, dtype=torch.bool, device=DEVICE)
    norms = torch.full((batch, kv_heads, slots), 3.0, device=DEVICE)
    norms[:, :, 4] = torch.tensor([0.1, 3.0], device=DEVICE)  # mean 1.55, max 3
    norms[:, :, 11] = torch.tensor([2.0, 2.0], device=DEVICE)  # mean 2, max 2
    norms[:, 1, 15] = 1.0  # head 1's own lowest
    next_slot = torch.empty(batch, kv_heads, dtype=torch.long, device=DEVICE)
    scored_attention(q, k, v, valid[:, 0], next_slot, score="attention_vnorm_mean", norms=norms, weight=1 / 8)
    assert next_slot.tolist() == [[4, 4]] * batch
    received = torch.ones(batch, kv_heads, slots, device=DEVICE)
    scored_attention(q, k, v, valid, next_slot, score="accumulated_vnorm", per_kv_head=True, received=received,
                     norms=norms)
    assert next_slot.tolist() == [[4, 15]] * batch
