"""The selection rule (`longflow.selection`) against a plain transcription, and the slot cache's writes,
compaction, per-slot state, per-row reset and per-head capacities (`longflow.slots`)."""

from __future__ import annotations

import pytest
import torch

from longflow.selection import choose_keep, choose_next, first_free
from longflow.slots import SlotCache, SlotState


def next_slot_by_hand(score, valid, protect):
    """One row: the lowest free slot, else the lowest-scoring unprotected valid slot (lowest index on ties)."""
    free = [j for j in range(len(valid)) if not valid[j]]
    if free:
        return free[0]
    candidates = [j for j in range(len(valid)) if not protect[j]]
    return min(candidates, key=lambda j: (score[j], j))


def kept_by_hand(score, valid, protect, count):
    """One row: every protected valid slot, then the best scored valid ones, `count` in all (or all
    valid); among equal keys the higher index."""
    protected = [j for j in reversed(range(len(valid))) if valid[j] and protect[j]]
    rest = sorted((j for j in range(len(valid)) if valid[j] and not protect[j]), key=lambda j: (-score[j], -j))
    return set((protected + rest)[:count])


@pytest.mark.parametrize("dtype", [torch.float32, torch.long])
def test_choose_next_is_the_rule(dtype):
    generator = torch.Generator().manual_seed(0)
    rows, slots = 200, 12
    score = torch.randint(0, 6, (rows, slots), generator=generator).to(dtype)  # many ties
    valid = torch.rand(rows, slots, generator=generator) < 0.9
    valid[:100] = True  # half the rows full
    protect = torch.rand(rows, slots, generator=generator) < 0.3
    protect[:, 0] = False  # at least one slot evictable
    got = choose_next(score, valid, protect).tolist()
    for row in range(rows):
        assert got[row] == next_slot_by_hand(score[row].tolist(), valid[row].tolist(), protect[row].tolist())
    assert choose_next(score, valid).tolist() == [next_slot_by_hand(s, v, [False] * slots)
                                                  for s, v in zip(score.tolist(), valid.tolist(), strict=True)]


def test_choose_keep_is_the_rule():
    generator = torch.Generator().manual_seed(1)
    rows, slots, count = 100, 16, 9
    score = torch.randn(rows, slots, generator=generator)
    valid = torch.rand(rows, slots, generator=generator) < 0.8
    protect = torch.rand(rows, slots, generator=generator) < 0.2
    kept = choose_keep(score, valid, count, protect)
    for row in range(rows):
        expected = kept_by_hand(score[row].tolist(), valid[row].tolist(), protect[row].tolist(), count)
        got = set(kept[row].tolist())
        assert expected <= got  # and the rest, if any, are free slots (fewer valid than count)
        assert all(not valid[row, j] for j in got - expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.long])
def test_choose_keep_breaks_ties_by_index(dtype):
    generator = torch.Generator().manual_seed(2)
    rows, slots, count = 200, 16, 7
    score = torch.randint(0, 4, (rows, slots), generator=generator).to(dtype)  # many ties
    valid = torch.ones(rows, slots, dtype=torch.bool)
    protect = torch.rand(rows, slots, generator=generator) < 0.5  # often more protected slots than count
    kept = choose_keep(score, valid, count, protect)
    assert [set(k) for k in kept.tolist()] == [kept_by_hand(s, v, p, count) for s, v, p in
                                               zip(score.tolist(), valid.tolist(), protect.tolist(), strict=True)]


def test_a_prompt_cut_does_not_depend_on_its_padding():
    """A left-padded prompt whose tokens all rank +inf (SnapKV's observation window) and do not all fit:
    the same tokens are dropped, the oldest, however far the batch pads the prompt."""
    length, count = 31, 30
    for padding in (1, 33, 97):
        score = torch.cat([torch.full((padding,), float("-inf")), torch.full((length,), float("inf"))])
        valid = torch.arange(padding + length) >= padding
        kept = choose_keep(score[None], valid[None], count)[0] - padding
        assert sorted(kept.tolist()) == list(range(length - count, length))


def test_first_free_and_per_head_usable():
    valid = torch.tensor([[True, False, True, False], [True, True, True, False]])
    assert first_free(valid).tolist() == [1, 3]
    usable = torch.tensor([[True, True, True, False], [True, True, True, False]])
    assert first_free(valid, usable).tolist() == [1, 0]  # no usable free slot: 0
    score = torch.tensor([[5.0, 1.0, 0.0, 9.0], [3.0, 2.0, 4.0, 0.0]])
    full = torch.ones(2, 4, dtype=torch.bool)
    assert choose_next(score, full, usable=usable).tolist() == [2, 1]  # slot 3 is beyond the heads' capacity


def make_cache(states=None, heads=None, slots=6):
    return SlotCache(batch=2, kv_heads=2, head_dim=3, dtype=torch.float32, device=torch.device("cpu"),
                     capacities=[slots, slots + 2], head_capacities=heads, states=states)


def test_writes_set_every_buffer_and_the_state():
    states = {"score": SlotState(fill=-1.0), "norm": SlotState(on_write=lambda v: v.abs().sum(dim=-1))}
    cache = make_cache(states)
    assert [layer.slots for layer in cache.layers] == [6, 8]
    cache.layers[1].state["score"].fill_(5.0)
    cache.next_slot[1].copy_(torch.tensor([[2, 4], [0, 7]]))
    k, v = torch.randn(2, 2, 1, 3), torch.randn(2, 2, 1, 3)
    cache.write(1, k, v, torch.tensor([11, 12]))
    layer = cache.layers[1]
    for row, heads in enumerate([[2, 4], [0, 7]]):
        for head, slot in enumerate(heads):
            assert torch.equal(layer.keys[row, head, slot], k[row, head, 0])
            assert torch.equal(layer.values[row, head, slot], v[row, head, 0])
            assert layer.valid[row, head, slot] and layer.positions[row, head, slot] == 11 + row
            assert layer.state["score"][row, head, slot] == -1.0  # reset on write
            assert layer.state["norm"][row, head, slot] == pytest.approx(float(v[row, head, 0].abs().sum()))
    assert int(layer.valid.sum()) == 4 and (layer.state["score"] == 5.0).sum() == 2 * 2 * 8 - 4


def test_compact_moves_slots_with_their_state_and_frees_the_rest():
    cache = make_cache({"credit": SlotState(fill=0.0)})
    layer = cache.layers[0]
    layer.keys.copy_(torch.arange(2 * 2 * 6 * 3, dtype=torch.float32).view(2, 2, 6, 3))
    layer.values.copy_(-layer.keys)
    layer.valid.fill_(True)
    layer.positions.copy_(torch.tensor([5, 3, 9, 1, 7, 2]).expand(2, 2, 6))
    layer.state["credit"].copy_(layer.positions.float() / 10)
    before = {name: getattr(layer, name).clone() for name in ("keys", "values", "positions")}
    keep = torch.zeros(1, 2, 6, dtype=torch.bool)
    keep[0, 0, [0, 2, 3]] = True  # positions 5, 9, 1
    keep[0, 1, [1, 4]] = True  # positions 3, 7
    rank = torch.tensor([[[0, 0, 2, 1, 0, 0], [0, 5, 0, 0, 4, 0]]])
    cache.compact(0, torch.tensor([1]), keep)  # row 1 only, by position
    assert layer.positions[1, 0].tolist() == [1, 5, 9, -1, -1, -1]
    assert layer.positions[1, 1].tolist() == [3, 7, -1, -1, -1, -1]
    assert layer.valid[1].sum(dim=-1).tolist() == [3, 2]
    assert torch.equal(layer.keys[1, 0, :3], before["keys"][1, 0, [3, 0, 2]])
    assert torch.equal(layer.values[1, 1, :2], before["values"][1, 1, [1, 4]])
    assert layer.keys[1, 0, 3:].eq(0).all() and layer.state["credit"][1, 0].tolist() == pytest.approx(
        [0.1, 0.5, 0.9, 0, 0, 0])
    assert torch.equal(layer.positions[0], before["positions"][0])  # row 0 untouched
    assert cache.next_slot[0][1].tolist() == [3, 2]  # the first free slots
    cache.compact(0, None, keep.expand(2, -1, -1) & layer.valid, rank.expand(2, -1, -1))  # by a given order
    assert layer.positions[0, 0].tolist() == [5, 1, 9, -1, -1, -1]


def test_store_prompt_and_reset_rows():
    cache = make_cache({"norm": SlotState(on_write=lambda v: v.abs().sum(dim=-1))},
                       heads=[[6, 4], [8, 8]])
    length = 5
    k, v = torch.randn(2, 2, length, 3), torch.randn(2, 2, length, 3)
    pad = torch.tensor([[True] * 5, [False, False, True, True, True]])
    positions = (pad.long().cumsum(dim=-1) - 1).clamp(min=0)
    kept = torch.tensor([[[0, 2, 4], [1, 3, length]], [[1, 3, 4], [2, 4, length]]])  # `length`: none
    cache.store_prompt(0, k, v, kept, pad, positions)
    layer = cache.layers[0]
    assert layer.positions[0].tolist() == [[0, 2, 4, -1, -1, -1], [1, 3, -1, -1, -1, -1]]
    assert layer.positions[1].tolist() == [[-1, 1, 2, -1, -1, -1], [0, 2, -1, -1, -1, -1]]  # padding is free
    assert torch.equal(layer.keys[1, 0, 2], k[1, 0, 4])
    assert layer.state["norm"][0, 1, 1] == pytest.approx(float(v[0, 1, 3].abs().sum()))
    assert layer.usable[1].tolist() == [True] * 4 + [False] * 2
    assert cache.next_slot[0].tolist() == [[3, 2], [0, 2]]
    cache.peak_slots()
    cache.reset_rows(torch.tensor([0]))
    assert not cache.layers[0].valid[0].any() and cache.layers[0].positions[0].eq(-1).all()
    assert cache.layers[0].state["norm"][0].eq(0).all() and cache.next_slot[0][0].eq(0).all()
    assert cache.peak.tolist() == [0, 2] and cache.layers[0].valid[1].sum() == 4
