"""Items of the canary suite's families as token ids, built in batches on the device as the harness renders them.

The suite's counterpart of `evals.canary.batches` (whose `Batches` builds the state family): every
number and name is one token, so a family's prompt and line are fixed token templates with holes,
and a batch of one step count is a dense `[B, T]` tensor, its trace a few tensor ops per line.
`tests/test_canary_families.py` checks the ids against `render_prompt` and the tokenizer.
Parameter rows are `SuiteItem.params`.
"""

from __future__ import annotations

import torch

from evals.canary.batches import MARK, Batches, heldout_mask
from evals.canary.families import (
    MODULUS,
    NAMES,
    PLAN,
    TAGS,
    VARIABLES,
    CanaryTask,
    heldout,
    schedule,
)
from evals.datasets import Item
from evals.prompts import build_messages, render_prompt

NUMBER, NAME = "number", "name"  # the two kinds of hole in a template


class Templates:
    """Token templates: literal text and holes, as ids with -1 at the holes."""

    def __init__(self, tokenizer, device: torch.device):
        self.tokenizer, self.device = tokenizer, device
        self.number = torch.tensor([self.one(str(n)) for n in range(100)], device=device)
        self.name = torch.tensor([self.one(letter) for letter in NAMES], device=device)

    def one(self, text: str) -> int:
        ids = self.ids(text)
        if len(ids) != 1:
            raise ValueError(f"{text!r} is not one token of the suite tokenizer")
        return ids[0]

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def template(self, pieces: list) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids `[T]` with -1 at holes, hole positions `[H]`) of literal strings and NUMBER/NAME holes."""
        ids = []
        for piece in pieces:
            ids += [-1] if piece in (NUMBER, NAME) else self.ids(piece)
        ids = torch.tensor(ids, device=self.device)
        return ids, (ids == -1).nonzero()[:, 0]

    def prompt(self, question: list) -> tuple[torch.Tensor, torch.Tensor]:
        """The rendered prompt around a question template: (ids `[L]`, hole positions `[H]`)."""
        question, _ = self.template(question)
        probe = render_prompt(self.tokenizer, build_messages(Item("probe", MARK, "0"), "math"), thinking=True)
        at = probe.index(self.one(MARK))
        ids = torch.cat([torch.tensor(probe[:at], device=self.device), question,
                         torch.tensor(probe[at + 1:], device=self.device)])
        return ids, (ids == -1).nonzero()[:, 0]

    def fill(self, template: torch.Tensor, holes: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """`values` `[B, ..., H]` token ids into copies of `template` -> `[B, ..., T]`."""
        out = template.expand(*values.shape[:-1], len(template)).clone()
        out[..., holes] = values
        return out

    def output_frame(self, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`<think>\\n`, `</think>\\n\\n\\boxed{` and `}<|im_end|>` as `[B, n]` ids."""
        think = torch.tensor(self.ids("<think>\n"), device=self.device)
        close = torch.tensor(self.ids("</think>\n\n\\boxed{"), device=self.device)
        tail = torch.tensor(self.ids("}") + [self.tokenizer.eos_token_id], device=self.device)
        return tuple(part.expand(batch, len(part)) for part in (think, close, tail))


class FamilyBatches:
    """Random items of one family and their token ids (prompt, reference output, end of turn)."""

    family: str

    def __init__(self, templates: Templates):
        self.t = templates
        self.heldout = torch.tensor([item.params for item in heldout(self.family)], device=templates.device)

    def draw(self, generator: torch.Generator, batch: int, steps: int) -> torch.Tensor:
        raise NotImplementedError

    def tokens(self, params: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def assemble(self, prompt: torch.Tensor, lines: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
        """prompt `[B, L]`, lines `[B, n, line]`, the boxed result `[B]` -> `[B, T]`."""
        think, close, tail = self.t.output_frame(prompt.shape[0])
        return torch.cat([prompt, think, lines.flatten(1), close, self.t.number[result][:, None], tail], dim=1)

    def countdowns(self, batch: int, steps: int) -> torch.Tensor:
        return torch.arange(steps, 0, -1, device=self.t.device).expand(batch, steps)


class StateBatches(FamilyBatches):
    """The canary's own items (`evals.canary.batches.Batches`)."""

    family = "state"

    def __init__(self, templates: Templates):
        super().__init__(templates)
        self.batches = Batches(CanaryTask(), templates.tokenizer, templates.device)

    def draw(self, generator, batch, steps):
        return self.batches.programs(generator, batch, steps)

    def tokens(self, params):
        return self.batches.tokens(params)


class LookupBatches(FamilyBatches):
    family = "lookup"

    def __init__(self, templates: Templates):
        super().__init__(templates)
        self.size = VARIABLES["lookup"]
        question = [f"{TAGS['lookup']}: "]
        for index in range(self.size):
            question += [f"{index}=" if index == 0 else f", {index}=", NUMBER]
        question += [". Start: ", NUMBER, ", z=", NUMBER, ". Steps: ", NUMBER, "."]
        self.prompt, self.prompt_holes = templates.prompt(question)
        self.line, self.line_holes = templates.template([NUMBER, ": ", NUMBER, "=", NUMBER, ", z=", NUMBER, " -> z=",
                                                         NUMBER, "\n"])

    def draw(self, generator, batch, steps):
        device, size = self.t.device, self.size
        order = torch.rand(batch, size, generator=generator, device=device).argsort(dim=1)
        successor = torch.empty_like(order).scatter_(1, order, order.roll(-1, dims=1))  # one cycle through all
        start = torch.randint(size, (batch, 1), generator=generator, device=device)
        total = torch.randint(MODULUS, (batch, 1), generator=generator, device=device)
        return torch.cat([successor, start, total, torch.full((batch, 1), steps, device=device)], dim=1)

    def tokens(self, params):
        number, size = self.t.number, self.size
        steps = int(params[0, -1])
        successor, key, total = params[:, :size], params[:, size:size + 1], params[:, size + 1]
        prompt = self.t.fill(self.prompt, self.prompt_holes, number[params])
        fields = []
        for countdown in range(steps, 0, -1):
            entry = successor.gather(1, key)[:, 0]
            result = (total + entry) % MODULUS
            fields.append(torch.stack([number[torch.full_like(total, countdown)], number[key[:, 0]], number[entry],
                                       number[total], number[result]], dim=-1))
            key, total = entry[:, None], result
        lines = self.t.fill(self.line, self.line_holes, torch.stack(fields, dim=1))
        return self.assemble(prompt, lines, total)


class ScheduledBatches(FamilyBatches):
    """Plan, redundant and chain: the canary's line, whose operands depend on the line alone."""

    def __init__(self, templates: Templates, family: str):
        self.family = family
        super().__init__(templates)
        self.names = NAMES[:VARIABLES[family]]
        extra = {"plan": PLAN, "redundant": "s", "chain": ""}[family]
        self.column = {name: index for index, name in enumerate(self.names + extra)}
        question = [f"{TAGS[family]}: "]
        for index, name in enumerate(self.names):
            question += [f"{name}=" if index == 0 else f", {name}=", NUMBER]
        question += [". Steps: ", NUMBER, "."]
        self.prompt, self.prompt_holes = templates.prompt(question)
        self.line, self.line_holes = templates.template([NUMBER, ": ", NAME, "=", NUMBER, ", ", NAME, "=", NUMBER,
                                                         " -> ", NAME, "=", NUMBER, "\n"])

    def draw(self, generator, batch, steps):
        values = torch.randint(MODULUS, (batch, len(self.names)), generator=generator, device=self.t.device)
        return torch.cat([values, torch.full((batch, 1), steps, device=self.t.device)], dim=1)

    def tokens(self, params):
        number, name = self.t.number, self.t.name
        batch, steps = params.shape[0], int(params[0, -1])
        prompt = self.t.fill(self.prompt, self.prompt_holes, number[params])
        values = torch.zeros(batch, len(self.column), dtype=torch.long, device=self.t.device)
        values[:, :len(self.names)] = params[:, :-1]
        fields, result = [], None
        for countdown, (left, right, target) in zip(range(steps, 0, -1), schedule(self.family, steps), strict=True):
            left_value, right_value = values[:, self.column[left]], values[:, self.column[right]]
            result = (left_value + right_value) % MODULUS
            values[:, self.column[target]] = result
            names = name[[NAMES.index(n) for n in (left, right, target)]].expand(batch, 3)
            fields.append(torch.stack([number[torch.full_like(result, countdown)], names[:, 0], number[left_value],
                                       names[:, 1], number[right_value], names[:, 2], number[result]], dim=-1))
        lines = self.t.fill(self.line, self.line_holes, torch.stack(fields, dim=1))
        return self.assemble(prompt, lines, result)


def suite_batches(tokenizer, device: torch.device) -> dict[str, FamilyBatches]:
    """Every family's batch builder, by family name."""
    templates = Templates(tokenizer, device)
    return {"state": StateBatches(templates), "lookup": LookupBatches(templates),
            **{family: ScheduledBatches(templates, family) for family in ("plan", "redundant", "chain")}}


__all__ = ["FamilyBatches", "heldout_mask", "suite_batches"]
