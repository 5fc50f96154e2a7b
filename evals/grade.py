"""Re-grade stored outputs without a GPU: `python -m evals.grade <run dir> [<run dir> ...]`.

Reads each run's generations.jsonl, grades every output again with the current grader (useful
after a grading fix), rewrites the file atomically and recomputes metrics.json. Records that never
reached generation (e.g. `prompt_too_long`) keep their reason.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from longflow.errors import UserError, report

NOT_GENERATED = {"prompt_too_long"}


def regrade(run: Path, workers: int = 2, timeout: int = 10) -> dict:
    """Re-grades one run directory in place; returns its new metrics."""
    from evals.grading import GradeRequest, grade_many
    from evals.metrics import summarize
    from evals.store import BATCHES, FIDELITY, GENERATIONS, IDENTITY, METRICS, atomic_write, read_records

    if not (run / IDENTITY).exists() or not (run / GENERATIONS).exists():
        raise UserError(f"{run} is not a run directory (no {IDENTITY} or {GENERATIONS})")
    identity = json.loads((run / IDENTITY).read_text())
    records = read_records(run / GENERATIONS)
    kind, thinks = identity["kind"], identity["thinks"]
    todo = [r for r in records if r["reason"] not in NOT_GENERATED]
    grades = grade_many(
        [GradeRequest(kind=kind, output=r["output"], gold=r["gold"], finish_reason=r["finish_reason"], thinks=thinks)
         for r in todo],
        workers=workers, timeout=timeout,
    )
    changed = 0
    for record, grade in zip(todo, grades, strict=True):
        changed += record["correct"] != grade.correct
        record.update(extracted=grade.extracted, correct=grade.correct, reason=grade.reason)
    atomic_write(run / GENERATIONS, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    metrics = summarize({**identity, "run_id": run.name}, records, read_records(run / BATCHES),
                        read_records(run / FIDELITY))
    atomic_write(run / METRICS, json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    print(f"{run}: {len(todo)} outputs re-graded, {changed} changed, accuracy {metrics['accuracy']}")
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=10, help="seconds per item, a hard limit")
    args = parser.parse_args()
    try:
        for run in args.runs:
            regrade(run, args.workers, args.timeout)
    except UserError as error:
        sys.exit(report(error))


if __name__ == "__main__":
    main()
