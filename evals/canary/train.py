"""Trains the canary model: a small Qwen3 that executes `evals.canary.task` programs.

    python -m evals.canary.train --out evals/canary/model --steps 5000   # the committed model (one H200)
    python -m evals.canary.train --out /tmp/canary --steps 40 --hidden 64 --layers 2   # a CPU smoke run
    python -m evals.canary.train --out /tmp/canary16 --seconds 300 --task '{"variables": 16}'  # another task

Reproducible from `--seed`: the training programs come from a seeded generator on the device, one
step count per batch (every row of a batch has the same length, so nothing is padded), and never
equal a held-out program (rows that would are left out of the loss and counted). The loss covers the
model's output only: the thinking lines, the boxed answer and the end of turn.

The run is `--steps` long (5000, the committed model's), or as long as fits in `--seconds`: then steps
`evals.canary.fitting.CALIBRATION_STEPS // 3` to `CALIBRATION_STEPS` (inside the warm-up, whose learning rate does not
depend on the run length; the first steps carry one-time costs) are timed, and the run takes as many
steps as fit, with a cosine schedule over them. The step count is logged: `--steps N` repeats the
same schedule. At the end the weights are rounded to bf16 and saved with the tokenizer, and the
held-out split is scored twice in float32 as the harness runs it on a CPU: teacher-forced (an item
is solved when every output token is the argmax given the reference before it, which is exactly
when greedy decoding writes the reference) and by greedy generation (`model.generate`, full cache).
Everything lands in `<out>/train_log.json` (config, environment, loss curve, accuracy, timings) and
`<out>/loss_curve.png` (`--replot` redraws it from the log).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from transformers import Qwen3Config, Qwen3ForCausalLM

from evals.canary import vocabulary
from evals.canary.batches import LINE_TOKENS, Batches, heldout_mask, heldout_programs
from evals.canary.fitting import RunLength, adamw, descend, learning_rate, sync
from evals.canary.task import CanaryTask
from evals.datasets import Item
from evals.prompts import build_messages, render_prompt

LOG_EVERY = 50


@dataclass
class TrainConfig:
    seed: int = 0
    steps: int = 5000
    seconds: float | None = None  # train for this long instead (the evaluation comes after)
    tokens_per_step: int = 131072
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    # Step counts of the training programs: a little wider than the task's, uniform per batch so that
    # long programs, the hard ones, get a large share of the tokens.
    train_min_steps: int = 6
    train_max_steps: int = 90
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 2
    intermediate: int = 768
    rope_theta: float = 10000.0
    max_positions: int = 4096
    eval_items: int = 200
    task: dict = field(default_factory=dict)  # CanaryTask knobs; empty = the default task

    def architecture(self, tokenizer) -> Qwen3Config:
        return Qwen3Config(
            vocab_size=vocabulary.VOCAB_SIZE, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            head_dim=self.hidden // self.heads, max_position_embeddings=self.max_positions,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta}, tie_word_embeddings=True,
            bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )


def output_loss(model, tokens: torch.Tensor, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row mean cross-entropy over the output tokens `[B]`, and the first output position whose
    argmax is not the reference token `[B]` (-1 where there is none: greedy decoding writes the row)."""
    logits = model(input_ids=tokens[:, :-1]).logits[:, prompt_len - 1:].float()  # [B, output, V]
    targets = tokens[:, prompt_len:]
    loss = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(dim=1)
    wrong = logits.argmax(dim=-1) != targets
    first = torch.where(wrong.any(dim=1), wrong.int().argmax(dim=1), -1)
    return loss, first


@torch.no_grad()
def teacher_forced(model, batches: Batches, programs: torch.Tensor, rows: int = 32) -> dict:
    """Held-out programs scored in one forward each: solved when no output token is a wrong argmax.

    For the others, where the first wrong token sits in its line (by the line's fields), which says
    what the model has not learnt: a table lookup (names), a retrieval (values read) or the sum.
    """
    fields = dict(zip(batches.line_holes.tolist(), batches.LINE_FIELDS, strict=True))
    solved, errors = 0, {}
    for steps in programs[:, -1].unique().tolist():
        group = programs[programs[:, -1] == steps]
        for start in range(0, len(group), rows):
            firsts = output_loss(model, batches.tokens(group[start:start + rows]), batches.prompt_len)[1]
            for first in firsts.tolist():
                offset = first - len(batches.think)
                if first < 0:
                    solved += 1
                    continue
                if offset >= LINE_TOKENS * steps:
                    field = "answer"
                else:
                    field = fields.get(offset % LINE_TOKENS, "format") if offset >= 0 else "format"
                errors[field] = errors.get(field, 0) + 1
    return {"accuracy": solved / len(programs), "items": len(programs), "first_error_field": errors}


@torch.no_grad()
def greedy_accuracy(model, tokenizer, task: CanaryTask, size: int, device: torch.device) -> dict:
    """Greedy generation with the full cache on the held-out split, graded on the boxed answer after
    "</think>" (the harness's rule for these integer answers)."""
    programs = task.heldout(size)
    prompts = [render_prompt(tokenizer, build_messages(Item(str(i), p.question(), str(p.answer)), "math"),
                             thinking=True) for i, p in enumerate(programs)]
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("held-out prompts differ in length; the canary tokenizer makes them equal")
    output = model.generate(
        torch.tensor(prompts, device=device), attention_mask=torch.ones(size, len(prompts[0]), dtype=torch.long,
                                                                        device=device),
        max_new_tokens=LINE_TOKENS * task.max_steps + 16, do_sample=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )[:, len(prompts[0]):]
    correct, lengths = [], []
    for program, row in zip(programs, output.tolist(), strict=True):
        if tokenizer.eos_token_id in row:
            row = row[:row.index(tokenizer.eos_token_id) + 1]
        text = tokenizer.decode(row, skip_special_tokens=True)
        answer = re.findall(r"\\boxed\{(\d+)\}", text.rsplit("</think>", 1)[-1]) if "</think>" in text else []
        correct.append(bool(answer) and answer[-1] == str(program.answer))
        lengths.append(len(row))
    return {"accuracy": sum(correct) / size, "items": size, "mean_output_tokens": sum(lengths) / size,
            "max_output_tokens": max(lengths)}


def fit(config: TrainConfig, model, batches: Batches, heldout: torch.Tensor, device: torch.device) -> dict:
    """The training loop; returns what the log keeps of it (curve, steps, tokens, time)."""
    optimizer = adamw(config, model, device)
    generator = torch.Generator(device=device).manual_seed(config.seed)
    step_counts = torch.Generator().manual_seed(config.seed + 1)
    # The longest programs both the task and the training have: the hardest items of the held-out split.
    validation = batches.programs(torch.Generator(device=device).manual_seed(config.seed + 2), 64,
                                  min(batches.task.max_steps, config.train_max_steps))
    amp = torch.autocast(device.type, dtype=torch.bfloat16)
    curve, tokens_seen = [], 0
    excluded = torch.zeros((), dtype=torch.long, device=device)  # summed on the device: no sync a step
    run_length = RunLength(config, device)

    def record(step: int, loss: torch.Tensor | None) -> None:
        """A curve point: the last training batch's loss and the validation programs' loss and share
        solved (teacher-forced)."""
        model.eval()
        with amp, torch.no_grad():
            val_loss, val_first = output_loss(model, batches.tokens(validation), batches.prompt_len)
        model.train()
        point = {"step": step, "seconds": round(run_length.elapsed(), 1), "tokens": tokens_seen,
                 "lr": learning_rate(config, max(step - 1, 0), run_length.total),
                 "loss": None if loss is None else round(loss.item(), 5),
                 "val_loss": round(val_loss.mean().item(), 5),
                 "val_exact": round((val_first < 0).float().mean().item(), 4)}
        curve.append(point)
        print(json.dumps(point), flush=True)

    record(0, None)  # the untrained model
    step = 0
    while run_length.goes_on(step):
        steps = int(torch.randint(config.train_min_steps, config.train_max_steps + 1, (1,), generator=step_counts))
        length = batches.prompt_len + LINE_TOKENS * steps + 9
        programs = batches.programs(generator, max(1, config.tokens_per_step // length), steps)
        keep = ~heldout_mask(programs, heldout)
        excluded += (~keep).sum()
        tokens = batches.tokens(programs)
        with amp:
            loss, _ = output_loss(model, tokens, batches.prompt_len)
        loss = (loss * keep).sum() / keep.sum().clamp(min=1)
        descend(config, optimizer, model, loss, step, run_length.total)
        tokens_seen += tokens.numel()
        step += 1
        run_length.stepped(step)
        if step % LOG_EVERY == 0 or step == run_length.total:
            record(step, loss)
        if run_length.overran(step):
            break
    sync(device)
    return {"steps": step, "tokens": tokens_seen, "train_seconds": round(run_length.elapsed(), 1),
            "heldout_rows_excluded": int(excluded), "curve": curve}


def train(config: TrainConfig, out: Path, device: torch.device) -> dict:
    torch.manual_seed(config.seed)
    torch.backends.cuda.matmul.allow_tf32 = False  # the evaluation must compute as the CPU harness does
    task = CanaryTask(**config.task)
    tokenizer = vocabulary.build()
    batches = Batches(task, tokenizer, device)
    model = Qwen3ForCausalLM(config.architecture(tokenizer)).to(device)
    model.config.use_cache = False
    heldout = heldout_programs(task, config.eval_items, device)
    params = sum(p.numel() for p in model.parameters())
    print(f"canary training: {params / 1e6:.2f}M parameters on {device}, {config.tokens_per_step} tokens a step",
          flush=True)
    try:
        run = fit(config, model, batches, heldout, device)
    finally:  # whatever happened, keep the weights
        model.eval()
        save_weights(model, tokenizer, out)
    model.to(torch.bfloat16).float()  # bf16-rounded weights, float32 arithmetic: the harness on a CPU

    start = time.perf_counter()
    forced = teacher_forced(model, batches, heldout)
    forced["seconds"] = round(time.perf_counter() - start, 1)
    print(f"held-out, teacher-forced: {json.dumps(forced)}", flush=True)
    start = time.perf_counter()
    greedy = greedy_accuracy(model, tokenizer, task, config.eval_items, device)
    greedy["seconds"] = round(time.perf_counter() - start, 1)
    print(f"held-out, greedy full cache: {json.dumps(greedy)}", flush=True)
    log = {
        "config": asdict(config), "task": asdict(task), "parameters": params,
        **{key: value for key, value in run.items() if key != "curve"},
        "environment": environment(device),
        "heldout_teacher_forced": forced, "heldout_greedy": greedy, "curve": run["curve"],
    }
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    plot_curve(log, out / "loss_curve.png")
    return log


def save_weights(model, tokenizer, out: Path) -> None:
    """The model in bf16 (from a copy: the caller's model is left as it is) with its generation
    config set for the harness's tokenizer, and the tokenizer, into the folder `out`."""
    out.mkdir(parents=True, exist_ok=True)
    rounded = copy.deepcopy(model).to(torch.bfloat16)
    rounded.config.use_cache = True
    rounded.generation_config.eos_token_id = tokenizer.eos_token_id
    rounded.generation_config.pad_token_id = tokenizer.pad_token_id
    rounded.generation_config.bos_token_id = None
    rounded.save_pretrained(out)
    tokenizer.save_pretrained(out)


def environment(device: torch.device) -> dict:
    """What a training log records of where it ran."""
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def plot_curve(log: dict, path: Path) -> Path:
    """The training log's curve: training and validation loss (log scale) and the validation programs
    solved (teacher-forced), against steps."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps = [point["step"] for point in log["curve"]]
    figure = Figure(figsize=(8, 3), layout="constrained")
    FigureCanvasAgg(figure)
    loss, solved = figure.subplots(1, 2)
    trained = [point for point in log["curve"] if point["loss"] is not None]
    loss.plot([point["step"] for point in trained], [point["loss"] for point in trained], label="training batch",
              alpha=0.6)
    loss.plot(steps, [point["val_loss"] for point in log["curve"]], label="validation")
    loss.set(yscale="log", xlabel="step", ylabel="loss per output token")
    loss.legend(frameon=False)
    solved.plot(steps, [100 * point["val_exact"] for point in log["curve"]])
    solved.set(xlabel="step", ylabel="validation programs solved (%)", ylim=(0, 105))
    for ax in (loss, solved):
        ax.grid(alpha=0.3)
    greedy = log.get("heldout_greedy", {}).get("accuracy")
    figure.suptitle(f"canary training ({log['parameters'] / 1e6:.2f}M parameters, {log['steps']} steps, "
                    f"{log['environment']['device']})" + ("" if greedy is None else
                                                          f": held-out greedy accuracy {100 * greedy:.1f}%"),
                    fontsize=10)
    figure.savefig(path, dpi=120)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals.canary.train", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the model, tokenizer and train_log.json")
    parser.add_argument("--replot", action="store_true", help="only redraw <out>/loss_curve.png from its log")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    defaults = TrainConfig()
    for name, value in asdict(defaults).items():
        kind = {"seconds": float, "task": json.loads}.get(name, type(value))
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=value,
                            help="CanaryTask knobs as JSON" if name == "task" else None)
    args = vars(parser.parse_args(argv))
    out, device = args.pop("out"), torch.device(args.pop("device"))
    if args.pop("replot"):
        print(plot_curve(json.loads((out / "train_log.json").read_text()), out / "loss_curve.png"))
        return 0
    log = train(TrainConfig(**args), out, device)
    print(json.dumps({key: log[key] for key in ("steps", "train_seconds", "heldout_teacher_forced",
                                                  "heldout_greedy")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
