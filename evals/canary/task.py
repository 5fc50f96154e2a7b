"""The canary task: variables tracked through a long program that the chain of thought executes.

An item gives V variables with initial values (mod M), a start value and a number of steps n:

    a=17, b=42, c=5, ..., t=88. Start: 31. Steps: 40.

A model executes the n steps, counting down, one line each, then boxes the last result:

    <think>
    40: f=12, k=55 -> c=67
    39: c=67, a=17 -> n=84
    ...
    1: d=3, h=90 -> b=93
    </think>

    \\boxed{93}

Each step is chosen by the previous result r (the start value for the first step) through the task's
fixed step table, r -> (x, y, z): the line reads the latest values of x and y and sets
z = (x + y) mod M. The model learns the table in training; no prompt spells it out.

Why this shape (after RULER's variable tracking, with the program moved into the model's own output):
  - The latest value of a variable sits at its latest mention (a read copies the value it read, a
    write states the new one): a geometric number of lines back, V/3 lines on average (three
    mentions a line), with a long tail; before its first mention, in the prompt. So the tokens that
    matter are specific old tokens of the model's own output: neither the last few lines (recency
    does not suffice) nor the prompt alone.
  - The previous result picks the next step, so no prompt holds the program: a method cannot keep
    "the program" and be done; it has to keep the latest mention of every variable.
  - A wrong value changes every later step, so the answer is right only if every step read the right
    values: a lost token shows as a wrong answer (right by chance once in M).

Knobs (`CanaryTask`): `min_steps`, `max_steps` (the output length: 19 tokens a step with the
canary tokenizer; steps are log-uniform between the two, so lengths have a long tail), `variables`
(how far back operands reach, V/3 lines on average), `modulus`, `table_seed`. The held-out split is
fixed: item i comes from its own seed string, so the first N items are the same for any split size.
"""

from __future__ import annotations

import math
import random
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


def heldout_rows(size: int = HELDOUT_SIZE, **knobs) -> list[dict[str, str]]:
    """The held-out split as dataset rows (`index`, `question`, `true_answer`) for `evals.datasets`."""
    return [{"index": f"canary-{index}", "question": program.question(), "true_answer": str(program.answer)}
            for index, program in enumerate(CanaryTask(**knobs).heldout(size))]
