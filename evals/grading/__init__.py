"""Grading: whether an output answers its item, what answer it gave, and why it is wrong.

The rules, and the reason for each, are in docs/protocol.md ("Grading"). In short:
  - A thinking model's output counts only after its last "</think>"; an output that never closes its
    thinking ("unclosed_think") or that stopped for length ("truncated") is wrong.
  - Math: the answer is the content of the last complete \\boxed{...} (`answers.boxed_contents`),
    normalised with its gold (`answers.normalize`) and compared (`equivalence.equivalent`): numbers
    numerically (exactly for integer golds, within a relative 1e-4 otherwise), everything else with
    math-verify. Several answers (a list, a set in braces, a \\pm) are a multiset: any order, each
    answer as often as written, no more answers than the gold's; a gold of several answers also
    accepts one box per answer.
  - GPQA: the letter of the last "Answer: X" (`answers.extract_choice`).

`grade` grades one output in this process; `grade_many` grades in worker processes under a hard
per-item time limit (`pool`), and raises `GraderError` when the grader itself fails.
"""

from evals.grading.answers import boxed_contents, extract_choice
from evals.grading.pool import GraderError, grade_many
from evals.grading.verdict import REASONS, Grade, GradeRequest, grade

__all__ = ["REASONS", "Grade", "GradeRequest", "GraderError", "boxed_contents", "extract_choice", "grade",
           "grade_many"]
