"""Canary programs as token ids, built in batches on the device exactly as the harness renders them.

Training draws millions of programs; rendering each through the chat template and the tokenizer
would cost more than the training step. Every number is one token of the canary tokenizer, so a
program's ids are fixed templates (the rendered prompt, a thinking line) with holes for its numbers
and names, and its execution is a few tensor ops per step over the whole batch.
`tests/test_canary_task.py` checks the ids against `render_prompt` and the tokenizer.
"""

from __future__ import annotations

import torch

from evals.canary.task import CanaryTask
from evals.datasets import Item
from evals.prompts import build_messages, render_prompt

LINE_TOKENS = 19
# A character no prompt contains: rendered in place of the question, it shows where the question's
# tokens go inside the chat template.
MARK = "\x00"


class Batches:
    """Token ids of programs, built on the device from the task's table, as the harness renders them.

    A row is the rendered prompt (chat template, question, math instruction, generation prompt) then
    the reference output and the end-of-turn token. Every number is one token, so a program of n
    steps is always `prompt_len + 19 n + 9` tokens: a batch of one n is a dense `[B, T]` tensor.
    Prompt and line are fixed token templates with holes for the program's numbers and names.
    """

    LINE_FIELDS = ("countdown", "left", "left_value", "right", "right_value", "target", "result")
    NAME_FIELDS = ("left", "right", "target")

    def __init__(self, task: CanaryTask, tokenizer, device: torch.device):
        self.task, self.device = task, device

        def one(text: str) -> int:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) != 1:
                raise ValueError(f"{text!r} is not one token of the canary tokenizer")
            return ids[0]

        self.number = torch.tensor([one(str(n)) for n in range(100)], device=device)
        self.name = torch.tensor([one(name) for name in task.names], device=device)
        self.table = torch.tensor(task.table, device=device)  # [M, 3]: left, right, target
        hole = -1
        question, self.holes = [], []  # holes: prompt positions of the program's V + 2 numbers
        for index, name in enumerate(task.names):
            question += [one(name), one("="), hole] + ([one(","), one(" ")] if index < task.variables - 1 else
                                                       [one(".")])
        question += [one(" "), one("Start"), one(":"), one(" "), hole, one("."), one(" "), one("Steps"), one(":"),
                     one(" "), hole, one(".")]
        probe = render_prompt(tokenizer, build_messages(Item("probe", MARK, "0"), "math"), thinking=True)
        at = probe.index(one(MARK))
        prompt = probe[:at] + question + probe[at + 1:]
        self.prompt = torch.tensor(prompt, device=device)
        self.holes = torch.tensor([i for i, t in enumerate(prompt) if t == hole], device=device)
        # "{countdown}: {left}={left_value}, {right}={right_value} -> {target}={result}\n"
        line = [hole, one(":"), one(" "), hole, one("="), hole, one(","), one(" "), hole, one("="), hole, one(" "),
                one("-"), one(">"), one(" "), hole, one("="), hole, one("\n")]
        assert len(line) == LINE_TOKENS
        self.line = torch.tensor(line, device=device)
        self.line_holes = torch.tensor([i for i, t in enumerate(line) if t == hole], device=device)
        self.is_name = torch.tensor([f in self.NAME_FIELDS for f in self.LINE_FIELDS], device=device)
        self.think = torch.tensor([one("<think>"), one("\n")], device=device)
        self.close = torch.tensor([one("</think>"), one("\n"), one("\n"), one("\\boxed{")], device=device)
        self.tail = torch.tensor([one("}"), tokenizer.eos_token_id], device=device)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    def programs(self, generator: torch.Generator, batch: int, steps: int) -> torch.Tensor:
        """`[B, V + 2]` random programs (initial values, start, steps): values uniform mod M as
        `CanaryTask.program` draws them, one given step count."""
        modulus = self.task.modulus
        values = torch.randint(modulus, (batch, self.task.variables + 1), generator=generator, device=self.device)
        return torch.cat([values, torch.full((batch, 1), steps, device=self.device)], dim=1)

    def tokens(self, programs: torch.Tensor) -> torch.Tensor:
        """`[B, V + 2]` programs (one step count) -> `[B, T]` token ids, prompt then reference output."""
        batch, variables, modulus = programs.shape[0], self.task.variables, self.task.modulus
        steps = int(programs[0, -1])
        values, result = programs[:, :variables].clone(), programs[:, variables]
        columns = [torch.arange(steps, 0, -1, device=self.device).expand(batch, steps)]
        trace = []
        for _ in range(steps):
            left, right, target = self.table[result].unbind(-1)
            left_value = values.gather(1, left[:, None])[:, 0]
            right_value = values.gather(1, right[:, None])[:, 0]
            result = (left_value + right_value) % modulus
            values.scatter_(1, target[:, None], result[:, None])
            trace.append(torch.stack([left, left_value, right, right_value, target, result], dim=-1))
        fields = torch.cat([columns[0][..., None], torch.stack(trace, dim=1)], dim=-1)  # [B, n, 7]
        ids = torch.where(self.is_name, self.name[fields.clamp(max=variables - 1)], self.number[fields])
        lines = self.line.repeat(batch, steps, 1)  # [B, n, 19]
        lines[:, :, self.line_holes] = ids
        prompt = self.prompt.repeat(batch, 1)
        prompt[:, self.holes] = self.number[programs]
        fixed = lambda ids: ids.expand(batch, len(ids))  # noqa: E731
        return torch.cat([prompt, fixed(self.think), lines.flatten(1), fixed(self.close),
                          self.number[result][:, None], fixed(self.tail)], dim=1)


def heldout_programs(task: CanaryTask, size: int, device: torch.device) -> torch.Tensor:
    """`[size, V + 2]` the held-out split as program rows."""
    return torch.tensor([[*p.initial, p.start, p.steps] for p in task.heldout(size)], device=device)


def heldout_mask(programs: torch.Tensor, heldout: torch.Tensor) -> torch.Tensor:
    """`[B]` whether each of `programs` `[B, V + 2]` is one of `heldout` `[H, V + 2]`."""
    return (programs[:, None, :] == heldout[None]).all(dim=-1).any(dim=-1)
