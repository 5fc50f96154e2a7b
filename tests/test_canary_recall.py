"""Dependency recall and eviction maps on the suite model: the full cache holds every read, the two
broken policies of the canary tests lose reads, as few items keep every read as their accuracy says,
and a held position is what the slot cache holds."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import policy_of
from helpers.canary import SMALL_BUDGET, EvictNewest, EvictRandom
from helpers.reports import is_figure

from evals.canary.eviction_map import draw, held_matrix
from evals.canary.families import heldout
from evals.canary.recall import RecallSummary, held_copies, method_budgets, teacher, teacher_forced_recall
from evals.configs import model_spec
from evals.grading import grade
from evals.pipeline import decode
from longflow.config import GenerationConfig
from longflow.engine import Engine
from longflow.models import eos_token_ids, load_model

# The canary tests' subset, as state items: the first 16 held-out items of at most 20 steps.
SUBSET = [item for item in heldout("state") if item.steps <= 20][:16]


@functools.cache
def suite():
    return load_model(model_spec("canary_suite"), torch.device("cpu"))


def engine_of(factory) -> Engine:
    model, tokenizer = suite()
    return Engine(model, factory, eos_token_ids(model, tokenizer), tokenizer.pad_token_id)


@functools.cache
def teachers():
    return [teacher(item, suite()[1]) for item in SUBSET]


@functools.cache
def summary(factory) -> RecallSummary:
    recalls, _ = teacher_forced_recall(engine_of(factory), teachers())
    return RecallSummary.of("state", "x", SMALL_BUDGET, recalls)


@functools.cache
def accuracy(factory) -> float:
    tokenizer = suite()[1]
    engine = engine_of(factory)
    result = engine.generate([t.prompt for t in teachers()], GenerationConfig(max_new_tokens=400), [0] * len(SUBSET))
    grades = [grade("math", decode(tokenizer, tokens, engine.eos_ids.tolist()), str(item.answer), finish_reason=reason)
              for item, tokens, reason in zip(SUBSET, result.tokens, result.finish_reasons, strict=True)]
    return sum(g.correct for g in grades) / len(grades)


def full_cache():
    return policy_of("vanilla", None)


def test_held_copies_reads_the_slot_cache():
    """A position is held where a valid slot of that layer and head holds it, and not where the slot is free."""
    policy = policy_of("streaming", 32)
    engine = engine_of(lambda: policy)
    item = teachers()[0]
    generation = GenerationConfig(max_new_tokens=4)
    engine.generate([item.prompt], generation, [0])
    slots = policy.layers[0]
    kept = int(slots.positions[0, 0][slots.valid[0, 0]][0])
    evicted = next(p for p in range(len(item.prompt)) if p not in slots.positions[0, 0].tolist())
    held = held_copies(policy, torch.tensor([0, 0]), torch.tensor([[kept, -1], [evicted, -1]]))
    assert held[0, 0].all() and not held[1, 0].any()
    with torch.inference_mode():
        slots.valid[0, 0] = False
    assert not held_copies(policy, torch.tensor([0]), torch.tensor([[kept, -1]]))[0, 0, 0]


@pytest.mark.slow
def test_the_full_cache_holds_every_read():
    result = summary(full_cache)
    assert result.recall_layer0 == result.recall_layers == result.complete_items == 1.0
    assert result.reads == sum(len(t.reads) for t in teachers())
    assert accuracy(full_cache) == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("broken", [EvictNewest, EvictRandom])
def test_a_broken_policy_loses_reads_as_its_accuracy_says(broken):
    """An item solved needs its reads (a lost value leaves a 1-in-23 guess), and an item whose reads were
    all held everywhere is one a broken policy can still solve: the share of such items and the
    accuracy agree within a few items, and both sit far below the full cache's; so does the recall."""
    factory = functools.partial(broken, SMALL_BUDGET)
    result, solved = summary(factory), accuracy(factory)
    assert result.recall_layer0 <= 0.95 and result.recall_layers <= 0.95, result
    assert solved <= result.complete_items + 0.15 and result.complete_items <= solved + 0.3, (result, solved)
    assert result.complete_items <= 0.35


def test_the_eviction_map_draws_what_was_held(tmp_path):
    item = teachers()[0]
    recalls, trace = teacher_forced_recall(engine_of(lambda: policy_of("streaming", 64)), [item], trace_row=0)
    length = len(item.prompt) + len(item.output)
    matrix = held_matrix(trace, 0, length)
    assert matrix.shape == (length, len(trace.steps)) and trace.steps[0] == 1
    # StreamingLLM at 64 slots: step t holds its sink tokens and the newest tokens only.
    last = len(trace.steps) - 1
    newest = len(item.prompt) + trace.steps[last] - 1
    assert matrix[newest, last] == 1.0 and matrix[newest - 200, last] == 0.0 and matrix.sum(axis=0).max() <= 64
    png, pdf = draw([("streaming", recalls[0], trace)], item, 0, "test", tmp_path / "map.png")
    assert is_figure(png) and is_figure(pdf) and pdf.name == "map.pdf"


def test_a_sweep_runs_the_full_cache_once_and_every_other_method_at_each_budget():
    """The budget question answered by the method's class (`uses_budget`), not by its name."""
    assert method_budgets("vanilla", [96, 192]) == [None]
    assert method_budgets("h2o", [96, 192]) == [96, 192]
    assert method_budgets("lkv", [96]) == [96]
