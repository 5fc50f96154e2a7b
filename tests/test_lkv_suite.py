"""The canary suite model's method files: LKV's trained parameters (evals/canary/lkv_suite/) and
CompressKV's calibration (results/calibration/compresskv/canary_suite-v1.pt). Both are fitted on
training items only: the LKV trainer leaves held-out rows out of its loss and counts them, and the
calibration's items (`evals.canary.families.training_rows`) are outside every held-out split. The
LKV file runs in the harness, where greedy decoding writes the reference exactly for the items that
the training's hard mask predicts token for token (its teacher-forced verdict, computed here
independently of the engine)."""

from __future__ import annotations

import pytest
import torch
from helpers.runs import REPO, records, run_cli, run_dirs
from transformers import AttentionInterface

from evals.canary import families as families_module
from evals.canary import vocabulary
from evals.canary.families import FAMILIES, heldout, heldout_rows, training_rows
from evals.canary.suite_batches import suite_batches
from evals.canary.train_lkv import ATTENTION, LKVTrainConfig, SoftEviction, fit, initial_parameters
from evals.canary.train_suite import prompt_length, teacher_forced
from evals.configs import model_spec
from evals.datasets import load, registry_spec
from evals.store import CONFIG
from longflow.cache import ATTENTION_NAME
from longflow.calibration import load_calibration
from longflow.errors import UserError
from longflow.models import load_model

LKV_FILE = "evals/canary/lkv_suite/lkv.safetensors"
CALIBRATION_FILE = "results/calibration/compresskv/canary_suite-v1.pt"


@pytest.fixture(scope="module")
def suite_model():
    model, tokenizer = load_model(model_spec("canary_suite"), torch.device("cpu"))
    model.requires_grad_(False)
    return model, tokenizer


def test_the_trainer_leaves_heldout_rows_out_of_the_loss(suite_model):
    """Every family's draw replaced by held-out items: each row is counted as excluded, and with no
    row left in the loss the parameters do not move."""
    model, tokenizer = suite_model
    batches = suite_batches(tokenizer, torch.device("cpu"))
    for family in batches.values():
        shortest = family.heldout[family.heldout[:, -1] == family.heldout[:, -1].min()]
        family.draw = lambda generator, batch, steps, rows=shortest: rows[:batch]
    config = LKVTrainConfig(steps=6, model="canary_suite", families=list(FAMILIES), checkpoint_every=100)
    student = SoftEviction(initial_parameters(config, model, torch.Generator().manual_seed(2)))
    before = {name: tensor.detach().clone() for name, tensor in student.params.items()}
    AttentionInterface.register(ATTENTION, student.attention)
    try:
        run = fit(config, model, student, batches, checkpoint=lambda run: None)
    finally:
        model.set_attn_implementation(ATTENTION_NAME)
    drawn = {name: 0 for name in FAMILIES}
    for point in run["curve"]:
        drawn[point["family"]] += point["rows"]
        assert point["kl"] == 0.0
    assert run["heldout_rows_excluded"] == drawn and sum(drawn.values()) > 0
    assert all(torch.equal(tensor.detach(), before[name]) for name, tensor in student.params.items())


def test_the_trainer_checks_its_families():
    with pytest.raises(UserError, match="families"):
        LKVTrainConfig(families=["state", "nothing"])
    with pytest.raises(UserError, match="families"):
        LKVTrainConfig(families=["chain", "chain"])


@pytest.mark.parametrize("family", FAMILIES)
def test_training_rows_are_outside_the_heldout_split(family):
    questions = {row["question"] for row in heldout_rows(family)}
    rows = training_rows(family, 40)
    assert len({row["question"] for row in rows}) == 40 and not questions & {row["question"] for row in rows}
    assert training_rows(family, 5) == rows[:5] and training_rows(family, 5, seed=1) != rows[:5]
    # Through the dataset path, as the calibration command names it.
    spec = registry_spec(f"canary_{family}", generator="evals.canary.families:training_rows",
                         generator_args={"family": family, "size": 3})
    assert [item.question for item in load(spec)] == [row["question"] for row in rows[:3]]


def test_training_rows_skip_a_draw_equal_to_a_heldout_item(monkeypatch):
    real, split, calls = families_module.draw, heldout("plan"), []

    def draw(family, rng):
        calls.append(family)
        return split[7] if len(calls) == 1 else real(family, rng)

    monkeypatch.setattr(families_module, "heldout", lambda family, size=None: split)
    monkeypatch.setattr(families_module, "draw", draw)
    rows = training_rows("plan", 3)
    assert [row["index"] for row in rows] == ["plan-training-1", "plan-training-2", "plan-training-3"]
    assert heldout_rows("plan")[7]["question"] not in {row["question"] for row in rows}


def teacher_forced_exact(model, family: str, budget: int, items: int) -> list[bool]:
    """Per held-out item: whether the training's hard mask at `budget` predicts the reference token
    for token (the student's forward, not the engine)."""
    from safetensors.torch import load_file

    batches = suite_batches(vocabulary.build_suite(), torch.device("cpu"))[family]
    student = SoftEviction(load_file(str(REPO / LKV_FILE)))
    student.hard, student.prompt_len, student.budget = True, prompt_length(batches), budget
    AttentionInterface.register(ATTENTION, student.attention)
    model.set_attn_implementation(ATTENTION)
    try:
        return [teacher_forced(model, batches, batches.heldout[i:i + 1], rows=1)["accuracy"] == 1.0
                for i in range(items)]
    finally:
        model.set_attn_implementation(ATTENTION_NAME)


@pytest.mark.slow
@pytest.mark.parametrize("budget", [96, 384])
def test_the_suite_lkv_file_runs_in_the_harness(tmp_path, suite_model, budget):
    if not (REPO / LKV_FILE).is_file():
        pytest.skip("the suite's LKV file is not committed")
    result = run_cli("model=canary_suite", "dataset=canary_lookup", "method=lkv", f"method.weights={LKV_FILE}",
                     f"budget={budget}", "limit=2", "device=cpu", "engine.batch_size=2", "grading.workers=1",
                     f"results_dir={tmp_path}", timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "prior" not in result.stderr  # the file fits the model: no fallback to the prior
    (run,) = run_dirs(tmp_path)
    assert LKV_FILE in (run / CONFIG).read_text()
    written = {record["id"]: record["output"] for record in records(run)}
    assert set(written) == {"lookup-0", "lookup-1"}
    exact = [written[f"lookup-{i}"] == item.output() for i, item in enumerate(heldout("lookup", 2))]
    assert exact == teacher_forced_exact(suite_model[0], "lookup", budget, 2)


def test_the_suite_calibration_file_fits_the_suite_model(suite_model):
    path = REPO / CALIBRATION_FILE
    if not path.is_file():
        pytest.skip("the suite's calibration file is not committed")
    config = suite_model[0].config
    tensors = load_calibration(str(path), "compresskv", ("head_scores", "layer_scores"))
    assert tensors["head_scores"].shape == (config.num_hidden_layers, config.num_attention_heads)
    assert tensors["layer_scores"].shape == (config.num_hidden_layers,)
    assert torch.isclose(tensors["layer_scores"].sum(), torch.tensor(1.0))
    made_by = torch.load(path, weights_only=True)
    assert made_by["model"] == "canary_suite" and made_by["items_correct"] == made_by["items"] > 0
    assert made_by["datasets"] == [f"canary_{family}" for family in FAMILIES]
