"""StreamingLLM: sinks + window at every step, and a transcription of METHODS.md."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
import yaml
from conftest import LONG_TEXTS, VARIANTS, capped, generate

from baselines.streaming import StreamingPolicy
from longflow.errors import UserError
from longflow.methods import build_policy
from longflow.policy import CacheSpec

CONF = Path(__file__).resolve().parents[1] / "conf" / "method" / "streaming.yaml"


def streaming_window(newest: int, budget: int, n_sink: int) -> set[int]:
    """METHODS.md: the first n_sink positions and the most recent budget - n_sink, up to `newest`."""
    window = range(max(0, newest - (budget - n_sink) + 1), newest + 1)
    return set(range(min(n_sink, newest + 1))) | set(window)


class CheckedStreaming(capped(StreamingPolicy)):
    """The hard cap (`capped`), and exactly the sinks + window after every attend."""

    def attend(self, layer, q, k, v, scale):
        out = super().attend(layer, q, k, v, scale)
        slots = self.layers[layer]
        # after prefill, one slot is left for the first decode token
        newest = self.pad.sum(dim=-1) - 1 if self.prefilling else self.positions
        budget = self.budget - 1 if self.prefilling else self.budget
        for row, last in enumerate(newest.tolist()):
            for head in range(slots.valid.shape[1]):
                held = slots.positions[row, head][slots.valid[row, head]].tolist()
                assert sorted(held) == sorted(streaming_window(last, budget, self.n_sink))
        return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_budget_cap_and_window_at_every_step(tiny, variant):
    prompts, result = generate(tiny, lambda: CheckedStreaming(12, variant=variant), LONG_TEXTS)
    assert min(map(len, prompts)) > 12  # prefill compression runs
    assert result.peak_slots == [12, 12]
    _, other = generate(tiny, lambda: StreamingPolicy(12, variant="lf_repo"), LONG_TEXTS)
    assert other.tokens == result.tokens  # the variants are identical


def test_matches_reference_random():
    """Random tensors, left padding, GQA: held positions and outputs against plain loops."""
    torch.manual_seed(0)
    batch, q_heads, kv_heads, length, head_dim, budget, n_sink = 3, 4, 2, 16, 8, 9, 3
    lengths = [16, 10, 5]
    pad = torch.arange(length)[None, :] >= (length - torch.tensor(lengths))[:, None]
    q = torch.randn(batch, q_heads, length, head_dim)
    k, v = torch.randn(2, batch, kv_heads, length, head_dim)
    policy = StreamingPolicy(budget, n_sink=n_sink)
    policy.allocate(CacheSpec(batch=batch, layers=1, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                              prompt_len=length, max_new_tokens=21, dtype=torch.float32,
                              device=torch.device("cpu")))
    policy.begin_prefill(pad, (pad.long().cumsum(dim=-1) - 1).clamp(min=0))
    policy.store(0, k, v)
    policy.attend(0, q, k, v, scale=0.5)
    positions = pad.sum(dim=-1)
    policy.begin_decode(positions)
    # each row's keys and values by position
    tokens = [{p: (k[b, :, length - n + p], v[b, :, length - n + p]) for p in range(n)}
              for b, n in enumerate(lengths)]
    for _ in range(20):
        qs = torch.randn(batch, q_heads, 1, head_dim)
        ks, vs = torch.randn(2, batch, kv_heads, 1, head_dim)
        policy.store(0, ks, vs)
        out = policy.attend(0, qs, ks, vs, scale=0.5)[:, 0]  # [B, Hq, D]
        slots = policy.layers[0]
        for b, current in enumerate(positions.tolist()):
            tokens[b][current] = (ks[b, :, 0], vs[b, :, 0])
            held = sorted(streaming_window(current, budget, n_sink))
            for h in range(q_heads):
                kv = h // (q_heads // kv_heads)
                assert sorted(slots.positions[b, kv][slots.valid[b, kv]].tolist()) == held
                logits = torch.stack([qs[b, h, 0] @ tokens[b][p][0][kv] for p in held]) * 0.5
                weights = torch.softmax(logits, dim=0)
                expected = sum(w * tokens[b][p][1][kv] for w, p in zip(weights, held, strict=True))
                torch.testing.assert_close(out[b, h], expected, rtol=1e-4, atol=1e-5)
        positions += 1


def test_ties_and_free_slots():
    policy = StreamingPolicy(6, n_sink=2)
    policy.allocate(CacheSpec(batch=1, layers=1, q_heads=2, kv_heads=1, head_dim=4, prompt_len=4,
                              max_new_tokens=8, dtype=torch.float32, device=torch.device("cpu")))
    slots = policy.layers[0]
    slots.positions.copy_(torch.tensor([[[9, 1, 5, 0, 7, 8]]]))
    slots.valid.fill_(True)
    policy.choose_next_slot(0, None, None)
    assert policy.next_slot[0].item() == 2  # oldest non-sink (position 5), not the sinks 0 and 1
    slots.valid[0, 0, 4] = False
    slots.positions[0, 0, 4] = -1
    policy.choose_next_slot(0, None, None)
    assert policy.next_slot[0].item() == 4  # free slots first


def test_config_and_validation():
    fields = yaml.safe_load(CONF.read_text())
    assert fields.pop("name") == StreamingPolicy.name
    parameters = inspect.signature(StreamingPolicy).parameters
    assert fields == {name: p.default for name, p in parameters.items() if name != "budget"}
    assert build_policy("streaming", 16, **fields).n_sink == 4
    for bad in (dict(variant="official"), dict(n_sink=-1), dict(n_sink=16)):
        with pytest.raises(UserError):
            StreamingPolicy(16, **bad)
