"""The canary training script end to end on the CPU at toy scale: it learns, saves a model the harness
can load, and logs what the model card reports."""

from __future__ import annotations

import json

import pytest
import torch

from evals.canary.train import main
from evals.configs import model_spec
from longflow.models import load_model


@pytest.mark.slow
def test_training_learns_and_saves_a_loadable_model(tmp_path):
    out = tmp_path / "model"
    task = {"variables": 4, "min_steps": 1, "max_steps": 3}
    assert main(["--out", str(out), "--steps", "60", "--warmup", "10", "--hidden", "64", "--heads", "4",
                 "--intermediate", "128", "--layers", "2", "--tokens-per-step", "2048", "--eval-items", "8",
                 "--train-min-steps", "1", "--train-max-steps", "3", "--task", json.dumps(task)]) == 0
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps"] == 60 and log["task"]["variables"] == 4 and log["heldout_rows_excluded"] >= 0
    curve = log["curve"]
    assert curve[-1]["val_loss"] < 0.5 * curve[0]["val_loss"]
    assert {"heldout_teacher_forced", "heldout_greedy", "environment", "config"} <= set(log)
    assert (out / "loss_curve.png").stat().st_size > 1000
    model, tokenizer = load_model(model_spec("canary", hub_id=str(out)), torch.device("cpu"))
    assert model.config.num_hidden_layers == 2 and tokenizer.eos_token == "<|im_end|>"
