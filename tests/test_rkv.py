"""R-KV: equality with the full cache, the budget at every step, and the scores against plain
transcriptions of docs/methods.md (loops over rows and heads, written independently of baselines/rkv.py):
the official code (`paper`) and the LongFlow authors' `RKVCache` (`lf_repo`)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml
from helpers import VARIANTS, capped, method_defaults, policy_of, tiny_model

from baselines.rkv import RKVLfRepoPolicy, RKVPolicy, lf_repo_scores
from baselines.vanilla import VanillaPolicy
from longflow.config import GenerationConfig
from longflow.engine import Engine
from longflow.errors import UserError
from longflow.methods import locate
from longflow.policy import CacheSpec

MODES = ("cap", "target")
# Small-budget settings: compressions every few steps, prompts longer than the budget.
SMALL = {
    "paper": dict(budget=24, compress_every=8),
}
PROMPT_LENGTHS = (7, 40, 19)


def prompts(lengths=PROMPT_LENGTHS):
    return [[5 + (7 * i + 3 * n) % 300 for i in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def qwen3():
    return tiny_model("qwen3")  # GQA: 8 query heads over 2 KV heads


# ---- end to end ------------------------------------------------------------------------------


@pytest.mark.parametrize("budget_mode", MODES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_large_budget_matches_vanilla(tiny, variant, budget_mode):
    model, tokenizer = tiny
    generation = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    batch = prompts((7, 30, 18))
    full = Engine(model, VanillaPolicy, [], tokenizer.pad_token_id).generate(batch, generation, [0, 1, 2])
    policy = lambda: policy_of("rkv", 512, variant=variant, budget_mode=budget_mode)  # noqa: E731
    result = Engine(model, policy, [], tokenizer.pad_token_id).generate(batch, generation, [0, 1, 2])
    assert result.tokens == full.tokens
    assert result.peak_slots == [len(p) + 23 for p in batch]


class CheckedRKV(RKVPolicy):
    """Asserts the slot invariants after every store, attention and compression."""

    def allocate(self, spec):
        super().allocate(spec)
        self.limit = self.budget if self.budget_mode == "cap" else self.budget + self.interval - 1
        self.cuts = [0] * spec.batch
        self.prefill_cut = False

    def store(self, layer, k, v):
        out = super().store(layer, k, v)
        self.check(layer)
        return out

    def attend(self, layer, q, k, v, scale):
        if self.prefilling and any(self.prompt_cut(n) for n in self.prompt_lengths):
            self.prefill_cut = True
        out = super().attend(layer, q, k, v, scale)
        self.check(layer)
        return out

    def after_step(self, step):
        before = list(self.held)
        super().after_step(step)
        self.cuts = [c + (n < b + 1) for c, n, b in zip(self.cuts, self.held, before, strict=True)]
        for layer, slots in enumerate(self.layers):
            self.check(layer)
            counts = slots.valid.sum(dim=-1)  # [B, Hkv]
            assert counts.eq(torch.tensor(self.held)[:, None]).all(), "host count != slots held"
            newest = self.positions  # the next token's position: the previous ones must be held
            for back in range(1, self.protect + 1):
                wanted = (newest - back)[:, None, None]
                assert ((slots.positions == wanted).any(-1) | (wanted < 0).squeeze(-1)).all()

    def check(self, layer):
        slots = self.layers[layer]
        held = slots.valid.sum(dim=-1)
        assert int(held.max()) <= self.limit
        # Held slots are the low ones, in position order (so free slots are the high ones).
        index = torch.arange(slots.slots)
        assert slots.valid.eq(index < held[..., None]).all()
        ordered = slots.positions[..., 1:] > slots.positions[..., :-1]
        assert (ordered | ~slots.valid[..., 1:]).all()
        assert slots.positions.masked_select(~slots.valid).eq(-1).all()
        if self.shared_selection:
            assert slots.positions.eq(slots.positions[:, :1]).all()


@pytest.mark.parametrize("budget_mode", MODES)
@pytest.mark.parametrize("variant", ["paper"])
def test_small_budget_never_exceeded(qwen3, variant, budget_mode):
    model, tokenizer = qwen3
    made = []

    def factory():
        made.append(CheckedRKV(variant=variant, budget_mode=budget_mode, **SMALL[variant]))
        return made[-1]

    generation = GenerationConfig(max_new_tokens=48, ignore_eos=True)
    result = Engine(model, factory, [], tokenizer.pad_token_id).generate(prompts(), generation, [0, 1, 2])
    policy = made[0]
    assert policy.prefill_cut  # the 40-token prompt exceeds the budget
    assert all(cuts >= 2 for cuts in policy.cuts)
    assert max(result.peak_slots) <= policy.limit
    if budget_mode == "cap":
        assert max(result.peak_slots) == SMALL[variant]["budget"]


def test_rows_are_cut_independently(qwen3):
    """A row's tokens do not depend on its batch-mates: each row is cut when its own cache is full."""
    model, tokenizer = qwen3
    engine = Engine(model, lambda: RKVPolicy(**SMALL["paper"]), [], tokenizer.pad_token_id)
    generation = GenerationConfig(max_new_tokens=32, ignore_eos=True)
    batch = engine.generate(prompts(), generation, [0, 1, 2]).tokens
    alone = [engine.generate([p], generation, [0]).tokens[0] for p in prompts()]
    assert batch == alone


def test_config_builds_the_policy():
    path = Path(__file__).resolve().parents[1] / "conf" / "method" / "rkv.yaml"
    fields = yaml.safe_load(path.read_text())
    assert fields.pop("name") == "rkv" and locate(fields.pop("_target_")) is RKVPolicy
    assert fields == method_defaults(RKVPolicy)
    policy = policy_of("rkv", 512)
    assert isinstance(policy, RKVPolicy)
    assert (policy.variant, policy.queries_held, policy.pool_kernel, policy.lam) == ("paper", 8, 7, 0.1)
    assert (policy.slots_held, policy.keep_after, policy.shared_selection) == (512, 384, False)
    lf = policy_of("rkv", 512, variant="lf_repo")
    assert type(lf) is RKVLfRepoPolicy and lf.variant == "lf_repo"  # the config's variant picks the class
    lf_fields = (lf.queries_held, lf.pool_kernel, lf.protect, lf.keep_after, lf.shared_selection)
    assert lf_fields == (9, 5, 128, 380, True)
    target = RKVPolicy(512, budget_mode="target")
    assert (target.slots_held, target.keep_after) == (639, 512)


@pytest.mark.parametrize("bad", [dict(variant="x"), dict(variant="lf_repo"), dict(budget_mode="x"), dict(budget=8),
                                 dict(kernel=4), dict(budget_mode="target", compress_every=1)])
def test_invalid_settings(bad):
    with pytest.raises(UserError):
        RKVPolicy(**{"budget": 512, **bad})


def test_no_budget_is_refused_before_the_buffers():
    policy = RKVPolicy()  # a scorer of another method needs none; a cache does
    with pytest.raises(UserError, match="needs a budget"):
        policy.allocate(CacheSpec(batch=1, layers=1, q_heads=2, kv_heads=1, head_dim=4, prompt_len=4,
                                  max_new_tokens=8, dtype=torch.float32, device=torch.device("cpu")))


@pytest.mark.parametrize("variant", ["paper"])
def test_budget_below_the_interval_shrinks_it(variant):
    with pytest.warns(UserWarning, match="using 16"):
        policy = RKVPolicy(64, variant=variant)
    assert policy.interval == 16 and policy.slots_held == 64
    assert policy.protect < policy.keep_after < policy.slots_held


# ---- paper: scores against docs/methods.md -------------------------------------------------------


def reference_scores(queries, query_valid, keys, held, scale, protect, kernel, lam, threshold):
    """docs/methods.md (paper), transcribed with loops. Held slots are contiguous and in position
    order; the last W slots are the window queries' own tokens. Returns float64 `[B, Hkv, S]` (nan =
    not a candidate)."""
    batch, q_heads, window, _ = queries.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    group = q_heads // kv_heads
    queries, keys = queries.double(), keys.double()
    out = torch.full((batch, kv_heads, slots), float("nan"), dtype=torch.float64)
    for b in range(batch):
        for h in range(kv_heads):
            tokens = [j for j in range(slots) if held[b, h, j]]
            older = [j for j in tokens if j < slots - window]
            candidates = [j for j in tokens if j < slots - protect]
            if not candidates:
                continue
            # Importance: max over the group's query heads of the logits, softmax over keys[:-W].
            used = [t for t in range(window) if query_valid[b, t]]
            importance = torch.zeros(len(older), dtype=torch.float64)
            for t in used:
                logits = torch.tensor([
                    max(float(queries[b, h * group + g, t] @ keys[b, h, j]) for g in range(group)) * scale
                    for j in older
                ], dtype=torch.float64)
                importance += torch.softmax(logits, dim=0)
            importance /= len(used)
            half = kernel // 2
            pooled = [max(importance[max(0, i - half):i + half + 1]) for i in range(len(older))]
            # Redundancy over all held keys.
            ks = keys[b, h, tokens]
            unit = ks / (ks.norm(dim=-1, keepdim=True) + 1e-8)
            sim = unit @ unit.T
            for i in range(len(tokens)):
                sim[i, i] = 0.0
            for i in range(len(tokens)):
                duplicates = [j for j in range(len(tokens)) if sim[i, j] > threshold]
                if duplicates:
                    sim[i, max(duplicates)] = 0.0  # the most recent duplicate is kept
            redundancy = torch.softmax(sim.mean(dim=0), dim=0)
            for i, j in enumerate(candidates):
                out[b, h, j] = lam * pooled[i] - (1 - lam) * redundancy[tokens.index(j)]
    return out


def random_case(seed, q_heads, kv_heads, slots, window, pads, duplicates=True):
    generator = torch.Generator().manual_seed(seed)
    batch, dim = len(pads), 16
    queries = torch.randn(batch, q_heads, window, dim, generator=generator)
    # A shared direction makes many pairs exceed the 0.5 cosine threshold, some not.
    common = torch.randn(batch, kv_heads, 1, dim, generator=generator)
    share = torch.rand(batch, kv_heads, slots, 1, generator=generator) < 0.6
    keys = share * common + 0.9 * torch.randn(batch, kv_heads, slots, dim, generator=generator)
    if duplicates:  # exact duplicates (cosine 1, ties among the duplicates of a row)
        keys[:, :, 9] = keys[:, :, 4]
        keys[:, :, 12] = 2 * keys[:, :, 4]
        keys[:, :, 15] = keys[:, :, 6]
    held = (torch.arange(slots) >= torch.tensor(pads)[:, None])[:, None, :].expand(batch, kv_heads, slots)
    query_valid = torch.ones(batch, window, dtype=torch.bool)
    return queries, query_valid, keys, held


def assert_scores_match(scores, reference, held, protect):
    slots = scores.shape[-1]
    candidate = ~reference.isnan()
    torch.testing.assert_close(scores[candidate].double(), reference[candidate], atol=1e-5, rtol=1e-4)
    protected = held & (torch.arange(slots) >= slots - protect)
    assert scores[protected].eq(float("inf")).all()
    assert scores[~held].eq(float("-inf")).all()
    assert candidate.eq(held & ~protected).all()


@pytest.mark.parametrize("variant", ["paper"])
@pytest.mark.parametrize("heads", [(2, 2), (8, 2)])
def test_scores_match_reference(variant, heads):
    from baselines.rkv import rkv_scores

    window, protect, kernel = 8, 8, 7
    queries, query_valid, keys, held = random_case(0, *heads, slots=40, window=window, pads=[0, 3, 11])
    scores = rkv_scores(queries, query_valid, keys, held, 0.25, protect=protect, kernel=kernel, lam=0.1,
                        threshold=0.5)
    reference = reference_scores(queries, query_valid, keys, held, 0.25, protect, kernel, 0.1, 0.5)
    assert_scores_match(scores, reference, held, protect)


def test_scores_match_reference_with_free_slots_among_the_held():
    """Free slots among the held ones, holding stale keys, add nothing to any similarity. They are
    put among the window's slots, which the importance does not score: its max-pool runs over slot
    neighbours and the reference's over held tokens, which differ around a hole (R-KV's held slots
    are compacted, so a hole before the window is only ever left padding)."""
    from baselines.rkv import rkv_scores

    window, protect, kernel = 8, 8, 7
    queries, query_valid, keys, held = random_case(1, 8, 2, slots=40, window=window, pads=[0, 0])
    held = held.clone()
    held[0, :, [33, 35]] = False
    held[1, 1, [32, 38, 39]] = False
    keys = keys.masked_fill(~held[..., None], 0.0) + (~held[..., None]) * 3.0  # stale values in free slots
    scores = rkv_scores(queries, query_valid, keys, held, 0.25, protect=protect, kernel=kernel, lam=0.1,
                        threshold=0.5)
    reference = reference_scores(queries, query_valid, keys, held, 0.25, protect, kernel, 0.1, 0.5)
    assert_scores_match(scores, reference, held, protect)


@pytest.mark.parametrize("slots", [1, 2, 3, 7, 40])
def test_newest_duplicates_by_hand(slots):
    """Each row's largest j != i with u_i . u_j > threshold (slot S - 1 and 0 without one), free slots
    (zero unit keys) among them, at slot counts that the similarity blocks do not divide."""
    from baselines.rkv import blocked_newest_duplicates

    generator = torch.Generator().manual_seed(slots)
    keys = torch.randn(2, 2, slots, 6, generator=generator) + torch.randn(2, 2, 1, 6, generator=generator)
    unit = keys / keys.norm(dim=-1, keepdim=True)
    unit[0, 1, ::3] = 0.0  # free slots
    index, similarity = blocked_newest_duplicates(unit, 0.5)
    for b in range(2):
        for h in range(2):
            for i in range(slots):
                above = [j for j in range(slots) if j != i and float(unit[b, h, i] @ unit[b, h, j]) > 0.5]
                expected = max(above, default=slots - 1)
                assert int(index[b, h, i]) == expected
                value = float(unit[b, h, i] @ unit[b, h, expected]) if above else 0.0
                assert math.isclose(float(similarity[b, h, i]), value, rel_tol=1e-5, abs_tol=1e-6)


def test_scores_reach_the_threshold_rule():
    """The case exercises duplicates: some rows have several keys above the threshold, some none."""
    queries, query_valid, keys, held = random_case(0, 8, 2, slots=40, window=8, pads=[0, 3, 11])
    unit = keys / keys.norm(dim=-1, keepdim=True)
    sim = unit @ unit.transpose(-1, -2) - torch.eye(40)
    above = (sim > 0.5).sum(dim=-1)
    assert (above >= 2).any() and (above == 0).any()


def make_policy(variant, **kwargs):
    params = dict(budget=24, compress_every=8)
    policy = RKVPolicy(variant=variant, **{**params, **kwargs})
    spec = CacheSpec(batch=3, layers=2, q_heads=8, kv_heads=2, head_dim=16, prompt_len=30, max_new_tokens=8,
                     dtype=torch.float32, device=torch.device("cpu"))
    policy.allocate(spec)
    return policy


@pytest.mark.parametrize("limit", [None, "SCORE_BYTES", "STACKED_KEY_BYTES"])
@pytest.mark.parametrize("variant", ["paper"])
def test_decode_compression_keeps_the_top_scored(variant, limit, monkeypatch):
    if limit is not None:  # one (layer, row), or one layer, per scoring call instead of every layer and row at once
        monkeypatch.setattr(f"baselines.rkv.{limit}", 1)
    policy = make_policy(variant)
    slots_n, window = policy.slots_held, policy.queries_held
    generator = torch.Generator().manual_seed(1)
    offsets = torch.tensor([30, 7, 55])
    saved = []
    for layer, slots in enumerate(policy.layers):
        queries, _, keys, _ = random_case(layer, 8, 2, slots=slots_n, window=window, pads=[0, 0, 0])
        slots.keys.copy_(keys)
        slots.values.copy_(torch.randn(slots.values.shape, generator=generator))
        slots.valid.fill_(True)
        slots.positions.copy_((offsets[:, None] + torch.arange(slots_n))[:, None, :].expand(3, 2, -1))
        policy.history.rings[layer].copy_(queries)
        names = ("keys", "values", "valid", "positions")
        saved.append({name: getattr(slots, name).clone() for name in names})
    policy.compress([0, 2])

    every = torch.ones(3, window, dtype=torch.bool)
    for layer, slots in enumerate(policy.layers):
        before = saved[layer]
        for name in before:  # row 1 was not full: untouched
            assert getattr(slots, name)[1].equal(before[name][1])
        reference = reference_scores(policy.history.rings[layer], every, before["keys"], before["valid"],
                                     policy.scale, policy.protect, policy.pool_kernel, policy.lam,
                                     policy.threshold)
        for row in (0, 2):
            for head in range(2):
                n = policy.keep_after
                assert slots.valid[row, head, :n].all() and not slots.valid[row, head, n:].any()
                kept_positions = slots.positions[row, head, :n]
                kept = kept_positions - offsets[row]  # original slot of each kept token
                assert (kept[1:] > kept[:-1]).all()
                assert slots.keys[row, head, :n].equal(before["keys"][row, head, kept])
                assert slots.values[row, head, :n].equal(before["values"][row, head, kept])
                assert set(range(slots_n - policy.protect, slots_n)) <= set(kept.tolist())
                score = reference[row, head]
                chosen = torch.zeros(slots_n, dtype=torch.bool)
                chosen[kept] = True
                candidate = ~score.isnan()
                assert int((chosen & candidate).sum()) == n - policy.protect
                assert score[chosen & candidate].min() >= score[~chosen & candidate].max() - 1e-6
        assert policy.next_slot[layer][[0, 2]].eq(policy.keep_after).all()


def keep_by_hand(score, protect, count):
    """The cut's rule for one row and head, from the transcription's scores `[S]` (nan = not a
    candidate): the `protect` newest slots, then the best candidates (ties: the higher slot)."""
    slots = len(score)
    newest = set(range(slots - protect, slots))
    ranked = sorted((j for j in range(slots) if not math.isnan(float(score[j]))), key=lambda j: (-float(score[j]), -j))
    return sorted(newest | set(ranked[:count - protect]))


@pytest.mark.parametrize("cut", [[0, 1, 2, 3], [0, 2, 3]], ids=["every_row", "full_rows"])
def test_a_batched_cut_is_the_per_row_transcription(cut):
    """Rows at different fill levels and positions (row 1 holds fewer slots when it is not cut), cut
    together: each cut row keeps what the transcription of the rule keeps for it alone."""
    spec = CacheSpec(batch=4, layers=2, q_heads=8, kv_heads=2, head_dim=16, prompt_len=30, max_new_tokens=8,
                     dtype=torch.float32, device=torch.device("cpu"))
    policy = RKVPolicy(budget=24, compress_every=8)
    policy.allocate(spec)
    slots_n, window, keep = policy.slots_held, policy.queries_held, policy.keep_after
    held = torch.tensor([slots_n, slots_n if 1 in cut else slots_n - 5, slots_n, slots_n])
    offsets = torch.tensor([30, 7, 55, 12])
    generator = torch.Generator().manual_seed(3)
    saved = []
    for layer, slots in enumerate(policy.layers):
        # No exact duplicates: their tied scores would be ordered by rounding, float32 against float64.
        queries, _, keys, _ = random_case(10 + layer, 8, 2, slots=slots_n, window=window, pads=[0] * 4,
                                          duplicates=False)
        slots.keys.copy_(keys)
        slots.values.copy_(torch.randn(slots.values.shape, generator=generator))
        slots.valid.copy_((torch.arange(slots_n) < held[:, None])[:, None, :].expand(4, 2, slots_n))
        slots.positions.copy_(torch.where(slots.valid, (offsets[:, None] + torch.arange(slots_n))[:, None, :], -1))
        policy.history.rings[layer].copy_(queries)
        saved.append({name: getattr(slots, name).clone() for name in ("keys", "values", "valid", "positions")})
    policy.begin_decode(offsets + held)  # the engine's positions: the token the next step writes
    policy.compress(cut)

    every = torch.ones(1, window, dtype=torch.bool)
    for layer, slots in enumerate(policy.layers):
        before = saved[layer]
        for row in range(4):
            if row not in cut:
                for name, tensor in before.items():
                    assert getattr(slots, name)[row].equal(tensor[row])
                continue
            reference = reference_scores(policy.history.rings[layer][row:row + 1], every,
                                         before["keys"][row:row + 1], before["valid"][row:row + 1], policy.scale,
                                         policy.protect, policy.pool_kernel, policy.lam, policy.threshold)[0]
            for head in range(2):
                kept = keep_by_hand(reference[head], policy.protect, keep)
                assert slots.positions[row, head, :keep].tolist() == [int(offsets[row]) + j for j in kept]
                assert slots.keys[row, head, :keep].equal(before["keys"][row, head, kept])
                assert slots.values[row, head, :keep].equal(before["values"][row, head, kept])
                assert slots.valid[row, head].tolist() == [True] * keep + [False] * (slots_n - keep)
                assert slots.keys[row, head, keep:].eq(0).all() and slots.positions[row, head, keep:].eq(-1).all()


@pytest.mark.parametrize("budget_mode", MODES)
@pytest.mark.parametrize("variant", ["paper"])
def test_prefill_compression_keeps_the_top_scored(variant, budget_mode):
    """cap: the padded prompt exceeds the slots (the base class selects first); target: it fits in
    the slots but its rows exceed the target (only `on_prompt_stored` cuts)."""
    policy = make_policy(variant, budget_mode=budget_mode)
    extra = policy.slots_held if budget_mode == "cap" else policy.keep_after
    batch, length, window = 3, extra + 6, policy.queries_held
    generator = torch.Generator().manual_seed(2)
    lengths = torch.tensor([length, length - 4, 5])  # row 2 is shorter than the window
    pad = torch.arange(length) >= (length - lengths)[:, None]
    positions = (pad.long().cumsum(-1) - 1).clamp(min=0)
    q = torch.randn(batch, 8, length, 16, generator=generator)
    k = torch.randn(batch, 2, length, 16, generator=generator)
    k = k + torch.randn(batch, 2, 1, 16, generator=generator)  # correlated keys: duplicates
    v = torch.randn(batch, 2, length, 16, generator=generator)
    policy.begin_prefill(pad, positions)
    policy.attend(0, q, k, v, 0.25)
    slots, keep = policy.layers[0], policy.keep_after
    assert policy.prompt_cut(length) and policy.prompt_cut(length - 4) and not policy.prompt_cut(5)

    held = pad[:, None, :].expand(batch, 2, length)
    query_valid = pad[:, -window:]
    reference = reference_scores(q[:, :, -window:], query_valid, k, held, 0.25, policy.protect,
                                 policy.pool_kernel, policy.lam, policy.threshold)
    for row in range(batch):
        n = min(keep, int(lengths[row]))
        for head in range(2):
            assert slots.valid[row, head, :n].all() and not slots.valid[row, head, n:].any()
            kept_positions = slots.positions[row, head, :n]
            kept = kept_positions + (length - lengths[row])  # index in the padded prompt
            assert (kept_positions[1:] > kept_positions[:-1]).all()
            assert slots.keys[row, head, :n].equal(k[row, head, kept])
            protected = range(length - min(policy.protect, int(lengths[row])), length)
            assert set(protected) <= set(kept.tolist())
            score = reference[row, head]
            chosen = torch.zeros(length, dtype=torch.bool)
            chosen[kept] = True
            candidate = ~score.isnan()
            if candidate.any() and (~chosen & candidate).any():
                assert score[chosen & candidate].min() >= score[~chosen & candidate].max() - 1e-6
    # The query ring holds each row's newest prompt queries at slot position mod W.
    ring = policy.history.rings[0]
    for row in range(batch):
        for t in range(max(0, int(lengths[row]) - window), int(lengths[row])):
            assert ring[row, :, t % window].equal(q[row, :, length - int(lengths[row]) + t])


def test_softmax_scale_convention():
    """Sanity: the default scale is 1/sqrt(D), the models' own."""
    policy = make_policy("paper")
    assert math.isclose(policy.scale, 16 ** -0.5)


# ---- lf_repo: the LongFlow authors' RKVCache, transcribed -----------------------------------------


def reference_lf_scores(queries, keys, kernel, lam):
    """docs/methods.md (R-KV, lf_repo) with loops, for one row: queries `[Hq, W, D]`, keys `[Hkv, N, D]`
    in cache order -> Z `[N]` float64."""
    q_heads, window, dim = queries.shape
    kv_heads, count = keys.shape[:2]
    group = q_heads // kv_heads
    queries, keys = queries.double(), keys.double()
    importance = torch.zeros(q_heads, count, dtype=torch.float64)
    for h in range(q_heads):
        for w in range(window):
            logits = torch.tensor([float(queries[h, w] @ keys[h // group, j]) / math.sqrt(dim) for j in range(count)],
                                  dtype=torch.float64)
            importance[h] += torch.softmax(logits, dim=0)
    half = kernel // 2
    pooled = torch.tensor([[max(importance[h, max(0, j - half):j + half + 1]) for j in range(count)]
                           for h in range(q_heads)], dtype=torch.float64)
    redundancy = torch.zeros(count, dtype=torch.float64)
    for h in range(kv_heads):
        unit = [keys[h, i] / float(keys[h, i] @ keys[h, i]) for i in range(count)]
        row_mean = torch.tensor([sum(float(unit[i] @ unit[j]) for j in range(count)) / count for i in range(count)],
                                dtype=torch.float64)
        redundancy += torch.softmax(row_mean, dim=0) / kv_heads
    return lam * pooled.mean(dim=0) - (1 - lam) * redundancy


@pytest.mark.parametrize("heads", [(2, 2), (8, 2)])
def test_lf_repo_scores_match_reference(heads):
    """Left padding is not scored: a row's real keys score as they would alone."""
    queries, query_valid, keys, _ = random_case(0, *heads, slots=30, window=9, pads=[0, 0, 0])
    held = torch.arange(30) >= torch.tensor([0, 4, 13])[:, None]
    scores = lf_repo_scores(queries, query_valid, keys, held, kernel=5, lam=0.1)
    assert scores[~held].eq(float("-inf")).all()
    for row in range(3):
        expected = reference_lf_scores(queries[row], keys[row][:, held[row]], kernel=5, lam=0.1)
        torch.testing.assert_close(scores[row][held[row]].double(), expected, rtol=1e-4, atol=1e-6)


def authors_cache(prompt, steps, budget, protect, margin, queries, kernel, lam, scale):
    """The authors' `RKVCache` driven by `generate`, for one row, on lists in cache order.

    prompt: (q `[Hq, n, D]`, k, v `[Hkv, n, D]`); steps: (q `[Hq, D]`, k, v `[Hkv, D]`). The query
    window is the last `queries - 1` prompt queries, then those plus each step's own. A cache of
    more than budget - margin tokens keeps the top budget - margin - 2 protect of all but its
    `protect` newest, in score order, then those newest: at prefill, and within each step after
    the append, before attention. Returns the cache order and the outputs `[Hq, D]` per step.
    """
    pq, pk, pv = prompt
    n, limit = pk.shape[1], budget - margin
    cache = [(p, pk[:, p], pv[:, p]) for p in range(n)]
    window = [pq[:, p] for p in range(max(0, n - (queries - 1)), n)]

    def cut(cache, window):
        scored = cache[:-protect]
        z = reference_lf_scores(torch.stack(window, dim=1), torch.stack([k for _, k, _ in scored], dim=1),
                                kernel, lam)
        return [scored[i] for i in z.topk(limit - 2 * protect).indices.tolist()] + cache[-protect:]

    if n > limit:
        cache = cut(cache, window)
    orders, outputs = [], []
    for t, (q, k, v) in enumerate(steps):
        window = window[-(queries - 1):] + [q]
        cache.append((n + t, k, v))
        if len(cache) > limit:
            cache = cut(cache, window)
        group = q.shape[0] // k.shape[0]
        keys = torch.stack([key for _, key, _ in cache], dim=1)  # [Hkv, T, D]
        values = torch.stack([value for _, _, value in cache], dim=1)
        outputs.append(torch.stack([torch.softmax(keys[h // group] @ q[h] * scale, dim=0) @ values[h // group]
                                    for h in range(q.shape[0])]))
        orders.append([p for p, _, _ in cache])
    return orders, outputs


def test_lf_repo_cuts_inside_the_step_like_the_authors_cache():
    """Random tensors, GQA, left padding, one prompt above budget - margin: at every step the slots
    hold the authors' cache in its order (score order, then the newest) and the outputs agree."""
    torch.manual_seed(4)
    batch, q_heads, kv_heads, length, dim, scale = 3, 8, 2, 40, 16, 0.25
    budget, protect, margin, queries, kernel = 40, 6, 4, 5, 3
    lengths = [40, 9, 3]
    pad = torch.arange(length) >= (length - torch.tensor(lengths))[:, None]
    q = torch.randn(batch, q_heads, length, dim)
    k = torch.randn(batch, kv_heads, length, dim) + torch.randn(batch, kv_heads, 1, dim)  # correlated keys
    v = torch.randn(batch, kv_heads, length, dim)
    steps = [(torch.randn(batch, q_heads, 1, dim), torch.randn(batch, kv_heads, 1, dim),
              torch.randn(batch, kv_heads, 1, dim)) for _ in range(45)]
    policy = capped(RKVLfRepoPolicy)(budget, lf_queries=queries, lf_kernel=kernel,
                               lf_protect=protect, lf_margin=margin, lam=0.1)
    policy.allocate(CacheSpec(batch=batch, layers=1, q_heads=q_heads, kv_heads=kv_heads, head_dim=dim,
                              prompt_len=length, max_new_tokens=len(steps) + 1, dtype=torch.float32,
                              device=torch.device("cpu")))
    policy.begin_prefill(pad, (pad.long().cumsum(dim=-1) - 1).clamp(min=0))
    policy.store(0, k, v)
    policy.attend(0, q, k, v, scale)
    positions = pad.sum(dim=-1)
    policy.begin_decode(positions)
    orders, outputs, eager = [], [], []
    for step, (qs, ks, vs) in enumerate(steps):
        eager.append(policy.before_step(step))
        policy.store(0, ks, vs)
        outputs.append(policy.attend(0, qs, ks, vs, scale)[:, 0])
        slots = policy.layers[0]
        assert slots.valid.sum(dim=-1).max() <= budget - margin  # what a query attends to
        orders.append([slots.positions[b, 0][slots.valid[b, 0]].tolist() for b in range(batch)])
        policy.after_step(step)
        positions += 1
    for b, n in enumerate(lengths):
        prompt = (q[b, :, length - n:], k[b, :, length - n:], v[b, :, length - n:])
        row_steps = [(qs[b, :, 0], ks[b, :, 0], vs[b, :, 0]) for qs, ks, vs in steps]
        expected_orders, expected_outputs = authors_cache(prompt, row_steps, budget, protect, margin, queries,
                                                          kernel, 0.1, scale)
        for step in range(len(steps)):
            assert orders[step][b] == expected_orders[step], f"row {b}, step {step}"
            torch.testing.assert_close(outputs[step][b], expected_outputs[step], rtol=1e-5, atol=1e-6)
    # a step runs eagerly exactly when some row cuts in it; each row cuts every protect + 1 steps
    cut_steps = [step for step in range(len(steps))
                 if any(len(orders[step][b]) < len(orders[step - 1][b]) + 1 for b in range(batch) if step)]
    assert [step for step, flag in enumerate(eager) if flag] == cut_steps and len(cut_steps) >= 6


class CheckedRKVRepo(capped(RKVLfRepoPolicy)):
    """The hard cap (`capped`), what a query attends to, and the `protect` newest at every attention."""

    def attend(self, layer, q, k, v, scale):
        out = super().attend(layer, q, k, v, scale)
        slots = self.layers[layer]
        held = slots.valid.sum(dim=-1)  # [B, Hkv]
        assert int(held.max()) <= self.hold_limit
        assert slots.valid.eq(torch.arange(slots.slots) < held[..., None]).all(), "held slots are the low ones"
        assert slots.positions.eq(slots.positions[:, :1]).all(), "one selection per layer"
        if not self.prefilling:
            for row, newest in enumerate(self.positions.tolist()):
                kept = set(slots.positions[row, 0].tolist())
                assert set(range(newest - self.protect + 1, newest + 1)) <= kept
        return out


def test_lf_repo_small_budget_in_the_engine(qwen3):
    model, tokenizer = qwen3
    made = []

    def factory():
        made.append(CheckedRKVRepo(40, lf_protect=6))
        return made[-1]

    generation = GenerationConfig(max_new_tokens=48, ignore_eos=True)
    result = Engine(model, factory, [], tokenizer.pad_token_id).generate(prompts(), generation, [0, 1, 2])
    policy = made[0]
    assert policy.slots_held == 37 and policy.keep_after == 30 and policy.keep_scored == 24
    assert policy.prompt_cut(40) and not policy.prompt_cut(19)
    assert result.peak_slots == [37, 37, 37]  # budget - lf_margin + 1: the stored token, before the cut
    assert all(len(tokens) == 48 for tokens in result.tokens)


def test_lf_repo_budget_below_their_minimum_shrinks_the_protected_tail():
    with pytest.warns(UserWarning, match="using 15"):
        policy = RKVLfRepoPolicy(64)
    assert (policy.protect, policy.slots_held, policy.keep_after, policy.keep_scored) == (15, 61, 45, 30)
    assert RKVLfRepoPolicy(261).keep_scored == 1  # their smallest working cache_budget
    with pytest.raises(UserError, match="lf_margin"):
        RKVLfRepoPolicy(512, lf_margin=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_score_bytes_bounds_the_scores_temporaries(dtype):
    """`score_bytes`, which sizes the compression's chunks, bounds the memory one `rkv_scores` call
    takes beyond its inputs (Figure 3's shapes: Qwen3-8B heads, window 8, 1744 slots) and, on the
    16-bit path the chunks are sized for, is within 2x of it (so the chunks are not needlessly small)."""
    from baselines.rkv import reads_keys_as_stored, rkv_scores, score_bytes

    batch, q_heads, kv_heads, window, slots, dim = 16, 32, 8, 8, 1744, 128
    device = torch.device("cuda")
    queries = torch.randn(batch, q_heads, window, dim, device=device, dtype=dtype)
    keys = torch.randn(batch, kv_heads, slots, dim, device=device, dtype=dtype)
    held = torch.ones(batch, kv_heads, slots, dtype=torch.bool, device=device)
    query_valid = torch.ones(batch, window, dtype=torch.bool, device=device)
    call = dict(protect=64, kernel=7, lam=0.1, threshold=0.5)
    rkv_scores(queries, query_valid, keys, held, dim**-0.5, **call)  # compile and warm up the kernels
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    scores = rkv_scores(queries, query_valid, keys, held, dim**-0.5, **call)
    torch.cuda.synchronize()
    taken = torch.cuda.max_memory_allocated() - before - scores.numel() * scores.element_size()
    as_stored = reads_keys_as_stored(queries, keys)
    assert as_stored == (dtype == torch.bfloat16)
    counted = batch * score_bytes(kv_heads, slots, dim, q_heads // kv_heads, window, as_stored)
    assert taken <= counted, f"{taken / 2**20:.1f} MiB taken, {counted / 2**20:.1f} MiB counted"
    if as_stored:
        assert counted <= 2 * taken, f"{taken / 2**20:.1f} MiB taken, {counted / 2**20:.1f} MiB counted"
