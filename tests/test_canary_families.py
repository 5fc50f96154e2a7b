"""The canary suite's families: every item follows its family's rules as read from its text alone, the
read positions the generator records are the ones a reader finds in the text, each family has the
dependency shape it is named for, the held-out splits are fixed and reach the harness through its
dataset path, and the training batches are exactly what the harness renders, held-out items left out."""

from __future__ import annotations

import re

import pytest
import torch
from helpers.canary import check_by_the_rules

from evals.canary import vocabulary
from evals.canary.families import FAMILIES, HELDOUT_SIZE, SuiteItem, heldout, heldout_rows, token_reads
from evals.canary.suite_batches import heldout_mask, suite_batches
from evals.canary.task import CanaryTask
from evals.datasets import Item, load, registry_spec
from evals.prompts import build_messages, render_prompt
from longflow.errors import UserError

TOKENIZER = vocabulary.build_suite()
SPLITS = {family: heldout(family) for family in FAMILIES}
MENTION = re.compile(r"\b([a-z])=(\d+)")
LINE = re.compile(r"(\d+): ([a-z])=(\d+), ([a-z])=(\d+) -> ([a-z])=(\d+)")
INDICES = [0, 1, 7, 42, 199]


def lines_of(question: str, output: str) -> tuple[int, list[str], str]:
    steps = int(re.search(r"Steps: (\d+)\.", question)[1])
    assert output.startswith("<think>\n")
    thinking, answer = output[len("<think>\n"):].split("</think>\n\n")
    lines = thinking.splitlines()
    assert len(lines) == steps
    return steps, lines, answer


def check_sum_lines(question: str, output: str, operands) -> int:
    """The canary's line rules with the operands `operands(line, countdown)` -> (left, right, target)
    gives; every value read is the latest "name=value" of the text so far. Returns the boxed answer."""
    steps, lines, answer = lines_of(question, output)
    text, result = question, None
    for line_index, (countdown, line) in enumerate(zip(range(steps, 0, -1), lines, strict=True)):
        match = LINE.fullmatch(line)
        assert match, line
        number, left, left_value, right, right_value, target, result = match.groups()
        latest = dict(MENTION.findall(text))
        assert int(number) == countdown
        assert (left, right, target) == operands(line_index, countdown)
        assert (left_value, right_value) == (latest[left], latest[right])
        assert int(result) == (int(left_value) + int(right_value)) % 23
        text += "\n" + line
    assert answer == f"\\boxed{{{result}}}"
    return int(result)


def rotation(index: int) -> tuple[str, str, str]:
    """The chain as the family's text states it: a, b, c, d in turn, each line reading the next two."""
    return "abcd"[(index + 1) % 4], "abcd"[(index + 2) % 4], "abcd"[index % 4]


def check_lookup(question: str, output: str) -> int:
    table = {int(key): int(value) for key, value in re.findall(r"(\d+)=(\d+)", question.split(". Start")[0])}
    assert sorted(table) == list(range(23)) and sorted(table.values()) == list(range(23))
    key, total = (int(value) for value in re.search(r"Start: (\d+), z=(\d+)\.", question).groups())
    cycle, entry = [], key
    for _ in range(23):
        cycle.append(entry)
        entry = table[entry]
    assert sorted(cycle) == list(range(23)), "the table is one cycle through every entry"
    steps, lines, answer = lines_of(question, output)
    for countdown, line in zip(range(steps, 0, -1), lines, strict=True):
        match = re.fullmatch(r"(\d+): (\d+)=(\d+), z=(\d+) -> z=(\d+)", line)
        assert match, line
        number, current, value, before, after = (int(group) for group in match.groups())
        assert (number, current, value, before) == (countdown, key, table[key], total)
        assert after == (total + value) % 23
        key, total = value, after
    assert answer == f"\\boxed{{{total}}}"
    return total


def plan_operands(index: int, countdown: int) -> tuple[str, str, str]:
    if index < 4:  # the plan: w = e + f, x = g + h, y = i + j, z = k + l
        return "efghijkl"[2 * index], "efghijkl"[2 * index + 1], "wxyz"[index]
    left, right, target = rotation(index - 4)
    return (left, "wxyz"[(countdown // 6) % 4], target) if countdown % 6 == 0 else (left, right, target)


def redundant_operands(index: int, countdown: int) -> tuple[str, str, str]:
    if index == 0:
        return "e", "f", "s"
    left, right, target = rotation(index - 1)
    return (left, "s", target) if index <= 4 or countdown == 1 else (left, right, target)


RULES = {
    "state": lambda question, output: check_by_the_rules(CanaryTask(), question, output),
    "lookup": check_lookup,
    "plan": lambda question, output: check_sum_lines(question, output, plan_operands),
    "redundant": lambda question, output: check_sum_lines(question, output, redundant_operands),
    "chain": lambda question, output: check_sum_lines(question, output, lambda index, _: rotation(index)),
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("index", INDICES)
def test_heldout_items_follow_their_rules(family, index):
    item = SPLITS[family][index]
    assert RULES[family](item.question(), item.output()) == item.answer


def test_state_family_is_the_canary():
    canary = CanaryTask().heldout()
    for item, program in zip(SPLITS["state"], canary, strict=True):
        assert (item.question(), item.output(), item.answer) == (program.question(), program.output(), program.answer)


def text_reads(family: str, question: str, output: str) -> list[tuple[str, int, list[int]]]:
    """Reads found in the text, independently of the generator: (value, character offset in
    question + output of the token that needs it, offsets of every earlier copy of that value).

    A copy of a value is a mention of its name since the name's last write (a prompt value, the
    third mention of a line). Each line copies two values (lookup: its number, the entry, z), its
    result needs the two values it sums (any copy, the line's own included), and in the state family
    the first name needs the previous result (the prompt's start, then each line's result)."""
    base = len(question)
    copies: dict[str, list[int]] = {}
    reads = []
    if family == "lookup":
        for match in re.finditer(r"(\d+)=(\d+)", question.split(". Start")[0]):
            copies[match.group(1)] = [match.start(2)]
        header = re.search(r"Start: (\d+), z=(\d+)\.", question)
        copies["key"], copies["z"] = [header.start(1)], [header.start(2)]
        for match in re.finditer(r"\d+: (\d+)=(\d+), z=(\d+) -> z=(\d+)", output):
            key, entry, before, after = (base + match.start(group) for group in range(1, 5))
            reads.append((match.group(1), key, list(copies["key"])))
            reads.append((match.group(2), entry, list(copies[match.group(1)])))
            copies[match.group(1)].append(entry)
            copies["key"] = [entry]
            reads.append((match.group(3), before, list(copies["z"])))
            copies["z"].append(before)
            reads.append((match.group(2), after, list(copies[match.group(1)])))
            reads.append((match.group(3), after, list(copies["z"])))
            copies["z"] = [after]
        return reads
    for match in MENTION.finditer(question):
        copies[match.group(1)] = [match.start(2)]
    previous = re.search(r"Start: (\d+)\.", question)
    previous = (previous.group(1), previous.start(1)) if previous else None
    for match in LINE.finditer(output):
        _, left, left_value, right, right_value, target, result = match.groups()
        if family == "state":
            reads.append((previous[0], base + match.start(2), [previous[1]]))
        for name, value, group in ((left, left_value, 3), (right, right_value, 5)):
            reads.append((value, base + match.start(group), list(copies[name])))
            copies[name].append(base + match.start(group))
        for name, value in ((left, left_value), (right, right_value)):
            reads.append((value, base + match.start(7), list(copies[name])))
        copies[target] = [base + match.start(7)]
        previous = (result, base + match.start(7))
    return reads


@pytest.mark.parametrize("family", FAMILIES)
def test_read_positions_match_the_text(family):
    """The generator's token positions of every read and of its copies against the reads a reader
    finds in the text, mapped to tokens by the tokenizer's offsets; every copy's token is the value."""
    for item in SPLITS[family][:6]:
        prompt = TOKENIZER.decode(render_prompt(TOKENIZER, build_messages(Item("x", item.question(), "0"), "math"),
                                                thinking=True))
        at = prompt.index(item.question())
        offsets = TOKENIZER(prompt + item.output(), add_special_tokens=False,
                            return_offsets_mapping=True)["offset_mapping"]
        token_at = {start: index for index, (start, _) in enumerate(offsets)}
        output_start = token_at[len(prompt)]
        ids = TOKENIZER(prompt + item.output(), add_special_tokens=False)["input_ids"]

        question = len(item.question())
        # An offset of question + output -> its token in the rendered prompt + output.
        token = {offset: token_at[at + offset if offset < question else len(prompt) + offset - question]
                 for offset in range(question + len(item.output())) if
                 (at + offset if offset < question else len(prompt) + offset - question) in token_at}.__getitem__
        expected = [(token(offset) - output_start, tuple(token(c) for c in copies))
                    for _, offset, copies in text_reads(family, item.question(), item.output())]
        found = token_reads(item, prompt, TOKENIZER)
        assert found == expected
        for (value, _, _), (_, copies) in zip(text_reads(family, item.question(), item.output()), found,
                                                    strict=True):
            assert all(TOKENIZER.decode([ids[c]]) == value for c in copies)


def distances(family: str) -> list[list[tuple[int, int]]]:
    """Per item: every read's (output index, token distance back to its nearest copy before the
    line it is in: for an operand, the line's own copy is 0-7 tokens back)."""
    result = []
    for item in SPLITS[family]:
        prompt = TOKENIZER.decode(render_prompt(TOKENIZER, build_messages(Item("x", item.question(), "0"), "math"),
                                                thinking=True))
        prompt_len = len(TOKENIZER(prompt, add_special_tokens=False)["input_ids"])
        result.append([(at, prompt_len + at - max(copies)) for at, copies in token_reads(item, prompt, TOKENIZER)])
    return result


def test_each_family_has_its_dependency_shape():
    """Chain: every read past the first two lines within two lines (38 tokens). Lookup: a table read
    reaches the prompt or a copy 23 lines (437 tokens) back. Plan: plan values read from far back, most 192+ tokens.
    Redundant: the last line's read of s reaches back to the first five lines. State: the canary's
    mix (some reads 192+ back)."""
    chain = [d for item in distances("chain") for index, (_, d) in enumerate(item) if index >= 8]
    assert max(chain) <= 38
    lookup_items = distances("lookup")
    assert all(d >= 19 * 23 - 2 for item, split in zip(lookup_items, SPLITS["lookup"], strict=True)
               for (at, d), read in zip(item, split.reads, strict=True)
               if read.kind == "copy" and read.key not in ("key", "z") and at > 19 * 23 + 2)
    plan_reads = [d for item, split in zip(distances("plan"), SPLITS["plan"], strict=True)
                  for (at, d), read in zip(item, split.reads, strict=True)
                  if read.key in "wxyz" and read.kind == "copy"]
    assert sorted(plan_reads)[len(plan_reads) // 2] >= 300 and sum(d >= 192 for d in plan_reads) > 0.6 * len(plan_reads)
    for item, split in zip(distances("redundant"), SPLITS["redundant"], strict=True):
        last = split.reads[-3]  # the last line's copy of s (its result's two operands follow)
        assert last.key == "s" and len(last.sources) == 5 and item[-3][1] >= 19 * (split.steps - 6)
    assert sum(d >= 192 for item in distances("state") for _, d in item) >= 100


def test_heldout_splits_are_fixed_and_distinct():
    for family in FAMILIES:
        assert heldout(family) == SPLITS[family]
        assert heldout(family, 10) == SPLITS[family][:10]
        assert len({item.params for item in SPLITS[family]}) == HELDOUT_SIZE
        assert all(10 <= item.steps <= 84 for item in SPLITS[family])


@pytest.mark.parametrize("family", FAMILIES)
def test_output_lengths_are_the_canarys(family):
    lengths = [len(TOKENIZER(item.output(), add_special_tokens=False)["input_ids"]) + 1 for item in SPLITS[family]]
    assert all(length == 19 * item.steps + 9 for length, item in zip(lengths, SPLITS[family], strict=True))
    assert sum(lengths) / len(lengths) >= 550 and max(lengths) > 1400


def test_dataset_path_generates_the_heldout_splits():
    for family in FAMILIES:
        items = load(registry_spec(f"canary_{family}"))
        assert len(items) == HELDOUT_SIZE
        item = SPLITS[family][3]
        assert items[3] == Item(id=f"{family}-3", question=item.question(), gold=str(item.answer))
    assert load(registry_spec("canary_lookup", generator_args={"family": "lookup", "size": 5})) == \
        load(registry_spec("canary_lookup"))[:5]
    assert heldout_rows("chain", 2)[1]["index"] == "chain-1"
    with pytest.raises(UserError, match="canary family"):
        load(registry_spec("canary_chain", generator_args={"family": "nothing"}))


def test_the_suite_tokenizer_keeps_the_canarys_ids():
    canary = vocabulary.build()
    text = render_prompt(canary, build_messages(Item("x", CanaryTask().heldout(1)[0].question(), "0"), "math"),
                         thinking=True)
    assert render_prompt(TOKENIZER, build_messages(Item("x", CanaryTask().heldout(1)[0].question(), "0"), "math"),
                         thinking=True) == text
    output = CanaryTask().heldout(1)[0].output()
    assert TOKENIZER(output)["input_ids"] == canary(output)["input_ids"]


@pytest.mark.parametrize("family", FAMILIES)
def test_training_batches_are_the_rendered_items(family):
    batches = suite_batches(TOKENIZER, torch.device("cpu"))[family]
    generator = torch.Generator().manual_seed(0)
    for steps in (8, 23, 90):
        params = batches.draw(generator, 3, steps)
        for row, values in zip(batches.tokens(params).tolist(), params.tolist(), strict=True):
            item = SuiteItem(family, tuple(values))
            prompt = render_prompt(TOKENIZER, build_messages(Item("x", item.question(), str(item.answer)), "math"),
                                   thinking=True)
            output = TOKENIZER(item.output(), add_special_tokens=False)["input_ids"] + [TOKENIZER.eos_token_id]
            assert row == prompt + output
    if family == "lookup":  # the device draws one cycle through all 23 entries, as the generator does
        successor = batches.draw(generator, 64, 10)[:, :23]
        entry = successor[:, 0].clone()
        seen = torch.zeros(64, 23, dtype=torch.bool)
        for _ in range(23):
            seen.scatter_(1, entry[:, None], True)
            entry = successor.gather(1, entry[:, None])[:, 0]
        assert seen.all()


def test_training_leaves_heldout_items_out():
    for family, batches in suite_batches(TOKENIZER, torch.device("cpu")).items():
        heldout_params = batches.heldout
        params = batches.draw(torch.Generator().manual_seed(1), 4, int(heldout_params[17, -1]))
        params[2] = heldout_params[17]
        assert heldout_mask(params, heldout_params).tolist() == [False, False, True, False], family
