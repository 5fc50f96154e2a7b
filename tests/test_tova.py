"""TOVA: a plain transcription of the official cache (`TOVACache.reduce`) on random tensors, and its config.

Greedy tokens equal the full cache's with a large budget, and the budget holds at every step, for
every method config: tests/test_methods.py.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from helpers import REPO, drive_layer, method_defaults, policy_of

from baselines.tova import TOVAPolicy
from longflow.methods import locate


def official_tova(q, k, v, pad, steps, cache_size, scale):
    """The official `TOVACache` driven by `generate`, row by row, on dicts keyed by position.

    After the prompt forward, and after every step's attention once the cache holds more than
    `cache_size` tokens, the cache keeps the top `cache_size` by the last query's attention
    averaged over all query heads. Returns the positions each step's query attended to and the
    outputs `[B, Hq, D]` per step.
    """
    batch, q_heads, length, _ = q.shape
    group = q_heads // k.shape[1]
    held_log = [[] for _ in steps]
    outputs = [torch.zeros(batch, q_heads, q.shape[-1]) for _ in steps]
    for b in range(batch):
        n = int(pad[b].sum())
        offset = length - n
        keys = {p: k[b, :, offset + p] for p in range(n)}
        values = {p: v[b, :, offset + p] for p in range(n)}

        def attention(query, held, keys=keys, values=values):  # query [Hq, D] -> probs [Hq, held], out [Hq, D]
            order = sorted(held)
            probs, out = [], []
            for h in range(q_heads):
                p = torch.softmax(torch.stack([query[h] @ keys[j][h // group] for j in order]) * scale, dim=0)
                probs.append(p)
                out.append(sum(w * values[j][h // group] for w, j in zip(p, order, strict=True)))
            return order, torch.stack(probs), torch.stack(out)

        held = set(range(n))
        order, probs, _ = attention(q[b, :, offset + n - 1], held)  # the last prompt query, causal
        if len(held) > cache_size:
            mean = probs.mean(dim=0)
            held = {order[i] for i in mean.topk(cache_size).indices.tolist()}
        for t, (qs, ks, vs) in enumerate(steps):
            current = n + t
            keys[current], values[current] = ks[b, :, 0], vs[b, :, 0]
            held.add(current)
            order, probs, out = attention(qs[b, :, 0], held)
            held_log[t].append(set(held))
            outputs[t][b] = out
            if len(held) > cache_size:
                mean = probs.mean(dim=0)
                held = {order[i] for i in mean.topk(cache_size).indices.tolist()}
    return held_log, outputs


@pytest.mark.parametrize("cache_size", [7, 20])  # prompt cut at prefill / kept whole
def test_matches_the_official_cache(cache_size):
    torch.manual_seed(0)
    batch, q_heads, kv_heads, length, head_dim = 3, 4, 2, 16, 8
    pad = torch.arange(length)[None, :] >= (length - torch.tensor([16, 10, 5]))[:, None]  # left padding
    q = 2 * torch.randn(batch, q_heads, length, head_dim)
    k, v = torch.randn(2, batch, kv_heads, length, head_dim)
    steps = [(2 * torch.randn(batch, q_heads, 1, head_dim), torch.randn(batch, kv_heads, 1, head_dim),
              torch.randn(batch, kv_heads, 1, head_dim)) for _ in range(20)]
    scale = head_dim ** -0.5
    policy = TOVAPolicy(cache_size + 1)  # the budget counts the new token
    held, outputs = drive_layer(policy, q, k, v, pad, steps, scale)
    expected_held, expected_outputs = official_tova(q, k, v, pad, steps, cache_size, scale)
    for t in range(len(steps)):
        for b in range(batch):
            assert all(held[t][b][h] == expected_held[t][b] for h in range(kv_heads)), f"step {t}, row {b}"
        torch.testing.assert_close(outputs[t], expected_outputs[t], rtol=1e-4, atol=1e-5)


def test_config():
    fields = yaml.safe_load((REPO / "conf" / "method" / "tova.yaml").read_text())
    assert fields.pop("name") == TOVAPolicy.name and locate(fields.pop("_target_")) is TOVAPolicy
    # `use_kernel` picks an implementation of the same score: outside the yaml and a run's identity
    assert fields == {} and method_defaults(TOVAPolicy) == {"use_kernel": "auto"}
    assert isinstance(policy_of("tova", 64), TOVAPolicy)
