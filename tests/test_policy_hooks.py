"""The hooks newer methods need: capacities per layer (budget counted per layer or in total) and per KV
head, the query history (and queries before RoPE), the engine's logits and hidden states handed to
the policy, and calibration files named in config."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from helpers import LONG_TEXTS, generate, hf_attention, tiny_model
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from baselines.h2o import H2OPolicy
from baselines.streaming import StreamingPolicy
from baselines.vanilla import VanillaPolicy
from longflow.calibration import check_shape, load_calibration
from longflow.errors import UserError
from longflow.history import QueryHistory
from longflow.rotary import mean_rotation, rotate_half, unrotate


@dataclass(eq=False)
class UnevenLayers(StreamingPolicy):
    """StreamingLLM with layer 0 holding `shift` slots fewer than the budget and the last layer more."""

    shift: int = 4

    def layer_capacities(self, spec):
        capacities = [self.budget] * spec.layers
        capacities[0] -= self.shift
        capacities[-1] += self.shift
        return capacities

    def store(self, layer, k, v):
        out = super().store(layer, k, v)
        self.check()
        return out

    def check(self):
        held = [int(slots.valid.sum(dim=-1).max()) for slots in self.layers]
        assert all(n <= slots.slots for n, slots in zip(held, self.layers, strict=True))
        assert sum(held) <= self.budget * len(self.layers)


@dataclass(eq=False)
class ProbsUndeclared(StreamingPolicy):
    """StreamingLLM's declaration (no probabilities at the step) over a score that reads them."""

    def score(self, obs):
        return obs.probs.sum(dim=2)


def test_a_score_reading_probs_it_declared_it_does_not_need_fails_loudly(tiny):
    with pytest.raises(RuntimeError, match="step_probs = False"):
        generate(tiny, lambda: ProbsUndeclared(8, n_sink=2), LONG_TEXTS, max_new_tokens=12)


def test_total_budget_scope_lets_layers_differ(tiny):
    made = []

    def factory():
        made.append(UnevenLayers(16, budget_scope="total", n_sink=2))
        return made[-1]

    _, result = generate(tiny, factory, LONG_TEXTS, max_new_tokens=30)
    policy = made[0]
    assert [slots.slots for slots in policy.layers][0] == 12 and policy.layers[-1].slots == 20
    assert max(result.peak_slots) == 20  # the largest layer, full
    with pytest.raises(UserError, match="exceed the total budget"):
        generate(tiny, lambda: Overfull(16, n_sink=2, budget_scope="total"), LONG_TEXTS, max_new_tokens=2)


@dataclass(eq=False)
class Overfull(StreamingPolicy):
    """Every layer one slot over the budget: more than layers x budget in all."""

    def layer_capacities(self, spec):
        return [self.budget + 1] * spec.layers


@dataclass(eq=False)
class NarrowHeads(H2OPolicy):
    """H2O (per KV head) whose last KV head holds `narrow` slots fewer than the layer."""

    narrow: int = 5

    def head_capacities(self, spec, layer):
        return [self.budget] * (spec.kv_heads - 1) + [self.budget - self.narrow]

    def attend(self, layer, q, k, v, scale):
        out = super().attend(layer, q, k, v, scale)
        held = self.layers[layer].valid.sum(dim=-1)  # [B, Hkv]
        limits = torch.tensor(self.head_capacities(self.spec, layer))
        assert (held <= limits).all()
        if not self.prefilling:  # the recent window is whole in every head, the narrow one included
            for row, current in enumerate(self.positions.tolist()):
                window = set(range(current - self.recent + 1, current + 1))
                positions = self.layers[layer].positions[row, -1][self.layers[layer].valid[row, -1]]
                assert window <= set(positions.tolist())
        return out


def test_per_head_capacities():
    model, tokenizer = tiny_model("qwen3")  # 2 KV heads
    made = []

    def factory():
        made.append(NarrowHeads(20))
        return made[-1]

    prompts, result = generate((model, tokenizer), factory, LONG_TEXTS, max_new_tokens=40)
    assert min(map(len, prompts)) > 20
    held = made[0].layers[0].valid.sum(dim=-1)
    assert held[:, 0].tolist() == [20, 20] and held[:, 1].tolist() == [15, 15]
    with pytest.raises(UserError, match="head capacities"):
        generate((model, tokenizer), lambda: NarrowHeads(20, narrow=19), LONG_TEXTS, max_new_tokens=2)


@dataclass(eq=False)
class Observer(VanillaPolicy):
    """The full cache, recording what the engine hands to `observe`."""

    observes = frozenset({"logits", "prompt_logits", "hidden_states"})

    def allocate(self, spec):
        super().allocate(spec)
        self.newest_logits = torch.zeros(spec.batch, spec.vocab)  # a static buffer, as a decode step needs
        self.seen = []

    def observe(self, logits, hidden_states):
        self.newest_logits.copy_(logits[:, -1])
        self.seen.append((logits.clone(), [h.clone() for h in hidden_states]))


def test_the_engine_hands_logits_and_hidden_states_to_the_policy(tiny):
    model, tokenizer = tiny
    made = []

    def factory():
        made.append(Observer())
        return made[-1]

    prompts, result = generate(tiny, factory, ["What is 2 + 3?", "hi"], max_new_tokens=6)
    seen = made[0].seen
    assert len(seen) == 6  # the prompt forward and 5 decode steps
    prompt_logits, prompt_hidden = seen[0]
    length = prompt_logits.shape[1]
    assert length == max(map(len, prompts)) + (-max(map(len, prompts))) % 16  # every (padded) prompt position
    with hf_attention(model), torch.no_grad():
        ids = torch.tensor([prompts[0]])
        expected = model(ids, output_hidden_states=True)
    row = slice(length - len(prompts[0]), length)
    torch.testing.assert_close(prompt_logits[0, row], expected.logits[0], rtol=1e-4, atol=1e-4)
    assert len(prompt_hidden) == len(expected.hidden_states)
    for got, want in zip(prompt_hidden, expected.hidden_states, strict=True):
        torch.testing.assert_close(got[0, row], want[0], rtol=1e-4, atol=1e-4)
    for step, (logits, hidden) in enumerate(seen[1:], start=1):
        assert logits.shape[1] == 1 and hidden[-1].shape[1] == 1
        assert logits[:, -1].argmax(dim=-1).tolist() == [tokens[step] for tokens in result.tokens]
    assert torch.equal(made[0].newest_logits, seen[-1][0][:, -1])


def test_no_policy_pays_for_what_it_does_not_observe(tiny, monkeypatch):
    model, _ = tiny
    calls = []
    forward = model.forward

    def spy(*args, **kwargs):
        calls.append((kwargs["logits_to_keep"], kwargs["output_hidden_states"]))
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    generate(tiny, VanillaPolicy, ["hi"], max_new_tokens=3)
    assert set(calls) == {(1, False)}


def test_query_history_returns_the_newest_queries_in_order():
    history = QueryHistory(layers=1, batch=2, q_heads=2, window=4, head_dim=3, dtype=torch.float32,
                           device=torch.device("cpu"))
    length = 6
    pad = torch.tensor([[True] * 6, [False, False, False, False, True, True]])
    q = torch.arange(2 * 2 * length * 3, dtype=torch.float32).view(2, 2, length, 3)
    history.record_prompt(0, q, pad)
    by_position = {(0, p): q[0, :, p] for p in range(6)} | {(1, p): q[1, :, 4 + p] for p in range(2)}
    positions = torch.tensor([6, 2])
    for _ in range(3):  # three decode steps
        step = torch.randn(2, 2, 3)
        history.record(0, step, positions)
        for row in range(2):
            by_position[(row, int(positions[row]))] = step[row]
        positions += 1
    newest = positions - 1
    queries, held_positions, valid = history.recent(0, newest)
    assert held_positions.tolist() == [[5, 6, 7, 8], [1, 2, 3, 4]]
    assert valid.tolist() == [[True] * 4, [True] * 4]
    for row in range(2):
        for i, position in enumerate(held_positions[row].tolist()):
            torch.testing.assert_close(queries[row, :, i], by_position[(row, position)])
    queries, held_positions, valid = history.recent(0, torch.tensor([1, 8]), window=3)
    assert valid[0].tolist() == [False, True, True]  # before position 0


def rotary(scaled: bool = False) -> LlamaRotaryEmbedding:
    scaling = dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}) if scaled else {}
    return LlamaRotaryEmbedding(LlamaConfig(hidden_size=16, num_attention_heads=2, head_dim=8,
                                            max_position_embeddings=4096, rope_theta=500.0, **scaling))


@pytest.mark.parametrize("scaled", [False, True])
def test_unrotate_undoes_rope_and_the_mean_rotation_averages_it(scaled):
    rope = rotary(scaled)
    x = torch.randn(2, 3, 5, 8)  # [n, H, w, D]
    positions = torch.tensor([[0, 3, 7, 100, 2000], [5, 6, 7, 8, 9]])
    cos, sin = rope(x, positions)
    rotated = x * cos[:, None] + rotate_half(x) * sin[:, None]
    torch.testing.assert_close(unrotate(rotated, positions, rope), x, rtol=1e-4, atol=1e-4)
    future = torch.arange(10, 30)[None]  # [1, f]
    matrix = mean_rotation(rope, future, 8)[0]  # [D, D]
    cos, sin = rope(x, future)
    vector = torch.randn(8)
    expected = (vector * cos[0] + rotate_half(vector) * sin[0]).mean(dim=0)
    torch.testing.assert_close(matrix @ vector, expected, rtol=1e-5, atol=1e-5)


def test_calibration_files(tmp_path):
    good = tmp_path / "stats.pt"
    torch.save({"query_mean": torch.zeros(2, 4, 8), "other": 1}, good)
    loaded = load_calibration(str(good), "ea", ["query_mean"])
    assert loaded["query_mean"].shape == (2, 4, 8)
    check_shape(loaded["query_mean"], (2, 4, 8), "query_mean")
    with pytest.raises(UserError, match="another model"):
        check_shape(loaded["query_mean"], (3, 4, 8), "query_mean")
    with pytest.raises(UserError, match="lacks the tensor 'query_cov'"):
        load_calibration(str(good), "ea", ["query_mean", "query_cov"])
    with pytest.raises(UserError, match="not found"):
        load_calibration(str(tmp_path / "none.pt"), "ea", ["query_mean"])
    (tmp_path / "bad.pt").write_text("not a tensor file")
    with pytest.raises(UserError, match="unreadable"):
        load_calibration(str(tmp_path / "bad.pt"), "ea", ["query_mean"])


def test_prompt_logits_are_the_models_logits_at_every_index(tiny):
    """`PromptLogits` computes only the positions an index asks for; each is the model's logit."""
    from longflow.engine import PromptLogits

    model, _ = tiny
    ids = torch.randint(0, 100, (2, 11))
    with hf_attention(model), torch.no_grad():
        output = model(ids, output_hidden_states=True, logits_to_keep=0)
        lazy = PromptLogits(model, output.hidden_states[-1])
        assert lazy.shape == output.logits.shape
        for index in [(slice(None), slice(3, 7)), (slice(None), -1), (0, 4, 5), (1, slice(None), slice(0, 9))]:
            torch.testing.assert_close(lazy[index], output.logits[index], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lazy.clone(), output.logits, rtol=1e-5, atol=1e-5)
