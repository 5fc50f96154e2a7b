"""Run folders as the report code reads them (a metrics.json like the entry point's), and checks of the
figure files it writes: shared by the table, results, figures and fidelity tests."""

from __future__ import annotations

import json
import os

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PDF_MAGIC = b"%PDF-"


SIZES = {"gsm8k": 1319, "math500": 500, "aime24": 30, "demo": 8, "canary": 200,
         **{f"canary_{family}": 200 for family in ("state", "lookup", "plan", "redundant", "chain")}}


def write_run(root, model, method, budget, dataset, accuracy, *, variant="paper", generation="greedy",
              n_items=None, planned=None, mtime=None, **extra):
    """A run directory holding a metrics.json like the entry point's, and the items.json of a config
    that covers `planned` items (none written when None); returns its path."""
    size = SIZES[dataset]
    n_items = size if n_items is None else n_items
    tag = "full" if budget is None else f"b{budget}"
    run_id = f"{model}__{method}__{tag}__{generation}__{dataset}__{variant}{mtime or ''}"
    metrics = {
        "run_id": run_id, "model": model, "hub_id": "none", "method": method, "variant": variant,
        "budget": budget, "generation": generation, "dataset": dataset, "dataset_size": size,
        "n_items": n_items, "n_samples": 1, "complete": n_items >= size, "accuracy": accuracy,
        "tokens_per_second": 100.0 if budget is None else 1000.0 / budget * 10,
        "ttft_seconds_mean": 0.05, "step_latency_ms": {"p50": 3.0, "p99": 4.0, "mean": 3.2},
        "peak_memory_gb": None, "peak_kv_slots": budget or 512, "mean_output_tokens": 48.0,
        "finish_reasons": {"eos": 1, "length": 3}, "grade_reasons": {"correct": 1, "mismatch": 3},
        "wall_seconds": 1.0, "device": "cpu", **extra,
    }
    path = root / run_id / "metrics.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(metrics))
    if planned is not None:
        (path.parent / "items.json").write_text(json.dumps([str(i) for i in range(planned)]))
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path.parent


def is_png(path) -> bool:
    return path.stat().st_size > 1000 and path.read_bytes()[:8] == PNG_MAGIC


def is_figure(path) -> bool:
    magic = PNG_MAGIC if path.suffix == ".png" else PDF_MAGIC
    return path.stat().st_size > 1000 and path.read_bytes()[:len(magic)] == magic


def write_generations(run, correct, samples=1):
    """A run's generations.jsonl: one graded record per item id of `correct` (id -> bool, or a list
    of bools, one per sample) and the items.json of those ids; returns `run`."""
    lines = []
    for item, marks in correct.items():
        for sample, mark in enumerate(marks if isinstance(marks, list) else [marks] * samples):
            lines.append(json.dumps({"id": item, "sample": sample, "correct": bool(mark), "output_tokens": 8}))
    (run / "generations.jsonl").write_text("\n".join(lines) + "\n")
    (run / "items.json").write_text(json.dumps(list(correct)))
    return run
