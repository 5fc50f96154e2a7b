"""StreamingLLM: sinks + window at every step, and transcriptions of docs/methods.md (both variants)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from helpers import LONG_TEXTS, VARIANTS, capped, drive_layer, generate, method_defaults, policy_of
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from baselines.streaming import StreamingLfRepoPolicy, StreamingPolicy, sink_rerotation
from longflow.errors import UserError
from longflow.methods import locate
from longflow.policy import CacheSpec
from longflow.selection import choose_next

CONF = Path(__file__).resolve().parents[1] / "conf" / "method" / "streaming.yaml"


def streaming_window(newest: int, budget: int, n_sink: int) -> set[int]:
    """docs/methods.md: the first n_sink positions and the most recent budget - n_sink, up to `newest`."""
    window = range(max(0, newest - (budget - n_sink) + 1), newest + 1)
    return set(range(min(n_sink, newest + 1))) | set(window)


def checked(cls):
    """`cls` with the hard cap (`capped`), and exactly the sinks + window after every attend."""

    class CheckedStreaming(capped(cls)):
        def attend(self, layer, q, k, v, scale):
            out = super().attend(layer, q, k, v, scale)
            slots = self.layers[layer]
            # after prefill, one slot is left for the first decode token
            newest = self.pad.sum(dim=-1) - 1 if self.prefilling else self.positions
            budget = self.budget - 1 if self.prefilling else self.budget
            for row, last in enumerate(newest.tolist()):
                for head in range(slots.valid.shape[1]):
                    held = slots.positions[row, head][slots.valid[row, head]].tolist()
                    assert sorted(held) == sorted(streaming_window(last, budget, self.sinks))
            return out

    return CheckedStreaming


@pytest.mark.parametrize("variant", VARIANTS)
def test_budget_cap_and_window_at_every_step(tiny, variant):
    sinks = {} if variant == "paper" else {"lf_n_sink": 4}  # lf_repo's 32 sinks exceed this budget
    cls = StreamingPolicy if variant == "paper" else StreamingLfRepoPolicy
    prompts, result = generate(tiny, lambda: checked(cls)(12, **sinks), LONG_TEXTS)
    assert min(map(len, prompts)) > 12  # prefill compression runs
    assert result.peak_slots == [12, 12]


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
    policy.choose_next_slot(0)
    assert policy.next_slot[0].item() == 2  # oldest non-sink (position 5), not the sinks 0 and 1
    slots.valid[0, 0, 4] = False
    slots.positions[0, 0, 4] = -1
    policy.choose_next_slot(0)
    assert policy.next_slot[0].item() == 4  # free slots first


def test_head_zero_chooses_as_the_rule_over_every_head():
    """A shared selection's `choose_next_slot` reads KV head 0 only. On random states shared by every head
    (positions in any slot order, free slots, sinks), each head gets the slot that `choose_next` gives over
    that head's own positions, validity and sinks; a subclass with its own score goes through that score,
    and its protection is asked of KV head 0 alone."""
    generator = torch.Generator().manual_seed(0)
    batch, kv_heads, budget = 4, 3, 10
    spec = CacheSpec(batch=batch, layers=1, q_heads=6, kv_heads=kv_heads, head_dim=4, prompt_len=4,
                     max_new_tokens=8, dtype=torch.float32, device=torch.device("cpu"))

    class Newest(StreamingPolicy):
        def score(self, obs):
            return -obs.positions

        def protected(self, obs):  # asked on one head (1/Hkv of the bytes), as every shared selection is
            assert obs.positions.shape == obs.valid.shape == (batch, 1, budget)
            return super().protected(obs)

    for cls, sign in ((StreamingPolicy, 1), (Newest, -1)):
        policy = cls(budget, n_sink=2)
        policy.allocate(spec)
        slots = policy.layers[0]
        for _ in range(20):
            positions = torch.stack([torch.randperm(budget, generator=generator) for _ in range(batch)])
            valid = torch.rand(batch, budget, generator=generator) < 0.8
            valid[0] = True  # a full row: the oldest non-sink goes
            slots.positions.copy_(positions.masked_fill(~valid, -1)[:, None].expand(-1, kv_heads, -1))
            slots.valid.copy_(valid[:, None].expand(-1, kv_heads, -1))
            policy.choose_next_slot(0)
            every_head = choose_next(sign * slots.positions, slots.valid, slots.positions < 2)  # [B, Hkv]
            assert torch.equal(policy.next_slot[0], every_head)


def test_config_and_validation():
    fields = yaml.safe_load(CONF.read_text())
    assert fields.pop("name") == StreamingPolicy.name and locate(fields.pop("_target_")) is StreamingPolicy
    assert fields == method_defaults(StreamingPolicy)
    assert policy_of("streaming", 16).sinks == 4
    for bad in (dict(variant="official"), dict(n_sink=-1), dict(n_sink=16)):
        with pytest.raises(UserError):
            StreamingPolicy(16, **bad)
    assert policy_of("streaming", 34, variant="lf_repo").sinks == 32
    assert type(policy_of("streaming", 34, variant="lf_repo")) is StreamingLfRepoPolicy
    with pytest.raises(UserError, match="StreamingLfRepoPolicy"):
        StreamingPolicy(34, variant="lf_repo")
    for bad in (dict(lf_n_sink=-1), dict(lf_n_sink=32)):  # lf_repo needs budget >= lf_n_sink + 2
        with pytest.raises(UserError):
            StreamingLfRepoPolicy(33, **bad)
    policy = StreamingLfRepoPolicy(34)
    with pytest.raises(UserError, match="rotary"):
        policy.allocate(CacheSpec(batch=1, layers=1, q_heads=2, kv_heads=1, head_dim=4, prompt_len=4,
                                  max_new_tokens=8, dtype=torch.float32, device=torch.device("cpu")))


# ---- lf_repo: transformers' SinkCache, transcribed ------------------------------------------------

HEAD_DIM = 8


def rotary_module(scaled: bool) -> LlamaRotaryEmbedding:
    """A model's rotary embedding: plain RoPE, or Llama 3.1's `rope_scaling` (R1-Distill-Llama)."""
    scaling = dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}) if scaled else {}
    config = LlamaConfig(hidden_size=2 * HEAD_DIM, num_attention_heads=2, head_dim=HEAD_DIM,
                         max_position_embeddings=4096, rope_theta=500.0, **scaling)
    return LlamaRotaryEmbedding(config)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of the models: x cos + rotate_half(x) sin, rotate_half(x1, x2) = (-x2, x1)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def sink_cache_reference(prompt_keys, prompt_values, steps, window, sinks, cos, sin, scale):
    """transformers' `SinkCache` (4.51) as `generate` drives it, for one row, transcribed on lists.

    prompt_keys/values `[Hkv, n, D]`; steps: (q `[Hq, D]`, k, v `[Hkv, D]`) per decode step; cos, sin
    `[positions, D]`: the model's, indexed by position. Prefill stores the whole prompt; each step
    appends while the cache plus the token stays below `window`, and otherwise keeps the first
    `sinks` entries and the last window - sinks - 1, the latter rotated back by one position (entry
    i with the cos/sin products of positions sinks + i + 1 and sinks + i), then appends the token.
    The query attends to the cache with its real position. Returns the held positions and outputs
    `[Hq, D]` per step, and the final keys by position.
    """
    kv_heads, n = prompt_keys.shape[:2]
    cache = [(p, prompt_keys[:, p], prompt_values[:, p]) for p in range(n)]
    held, outputs = [], []
    for t, (q, k, v) in enumerate(steps):
        if len(cache) + 1 >= window:
            kept = []
            for i, (p, key, value) in enumerate(cache[len(cache) - (window - sinks - 1):]):
                a, b = sinks + i + 1, sinks + i
                back_cos = cos[a] * cos[b] + sin[a] * sin[b]
                back_sin = -sin[a] * cos[b] + cos[a] * sin[b]
                kept.append((p, rope(key, back_cos, back_sin), value))
            cache = cache[:sinks] + kept
        cache.append((n + t, k, v))
        group = q.shape[0] // kv_heads
        out = torch.empty_like(q)
        for h in range(q.shape[0]):
            keys = torch.stack([key[h // group] for _, key, _ in cache])
            values = torch.stack([value[h // group] for _, _, value in cache])
            out[h] = torch.softmax(keys @ q[h] * scale, dim=0) @ values
        held.append({p for p, _, _ in cache})
        outputs.append(out)
    return held, outputs, {p: key for p, key, _ in cache}


@pytest.mark.parametrize("scaled", [False, True])
def test_lf_repo_matches_the_sink_cache_transcription(scaled):
    """Random tensors, left padding (one prompt longer than the window), GQA, 30 steps: the held
    positions, the outputs and the re-rotated keys, against `sink_cache_reference` row by row."""
    torch.manual_seed(1)
    batch, q_heads, kv_heads, length, window, sinks, scale = 3, 4, 2, 20, 12, 3, 0.3
    lengths = [20, 7, 11]
    rotary = rotary_module(scaled)
    cos, sin = (t[0] for t in rotary(torch.empty(0), torch.arange(64)[None]))
    pad = torch.arange(length)[None, :] >= (length - torch.tensor(lengths))[:, None]
    q = torch.randn(batch, q_heads, length, HEAD_DIM)
    k, v = torch.randn(2, batch, kv_heads, length, HEAD_DIM)
    steps = [(torch.randn(batch, q_heads, 1, HEAD_DIM), *torch.randn(2, batch, kv_heads, 1, HEAD_DIM))
             for _ in range(30)]
    policy = StreamingLfRepoPolicy(window, lf_n_sink=sinks)
    held, outputs = drive_layer(policy, q, k, v, pad, steps, scale, rotary=rotary)
    slots = policy.layers[0]
    for b, n in enumerate(lengths):
        row_steps = [(qs[b, :, 0], ks[b, :, 0], vs[b, :, 0]) for qs, ks, vs in steps]
        expected_held, expected_out, final_keys = sink_cache_reference(
            k[b, :, length - n:], v[b, :, length - n:], row_steps, window, sinks, cos, sin, scale)
        for t in range(len(steps)):
            assert all(held[t][b][h] == expected_held[t] for h in range(kv_heads)), f"row {b}, step {t}"
            torch.testing.assert_close(outputs[t][b], expected_out[t], rtol=1e-5, atol=1e-6)
        for slot in range(window):
            torch.testing.assert_close(slots.keys[b, :, slot], final_keys[int(slots.positions[b, 0, slot])],
                                       rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scaled", [False, True])
def test_lf_repo_rerotation_is_one_position_back(scaled):
    """Every row of the table takes a key rotated at position p to the key rotated at p - 1, with the
    model's own frequencies (Llama 3.1's scaled ones too)."""
    rotary = rotary_module(scaled)
    back_cos, back_sin = sink_rerotation(rotary, 40, 4, torch.float32, torch.device("cpu"))
    cos, sin = (t[0] for t in rotary(torch.empty(0), torch.arange(40)[None]))
    key = torch.randn(HEAD_DIM)
    for p in range(1, 40):
        for i in range(len(back_cos)):
            moved = rope(rope(key, cos[p], sin[p]), back_cos[i], back_sin[i])
            torch.testing.assert_close(moved, rope(key, cos[p - 1], sin[p - 1]), rtol=1e-5, atol=1e-5)
