"""The `prefill` rule of a method (`KVPolicy.prefill`): a prompt longer than the budget cut by SnapKV
(the default) or by the method's own score applied to the prompt (`by_score`), checked against the
score's formula written out with loops."""

from __future__ import annotations

import pytest
import torch

from baselines.ams import AMSPolicy
from baselines.h2o import H2OPolicy
from baselines.keydiff import KeyDiffPolicy
from baselines.tova import TOVAPolicy
from longflow.errors import UserError
from longflow.method import LongFlowPolicy
from longflow.policy import CacheSpec

BATCH, Q_HEADS, KV_HEADS, HEAD_DIM = 3, 4, 2, 8
SCALE = HEAD_DIM ** -0.5


def prompt(lengths, length, seed=0):
    """Left-padded random q `[B, Hq, L, D]`, k, v `[B, Hkv, L, D]` and pad `[B, L]` for rows of `lengths`."""
    gen = torch.Generator().manual_seed(seed)
    pad = torch.arange(length) >= (length - torch.tensor(lengths))[:, None]
    q = torch.randn(BATCH, Q_HEADS, length, HEAD_DIM, generator=gen)
    k, v = (torch.randn(BATCH, KV_HEADS, length, HEAD_DIM, generator=gen) for _ in range(2))
    return q, k, v, pad


def prefill(policy, q, k, v, pad):
    """Stores the prompt of one layer; returns the held positions of each row and KV head."""
    policy.allocate(CacheSpec(batch=BATCH, layers=1, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                              prompt_len=q.shape[2], max_new_tokens=4, dtype=torch.float32,
                              device=torch.device("cpu"), scale=SCALE))
    policy.begin_prefill(pad, (pad.long().cumsum(dim=-1) - 1).clamp(min=0))
    policy.attend(0, q, *policy.store(0, k, v), SCALE)
    slots = policy.layers[0]
    return [[sorted(slots.positions[b, h][slots.valid[b, h]].tolist()) for h in range(KV_HEADS)]
            for b in range(BATCH)]


def longflow_prompt_score(q, k, v, n):
    """LongFlow's score of one unpadded row's n prompt tokens, with loops: the last query's attention
    p_hj (causal: over every prompt token), times ||v_j||_1, summed over all query heads."""
    group = Q_HEADS // KV_HEADS
    score = [0.0] * n
    for h in range(Q_HEADS):
        logits = torch.tensor([float(q[h, n - 1] @ k[h // group, j]) * SCALE for j in range(n)], dtype=torch.float64)
        probs = torch.softmax(logits, dim=0)
        for j in range(n):
            score[j] += float(probs[j]) * float(v[h // group, j].abs().sum())
    return score


def top(score, count, always=()):
    """The `always` positions, then the best of the rest by score, in position order."""
    rest = sorted((j for j in range(len(score)) if j not in always), key=lambda j: -score[j])
    return sorted([*always, *rest[:count - len(always)]])


@pytest.mark.parametrize("n_sink", [0, 2])
def test_by_score_keeps_the_tokens_the_score_ranks_top(n_sink):
    """Rows of 30 and 24 real tokens above the budget of 10, one of 6 below it (kept whole)."""
    budget, length, lengths = 10, 30, [30, 24, 6]
    q, k, v, pad = prompt(lengths, length)
    held = prefill(LongFlowPolicy(budget, n_sink=n_sink, prefill="by_score"), q, k, v, pad)
    for b, n in enumerate(lengths):
        row = slice(length - n, length)
        expected = list(range(n))
        if n > budget - 1:
            expected = top(longflow_prompt_score(q[b, :, row], k[b, :, row], v[b, :, row], n), budget - 1,
                           always=range(n_sink))
        assert held[b] == [expected] * KV_HEADS


def official_snapkv(q, k, keep, heads, window=32, kernel=5):
    """SnapKV's official rule (`SnapKVCluster.update_kv`) for one unpadded row, with loops: q `[Hq,
    n, D]`, k `[Hkv, n, D]` -> the kept positions. Each window query's softmax over every key it
    sees (causal); its rows summed over the window queries and the query heads `heads`, at the keys
    before the window only; those sums average-pooled over `kernel` (zero beyond them); the top
    keep - window of them, and the window."""
    q_heads, n, dim = q.shape
    group, scored = q_heads // k.shape[0], n - window
    sums = torch.zeros(scored, dtype=torch.float64)
    for h in heads:
        for t in range(scored, n):
            logits = torch.tensor([float(q[h, t] @ k[h // group, j]) * dim ** -0.5 for j in range(t + 1)],
                                  dtype=torch.float64)
            sums += torch.softmax(logits, dim=0)[:scored]
    half = kernel // 2
    pooled = [float(sums[max(0, j - half):j + half + 1].sum()) / kernel for j in range(scored)]
    return top(pooled, keep - window) + list(range(scored, n))


@pytest.mark.parametrize("policy", ["longflow", "per_kv_head"])
def test_snapkv_is_the_official_rule(policy):
    """Rows of 60 and 50 real tokens (left padding) above the budget of 41, one of 20 below it."""
    budget, length, lengths = 41, 60, [60, 50, 20]
    q, k, v, pad = prompt(lengths, length, seed=2)
    if policy == "longflow":  # one selection per layer: every query head's attention summed
        held = prefill(LongFlowPolicy(budget), q, k, v, pad)
    else:
        held = prefill(KeyDiffPolicy(budget, compress_every=4, prefill="snapkv"), q, k, v, pad)
    group = Q_HEADS // KV_HEADS
    for b, n in enumerate(lengths):
        row = slice(length - n, length)
        for h in range(KV_HEADS):
            heads = range(Q_HEADS) if policy == "longflow" else range(h * group, (h + 1) * group)
            expected = official_snapkv(q[b, :, row], k[b, :, row], budget - 1, heads) if n > budget - 1 \
                else list(range(n))
            assert held[b][h] == expected


def test_snapkv_stays_the_default_and_chooses_otherwise():
    q, k, v, pad = prompt([30, 24, 6], 30)
    assert LongFlowPolicy(10).prefill == "snapkv"
    assert prefill(LongFlowPolicy(10), q, k, v, pad)[:2] != prefill(LongFlowPolicy(10, prefill="by_score"),
                                                                     q, k, v, pad)[:2]


def test_keydiff_cuts_its_prompt_by_its_score():
    """KeyDiff's default: per KV head, the keys least similar to the mean unit key of the prompt."""
    budget, length, lengths = 10, 30, [30, 24, 6]
    q, k, v, pad = prompt(lengths, length, seed=1)
    held = prefill(KeyDiffPolicy(budget, compress_every=4), q, k, v, pad)
    for b, n in enumerate(lengths):
        for h in range(KV_HEADS):
            keys = k[b, h, length - n:].double()
            unit = keys / keys.norm(dim=-1, keepdim=True)
            anchor = unit.mean(dim=0)
            score = [-float(keys[j] @ anchor / (keys[j].norm() * anchor.norm())) for j in range(n)]
            assert held[b][h] == (top(score, budget - 1) if n > budget - 1 else list(range(n)))


def test_by_score_is_refused_where_it_cannot_be_defined():
    with pytest.raises(UserError, match="own rule"):
        H2OPolicy(16, prefill="by_score")  # its prompt rule is its own (accumulated prompt attention)
    with pytest.raises(UserError, match="own rule"):
        TOVAPolicy(16, prefill="by_score")
    with pytest.raises(UserError, match="prefill must be one of"):
        LongFlowPolicy(16, prefill="topk")
    ams = AMSPolicy(64, scorer=TOVAPolicy(), compress_every=16, prefill="by_score")
    with pytest.raises(UserError, match="per-slot state"):  # its credit lives only in slots
        prefill(ams, *prompt([30, 24, 6], 30))
