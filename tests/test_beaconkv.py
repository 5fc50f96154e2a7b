"""BeaconKV: farthest point sampling on hand-placed points and against a brute-force transcription
of its definition, the beacon bank (prefill and merges) against that transcription, the score with
beacons rotated to the current position against RoPE written out by hand, and the schedule."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import capped, drive_layer
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from baselines.beaconkv import BeaconKVPolicy, farthest_point_sampling, rotate
from longflow.errors import UserError
from longflow.policy import CacheSpec, Observation

HEAD_DIM, THETA = 8, 100.0


def rope() -> LlamaRotaryEmbedding:
    return LlamaRotaryEmbedding(LlamaConfig(hidden_size=32, num_attention_heads=4, head_dim=HEAD_DIM,
                                            max_position_embeddings=4096, rope_theta=THETA))


def rope_by_hand(x: torch.Tensor, position: int) -> torch.Tensor:
    """RoPE of one vector `[D]` at `position`: each pair (i, i + D/2) turned by position / theta^(2i/D)."""
    half = x.shape[-1] // 2
    out = x.clone()
    for i in range(half):
        angle = position / THETA ** (2 * i / x.shape[-1])
        c, s = math.cos(angle), math.sin(angle)
        out[i] = x[i] * c - x[i + half] * s
        out[i + half] = x[i + half] * c + x[i] * s
    return out


def fps_by_definition(points: list[torch.Tensor], count: int) -> list[int]:
    """The paper's FPS with a full cosine-distance matrix: first the point of least mean similarity
    to the set, then repeatedly the one farthest from its nearest chosen point (lowest index on ties)."""
    n = len(points)
    cos = [[float(torch.nn.functional.cosine_similarity(points[i], points[j], dim=0)) for j in range(n)]
           for i in range(n)]
    mean = [sum(row) / n for row in cos]
    chosen = [min(range(n), key=lambda i: (mean[i], i))]
    while len(chosen) < min(count, n):
        rest = [i for i in range(n) if i not in chosen]
        chosen.append(max(rest, key=lambda i: (min(1 - cos[i][j] for j in chosen), -i)))
    return chosen


# ---- farthest point sampling -------------------------------------------------------------------


def test_fps_picks_the_expected_points():
    # (1, 0), nearly (1, 0), (0, 1), (-1, 0): (-1, 0) is least like the others, then its opposite
    # (1, 0), then (0, 1), which is farther from both than the near-duplicate of (1, 0).
    points = torch.tensor([[1.0, 0.0], [0.99, 0.14], [0.0, 1.0], [-1.0, 0.0]])[None, None]  # [1, 1, 4, 2]
    indices, picked = farthest_point_sampling(points, torch.ones(1, 4, dtype=torch.bool), 3)
    assert indices.tolist() == [[[3, 0, 2]]] and picked.all()
    # Cosine distance: scaling a point changes nothing.
    indices, _ = farthest_point_sampling(points * torch.tensor([5.0, 1, 0.1, 2])[:, None], torch.ones(1, 4).bool(), 3)
    assert indices.tolist() == [[[3, 0, 2]]]
    # Without (-1, 0), (0, 1) is the outlier, then (1, 0), the farther of the other two from it.
    valid = torch.tensor([[True, True, True, False]])
    indices, picked = farthest_point_sampling(points, valid, 3)
    assert indices[0, 0, :2].tolist() == [2, 0] and picked.tolist() == [[True, True, True]]
    # Two valid points are equally unlike each other on average: the lower index first; no third.
    indices, picked = farthest_point_sampling(points, torch.tensor([[False, True, True, False]]), 3)
    assert indices[0, 0, :2].tolist() == [1, 2] and picked.tolist() == [[True, True, False]]


def test_fps_matches_its_definition_per_row_and_head():
    torch.manual_seed(0)
    points = torch.randn(2, 3, 12, 5)
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[1, :4] = False  # a left-padded row
    indices, _ = farthest_point_sampling(points, valid, 6)
    for row in range(2):
        real = [p for p in range(12) if valid[row, p]]
        for head in range(3):
            expected = fps_by_definition([points[row, head, p] for p in real], 6)
            assert indices[row, head].tolist() == [real[i] for i in expected]


def test_rotate_is_rope_at_the_given_position():
    torch.manual_seed(1)
    x = torch.randn(2, 3, 2, HEAD_DIM)  # before RoPE
    positions = torch.tensor([[0, 7], [300, 41]])
    rotated = rotate(x, positions, rope())
    for row in range(2):
        for head in range(3):
            for i in range(2):
                expected = rope_by_hand(x[row, head, i], int(positions[row, i]))
                torch.testing.assert_close(rotated[row, head, i], expected, rtol=1e-4, atol=1e-5)


# ---- the policy on one layer -------------------------------------------------------------------

Q_HEADS, KV_HEADS, PROMPT = 4, 2, 10
FIELDS = dict(n_recent=2, n_beacons=3, buffer_size=5, keep_last=4, kernel=1, keep_prompt=False)


def drive(policy: BeaconKVPolicy, steps: int, seed: int = 0):
    """One layer, two left-padded rows (10 and 7 prompt tokens), random queries made before RoPE and
    rotated by hand at their positions. Returns (queries before RoPE by (row, position) -> `[Hq, D]`,
    the pad mask, the held positions per step)."""
    torch.manual_seed(seed)
    pad = torch.ones(2, PROMPT, dtype=torch.bool)
    pad[1, :3] = False
    positions = (pad.long().cumsum(dim=-1) - 1).clamp(min=0)
    before = {}

    def rotated(row, position):
        q = torch.randn(Q_HEADS, HEAD_DIM)
        before[(row, position)] = q
        return torch.stack([rope_by_hand(q[h], position) for h in range(Q_HEADS)])

    q = torch.stack([torch.stack([rotated(b, int(positions[b, i])) for i in range(PROMPT)], dim=1)
                     for b in range(2)])  # [B, Hq, L, D]
    k, v = torch.randn(2, KV_HEADS, PROMPT, HEAD_DIM), torch.randn(2, KV_HEADS, PROMPT, HEAD_DIM)
    lengths = pad.sum(dim=-1)
    decode = []
    for step in range(steps):
        qs = torch.stack([rotated(b, int(lengths[b]) + step) for b in range(2)])[:, :, None]
        decode.append((qs, torch.randn(2, KV_HEADS, 1, HEAD_DIM), torch.randn(2, KV_HEADS, 1, HEAD_DIM)))
    held, _ = drive_layer(policy, q, k, v, pad, decode, HEAD_DIM ** -0.5, rotary=rope())
    return before, pad, held


def test_the_bank_is_fps_of_the_prompt_then_merged_with_the_new_queries():
    policy = BeaconKVPolicy(64, **FIELDS)
    before, pad, _ = drive(policy, steps=0)
    lengths = pad.sum(dim=-1).tolist()
    bank = {}
    for row, length in enumerate(lengths):
        for head in range(Q_HEADS):
            points = [before[(row, p)][head] for p in range(length)]
            expected = torch.stack([points[i] for i in fps_by_definition(points, 3)])
            torch.testing.assert_close(policy.beacons[0][row, head], expected, rtol=1e-4, atol=1e-5)
            bank[(row, head)] = list(expected)
    # buffer_size 5 = 3 beacons + 2 appended: after two decode steps the bank is cut back to 3.
    policy = BeaconKVPolicy(64, **FIELDS)
    before, _, _ = drive(policy, steps=2)
    for row, length in enumerate(lengths):
        for head in range(Q_HEADS):
            points = bank[(row, head)] + [before[(row, length)][head], before[(row, length + 1)][head]]
            expected = torch.stack([points[i] for i in fps_by_definition(points, 3)])
            torch.testing.assert_close(policy.beacons[0][row, head], expected, rtol=1e-4, atol=1e-5)
    assert policy.appended == [0, 0]


@pytest.mark.parametrize("softmax_over", ["candidates", "held"])
def test_the_score_rotates_the_beacons_to_the_current_position(softmax_over):
    policy = BeaconKVPolicy(64, **FIELDS, softmax_over=softmax_over)
    before, pad, _ = drive(policy, steps=3)
    rows = torch.arange(2)
    score = policy.score(Observation(policy, 0, rows=rows, newest=policy.written(rows)))  # as at a compression
    slots = policy.layers[0]
    group = Q_HEADS // KV_HEADS
    for row in range(2):
        newest = int(slots.positions[row].max())
        # The 2 newest queries at their own positions, the 3 beacons at the newest one: (position, query).
        observation = [(p, torch.stack([rope_by_hand(before[(row, p)][h], p) for h in range(Q_HEADS)]))
                       for p in (newest - 1, newest)]
        observation += [(newest, torch.stack([rope_by_hand(policy.beacons[0][row, h, i], newest)
                                              for h in range(Q_HEADS)])) for i in range(3)]
        for kv in range(KV_HEADS):
            held = [j for j in range(slots.slots) if slots.valid[row, kv, j]]
            candidates = [j for j in held if slots.positions[row, kv, j] <= newest - 4]
            for j in range(slots.slots):
                if j not in candidates:
                    assert score[row, kv, j] == float("-inf")
                    continue
                best = -1.0
                for position, query in observation:
                    # candidates: RPC's softmax over the candidate keys; held: over every held key up
                    # to the query's own position (all of them for the beacons, at the newest)
                    domain = candidates if softmax_over == "candidates" else \
                        [i for i in held if slots.positions[row, kv, i] <= position]
                    for h in range(kv * group, (kv + 1) * group):
                        logits = {i: float(query[h] @ slots.keys[row, kv, i]) / math.sqrt(HEAD_DIM) for i in domain}
                        top = max(logits.values())
                        total = sum(math.exp(x - top) for x in logits.values())
                        best = max(best, math.exp(logits[j] - top) / total)
                assert math.isclose(float(score[row, kv, j]), best, rel_tol=1e-4, abs_tol=1e-6)


def test_by_score_cuts_each_layers_prompt_with_that_layers_own_bank():
    """Two layers, each with its own prompt queries: a prompt longer than the budget cut by the
    score, whose observation set is the 2 newest prompt queries and that layer's FPS beacons rotated
    to the last prompt position, the 4 newest tokens protected, the best 4 of the rest kept."""
    torch.manual_seed(2)
    layers, length, lengths, budget = 2, 16, [16, 13], 9
    pad = torch.arange(length) >= (length - torch.tensor(lengths))[:, None]
    positions = (pad.long().cumsum(dim=-1) - 1).clamp(min=0)
    before = torch.randn(layers, 2, Q_HEADS, length, HEAD_DIM)  # queries before RoPE
    q = torch.stack([torch.stack([torch.stack([
        torch.stack([rope_by_hand(before[layer, b, h, i], int(positions[b, i])) for i in range(length)])
        for h in range(Q_HEADS)]) for b in range(2)]) for layer in range(layers)])
    k, v = torch.randn(2, layers, 2, KV_HEADS, length, HEAD_DIM)
    policy = BeaconKVPolicy(budget, **FIELDS, prefill="by_score")
    policy.allocate(CacheSpec(batch=2, layers=layers, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                              prompt_len=length, max_new_tokens=4, dtype=torch.float32,
                              device=torch.device("cpu"), rotary=rope(), scale=HEAD_DIM ** -0.5))
    policy.begin_prefill(pad, positions)
    for layer in range(layers):
        policy.attend(layer, q[layer], *policy.store(layer, k[layer], v[layer]), HEAD_DIM ** -0.5)
    group = Q_HEADS // KV_HEADS
    for layer in range(layers):
        slots = policy.layers[layer]
        for row, n in enumerate(lengths):
            first = length - n
            newest = n - 1
            for kv in range(KV_HEADS):
                heads = range(kv * group, (kv + 1) * group)
                observation = {h: [q[layer, row, h, first + p] for p in (newest - 1, newest)] for h in heads}
                for h in heads:
                    points = [before[layer, row, h, first + p] for p in range(n)]
                    observation[h] += [rope_by_hand(points[i], newest) for i in fps_by_definition(points, 3)]
                candidates = list(range(n - 4))
                score = {}
                for j in candidates:
                    best = 0.0
                    for h in heads:
                        for query in observation[h]:
                            logits = torch.tensor([float(query @ k[layer, row, kv, first + i]) for i in candidates],
                                                  dtype=torch.float64) / math.sqrt(HEAD_DIM)
                            best = max(best, float(torch.softmax(logits, dim=0)[j]))
                    score[j] = best
                expected = sorted(sorted(candidates, key=lambda j: -score[j])[:budget - 1 - 4]) + list(range(n - 4, n))
                held = slots.positions[row, kv][slots.valid[row, kv]].tolist()
                assert sorted(held) == expected, (layer, row, kv)


@pytest.mark.parametrize("beacons", [3, 0])  # 0: no bank, the recent queries alone (the paper's RPC point)
def test_a_full_row_is_cut_to_seven_eighths_keeping_the_newest(beacons):
    policy = capped(BeaconKVPolicy)(budget=16, **{**FIELDS, "n_beacons": beacons})
    assert policy.keep_after == 14
    _, pad, held = drive(policy, steps=30)
    lengths = pad.sum(dim=-1).tolist()
    for step, rows in enumerate(held):
        for row, heads in enumerate(rows):
            newest = lengths[row] + step
            for kept in heads:
                assert len(kept) <= 16
                assert set(range(newest - 3, newest + 1)) <= kept  # keep_last 4


def test_keep_prompt_keeps_the_prompt_while_it_fits():
    policy = BeaconKVPolicy(24, **{**FIELDS, "keep_prompt": True})  # keep_after 21 > 10 + 4
    _, pad, held = drive(policy, steps=40)
    for row, length in enumerate(pad.sum(dim=-1).tolist()):
        assert all(set(range(length)) <= kept for kept in held[-1][row])


def test_bad_fields_are_user_errors():
    with pytest.raises(UserError, match="aggregate"):
        BeaconKVPolicy(64, aggregate="sum")
    with pytest.raises(UserError, match="softmax_over"):
        BeaconKVPolicy(64, softmax_over="all")
    with pytest.raises(UserError, match="buffer_size"):
        BeaconKVPolicy(64, buffer_size=16)
    with pytest.raises(UserError, match="too small"):
        BeaconKVPolicy(32)  # keeps 28 <= keep_last 32
