"""VATP: the budget cap and sinks at every step, and a transcription of docs/methods.md."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from helpers import LONG_TEXTS, VARIANTS, capped, drive_layer, generate, method_defaults, policy_of

from baselines.vatp import VATPPolicy
from longflow.errors import UserError
from longflow.methods import locate
from longflow.policy import CacheSpec

CONF = Path(__file__).resolve().parents[1] / "conf" / "method" / "vatp.yaml"


class CheckedVATP(capped(VATPPolicy)):
    """The hard cap (`capped`); sinks and the recent window at every decode step."""

    def attend(self, layer, q, k, v, scale):
        out = super().attend(layer, q, k, v, scale)
        slots = self.layers[layer]
        if not self.prefilling:
            for row, current in enumerate(self.positions.tolist()):
                kept = set(range(self.sinks)) | set(range(max(0, current - self.recent + 1), current + 1))
                for head in range(slots.valid.shape[1]):
                    assert kept <= set(slots.positions[row, head][slots.valid[row, head]].tolist())
        return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_budget_cap_and_sinks_at_every_step(tiny, variant):
    prompts, result = generate(tiny, lambda: CheckedVATP(28, variant=variant), LONG_TEXTS)  # 20 sinks
    assert min(map(len, prompts)) > 28
    assert result.peak_slots == [28, 28]


# ---- an independent transcription of docs/methods.md, on random tensors -------------------------


def received(queries, keys, query_positions, key_positions, scale):
    """`[Hq, N]`: attention each key receives from the queries (causal), per query head.

    queries `[Hq, T, D]`, keys `[Hq, T, D]` (already repeated over each group) indexed by position."""
    logits = torch.einsum("hid,hjd->hij", queries[:, query_positions], keys[:, key_positions]) * scale
    causal = torch.tensor(query_positions)[:, None] >= torch.tensor(key_positions)[None, :]
    return torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1).sum(dim=1)


def vatp_scores(attention, values, variant):
    """docs/methods.md: attention `[Hq, N]` received, values `[Hkv, N, D]` -> scores `[Hkv, N]`."""
    kv_heads = values.shape[0]
    if variant == "paper":  # ||v||_1 * attention summed over the group, per KV head
        return attention.view(kv_heads, -1, attention.shape[-1]).sum(dim=1) * values.abs().sum(dim=-1)
    # lf_repo: mean over heads of the attention, times the mean over heads of ||v||_2, shared
    return (attention.mean(dim=0) * values.norm(dim=-1).mean(dim=0)).expand(kv_heads, -1)


def reference_row(queries, keys, values, n, steps, budget, sinks, recent, variant, scale):
    """VATP on one row whose tokens (prompt then decode, `[H, n + steps, D]`) are indexed by position.

    Returns the held positions per decode step, `[t][h] -> set`.
    """
    q_heads, kv_heads = queries.shape[0], keys.shape[0]
    group = q_heads // kv_heads
    keys_per_query = keys.repeat_interleave(group, dim=0)  # query head h reads KV head h // G
    prompt = list(range(n))
    attention = received(queries, keys_per_query, prompt, prompt, scale)
    accumulated = [dict(zip(prompt, row, strict=True)) for row in attention.tolist()]  # per query head
    prompt_scores = vatp_scores(attention, values[:, :n], variant)
    held = []
    for h in range(kv_heads):
        protected = {p for p in prompt if p < sinks or p >= n - recent + 1}
        rest = sorted(set(prompt) - protected, key=lambda p, h=h: -float(prompt_scores[h, p]))
        keep = protected | set(rest[: budget - 1 - len(protected)])
        held.append(set(prompt) if n <= budget - 1 else keep)
    log = []
    for current in range(n, n + steps):
        for h in range(kv_heads):
            held[h].add(current)
            assert len(held[h]) <= budget
        log.append([set(s) for s in held])
        victims = []
        for h in range(kv_heads):
            order = sorted(held[h])
            attention = received(queries, keys_per_query, [current], order, scale)  # [Hq, N], this step
            if variant == "paper":  # accumulate; a new token starts from this step's attention
                for head in range(h * group, (h + 1) * group):  # the query heads of KV head h
                    row = attention[head].tolist()
                    accumulated[head][current] = 0.0
                    for p, a in zip(order, row, strict=True):
                        accumulated[head][p] += a
                attention = torch.tensor([[row.get(p, 0.0) for p in order] for row in accumulated])
            scores = vatp_scores(attention, values[:, order], variant)[h]
            score = dict(zip(order, scores.tolist(), strict=True))
            candidates = [p for p in order if sinks <= p < current - recent + 2]
            victims.append(min(candidates, key=score.get) if len(order) == budget else None)
        for h, victim in enumerate(victims):
            if victim is not None:
                held[h].remove(victim)
    return log


@pytest.mark.parametrize("budget", [11, 20])  # prompt compressed at prefill / kept whole
@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_reference(variant, budget):
    torch.manual_seed(1)
    batch, q_heads, kv_heads, length, head_dim = 3, 4, 2, 16, 8
    pad = torch.arange(length)[None, :] >= (length - torch.tensor([16, 12, 5]))[:, None]
    q = 2 * torch.randn(batch, q_heads, length, head_dim)
    k, v = torch.randn(2, batch, kv_heads, length, head_dim)
    steps = [(2 * torch.randn(batch, q_heads, 1, head_dim), torch.randn(batch, kv_heads, 1, head_dim),
              torch.randn(batch, kv_heads, 1, head_dim)) for _ in range(20)]
    scale = head_dim**-0.5
    policy = VATPPolicy(budget, variant=variant, n_sink=3)
    assert policy.recent == (budget - policy.sinks) - (budget - policy.sinks) // 2
    expected = []
    for b, n in enumerate(pad.sum(dim=-1).tolist()):  # each row's tokens by position
        queries = torch.cat([q[b, :, length - n:]] + [qs[b] for qs, _, _ in steps], dim=1)
        keys = torch.cat([k[b, :, length - n:]] + [ks[b] for _, ks, _ in steps], dim=1)
        values = torch.cat([v[b, :, length - n:]] + [vs[b] for _, _, vs in steps], dim=1)
        sinks = 3 if variant == "paper" else 0  # lf_repo: no sink protection
        expected.append(reference_row(queries, keys, values, n, len(steps), budget, sinks, policy.recent,
                                      variant, scale))
    expected = [list(step) for step in zip(*expected, strict=True)]  # [t][b][h]
    assert drive_layer(policy, q, k, v, pad, steps, scale)[0] == expected


def test_value_norm_ties_sinks_and_free_slots():
    """One full row: equal attention everywhere, so the value norms decide."""
    policy = VATPPolicy(8, n_sink=2)  # heavy 3, recent 3: positions 9 and 10 protected at step 10
    policy.allocate(CacheSpec(batch=1, layers=1, q_heads=4, kv_heads=2, head_dim=4, prompt_len=4,
                              max_new_tokens=8, dtype=torch.float32, device=torch.device("cpu")))
    policy.begin_decode(torch.tensor([10]))
    slots = policy.layers[0]
    slots.positions.copy_(torch.tensor([[0, 1, 99, 9, 4, 5, 6, 7]] * 2)[None])
    slots.valid.fill_(True)
    l1 = torch.tensor([[0.1, 0.1, 0.1, 0.1, 3.0, 2.0, 2.0, 5.0], [0.1, 0.1, 0.1, 0.1, 3.0, 2.0, 4.0, 5.0]])
    slots.values.copy_((l1[..., None] / 4).expand(2, 8, 4)[None])  # ||v||_1 = l1
    slots.state["norms"].copy_(l1[None])  # norms are kept per slot, computed when a value is written
    slots.state["received"].fill_(1.0)
    slots.state["norms"][..., 2] = 7.0  # the evicted token's, replaced when position 10 is written
    policy.next_slot[0].fill_(2)
    policy.store(0, torch.zeros(1, 2, 1, 4), torch.full((1, 2, 1, 4), 0.1 / 4))  # position 10 into slot 2
    probs = torch.zeros(1, 2, 2, 8)
    probs[..., 2] = 0.5  # the new token's own attention: its score restarts from this step
    policy.choose_next_slot(0, probs)
    head0, head1 = policy.next_slot[0][0].tolist()
    assert head0 in (5, 6) and head1 == 5  # never the sinks (0, 1) nor the recent (9, 10)
    assert slots.state["received"][0, :, 2].tolist() == [1.0, 1.0]
    torch.testing.assert_close(slots.state["norms"][0], l1)  # the written slot's norm: ||v||_1 of its value
    assert slots.positions[0, :, 2].tolist() == [10, 10]
    slots.valid[0, 1, 3] = False
    policy.choose_next_slot(0, probs)
    assert policy.next_slot[0][0, 1] == 3  # free slots first


def test_config_and_validation():
    fields = yaml.safe_load(CONF.read_text())
    assert fields.pop("name") == VATPPolicy.name and locate(fields.pop("_target_")) is VATPPolicy
    # `use_kernel` picks an implementation of the same score: outside the yaml and a run's identity
    assert fields == {key: value for key, value in method_defaults(VATPPolicy).items() if key != "use_kernel"}
    policy = policy_of("vatp", 40)
    assert (policy.sinks, policy.heavy, policy.recent) == (20, 10, 10)
    assert policy_of("vatp", 40, variant="lf_repo").sinks == 0
    for bad in (dict(variant="repo"), dict(n_sink=-1), dict(compress_every=2), dict(n_sink=40)):
        with pytest.raises(UserError):
            VATPPolicy(40, **bad)
