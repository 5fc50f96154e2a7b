"""Grading: whether an output answers its item, what answer it gave, and why it is wrong.

Rules (PROTOCOL.md, "Grading"):
  - A thinking model's output counts only after its last "</think>"; an output that never closes its
    thinking ("unclosed_think") or that stopped for length ("truncated") is wrong, whatever stray
    number it holds.
  - Math: the answer is the content of the last complete \\boxed{...} (or \\fbox{...}), found here
    with brace matching: math-verify's own extraction merges close boxes ("\\boxed{204} ...
    \\boxed{205}" reads 204205). Both sides are normalised, then compared:
      * golds written as numbers ("27.0", "025", "70\\,000", "4.5e33", Minerva's Python-ish
        "np.arcsin(10/13)") compare numerically: exactly for integers, within a relative 1e-4
        otherwise. math-verify would read "4.5e33" with Euler's e and compare tiny magnitudes after
        rounding to 6 decimals (1e-8 == 2e-8);
      * every other gold goes through math-verify, `verify(gold, pred)` in that order, with the gold
        wrapped in "$...$" and e-notation rewritten as "\\times 10^{...}"; when both sides are
        numbers, a math-verify match must also be within the relative 1e-4;
      * a gold of several answers ("$(1,8,19), (2,7,13)$", "$69$,$84$") is one comma list; an output
        that boxes each answer separately is also tried with its boxes joined.
    Golds that a regex cut short in the paper's MATH-500 file ("3} \\pmod{7", "350}$. We also ...")
    are repaired to what precedes their first unmatched "}".
  - GPQA: the letter of the last "Answer: X" (also "**Answer:** X", "Answer: $X$", "the answer is
    X", "\\boxed{X}"), else of the last "(X)".

math-verify bounds its work with signal.alarm, so `grade` runs in the main thread of its process.
`grade_many` grades in worker processes under a hard per-item time limit.
"""

from __future__ import annotations

import ast
import logging
import math
import multiprocessing
import re
import signal
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import product
from multiprocessing.connection import Connection, wait

import sympy
from math_verify import parse, verify
from math_verify.errors import TimeoutException
from tqdm import tqdm

from evals.datasets import KINDS

logger = logging.getLogger(__name__)

REASONS = ("correct", "mismatch", "no_box", "no_answer", "truncated", "unclosed_think", "timeout", "error")
THINK_CLOSE = "</think>"
REL_TOL = 1e-4
PROGRESS_MIN_ITEMS = 64  # grade_many shows a progress bar from this many requests on


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
    _check_timeout(timeout)
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


def grade_many(requests: list[GradeRequest], workers: int = 2, timeout: int = 10) -> list[Grade]:
    """Grade every request in worker processes; results in input order.

    `timeout` is a hard limit per item, in whole seconds: a worker still busy past it is killed and
    replaced, and its item gets reason "timeout"; the other items go on. A worker that dies on its
    own (a crash, out of memory) costs its item reason "error". Works from the main thread of any
    process, CUDA initialised or not (see `_Worker`).
    """
    if workers <= 0:
        raise ValueError(f"workers must be positive, got {workers}")
    _check_timeout(timeout)
    kinds = {request.kind for request in requests}
    if not kinds <= set(KINDS):
        raise ValueError(f"request kinds must be in {KINDS}, got {sorted(kinds - set(KINDS))}")
    grades: list[Grade | None] = [None] * len(requests)
    pending = list(reversed(range(len(requests))))  # popped from the end: input order
    progress = tqdm(total=len(requests), desc="grading", unit="item",
                    disable=len(requests) < PROGRESS_MIN_ITEMS)
    # math-verify's own alarms get half the hard limit, so a slow but interruptible comparison ends
    # as a "timeout" inside its worker, and only work that ignores signals costs a process.
    soft_timeout = max(1, timeout // 2)
    pool: list[_Worker] = []
    try:
        for _ in range(min(workers, len(requests))):
            pool.append(_Worker(soft_timeout))
            pool[-1].assign(pending, requests, timeout)
        while any(worker.index is not None for worker in pool):
            busy = [worker for worker in pool if worker.index is not None]
            ready = wait([worker.conn for worker in busy],
                         timeout=max(0.0, min(worker.deadline for worker in busy) - time.monotonic()))
            for slot, worker in enumerate(pool):
                if worker.index is None:
                    continue
                if worker.conn in ready:
                    result, failure = worker.receive(), "error"  # None: it died before answering
                elif time.monotonic() >= worker.deadline:
                    result, failure = None, "timeout"
                else:
                    continue
                grades[worker.index] = result or Grade(False, None, failure)
                progress.update()
                if result is None:  # hung past the limit, or dead: replace it
                    worker.close()
                    worker = pool[slot] = _Worker(soft_timeout)
                worker.assign(pending, requests, timeout)
    finally:
        progress.close()
        for worker in pool:
            worker.close()
    return grades  # type: ignore[return-value]  # every slot is filled once the loop ends


def extract_choice(text: str) -> str | None:
    """The multiple-choice letter (A-D) a text answers with, or None; see the module docstring."""
    stated = [match for pattern in _STATED_CHOICE for match in pattern.finditer(text)]
    if stated:
        return max(stated, key=lambda match: match.start()).group(1)
    bare = list(_BARE_CHOICE.finditer(text))
    return bare[-1].group(1) if bare else None


def boxed_contents(text: str) -> list[str]:
    """The contents of the complete top-level \\boxed{...} / \\fbox{...} groups of `text`, in order.

    Braces are matched, escaped ones (\\{, \\}) skipped; a box nested in another is part of the
    outer content, and an unclosed box (a cut-off output) ends the search.
    """
    contents = []
    position = 0
    while (opening := _BOX_OPEN.search(text, position)) is not None:
        depth = 1
        for token in _BRACE_TOKEN.finditer(text, opening.end()):
            depth += {"{": 1, "}": -1}.get(token.group(), 0)
            if depth == 0:
                contents.append(text[opening.end():token.start()].strip())
                position = token.end()
                break
        else:
            break
    return contents


# --- math ----------------------------------------------------------------------------------------

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE_TOKEN = re.compile(r"\\.|[{}]", re.DOTALL)  # an escaped character, or a brace
# "4.5e33", "1e-8", "3.21E+5" as a whole number token (not "2e^{t}" or "x1e5").
_E_NOTATION = re.compile(r"(?<![\w.\\])(\d+(?:\.\d*)?|\.\d+)[eE]\+?(-?\d+)(?![\w.])")
# Thousands separated by a LaTeX space or a braced comma ("70\,000", "1\ 000", "10{,}080").
_SPACED_THOUSANDS = re.compile(r"(?<=\d)(?:\\,|\\;|\\:|\\ |~|\{,\})(?=\d{3}(?!\d))")
_NEGATIVE_SPACE = re.compile(r"\\!\s*")  # "\!", MATH's kerning in "10,\!080" and "11,\! 111"
_COMMA_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_INTEGER = re.compile(r"[+-]?\d+(?:\.0*)?")
_LEADING_ZEROS = re.compile(r"(?<![\d.])0+(?=\d)")


def _check_timeout(timeout: int) -> None:
    if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout <= 0:
        # signal.alarm takes whole seconds; math-verify turns a float into a silent False.
        raise ValueError(f"timeout must be a positive int (seconds), got {timeout!r}")


def _grade_math(answer: str, gold: str, timeout: int) -> Grade:
    boxes = boxed_contents(answer)
    if not boxes:
        return Grade(False, None, "no_box")
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("grade() needs the main thread (math-verify uses signal.alarm); use grade_many")
    gold = _normalize(_repair_gold(gold))
    candidates = [boxes[-1]]
    if len(boxes) > 1 and _count_answers(gold) > 1:
        candidates.append(",".join(dict.fromkeys(boxes)))
    try:
        for candidate in candidates:
            if _equivalent(gold, _normalize(candidate), timeout):
                return Grade(True, candidate, "correct")
    except TimeoutException:
        return Grade(False, boxes[-1], "timeout")
    except Exception as error:  # a parser failure on odd input costs one item, not a run's grades
        logger.warning("grading error (%s: %s) for gold %r, answer %r", type(error).__name__, error, gold,
                       boxes[-1][:200])
        return Grade(False, boxes[-1], "error")
    return Grade(False, boxes[-1], "mismatch")


def _repair_gold(gold: str) -> str:
    """A gold cut out of a solution by a regex that did not match braces ("3} \\pmod{7") ends at its
    first unmatched "}"; balanced golds come back unchanged."""
    depth = 0
    for token in _BRACE_TOKEN.finditer(gold):
        if token.group() == "{":
            depth += 1
        elif token.group() == "}":
            if depth == 0:
                return gold[:token.start()]
            depth -= 1
    return gold


def _normalize(text: str) -> str:
    """Notation that means nothing to the comparison, removed from a gold or a boxed answer."""
    text = text.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    text = _NEGATIVE_SPACE.sub("", text).strip().rstrip(".").strip()
    text = _SPACED_THOUSANDS.sub("", text)
    # "2,125" is a number with a thousands comma, but "2500,7500" or "1,3,5" are lists.
    if _COMMA_THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    return text


def _count_answers(text: str) -> int:
    """How many comma-separated answers `text` holds at bracket depth 0."""
    depth, count = 0, 1
    for char in text:
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            count += 1
    return count


def _equivalent(gold: str, pred: str, timeout: int) -> bool:
    gold_value = _literal_number(gold)
    if gold_value is not None:
        pred_value = _literal_number(pred)
        if pred_value is None:
            pred_value = _number(_parse(pred, timeout), timeout)
        if pred_value is not None:
            return _close(gold_value, pred_value, exact=_INTEGER.fullmatch(gold) is not None)
    gold_parsed, pred_parsed = _parse(gold, timeout), _parse(pred, timeout)
    if not _verify(gold_parsed, pred_parsed, timeout):
        return False
    # math-verify compares numbers after rounding to 6 decimals: 1e-8 would equal 2e-8.
    gold_number, pred_number = _number(gold_parsed, timeout), _number(pred_parsed, timeout)
    return gold_number is None or pred_number is None or _close(gold_number, pred_number, exact=False)


def _close(gold: complex, pred: complex, exact: bool) -> bool:
    if exact:
        return pred == gold
    return abs(pred - gold) <= REL_TOL * abs(gold)


def _parse(text: str, timeout: int) -> list:
    """math-verify's parse of `text` as one LaTeX formula, with e-notation made explicit."""
    latex = _E_NOTATION.sub(r"\1\\times 10^{\2}", text)
    return parse(f"${latex}$", parsing_timeout=timeout, raise_on_error=True)


def _verify(gold: list, pred: list, timeout: int) -> bool:
    """math-verify's `verify`, pair by pair as it does itself, but telling a timeout from a mismatch."""
    timed_out = False
    for gold_item, pred_item in product(gold, pred):
        try:
            if verify(gold_item, pred_item, timeout_seconds=timeout, raise_on_error=True):
                return True
        except TimeoutException:
            timed_out = True
        except Exception:  # math-verify's own rule: a comparison that fails is not a match
            continue
    if timed_out:
        raise TimeoutException("math-verify timed out")
    return False


def _number(parsed: list, timeout: int) -> complex | None:
    """The numeric value of a parsed answer, or None when it is not a single number."""
    expr = next((item for item in parsed if isinstance(item, sympy.Basic)), None)
    if not isinstance(expr, sympy.Expr):
        return None
    with _time_limit(timeout):
        if not expr.is_number:
            return None
        try:
            value = complex(expr)
        except (TypeError, ValueError, OverflowError, ZeroDivisionError):
            return None
    return value if math.isfinite(value.real) and math.isfinite(value.imag) else None


@contextmanager
def _time_limit(seconds: int) -> Iterator[None]:
    """Raise TimeoutException after `seconds`, as math-verify does (never nested with its alarms)."""

    def on_alarm(signum, frame):
        raise TimeoutException("numeric evaluation timed out")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# A tiny evaluator for numbers written as Python, as some Minerva golds are ("np.arcsin(10/13)",
# "-1./3", "4.5e33"): literals, + - * / **, and these names, bare or as np./numpy./math. attributes.
_CONSTANTS = {"pi": math.pi, "e": math.e}
_FUNCTIONS = {
    "sqrt": math.sqrt, "exp": math.exp, "log": math.log, "log10": math.log10, "log2": math.log2,
    "sin": math.sin, "cos": math.cos, "tan": math.tan, "arcsin": math.asin, "arccos": math.acos,
    "arctan": math.atan, "asin": math.asin, "acos": math.acos, "atan": math.atan, "abs": abs,
}
_BINARY = {ast.Add: float.__add__, ast.Sub: float.__sub__, ast.Mult: float.__mul__,
           ast.Div: float.__truediv__, ast.Pow: math.pow}


def _literal_number(text: str) -> float | None:
    """The value of `text` if it is a number written as Python (see above), else None."""
    try:
        tree = ast.parse(_LEADING_ZEROS.sub("", text), mode="eval")  # "025": Python rejects leading zeros
        value = _evaluate(tree.body)
    except (SyntaxError, ValueError, TypeError, ArithmeticError):
        return None
    return value if math.isfinite(value) else None


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return float(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if _name(node) in _CONSTANTS:
        return _CONSTANTS[_name(node)]
    if isinstance(node, ast.Call) and not node.keywords and _name(node.func) in _FUNCTIONS:
        return float(_FUNCTIONS[_name(node.func)](*(_evaluate(arg) for arg in node.args)))
    raise ValueError(f"not a number: {ast.dump(node)}")


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in (
            "np", "numpy", "math"):
        return node.attr
    return None


# --- GPQA ----------------------------------------------------------------------------------------

_LETTER = r"\(?\s*([A-D])\s*\)?(?![A-Za-z0-9])"
_STATED_CHOICE = (
    # "Answer: C", "**Answer:** C", "Answer: $C$", "Final answer: (C)", "the answer is **C**".
    re.compile(r"(?i:answer)\s*(?:\*\*|__)?\s*(?:(?i:is)\s*)?:?\s*(?:\*\*|__)?\s*:?\s*\$?\s*"
               r"(?:\\(?:boxed|text|textbf|mathrm)\s*\{\s*)?" + _LETTER),
    re.compile(r"\\boxed\s*\{\s*(?:\\(?:text|textbf|mathrm)\s*\{\s*)?" + _LETTER),
)
_BARE_CHOICE = re.compile(r"\(([A-D])\)")


# --- worker processes ----------------------------------------------------------------------------


class _Worker:
    """One grading process, fed one request at a time through its own pipe.

    A pipe per worker, not a shared queue: killing a worker mid-write then breaks only its own pipe,
    never a lock that the other workers share. Workers start from a fork server, a clean process that
    never ran the caller's CUDA context or threads, with this module preloaded so that a replacement
    starts in milliseconds.
    """

    def __init__(self, timeout: int):
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([__name__])
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child, timeout), daemon=True)
        self.process.start()
        child.close()
        self.index: int | None = None
        self.deadline = math.inf

    def assign(self, pending: list[int], requests: list[GradeRequest], timeout: int) -> None:
        """Send the next pending request, or go idle when none is left."""
        self.index = pending.pop() if pending else None
        if self.index is not None:
            self.deadline = time.monotonic() + timeout
            try:
                self.conn.send(requests[self.index])
            except OSError:  # it died already: `wait` then reports its pipe closed, as for any death
                pass

    def receive(self) -> Grade | None:
        """The worker's grade, or None if it died before answering."""
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            return None

    def close(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.conn.close()


def _worker_main(conn: Connection, timeout: int) -> None:
    """Grade requests from `conn` until it closes, in the worker's main thread as math-verify needs."""
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        try:
            result = grade(request.kind, request.output, request.gold, finish_reason=request.finish_reason,
                           thinks=request.thinks, timeout=timeout)
        except Exception:  # a bug must not hang the parent waiting for this item
            traceback.print_exc()
            result = Grade(False, None, "error")
        conn.send(result)
