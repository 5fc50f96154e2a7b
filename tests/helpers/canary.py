"""What the canary's test modules share: a reader that checks an item by the task's rules from its text
alone, and two deliberately broken policies with the budget they are tested at."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from evals.canary.task import CanaryTask
from longflow.policy import KVPolicy, Observation

MENTION = re.compile(r"\b([a-z])=(\d+)")


def check_by_the_rules(task: CanaryTask, question: str, output: str) -> int:
    """Reads an item from its text as a person would and checks every line; returns the boxed answer.

    The latest value of a variable is its last "name=value" in the text so far, prompt included.
    """
    start = int(re.search(r"Start: (\d+)\.", question)[1])
    steps = int(re.search(r"Steps: (\d+)\.", question)[1])
    assert output.startswith("<think>\n")
    thinking, answer = output[len("<think>\n"):].split("</think>\n\n")
    lines = thinking.splitlines()
    assert len(lines) == steps
    text, previous = question, start
    for countdown, line in zip(range(steps, 0, -1), lines, strict=True):
        match = re.fullmatch(r"(\d+): ([a-z])=(\d+), ([a-z])=(\d+) -> ([a-z])=(\d+)", line)
        assert match, line
        number, left, left_value, right, right_value, target, result = match.groups()
        latest = dict(MENTION.findall(text))
        assert int(number) == countdown
        assert tuple(task.names.index(name) for name in (left, right, target)) == task.table[previous]
        assert (left_value, right_value) == (latest[left], latest[right])
        assert int(result) == (int(left_value) + int(right_value)) % task.modulus
        text += "\n" + line
        previous = int(result)
    assert answer == f"\\boxed{{{previous}}}"
    return previous


SMALL_BUDGET = 128  # slots: under half of these items' mean sequence length (121 + 312 tokens)


@dataclass(eq=False)
class EvictNewest(KVPolicy):
    """Deliberately broken: once the cache is full, every new token overwrites the one written before it,
    so the model keeps the old tokens and loses each newest one at the next step."""

    name = "evict_newest"

    def score(self, obs: Observation) -> torch.Tensor:
        return -obs.positions.float()  # the newest position scores lowest


@dataclass(eq=False)
class EvictRandom(KVPolicy):
    """Deliberately broken: once the cache is full, the next token overwrites a uniformly random slot."""

    name = "evict_random"

    def __post_init__(self):
        super().__post_init__()
        self.generator = torch.Generator().manual_seed(0)

    def score(self, obs: Observation) -> torch.Tensor:
        return torch.rand(obs.positions.shape, generator=self.generator)
