"""`evals.report.stats`: paired bootstrap intervals against a plain numpy bootstrap written here and
against hand cases whose interval is known; the per-item accuracy read from a run directory."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.reports import write_generations, write_run

from evals.report.stats import (
    BootstrapConfig,
    ItemScores,
    mean_difference,
    paired_difference,
    run_accuracy_scores,
)
from longflow.errors import UserError


def scores(values, prefix="q") -> ItemScores:
    return ItemScores.means({f"{prefix}{i}": float(v) for i, v in enumerate(values)})


def reference_interval(a: np.ndarray, b: np.ndarray, resamples: int, seed: int) -> tuple[float, float]:
    """A plain paired percentile bootstrap of mean(a) - mean(b): resample items, one loop per draw."""
    rng = np.random.RandomState(seed)
    draws = []
    for _ in range(resamples):
        pick = rng.randint(0, len(a), len(a))
        draws.append(a[pick].mean() - b[pick].mean())
    return tuple(np.percentile(draws, [2.5, 97.5]))


def test_identical_runs_give_a_zero_interval():
    run = scores(np.random.default_rng(1).integers(0, 2, 200))
    difference = paired_difference(run, run, BootstrapConfig(resamples=500))
    assert (difference.estimate, difference.low, difference.high) == (0.0, 0.0, 0.0)
    assert not difference.excludes_zero and difference.items == 200


def test_a_run_that_always_wins_by_the_same_margin():
    """b is a with every item's score lowered by 0.25: each resample's difference is exactly 0.25."""
    a = np.random.default_rng(2).uniform(0.5, 1.0, 50)
    difference = paired_difference(scores(a), scores(a - 0.25), BootstrapConfig(resamples=300))
    assert difference.estimate == pytest.approx(0.25)
    assert difference.low == pytest.approx(0.25) and difference.high == pytest.approx(0.25)
    assert difference.excludes_zero


def test_matches_a_plain_numpy_bootstrap():
    rng = np.random.default_rng(3)
    a = rng.integers(0, 2, 200).astype(float)
    b = np.where(rng.uniform(size=200) < 0.2, 1.0 - a, a)  # b disagrees with a on a fifth of the items
    found = paired_difference(scores(a), scores(b), BootstrapConfig(resamples=10_000, seed=7))
    low, high = reference_interval(a, b, 10_000, seed=11)
    assert found.estimate == pytest.approx(a.mean() - b.mean())
    # Two bootstraps of 10000 draws on other seeds: the percentiles agree to Monte Carlo error.
    assert found.low == pytest.approx(low, abs=0.008) and found.high == pytest.approx(high, abs=0.008)
    # The pairing is what narrows it: two independent binomial errors would give a far wider one.
    unpaired = 2 * 1.96 * np.sqrt(a.var() / 200 + b.var() / 200)
    assert found.high - found.low < 0.7 * unpaired


def test_items_pair_by_id_not_by_position():
    a = ItemScores.means({"x": 1.0, "y": 0.0, "z": 1.0})
    b = ItemScores.means({"z": 1.0, "x": 1.0, "y": 0.0, "w": 1.0})  # another order, and an item a lacks
    difference = paired_difference(a, b, BootstrapConfig(resamples=200))
    assert (difference.estimate, difference.low, difference.high, difference.items) == (0.0, 0.0, 0.0, 3)
    with pytest.raises(UserError, match="share no item ids"):
        paired_difference(a, ItemScores.means({"v": 1.0}))


def test_ratio_scores_weigh_items_by_their_reads():
    """A recall pooled over reads: item 0 holds 3 of 4 reads, item 1 1 of 1; score 4/5, not (0.75 + 1)/2."""
    a = ItemScores(("i0", "i1"), np.array([3.0, 1.0]), np.array([4.0, 1.0]))
    b = ItemScores(("i0", "i1"), np.array([4.0, 1.0]), np.array([4.0, 1.0]))
    assert a.score == pytest.approx(0.8)
    difference = paired_difference(a, b, BootstrapConfig(resamples=2000))
    assert difference.estimate == pytest.approx(-0.2)
    # A resample draws item 0 k times of 2: the difference is -k / (4k + (2 - k)), so -0.25 at worst, 0 at best.
    assert difference.low == pytest.approx(-0.25) and difference.high == pytest.approx(0.0)


def test_mean_over_datasets_resamples_each_apart():
    rng = np.random.default_rng(4)
    first, second = rng.integers(0, 2, (2, 120)).astype(float), rng.integers(0, 2, (2, 80)).astype(float)
    pairs = [(scores(first[0], "f"), scores(first[1], "f")), (scores(second[0], "s"), scores(second[1], "s"))]
    found = mean_difference(pairs, BootstrapConfig(resamples=10_000))
    assert found.estimate == pytest.approx(((first[0] - first[1]).mean() + (second[0] - second[1]).mean()) / 2)
    reference = np.random.RandomState(5)
    draws = [np.mean([(d[0][p] - d[1][p]).mean() for d, p in
                      ((first, reference.randint(0, 120, 120)), (second, reference.randint(0, 80, 80)))])
             for _ in range(10_000)]
    low, high = np.percentile(draws, [2.5, 97.5])
    assert found.low == pytest.approx(low, abs=0.01) and found.high == pytest.approx(high, abs=0.01)


def test_config_checks():
    with pytest.raises(UserError, match="at least 1"):
        BootstrapConfig(resamples=0)
    with pytest.raises(UserError, match="strictly between"):
        BootstrapConfig(confidence=1.0)


def test_a_draw_is_repeatable_and_seeded():
    rng = np.random.default_rng(6)
    a, b = scores(rng.integers(0, 2, 100)), scores(rng.integers(0, 2, 100))
    one, again = (paired_difference(a, b, BootstrapConfig(resamples=1000, seed=3)) for _ in range(2))
    other = paired_difference(a, b, BootstrapConfig(resamples=1000, seed=4))
    assert one == again and (one.low, one.high) != (other.low, other.high)


def test_run_accuracy_scores_reads_each_items_samples(tmp_path):
    run = write_run(tmp_path, "m", "h2o", 64, "demo", 0.5)
    assert run_accuracy_scores(run) is None  # metrics only, no records
    write_generations(run, {"a": [True, False], "b": [True, True], "c": [False, False]})
    (run / "items.json").write_text('["a", "b"]')  # c is another config's item
    found = run_accuracy_scores(run)
    assert found.ids == ("a", "b") and found.numerator.tolist() == [0.5, 1.0] and found.score == 0.75
