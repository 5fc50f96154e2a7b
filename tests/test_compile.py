"""The compiled decode forward (`longflow.compile`) on the CPU, through Dynamo and AOTAutograd without
Inductor (`aot_eager`, seconds instead of minutes of C++ compilation): one graph per batch size, no
break and no recompile per layer or per step, the eager engine's tokens, two policies in lockstep.
The GPU tests compile with Inductor (tests/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import LONG_TEXTS, policy_of, tiny_model
from torch._dynamo.utils import counters

from longflow.compile import CompiledDecode
from longflow.config import EngineConfig, GenerationConfig
from longflow.engine import Engine
from longflow.fidelity import teacher_force

TEXTS = ["What is 2 + 3?", "hi", *LONG_TEXTS]


def engine_of(tiny, method, budget, compiled=None, config=None):
    model, tokenizer = tiny
    engine = Engine(model, lambda: policy_of(method, budget), [], tokenizer.pad_token_id, config)
    engine.decode_forward = compiled
    return engine


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("method,budget", [("vanilla", None), ("longflow", 12)])
def test_compiled_decoding_gives_the_eager_tokens(tiny, method, budget):
    """The budget of 12 slots is below every prompt: LongFlow compresses at prefill and evicts at every step."""
    torch._dynamo.reset()
    model, tokenizer = tiny
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    generation = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    compiled = CompiledDecode(model, backend="aot_eager")
    expected = engine_of(tiny, method, budget).generate(prompts, generation, [0, 1, 2, 3])
    before = graphs()
    result = engine_of(tiny, method, budget, compiled).generate(prompts, generation, [0, 1, 2, 3])
    assert result.tokens == expected.tokens
    assert graphs() == before + 1  # fullgraph: a break would have raised; 29 steps, no recompile
    assert not compiled.failed and compiled.compile_seconds > 0


def test_batch_sizes_compile_twice_at_most(tiny):
    """The first size is specialised, the second makes the batch dynamic, later sizes reuse that graph."""
    torch._dynamo.reset()
    model, tokenizer = tiny
    compiled = CompiledDecode(model, backend="aot_eager")
    generation = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    before = graphs()
    for size in (4, 2, 3, 2):
        prompts = [tokenizer(t)["input_ids"] for t in TEXTS[:size]]
        expected = engine_of(tiny, "longflow", 12).generate(prompts, generation, list(range(size)))
        result = engine_of(tiny, "longflow", 12, compiled).generate(prompts, generation, list(range(size)))
        assert result.tokens == expected.tokens
    assert graphs() == before + 2


def test_teacher_forcing_runs_two_policies_through_one_compiled_forward(tiny):
    torch._dynamo.reset()
    model, tokenizer = tiny
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    generation = GenerationConfig(max_new_tokens=20, ignore_eos=True)

    def run(compiled):
        return teacher_force(engine_of(tiny, "longflow", 12, compiled), prompts, generation,
                             lambda: policy_of("vanilla", None))

    eager, compiled = run(None), run(CompiledDecode(model, backend="aot_eager"))
    assert compiled.tokens == eager.tokens
    assert compiled.agreement == eager.agreement
    torch.testing.assert_close(torch.tensor(compiled.kl), torch.tensor(eager.kl), rtol=1e-4, atol=1e-6)


def test_the_engine_compiles_on_a_gpu_only(tiny):
    model, tokenizer = tiny
    engine = Engine(model, lambda: policy_of("vanilla", None), [], tokenizer.pad_token_id, EngineConfig(compile=True))
    assert engine.decode_forward is None


def test_continuous_batching_through_the_compiled_forward(tiny):
    """Two rows serve four items, refilled between steps: the compiled forward sees one batch size."""
    torch._dynamo.reset()
    model, tokenizer = tiny
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    generation = GenerationConfig(max_new_tokens=24)

    def served(compiled):
        engine = engine_of(tiny, "longflow", 12, compiled, EngineConfig(batch_size=2, prefill_rows=2, check_every=4))
        rounds = engine.serve(prompts, generation, [0, 1, 2, 3], limits=[24, 7, 15, 20])
        return {item.index: item.tokens for round_ in rounds for item in round_.finished}

    before = graphs()
    assert served(CompiledDecode(model, backend="aot_eager")) == served(None)
    assert graphs() == before + 1


@torch._dynamo.config.patch(recompile_limit=2)
def test_each_compiled_forward_has_its_own_recompile_count():
    """Dynamo counts recompilations per code object, and past `recompile_limit` a fullgraph compile
    raises: the forwards of several models (or tunings) in one process must not add up. With the
    limit at 2, the compiled forwards of two models each compile two batch sizes."""
    torch._dynamo.reset()
    generation = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    for family in ("llama", "qwen3"):
        tiny = tiny_model(family)
        model, tokenizer = tiny
        compiled = CompiledDecode(model, backend="aot_eager")
        for size in (3, 2):
            prompts = [tokenizer(t)["input_ids"] for t in TEXTS[:size]]
            expected = engine_of(tiny, "longflow", 12).generate(prompts, generation, list(range(size)))
            result = engine_of(tiny, "longflow", 12, compiled).generate(prompts, generation, list(range(size)))
            assert result.tokens == expected.tokens
        assert not compiled.failed
