"""Expected Attention: a plain transcription of docs/methods.md (kvpress's ExpectedAttentionPress, its
decoding schedule) on random tensors, with RoPE written out as 2x2 rotations; the calibration-file
variant; the config. Large budget = the full cache's tokens and the hard cap: test_methods.py."""

from __future__ import annotations

import math

import pytest
import torch
import yaml
from helpers import REPO, drive_layer, method_defaults, policy_of
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from baselines.expected_attention import ExpectedAttentionPolicy
from longflow.errors import UserError
from longflow.methods import locate

HEAD_DIM, THETA = 8, 500.0


def rotary_module() -> LlamaRotaryEmbedding:
    return LlamaRotaryEmbedding(LlamaConfig(hidden_size=2 * HEAD_DIM, num_attention_heads=2, head_dim=HEAD_DIM,
                                            max_position_embeddings=4096, rope_theta=THETA))


def rotation(position: int) -> torch.Tensor:
    """RoPE at `position` as a `[D, D]` float64 matrix: dims i and i + D/2 rotate by position * theta^(-2i/D)."""
    half = HEAD_DIM // 2
    matrix = torch.zeros(HEAD_DIM, HEAD_DIM, dtype=torch.float64)
    for i in range(half):
        angle = position * THETA ** (-2 * i / HEAD_DIM)
        c, s = math.cos(angle), math.sin(angle)
        matrix[i, i], matrix[i, i + half], matrix[i + half, i], matrix[i + half, i + half] = c, -s, s, c
    return matrix


def statistics_by_hand(queries):
    """Mean `[Hq, D]` and population covariance `[Hq, D, D]` (float64) of queries {position: [Hq, D]} after
    RoPE, each rotated back by its own position first."""
    before = torch.stack([torch.stack([rotation(p).T @ qh.double() for qh in query]) for p, query in queries.items()])
    mean = before.mean(dim=0)
    centered = before - mean
    return mean, torch.einsum("whi,whj->hij", centered, centered) / len(queries)


def scores_by_hand(keys, values, held, mean, cov, newest, n_sink, n_future, epsilon, group):
    """One row. keys/values: {position: [Hkv, D]} (keys after RoPE); mean, cov: the query statistics
    before RoPE. Returns {position: score} per KV head (sinks left out)."""
    kv_heads = next(iter(keys.values())).shape[0]
    average = sum(rotation(newest + 1 + f) for f in range(n_future)) / n_future
    result = []
    for h in range(kv_heads):
        scored = sorted(p for p in held if p >= n_sink)
        probs = 0
        for g in range(group):
            head = h * group + g
            mu, sigma = average @ mean[head].double(), average @ cov[head].double() @ average.T
            z = torch.tensor([float(keys[p][h].double() @ mu) / math.sqrt(HEAD_DIM)
                              + float(keys[p][h].double() @ sigma @ keys[p][h].double()) / HEAD_DIM / 2
                              for p in scored], dtype=torch.float64)
            probs = probs + torch.softmax(z, dim=0) / group
        result.append({p: (float(probs[i]) + epsilon) * float(values[p][h].double().norm())
                       for i, p in enumerate(scored)})
    return result


def keep_by_hand(scores, held, n_sink, count):
    """Per KV head: the sinks held, then the best scored, `count` in all."""
    kept = []
    for h, head_scores in enumerate(scores):
        sinks = {p for p in held[h] if p < n_sink}
        rest = sorted((p for p in held[h] if p >= n_sink), key=lambda p, s=head_scores: -s[p])
        kept.append(sinks | set(rest[:count - len(sinks)]))
    return kept


def reference_ea(q, k, v, pad, steps, budget, keep_after, n_sink, n_future, n_queries, epsilon, scale):
    """Per row: the prompt cut to budget - 1 (statistics of every prompt query after the sinks, future
    positions after the prompt); each step's token appended and attended; a full cache cut to
    `keep_after` per KV head (statistics of the `n_queries` newest queries after the sinks). The sinks
    are always kept. Returns held positions `[t][b][h]` and outputs `[B, Hq, D]` per step."""
    batch, q_heads, length, _ = q.shape
    kv_heads = k.shape[1]
    group = q_heads // kv_heads
    held_log = [[None] * batch for _ in steps]
    outputs = [torch.zeros(batch, q_heads, HEAD_DIM) for _ in steps]

    def cut(keys, values, held, queries, newest, count):
        mean, cov = statistics_by_hand(queries)
        scores = scores_by_hand(keys, values, held[0] | held[1], mean, cov, newest, n_sink, n_future, epsilon,
                                group)
        return keep_by_hand(scores, held, n_sink, count)

    for b in range(batch):
        n = int(pad[b].sum())
        keys = {p: k[b, :, length - n + p] for p in range(n)}
        values = {p: v[b, :, length - n + p] for p in range(n)}
        queries = {p: q[b, :, length - n + p] for p in range(n)}
        held = [set(range(n)) for _ in range(kv_heads)]
        if n > budget - 1:
            prompt_queries = {p: queries[p] for p in range(n_sink, n)}
            held = cut(keys, values, held, prompt_queries, n - 1, budget - 1)
        for t, (qs, ks, vs) in enumerate(steps):
            current = n + t
            keys[current], values[current], queries[current] = ks[b, :, 0], vs[b, :, 0], qs[b, :, 0]
            for h in range(kv_heads):
                held[h].add(current)
                order = sorted(held[h])
                for g in range(group):
                    query = qs[b, h * group + g, 0]
                    weights = torch.softmax(torch.stack([query @ keys[p][h] for p in order]) * scale, dim=0)
                    outputs[t][b, h * group + g] = sum(w * values[p][h] for w, p in zip(weights, order, strict=True))
            held_log[t][b] = [set(s) for s in held]
            if len(held[0]) == budget:
                recent = {p: queries[p] for p in range(max(n_sink, current - n_queries + 1), current + 1)}
                held = cut(keys, values, held, recent, current, keep_after)
    return held_log, outputs


@pytest.mark.parametrize("budget", [12, 40])  # prompt cut / whole
def test_matches_the_transcription(budget):
    torch.manual_seed(0)
    batch, q_heads, kv_heads, length = 3, 4, 2, 16
    n_sink, n_future, n_queries, compress_every, epsilon = 2, 16, 6, 4, 0.01
    pad = torch.arange(length)[None, :] >= (length - torch.tensor([16, 10, 5]))[:, None]
    q = torch.randn(batch, q_heads, length, HEAD_DIM) + 0.5
    k = torch.randn(batch, kv_heads, length, HEAD_DIM)
    v = torch.randn(batch, kv_heads, length, HEAD_DIM)
    steps = [(torch.randn(batch, q_heads, 1, HEAD_DIM) + 0.5, torch.randn(batch, kv_heads, 1, HEAD_DIM),
              torch.randn(batch, kv_heads, 1, HEAD_DIM)) for _ in range(22)]
    scale = HEAD_DIM ** -0.5
    policy = ExpectedAttentionPolicy(budget, compress_every=compress_every, n_sink=n_sink, n_queries=n_queries,
                                     n_future_positions=n_future, epsilon=epsilon)
    held, outputs = drive_layer(policy, q, k, v, pad, steps, scale, rotary=rotary_module())
    expected_held, expected_outputs = reference_ea(q, k, v, pad, steps, budget, budget - compress_every, n_sink,
                                                   n_future, n_queries, epsilon, scale)
    assert held == expected_held
    for got, expected in zip(outputs, expected_outputs, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    if budget == 12:  # each row is cut several times
        assert sum(len(step[0][0]) == budget - compress_every + 1 for step in held) >= 4


def test_calibrated_statistics_replace_the_queries(tmp_path):
    """With `query_stats` the statistics are the file's, for every row, and no query is stored."""
    torch.manual_seed(1)
    rows, q_heads, kv_heads, length, n_sink, n_future = 2, 4, 2, 20, 1, 4
    k, v = torch.randn(2, rows, kv_heads, length, HEAD_DIM)
    mean = torch.randn(1, q_heads, HEAD_DIM)  # [layers, Hq, D]: one layer
    spread = torch.randn(1, q_heads, HEAD_DIM, HEAD_DIM) * 0.3
    cov = spread @ spread.transpose(-1, -2)
    path = tmp_path / "stats.pt"
    torch.save({"query_mean": mean, "query_cov": cov}, path)
    policy = ExpectedAttentionPolicy(8, compress_every=4, n_sink=n_sink, n_future_positions=n_future,
                                     query_stats=str(path))
    assert policy.query_window() == 0
    pad = torch.ones(rows, length, dtype=torch.bool)
    q = torch.randn(rows, q_heads, length, HEAD_DIM)
    drive_layer(policy, q, k, v, pad, [], HEAD_DIM ** -0.5, rotary=rotary_module())
    assert policy.history is None
    slots = policy.layers[0]
    for row in range(rows):
        keys = {p: k[row, :, p] for p in range(length)}
        values = {p: v[row, :, p] for p in range(length)}
        scores = scores_by_hand(keys, values, set(range(length)), mean[0], cov[0], length - 1, n_sink, n_future,
                                0.0, q_heads // kv_heads)
        expected = keep_by_hand(scores, [set(range(length))] * kv_heads, n_sink, 7)
        assert [set(slots.positions[row, h][slots.valid[row, h]].tolist()) for h in range(kv_heads)] == expected
    bad = tmp_path / "other_model.pt"
    torch.save({"query_mean": mean[:, :2], "query_cov": cov}, bad)
    with pytest.raises(UserError, match="another model"):
        drive_layer(ExpectedAttentionPolicy(8, query_stats=str(bad), compress_every=4, n_sink=1), q, k, v, pad, [],
                    0.3, rotary=rotary_module())
    with pytest.raises(UserError, match="not found"):
        ExpectedAttentionPolicy(8, query_stats=str(tmp_path / "missing.pt"))


def test_config_and_validation():
    fields = yaml.safe_load((REPO / "conf" / "method" / "expected_attention.yaml").read_text())
    assert fields.pop("name") == ExpectedAttentionPolicy.name
    assert locate(fields.pop("_target_")) is ExpectedAttentionPolicy
    assert fields == method_defaults(ExpectedAttentionPolicy)
    assert policy_of("expected_attention", 1024).keep_after == 512
    for bad in (dict(budget=4), dict(n_queries=0), dict(epsilon=-1.0)):
        with pytest.raises(UserError):
            ExpectedAttentionPolicy(**{"budget": 64, **bad})
