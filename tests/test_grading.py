"""Grading: every trap of PROTOCOL.md on the real golds it comes from, thinking and truncation, GPQA
letters, the gold self-check over every math set, and worker processes under a hard time limit."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from functools import cache
from pathlib import Path

import pytest
from math_verify import parse, verify

from evals import grading
from evals.grading import Grade, GradeRequest, boxed_contents, extract_choice, grade, grade_many

MATH_SETS = ("aime24", "aime25", "amc", "gsm8k", "math500", "minerva", "olympiad")
# A box whose comparison runs for ever unless interrupted: sympy works on a tower of powers.
HANG = "</think>\\boxed{9^{9^{9^{9}}}}"


@cache
def _golds(root: Path, name: str) -> dict[int, str]:
    with (root / f"{name}.jsonl").open(encoding="utf-8") as handle:
        return {row["index"]: row["true_answer"] for row in map(json.loads, handle)}


@pytest.fixture
def gold(data_root):
    """gold(name, index, expected): the benchmark's gold, checked to be the one the test means."""

    def lookup(name: str, index: int, expected: str) -> str:
        value = _golds(data_root, name)[index]
        assert value == expected, f"{name}[{index}] is {value!r}, not {expected!r}: update the test"
        return value

    return lookup


def boxed(answer: str, before: str = "Some thinking.</think>The answer is ") -> str:
    return f"{before}\\boxed{{{answer}}}."


def math_grade(output: str, gold_text: str, **kwargs) -> Grade:
    return grade("math", output, gold_text, **kwargs)


# --- PROTOCOL.md traps, on real golds -------------------------------------------------------------


@pytest.mark.parametrize("pred, correct", [
    ("4.5 \\times 10^{33}", True), ("4.5e33", True), ("4.5 \\cdot 10^{33}", True),
    ("4.6 \\times 10^{33}", False),
])
def test_e_notation_is_not_eulers_e(gold, pred, correct):
    gold_text = gold("minerva", 1, "4.5e33")
    assert verify(parse("$4.5e33$"), parse("$4.5 \\times 10^{33}$")) is False  # the trap itself
    assert math_grade(boxed(pred), gold_text).correct is correct


@pytest.mark.parametrize("index, gold_text, pred, correct", [
    (179, "7.4e-12", "0.0", False),
    (156, "1.77e-6", "0.0000017", False),
    (156, "1.77e-6", "0.00000177", True),
    (264, "2.88e-19", "3 \\times 10^{-19}", False),
    (264, "2.88e-19", "2.88 \\times 10^{-19}", True),
    (40, "0.5613", "0.56131", True),
    (40, "0.5613", "0.5614", False),
])
def test_tiny_magnitudes_need_relative_tolerance(gold, index, gold_text, pred, correct):
    gold_text = gold("minerva", index, gold_text)
    if index == 179:  # math-verify alone rounds both to 0 at 6 decimals
        assert verify(parse("$7.4 \\times 10^{-12}$"), parse("$0.0$")) is True
    assert math_grade(boxed(pred), gold_text).correct is correct


@pytest.mark.parametrize("name, index, gold_text, pred", [
    ("math500", 198, "10,\\!080", "10080"),
    ("math500", 198, "10,\\!080", "10\\,080"),
    ("math500", 242, "\\$32,\\!348", "32,348"),
    ("math500", 242, "\\$32,\\!348", "\\$32\\,348"),
    ("gsm8k", 611, "1,450,000", "1450000"),
    ("gsm8k", 611, "1,450,000", "1\\,450\\,000"),
    ("gsm8k", 146, "2,125", "2{,}125"),
])
def test_thousands_separators(gold, name, index, gold_text, pred):
    gold_text = gold(name, index, gold_text)
    assert math_grade(boxed(pred), gold_text).correct
    assert not math_grade(boxed("1001"), gold_text).correct


def test_thin_space_thousands_in_the_gold():
    # No benchmark gold is written "70\,000"; MATH writes "10,\!080" (above).
    assert math_grade(boxed("70000"), "70\\,000").correct
    assert not math_grade(boxed("70"), "70\\,000").correct


def test_the_last_of_two_close_boxes_is_the_answer(gold):
    gold_text = gold("aime24", 0, "204")
    assert parse("\\boxed{204} \\boxed{205}")[0] == 204205  # math-verify merges them
    result = math_grade("</think>First \\boxed{205}, no: \\boxed{204}", gold_text)
    assert result == Grade(True, "204", "correct")
    assert math_grade("</think>\\boxed{204} \\boxed{205}", gold_text) == Grade(False, "205", "mismatch")


@pytest.mark.parametrize("output, correct", [
    (boxed("(2,7,13), (1,8,19), (4,5,7)"), True),
    (boxed("(1,8,19),(2,7,13),(4,5,7)"), True),
    (boxed("(1,8,19), (2,7,13)"), False),
    ("</think>So \\boxed{(1,8,19)}, \\boxed{(2,7,13)} and \\boxed{(4,5,7)}.", True),
    ("</think>So \\boxed{(1,8,19)} and \\boxed{(2,7,13)}.", False),
])
def test_olympiad_multi_answer_golds_are_lists(gold, output, correct):
    assert math_grade(output, gold("olympiad", 5, "$(1,8,19), (2,7,13), (4,5,7)$")).correct is correct


@pytest.mark.parametrize("pred, correct", [("69, 84", True), ("84,69", True), ("84", False)])
def test_olympiad_dollar_separated_answers(gold, pred, correct):
    assert math_grade(boxed(pred), gold("olympiad", 13, "$69$,$84$")).correct is correct


def test_olympiad_list_is_not_a_thousands_number(gold):
    gold_text = gold("olympiad", 87, "2500,7500")
    assert math_grade(boxed("7500, 2500"), gold_text).correct
    assert not math_grade(boxed("2500"), gold_text).correct


@pytest.mark.parametrize("pred, correct", [("25", True), ("025", True), ("25.0", True), ("250", False)])
def test_aime_zero_padding(gold, pred, correct):
    assert math_grade(boxed(pred), gold("aime24", 7, "025")).correct is correct


@pytest.mark.parametrize("pred, correct", [
    ("27", True), ("27.0", True), ("\\frac{54}{2}", True), ("27.5", False), ("27.001", False),
])
def test_amc_floats_are_integers(gold, pred, correct):
    assert math_grade(boxed(pred), gold("amc", 0, "27.0")).correct is correct


@pytest.mark.parametrize("pred, correct", [
    ("\\text{Evelyn}", True), ("Evelyn", True), ("\\text{Bob}", False),
])
def test_text_answers(gold, pred, correct):
    assert math_grade(boxed(pred), gold("math500", 4, "\\text{Evelyn}")).correct is correct


@pytest.mark.parametrize("pred, correct", [
    ("90", True), ("90^\\circ", True), ("90^{\\circ}", True), ("45", False),
])
def test_degrees(gold, pred, correct):
    assert math_grade(boxed(pred), gold("math500", 7, "90^\\circ")).correct is correct


def test_latex_tuple(gold):
    gold_text = gold("math500", 0, "\\left( 3, \\frac{\\pi}{2} \\right)")
    assert math_grade(boxed("(3, \\frac{\\pi}{2})"), gold_text).correct
    assert not math_grade(boxed("(3, \\pi)"), gold_text).correct


@pytest.mark.parametrize("index, gold_text, pred, correct", [
    (5, "np.arcsin(10/13)", "\\arcsin\\left(\\frac{10}{13}\\right)", True),
    (5, "np.arcsin(10/13)", "0.8776", True),
    (5, "np.arcsin(10/13)", "0.88", False),
    (38, "-1./3", "-\\frac{1}{3}", True),
    (38, "-1./3", "-1", False),
])
def test_python_ish_minerva_golds_are_evaluated(gold, index, gold_text, pred, correct):
    assert math_grade(boxed(pred), gold("minerva", index, gold_text)).correct is correct


def test_percent_golds(gold):
    gold_text = gold("olympiad", 139, "62.5%")
    assert math_grade(boxed("62.5\\%"), gold_text).correct
    assert math_grade(boxed("62.5"), gold_text).correct


def test_golds_cut_short_in_the_math500_file_are_repaired(gold):
    gold_text = gold("math500", 35, "3} \\pmod{7")
    assert math_grade(boxed("3"), gold_text).correct
    assert not math_grade(boxed("4"), gold_text).correct


def test_symbolic_gold_rejects_a_decimal_approximation():
    assert not math_grade(boxed("4.6667"), "\\frac{14}{3}").correct
    assert math_grade(boxed("\\dfrac{14}{3}"), "\\frac{14}{3}").correct


# --- the gold self-check --------------------------------------------------------------------------

SAMPLE_STEP = {"aime24": 1, "aime25": 1, "amc": 1, "gsm8k": 10, "math500": 3, "minerva": 3, "olympiad": 3}


@pytest.mark.parametrize("name", MATH_SETS)
def test_golds_verify_against_themselves(data_root, name):
    """A boxed gold must grade correct against itself: catches golds that do not survive box
    extraction or parsing. All golds pass; the sample keeps the suite fast."""
    golds = _golds(data_root, name)
    failures = {index: (text, result) for index, text in list(golds.items())[::SAMPLE_STEP[name]]
                if not (result := math_grade(f"</think> ... \\boxed{{{text}}}", text)).correct}
    assert not failures


# --- thinking, truncation, extraction ---------------------------------------------------------------


def test_truncated_output_is_wrong_even_with_a_right_box():
    assert math_grade(boxed("204"), "204", finish_reason="length") == Grade(False, None, "truncated")


def test_unclosed_thinking_is_wrong():
    assert math_grade("Thinking... \\boxed{204} is it", "204") == Grade(False, None, "unclosed_think")


def test_only_the_text_after_the_last_think_close_counts():
    assert math_grade("\\boxed{204}</think>no box here", "204").reason == "no_box"
    assert math_grade("a</think>b</think>\\boxed{204}", "204").correct


def test_without_thinking_the_whole_output_counts():
    assert math_grade("\\boxed{204}", "204", thinks=False).correct


def test_no_box():
    assert math_grade("</think>The answer is 204.", "204") == Grade(False, None, "no_box")


def test_boxed_contents_matches_braces():
    text = "\\boxed{\\frac{1}{2}} \\fbox{7} \\boxed{\\{1,2\\}} \\boxed{\\boxed{5}} \\boxed{cut {"
    assert boxed_contents(text) == ["\\frac{1}{2}", "7", "\\{1,2\\}", "\\boxed{5}"]


@pytest.mark.parametrize("text, letter", [
    ("Answer: C", "C"), ("**Answer:** B", "B"), ("**Answer: B**", "B"), ("Answer: $D$", "D"),
    ("the answer is A.", "A"), ("The correct answer is (B)", "B"), ("\\boxed{C}", "C"),
    ("\\boxed{\\text{D}}", "D"), ("Final Answer: \\boxed{A}", "A"), ("so it must be (C).", "C"),
    ("Answer: A\nWait, no.\nAnswer: B", "B"), ("(A) fails, so \\boxed{D}; (B) too", "D"),
    ("I cannot tell.", None), ("answer: c", None),
])
def test_gpqa_letter_formats(text, letter):
    assert extract_choice(text) == letter


def test_gpqa_grades_after_thinking():
    assert grade("gpqa", "Answer: A</think>Answer: B", "B") == Grade(True, "B", "correct")
    assert grade("gpqa", "Answer: A</think>Answer: B", "A") == Grade(False, "B", "mismatch")
    assert grade("gpqa", "Answer: A</think>I do not know", "A") == Grade(False, None, "no_answer")
    assert grade("gpqa", "Answer: A", "A").reason == "unclosed_think"


def test_bad_arguments():
    with pytest.raises(ValueError, match="int"):
        math_grade(boxed("1"), "1", timeout=2.5)
    with pytest.raises(ValueError, match="dataset_kind"):
        grade("code", "x", "1")


def test_grade_refuses_a_thread_that_cannot_take_signals():
    errors = []
    thread = threading.Thread(target=lambda: errors.append(pytest.raises(RuntimeError, math_grade,
                                                                         boxed("1"), "1")))
    thread.start()
    thread.join()
    assert errors and "main thread" in str(errors[0].value)


# --- timeouts and worker processes ----------------------------------------------------------------


def test_a_slow_comparison_times_out_in_process():
    start = time.monotonic()
    assert math_grade(HANG, "5", timeout=1) == Grade(False, "9^{9^{9^{9}}}", "timeout")
    assert time.monotonic() - start < 5


def test_grade_many_keeps_order_and_survives_a_slow_item():
    requests = [
        GradeRequest("math", boxed("204"), "204"),
        GradeRequest("math", HANG, "5"),
        GradeRequest("gpqa", "</think>Answer: C", "C"),
        GradeRequest("math", boxed("7"), "8"),
        GradeRequest("math", boxed("7"), "7", finish_reason="length"),
        GradeRequest("math", "\\boxed{7}", "7", thinks=False),
    ]
    start = time.monotonic()
    results = grade_many(requests, workers=2, timeout=2)
    assert [result.reason for result in results] == ["correct", "timeout", "correct", "mismatch", "truncated",
                                                      "correct"]
    assert time.monotonic() - start < 20  # start-up of the fork server included
    assert grade_many([]) == []


def stop_first_worker(monkeypatch, sig: signal.Signals) -> list[int]:
    """Make the first grading process unable to answer: SIGSTOP freezes it the way work that ignores
    signals would (its own alarm cannot fire), SIGKILL kills it."""
    pids = []
    start_worker = grading._Worker.__init__

    def start_and_signal(worker, timeout):
        start_worker(worker, timeout)
        pids.append(worker.process.pid)
        if len(pids) == 1:
            os.kill(worker.process.pid, sig)

    monkeypatch.setattr(grading._Worker, "__init__", start_and_signal)
    return pids


def test_a_hung_worker_is_killed_and_replaced(monkeypatch):
    pids = stop_first_worker(monkeypatch, signal.SIGSTOP)
    requests = [GradeRequest("math", boxed(str(n)), str(n)) for n in range(4)]
    start = time.monotonic()
    results = grade_many(requests, workers=1, timeout=2)
    assert [result.reason for result in results] == ["timeout", "correct", "correct", "correct"]
    assert 2 <= time.monotonic() - start < 20
    assert len(pids) == 2  # the frozen worker and its replacement
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)  # killed and reaped


def test_a_dead_worker_costs_its_item_an_error(monkeypatch):
    pids = stop_first_worker(monkeypatch, signal.SIGKILL)
    requests = [GradeRequest("math", boxed(str(n)), str(n)) for n in range(3)]
    assert [result.reason for result in grade_many(requests, workers=1, timeout=5)] == ["error", "correct",
                                                                                        "correct"]
    assert len(pids) == 2
