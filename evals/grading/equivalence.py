"""Whether a normalised math answer equals its gold (see `evals.grading` for the rules).

Numbers are compared here, not by math-verify: a gold that is a number, written plainly ("27.0",
"4.5e33", Minerva's Python-ish "np.arcsin(10/13)") or as LaTeX that evaluates to one
("\\frac{8}{3}", "\\cos^{10}(\\frac{\\pi}{10})"), matches an answer that evaluates to a number
exactly when the gold is an integer and within a relative 1e-4 otherwise. Integer-ness and exact
equality are decided in rationals ("\\frac{100!}{2^{50}}" is an integer, and "+1" changes it);
floats would make every integer past 2^53 equal to its neighbours. math-verify compares numbers
after rounding to 6 decimals (1e-8 == 2e-8) and reads "4.5e33" with Euler's e. Everything else
(expressions with variables, tuples, intervals, sets, equations, text) goes through math-verify's
`verify(gold, pred)`, except that several answers are compared here as multisets, answer by answer
(`_expressions_match`): math-verify compares sets, which drop repeated answers.

math-verify bounds its work with signal.alarm, so everything here runs in the main thread.
"""

from __future__ import annotations

import ast
import math
import re
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from itertools import product

import sympy
from latex2sympy2_extended.sets import FiniteSet
from math_verify import parse, verify
from math_verify.errors import TimeoutException

from evals.grading.answers import Answer, base_numeral, decimal_comma, definition, split_answers

REL_TOL = 1e-4

# "4.5e33", "1e-8", "3.21E+5" as a whole number token (not "2e^{t}" or "x1e5").
_E_NOTATION = re.compile(r"(?<![\w.\\])(\d+(?:\.\d*)?|\.\d+)[eE]\+?(-?\d+)(?![\w.])")
# A capital E with a subscript ("E_{1}", "E_0"): math-verify's grammar takes E for Euler's e and
# rejects the subscript, and then reads a fragment of the text instead (minerva#261's gold
# "\hbar \omega(v+1 / 2)-\frac{E_{0}^{2} e^{2}}{2 m \omega^{2}}" as the number 2). Written
# \mathsf{E} it is a symbol of its own; \mathrm{E} would not do: math-verify turns it into \text{E}
# and stops its formula there.
_SUBSCRIPTED_E = re.compile(r"(?<![\\A-Za-z])E(?=\s*_)")
# A plain decimal ("27.0", "025", "-.5"): its digits are its exact value. "4.5e33" is a measurement.
_DECIMAL = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)")
# Past 2^53 a float stands for several integers, so it cannot answer an integer gold exactly.
_EXACT_FLOAT_INTEGERS = 2**53
_LEADING_ZEROS = re.compile(r"(?<![\d.])0+(?=\d)")
# A gold that is one tuple holds ordered answers, which math-verify compares with a list in order;
# it reads "(1,3)" as an open interval.
_ORDERED = (sympy.Tuple, sympy.Interval)


def equivalent(gold: Answer, pred: Answer, timeout: int) -> bool:
    """Whether `pred` answers `gold`; raises TimeoutException when a comparison runs out of time."""
    gold, pred = _definitions_dropped(gold, pred)
    numeral = base_numeral(gold.text)
    if numeral is not None:
        # "52_8" is not 528 (Python's digit separator) nor 52's decimal value 42: the same digits,
        # with the same base or none (the question asked for that base).
        digits, base = numeral
        return pred.text.upper() == digits or base_numeral(pred.text) == numeral
    gold_value = _value(gold.text, timeout)
    if gold_value is not None:
        pred_value = _value(pred.text, timeout)
        # "1,22" answers 1.22; a comma in a gold always separates answers ("-3,0", "-2,1"), and
        # against an integer gold "3,0" is the list 3, 0 rather than 3.0, an unlikely spelling of 3.
        if pred_value is None and not gold_value.is_integer and (pred_comma := decimal_comma(pred.text)):
            pred_value = _value(pred_comma, timeout)
        if pred_value is not None:
            return _numbers_match(gold_value, gold.percent, pred_value, pred.percent)
    return _expressions_match(gold, pred, timeout)


def _expressions_match(gold: Answer, pred: Answer, timeout: int) -> bool:
    """Answers that are not both numbers. A side holding several answers (a list, a set, "\\pm")
    is a multiset: the other side must hold as many, each answering its own one, in any order. An
    answer holding more values than its gold (a hedge, "135^\\circ, 45^\\circ" for 45^\\circ) is
    wrong, except against a gold that is one tuple (`_ORDERED`)."""
    gold_parsed, pred_parsed = _parse(gold.text, timeout), _parse(pred.text, timeout)
    gold_answers, pred_answers = _answers(gold_parsed, gold.text), _answers(pred_parsed, pred.text)
    if gold_answers is None or pred_answers is None:  # compare the texts' answers one by one instead
        gold_items, pred_items = split_answers(gold.text), split_answers(pred.text)
        if len(gold_items) == len(pred_items) == 1:
            return _verify(gold_parsed, pred_parsed, timeout)
        return _matched(gold_items, pred_items, lambda gold_item, pred_item: equivalent(
            replace(gold, text=gold_item), replace(pred, text=pred_item), timeout))
    if len(gold_answers) == 1 and (len(pred_answers) == 1 or isinstance(gold_answers[0], _ORDERED)):
        return _verify(gold_parsed, pred_parsed, timeout)
    if len(gold_answers) > 1 and len(pred_answers) == 1:
        pred_answers = _unpacked(pred_answers[0])
    return _matched(gold_answers, pred_answers, lambda gold_answer, pred_answer: _answers_match(
        gold_answer, gold.percent, pred_answer, pred.percent, timeout))


def _answers(parsed: list, text: str) -> list | None:
    """The answers math-verify read in `text`, duplicates kept, or None when it read no expression,
    or one answer of a text that holds several ("3 \\text{ cm}, 5 \\text{ cm}" reads as 3).
    math-verify holds a list as a set, which drops duplicates ("-2,-2" is {-2}); the set's
    `_unsorted_args`, which math-verify keeps for its own in-order comparisons, still has them. A
    name defined as a list ("(x, y) = (5, 8) \\text{ and } (8, 5)") holds that list."""
    expr = next((item for item in parsed if isinstance(item, sympy.Basic)), None)
    if isinstance(expr, sympy.Eq) and isinstance(expr.rhs, FiniteSet) and _is_name(expr.lhs):
        expr = expr.rhs
    if isinstance(expr, FiniteSet):
        return list(expr._unsorted_args)
    if expr is None or len(split_answers(text)) > 1:
        return None
    return [expr]


def _unpacked(answer: sympy.Basic) -> list:
    """The answers of one tuple answering a list ("(-2, -2)" answers "-2,-2"), with "(1, 3)", which
    math-verify reads as an open interval, a pair; any other answer alone."""
    if isinstance(answer, sympy.Tuple):
        return list(answer.args)
    if isinstance(answer, sympy.Interval) and answer.left_open and answer.right_open:
        return [answer.start, answer.end]
    return [answer]


def _is_name(expr: sympy.Basic) -> bool:
    """A symbol, or a tuple of them ("(x, y)")."""
    return isinstance(expr, sympy.Symbol) or (isinstance(expr, sympy.Tuple)
                                              and all(isinstance(item, sympy.Symbol) for item in expr))


def _answers_match(gold: sympy.Basic, gold_percent: bool, pred: sympy.Basic, pred_percent: bool,
                   timeout: int) -> bool:
    """One answer of a list against one of another, numbers by the rules for numbers."""
    gold_value, pred_value = _number([gold], timeout), _number([pred], timeout)
    if gold_value is not None and pred_value is not None:
        return _numbers_match(gold_value, gold_percent, pred_value, pred_percent)
    return _verify([gold], [pred], timeout)


def _matched(golds: list, preds: list, answers: Callable[[object, object], bool]) -> bool:
    """Whether `preds` answers `golds` as a multiset: as many answers, each gold answered by a pred
    of its own. A bipartite matching by augmenting paths (Kuhn's algorithm), written here because
    neither sympy nor math-verify has one; it compares a pair only when the search reaches it, at
    most once. A comparison that times out is no match, and raises if no matching is found."""
    if len(golds) != len(preds):
        return False
    known: dict[tuple[int, int], bool] = {}
    timed_out = False

    def match(gold: int, pred: int) -> bool:
        nonlocal timed_out
        if (gold, pred) not in known:
            try:
                known[gold, pred] = answers(golds[gold], preds[pred])
            except TimeoutException:
                timed_out = True
                known[gold, pred] = False
        return known[gold, pred]

    owner: dict[int, int] = {}  # pred -> the gold it answers

    def assign(gold: int, seen: set[int]) -> bool:
        for pred in range(len(preds)):
            if pred not in seen and match(gold, pred):
                seen.add(pred)
                if pred not in owner or assign(owner[pred], seen):
                    owner[pred] = gold
                    return True
        return False

    if all(assign(gold, set()) for gold in range(len(golds))):
        return True
    if timed_out:
        raise TimeoutException("math-verify timed out")
    return False


def _definitions_dropped(gold: Answer, pred: Answer) -> tuple[Answer, Answer]:
    """What a name is called is not part of the answer: "I_{\\max} = \\frac{q}{2}" is answered by
    "\\frac{q}{2}", "3" by "x = 3", and "f(x) = 2x" by "f(x) = x + x"."""
    gold_definition, pred_definition = definition(gold.text), definition(pred.text)
    if gold_definition and pred_definition:
        if gold_definition[0] != pred_definition[0]:
            return gold, pred
        return replace(gold, text=gold_definition[1]), replace(pred, text=pred_definition[1])
    if gold_definition and "=" not in pred.text:
        gold = replace(gold, text=gold_definition[1])
    if pred_definition and "=" not in gold.text:
        pred = replace(pred, text=pred_definition[1])
    return gold, pred


@dataclass(frozen=True)
class _Number:
    """A side that is one number: `approx` for the relative tolerance, and `exact`, its (real,
    imaginary) parts as rationals when it has them ("\\frac{54}{2}", "27.0", "6+9i"; not
    "\\sqrt{2}", nor a float computed in LaTeX such as "2.7 \\times 10^{1}")."""

    approx: complex
    exact: tuple[sympy.Rational, sympy.Rational] | None

    @property
    def is_integer(self) -> bool:
        return self.exact is not None and all(part.is_integer for part in self.exact)


def _numbers_match(gold: _Number, gold_percent: bool, pred: _Number, pred_percent: bool) -> bool:
    """A side written with a percent sign also matches through its value divided by 100 ("60\\%"
    answers 0.6, and 0.625 answers "62.5%")."""
    for gold_scale, pred_scale in product((1, 100) if gold_percent else (1,), (1, 100) if pred_percent else (1,)):
        if gold.is_integer and gold_scale == pred_scale == 1:
            if _equals_integer(gold, pred):
                return True
        elif abs(pred.approx / pred_scale - gold.approx / gold_scale) <= REL_TOL * abs(gold.approx / gold_scale):
            return True
    return False


def _equals_integer(gold: _Number, pred: _Number) -> bool:
    if pred.exact is not None:
        return pred.exact == gold.exact
    return pred.approx == gold.approx and all(abs(part) < _EXACT_FLOAT_INTEGERS for part in gold.exact)


def _value(text: str, timeout: int) -> _Number | None:
    """The number an answer is, or None when it is not a single number. A text of several answers
    never is, whatever math-verify makes of it: it reads "135^\\circ, 45^\\circ" as 45, and
    "0,111" as 0.111."""
    if len(split_answers(text)) > 1:
        return None
    literal = _literal_number(text)
    if literal is not None:
        exact = (sympy.Rational(text), sympy.Integer(0)) if _DECIMAL.fullmatch(text) else None
        return _Number(complex(literal), exact)
    return _number(_parse(text, timeout), timeout)


def _parse(text: str, timeout: int) -> list:
    """math-verify's parse of `text` as one LaTeX formula, with e-notation made explicit, a
    subscripted E a symbol, and its letters read alike on every side (`_letters_read_alike`)."""
    latex = _SUBSCRIPTED_E.sub(r"\\mathsf{E}", _E_NOTATION.sub(r"\1\\times 10^{\2}", text))
    parsed = parse(f"${latex}$", parsing_timeout=timeout, raise_on_error=True)
    return [_letters_read_alike(item) if isinstance(item, sympy.Basic) else item for item in parsed]


def _letters_read_alike(expr: sympy.Basic) -> sympy.Basic:
    """`expr` with a standalone i as the imaginary unit and every other letter a real symbol.

    math-verify never reads i as the unit, and makes all the letters of a text complex symbols when
    it sees an i standing alone, real ones otherwise: "e^{2 i t}" and "e^{2it}" hold two different
    t's (and i's), "x_{i}" and "x_i" two different x_i's, so neither matches the other. Real is what
    math-verify reads in a text without i. Only a standalone i is the unit: a subscript is part of
    its symbol's name ("x_i", "v_{i}" are the symbols x_i, v_i) and a summation index is bound, not
    free; an i that was meant as a variable is read as the unit on both sides alike."""
    replacements = {}
    for symbol in expr.free_symbols:
        if isinstance(symbol, sympy.Symbol):
            alike = sympy.I if symbol.name == "i" else sympy.Symbol(symbol.name, real=True)
            if alike != symbol:
                replacements[symbol] = alike
    if not replacements:
        return expr
    if isinstance(expr, FiniteSet):  # its own `_unsorted_args` keep the duplicates a list may hold
        return FiniteSet(*(_letters_read_alike(element) for element in expr._unsorted_args))
    return expr.xreplace(replacements)


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


def _number(parsed: list, timeout: int) -> _Number | None:
    """The number a parsed answer is, or None when it is not a single number."""
    expr = next((item for item in parsed if isinstance(item, sympy.Basic)), None)
    if not isinstance(expr, sympy.Expr):
        return None
    with time_limit(timeout):
        if not expr.is_number:
            return None
        try:
            approx = complex(expr)
        except (TypeError, ValueError, OverflowError, ZeroDivisionError):
            return None
        if not (math.isfinite(approx.real) and math.isfinite(approx.imag)):
            return None
        return _Number(approx, _exact_parts(expr))


def _exact_parts(expr: sympy.Expr) -> tuple[sympy.Rational, sympy.Rational] | None:
    """The (real, imaginary) parts of a finite number as rationals, or None when it has none.

    math-verify's parse is unevaluated ("\\frac{4 \\cdot 999^{4}}{27}" stays a quotient, whose
    is_integer sympy leaves undecided); doit() evaluates it. Called only once the value is known to
    be finite, so a tower of powers is never expanded into its digits."""
    try:
        real, imaginary = expr.doit().as_real_imag()
    except Exception:  # what sympy cannot evaluate has no exact value; its float still counts
        return None
    return (real, imaginary) if real.is_Rational and imaginary.is_Rational else None


@contextmanager
def time_limit(seconds: int) -> Iterator[None]:
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
    if "_" in text:  # Python reads "52_8" as 528; in a math answer "_" is a subscript (a base)
        return None
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
