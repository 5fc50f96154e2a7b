"""Dependency recall: for every read a step of a canary suite item makes, whether the KV policy still
held a token holding the value it reads, when that step was generated.

    python -m evals.canary.recall --families lookup,plan --methods vanilla,streaming,rkv,longflow \\
        --budgets 96,192,384 --limit 16 --out results/canary_suite/recall

The generator knows every read (`evals.canary.families`: the output token that copies a value and
the earlier tokens that hold it, any of which will do). An item's reference output is fed to the
policy token by token (teacher-forced, through the engine's own prefill, decode step and host
hooks), so each step sees exactly the tokens the read positions refer to; the step that generates a
read's token is the forward whose input is the token before it, and what the policy held then is
what that forward attended to. For each read:

    recall_layer0  share of layer 0's KV heads that held at least one copy of the value
    recall_layers  share of all (layer, KV head) pairs that held at least one copy

and per item whether every read was held by every layer's KV heads (`complete`): the model reads a
value in the layers that learnt to retrieve it, and a value lost there leaves it a guess (a copy
kept by some other head and layer rarely saves it: random eviction keeps one somewhere for nearly
every read and solves few items), so an item that is not complete is mostly solved by chance. The full cache holds every
token, so its recall is 1 by construction. Normal runs are untouched: the snapshots are taken only
here, between the steps of this analysis. `record_held` also keeps every step's held positions of
one row, for `evals.canary.eviction_map`.

Notation: B rows, Hkv KV heads, S slots of a layer, n reads at a step, C copies of a value.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from evals.canary.families import FAMILIES, SuiteItem, heldout, token_reads
from evals.datasets import Item
from evals.prompts import build_messages, render_prompt
from longflow.config import EngineConfig, GenerationConfig
from longflow.engine import DecodeState, Engine
from longflow.errors import UserError
from longflow.policy import KVPolicy


@dataclass
class Teacher:
    """What one item feeds and checks: rendered prompt ids, reference output ids (EOS included), and
    its reads as (output index of the copying token, token positions of the copies)."""

    prompt: list[int]
    output: list[int]
    reads: list[tuple[int, tuple[int, ...]]]


def teacher(item: SuiteItem, tokenizer) -> Teacher:
    message = build_messages(Item("x", item.question(), str(item.answer)), "math")
    prompt = render_prompt(tokenizer, message, thinking=True)
    output = tokenizer(item.output(), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return Teacher(prompt, output, token_reads(item, tokenizer.decode(prompt), tokenizer))


@dataclass
class ReadRecall:
    """Per read of one item, in order: the share of layer 0's KV heads and of all (layer, head) pairs
    that held a copy of the value when the read's token was generated."""

    layer0: list[float] = field(default_factory=list)
    layers: list[float] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """Every read held by every (layer, KV head)."""
        return all(share == 1.0 for share in self.layers)


@dataclass
class HeldTrace:
    """Every decode step's held positions of one row: per step, per layer, `[Hkv, S]` positions
    (-1 where the slot is free). Step t is the forward that generates output token t."""

    steps: list[int] = field(default_factory=list)
    positions: list[list[torch.Tensor]] = field(default_factory=list)


def held_copies(policy: KVPolicy, rows: torch.Tensor, copies: torch.Tensor) -> torch.Tensor:
    """`[n, layers, Hkv]` bool: whether each layer's KV head held one of the copies `[n, C]`
    (positions, -1 = padding) of rows `[n]`, now."""
    held = []
    for slots in policy.layers:
        positions = slots.positions.index_select(0, rows)  # [n, Hkv, S]
        positions = positions.masked_fill(~slots.valid.index_select(0, rows), -2)
        match = (positions[..., None] == copies[:, None, None, :]) & (copies[:, None, None, :] >= 0)
        held.append(match.any(dim=-1).any(dim=-1))
    return torch.stack(held, dim=1)


@torch.inference_mode()
def teacher_forced_recall(engine: Engine, teachers: list[Teacher], trace_row: int | None = None
                          ) -> tuple[list[ReadRecall], HeldTrace]:
    """Feeds every reference output through `engine`'s policy in one batch; returns each item's
    `ReadRecall`, and with `trace_row` the held positions of that row at every step."""
    if not teachers:
        raise ValueError("teacher_forced_recall needs at least one item")
    steps = max(len(t.output) for t in teachers)
    generation = GenerationConfig(max_new_tokens=steps)
    input_ids, pad = engine.batch_inputs([t.prompt for t in teachers])
    batch = len(teachers)
    cache = engine.new_cache(engine.policy_factory, batch, pad.shape[1], generation)
    state = DecodeState(batch, steps, engine.vocab, [0] * batch, engine.pad_id, engine.device, track_seen=False)
    reference = torch.full((batch, steps + 1), engine.pad_id, dtype=torch.long, device=engine.device)
    for row, t in enumerate(teachers):
        reference[row, :len(t.output)] = torch.tensor(t.output)
    by_step: dict[int, list[tuple[int, int, tuple[int, ...]]]] = {}
    for row, t in enumerate(teachers):
        for index, (at, copies) in enumerate(t.reads):
            by_step.setdefault(at, []).append((row, index, copies))
    recalls = [ReadRecall([0.0] * len(t.reads), [0.0] * len(t.reads)) for t in teachers]
    trace = HeldTrace()
    width = max(len(copies) for t in teachers for _, copies in t.reads)

    def feed() -> None:
        engine.emit(state, reference.gather(1, state.step[:, None])[:, 0], generation)

    def check(step: int) -> None:
        """Reads whose token is output `step`, against what the policy holds for that step's forward."""
        policy = cache.policy
        if trace_row is not None:
            trace.steps.append(step)
            trace.positions.append([slots.positions[trace_row].masked_fill(~slots.valid[trace_row], -1).clone()
                                    for slots in policy.layers])
        reads = by_step.get(step, [])
        if not reads:
            return
        rows = torch.tensor([row for row, _, _ in reads], device=engine.device)
        copies = torch.tensor([list(c) + [-1] * (width - len(c)) for _, _, c in reads], device=engine.device)
        held = held_copies(policy, rows, copies).float()  # [n, layers, Hkv]
        for (row, index, _), layer0, layers in zip(reads, held[:, 0].mean(dim=-1).tolist(),
                                                   held.mean(dim=(1, 2)).tolist(), strict=True):
            recalls[row].layer0[index], recalls[row].layers[index] = layer0, layers

    engine.prompt_forward((cache,), state, input_ids, pad)
    feed()
    output_step = [1]

    def step() -> None:
        engine.forward(cache, state.token[:, None], state.positions[:, None])
        state.positions += 1
        check(output_step[0])
        output_step[0] += 1
        feed()

    engine.run_steps(step, (cache.policy,), state, steps - 1)
    return recalls, trace


@dataclass(frozen=True)
class RecallSummary:
    """One (family, method, budget): reads and items, mean recall, items with every read held."""

    family: str
    method: str
    budget: int | None
    items: int
    reads: int
    recall_layer0: float
    recall_layers: float
    complete_items: float

    @classmethod
    def of(cls, family: str, method: str, budget: int | None, recalls: list[ReadRecall]) -> RecallSummary:
        layer0 = [share for r in recalls for share in r.layer0]
        layers = [share for r in recalls for share in r.layers]
        return cls(family, method, budget, len(recalls), len(layer0), sum(layer0) / len(layer0),
                   sum(layers) / len(layers), sum(r.complete for r in recalls) / len(recalls))


def recording_engine(model, tokenizer, factory: Callable[[], KVPolicy]) -> Engine:
    """An engine whose steps run eagerly: the snapshots between them are host work that a CUDA graph
    or a compiled forward would not replay."""
    from longflow.models import eos_token_ids

    return Engine(model, factory, eos_token_ids(model, tokenizer), tokenizer.pad_token_id,
                  EngineConfig(cuda_graph=False, compile=False))


def family_recall(model, tokenizer, factory: Callable[[], KVPolicy], family: str, limit: int,
                  batch_size: int) -> list[ReadRecall]:
    """Recall of `factory`'s policy over the first `limit` held-out items of `family`."""
    engine = recording_engine(model, tokenizer, factory)
    teachers = [teacher(item, tokenizer) for item in heldout(family, limit)]
    recalls = []
    for start in range(0, len(teachers), batch_size):
        recalls += teacher_forced_recall(engine, teachers[start:start + batch_size])[0]
    return recalls


def policy_factory(method: str, budget: int | None) -> Callable[[], KVPolicy]:
    """A method of `conf/method/` at `budget`, as the entry point builds it."""
    import functools

    from evals.configs import method_config
    from longflow.methods import build_policy

    config = method_config(method)
    build_policy(config, budget)  # checks the method and the budget once, with the harness's messages
    return functools.partial(build_policy, config, budget)


def method_budgets(method: str, budgets: list[int]) -> list[int | None]:
    """The budgets a sweep runs `method` at: `budgets`, or only None for a method that takes none
    (the full cache: its class's `uses_budget`)."""
    from evals.configs import method_config
    from longflow.methods import uses_budget

    return budgets if uses_budget(method_config(method)) else [None]


def write(summaries: list[RecallSummary], out: Path) -> None:
    """`<out>.csv` and `<out>.md`: one row per (family, method, budget)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = [asdict(summary) for summary in summaries]
    with out.with_suffix(".csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| family | method | budget | items | reads | recall, layer 0 (%) | recall, all layers (%) | "
             "items with every read held everywhere (%) |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {s.family} | {s.method} | {s.budget if s.budget is not None else 'full'} | {s.items} | {s.reads} | "
              f"{100 * s.recall_layer0:.1f} | {100 * s.recall_layers:.1f} | {100 * s.complete_items:.1f} |"
              for s in summaries]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    from evals.configs import model_spec
    from longflow.models import load_model, resolve_device

    parser = argparse.ArgumentParser(prog="python -m evals.canary.recall", description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--methods", default="vanilla,streaming,h2o,rkv,longflow")
    parser.add_argument("--budgets", default="96,192,384")
    parser.add_argument("--limit", type=int, default=16, help="first N held-out items of each family")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--model", default="canary_suite", help="a config of conf/model/")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=Path("results/canary_suite/recall"),
                        help="writes <out>.csv, <out>.md and <out>.json (every read's recall)")
    args = parser.parse_args(argv)
    families = args.families.split(",")
    if unknown := set(families) - set(FAMILIES):
        raise UserError(f"unknown families {sorted(unknown)}; choose from {list(FAMILIES)}")
    model, tokenizer = load_model(model_spec(args.model), resolve_device(args.device))
    summaries, every = [], {}
    for family in families:
        for method in args.methods.split(","):
            for budget in method_budgets(method, [int(b) for b in args.budgets.split(",")]):
                recalls = family_recall(model, tokenizer, policy_factory(method, budget), family, args.limit,
                                        args.batch_size)
                summary = RecallSummary.of(family, method, budget, recalls)
                summaries.append(summary)
                every[f"{family}/{method}/{budget}"] = [asdict(r) for r in recalls]
                print(json.dumps(asdict(summary)), flush=True)
    write(summaries, args.out)
    args.out.with_suffix(".json").write_text(json.dumps(every) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
