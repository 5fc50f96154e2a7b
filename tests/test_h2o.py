"""H2O: the budget cap and recent window at every step, and a plain transcription of docs/methods.md."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from helpers import LONG_TEXTS, VARIANTS, capped, drive_layer, generate, method_defaults, policy_of

from baselines.h2o import H2OPolicy, prompt_attention_sums
from longflow.errors import UserError
from longflow.methods import locate
from longflow.policy import CacheSpec

CONF = Path(__file__).resolve().parents[1] / "conf" / "method" / "h2o.yaml"


class CheckedH2O(capped(H2OPolicy)):
    """The hard cap (`capped`), and the recent window at every decode step."""

    def attend(self, layer, q, k, v, scale):
        out = super().attend(layer, q, k, v, scale)
        slots = self.layers[layer]
        if self.shared_selection:
            assert torch.equal(slots.positions, slots.positions[:, :1].expand_as(slots.positions))
        if not self.prefilling:
            for row, current in enumerate(self.positions.tolist()):
                window = set(range(max(0, current - self.recent + 1), current + 1))
                for head in range(slots.valid.shape[1]):
                    held = slots.positions[row, head][slots.valid[row, head]].tolist()
                    assert window <= set(held) and len(set(held)) == len(held)
        return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_budget_cap_at_every_step(tiny, variant):
    prompts, result = generate(tiny, lambda: CheckedH2O(12, variant=variant), LONG_TEXTS)
    assert min(map(len, prompts)) > 12  # prefill compression runs
    assert result.peak_slots == [12, 12]


# ---- an independent transcription of docs/methods.md, on random tensors -------------------------


def reference_h2o(q, k, v, pad, steps, budget, recent, variant, scale):
    """H2O by loops over rows, KV heads and query heads, on dicts keyed by position.

    Returns, per decode step, the held positions `[b][h] -> set` that the step's query attended to,
    the outputs `[B, Hq, D]`, and the final scores `[b][h] -> {position: score}`.
    """
    batch, q_heads, length, _ = q.shape
    kv_heads = k.shape[1]
    group = q_heads // kv_heads
    held_log, out_log = [[] for _ in steps], [torch.zeros(batch, q_heads, q.shape[-1]) for _ in steps]
    final = []
    for b in range(batch):
        n = int(pad[b].sum())
        offset = length - n
        keys = [{p: k[b, h, offset + p] for p in range(n)} for h in range(kv_heads)]
        values = [{p: v[b, h, offset + p] for p in range(n)} for h in range(kv_heads)]
        sums = [dict.fromkeys(range(n), 0.0) for _ in range(kv_heads)]
        for h in range(kv_heads):
            for g in range(group):
                for i in range(n):
                    logits = torch.stack([q[b, h * group + g, offset + i] @ keys[h][j] for j in range(i + 1)])
                    for j, p in enumerate(torch.softmax(logits * scale, dim=0).tolist()):
                        sums[h][j] += p
        if variant == "lf_repo":  # one selection: summed over all heads
            total = {p: sum(s[p] for s in sums) for p in range(n)}
            sums = [dict(total) for _ in range(kv_heads)]
        held = []
        for h in range(kv_heads):
            if n <= budget - 1:
                held.append(set(range(n)))
                continue
            protected = set(range(n - recent + 1, n))
            rest = sorted(set(range(n)) - protected, key=lambda p, h=h: -sums[h][p])
            held.append(protected | set(rest[: budget - 1 - len(protected)]))
        scores = [{p: sums[h][p] for p in held[h]} for h in range(kv_heads)]
        for t, (qs, ks, vs) in enumerate(steps):
            current = n + t
            attention = []
            for h in range(kv_heads):
                keys[h][current], values[h][current] = ks[b, h, 0], vs[b, h, 0]
                held[h].add(current)
                assert len(held[h]) <= budget
                order = sorted(held[h])
                received = dict.fromkeys(order, 0.0)
                for g in range(group):
                    logits = torch.stack([qs[b, h * group + g, 0] @ keys[h][p] for p in order]) * scale
                    probs = torch.softmax(logits, dim=0)
                    mixed = sum(pr * values[h][p] for pr, p in zip(probs, order, strict=True))
                    out_log[t][b, h * group + g] = mixed
                    for p, pr in zip(order, probs.tolist(), strict=True):
                        received[p] += pr
                attention.append(received)
            held_log[t].append([set(s) for s in held])
            for h in range(kv_heads):
                if variant == "paper":
                    scores[h][current] = 0.0
                    for p, a in attention[h].items():
                        scores[h][p] += a
                else:
                    scores[h] = {p: sum(a[p] for a in attention) for p in held[h]}
            for h in range(kv_heads):
                if len(held[h]) == budget:  # full: the next token needs a slot
                    candidates = [p for p in held[h] if p < current - recent + 2]
                    held[h].remove(min(candidates, key=lambda p, h=h: scores[h][p]))
        final.append(scores)
    return held_log, out_log, final


def random_case(seed=0, batch=3, q_heads=4, kv_heads=2, length=16, head_dim=8, steps=20):
    torch.manual_seed(seed)
    lengths = torch.tensor([length, 10, 5][:batch])
    pad = torch.arange(length)[None, :] >= (length - lengths)[:, None]  # left padding
    q = 2 * torch.randn(batch, q_heads, length, head_dim)
    k = torch.randn(batch, kv_heads, length, head_dim)
    v = torch.randn(batch, kv_heads, length, head_dim)
    decode = [(2 * torch.randn(batch, q_heads, 1, head_dim), torch.randn(batch, kv_heads, 1, head_dim),
               torch.randn(batch, kv_heads, 1, head_dim)) for _ in range(steps)]
    return q, k, v, pad, decode


@pytest.mark.parametrize("budget", [9, 20])  # prompt compressed at prefill / kept whole
@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_reference(variant, budget):
    q, k, v, pad, steps = random_case()
    scale = q.shape[-1] ** -0.5
    policy = H2OPolicy(budget, variant=variant)
    held, outs = drive_layer(policy, q, k, v, pad, steps, scale)
    expected_held, expected_outs, final = reference_h2o(q, k, v, pad, steps, budget, policy.recent, variant,
                                                        scale)
    assert held == expected_held
    for got, expected in zip(outs, expected_outs, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    if variant == "paper":  # the accumulated scores themselves, slot by slot
        slots = policy.layers[0]
        for b, heads in enumerate(final):
            for h, scores in enumerate(heads):
                for slot in range(slots.slots):
                    if slots.valid[b, h, slot]:
                        expected = scores[int(slots.positions[b, h, slot])]
                        received = policy.layers[0].state["received"]
                        assert float(received[b, h, slot]) == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("chunk_elements", [1, 200, 1 << 26])
def test_prompt_attention_sums(chunk_elements):
    q, k, _, pad, _ = random_case(q_heads=6, kv_heads=2)
    scale = 0.3
    batch, q_heads, length, _ = q.shape
    grouped = q.view(batch, 2, 3, length, -1)
    logits = torch.einsum("bhgid,bhjd->bhgij", grouped, k) * scale
    allowed = torch.ones(length, length, dtype=torch.bool).tril() & pad[:, None, None, None, :]
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num()
    expected = (probs * pad[:, None, None, :, None]).sum(dim=(2, 3))
    got = prompt_attention_sums(q, k, pad, scale, chunk_elements=chunk_elements)
    torch.testing.assert_close(got, expected)


def full_layer(policy, positions, scores, valid=None, current=10):
    """A one-row, one-layer policy whose slots hold `positions` `[Hkv, S]` with `scores`."""
    kv_heads, slots = positions.shape
    policy.allocate(CacheSpec(batch=1, layers=1, q_heads=2 * kv_heads, kv_heads=kv_heads, head_dim=4,
                              prompt_len=4, max_new_tokens=8, dtype=torch.float32,
                              device=torch.device("cpu")))
    policy.begin_decode(torch.tensor([current]))
    layer = policy.layers[0]
    layer.positions.copy_(positions[None])
    layer.valid.fill_(True) if valid is None else layer.valid.copy_(valid[None])
    policy.next_slot[0].copy_((positions == current).long().argmax(dim=-1)[None])  # the token just written
    if policy.accumulate:
        layer.state["received"].copy_(scores[None])
        probs = torch.zeros(1, kv_heads, 2, slots)
    else:  # lf_repo: the current step's attention is the score
        probs = (scores / 2)[None, :, None].expand(1, kv_heads, 2, slots)
    policy.choose_next_slot(0, probs)
    return policy.next_slot[0][0].tolist()


def test_ties_and_free_slots():
    # budget 6: recent 3, so positions 9 and 10 (the newest recent - 1) are protected.
    positions = torch.tensor([[3, 10, 5, 9, 4, 6], [3, 10, 5, 9, 4, 6]])
    scores = torch.tensor([[1.0, 0.0, 1.0, 0.0, 1.0, 2.0], [5.0, 0.0, 4.0, 0.0, 3.0, 2.0]])
    head0, head1 = full_layer(H2OPolicy(6), positions, scores)
    assert head0 in (0, 2, 4) and head1 == 5  # any tied minimum; never a protected slot
    valid = torch.ones(2, 6, dtype=torch.bool)
    valid[1, 2] = False
    assert full_layer(H2OPolicy(6), positions, scores, valid)[1] == 2  # free slots first
    shared = full_layer(H2OPolicy(6, variant="lf_repo"), positions, scores)
    assert shared[0] == shared[1] and shared[0] in (4, 5)  # summed over heads: 6, 5, 4, 4


def test_config_and_validation():
    fields = yaml.safe_load(CONF.read_text())
    assert fields.pop("name") == H2OPolicy.name and locate(fields.pop("_target_")) is H2OPolicy
    # `use_kernel` picks an implementation of the same score: outside the yaml and a run's identity
    assert fields == {key: value for key, value in method_defaults(H2OPolicy).items() if key != "use_kernel"}
    policy = policy_of("h2o", 11)
    assert (policy.heavy, policy.recent) == (5, 6)
    for bad in (dict(variant="lf-repo"), dict(compress_every=4), dict(heavy_ratio=1.0)):
        with pytest.raises(UserError):
            H2OPolicy(16, **bad)
