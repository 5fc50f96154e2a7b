"""Eviction maps: for one canary suite item, one panel per method, which token positions the KV cache
held at each output step (x: step, y: position), with the reads each step needs overlaid; written
as PNG and PDF.

    python -m evals.canary.eviction_map --family lookup --item 0 --budget 192 \\
        --methods vanilla,streaming,h2o,rkv,longflow --out results/canary_suite/eviction_map_lookup.png

The item's reference output is fed through each method's policy (`evals.canary.recall`, teacher-
forced), and every step's held positions are recorded. Grey: the share of the layer's KV heads
holding a position (`--layer`, default 0); a read's copies are dots at the step that reads them,
green where the layer held one of them then, red where it held none. A panel's title gives its
dependency recall.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from evals.canary.families import FAMILIES, heldout
from evals.canary.recall import (
    HeldTrace,
    ReadRecall,
    Teacher,
    method_budgets,
    policy_factory,
    recording_engine,
    teacher,
    teacher_forced_recall,
)
from longflow.errors import UserError


def held_matrix(trace: HeldTrace, layer: int, length: int) -> np.ndarray:
    """`[length, steps]` share of the layer's KV heads holding each position at each traced step."""
    matrix = np.zeros((length, len(trace.steps)))
    for column, positions in enumerate(trace.positions):
        held = positions[layer].numpy()  # [Hkv, S]
        for head in held:
            head = head[(head >= 0) & (head < length)]
            matrix[head, column] += 1.0 / len(held)
    return matrix


def trace_method(model, tokenizer, method: str, budget: int | None, item: Teacher) -> tuple[ReadRecall, HeldTrace]:
    engine = recording_engine(model, tokenizer, policy_factory(method, budget))
    recalls, trace = teacher_forced_recall(engine, [item], trace_row=0)
    return recalls[0], trace


def draw(panels: list[tuple[str, ReadRecall, HeldTrace]], item: Teacher, layer: int, title: str,
         out: Path) -> list[Path]:
    """One panel per (label, recall, trace), stacked, sharing the axes; written to `out` (PNG) and
    the same name as a PDF; returns both paths."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    length = len(item.prompt) + len(item.output)
    figure = Figure(figsize=(10, 2.2 * len(panels) + 0.6), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (label, recall, trace) in zip(axes, panels, strict=True):
        matrix = held_matrix(trace, layer, length)
        first = trace.steps[0]
        ax.imshow(matrix, origin="lower", aspect="auto", cmap="Greys", vmin=0, vmax=1.5, interpolation="nearest",
                  extent=(first - 0.5, first + len(trace.steps) - 0.5, -0.5, length - 0.5))
        shares = recall.layer0 if layer == 0 else None
        for index, (at, copies) in enumerate(item.reads):
            held = shares[index] > 0 if shares is not None else matrix[list(copies), at - first].max() > 0
            ax.scatter([at] * len(copies), copies, s=6, color="tab:green" if held else "tab:red", linewidths=0)
        ax.axhline(len(item.prompt) - 0.5, color="tab:blue", linewidth=0.6, linestyle=":")
        ax.set_ylabel("position")
        ax.set_title(f"{label}: dependency recall {100 * np.mean(recall.layer0):.1f}% (layer 0), "
                     f"{100 * np.mean(recall.layers):.1f}% (all layers)", fontsize=9)
    axes[-1].set_xlabel("output step")
    figure.suptitle(title, fontsize=10)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=130)
    figure.savefig(out.with_suffix(".pdf"), metadata={"CreationDate": None})
    return [out, out.with_suffix(".pdf")]


def main(argv: list[str] | None = None) -> int:
    from evals.configs import model_spec
    from longflow.models import load_model, resolve_device

    parser = argparse.ArgumentParser(prog="python -m evals.canary.eviction_map", description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="lookup", choices=FAMILIES)
    parser.add_argument("--item", type=int, default=0, help="index in the family's held-out split")
    parser.add_argument("--budget", type=int, default=192)
    parser.add_argument("--methods", default="vanilla,streaming,h2o,rkv,longflow")
    parser.add_argument("--layer", type=int, default=0)
    parser.add_argument("--model", default="canary_suite", help="a config of conf/model/")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=None, help="default results/canary_suite/eviction_map_<family>.png")
    args = parser.parse_args(argv)
    if not 0 <= args.item < 200:
        raise UserError(f"--item must be an index of the held-out split, 0 to 199, got {args.item}")
    model, tokenizer = load_model(model_spec(args.model), resolve_device(args.device))
    if not 0 <= args.layer < model.config.num_hidden_layers:
        raise UserError(f"--layer must be in [0, {model.config.num_hidden_layers}), got {args.layer}")
    item = teacher(heldout(args.family, args.item + 1)[args.item], tokenizer)
    panels = []
    for method in args.methods.split(","):
        budget, = method_budgets(method, [args.budget])
        recall, trace = trace_method(model, tokenizer, method, budget, item)
        panels.append((method if budget is None else f"{method}, {budget} slots", recall, trace))
    out = args.out or Path(f"results/canary_suite/eviction_map_{args.family}.png")
    title = (f"{args.family} item {args.item} ({len(item.prompt)} prompt + {len(item.output)} output tokens): "
             f"positions held by layer {args.layer} at each step; reads green if held, red if lost")
    for path in draw(panels, item, args.layer, title, out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
