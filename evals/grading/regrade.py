"""Re-grade stored outputs without a GPU: `python -m evals.grading <run dir> [<run dir> ...]`.

Reads each run's generations.jsonl, grades every output again with the current grader (useful
after a grading fix), rewrites the file atomically, records the grader in grader.json and recomputes
metrics.json over the items of the last config run there (items.json). Records that never reached
generation (e.g. `prompt_too_long`) keep their reason. The run directory is locked meanwhile, so a
run cannot append to the file while it is rewritten (and a live run makes this refuse). A run
resumed under another grader is re-graded the same way (`regrade_files`, from `evals.pipeline`).
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import closing
from pathlib import Path

from evals.fingerprint import grader_record
from evals.grading.pool import GraderError, grade_many
from evals.grading.verdict import GradeRequest
from evals.metrics import summarize
from evals.store import (
    BATCHES,
    FIDELITY,
    GENERATIONS,
    GRADER,
    IDENTITY,
    ITEMS,
    METRICS,
    atomic_write,
    in_scope,
    lock_run,
    read_json_file,
    read_records,
)
from longflow.errors import UserError, report

NOT_GENERATED = {"prompt_too_long"}


def regrade(run: Path, workers: int = 2, timeout: int = 10) -> dict:
    """Re-grades one run directory in place; returns its new metrics."""
    if not (run / IDENTITY).exists():
        raise UserError(f"{run} is not a run directory (no {IDENTITY})")
    with closing(lock_run(run)):  # first: a run that has not stored its first batch is being written
        if not (run / GENERATIONS).exists():
            raise UserError(f"{run} holds no outputs yet (no {GENERATIONS}): nothing to re-grade")
        return regrade_files(run, workers, timeout, grader_record())


def grade_again(records: list[dict], kind: str, thinks: bool, workers: int, timeout: int) -> int:
    """Grades the generated `records` again in place with the current grader; returns how many
    changed their verdict."""
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
    return changed


def regrade_files(run: Path, workers: int, timeout: int, grader: dict) -> dict:
    """Re-grades the run directory `run`, whose lock the caller holds, with `grader` (this process's
    `evals.fingerprint.grader_record`), and records it; returns the new metrics."""
    identity = read_json_file(run / IDENTITY)
    if not isinstance(identity, dict) or not {"kind", "thinks"} <= set(identity):
        raise UserError(f"{run / IDENTITY} is not a run identity (no kind or thinks)")
    records = read_records(run / GENERATIONS)
    changed = grade_again(records, identity["kind"], identity["thinks"], workers, timeout)
    atomic_write(run / GENERATIONS, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    atomic_write(run / GRADER, json.dumps(grader, indent=2, sort_keys=True) + "\n")
    scope = read_json_file(run / ITEMS) if (run / ITEMS).exists() else None
    metrics = summarize({**identity, "run_id": run.name}, in_scope(records, scope), read_records(run / BATCHES),
                        in_scope(read_records(run / FIDELITY), scope))
    atomic_write(run / METRICS, json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    regraded = sum(r["reason"] not in NOT_GENERATED for r in records)
    print(f"{run}: {regraded} outputs re-graded, {changed} changed, accuracy {metrics['accuracy']}")
    return metrics


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m evals.grading", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=10, help="seconds per item, a hard limit")
    args = parser.parse_args(argv)
    try:
        if args.workers <= 0 or args.timeout <= 0:
            raise UserError(f"--workers and --timeout must be positive, got {args.workers} and {args.timeout}")
        for run in args.runs:
            regrade(run, args.workers, args.timeout)
    except UserError as error:
        sys.exit(report(error))
    except GraderError as error:
        print(f"error: grading failed, nothing was rewritten: {error}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted; the run directory being re-graded was left as it was", file=sys.stderr)
        sys.exit(130)
