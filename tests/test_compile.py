"""The compiled forwards (`longflow.compile`) on the CPU, through Dynamo and AOTAutograd without
Inductor (`aot_eager`, seconds instead of minutes of C++ compilation). Decode: one graph per batch
size, no break and no recompile per layer or per step, the eager engine's tokens, two policies in
lockstep. Prefill: one graph for every prompt length and number of rows above one, the eager
engine's tokens for the methods' prompt rules. The GPU tests compile with Inductor (tests/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import LONG_TEXTS, policy_of, tiny_model
from torch._dynamo.utils import counters

from longflow.compile import CompiledForward
from longflow.config import EngineConfig, GenerationConfig, VerifyConfig
from longflow.engine import Engine
from longflow.fidelity import teacher_force

TEXTS = ["What is 2 + 3?", "hi", *LONG_TEXTS]


def engine_of(tiny, method, budget, compiled=None, config=None, prefill=None):
    """An engine whose decode steps run `compiled` and whose prompt forwards run `prefill` (None:
    the model eagerly), whatever the device."""
    model, tokenizer = tiny
    engine = Engine(model, lambda: policy_of(method, budget), [], tokenizer.pad_token_id, config)
    engine.decode_forward = compiled
    engine.prefill_forward = prefill
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
    compiled = CompiledForward(model, backend="aot_eager")
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
    compiled = CompiledForward(model, backend="aot_eager")
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

    eager, compiled = run(None), run(CompiledForward(model, backend="aot_eager"))
    assert compiled.tokens == eager.tokens
    assert compiled.agreement == eager.agreement
    torch.testing.assert_close(torch.tensor(compiled.kl), torch.tensor(eager.kl), rtol=1e-4, atol=1e-6)


def test_the_engine_compiles_on_a_gpu_only(tiny):
    model, tokenizer = tiny
    engine = Engine(model, lambda: policy_of("vanilla", None), [], tokenizer.pad_token_id,
                    EngineConfig(compile=True, compile_prefill=True))
    assert engine.decode_forward is None and engine.prefill_forward is None


# Prompt rules of different shapes: every token kept (vanilla), the top prompt tokens by the step's
# score (LongFlow below every prompt), an observation window (R-KV), per-head capacities
# (CompressKV), and an observer of every prompt position's logits and every layer's hidden states
# (InfoKV), which makes the compiled forward return them.
PROMPT_RULES = [("vanilla", None), ("longflow", 12), ("rkv", 16), ("compresskv", 16), ("infokv", 16)]


@pytest.mark.parametrize("method,budget", PROMPT_RULES)
def test_compiled_prefill_gives_the_eager_tokens(tiny, method, budget):
    torch._dynamo.reset()
    model, tokenizer = tiny
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    generation = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    expected = engine_of(tiny, method, budget).generate(prompts, generation, [0, 1, 2, 3])
    prefill = CompiledForward(model, backend="aot_eager", prompt=True)
    before = graphs()
    result = engine_of(tiny, method, budget, prefill=prefill).generate(prompts, generation, [0, 1, 2, 3])
    assert result.tokens == expected.tokens
    assert graphs() == before + 1 and not prefill.failed and prefill.compile_seconds > 0


def test_one_prompt_graph_serves_every_length_and_row_count(tiny):
    """Rows and prompt length are dynamic from the first call: batches of 4, 2 and 3 rows whose
    prompts pad to different lengths share one graph; a single row gets its own."""
    torch._dynamo.reset()
    model, tokenizer = tiny
    prefill = CompiledForward(model, backend="aot_eager", prompt=True)
    generation = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    before, lengths = graphs(), set()
    for size, repeats in ((4, 1), (2, 6), (3, 12), (1, 1)):
        prompts = [tokenizer(t * repeats)["input_ids"] for t in TEXTS[:size]]
        engine = engine_of(tiny, "longflow", 12, prefill=prefill)
        lengths.add(engine.batch_inputs(prompts)[0].shape[1])
        expected = engine_of(tiny, "longflow", 12).generate(prompts, generation, list(range(size)))
        assert engine.generate(prompts, generation, list(range(size))).tokens == expected.tokens
    assert len(lengths) == 4  # the padded lengths differ
    assert graphs() == before + 2


def test_warming_up_compiles_the_single_row_prompt_graph_too(tiny):
    """After `warm_up`, an admission of one row, as continuous batching makes at a queue's end,
    compiles nothing."""
    torch._dynamo.reset()
    model, tokenizer = tiny
    prefill = CompiledForward(model, backend="aot_eager", prompt=True)
    engine = engine_of(tiny, "longflow", 12, config=EngineConfig(batch_size=3), prefill=prefill)
    before = graphs()
    engine.warm_up()
    assert graphs() == before + 2
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS[:1]]
    engine.generate(prompts, GenerationConfig(max_new_tokens=4, ignore_eos=True), [0])
    assert graphs() == before + 2


def test_continuous_batching_through_the_compiled_prefill_and_decode(tiny):
    """Admissions of one and two rows, every prompt forward and step compiled: the eager tokens."""
    torch._dynamo.reset()
    model, tokenizer = tiny
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    generation = GenerationConfig(max_new_tokens=24)

    def served(compiled, prefill):
        engine = engine_of(tiny, "rkv", 16, compiled, EngineConfig(batch_size=2, prefill_rows=2, check_every=4,
                                                                   refill_rows=1), prefill)
        rounds = engine.serve(prompts, generation, [0, 1, 2, 3], limits=[24, 7, 15, 20])
        return {item.index: item.tokens for round_ in rounds for item in round_.finished}

    compiled = (CompiledForward(model, backend="aot_eager"), CompiledForward(model, backend="aot_eager", prompt=True))
    assert served(*compiled) == served(None, None)
    assert not any(forward.failed for forward in compiled)


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
    assert served(CompiledForward(model, backend="aot_eager")) == served(None)
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
        compiled = CompiledForward(model, backend="aot_eager")
        for size in (3, 2):
            prompts = [tokenizer(t)["input_ids"] for t in TEXTS[:size]]
            expected = engine_of(tiny, "longflow", 12).generate(prompts, generation, list(range(size)))
            result = engine_of(tiny, "longflow", 12, compiled).generate(prompts, generation, list(range(size)))
            assert result.tokens == expected.tokens
        assert not compiled.failed


def test_verification_prefills_its_full_cache_through_the_compiled_prefill(tiny):
    """VeriCache prefills the drafting policy and the full cache beside it, each through the op."""
    torch._dynamo.reset()
    model, tokenizer = tiny
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    generation = GenerationConfig(max_new_tokens=20, ignore_eos=True)

    def run(prefill):
        engine = Engine(model, lambda: policy_of("longflow", 12), [], tokenizer.pad_token_id,
                        EngineConfig(batch_size=2, prefill_rows=2, refill_rows=1, check_every=4),
                        VerifyConfig(name="vericache", horizon=4))
        engine.prefill_forward = prefill
        static = engine.generate(prompts, generation, [0, 1, 2, 3]).tokens
        rounds = engine.serve(prompts, generation, [0, 1, 2, 3], limits=[20, 7, 15, 12])
        return static, {item.index: item.tokens for round_ in rounds for item in round_.finished}

    prefill = CompiledForward(model, backend="aot_eager", prompt=True)
    assert run(prefill) == run(None)
    assert not prefill.failed and prefill.compile_seconds > 0
