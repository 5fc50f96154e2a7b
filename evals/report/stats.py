"""Paired bootstrap confidence intervals of the difference between two runs over the same items.

Two methods run on the same items are compared item by item: resampling the items (with replacement,
the same draw for both runs) keeps each item's difficulty out of the difference, so the interval is
much narrower than two independent binomial errors would give. A run's score is a ratio of sums over
its items, `sum(numerator) / sum(denominator)`: accuracy is the mean over items of each item's mean
correctness over its samples (denominator 1 per item); a read-weighted recall is the sum of the
items' read shares over the sum of their reads. The interval is the percentile one (Efron and
Tibshirani, *An Introduction to the Bootstrap*, 1993, ch. 13): the `(1 - confidence) / 2` and
`(1 + confidence) / 2` quantiles of the resampled differences.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from evals.store import GENERATIONS, in_scope, peek_records, planned_items
from longflow.errors import UserError

RESAMPLES = 10_000  # the usual count for percentile intervals at 95% (Efron and Tibshirani, ch. 19)
CONFIDENCE = 0.95
SEED = 0
CHUNK = 1_000  # resamples drawn at once: bounds the index matrix to CHUNK x items
COUNTS_KEPT = 16  # draws kept (one per item-set column of a table): a table's columns are compared row by row


@dataclass(frozen=True)
class BootstrapConfig:
    """How the intervals are drawn: `resamples` draws of the items, a `confidence` level, a `seed`
    (every comparison of a table uses the same one, so a table is redrawn exactly)."""

    resamples: int = RESAMPLES
    confidence: float = CONFIDENCE
    seed: int = SEED

    def __post_init__(self):
        if self.resamples < 1:
            raise UserError(f"bootstrap resamples must be at least 1, got {self.resamples}")
        if not 0.0 < self.confidence < 1.0:
            raise UserError(f"bootstrap confidence must lie strictly between 0 and 1, got {self.confidence}")


@dataclass(frozen=True)
class ItemScores:
    """One run's per-item numbers: item ids, and per item the numerator and denominator of the run's
    score (`score` = sum of numerators / sum of denominators). `numerator`, `denominator`: `[items]`."""

    ids: tuple[str, ...]
    numerator: np.ndarray
    denominator: np.ndarray

    def __post_init__(self):
        if not (len(self.ids) == len(self.numerator) == len(self.denominator)):
            raise ValueError("ItemScores needs one numerator and one denominator per item id")

    @classmethod
    def means(cls, values: dict[str, float]) -> ItemScores:
        """Per-item values whose score is their plain mean (accuracy: each item's mean correctness)."""
        ids = tuple(values)
        return cls(ids, np.array([values[i] for i in ids], dtype=float), np.ones(len(ids)))

    @property
    def score(self) -> float:
        return float(self.numerator.sum() / self.denominator.sum())


@dataclass(frozen=True)
class Difference:
    """`a - b` of two runs' scores over the items both have (`items` of them), and its interval
    [`low`, `high`]; in the scores' unit (fractions)."""

    estimate: float
    low: float
    high: float
    items: int

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0.0 or self.high < 0.0


def run_accuracy_scores(run: Path | str, items: Sequence[str] | None = None) -> ItemScores | None:
    """Per-item accuracy of a run directory: each item's mean correctness over its graded samples,
    over `items` (a frame's `item_ids`; by default the items its last config covers, items.json);
    None when it has no generations.jsonl records of them."""
    run = Path(run)
    records = in_scope(peek_records(run / GENERATIONS), planned_items(run) if items is None else items)
    if not records:
        return None
    by_item: dict[str, list[bool]] = defaultdict(list)
    for record in records:
        by_item[str(record["id"])].append(bool(record["correct"]))
    return ItemScores.means({item: float(np.mean(correct)) for item, correct in by_item.items()})


def paired(a: ItemScores, b: ItemScores) -> tuple[np.ndarray, np.ndarray]:
    """`[2, items]` numerators and denominators of the items both runs have, in `a`'s order."""
    where_b = {item: position for position, item in enumerate(b.ids)}
    common = [(position, where_b[item]) for position, item in enumerate(a.ids) if item in where_b]
    if not common:
        raise UserError("the two runs share no item ids: nothing to pair")
    in_a, in_b = (np.array(side) for side in zip(*common, strict=True))
    return (np.stack([a.numerator[in_a], b.numerator[in_b]]), np.stack([a.denominator[in_a], b.denominator[in_b]]))


@functools.lru_cache(maxsize=COUNTS_KEPT)
def resample_counts(items: int, config: BootstrapConfig, stream: int) -> np.ndarray:
    """`[resamples, items]`: how many times each item is drawn in each resample (items drawn with
    replacement, uniformly), from the seed's stream `stream`. Every comparison over the same number
    of items on one stream shares these draws, so each costs one matrix product. Kept for the last
    `COUNTS_KEPT` (items, config, stream): 8 bytes x resamples x items each, 16 MB at 200 items."""
    rng = np.random.default_rng(np.random.SeedSequence([config.seed, stream]))
    counts = []
    for start in range(0, config.resamples, CHUNK):
        chunk = min(CHUNK, config.resamples - start)
        index = rng.integers(0, items, size=(chunk, items)) + items * np.arange(chunk)[:, None]  # [chunk, items]
        counts.append(np.bincount(index.ravel(), minlength=chunk * items).reshape(chunk, items))
    return np.concatenate(counts).astype(float)


def resampled_differences(a: ItemScores, b: ItemScores, config: BootstrapConfig,
                          stream: int = 0) -> tuple[float, np.ndarray, int]:
    """The difference of the scores of `a` and `b` over their common items, `[resamples]` such
    differences over items drawn with replacement (the same draw for both), and the number of
    common items. `stream` picks an independent random stream of the seed, for comparisons that
    are combined (an average over datasets draws each dataset's items apart)."""
    numerator, denominator = paired(a, b)  # [2, n] each
    estimate = numerator[0].sum() / denominator[0].sum() - numerator[1].sum() / denominator[1].sum()
    sums = resample_counts(numerator.shape[1], config, stream) @ np.concatenate([numerator, denominator]).T
    scores = sums[:, :2] / sums[:, 2:]  # [resamples, 2]: each run's score in each resample
    return float(estimate), scores[:, 0] - scores[:, 1], numerator.shape[1]


def interval(estimate: float, draws: np.ndarray, items: int, config: BootstrapConfig) -> Difference:
    """The percentile interval of resampled differences `[resamples]` around `estimate`."""
    tail = (1.0 - config.confidence) / 2.0
    low, high = np.quantile(draws, [tail, 1.0 - tail])
    return Difference(estimate, float(low), float(high), items)


def paired_difference(a: ItemScores, b: ItemScores, config: BootstrapConfig = BootstrapConfig(),
                      stream: int = 0) -> Difference:
    """score(a) - score(b) over their common items, with its paired percentile bootstrap interval."""
    return interval(*resampled_differences(a, b, config, stream), config)


def mean_difference(pairs: list[tuple[ItemScores, ItemScores]], config: BootstrapConfig = BootstrapConfig(),
                    streams: list[int] | None = None) -> Difference:
    """The mean over datasets of score(a) - score(b), one pair of runs per dataset, each dataset's
    items resampled apart on its own stream (`streams`, default 0, 1, ...; datasets are independent
    samples): a table's "Avg." column."""
    if not pairs:
        raise ValueError("mean_difference needs at least one pair of runs")
    streams = list(range(len(pairs))) if streams is None else streams
    results = [resampled_differences(a, b, config, stream) for stream, (a, b) in zip(streams, pairs, strict=True)]
    estimate = float(np.mean([estimate for estimate, _, _ in results]))
    draws = np.mean([draws for _, draws, _ in results], axis=0)
    return interval(estimate, draws, sum(items for _, _, items in results), config)
