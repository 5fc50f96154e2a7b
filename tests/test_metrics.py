"""`evals.metrics`: the standard error of a run's accuracy, against the formulas worked by hand."""

from __future__ import annotations

import math

import pytest

from evals.metrics import accuracy_stderr, summarize


def rows(correct_by_sample: dict[int, list[bool]]) -> list[dict]:
    return [{"id": str(item), "sample": sample, "correct": correct}
            for sample, column in correct_by_sample.items() for item, correct in enumerate(column)]


def test_binomial_with_one_sample():
    # 3 of 4 right: sqrt(0.75 * 0.25 / 4)
    assert accuracy_stderr(rows({0: [True, True, True, False]}), 1) == pytest.approx(math.sqrt(0.1875 / 4))
    assert accuracy_stderr(rows({0: [True, True]}), 1) == 0.0
    assert accuracy_stderr([], 1) is None


def test_over_samples():
    # Per-sample accuracies 1.0, 0.5 and 0.75: standard deviation 0.25 (n - 1), over sqrt(3).
    generations = rows({0: [True, True, True, True], 1: [True, False, True, False], 2: [True, True, True, False]})
    assert accuracy_stderr(generations, 3) == pytest.approx(0.25 / math.sqrt(3))
    assert accuracy_stderr(rows({0: [True, False]}), 4) is None  # one sample done: no spread yet


def test_summarize_records_it():
    identity = {"run_id": "r", "model": "m", "hub_id": "h", "method": "h2o", "variant": "paper", "budget": 8,
                "generation": "greedy", "dataset": "d", "dataset_size": 4, "generation_params": {"n_samples": 1}}
    generations = [{**row, "output_tokens": 3, "finish_reason": "eos", "reason": "x", "peak_slots": 2}
                   for row in rows({0: [True, False, False, False]})]
    metrics = summarize(identity, generations, [])
    assert metrics["accuracy"] == 0.25 and metrics["accuracy_stderr"] == pytest.approx(math.sqrt(0.1875 / 4))


def test_complete_means_every_item_of_the_dataset_not_of_the_limit():
    """`complete` answers "does this run cover the whole dataset?": a run of `limit=2` that finished its two
    items is not complete (tables show it as finished over its own items, `n_items` of `dataset_size`)."""
    identity = {"run_id": "r", "model": "m", "hub_id": "h", "method": "h2o", "variant": "paper", "budget": 8,
                "generation": "greedy", "dataset": "d", "dataset_size": 4, "generation_params": {"n_samples": 1}}
    generations = [{**row, "output_tokens": 3, "finish_reason": "eos", "reason": "x", "peak_slots": 2}
                   for row in rows({0: [True, False, True, False]})]
    limited = summarize(identity, generations[:2], [])
    assert limited["n_items"] == 2 and limited["dataset_size"] == 4 and limited["complete"] is False
    assert summarize(identity, generations, [])["complete"] is True
