"""The real loading path: `model.weights=hub` on a checkpoint folder written by `save_pretrained`.

Each folder holds a tiny model, a `tokenizers` tokenizer with the family's chat template, and a
generation config, as a hub download does. Its weights are set by hand so that greedy decoding is
known in advance: every decoder layer's output projections are zero, so the hidden state of a
position is its token's embedding, and the LM head maps each token of a chain to the next one. After
the generation prompt's final "\\n" the model writes "</think>\\boxed{7}" and then an end-of-sequence
id, which the test makes one that only the generation config lists (as Qwen3's does).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from evals.configs import group_config
from longflow.tokenizer import build_tokenizer

REPO = Path(__file__).resolve().parents[1]
ANSWER = "</think>\\boxed{7}"
QUESTIONS = [{"index": 0, "question": "What is 3+4?", "true_answer": "7"},
             {"index": 1, "question": "What is 4+4?", "true_answer": "8"}]
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def write_checkpoint(folder: Path, family: str, chat_format: str, stop_token: str) -> None:
    """A tiny `family` checkpoint whose greedy output after "\\n" is ANSWER, then `stop_token`."""
    architecture = {**group_config("model", f"tiny_{family}")["architecture"], "tie_word_embeddings": False,
                    "max_position_embeddings": 4096}
    config = AutoConfig.for_model(**architecture)
    tokenizer = build_tokenizer(config.vocab_size, chat_format)
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    chain = [*tokenizer.encode("\n", add_special_tokens=False), tokenizer.convert_tokens_to_ids("</think>"),
             *tokenizer.encode("\\boxed{7}", add_special_tokens=False), tokenizer.convert_tokens_to_ids(stop_token)]
    assert len(set(chain)) == len(chain) <= config.hidden_size, "each chain token needs its own direction"
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embeddings, head = model.model.embed_tokens.weight, model.lm_head.weight
        embeddings.zero_()
        head.zero_()
        for direction, (token, successor) in enumerate(zip(chain[:-1], chain[1:], strict=True)):
            embeddings[token, direction] = 1.0  # RMSNorm turns it into sqrt(hidden) along `direction`
            head[successor, direction] = 1.0
    stop_ids = sorted({tokenizer.eos_token_id, tokenizer.pad_token_id})
    model.generation_config.eos_token_id = stop_ids
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.fixture(scope="module")
def data_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("data")
    (folder / "gsm8k.jsonl").write_text("".join(json.dumps(row) + "\n" for row in QUESTIONS))
    return folder


def run_checkpoint(model: str, folder: Path, data: Path, results: Path, *overrides: str) -> list[dict]:
    """`python -m evals.run` on a checkpoint folder, as a user runs it; returns the one run's records."""
    command = [sys.executable, "-m", "evals.run", f"model={model}", f"model.hub_id={folder}", "model.dtype=float32",
               "method=longflow", "budget=64", "dataset=gsm8k", f"dataset.root={data}", "limit=4",
               "generation.max_new_tokens=64", "device=cpu", "grading.workers=1", f"results_dir={results}",
               *overrides]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    (run,) = [path for path in results.iterdir() if path.is_dir() and not path.name.startswith(".")]
    for name in ("run.json", "config.yaml", "provenance.json", "metrics.json", "batches.jsonl"):
        assert (run / name).is_file(), name
    identity = json.loads((run / "run.json").read_text())
    assert identity["hub_id"] == str(folder) and identity["weights"] == "hub"
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["n_items"] == 2 and metrics["accuracy"] == 0.5
    rows = [json.loads(line) for line in (run / "generations.jsonl").read_text().splitlines()]
    return sorted(rows, key=lambda row: row["id"])


def check_answers(rows: list[dict]) -> None:
    """Both items answer 7 and stop on the generation config's end id (ANSWER's tokens + 1 stop)."""
    for row in rows:
        assert row["output"] == ANSWER
        assert row["finish_reason"] == "eos" and row["output_tokens"] == 1 + len("\\boxed{7}") + 1
        assert row["extracted"] == "7"
    assert [(row["correct"], row["reason"]) for row in rows] == [(True, "correct"), (False, "mismatch")]


@pytest.mark.slow
@pytest.mark.parametrize("thinking", [True, False])
def test_qwen3_checkpoint_folder(tmp_path, data_folder, thinking):
    folder = tmp_path / "qwen3-checkpoint"
    # Qwen3's tokenizer ends turns with <|im_end|>; <|endoftext|> stops generation only because the
    # generation config lists it.
    write_checkpoint(folder, "qwen3", "qwen3", stop_token="<|endoftext|>")
    rows = run_checkpoint("qwen3_4b", folder, data_folder, tmp_path / "runs", f"model.thinks={thinking}")
    check_answers(rows)
    opening = "" if thinking else "<think>\n\n</think>\n\n"
    for row, question in zip(rows, QUESTIONS, strict=True):
        assert row["prompt"] == (f"<|im_start|>user\n{question['question']}\n{MATH_INSTRUCTION}<|im_end|>\n"
                                 f"<|im_start|>assistant\n{opening}")


@pytest.mark.slow
def test_r1_distill_llama_checkpoint_folder(tmp_path, data_folder):
    folder = tmp_path / "llama-checkpoint"
    write_checkpoint(folder, "llama", "r1_distill", stop_token="<｜end▁of▁sentence｜>")
    rows = run_checkpoint("r1_distill_llama_8b", folder, data_folder, tmp_path / "runs")
    check_answers(rows)
    for row, question in zip(rows, QUESTIONS, strict=True):
        # One BOS (the template's), the generation prompt opening the thinking block.
        assert row["prompt"] == (f"<｜begin▁of▁sentence｜><｜User｜>{question['question']}\n{MATH_INSTRUCTION}"
                                 "<｜Assistant｜><think>\n")


def test_missing_checkpoint_folder_is_one_line(tmp_path):
    command = [sys.executable, "-m", "evals.run", "model=qwen3_4b", f"model.hub_id={tmp_path / 'absent'}",
               "dataset=demo", "device=cpu", f"results_dir={tmp_path}"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "save_pretrained" in result.stderr
