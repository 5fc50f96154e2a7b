"""The verdict on one output: whether it answers its item, what answer it gave, and why it is wrong."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from math_verify.errors import TimeoutException

from evals.datasets import KINDS
from evals.grading.answers import boxed_contents, extract_choice, normalize, repair_gold, split_answers
from evals.grading.equivalence import equivalent

logger = logging.getLogger(__name__)

REASONS = ("correct", "mismatch", "no_box", "no_answer", "truncated", "unclosed_think", "timeout", "error")
THINK_CLOSE = "</think>"


@dataclass(frozen=True)
class Grade:
    """The verdict on one output: `extracted` is the answer read from it (None if none was read)."""

    correct: bool
    extracted: str | None
    reason: str

    def __post_init__(self):
        if self.reason not in REASONS or self.correct != (self.reason == "correct"):
            raise ValueError(f"inconsistent grade: correct={self.correct}, reason={self.reason!r}")


@dataclass(frozen=True)
class GradeRequest:
    """One output to grade, with what `grade` needs to know about it."""

    kind: str
    output: str
    gold: str
    finish_reason: str = "eos"
    thinks: bool = True


def grade(dataset_kind: str, output: str, gold: str, *, finish_reason: str = "eos", thinks: bool = True,
          timeout: int = 5) -> Grade:
    """Grade one output in this process (main thread only). `finish_reason` is "eos" or "length";
    `thinks` says the output is a chain of thought closed by "</think>" before the answer; `timeout`
    bounds each math-verify call and each numeric evaluation, in whole seconds."""
    if dataset_kind not in KINDS:
        raise ValueError(f"dataset_kind must be one of {KINDS}, got {dataset_kind!r}")
    check_timeout(timeout)
    if finish_reason == "length":
        return Grade(False, None, "truncated")
    if thinks:
        if THINK_CLOSE not in output:
            return Grade(False, None, "unclosed_think")
        output = output.rsplit(THINK_CLOSE, 1)[1]
    if dataset_kind == "gpqa":
        letter = extract_choice(output)
        if letter is None:
            return Grade(False, None, "no_answer")
        correct = letter == gold.strip().upper()
        return Grade(correct, letter, "correct" if correct else "mismatch")
    return _grade_math(output, gold, timeout)


def check_timeout(timeout: int) -> None:
    if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout <= 0:
        # signal.alarm takes whole seconds; math-verify turns a float into a silent False.
        raise ValueError(f"timeout must be a positive int (seconds), got {timeout!r}")


def _grade_math(answer: str, gold: str, timeout: int) -> Grade:
    boxes = boxed_contents(answer)
    if not boxes:
        return Grade(False, None, "no_box")
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("grade() needs the main thread (math-verify uses signal.alarm); use grade_many")
    gold_answer = normalize(repair_gold(gold))
    candidates = [boxes[-1]]
    if len(boxes) > 1 and len(split_answers(gold_answer.text)) > 1:  # one box per answer of a list or set
        # Every box ("-2" twice answers "-2,-2"), or each different box once (an output that boxes
        # its answers, then boxes them again in its summary).
        candidates += dict.fromkeys([",".join(boxes), ",".join(dict.fromkeys(boxes))])
    try:
        for candidate in candidates:
            if equivalent(gold_answer, normalize(candidate), timeout):
                return Grade(True, candidate, "correct")
    except TimeoutException:
        return Grade(False, boxes[-1], "timeout")
    except Exception as error:  # an answer the parser cannot read costs its item, not a run's grades
        logger.warning("grading error (%s: %s) for gold %r, answer %r", type(error).__name__, error, gold,
                       boxes[-1][:200])
        return Grade(False, boxes[-1], "error")
    return Grade(False, boxes[-1], "mismatch")
