"""Random Attention: each cut against a plain transcription of the official `random_pp` rule
(`pl = min(prompt_len, K - 1)` prompt tokens forced, the top K of uniform noise, the residual
buffer kept), the noise uniform, and every row's draws reproducible through the engine's per-row
generator: the same tokens alone, beside any batch-mates, in continuous batching and after the
process's own random state moved on (a resumed run). Large budget = the full cache's tokens and
the hard cap: test_methods.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from helpers import drive_layer, method_defaults, policy_of, tiny_model

from baselines.random_attention import RandomAttentionPolicy, uniform_scores
from longflow.config import EngineConfig, GenerationConfig
from longflow.engine import Engine
from longflow.errors import UserError
from longflow.methods import locate
from longflow.sampling import row_uniform

pytestmark = pytest.mark.filterwarnings("ignore:.*leaves no room:UserWarning")


def noise_by_hand(seed: int, layer: int, head: int, position: int, newest: int) -> float:
    """The engine's per-row generator at one counter: docs/methods.md's (seed, layer, KV head, position)
    packed into 17 + 12 + 10 + 24 bits, with the row's newest position as its step."""
    counter = ((seed * 4096 + layer) * 1024 + head) * 2 ** 24 + position
    return float(row_uniform(torch.tensor([counter]), torch.tensor([newest]), 1)[0, 0])


def test_noise_is_the_per_row_generator_of_the_slot_alone():
    positions = torch.tensor([[[3, 9, 0, 41], [3, 9, 0, 41]], [[5, 6, 7, 8], [8, 7, 6, 5]]])
    newest = torch.tensor([41, 8])
    noise = uniform_scores(2, 5, positions, newest)
    for b in range(2):
        for h in range(2):
            for s in range(4):
                assert float(noise[b, h, s]) == noise_by_hand(2, 5, h, int(positions[b, h, s]), int(newest[b]))
    # a row's noise is the same computed alone, and a slot's does not depend on where it is held
    assert torch.equal(uniform_scores(2, 5, positions[1:], newest[1:]), noise[1:])
    moved = [3, 0, 2, 1]
    assert torch.equal(uniform_scores(2, 5, positions[:, :, moved], newest), noise[:, :, moved])
    assert noise[1, 0, 0] != noise[1, 1, 3]  # the same position in another KV head draws apart
    assert ((noise > 0) & (noise < 1)).all()
    assert not torch.equal(uniform_scores(3, 5, positions, newest), noise)  # the seed, layer, newest all count
    assert not torch.equal(uniform_scores(2, 4, positions, newest), noise)
    assert not torch.equal(uniform_scores(2, 5, positions, newest + 1), noise)


def test_noise_is_uniform():
    positions = torch.arange(4000)[None, None, :]
    noise = uniform_scores(0, 0, positions, torch.tensor([4000]))
    counts = torch.histc(noise, bins=10, min=0.0, max=1.0)
    assert ((counts - 400).abs() < 4 * 20).all()  # 4 standard deviations of a binomial(4000, 0.1)


def reference_random(k, pad, count, *, budget, keep_after, recent, seed):
    """Per row and KV head, loop by loop, one layer (layer 0): the positions each step's query attends
    to `[t][b][h] -> set`. A full cache (budget) is cut to keep_after as `random_pp`: with K =
    keep_after - recent, the first pl = min(prompt held, K - 1) prompt tokens and the recent newest are
    kept, and of the others the K - pl with the highest noise (`noise_by_hand`). Prompts must fit."""
    batch, kv_heads, length, _ = k.shape
    log = [[[None] * kv_heads for _ in range(batch)] for _ in range(count)]
    for b in range(batch):
        n = int(pad[b].sum())
        for h in range(kv_heads):
            held = list(range(n))
            for t in range(count):
                newest = n + t
                held.append(newest)
                log[t][b][h] = set(held)
                if len(held) == budget:
                    K = keep_after - recent
                    prompt = [p for p in held if p < n][:max(0, K - 1)]
                    tail = held[-recent:]
                    forced = sorted(set(prompt) | set(tail))
                    others = [p for p in held if p not in forced]
                    noise = {p: noise_by_hand(seed, 0, h, p, newest) for p in others}
                    drawn = sorted(others, key=lambda p, noise=noise: -noise[p])[:keep_after - len(forced)]
                    held = sorted(forced + drawn)
    return log


@pytest.mark.parametrize("protect_prompt", [True, False])
def test_cuts_match_the_official_rule(protect_prompt):
    torch.manual_seed(0)
    batch, q_heads, kv_heads, length, head_dim, count, seed = 3, 4, 2, 12, 8, 50, 7
    pad = torch.arange(length)[None, :] >= (length - torch.tensor([12, 6, 2]))[:, None]
    q, k, v = (torch.randn(batch, h, length, head_dim) for h in (q_heads, kv_heads, kv_heads))
    steps = [(torch.randn(batch, q_heads, 1, head_dim), torch.randn(batch, kv_heads, 1, head_dim),
              torch.randn(batch, kv_heads, 1, head_dim)) for _ in range(count)]
    policy = RandomAttentionPolicy(20, recent=4, compress_every=6, seed=seed, protect_prompt=protect_prompt)
    held, _ = drive_layer(policy, q, k, v, pad, steps, head_dim ** -0.5)
    expected = reference_random(k, pad, count, budget=20, keep_after=14, recent=4, seed=seed)
    if not protect_prompt:  # the `random` ablation: nothing but the newest is forced
        expected = None
    for t in range(count):
        for b in range(batch):
            for h in range(kv_heads):
                assert len(held[t][b][h]) <= 20
                if expected is not None:
                    assert held[t][b][h] == expected[t][b][h], (t, b, h)
    first_cut = 20 - 12 - 1  # row 0: 12 prompt tokens, full after 8 steps
    if protect_prompt:
        assert set(range(9)) <= held[first_cut + 1][0][0]  # K - 1 = 9 prompt tokens forced
    assert held[-1][0][0] != held[-1][0][1]  # per KV head


def test_each_slot_survives_a_cut_with_the_same_chance():
    """Over many cuts of one full row, every candidate is kept about (K - pl) / candidates of the time."""
    policy = RandomAttentionPolicy(40, recent=8, compress_every=10)  # cuts 40 slots to 30
    k = torch.randn(1, 1, 5, 4)
    pad = torch.ones(1, 5, dtype=torch.bool)
    steps = [(torch.randn(1, 2, 1, 4), torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4)) for _ in range(2000)]
    held, _ = drive_layer(policy, torch.randn(1, 2, 5, 4), k, k.clone(), pad, steps, 0.5)
    # After each cut (every 10 steps from step 34 on) the candidates were the 27 tokens after the 5
    # prompt tokens and before the 8 newest; 30 - 5 - 8 = 17 of them were kept. Count how often a
    # token survives its first cut as a candidate.
    survived, tried = 0, 0
    for t in range(35, 2000 - 10, 10):
        before, after = held[t - 1][0][0], held[t][0][0]  # t - 1 attended to the full cache, then the cut
        newest = max(before)
        candidates = {p for p in before if 5 <= p <= newest - 8}
        survived += len(candidates & after)
        tried += len(candidates)
        assert set(range(5)) <= after
    assert abs(survived / tried - 17 / 27) < 0.03


@pytest.fixture(scope="module")
def qwen3():
    return tiny_model("qwen3")


def prompts(lengths):
    return [[5 + (7 * i + 3 * n) % 300 for i in range(n)] for n in lengths]


def test_a_row_draws_the_same_beside_any_batch_mates_and_after_a_resume(qwen3):
    model, tokenizer = qwen3
    generation = GenerationConfig(max_new_tokens=48, ignore_eos=True)

    def engine(**config):
        return Engine(model, lambda: RandomAttentionPolicy(24, recent=4, compress_every=6), [],
                      tokenizer.pad_token_id, EngineConfig(**config))

    static = engine()
    alone = [static.generate([p], generation, [0]).tokens[0] for p in prompts((7, 30, 19))]
    assert static.generate(prompts((7, 30, 19)), generation, [0, 1, 2]).tokens == alone
    assert static.generate(prompts((19, 7)), generation, [5, 9]).tokens == [alone[2], alone[0]]
    torch.manual_seed(1234)  # a resumed run: a new process, its global random state elsewhere
    torch.rand(1000)
    assert static.generate(prompts((30,)), generation, [0]).tokens == [alone[1]]
    served = engine(batch_size=2, check_every=4, refill_rows=1, prefill_rows=1)
    finished = {s.index: s.tokens for r in served.serve(prompts((30, 7, 19)), generation, [0, 1, 2])
                for s in r.finished}
    assert [finished[i] for i in range(3)] == [alone[1], alone[0], alone[2]]
    # and the draws matter: another seed gives other tokens
    other = Engine(model, lambda: RandomAttentionPolicy(24, recent=4, compress_every=6, seed=1), [],
                   tokenizer.pad_token_id)
    assert [other.generate([p], generation, [0]).tokens[0] for p in prompts((7, 30, 19))] != alone


def test_config_builds_the_policy():
    path = Path(__file__).resolve().parents[1] / "conf" / "method" / "random_attention.yaml"
    fields = yaml.safe_load(path.read_text())
    assert fields.pop("name") == "random_attention" and locate(fields.pop("_target_")) is RandomAttentionPolicy
    assert fields == method_defaults(RandomAttentionPolicy)
    policy = policy_of("random_attention", 1024)
    assert (policy.slots_held, policy.keep_after, policy.newest_kept, policy.shared_selection) == (1024, 960, 64,
                                                                                                  False)
    target = RandomAttentionPolicy(1024, budget_mode="target")
    assert (target.slots_held, target.keep_after) == (1088, 1024)


def test_small_budgets_shrink_the_interval_then_the_newest():
    with pytest.warns(UserWarning, match="using 24"):
        policy = RandomAttentionPolicy(96)
    assert (policy.keep_after, policy.newest_kept) == (72, 64)
    with pytest.warns(UserWarning, match="no room for 64 newest tokens; using 15"):
        policy = RandomAttentionPolicy(40)
    assert (policy.keep_after, policy.newest_kept) == (30, 15)


@pytest.mark.parametrize("bad", [dict(budget_mode="ratio"), dict(recent=0), dict(seed=-1), dict(seed=2 ** 17),
                                 dict(seed=1.5), dict(budget=3), dict(budget=64, budget_mode="target")])
def test_invalid_settings(bad):
    with pytest.raises(UserError):
        RandomAttentionPolicy(**{"budget": 1024, **bad})
