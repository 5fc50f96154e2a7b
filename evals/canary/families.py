"""The canary suite: five task families, each a shape of dependency that reasoning traces mix.

Every family is a program that the chain of thought executes, one line per step, counting down from
the prompt's step count to 1, then boxes the last result; values are mod 23 and every number and
name is one token (the suite tokenizer, `vocabulary.build_suite`). Four families write the canary's
line, `k: x=3, y=17 -> z=20` (read the latest values of x and y, write their sum to z); the families
differ in which variables a line reads, and so in where the tokens it needs sit:

  state      today's canary (`evals.canary.task`, same items): the previous result picks the
             variables through a table the model learnt; 20 variables, read anywhere back.
  lookup     pointer chasing through a table in the prompt, read throughout the output:
             `Lookup: 0=14, 1=7, ...` maps each of the numbers 0-22 to another (one cycle through
             all 23); a line reads the current number's entry and adds it to z, `k: 5=14, z=12 ->
             z=3`, and the entry is the next line's number. An entry is read again only 23 lines
             (437 tokens) later, so every read of the table takes its value from the prompt or
             from a copy 437 tokens back.
  plan       an early plan in the output, consulted at intervals: the first four lines compute
             the plan w, x, y, z from the prompt, then a local chain over a, b, c, d takes a plan
             value in every line whose countdown is a multiple of 6 (w, x, y, z in turn), so each
             plan value is read every 24 lines (456 tokens).
  redundant  an early result restated and re-checked, the answer needing it: the first line
             computes s, the next four lines read it (four copies, early), then a local chain;
             the last line reads s again, from any of its five early copies.
  chain      local computation only: a, b, c, d in rotation, each line reading the two values
             written one and two lines before (recency suffices).

Read positions: for every read of every line, the generator records where the value it needs sits:
every mention of the variable since its last write (the write included, or the prompt's if it was
never written), each a copy of the same value, any of which will do (`Read.sources`). A line reads
when it copies a value (`x=3`), when its result sums the two values (the line's own copies or any
earlier one), and, in the state family, when its first name follows from the previous result. Offsets are
characters of the question or of the output; `token_reads` maps them to token positions of the
rendered prompt and the output.

Held-out splits: 200 items per family, item i from its own seed string (the state family's are the
canary's held-out items); training draws from another generator and leaves these out
(`evals.canary.suite_batches`); `training_rows` gives dataset rows of items outside them. Output
lengths: 10 to 84 steps, log-uniform as the canary's: 199 to 1605 tokens (every family's line is 19
tokens).
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from functools import cached_property

from evals.canary.task import NAMES, CanaryTask
from longflow.errors import UserError

FAMILIES = ("state", "lookup", "plan", "redundant", "chain")
HELDOUT_SIZE = 200
MODULUS = 23
MIN_STEPS, MAX_STEPS = 10, 84
TAGS = {"lookup": "Lookup", "plan": "Plan", "redundant": "Check", "chain": "Chain"}
# Prompt variables of each family: the lookup table's entries, the plan's inputs (a-d start the
# chain, e-l make the plan), the redundant family's (a-d the chain, e and f make s), the chain's.
VARIABLES = {"state": 20, "lookup": MODULUS, "plan": 12, "redundant": 6, "chain": 4}
PLAN = "wxyz"
PLAN_LINES = 4  # lines that compute the plan
PLAN_EVERY = 6  # a chain line whose countdown is a multiple of this reads the plan (every item has one)
RESTATEMENTS = 4  # lines after the first that read s
ROTATION = 4  # the chain's variables: a, b, c, d


@dataclass(frozen=True)
class Read:
    """One value a token of a line needs: `key` (a variable, lookup's entry "5", "key", lookup's current
    entry, or "previous", the state family's previous result), `value` (its text), `at` (offset in
    the output of the token that needs it), `sources` (offsets of every earlier token holding it:
    ("question" | "output", offset)) and `kind`: "copy" (the token writes the value again, `x=3`),
    "operand" (the line's result sums it: the line's own copy or any earlier one will do) or
    "choice" (the state family's names, picked by the previous result)."""

    key: str
    value: str
    at: int
    sources: tuple[tuple[str, int], ...]
    kind: str = "copy"


class Text:
    """A question, then an output, written piece by piece; records every copy of every key's value."""

    def __init__(self):
        self.parts = {"question": [], "output": []}
        self.part, self.length = "question", 0
        self.copies: dict[str, list[tuple[str, int]]] = {}
        self.reads: list[Read] = []

    def begin_output(self) -> None:
        self.part, self.length = "output", 0

    def plain(self, text: str) -> None:
        self.parts[self.part].append(text)
        self.length += len(text)

    def write(self, key: str, value: str) -> None:
        """A new value of `key`: older copies no longer hold it."""
        self.copies[key] = [(self.part, self.length)]
        self.plain(value)

    def needs(self, key: str, value: str, kind: str) -> None:
        """The next token needs `key`'s current value without writing it again."""
        self.reads.append(Read(key, value, self.length, tuple(self.copies[key]), kind))

    def read(self, key: str, value: str, writes: str | None = None) -> None:
        """A copy of `key`'s current value (and, with `writes`, a new value of that key)."""
        self.reads.append(Read(key, value, self.length, tuple(self.copies[key])))
        self.copies[key].append((self.part, self.length))
        if writes is not None:
            self.copies[writes] = [(self.part, self.length)]
        self.plain(value)

    def text(self, part: str) -> str:
        return "".join(self.parts[part])


@dataclass(frozen=True)
class SuiteItem:
    """One item of a family, from its parameters (`params`, the row `suite_batches` draws):

    state: initial values (20), start, steps; lookup: the entry of each number (23, one cycle), the
    first number, z's initial value, steps; plan, redundant, chain: the prompt variables' values, steps.
    """

    family: str
    params: tuple[int, ...]

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise UserError(f"canary family must be one of {list(FAMILIES)}, got {self.family!r}")

    @property
    def steps(self) -> int:
        return self.params[-1]

    @cached_property
    def built(self) -> Text:
        return BUILDERS[self.family](self.params)

    def question(self) -> str:
        return self.built.text("question")

    def output(self) -> str:
        return self.built.text("output")

    @property
    def answer(self) -> int:
        return int(re.search(r"\\boxed\{(\d+)\}", self.output())[1])

    @property
    def reads(self) -> list[Read]:
        return self.built.reads


def sum_line(text: Text, countdown: int, left: str, right: str, target: str, values: dict[str, int],
             previous: int | None = None) -> int:
    """The canary's line: `countdown: left=v, right=w -> target=(v + w) mod 23`. With `previous` (the
    state family), the names are the previous result's, which the first name needs."""
    text.plain(f"{countdown}: ")
    if previous is not None:
        text.needs("previous", str(previous), "choice")
    text.plain(f"{left}=")
    text.read(left, str(values[left]))
    text.plain(f", {right}=")
    text.read(right, str(values[right]))
    result = (values[left] + values[right]) % MODULUS
    text.plain(f" -> {target}=")
    text.needs(left, str(values[left]), "operand")
    text.needs(right, str(values[right]), "operand")
    text.write(target, str(result))
    if previous is not None:
        text.copies["previous"] = list(text.copies[target])
    text.plain("\n")
    values[target] = result
    return result


def assignments(text: Text, names: str, values: tuple[int, ...]) -> None:
    for index, (name, value) in enumerate(zip(names, values, strict=True)):
        text.plain(f"{name}=" if index == 0 else f", {name}=")
        text.write(name, str(value))


def finish(text: Text, result: int) -> Text:
    text.plain(f"</think>\n\n\\boxed{{{result}}}")
    return text


def build_state(params: tuple[int, ...]) -> Text:
    task = CanaryTask()
    names, steps = task.names, params[-1]
    text, values = Text(), dict(zip(names, params[:task.variables], strict=True))
    assignments(text, names, params[:task.variables])
    result = params[task.variables]
    text.plain(". Start: ")
    text.write("previous", str(result))
    text.plain(f". Steps: {steps}.")
    text.begin_output()
    text.plain("<think>\n")
    for countdown in range(steps, 0, -1):
        left, right, target = (names[index] for index in task.table[result])
        result = sum_line(text, countdown, left, right, target, values, previous=result)
    return finish(text, result)


def build_lookup(params: tuple[int, ...]) -> Text:
    size = VARIABLES["lookup"]
    successor, key, total, steps = params[:size], params[size], params[size + 1], params[-1]
    text = Text()
    text.plain(f"{TAGS['lookup']}: ")
    for index in range(size):
        text.plain(f"{index}=" if index == 0 else f", {index}=")
        text.write(str(index), str(successor[index]))
    text.plain(". Start: ")
    text.write("key", str(key))
    text.plain(", z=")
    text.write("z", str(total))
    text.plain(f". Steps: {steps}.")
    text.begin_output()
    text.plain("<think>\n")
    for countdown in range(steps, 0, -1):
        text.plain(f"{countdown}: ")
        text.read("key", str(key))
        text.plain("=")
        text.read(str(key), str(successor[key]), writes="key")
        text.plain(", z=")
        text.read("z", str(total))
        entry = str(key)
        key = successor[key]
        text.plain(" -> z=")
        text.needs(entry, str(key), "operand")
        text.needs("z", str(total), "operand")
        total = (total + key) % MODULUS
        text.write("z", str(total))
        text.plain("\n")
    return finish(text, total)


def chain_operands(index: int) -> tuple[str, str, str]:
    """The chain's line `index`: reads the next two variables of the rotation, writes the current one."""
    return NAMES[(index + 1) % ROTATION], NAMES[(index + 2) % ROTATION], NAMES[index % ROTATION]


def schedule(family: str, steps: int) -> list[tuple[str, str, str]]:
    """(left, right, target) of every line of a plan, redundant or chain item of `steps` lines."""
    lines = []
    for line, countdown in enumerate(range(steps, 0, -1)):
        if family == "chain":
            lines.append(chain_operands(line))
        elif family == "plan":
            if line < PLAN_LINES:
                lines.append((NAMES[ROTATION + 2 * line], NAMES[ROTATION + 2 * line + 1], PLAN[line]))
            else:
                left, right, target = chain_operands(line - PLAN_LINES)
                if countdown % PLAN_EVERY == 0:
                    right = PLAN[(countdown // PLAN_EVERY) % len(PLAN)]
                lines.append((left, right, target))
        elif family == "redundant":
            if line == 0:
                lines.append((NAMES[ROTATION], NAMES[ROTATION + 1], "s"))
            else:
                left, right, target = chain_operands(line - 1)
                if line <= RESTATEMENTS or countdown == 1:
                    right = "s"
                lines.append((left, right, target))
        else:
            raise ValueError(f"{family} has no fixed schedule")
    return lines


def build_scheduled(family: str, params: tuple[int, ...]) -> Text:
    names, steps = NAMES[:VARIABLES[family]], params[-1]
    text, values = Text(), dict(zip(names, params[:-1], strict=True))
    text.plain(f"{TAGS[family]}: ")
    assignments(text, names, params[:-1])
    text.plain(f". Steps: {steps}.")
    text.begin_output()
    text.plain("<think>\n")
    result = 0
    for countdown, (left, right, target) in zip(range(steps, 0, -1), schedule(family, steps), strict=True):
        result = sum_line(text, countdown, left, right, target, values)
    return finish(text, result)


BUILDERS = {
    "state": build_state,
    "lookup": build_lookup,
    "plan": lambda params: build_scheduled("plan", params),
    "redundant": lambda params: build_scheduled("redundant", params),
    "chain": lambda params: build_scheduled("chain", params),
}


def draw_steps(rng: random.Random) -> int:
    """Log-uniform in [MIN_STEPS, MAX_STEPS], as `CanaryTask.program` draws them."""
    return min(int(math.exp(rng.uniform(math.log(MIN_STEPS), math.log(MAX_STEPS + 1)))), MAX_STEPS)


def draw(family: str, rng: random.Random) -> SuiteItem:
    """A random item of `family`: values uniform mod 23, lookup's table one random cycle."""
    size = VARIABLES[family]
    if family == "lookup":
        order = rng.sample(range(size), size)
        successor = [0] * size
        for index, entry in enumerate(order):
            successor[entry] = order[(index + 1) % size]
        params = (*successor, rng.randrange(size), rng.randrange(MODULUS), draw_steps(rng))
    else:
        params = (*(rng.randrange(MODULUS) for _ in range(size)), draw_steps(rng))
    return SuiteItem(family, params)


def heldout(family: str, size: int = HELDOUT_SIZE) -> list[SuiteItem]:
    """The family's fixed held-out split; the state family's is the canary's."""
    if family == "state":
        return [SuiteItem("state", (*p.initial, p.start, p.steps)) for p in CanaryTask().heldout(size)]
    return [draw(family, random.Random(f"canary-suite-heldout:{family}:{index}")) for index in range(size)]


def heldout_rows(family: str, size: int = HELDOUT_SIZE) -> list[dict[str, str]]:
    """A family's held-out split as dataset rows (`index`, `question`, `true_answer`) for `evals.datasets`."""
    if family not in FAMILIES:
        raise UserError(f"canary family must be one of {list(FAMILIES)}, got {family!r}")
    return [{"index": f"{family}-{index}", "question": item.question(), "true_answer": str(item.answer)}
            for index, item in enumerate(heldout(family, size))]


def training_rows(family: str, size: int = HELDOUT_SIZE, seed: int = 0) -> list[dict[str, str]]:
    """`size` items of a family outside its held-out split, as dataset rows (`index`, `question`,
    `true_answer`): for what must not see the held-out items, such as a method's calibration
    (`dataset.overrides.canary_<family>.generator=evals.canary.families:training_rows`).

    Item i comes from its own seed string (another than the held-out split's), by the task's law
    (`draw`; the state family's by `CanaryTask.program`); a draw equal to a held-out item is skipped.
    """
    if family not in FAMILIES:
        raise UserError(f"canary family must be one of {list(FAMILIES)}, got {family!r}")
    excluded = {item.params for item in heldout(family)}
    items, index = [], 0
    while len(items) < size:
        rng = random.Random(f"canary-suite-training:{seed}:{family}:{index}")
        if family == "state":
            program = CanaryTask().program(rng)
            item = SuiteItem("state", (*program.initial, program.start, program.steps))
        else:
            item = draw(family, rng)
        if item.params not in excluded:
            items.append((index, item))
        index += 1
    return [{"index": f"{family}-training-{index}", "question": item.question(), "true_answer": str(item.answer)}
            for index, item in items]


def token_reads(item: SuiteItem, prompt_text: str, tokenizer) -> list[tuple[int, tuple[int, ...]]]:
    """Every read of `item` as token positions: (output index of the token that copies the value,
    positions of the tokens holding it in the rendered prompt + output, 0 = the prompt's first).

    `prompt_text`: the rendered prompt decoded, which holds the question once.
    """
    output = item.output()
    base = {"question": prompt_text.index(item.question()), "output": len(prompt_text)}
    offsets = tokenizer(prompt_text + output, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    token_at = {start: index for index, (start, _) in enumerate(offsets)}
    first_output = token_at[len(prompt_text)]
    return [(token_at[base["output"] + read.at] - first_output,
             tuple(token_at[base[part] + offset] for part, offset in read.sources)) for read in item.reads]
