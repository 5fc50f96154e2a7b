"""Kara: Token2Chunk on hand-set scores, the bidirectional window score against a plain loop, and the
policy's windows in both budget modes driven step by step.

Greedy tokens equal the full cache's with a large budget, and the budget holds at every step (the
capped default): tests/test_methods.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import yaml
from helpers import REPO, drive_layer, method_defaults, policy_of

from baselines.kara import KaraPolicy, token2chunk, window_scores
from longflow.errors import UserError
from longflow.methods import locate

pytestmark = pytest.mark.filterwarnings("ignore:.*leaves no room:UserWarning")

# Window of 12; the quota of 6 candidates is positions 0, 3, 4, 7, 8, 11 (scores 9, 8, 1, 7, 6.5, 6).
SCORES = [9.0, 0.0, 0.0, 8.0, 1.0, 0.0, 0.0, 7.0, 6.5, 0.0, 0.0, 6.0]


@pytest.mark.parametrize("width,quantile,tokens,expected", [
    # Median of the candidates' scores 6.75: only (0, 3) has both endpoints above it; its 4 tokens fit.
    (4, 0.5, 4, {0, 1, 2, 3, 7, 8}),
    # ... but not into 3 chunk tokens: no chunk, the quota is the top 6 single tokens.
    (4, 0.5, 3, {0, 3, 4, 7, 8, 11}),
    # Every pair eligible: (0, 3) then (7, 8) fill the 6 chunk tokens; (8, 11) no longer fits.
    (4, 0.0, 6, {0, 1, 2, 3, 7, 8}),
    # 5 chunk tokens: (0, 3), then (7, 8) and (8, 11) skipped, (3, 4) fits (1 new token); one single: 7.
    (5, 0.0, 5, {0, 1, 2, 3, 4, 7}),
    # A pair spanning more than the chunk width is no chunk: (4, 7) spans 4 tokens, (0, 3) too, so
    # width 3 leaves only the adjacent pairs (3, 4) and (7, 8), which add nothing beyond the candidates.
    (3, 0.0, 6, {0, 3, 4, 7, 8, 11}),
])
def test_token2chunk_on_hand_set_scores(width, quantile, tokens, expected):
    kept = token2chunk(torch.tensor([SCORES]), quota=6, chunk_width=width, chunk_tokens=tokens,
                       endpoint_quantile=quantile)
    assert set(kept[0].nonzero()[:, 0].tolist()) == expected


def test_token2chunk_keeps_exactly_the_quota_per_line():
    torch.manual_seed(0)
    scores = torch.rand(50, 32)
    for quota in (1, 5, 10, 32):
        kept = token2chunk(scores, quota, chunk_width=6, chunk_tokens=quota // 2, endpoint_quantile=0.3)
        assert kept.sum(dim=-1).tolist() == [quota] * 50


def plain_window_scores(queries, keys, scale, shared):
    """score[b, kv, j] = sum over the window's queries i and heads h (of kv, or all) of softmax_j(q_i.k_j)."""
    rows, q_heads, window, _ = queries.shape
    kv_heads = keys.shape[1]
    group = q_heads // kv_heads
    out = torch.zeros(rows, kv_heads, window)
    for b in range(rows):
        for h in range(q_heads):
            for i in range(window):
                p = torch.softmax(torch.stack([queries[b, h, i] @ keys[b, h // group, j] for j in range(window)])
                                  * scale, dim=0)
                for kv in range(kv_heads):
                    if shared or kv == h // group:
                        out[b, kv] += p
    return out


@pytest.mark.parametrize("shared", [True, False])
def test_window_scores_are_bidirectional_attention_received(shared):
    torch.manual_seed(0)
    queries, keys = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8)
    torch.testing.assert_close(window_scores(queries, keys, 0.35, shared),
                               plain_window_scores(queries, keys, 0.35, shared))


def drive(policy, prompt=6, steps=30, seed=0):
    """One layer, one row, through `drive_layer`; returns (held positions per step, queries, keys)."""
    torch.manual_seed(seed)
    q_heads, kv_heads, dim = 4, 2, 8
    q = 2 * torch.randn(1, q_heads, prompt, dim)
    k, v = torch.randn(2, 1, kv_heads, prompt, dim)
    step_inputs = [(2 * torch.randn(1, q_heads, 1, dim), torch.randn(1, kv_heads, 1, dim),
                    torch.randn(1, kv_heads, 1, dim)) for _ in range(steps)]
    held, _ = drive_layer(policy, q, k, v, torch.ones(1, prompt, dtype=torch.bool), step_inputs, dim ** -0.5)
    queries = torch.cat([q] + [s[0] for s in step_inputs], dim=2)  # [1, Hq, prompt + steps, D] by position
    keys = torch.cat([k] + [s[1] for s in step_inputs], dim=2)
    return [h[0][0] for h in held], queries, keys


def window_choice(queries, keys, start, window, quota, policy):
    """The positions Token2Chunk keeps of the window starting at position `start`, and their scores."""
    span = slice(start, start + window)
    scores = plain_window_scores(queries[:, :, span], keys[:, :, span], 8 ** -0.5, shared=True)[0, 0]
    kept = token2chunk(scores[None], quota, policy.chunk_width, int(policy.chunk_budget * quota),
                       policy.endpoint_quantile)[0]
    return {start + j for j in kept.nonzero()[:, 0].tolist()}, scores


def test_ratio_mode_frees_each_window_to_its_token2chunk_choice_and_grows_past_any_budget():
    policy = KaraPolicy(None, window=8, ratio=0.5, chunk_width=3, budget_mode="ratio")
    held, queries, keys = drive(policy)
    prompt, window, quota = 6, 8, 4
    kept = set(range(prompt))
    for closed in range(3):  # window w covers positions prompt + 8w ... prompt + 8w + 7
        start = prompt + window * closed
        chosen, _ = window_choice(queries, keys, start, window, quota, policy)
        kept |= chosen
        step = window * (closed + 1)  # the first step after the window's end
        assert held[step] == kept | {prompt + step}
    assert len(held[-1]) == prompt + 3 * quota + (30 - 24)
    assert max(policy.peak_slots()) == prompt + 3 * quota + 6  # the end: no budget bounds it


def test_cap_mode_frees_dropped_tokens_first_and_only_when_room_is_needed():
    policy = KaraPolicy(20, window=8, ratio=0.5, chunk_width=3)
    held, queries, keys = drive(policy)
    prompt, window, quota = 6, 8, 4
    assert all(len(h) <= 20 for h in held)
    # Window 1 (positions 6-13): 6 + 8 held, the next window needs 8 of the 20: 2 of its 8 tokens go,
    # the lowest-scored of those Token2Chunk drops.
    chosen, scores = window_choice(queries, keys, prompt, window, quota, policy)
    dropped = sorted(set(range(prompt, prompt + window)) - chosen, key=lambda p: scores[p - prompt])
    assert held[8] == set(range(prompt)) | chosen | set(dropped[2:]) | {prompt + 8}
    # Window 2: 6 + 6 + 8 held, 12 kept: the prompt and 6 of the 8 tokens the two windows chose.
    second, _ = window_choice(queries, keys, prompt + window, window, quota, policy)
    after = held[16] - {prompt + 16}
    assert set(range(prompt)) <= after and len(after) == 12 and after - set(range(prompt)) <= chosen | second


@pytest.mark.parametrize("prompt,steps", [(6, 30), (12, 4)])  # windows that close / an output shorter than W
def test_a_budget_of_exactly_the_stored_tokens_evicts_nothing(prompt, steps):
    # `drive` generates steps + 1 tokens and stores steps of them: the last generated one never is.
    policy = KaraPolicy(prompt + steps, window=8, ratio=0.25)
    held, _, _ = drive(policy, prompt=prompt, steps=steps)
    assert held == [set(range(prompt + step + 1)) for step in range(steps)]


def test_the_last_window_frees_only_the_room_of_the_tokens_still_to_be_stored():
    policy = KaraPolicy(20, window=8, ratio=0.5, chunk_width=3)
    held, _, _ = drive(policy, steps=30)
    # The third window closes after 24 stored tokens; 31 are generated, 30 stored: 6 still to come,
    # so the cut keeps 20 - 6 = 14 and the last step holds the whole budget.
    assert len(held[24]) == 14 + 1 and len(held[-1]) == 20


def test_window_shrinks_under_a_small_budget_and_bad_fields_are_user_errors():
    with pytest.warns(UserWarning, match="leaves no room"):
        policy = KaraPolicy(96)
    assert policy.span == 24 and policy.quota == math.ceil(0.3 * 24)
    assert KaraPolicy(384).span == 128
    with pytest.raises(UserError, match="budget_mode"):
        KaraPolicy(96, budget_mode="target")
    with pytest.raises(UserError, match="ratio"):
        KaraPolicy(384, ratio=0.0)


def test_config():
    fields = yaml.safe_load((REPO / "conf" / "method" / "kara.yaml").read_text())
    assert fields.pop("name") == KaraPolicy.name and locate(fields.pop("_target_")) is KaraPolicy
    assert fields == method_defaults(KaraPolicy)
    assert isinstance(policy_of("kara", 384), KaraPolicy)
