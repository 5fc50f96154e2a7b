"""The engine on a GPU: CUDA-graph decoding gives HF's tokens, and every method is graph-safe, in
generation and in the teacher-forced fidelity pass."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, tiny_spec
from test_engine import TEXTS, hf_generate

from longflow.config import EngineConfig, GenerationConfig
from longflow.engine import Engine
from longflow.fidelity import teacher_force
from longflow.methods import METHODS, build_policy
from longflow.models import eos_token_ids, load_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=FAMILIES)
def tiny_cuda(request):
    return load_model(tiny_spec(request.param), torch.device("cuda"))


def test_graph_decoding_matches_hf_generate(tiny_cuda):
    model, tokenizer = tiny_cuda
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    engine = Engine(model, lambda: build_policy("vanilla", None), eos_token_ids(model, tokenizer),
                    tokenizer.pad_token_id, EngineConfig(cuda_graph=True))
    result = engine.generate(prompts, GenerationConfig(max_new_tokens=40), [0, 1, 2])
    assert result.cuda_graph
    assert result.tokens == hf_generate(model, tokenizer, prompts, max_new_tokens=40, do_sample=False)


@pytest.mark.parametrize("method", sorted(set(METHODS) - {"vanilla"}))
def test_every_method_equals_vanilla_with_a_large_budget_under_graphs(tiny_cuda, method):
    model, tokenizer = tiny_cuda
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    config = GenerationConfig(max_new_tokens=40)

    def run(name, budget):
        engine = Engine(model, lambda: build_policy(name, budget), [], tokenizer.pad_token_id,
                        EngineConfig(cuda_graph=True))
        return engine.generate(prompts, config, [0, 1, 2])

    expected = run("vanilla", None)
    result = run(method, 1024)
    assert result.tokens == expected.tokens


@pytest.mark.parametrize("method", sorted(set(METHODS) - {"vanilla"}))
def test_small_budget_holds_under_graphs(tiny_cuda, method):
    model, tokenizer = tiny_cuda
    prompts = [tokenizer(t * 4)["input_ids"] for t in TEXTS]
    budget = 200 if method == "rkv" else 48
    engine = Engine(model, lambda: build_policy(method, budget), [], tokenizer.pad_token_id,
                    EngineConfig(cuda_graph=True))
    result = engine.generate(prompts, GenerationConfig(max_new_tokens=300), [0, 1, 2])
    assert max(result.peak_slots) <= budget
    assert all(len(t) == 300 for t in result.tokens)


@pytest.mark.parametrize("method", sorted(set(METHODS) - {"vanilla"}))
def test_teacher_forcing_under_graphs_equals_eager(tiny_cuda, method):
    model, tokenizer = tiny_cuda
    prompts = [tokenizer(t * 4)["input_ids"] for t in TEXTS]
    budget = 200 if method == "rkv" else 48
    generation = GenerationConfig(max_new_tokens=120, ignore_eos=True)

    def run(cuda_graph):
        engine = Engine(model, lambda: build_policy(method, budget), [], tokenizer.pad_token_id,
                        EngineConfig(cuda_graph=cuda_graph))
        return teacher_force(engine, prompts, generation, lambda: build_policy("vanilla", None))

    eager, graphed = run(False), run(True)
    assert graphed.cuda_graph and not eager.cuda_graph
    assert graphed.tokens == eager.tokens
    assert graphed.agreement == eager.agreement
    torch.testing.assert_close(torch.tensor(graphed.kl), torch.tensor(eager.kl), rtol=1e-4, atol=1e-6)
    reference = Engine(model, lambda: build_policy("vanilla", None), [], tokenizer.pad_token_id,
                       EngineConfig(cuda_graph=True)).generate(prompts, generation, [0, 1, 2])
    assert graphed.tokens == reference.tokens  # the reference path is the full cache's greedy output


@pytest.mark.parametrize("method", sorted(set(METHODS) - {"vanilla"}))
def test_lf_repo_graphs_give_the_eager_tokens(tiny_cuda, method):
    """The lf_repo variants under CUDA graphs (StreamingLLM's in-place re-rotation captured, R-KV's
    cutting steps run eagerly between replays) give the tokens of eager decoding."""
    model, tokenizer = tiny_cuda
    prompts = [tokenizer(t * 4)["input_ids"] for t in TEXTS]
    budget = 300 if method == "rkv" else 48  # R-KV: one cut every 129 steps after the first

    def run(cuda_graph):
        engine = Engine(model, lambda: build_policy(method, budget, variant="lf_repo"), [], tokenizer.pad_token_id,
                        EngineConfig(cuda_graph=cuda_graph))
        return engine.generate(prompts, GenerationConfig(max_new_tokens=400), [0, 1, 2])

    graphed, eager = run(True), run(False)
    assert graphed.cuda_graph and not eager.cuda_graph
    assert graphed.tokens == eager.tokens
    assert max(graphed.peak_slots) <= budget
