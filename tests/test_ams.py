"""AMS: each step of docs/methods.md transcribed with plain loops, as the official press runs it at batch
size 1 (window evidence, credit, segments, quotas, candidates, must-keep), against `AMSPolicy`'s
vectorised compression; the config of every scorer. Large budget = the full cache's tokens and the hard
cap, for every ams_* config: test_methods.py."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import pytest
import torch
import yaml
from helpers import REPO, method_defaults, method_names, policy_of

from baselines.ams import AMSPolicy, quotas, round_robin, segments
from baselines.tova import TOVAPolicy
from longflow.errors import UserError
from longflow.methods import locate
from longflow.policy import CacheSpec, KVPolicy

# ---- the official algorithm, line by line, for one row and KV head ---------------------------------


def segments_by_hand(mass: list[float], step: float, min_len: int, max_len: int) -> list[tuple[int, int]]:
    length = len(mass)
    cum = list(torch.tensor(mass).cumsum(0).tolist())
    targets = torch.arange(step, 1.0, step, dtype=torch.float32).tolist()
    cut_positions = sorted({bisect.bisect_left(cum, t) for t in targets})  # first index with cum >= t
    cuts = [min(max(c, 1), length - 1) for c in cut_positions]
    bounds = [0, *cuts, length]
    pieces = [(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
    split = []
    for s, e in pieces:
        while e - s > max_len:
            split.append((s, s + max_len))
            s += max_len
        split.append((s, e))
    merged, i = [], 0
    while i < len(split):
        s, e = split[i]
        while e - s < min_len and i + 1 < len(split):
            e = split[i + 1][1]
            i += 1
        merged.append((s, e))
        i += 1
    return merged


def quotas_by_hand(keep: int, lengths: list[int], masses: list[float], min_keep: int) -> list[int]:
    n = len(lengths)
    budgets = [min(length, min_keep) for length in lengths]
    if sum(budgets) >= keep:
        current = sum(budgets)
        while current > keep and any(b > 1 for b in budgets):
            for i in range(n):
                if budgets[i] > 1:
                    budgets[i] -= 1
                    current -= 1
                    if current == keep:
                        break
        return budgets
    remain = keep - sum(budgets)
    total = sum(masses) + 1e-12
    for i in range(n):
        budgets[i] = min(lengths[i], budgets[i] + int(round(remain * (masses[i] / total))))
    current = sum(budgets)
    while current > keep:
        changed = False
        for i in range(n):
            if budgets[i] > min(min_keep, lengths[i]):
                budgets[i] -= 1
                current -= 1
                changed = True
                if current == keep:
                    break
        if not changed:
            break
    while current < keep:
        changed = False
        for i in range(n):
            if budgets[i] < lengths[i]:
                budgets[i] += 1
                current += 1
                changed = True
                if current == keep:
                    break
        if not changed:
            break
    return budgets


def normalize(values: list[float]) -> list[float]:
    values = [max(v, 0.0) + 1e-12 for v in values]
    total = sum(values)
    return [v / total for v in values]


def evidence_by_hand(queries, query_positions, keys, key_positions, kernel):
    """One row: queries [Hq, W, D], keys [Hkv, T, D] -> [Hkv][T] (the window slots: the row's max)."""
    q_heads, window, dim = queries.shape
    kv_heads, slots = keys.shape[:2]
    group = q_heads // kv_heads
    per_head = []
    for h in range(q_heads):
        kv = h // group
        sums = [0.0] * (slots - window)
        for i in range(window):
            seen = [j for j in range(slots) if key_positions[j] <= query_positions[i]]
            logits = torch.tensor([float(queries[h, i] @ keys[kv, j]) / math.sqrt(dim) for j in seen])
            probs = dict(zip(seen, torch.softmax(logits, dim=0).tolist(), strict=True))
            for j in range(slots - window):
                sums[j] += probs.get(j, 0.0) / window
        half = kernel // 2
        per_head.append([sum(sums[j + o] for o in range(-half, half + 1) if 0 <= j + o < len(sums)) / kernel
                         for j in range(len(sums))])
    evidence = [[sum(per_head[kv * group + g][j] for g in range(group)) / group for j in range(slots - window)]
                for kv in range(kv_heads)]
    best = max(max(row) for row in evidence)
    return [row + [best] * window for row in evidence]


def keep_by_hand(score: list[float], mass: list[float], keep: int, params: dict) -> set[int]:
    """The kept slots of one row and KV head, from its selection scores and its (mixed) mass."""
    slots = len(score)
    pieces = segments_by_hand(normalize(mass), params["segment_mass"], params["min_seg_len"], params["max_seg_len"])
    line = normalize(mass)
    budgets = quotas_by_hand(keep, [e - s for s, e in pieces], [sum(line[s:e]) for s, e in pieces],
                             params["min_keep_per_segment"])
    candidates = set()
    for (s, e), quota in zip(pieces, budgets, strict=True):
        ranked = sorted(range(s, e), key=lambda j: (-score[j], j))
        candidates |= set(ranked[:quota])
    last = min(params["always_keep_last"], keep)
    sinks = min(params["n_sink"], keep - last)
    must = set(range(sinks)) | set(range(slots - last, slots))
    need = keep - len(must)
    pool = candidates - must
    if len(pool) < need:
        pool = set(range(slots)) - must
    return must | set(sorted(pool, key=lambda j: (-score[j], j))[:need])


# ---- the pieces ---------------------------------------------------------------------------------


def test_round_robin_is_the_loop():
    generator = torch.Generator().manual_seed(0)
    capacity = torch.randint(0, 6, (300, 7), generator=generator)
    count = torch.randint(0, 30, (300,), generator=generator)
    got = round_robin(capacity, count, 5)
    for line in range(300):
        given, left = [0] * 7, int(count[line])
        while left and any(given[i] < capacity[line, i] for i in range(7)):
            for i in range(7):
                if left and given[i] < capacity[line, i]:
                    given[i] += 1
                    left -= 1
        assert got[line].tolist() == given


@pytest.mark.parametrize("step,min_len,max_len", [(0.02, 32, 1024), (0.05, 4, 10), (0.1, 1, 6), (0.3, 9, 9)])
def test_segments_and_quotas_are_the_loops(step, min_len, max_len):
    generator = torch.Generator().manual_seed(1)
    lines, slots = 40, 120
    raw = torch.rand(lines, slots, generator=generator) ** 6  # peaked masses: segments of every length
    mass = raw / raw.sum(dim=-1, keepdim=True)
    segment = segments(mass, step, min_len, max_len)
    for keep in (17, 60, 110):
        quota = quotas(segment, mass, keep, 8)
        for line in range(lines):
            pieces = segments_by_hand(mass[line].tolist(), step, min_len, max_len)
            got = segment[line].tolist()
            assert [(got.index(i), len(got) - got[::-1].index(i)) for i in range(got[-1] + 1)] == pieces
            masses = [float(mass[line, s:e].sum()) for s, e in pieces]
            expected = quotas_by_hand(keep, [e - s for s, e in pieces], masses, 8)
            assert quota[line, :len(pieces)].tolist() == expected and quota[line, len(pieces):].eq(0).all()


# ---- a compression --------------------------------------------------------------------------------


@dataclass(eq=False)
class FixedScore(KVPolicy):
    """A scorer whose scores are set by the test, `[n, Hkv, S]` for the rows being compressed."""

    name = "fixed"

    def score(self, obs):
        return self.scores if obs.rows is None else self.scores.index_select(0, obs.rows)


def full_cache(policy: AMSPolicy, batch=2, kv_heads=2, q_heads=4, slots=64, head_dim=8, seed=0):
    """One layer, every slot held, positions in slot order (with gaps, as after earlier compressions)."""
    generator = torch.Generator().manual_seed(seed)
    policy.allocate(CacheSpec(batch=batch, layers=1, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                              prompt_len=16, max_new_tokens=8, dtype=torch.float32, device=torch.device("cpu")))
    layer = policy.layers[0]
    layer.keys.copy_(torch.randn(layer.keys.shape, generator=generator))
    layer.values.copy_(torch.randn(layer.values.shape, generator=generator))
    layer.valid.fill_(True)
    gaps = torch.randint(1, 3, (batch, slots - 40), generator=generator)  # older slots: gaps of evicted tokens
    older = gaps.cumsum(dim=-1) - 1
    positions = torch.cat([older, older[:, -1:] + 1 + torch.arange(40)], dim=-1)  # the 40 newest contiguous
    layer.positions.copy_(positions[:, None, :].expand(-1, kv_heads, -1))
    policy.positions = positions[:, -1] + 1  # between steps (after_step) the engine's positions are the next token's
    policy.prefilling = False
    ring = policy.history.rings[0]
    ring.copy_(torch.randn(ring.shape, generator=generator) * 2)  # slot p mod W holds position p's query
    policy.scorer.scores = torch.randn(batch, kv_heads, slots, generator=generator)
    layer.state["credit"].copy_(torch.rand(batch, kv_heads, slots, generator=generator) * 0.05)
    return layer, positions


@pytest.mark.parametrize("params", [
    dict(),  # the paper's defaults, scaled down below
    dict(segment_mass=0.1, min_seg_len=3, max_seg_len=12, min_keep_per_segment=2, always_keep_last=5, n_sink=2),
    dict(segment_mass=0.05, min_seg_len=1, max_seg_len=64, min_keep_per_segment=8, window_size=6),  # base >= t
    dict(always_keep_last=30, window_size=16, min_seg_len=4, segment_mass=0.1),  # mostly must-keep
    dict(window_size=32),  # the interval of 24 bounds the window: 23 queries
])
@pytest.mark.parametrize("segment_over", ["row", "batch"])
def test_a_compression_is_the_transcription(params, segment_over):
    config = dict(compress_every=24, window_size=8, window_kernel=5, segment_mass=0.02, min_seg_len=8,
                  max_seg_len=40, min_keep_per_segment=3, n_sink=4, always_keep_last=10, use_credit=True,
                  credit_decay=0.8, mix_beta=0.7)
    config.update(params)
    policy = AMSPolicy(64, scorer=FixedScore(), segment_over=segment_over, **config)
    layer, positions = full_cache(policy)
    before = {name: tensor.clone() for name, tensor in (("keys", layer.keys), ("credit", layer.state["credit"]))}
    keep, slots, kv_heads = policy.keep_after, 64, 2
    # The official press: W = min(window_size, max(q_len - 1, 1), k_len - 1, t_keep), q_len the hidden
    # states its trigger buffered, one interval's (at most 256).
    window = min(config["window_size"], max(min(config["compress_every"], 256) - 1, 1), slots - 1, keep)
    ring = policy.history.rings[0]
    masses, credits = [], []
    for row in range(2):
        newest = int(positions[row, -1])
        query_positions = list(range(newest - window + 1, newest + 1))
        queries = torch.stack([ring[row, :, p % ring.shape[2]] for p in query_positions], dim=1)
        evidence = evidence_by_hand(queries, query_positions, before["keys"][row], positions[row].tolist(),
                                    config["window_kernel"])
        row_masses, row_credits = [], []
        for h in range(kv_heads):
            current = normalize(evidence[h])
            credit = [0.8 * c + 0.2 * m for c, m in zip(before["credit"][row, h].tolist(), current, strict=True)]
            mixed = normalize([0.7 * m + 0.3 * c for m, c in zip(current, normalize(credit), strict=True)])
            row_masses.append(mixed)
            row_credits.append(credit)
        masses.append(row_masses)
        credits.append(row_credits)
    policy.compress([0, 1])
    for row in range(2):
        for h in range(kv_heads):
            mass = masses[row][h]
            if segment_over == "batch":  # the official: one segmentation from the mean over the rows
                mass = [(a + b) / 2 for a, b in zip(masses[0][h], masses[1][h], strict=True)]
            kept = keep_by_hand(policy.scorer.scores[row, h].tolist(), mass, keep, config)
            held = layer.positions[row, h][layer.valid[row, h]].tolist()
            assert held == sorted(int(positions[row, j]) for j in kept), f"row {row}, head {h}"
            expected_credit = [credits[row][h][j] for j in sorted(kept)]
            torch.testing.assert_close(layer.state["credit"][row, h, :keep], torch.tensor(expected_credit),
                                       rtol=1e-4, atol=1e-7)
            assert layer.state["credit"][row, h, keep:].eq(0).all()


def test_the_scorer_must_be_a_stateless_method():
    with pytest.raises(UserError, match="scorer must be"):
        AMSPolicy(64)
    with pytest.raises(UserError, match="keeps state"):
        AMSPolicy(64, scorer=policy_of("h2o", None))
    with pytest.raises(UserError, match="keeps state"):
        AMSPolicy(64, scorer=policy_of("rkv", None, variant="lf_repo"))
    with pytest.raises(UserError, match="needs 1 <= min_seg_len <= max_seg_len"):
        AMSPolicy(64, scorer=TOVAPolicy(), min_seg_len=100, max_seg_len=50)


@pytest.mark.parametrize("name", [name for name in method_names() if name.startswith("ams_")])
def test_configs(name):
    path = REPO / "conf" / "method" / f"{name}.yaml"
    if name == "ams_tova":
        fields = yaml.safe_load(path.read_text())
        assert fields.pop("name") == name and locate(fields.pop("_target_")) is AMSPolicy
        scorer = fields.pop("scorer")
        assert locate(scorer["_target_"]) is TOVAPolicy
        assert fields == {key: value for key, value in method_defaults(AMSPolicy).items() if key != "scorer"}
    policy = policy_of(name, 1024)
    assert isinstance(policy, AMSPolicy) and policy.keep_after == 512 and policy.segment_over == "row"
    assert type(policy.scorer) is type(policy_of(name.removeprefix("ams_"), None))
