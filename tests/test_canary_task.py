"""The canary task: items follow its rules as read from their text alone, the held-out split is fixed and
long, the training batches are exactly what the harness renders, and training never sees a held-out item."""

from __future__ import annotations

import statistics

import pytest
import torch
from helpers.canary import check_by_the_rules

from evals.canary import vocabulary
from evals.canary.batches import Batches, heldout_mask, heldout_programs
from evals.canary.task import HELDOUT_SIZE, CanaryTask, Program, heldout_rows, reach_in_tokens
from evals.datasets import Item, fingerprint, load, registry_spec
from evals.prompts import build_messages, render_prompt
from longflow.errors import UserError

TASK = CanaryTask()
HELDOUT = TASK.heldout()
@pytest.mark.parametrize("index", [0, 1, 7, 42, 199])
def test_heldout_items_follow_the_rules(index):
    program = HELDOUT[index]
    assert check_by_the_rules(TASK, program.question(), program.output()) == program.answer


@pytest.mark.parametrize("knobs", [dict(variables=4, min_steps=1, max_steps=3), dict(variables=26, modulus=11)])
def test_other_knobs_follow_the_rules(knobs):
    task = CanaryTask(**knobs)
    for program in task.heldout(20):
        assert check_by_the_rules(task, program.question(), program.output()) == program.answer
        assert task.min_steps <= program.steps <= task.max_steps


def test_heldout_split_is_fixed():
    assert CanaryTask().heldout() == HELDOUT
    assert CanaryTask().heldout(10) == HELDOUT[:10]
    assert len({(p.initial, p.start, p.steps) for p in HELDOUT}) == HELDOUT_SIZE
    assert CanaryTask(variables=12).heldout(5)[0].initial != HELDOUT[0].initial


def test_default_difficulty_is_long_with_a_tail():
    """The issue's default difficulty: mean output >= 600 tokens, a tail past 1500 (canary tokenizer)."""
    tokenizer = vocabulary.build()
    lengths = [len(tokenizer(p.output(), add_special_tokens=False)["input_ids"]) + 1 for p in HELDOUT]  # + EOS
    assert statistics.mean(lengths) >= 600
    assert sum(length > 1500 for length in lengths) >= 3
    assert all(length == 19 * p.steps + 9 for length, p in zip(lengths, HELDOUT, strict=True))


def test_operands_reach_back_into_the_output_and_the_prompt():
    """Reads need tokens that recency does not keep: a tenth of them take a value still in the prompt
    (some after line 10, 200+ tokens into the output), and some a value written 10+ lines back."""
    reach = [distance for program in HELDOUT for distance in program.reach()]
    lines = [d for d in reach if d is not None]
    assert (len(reach) - len(lines)) / len(reach) > 0.1
    assert sum(d >= 10 for d in lines) >= 30 and max(lines) >= 15
    late_prompt_reads = sum(
        1 for p in HELDOUT for position, d in enumerate(p.reach()) if d is None and position // 2 >= 10)
    assert late_prompt_reads >= 20


def test_dataset_path_generates_the_heldout_split():
    items = load(registry_spec("canary"))
    assert len(items) == HELDOUT_SIZE
    assert items[3] == Item(id="canary-3", question=HELDOUT[3].question(), gold=str(HELDOUT[3].answer))
    small = load(registry_spec("canary", generator_args={"size": 5}))
    assert small == items[:5]
    assert fingerprint(load(registry_spec("canary", generator_args={"variables": 8}))) != fingerprint(items)
    assert heldout_rows(2)[1]["index"] == "canary-1"
    short = load(registry_spec("canary", generator_args={"size": 4, "steps_at_most": 20}))
    assert [item.id for item in short] == [f"canary-{i}" for i, p in enumerate(HELDOUT) if p.steps <= 20][:4]
    assert all(item in items for item in short)


@pytest.mark.parametrize("settings,message", [
    (dict(generator="evals.canary.task:nothing"), "cannot import generator"),
    (dict(generator="no colon"), "module:function"),
    (dict(generator_args={"colour": 1}), "generator_args"),
    (dict(generator_args={"variables": 99}), "canary variables"),
])
def test_generator_errors_are_user_errors(settings, message):
    with pytest.raises(UserError, match=message):
        load(registry_spec("canary", **settings))


def test_training_batches_are_the_rendered_items():
    """The training script builds token ids on the device; they must be what the harness feeds the model:
    the chat-rendered prompt, then the reference output and the end of turn."""
    tokenizer = vocabulary.build()
    batches = Batches(TASK, tokenizer, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    for steps in (1, 9, 90):
        programs = batches.programs(generator, 3, steps)
        for row, values in zip(batches.tokens(programs).tolist(), programs.tolist(), strict=True):
            program = Program(TASK, tuple(values[:TASK.variables]), values[TASK.variables], values[-1])
            item = Item("x", program.question(), str(program.answer))
            prompt = render_prompt(tokenizer, build_messages(item, "math"), thinking=True)
            output = tokenizer(program.output(), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            assert row == prompt + output


def test_training_leaves_heldout_programs_out():
    heldout = heldout_programs(TASK, HELDOUT_SIZE, torch.device("cpu"))
    batches = Batches(TASK, vocabulary.build(), torch.device("cpu"))
    programs = batches.programs(torch.Generator().manual_seed(1), 6, int(heldout[17, -1]))
    programs[4] = heldout[17]
    assert heldout_mask(programs, heldout).tolist() == [False] * 4 + [True, False]


def test_reach_in_tokens_agrees_with_the_trace():
    """The token-level reach, read off the text, against the line distances of the executed trace."""
    tokenizer = vocabulary.build()
    for program in HELDOUT[:20]:
        prompt = tokenizer.decode(render_prompt(tokenizer, build_messages(Item("x", program.question(), "0"), "math"),
                                                thinking=True))
        tokens = reach_in_tokens(prompt, program.output(), tokenizer)
        lines = program.reach()
        assert len(tokens) == len(lines) == 2 * program.steps
        for in_tokens, in_lines in zip(tokens, lines, strict=True):
            if in_lines is None:
                assert in_tokens > 0
            else:
                assert 19 * (in_lines - 1) < in_tokens < 19 * (in_lines + 1)
