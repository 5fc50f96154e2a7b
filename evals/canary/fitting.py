"""What the canary model's trainers share (`evals.canary.train`, `evals.canary.train_suite`): AdamW with
weight decay on the matrices only, one descent step, the warm-up and cosine schedule, and the run's
length, a number of steps or as many as fit in a time budget.

A config passed here has the fields of `evals.canary.train.TrainConfig` that the schedule reads: `steps`,
`seconds`, `lr`, `min_lr_ratio`, `warmup`, `weight_decay`, `grad_clip`.
"""

from __future__ import annotations

import math
import time

import torch

CALIBRATION_STEPS = 60


def adamw(config, model: torch.nn.Module, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the model's parameters, the biases and norms (fewer than two dimensions) undecayed."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=config.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def learning_rate(config, step: int, total: int | None) -> float:
    """Linear warm-up, then cosine decay to `min_lr_ratio` of `lr` over the run's `total` steps (the
    warm-up alone while the total is not yet known)."""
    if step < config.warmup or total is None:
        return config.lr * min(1.0, (step + 1) / config.warmup)
    progress = min(1.0, (step - config.warmup) / max(1, total - config.warmup))
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def descend(config, optimizer: torch.optim.Optimizer, model: torch.nn.Module, loss: torch.Tensor,
            step: int, total: int | None) -> None:
    """One step down `loss` at step `step`'s learning rate, the gradient's norm clipped to `grad_clip`."""
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(config, step, total)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
    optimizer.step()


class RunLength:
    """How many steps a run takes: `config.steps`, or with `config.seconds` as many as fit.

    Timed runs time steps `CALIBRATION_STEPS // 3` to `CALIBRATION_STEPS`, inside the warm-up, whose
    learning rate does not depend on the run's length, and from a third of the way in, since the first
    steps carry one-time costs (kernel loading); `total` is None until then. A run that still goes past
    1.1x its time budget stops.
    """

    def __init__(self, config, device: torch.device):
        self.seconds = config.seconds
        self.warmup = config.warmup
        self.total: int | None = config.steps if config.seconds is None else None
        self.device = device
        self.start = time.perf_counter()
        self.timed_from: tuple[int, float] | None = None

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def goes_on(self, step: int) -> bool:
        """Whether step `step` (counted from 0) is part of the run."""
        return self.total is None or step < self.total

    def stepped(self, step: int) -> None:
        """Called after `step` steps: sets the total once the calibration steps are timed."""
        if self.total is not None or step not in (CALIBRATION_STEPS // 3, CALIBRATION_STEPS):
            return
        sync(self.device)
        if step == CALIBRATION_STEPS // 3:
            self.timed_from = (step, time.perf_counter())
        else:
            per_step = (time.perf_counter() - self.timed_from[1]) / (step - self.timed_from[0])
            self.total = max(self.warmup + 1, step + int((self.seconds - self.elapsed()) / per_step))
            print(f"calibrated: {per_step * 1000:.0f} ms a step -> {self.total} steps", flush=True)

    def overran(self, step: int) -> bool:
        """Whether the run, `step` steps in, is past 1.1x its time budget and must stop."""
        if self.seconds is None or self.elapsed() <= 1.1 * self.seconds:
            return False
        print(f"stopped at step {step} of {self.total}: past 1.1x the time budget", flush=True)
        return True


def sync(device: torch.device) -> None:
    """Waits for the device's queued work, so that a timer read after it counts that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
