"""Trains the canary suite's model: one small Qwen3 for the five families of `evals.canary.families`.

    python -m evals.canary.train_suite --out evals/canary/suite_model --seconds 180 --greedy false  # committed
    python -m evals.canary.train_suite --out /tmp/suite --steps 2 --tokens-per-step 2048 --validation-rows 1 \
        --eval-items 2   # a CPU smoke run

The model starts from the canary model (`--init`, the canary's folder: same architecture, and the
suite tokenizer is the canary's with four words on ids the canary left unused), so it already
executes the state family, reads latest mentions and sums mod 23; `--init ''` trains from random
weights with `evals.canary.train.TrainConfig`'s architecture. Each step draws one family (by
`--weights`) and one step count, a dense batch of that family's training items on the device
(`evals.canary.suite_batches`); rows equal to a held-out item are left out of the loss and counted.
The loss covers the output only. The run length, the schedule, the bf16 rounding and the float32
held-out scoring (teacher-forced, then `model.generate` with the full cache) are
`evals.canary.train`'s, per family. `<out>/train_log.json` (config, environment, curve with each
family's validation loss and share solved, held-out accuracy per family) and `<out>/model.safetensors`
are rewritten at every curve point, so a run cut short leaves its last state.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import Qwen3ForCausalLM

from evals.canary import vocabulary
from evals.canary.batches import LINE_TOKENS
from evals.canary.families import FAMILIES, HELDOUT_SIZE, MAX_STEPS, heldout
from evals.canary.fitting import RunLength, adamw, descend, learning_rate, sync
from evals.canary.suite_batches import FamilyBatches, heldout_mask, suite_batches
from evals.canary.train import TrainConfig, environment, output_loss, save_weights
from evals.datasets import Item
from evals.prompts import build_messages, render_prompt
from longflow.errors import UserError
from longflow.models import PROJECT_ROOT

LOG_EVERY = 100


@dataclass
class SuiteTrainConfig:
    seed: int = 0
    init: str = "evals/canary/model"  # a model folder (relative: to the project root), or "" for random weights
    steps: int = 3000
    seconds: float | None = None  # train for this long instead (the evaluation comes after)
    tokens_per_step: int = 131072
    # A quarter of the canary's 2e-3 from scratch: the run starts from a trained model, whose state
    # family a full-size first step already unlearns.
    lr: float = 5e-4
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    # A little wider than the families' 10-84 steps, as for the canary.
    train_min_steps: int = 8
    train_max_steps: int = 90
    # Share of the steps per family: the state family, which the canary model knows, and the chain,
    # the simplest, get half of the others'.
    weights: dict = field(default_factory=lambda: {"state": 1, "lookup": 2, "plan": 2, "redundant": 2, "chain": 1})
    eval_items: int = HELDOUT_SIZE
    validation_rows: int = 32  # per family, of the longest items (84 steps), at every curve point
    # Also score the held-out splits by `model.generate` (teacher-forced exactness is the same verdict
    # for these items, at a fraction of the time; `evals.run` grades the generations on a CPU).
    greedy: bool = True

    def __post_init__(self):
        if set(self.weights) != set(FAMILIES) or min(self.weights.values()) < 0 or not sum(self.weights.values()):
            raise UserError(f"weights must give every family of {list(FAMILIES)} a non-negative share, "
                            f"got {self.weights}")
        if not 1 <= self.train_min_steps <= self.train_max_steps < 100:
            raise UserError("train steps need 1 <= train_min_steps <= train_max_steps < 100 (one token a countdown)")


def initial_model(config: SuiteTrainConfig, tokenizer, device: torch.device) -> Qwen3ForCausalLM:
    if not config.init:
        return Qwen3ForCausalLM(TrainConfig().architecture(tokenizer)).to(device)
    folder = Path(config.init)
    folder = folder if folder.is_absolute() else PROJECT_ROOT / folder
    model = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device)
    if model.config.vocab_size != vocabulary.VOCAB_SIZE:
        raise UserError(f"{folder}: vocab size {model.config.vocab_size}, the suite tokenizer has "
                        f"{vocabulary.VOCAB_SIZE}")
    return model


@torch.no_grad()
def teacher_forced(model, family: FamilyBatches, params: torch.Tensor, rows: int = 32) -> dict:
    """Held-out items in one forward each: solved when no output token is a wrong argmax."""
    solved, prompt_len = 0, prompt_length(family)
    for steps in params[:, -1].unique().tolist():
        group = params[params[:, -1] == steps]
        for start in range(0, len(group), rows):
            solved += int((output_loss(model, family.tokens(group[start:start + rows]), prompt_len)[1] < 0).sum())
    return {"accuracy": solved / len(params), "items": len(params)}


def prompt_length(family: FamilyBatches) -> int:
    return family.batches.prompt_len if family.family == "state" else len(family.prompt)


@torch.no_grad()
def greedy_accuracy(model, tokenizer, family: str, size: int, device: torch.device) -> dict:
    """Greedy generation with the full cache on a family's held-out split, graded on the boxed
    answer after "</think>" (the harness's rule for these integer answers)."""
    items = heldout(family, size)
    prompts = [render_prompt(tokenizer, build_messages(Item(str(i), item.question(), str(item.answer)), "math"),
                             thinking=True) for i, item in enumerate(items)]
    longest = max(len(tokenizer(item.output(), add_special_tokens=False)["input_ids"]) for item in items)
    output = model.generate(
        torch.tensor(prompts, device=device), attention_mask=torch.ones(size, len(prompts[0]), dtype=torch.long,
                                                                        device=device),
        max_new_tokens=longest + 16, do_sample=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )[:, len(prompts[0]):]
    correct = []
    for item, row in zip(items, output.tolist(), strict=True):
        if tokenizer.eos_token_id in row:
            row = row[:row.index(tokenizer.eos_token_id) + 1]
        text = tokenizer.decode(row, skip_special_tokens=True)
        answer = re.findall(r"\\boxed\{(\d+)\}", text.rsplit("</think>", 1)[-1]) if "</think>" in text else []
        correct.append(bool(answer) and answer[-1] == str(item.answer))
    return {"accuracy": sum(correct) / size, "items": size}


def save(model, tokenizer, out: Path, log: dict) -> None:
    """The weights in bf16 (training goes on in float32), the tokenizer and the log."""
    save_weights(model, tokenizer, out)
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")


def fit(config: SuiteTrainConfig, model, families: dict[str, FamilyBatches], device: torch.device,
        checkpoint) -> dict:
    """The training loop; returns what the log keeps of it. `checkpoint(run)` at every curve point."""
    optimizer = adamw(config, model, device)
    generator = torch.Generator(device=device).manual_seed(config.seed)
    choices = torch.Generator().manual_seed(config.seed + 1)
    names = list(FAMILIES)
    shares = torch.tensor([float(config.weights[name]) for name in names])
    validation_generator = torch.Generator(device=device).manual_seed(config.seed + 2)
    validation = {name: family.draw(validation_generator, config.validation_rows, MAX_STEPS)
                  for name, family in families.items()}
    amp = torch.autocast(device.type, dtype=torch.bfloat16)
    run = {"curve": [], "steps": 0, "tokens": 0, "heldout_rows_excluded": 0}
    excluded = torch.zeros((), dtype=torch.long, device=device)
    run_length = RunLength(config, device)

    def record(step: int, loss: torch.Tensor | None, family: str | None) -> None:
        model.eval()
        point = {"step": step, "seconds": round(run_length.elapsed(), 1), "tokens": run["tokens"],
                 "lr": learning_rate(config, max(step - 1, 0), run_length.total), "family": family,
                 "loss": None if loss is None else round(loss.item(), 5)}
        with amp, torch.no_grad():
            for name, family_batches in families.items():
                val_loss, first = output_loss(model, family_batches.tokens(validation[name]),
                                              prompt_length(family_batches))
                point[f"val_loss_{name}"] = round(val_loss.mean().item(), 5)
                point[f"val_exact_{name}"] = round((first < 0).float().mean().item(), 4)
        model.train()
        run["curve"].append(point)
        run.update(steps=step, heldout_rows_excluded=int(excluded), train_seconds=point["seconds"])
        print(json.dumps(point), flush=True)
        checkpoint(run)

    model.train()
    record(0, None, None)
    step = 0
    while run_length.goes_on(step):
        name = names[int(torch.multinomial(shares, 1, generator=choices))]
        steps = int(torch.randint(config.train_min_steps, config.train_max_steps + 1, (1,), generator=choices))
        family = families[name]
        length = prompt_length(family) + LINE_TOKENS * steps + 9
        params = family.draw(generator, max(1, config.tokens_per_step // length), steps)
        keep = ~heldout_mask(params, family.heldout)
        tokens = family.tokens(params)
        with amp:
            loss, _ = output_loss(model, tokens, prompt_length(family))
        excluded += (~keep).sum()
        loss = (loss * keep).sum() / keep.sum().clamp(min=1)
        descend(config, optimizer, model, loss, step, run_length.total)
        run["tokens"] += tokens.numel()
        step += 1
        run_length.stepped(step)
        if step % LOG_EVERY == 0 or step == run_length.total:
            record(step, loss, name)
        if run_length.overran(step):
            record(step, loss, name)
            break
    sync(device)
    return run


def train(config: SuiteTrainConfig, out: Path, device: torch.device) -> dict:
    torch.manual_seed(config.seed)
    torch.backends.cuda.matmul.allow_tf32 = False  # the evaluation must compute as the CPU harness does
    tokenizer = vocabulary.build_suite()
    families = suite_batches(tokenizer, device)
    model = initial_model(config, tokenizer, device)
    model.config.use_cache = False
    params = sum(p.numel() for p in model.parameters())
    log = {"config": asdict(config), "parameters": params, "environment": environment(device)}
    print(f"canary suite training: {params / 1e6:.2f}M parameters on {device}, from "
          f"{config.init or 'random weights'}", flush=True)

    def checkpoint(run: dict) -> None:
        save(model, tokenizer, out, {**log, **run})

    run = fit(config, model, families, device, checkpoint)
    model.eval()
    state = {name: tensor.to(torch.bfloat16).float() for name, tensor in model.state_dict().items()}
    model.load_state_dict(state)  # bf16-rounded weights, float32 arithmetic: the harness on a CPU
    log.update(run)
    log["heldout_teacher_forced"], log["heldout_greedy"] = {}, {}
    for name, family in families.items():
        started = time.perf_counter()
        forced = teacher_forced(model, family, family.heldout[:config.eval_items])
        forced["seconds"] = round(time.perf_counter() - started, 1)
        log["heldout_teacher_forced"][name] = forced
        print(f"{name} held-out, teacher-forced: {json.dumps(forced)}", flush=True)
        checkpoint(log)
    for name in families if config.greedy else ():
        started = time.perf_counter()
        greedy = greedy_accuracy(model, tokenizer, name, config.eval_items, device)
        greedy["seconds"] = round(time.perf_counter() - started, 1)
        log["heldout_greedy"][name] = greedy
        print(f"{name} held-out, greedy full cache: {json.dumps(greedy)}", flush=True)
        checkpoint(log)
    plot_curve(log, out / "loss_curve.png")
    return log


def plot_curve(log: dict, path: Path) -> Path:
    """Each family's validation loss (log scale) and share of validation items solved, against steps."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    curve = log["curve"]
    steps = [point["step"] for point in curve]
    figure = Figure(figsize=(9, 3.2), layout="constrained")
    FigureCanvasAgg(figure)
    loss, solved = figure.subplots(1, 2)
    for name in FAMILIES:
        loss.plot(steps, [max(point[f"val_loss_{name}"], 1e-7) for point in curve], label=name)
        solved.plot(steps, [100 * point[f"val_exact_{name}"] for point in curve], label=name)
    loss.set(yscale="log", xlabel="step", ylabel="validation loss per output token")
    solved.set(xlabel="step", ylabel="validation items solved (%)", ylim=(0, 105))
    solved.legend(frameon=False, fontsize=8)
    for ax in (loss, solved):
        ax.grid(alpha=0.3)
    greedy = log.get("heldout_greedy", {})
    summary = ", ".join(f"{name} {100 * result['accuracy']:.1f}%" for name, result in greedy.items())
    figure.suptitle(f"canary suite training ({log['parameters'] / 1e6:.2f}M parameters, {log['steps']} steps, "
                    f"{log['environment']['device']})" + (f"\nheld-out greedy: {summary}" if summary else ""),
                    fontsize=9)
    figure.savefig(path, dpi=120)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals.canary.train_suite", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the model, tokenizer and train_log.json")
    parser.add_argument("--replot", action="store_true", help="only redraw <out>/loss_curve.png from its log")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    for name, value in asdict(SuiteTrainConfig()).items():
        kind = {"seconds": float, "weights": json.loads, "greedy": json.loads}.get(name, type(value))
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=value,
                            help="shares per family as JSON" if name == "weights" else None)
    args = vars(parser.parse_args(argv))
    out, device = args.pop("out"), torch.device(args.pop("device"))
    if args.pop("replot"):
        print(plot_curve(json.loads((out / "train_log.json").read_text()), out / "loss_curve.png"))
        return 0
    log = train(SuiteTrainConfig(**args), out, device)
    print(json.dumps({key: log[key] for key in ("steps", "train_seconds", "heldout_teacher_forced", "heldout_greedy")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
