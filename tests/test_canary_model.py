"""The committed canary model through the harness: it loads offline from its folder, solves canary items
with the full cache, and the harness tells a broken KV method from a faithful one, by accuracy and by
teacher-forced agreement with the full cache."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import policy_of
from helpers.canary import SMALL_BUDGET, EvictNewest, EvictRandom
from transformers import AutoTokenizer

from evals.canary.task import CanaryTask
from evals.configs import model_spec
from evals.datasets import Item
from evals.grading import grade
from evals.pipeline import decode
from evals.prompts import build_messages, render_prompt
from longflow.config import GenerationConfig
from longflow.engine import Engine
from longflow.fidelity import teacher_force
from longflow.models import PROJECT_ROOT, checkpoint_location, eos_token_ids, load_model

# The first 16 held-out items of at most 20 steps (at most 389 output tokens): a CI-sized subset.
SUBSET = [(str(index), program) for index, program in enumerate(CanaryTask().heldout()) if program.steps <= 20][:16]
@functools.cache
def canary():
    """(model, tokenizer) as `model=canary` loads them: float32 on the CPU."""
    return load_model(model_spec("canary"), torch.device("cpu"))


def subset_engine(factory) -> tuple[Engine, list[list[int]]]:
    """An engine of the canary model with `factory`'s policy, and `SUBSET`'s rendered prompts."""
    model, tokenizer = canary()
    prompts = [render_prompt(tokenizer, build_messages(Item(i, p.question(), str(p.answer)), "math"), thinking=True)
               for i, p in SUBSET]
    return Engine(model, factory, eos_token_ids(model, tokenizer), tokenizer.pad_token_id), prompts


@functools.cache
def accuracy(factory) -> float:
    """Greedy accuracy on `SUBSET` with `factory`'s policy, graded by the harness's grader."""
    _, tokenizer = canary()
    engine, prompts = subset_engine(factory)
    eos = engine.eos_ids.tolist()
    result = engine.generate(prompts, GenerationConfig(max_new_tokens=400), [0] * len(prompts))
    grades = [grade("math", decode(tokenizer, tokens, eos), str(p.answer), finish_reason=reason)
              for (_, p), tokens, reason in zip(SUBSET, result.tokens, result.finish_reasons, strict=True)]
    return sum(g.correct for g in grades) / len(grades)


@functools.cache
def fidelity(factory) -> tuple[float, float]:
    """(mean top-1 agreement, mean KL) of `factory`'s policy against the full cache over every output
    token of `SUBSET`, teacher-forced on the full cache's greedy output."""
    engine, prompts = subset_engine(factory)
    result = teacher_force(engine, prompts, GenerationConfig(max_new_tokens=400), full_cache)
    agreement = [agree for row in result.agreement for agree in row]
    kl = [value for row in result.kl for value in row]
    return sum(agreement) / len(agreement), sum(kl) / len(kl)


def full_cache():
    return policy_of("vanilla", None)


def faithful():
    return policy_of("rkv", SMALL_BUDGET, compress_every=32)


def test_the_model_loads_from_any_directory(tmp_path, monkeypatch):
    """model.hub_id names the committed folder relative to the project: found from elsewhere too."""
    monkeypatch.chdir(tmp_path)
    folder = checkpoint_location(model_spec("canary").hub_id)
    assert folder == str(PROJECT_ROOT / "evals" / "canary" / "model")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.decode(tokenizer("7: a=0, e=10 -> p=10\n")["input_ids"]) == "7: a=0, e=10 -> p=10\n"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                         tokenize=False) == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    model, _ = canary()
    assert model.config.model_type == "qwen3" and model.config.num_key_value_heads < model.config.num_attention_heads
    assert sum(p.numel() for p in model.parameters()) < 4e6


@pytest.mark.slow
def test_full_cache_solves_the_canary():
    assert accuracy(full_cache) >= 0.9


@pytest.mark.slow
@pytest.mark.parametrize("broken", [EvictNewest, EvictRandom])
def test_a_broken_policy_scores_clearly_below_a_faithful_one(broken):
    """At a small budget, R-KV (which keeps what attention uses and drops the older of two similar keys:
    a variable's stale mentions) keeps most items right; a policy that throws away the newest token,
    or a random one, loses nearly all of them."""
    right, wrong = accuracy(faithful), accuracy(functools.partial(broken, SMALL_BUDGET))
    assert right >= 0.8 and wrong <= right - 0.5, (right, wrong)


@pytest.mark.slow
@pytest.mark.parametrize("broken", [EvictNewest, EvictRandom])
def test_a_broken_policy_agrees_clearly_less_with_the_full_cache(broken):
    """The same comparison, teacher-forced (no answer grading): R-KV at 128 slots predicts the full
    cache's next token almost everywhere; the broken policies miss it at least ten times as often,
    and their next-token distributions sit at least ten times as far (KL) from the full cache's."""
    (right, right_kl), (wrong, wrong_kl) = fidelity(faithful), fidelity(functools.partial(broken, SMALL_BUDGET))
    assert right >= 0.99, right
    assert 1 - wrong >= 10 * (1 - right) and wrong <= right - 0.03, (right, wrong)
    assert wrong_kl >= 10 * right_kl, (right_kl, wrong_kl)
