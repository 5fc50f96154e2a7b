"""A run's metrics from its stored records: accuracy, pass@k, speed, memory, KV slots held, and the
teacher-forced fidelity summary when the run has one."""

from __future__ import annotations

from collections import Counter, defaultdict
from math import comb
from typing import Any

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): 1 - C(n-c, k) / C(n, k), for n samples of which c correct."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def accuracy_stderr(generations: list[dict], n_samples: int) -> float | None:
    """The standard error of a run's accuracy. One sample per item: binomial, sqrt(p (1 - p) / n)
    over the n graded outputs. Several: over the samples, the standard deviation of the per-sample
    accuracies (sample s of every item that has one) divided by the square root of their number;
    None with fewer than two samples done."""
    if not generations:
        return None
    if n_samples == 1:
        p = float(np.mean([bool(record["correct"]) for record in generations]))
        return float(np.sqrt(p * (1.0 - p) / len(generations)))
    by_sample: dict[int, list[bool]] = defaultdict(list)
    for record in generations:
        by_sample[record["sample"]].append(bool(record["correct"]))
    if len(by_sample) < 2:
        return None
    accuracies = [np.mean(correct) for correct in by_sample.values()]
    return float(np.std(accuracies, ddof=1) / np.sqrt(len(accuracies)))


def summarize(identity: dict[str, Any], generations: list[dict], batches: list[dict],
              fidelity: list[dict] = ()) -> dict[str, Any]:
    """metrics.json of one run.

    generations: one record per item and sample (see `evals.run`); batches: one record per engine
    batch with its timings; fidelity: the run's teacher-forced records, if any (`summarize_fidelity`).
    Speed figures cover generation only (not loading, grading or the fidelity pass).
    """
    n_samples = identity["generation_params"]["n_samples"]
    by_item: dict[str, list[bool]] = defaultdict(list)
    for record in generations:
        by_item[record["id"]].append(bool(record["correct"]))
    correct = [bool(record["correct"]) for record in generations]

    metrics: dict[str, Any] = {
        key: identity[key] for key in ("run_id", "model", "hub_id", "method", "variant", "budget", "generation",
                                       "dataset", "dataset_size")
    }
    # The budget form of methods that have one (R-KV's cap | target, RPC's cap | ratio): the tables
    # show a form other than the cap apart, its peak slots above the budget.
    metrics["budget_mode"] = identity.get("method_params", {}).get("budget_mode")
    complete_items = [item for item, results in by_item.items() if len(results) >= n_samples]
    metrics.update(
        n_items=len(by_item),
        n_samples=n_samples,
        # Every item of the dataset, not of the run's `limit`: whether the run stands for the benchmark
        # (readers that ask whether a limited run is done compare n_items with its items.json).
        complete=len(complete_items) >= identity["dataset_size"],
        accuracy=float(np.mean(correct)) if correct else None,
        accuracy_stderr=accuracy_stderr(generations, n_samples),
    )
    if n_samples > 1 and complete_items:
        ks = [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= n_samples]
        metrics["pass_at_k"] = {
            str(k): float(np.mean([pass_at_k(n_samples, sum(by_item[i][:n_samples]), k) for i in complete_items]))
            for k in ks
        }

    steps = np.array([s for batch in batches for s in batch["step_seconds"]], dtype=float)
    generated = sum(batch["generated_tokens"] for batch in batches)
    generation_seconds = sum(batch["prefill_seconds"] + sum(batch["step_seconds"]) for batch in batches)
    memory = [batch["peak_memory_bytes"] for batch in batches if batch.get("peak_memory_bytes") is not None]
    slots = [s for record in generations for s in [record.get("peak_slots")] if s is not None]
    reused = sum(1 for record in generations if record.get("reused_from_full_cache"))
    metrics.update(
        # Copied records (evals.reuse) have no batch record: speed and latency are the generated ones'.
        reuse_full_cache=identity.get("reuse_full_cache", "off"),
        reused_share=reused / len(generations) if generations else None,
        tokens_per_second=generated / generation_seconds if generation_seconds > 0 else None,
        ttft_seconds_mean=float(np.mean([b["prefill_seconds"] for b in batches])) if batches else None,
        step_latency_ms={
            "p50": float(np.percentile(steps, 50) * 1e3),
            "p99": float(np.percentile(steps, 99) * 1e3),
            "mean": float(steps.mean() * 1e3),
        } if steps.size else None,
        peak_memory_gb=max(memory) / 2**30 if memory else None,
        peak_kv_slots=max(slots) if slots else None,
        mean_output_tokens=float(np.mean([r["output_tokens"] for r in generations])) if generations else None,
        finish_reasons=dict(Counter(r["finish_reason"] for r in generations)),
        grade_reasons=dict(Counter(r["reason"] for r in generations)),
        generation_seconds=generation_seconds,
        cuda_graph=any(batch.get("cuda_graph") for batch in batches),
        device=batches[-1]["device"] if batches else None,
    )
    if identity.get("verify"):
        metrics["verify"], metrics["verify_horizon"] = identity["verify"]["name"], identity["verify"]["horizon"]
        metrics.update(summarize_verify(generations))
    if fidelity:
        metrics["fidelity"] = summarize_fidelity(fidelity)
    return metrics


def summarize_verify(generations: list[dict]) -> dict[str, Any]:
    """The acceptance figures of a run with verification (`longflow.verify`), over the records that
    have them (a copied record, `evals.reuse`, has none):

    - `verify_rounds`: verify rounds, every item's together;
    - `accepted_histogram`: how many rounds accepted a = 0, 1, ..., h drafts (a is measured before
      a stop inside the round cuts what is committed);
    - `accepted_per_round`: the mean of a over the rounds;
    - `compressed_only_share`: the share of generated tokens that came from accepted drafts, whose
      step read the compressed cache only (the rest are each round's token from the full cache, and
      the first token, from the prompt's forward).
    """
    records = [record for record in generations if "verify_rounds" in record]
    histogram = np.sum([record["accepted_histogram"] for record in records], axis=0).tolist() if records else []
    rounds = sum(histogram)
    tokens = sum(record["output_tokens"] for record in records)
    return {
        "verify_rounds": rounds,
        "accepted_histogram": histogram,
        "accepted_per_round": sum(a * n for a, n in enumerate(histogram)) / rounds if rounds else None,
        "compressed_only_share": sum(record["drafted_tokens"] for record in records) / tokens if tokens else None,
    }


# The running agreement: pooled over a trailing window of this many output steps.
FIDELITY_WINDOW = 32
FIDELITY_THRESHOLD = 0.9


def trailing_mean(records: list[dict], key: str, window: int = FIDELITY_WINDOW) -> np.ndarray:
    """Per output step t, the mean of `key` over the steps t - window + 1 .. t of every record still
    running there, pooled (each (record, step) pair counts once): `[max steps]` float, NaN for
    t < window - 1 (no full window yet).

    records: teacher-forced records, `key` ("agreement" or "kl") a list per output step.
    """
    steps = max(len(r[key]) for r in records)
    values = np.zeros((len(records), steps))
    running = np.zeros((len(records), steps))
    for i, record in enumerate(records):
        values[i, :len(record[key])] = record[key]
        running[i, :len(record[key])] = 1.0
    totals = np.concatenate([[0.0], values.sum(axis=0).cumsum()])
    counts = np.concatenate([[0.0], running.sum(axis=0).cumsum()])
    means = np.full(steps, np.nan)
    end = np.arange(window, steps + 1)  # window [end - window, end), i.e. up to step end - 1
    means[window - 1:] = (totals[end] - totals[end - window]) / (counts[end] - counts[end - window])
    return means


def summarize_fidelity(records: list[dict], window: int = FIDELITY_WINDOW,
                       threshold: float = FIDELITY_THRESHOLD) -> dict[str, Any]:
    """The teacher-forced records of a run (one per item, lists per output step, see
    `longflow.fidelity`) summarised: mean agreement and mean KL over every scored token, and
    `divergence_step`, the first output step t at which the running agreement (`trailing_mean`:
    pooled over the last `window` steps and the items still running) is below `threshold`; None
    when it never is (or no output reaches `window` steps)."""
    tokens = sum(len(r["agreement"]) for r in records)
    running = trailing_mean(records, "agreement", window)
    below = np.flatnonzero(running < threshold)  # NaN compares False
    return {
        "n_items": len(records),
        "n_tokens": tokens,
        "agreement": sum(sum(r["agreement"]) for r in records) / tokens,
        "kl": sum(sum(r["kl"]) for r in records) / tokens,
        "divergence_step": int(below[0]) if below.size else None,
        "window": window,
        "threshold": threshold,
    }
