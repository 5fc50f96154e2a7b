"""The canary task: variables tracked through a long program that the chain of thought executes.

An item gives V variables with initial values (mod M), a start value and a number of steps n:

    a=0, b=10, c=5, d=5, e=10, ..., t=10. Start: 14. Steps: 71.

A model executes the n steps, counting down, one line each, then boxes the last result:

    <think>
    71: a=0, e=10 -> p=10
    70: r=15, e=10 -> t=2
    ...
    1: j=10, a=0 -> q=10
    </think>

    \\boxed{10}

Each step is chosen by the previous result r (the start value for the first step) through the task's
fixed step table, r -> (x, y, z): the line reads the latest values of x and y and sets
z = (x + y) mod M. The model learns the table in training; no prompt spells it out.

Why this shape (after RULER's variable tracking, with the program moved into the model's own output):
  - The latest value of a variable sits at its latest mention (a read copies the value it read, a
    write states the new one), or in the prompt before its first one. So the tokens a step needs are
    specific old tokens, in the model's own output or in the prompt, not simply the last lines.
  - The previous result picks the next step, so no prompt holds the program: a method cannot keep
    "the program" and be done; it has to keep the latest mention of every variable.
  - A wrong value changes every later step, so the answer is right only if every step read the right
    values: a lost token shows as a wrong answer (right by chance about once in M).
On the default held-out split (`python -m evals.canary.task` prints these): a read's value sits 52
tokens back on average, 204 at the 99th percentile and up to 488; 11% of reads take a value that is
still in the prompt only.

Knobs (`CanaryTask`): `min_steps`, `max_steps` (the output length: 19 tokens a step with the
canary tokenizer; steps are log-uniform between the two, so lengths have a long tail), `variables`,
`modulus`, `table_seed` (how far back operands reach follows from these three through the step
table's dynamics; `python -m evals.canary.task --variables 26` shows it). The held-out split is fixed:
item i comes from its own seed string, so the first N items are the same for any split size.
"""

from __future__ import annotations

import argparse
import math
import random
import re
import statistics
import sys
from dataclasses import asdict, dataclass, field
from functools import cached_property

from longflow.errors import UserError

NAMES = "abcdefghijklmnopqrstuvwxyz"
HELDOUT_SIZE = 200


@dataclass(frozen=True)
class Step:
    """One executed line: `target` = (`left` + `right`) mod M, with the values read and the result."""

    countdown: int
    left: str
    left_value: int
    right: str
    right_value: int
    target: str
    result: int

    def line(self) -> str:
        return (f"{self.countdown}: {self.left}={self.left_value}, {self.right}={self.right_value} "
                f"-> {self.target}={self.result}\n")


@dataclass(frozen=True)
class CanaryTask:
    """The task's knobs. The defaults are the task the committed canary model was trained on."""

    variables: int = 20
    min_steps: int = 10
    max_steps: int = 84
    modulus: int = 23
    table_seed: int = 0

    def __post_init__(self):
        if not 2 <= self.variables <= len(NAMES):
            raise UserError(f"canary variables must be in [2, {len(NAMES)}], got {self.variables}")
        if not 1 <= self.min_steps <= self.max_steps:
            raise UserError(f"canary steps need 1 <= min_steps <= max_steps, got {self.min_steps}, {self.max_steps}")
        if self.modulus < 2:
            raise UserError(f"canary modulus must be at least 2, got {self.modulus}")

    @property
    def names(self) -> str:
        return NAMES[:self.variables]

    @cached_property
    def table(self) -> tuple[tuple[int, int, int], ...]:
        """Per previous result r: (left, right, target) variable indices, left != right."""
        rng = random.Random(f"canary-table:{self.table_seed}:{self.variables}:{self.modulus}")
        rows = []
        for _ in range(self.modulus):
            left, right = rng.sample(range(self.variables), 2)
            rows.append((left, right, rng.randrange(self.variables)))
        return tuple(rows)

    def program(self, rng: random.Random) -> Program:
        """A random program: initial values and start uniform mod M, steps log-uniform."""
        initial = tuple(rng.randrange(self.modulus) for _ in range(self.variables))
        start = rng.randrange(self.modulus)
        steps = int(math.exp(rng.uniform(math.log(self.min_steps), math.log(self.max_steps + 1))))
        return Program(self, initial, start, min(steps, self.max_steps))

    def heldout(self, size: int = HELDOUT_SIZE) -> list[Program]:
        """The fixed held-out split. Training draws from another generator and skips these programs."""
        key = ":".join(str(value) for value in asdict(self).values())
        return [self.program(random.Random(f"canary-heldout:{key}:{index}")) for index in range(size)]


@dataclass(frozen=True)
class Program:
    """One item: initial values (one per variable, in name order), start value, number of steps."""

    task: CanaryTask = field(repr=False)
    initial: tuple[int, ...]
    start: int
    steps: int

    @cached_property
    def trace(self) -> tuple[Step, ...]:
        names, modulus = self.task.names, self.task.modulus
        values, result, trace = list(self.initial), self.start, []
        for countdown in range(self.steps, 0, -1):
            left, right, target = self.task.table[result]
            left_value, right_value = values[left], values[right]
            result = (left_value + right_value) % modulus
            values[target] = result
            trace.append(Step(countdown, names[left], left_value, names[right], right_value, names[target], result))
        return tuple(trace)

    @property
    def answer(self) -> int:
        return self.trace[-1].result

    def question(self) -> str:
        values = ", ".join(f"{name}={value}" for name, value in zip(self.task.names, self.initial, strict=True))
        return f"{values}. Start: {self.start}. Steps: {self.steps}."

    def output(self) -> str:
        """What a perfect model writes: the executed lines as its thinking, then the boxed answer."""
        lines = "".join(step.line() for step in self.trace)
        return f"<think>\n{lines}</think>\n\n\\boxed{{{self.answer}}}"

    def reach(self) -> list[int | None]:
        """For every read, in order: how many lines back the variable was last mentioned (1 = the
        previous line), or None when its value still sits in the prompt only."""
        mentioned: dict[str, int] = {}
        distances = []
        for line, step in enumerate(self.trace):
            for name in (step.left, step.right):
                distances.append(line - mentioned[name] if name in mentioned else None)
            for name in (step.left, step.right, step.target):
                mentioned[name] = line
        return distances


MENTION = re.compile(r"\b([a-z])=(\d+)")


def reach_in_tokens(prompt: str, output: str, tokenizer) -> list[int]:
    """For every read of `output` (the first two mentions of a line): how many tokens back the value
    it needs sits, i.e. its variable's previous "name=value" in `prompt` + `output` (the rendered
    prompt text). Measured on the text, independently of `Program`."""
    text = prompt + output
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    token_at = {start: index for index, (start, _) in enumerate(offsets)}
    latest: dict[str, int] = {}
    distances = []
    line_mentions = 0
    for match in MENTION.finditer(text):
        name, value_token = match.group(1), token_at[match.start(2)]
        if match.start() >= len(prompt):
            if line_mentions % 3 != 2:  # a read; the third mention of a line is the write
                distances.append(value_token - latest[name])
            line_mentions += 1
        latest[name] = value_token
    return distances


def heldout_rows(size: int = HELDOUT_SIZE, steps_at_most: int | None = None, **knobs) -> list[dict[str, str]]:
    """The held-out split as dataset rows (`index`, `question`, `true_answer`) for `evals.datasets`.

    With `steps_at_most`, only the items of the 200-item split with at most that many steps, the first
    `size` of them (a cheaper subset: the demo's), each keeping its index in the split.
    """
    programs = list(enumerate(CanaryTask(**knobs).heldout(size if steps_at_most is None else HELDOUT_SIZE)))
    if steps_at_most is not None:
        programs = [(index, program) for index, program in programs if program.steps <= steps_at_most]
    return [{"index": f"canary-{index}", "question": program.question(), "true_answer": str(program.answer)}
            for index, program in programs[:size]]


def main(argv: list[str] | None = None) -> int:
    """Prints the held-out split's length and reach statistics in the canary tokenizer's tokens."""
    from evals.canary import vocabulary
    from evals.datasets import Item
    from evals.prompts import build_messages, render_prompt

    parser = argparse.ArgumentParser(prog="python -m evals.canary.task", description=main.__doc__)
    parser.add_argument("--size", type=int, default=HELDOUT_SIZE)
    for name, value in asdict(CanaryTask()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    args = vars(parser.parse_args(argv))
    size = args.pop("size")
    task, tokenizer = CanaryTask(**args), vocabulary.build()
    prompts, outputs, reach, in_prompt = [], [], [], 0
    for program in task.heldout(size):
        item = Item("x", program.question(), str(program.answer))
        prompt = render_prompt(tokenizer, build_messages(item, "math"), thinking=True)
        prompts.append(len(prompt))
        outputs.append(len(tokenizer(program.output(), add_special_tokens=False)["input_ids"]) + 1)  # + EOS
        reach += reach_in_tokens(tokenizer.decode(prompt), program.output(), tokenizer)
        in_prompt += sum(lines is None for lines in program.reach())
    reach.sort()
    print(f"{task}: {size} held-out items")
    print(f"prompt tokens: mean {statistics.mean(prompts):.0f}; output tokens (with EOS): mean "
          f"{statistics.mean(outputs):.1f}, max {max(outputs)}, {sum(n > 1500 for n in outputs)} past 1500; "
          f"mean sequence {statistics.mean(prompts) + statistics.mean(outputs):.0f}")
    print(f"reads: {len(reach)}; tokens back to the value read: mean {statistics.mean(reach):.1f}, median "
          f"{reach[len(reach) // 2]}, p90 {reach[int(0.9 * len(reach))]}, p99 {reach[int(0.99 * len(reach))]}, "
          f"max {reach[-1]}; {sum(d >= 192 for d in reach)} reads 192+ back; "
          f"{100 * in_prompt / len(reach):.0f}% of reads take a value still in the prompt only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
