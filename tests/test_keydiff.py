"""KeyDiff: a plain transcription of docs/methods.md (kvpress's KeyDiffPress score, block-wise schedule)
on random tensors, and its config. Large budget = the full cache's tokens and the hard cap: test_methods.py."""

from __future__ import annotations

import pytest
import torch
import yaml
from helpers import REPO, drive_layer, method_defaults, policy_of

from baselines.keydiff import KeyDiffPolicy
from longflow.errors import UserError
from longflow.methods import locate


def keydiff_by_hand(keys: dict, held: set) -> dict:
    """{position: -cos(k_j, mean_i k_i / ||k_i||)} over `held`, for one row and KV head (float64)."""
    unit = sum(keys[p].double() / keys[p].double().norm() for p in held) / len(held)
    return {p: -float(keys[p].double() @ unit / (keys[p].double().norm() * unit.norm())) for p in held}


def reference_keydiff(q, k, v, pad, steps, budget, keep_after, scale):
    """Per row and KV head: the prompt cut to budget - 1 by the score over its keys; then each step's
    token appended, attended, and a full cache (budget) cut to `keep_after` by the score over the held
    keys. Returns the held positions per step `[t][b][h]` and the outputs `[B, Hq, D]` per step."""
    batch, q_heads, length, _ = q.shape
    kv_heads = k.shape[1]
    group = q_heads // kv_heads
    held_log = [[[None] * kv_heads for _ in range(batch)] for _ in steps]
    outputs = [torch.zeros(batch, q_heads, q.shape[-1]) for _ in steps]
    for b in range(batch):
        n = int(pad[b].sum())
        for h in range(kv_heads):
            keys = {p: k[b, h, length - n + p] for p in range(n)}
            values = {p: v[b, h, length - n + p] for p in range(n)}
            held = set(range(n))
            if n > budget - 1:
                score = keydiff_by_hand(keys, held)
                held = set(sorted(held, key=lambda p, score=score: -score[p])[:budget - 1])
            for t, (qs, ks, vs) in enumerate(steps):
                keys[n + t], values[n + t] = ks[b, h, 0], vs[b, h, 0]
                held.add(n + t)
                held_log[t][b][h] = set(held)
                order = sorted(held)
                for g in range(group):
                    query = qs[b, h * group + g, 0]
                    weights = torch.softmax(torch.stack([query @ keys[p] for p in order]) * scale, dim=0)
                    outputs[t][b, h * group + g] = sum(w * values[p] for w, p in zip(weights, order, strict=True))
                if len(held) == budget:
                    score = keydiff_by_hand(keys, held)
                    held = set(sorted(held, key=lambda p, score=score: -score[p])[:keep_after])
    return held_log, outputs


@pytest.mark.parametrize("budget", [9, 30])  # the prompt cut at prefill / kept whole
def test_matches_the_transcription(budget):
    torch.manual_seed(0)
    batch, q_heads, kv_heads, length, head_dim, compress_every = 3, 4, 2, 16, 8, 3
    pad = torch.arange(length)[None, :] >= (length - torch.tensor([16, 10, 5]))[:, None]
    q = torch.randn(batch, q_heads, length, head_dim)
    k = torch.randn(batch, kv_heads, length, head_dim) + torch.randn(batch, kv_heads, 1, head_dim)
    v = torch.randn(batch, kv_heads, length, head_dim)
    steps = [(torch.randn(batch, q_heads, 1, head_dim), torch.randn(batch, kv_heads, 1, head_dim),
              torch.randn(batch, kv_heads, 1, head_dim)) for _ in range(25)]
    scale = head_dim ** -0.5
    policy = KeyDiffPolicy(budget, compress_every=compress_every)
    held, outputs = drive_layer(policy, q, k, v, pad, steps, scale)
    expected_held, expected_outputs = reference_keydiff(q, k, v, pad, steps, budget, budget - compress_every, scale)
    assert held == expected_held
    for got, expected in zip(outputs, expected_outputs, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    if budget == 9:  # every row is cut, again and again: right after a cut a query sees keep_after + 1
        for b in range(batch):
            sizes = [len(step[b][0]) for step in held]
            assert sizes.count(budget - compress_every + 1) >= 5 and max(sizes) == budget


def test_config_and_validation():
    fields = yaml.safe_load((REPO / "conf" / "method" / "keydiff.yaml").read_text())
    assert fields.pop("name") == KeyDiffPolicy.name and locate(fields.pop("_target_")) is KeyDiffPolicy
    assert fields == method_defaults(KeyDiffPolicy)
    assert policy_of("keydiff", 1024).keep_after == 896
    with pytest.warns(UserWarning, match="using 10"):
        assert KeyDiffPolicy(40).keep_after == 30
    for bad in (dict(budget=2), dict(compress_every=0)):
        with pytest.raises(UserError):
            KeyDiffPolicy(**{"budget": 64, **bad})
