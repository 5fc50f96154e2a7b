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


def write_recorded_run(root, method, budget, correct, *, planned=None, model="canary", dataset="canary",
                       method_params=None, generation_params=None, **identity):
    """A run directory as the entry point leaves it: run.json, a graded generations.jsonl record per
    item of `correct` (id -> bool), a batch record, the items.json of its last config (`planned` ids,
    by default those of `correct`) and the metrics.json that config computed; returns its path."""
    from evals.metrics import summarize
    from evals.store import in_scope, stable_hash

    identity = {"model": model, "hub_id": "evals/canary/model", "revision": "main", "weights": "hub",
                "method": method, "variant": "paper", "budget": budget,
                "method_params": {"variant": "paper", **(method_params or {})},
                "generation": "greedy", "protocol": "default",
                "generation_params": {"n_samples": 1, "max_new_tokens": 64, **(generation_params or {})},
                "dataset": dataset, "kind": "math", "dataset_size": SIZES[dataset], "dataset_fingerprint": "f",
                "template": "t", **identity}
    tag = "full" if budget is None else f"b{budget}"
    run = root / f"{model}__{method}__{tag}__greedy__{dataset}__{stable_hash(identity)}"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps(identity))
    records = [{"id": item, "sample": 0, "correct": bool(mark), "output_tokens": 8 + index, "finish_reason": "eos",
                "reason": "correct" if mark else "mismatch", "peak_slots": budget or 64}
               for index, (item, mark) in enumerate(correct.items())]
    (run / "generations.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    batch = {"size": len(records), "prefill_seconds": 0.1, "step_seconds": [0.01] * 8, "generated_tokens": 64,
             "peak_memory_bytes": None, "device": "cpu"}
    (run / "batches.jsonl").write_text(json.dumps(batch) + "\n")
    planned = list(correct) if planned is None else planned
    (run / "items.json").write_text(json.dumps(planned))
    metrics = summarize({**identity, "run_id": run.name}, in_scope(records, planned), [batch])
    (run / "metrics.json").write_text(json.dumps(metrics))
    return run


def write_sweep(folder, jobs, *, command="python -m evals.run -m ...", total=None):
    """A sweep folder whose sweep.json records `jobs` as `evals.sweeps.SweepRecord` does: each job a
    list of (run directory, the item ids it covered there); `total` jobs in the command (default: as
    many as given)."""
    from evals.store import stable_hash

    folder.mkdir(parents=True, exist_ok=True)
    item_sets, job_runs = {}, {}
    for number, job in enumerate(jobs):
        entries = []
        for run, items in job:
            key = stable_hash(sorted(items))
            item_sets[key] = list(items)
            entries.append({"run": str(run), "items": key})
        job_runs[str(number)] = {"ended": 0.0, "runs": entries}
    runs = list(dict.fromkeys(str(run) for job in jobs for run, _ in job))
    (folder / "sweep.json").write_text(json.dumps({
        "command": command, "jobs": len(jobs) if total is None else total, "finished": len(jobs), "started": 0.0,
        "runs": runs, "job_runs": job_runs, "item_sets": item_sets}))
    return folder
