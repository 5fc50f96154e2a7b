"""The engine on a GPU: CUDA-graph decoding gives HF's tokens, and every method config of conf/method/
(TOVA, KeyDiff, Expected Attention and the AMS variants included) is graph-safe, in generation and in
the teacher-forced fidelity pass; vanilla's flash-decoding kernel replays with lengths that change
between replays, and its one-launch step (`append_decode`) replays step after step, its splits
combined by their last program; the compiled decode forward gives the tokens of the eager one, with
its one-row products through the GEMV kernel too."""

from __future__ import annotations

import pytest
import torch
from helpers import COMPRESSING, FAMILIES, TEXTS, filled_attention, hf_generate, method_variants, policy_of, tiny_spec
from torch._inductor.utils import fresh_cache

from longflow.config import EngineConfig, GenerationConfig
from longflow.engine import Engine
from longflow.fidelity import teacher_force
from longflow.kernels import append_decode, flash_decode
from longflow.models import eos_token_ids, load_model

# Small budgets shrink the compression interval of interval methods, with a warning expected here.
pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:.*leaves no room:UserWarning")]


@pytest.fixture(scope="module", params=FAMILIES)
def tiny_cuda(request):
    return load_model(tiny_spec(request.param), torch.device("cuda"))


def test_graph_decoding_matches_hf_generate(tiny_cuda):
    model, tokenizer = tiny_cuda
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    engine = Engine(model, lambda: policy_of("vanilla", None), eos_token_ids(model, tokenizer),
                    tokenizer.pad_token_id, EngineConfig(cuda_graph=True))
    result = engine.generate(prompts, GenerationConfig(max_new_tokens=40), [0, 1, 2])
    assert result.cuda_graph and engine.capture_seconds > 0  # one capture, timed outside the steps
    first = engine.capture_seconds
    engine.generate(prompts, GenerationConfig(max_new_tokens=40), [0, 1, 2])
    assert engine.capture_seconds > first  # a static batch captures its own graph
    assert result.tokens == hf_generate(model, tokenizer, prompts, max_new_tokens=40, do_sample=False)


def test_vanilla_flash_decoding_under_graphs_equals_eager_and_hf(tiny_cuda):
    """Vanilla through its kernel (use_kernel auto on CUDA), ragged prompts and 300 steps: the filled
    length grows over many tiles and several splits while the graph replays."""
    model, tokenizer = tiny_cuda
    prompts = [tokenizer(t * 4)["input_ids"] for t in TEXTS]
    eos = eos_token_ids(model, tokenizer)

    def run(cuda_graph):
        engine = Engine(model, lambda: policy_of("vanilla", None), eos, tokenizer.pad_token_id,
                        EngineConfig(cuda_graph=cuda_graph))
        return engine.generate(prompts, GenerationConfig(max_new_tokens=300), [0, 1, 2])

    graphed, eager = run(True), run(False)
    assert graphed.cuda_graph and not eager.cuda_graph
    assert graphed.tokens == eager.tokens
    assert graphed.tokens == hf_generate(model, tokenizer, prompts, max_new_tokens=300, do_sample=False)


@pytest.mark.parametrize("batch", [1, 4, 64])
def test_append_decode_replays_step_after_step(batch):
    """One captured `append_decode` at Qwen3-8B's head shapes, replayed 40 times: each replay writes a
    new token after the row's last and attends over them all. At batch 1 each KV head's slots are split
    over 32 programs, whose last one combines them: the output of every replay is checked against
    the softmax over the slots written so far, and the counters are back at 0 after each."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    slots, heads, kv_heads, dim = 2048, 32, 8, 128
    q = 2 * torch.randn(batch, heads, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    keys, values = (torch.randn(batch, kv_heads, slots, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
                    for _ in range(2))
    starts = torch.randint(1, 1900, (batch,), generator=gen, device="cuda")
    valid = (torch.arange(slots, device="cuda")[None, :] < starts[:, None])[:, None].expand(-1, kv_heads, -1).clone()
    positions = torch.zeros(batch, kv_heads, slots, dtype=torch.long, device="cuda")
    next_slot = starts[:, None].expand(-1, kv_heads).clone()
    token_positions = starts.clone()
    new_k, new_v = (torch.zeros(batch, kv_heads, 1, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    arrivals = torch.zeros(batch * kv_heads, dtype=torch.int32, device="cuda")
    state = (keys, values, valid, positions, next_slot, token_positions, arrivals)
    append_decode(q, new_k, new_v, *state)  # compiles outside the capture
    valid[:] = torch.arange(slots, device="cuda")[None, None, :] < starts[:, None, None]
    next_slot.copy_(starts[:, None].expand(-1, kv_heads))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = append_decode(q, new_k, new_v, *state)
    for step in range(40):
        new_k.normal_(generator=gen)
        new_v.normal_(generator=gen)
        slot = starts + step
        graph.replay()
        rows = torch.arange(batch, device="cuda")
        assert torch.equal(keys[rows, :, slot], new_k[:, :, 0]) and torch.equal(values[rows, :, slot], new_v[:, :, 0])
        assert torch.equal(positions[rows, :, slot], token_positions[:, None].expand(-1, kv_heads))
        assert torch.equal(next_slot, (slot + 1)[:, None].expand(-1, kv_heads)) and arrivals.eq(0).all()
        expected = filled_attention(q, keys, values, valid[:, 0], slot + 1, 128**-0.5)
        error = (out.double() - expected).norm() / expected.norm()
        assert error < 1e-2, f"step {step}: relative error {error:.2e}"
        token_positions += 1


@pytest.mark.parametrize("compile_step", [False, True])
def test_vanilla_in_one_launch_gives_the_tokens_of_three(tiny_cuda, compile_step):
    """`one_launch` (`append_decode`: the step's write, attention and combine in one launch) under the
    engine's CUDA graph, eager or compiled: 300 steps at batch 3 and at batch 1 (the tuned compile), and
    served continuously with admissions, each with the tokens of the base write, `flash_decode` and its
    combine."""
    model, tokenizer = tiny_cuda
    prompts = [tokenizer(t * 4)["input_ids"] for t in TEXTS]
    generation = GenerationConfig(max_new_tokens=300, ignore_eos=True)
    limits = [250, 17, 160]

    def runs(one_launch):
        def engine(**config):
            return Engine(model, lambda: policy_of("vanilla", None, one_launch=one_launch), [], tokenizer.pad_token_id,
                          EngineConfig(compile=compile_step, **config))

        static = engine().generate(prompts, generation, [0, 1, 2])
        alone = engine(batch_size=1).generate(prompts[:1], generation, [0])
        rounds = list(engine(batch_size=2, refill_rows=1, check_every=8).serve(prompts, generation, [0, 1, 2],
                                                                              limits=limits))
        served = {item.index: item.tokens for round_ in rounds for item in round_.finished}
        assert static.cuda_graph and alone.cuda_graph and rounds[-1].cuda_graph
        return static.tokens, alone.tokens, [served[i] for i in range(3)]

    assert runs(True) == runs(False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_flash_decode_replays_with_new_lengths(dtype):
    """One captured call at Qwen3-8B's head shapes; new per-row lengths copied in before each replay."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = 2 * torch.randn(4, 32, 128, generator=gen, device="cuda", dtype=dtype)
    k, v = (torch.randn(4, 8, 4096, 128, generator=gen, device="cuda", dtype=dtype) for _ in range(2))
    valid = torch.arange(4096, device="cuda")[None, :] >= torch.tensor([0, 0, 30, 7], device="cuda")[:, None]
    lengths = torch.full((4,), 4096, device="cuda")
    flash_decode(q, k, v, valid, lengths)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_decode(q, k, v, valid, lengths)
    for new in ([4096, 1, 95, 2049], [700, 701, 4000, 128], [3000, 3000, 3000, 3000]):
        lengths.copy_(torch.tensor(new))
        graph.replay()
        expected = filled_attention(q, k, v, valid, lengths, 128**-0.5)
        error = (out.double() - expected).norm() / expected.norm()
        assert error < (1e-2 if dtype == torch.bfloat16 else 1e-4), f"lengths {new}: relative error {error:.2e}"


@pytest.mark.parametrize("method", COMPRESSING)
def test_every_method_equals_vanilla_with_a_large_budget_under_graphs(tiny_cuda, method):
    model, tokenizer = tiny_cuda
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    config = GenerationConfig(max_new_tokens=40)

    def run(name, budget):
        engine = Engine(model, lambda: policy_of(name, budget), [], tokenizer.pad_token_id,
                        EngineConfig(cuda_graph=True))
        return engine.generate(prompts, config, [0, 1, 2])

    expected = run("vanilla", None)
    result = run(method, 1024)
    assert result.tokens == expected.tokens


@pytest.mark.parametrize("method", COMPRESSING)
def test_small_budget_holds_under_graphs(tiny_cuda, method):
    model, tokenizer = tiny_cuda
    prompts = [tokenizer(t * 4)["input_ids"] for t in TEXTS]
    budget = 200 if method == "rkv" else 48
    engine = Engine(model, lambda: policy_of(method, budget), [], tokenizer.pad_token_id,
                    EngineConfig(cuda_graph=True))
    result = engine.generate(prompts, GenerationConfig(max_new_tokens=300), [0, 1, 2])
    assert max(result.peak_slots) <= budget
    assert all(len(t) == 300 for t in result.tokens)


@pytest.mark.parametrize("method", COMPRESSING)
def test_teacher_forcing_under_graphs_equals_eager(tiny_cuda, method):
    model, tokenizer = tiny_cuda
    prompts = [tokenizer(t * 4)["input_ids"] for t in TEXTS]
    budget = 200 if method == "rkv" else 48
    generation = GenerationConfig(max_new_tokens=120, ignore_eos=True)

    def run(cuda_graph):
        engine = Engine(model, lambda: policy_of(method, budget), [], tokenizer.pad_token_id,
                        EngineConfig(cuda_graph=cuda_graph))
        return teacher_force(engine, prompts, generation, lambda: policy_of("vanilla", None))

    eager, graphed = run(False), run(True)
    assert graphed.cuda_graph and not eager.cuda_graph
    assert graphed.tokens == eager.tokens
    assert graphed.agreement == eager.agreement
    torch.testing.assert_close(torch.tensor(graphed.kl), torch.tensor(eager.kl), rtol=1e-4, atol=1e-6)
    reference = Engine(model, lambda: policy_of("vanilla", None), [], tokenizer.pad_token_id,
                       EngineConfig(cuda_graph=True)).generate(prompts, generation, [0, 1, 2])
    assert graphed.tokens == reference.tokens  # the reference path is the full cache's greedy output


@pytest.mark.parametrize("method,variant", method_variants())
def test_graphs_give_the_eager_tokens(tiny_cuda, method, variant):
    """Every method and variant under CUDA graphs gives the tokens of eager decoding, with a budget that
    compresses all along: per-step evictions captured, StreamingLLM lf_repo's in-place re-rotation
    captured, the interval methods' compressions (R-KV, KeyDiff, Expected Attention, AMS) between
    replays, R-KV lf_repo's cutting steps run eagerly."""
    model, tokenizer = tiny_cuda
    prompts = [tokenizer(t * 4)["input_ids"] for t in TEXTS]
    lf_repo_rkv = method == "rkv" and variant == "lf_repo"
    budget = 300 if lf_repo_rkv else 48  # R-KV lf_repo: one cut every 129 steps after the first
    fields = {} if variant is None else {"variant": variant}

    def run(cuda_graph):
        engine = Engine(model, lambda: policy_of(method, budget, **fields), [], tokenizer.pad_token_id,
                        EngineConfig(cuda_graph=cuda_graph))
        return engine.generate(prompts, GenerationConfig(max_new_tokens=400), [0, 1, 2])

    graphed, eager = run(True), run(False)
    assert graphed.cuda_graph and not eager.cuda_graph
    assert graphed.tokens == eager.tokens
    assert max(graphed.peak_slots) <= budget


@pytest.mark.parametrize("method,variant", [("vanilla", None), *method_variants()])
def test_continuous_batching_under_graphs_gives_each_item_its_own_tokens(tiny_cuda, method, variant):
    """Two rows serve six items under one captured graph (rows refilled between replays, one released
    at the end): each item gets the tokens it gets alone, at a compressing budget; with a large one,
    every method gets the full cache's tokens."""
    model, tokenizer = tiny_cuda
    prompts = [tokenizer(text * repeat)["input_ids"] for text in TEXTS for repeat in (1, 4)]
    limits = [90, 17, 160, 41, 5, 120]
    fields = {} if variant is None else {"variant": variant}
    budget = 300 if (method, variant) == ("rkv", "lf_repo") else 48  # dropped by the full cache (uses_budget)
    generation = GenerationConfig(max_new_tokens=160)
    eos = eos_token_ids(model, tokenizer)

    def alone(name, budget):
        engine = Engine(model, lambda: policy_of(name, budget, **fields), eos, tokenizer.pad_token_id)
        return [engine.generate([p], generation, [i], limits=[n]).tokens[0]
                for i, (p, n) in enumerate(zip(prompts, limits, strict=True))]

    def served(budget):
        engine = Engine(model, lambda: policy_of(method, budget, **fields), eos, tokenizer.pad_token_id,
                        EngineConfig(batch_size=2, prefill_rows=2, check_every=8))
        rounds = list(engine.serve(prompts, generation, list(range(len(prompts))), limits=limits))
        assert rounds[-1].cuda_graph
        tokens = {item.index: item.tokens for round_ in rounds for item in round_.finished}
        return [tokens[i] for i in range(len(prompts))]

    assert served(budget) == alone(method, budget)
    if method != "vanilla":
        assert served(1024) == alone("vanilla", None)


@pytest.mark.parametrize("compile_prefill", [False, True], ids=["eager_prefill", "compiled_prefill"])
@pytest.mark.parametrize("method,variant", [("vanilla", None), ("longflow", None), ("rkv", "paper"), ("h2o", "paper")])
def test_admissions_overlapped_on_their_own_stream_give_the_same_tokens(tiny_cuda, method, variant, compile_prefill):
    """`engine.overlap_admissions`: prompts prefilled on a stream of their own while the rows' graph
    replays run, adopted at the check; every item's tokens are those of admissions made before the
    round, at a compressing budget, with the prompt forward eager or compiled."""
    model, tokenizer = tiny_cuda
    prompts = [tokenizer(text * repeat)["input_ids"] for text in TEXTS for repeat in (1, 4)]
    limits = [90, 17, 160, 41, 5, 120]
    fields = {} if variant is None else {"variant": variant}
    generation = GenerationConfig(max_new_tokens=160)
    eos = eos_token_ids(model, tokenizer)

    def served(overlap):
        config = EngineConfig(batch_size=3, prefill_rows=2, refill_rows=1, check_every=8, overlap_admissions=overlap,
                              compile_prefill=compile_prefill)
        engine = Engine(model, lambda: policy_of(method, 48, **fields), eos, tokenizer.pad_token_id, config)
        rounds = list(engine.serve(prompts, generation, list(range(len(prompts))), limits=limits))
        assert rounds[-1].cuda_graph
        tokens = {item.index: item.tokens for round_ in rounds for item in round_.finished}
        return [tokens[i] for i in range(len(prompts))]

    assert served(True) == served(False)


def one_row(tiny_cuda, method, budget, config):
    """(the engine's decode forward, its result) for one long prompt, 300 steps, EOS ignored."""
    model, tokenizer = tiny_cuda
    engine = Engine(model, lambda: policy_of(method, budget), [], tokenizer.pad_token_id, config)
    prompt = [tokenizer(TEXTS[0] * 4)["input_ids"]]
    result = engine.generate(prompt, GenerationConfig(max_new_tokens=300, ignore_eos=True), [0])
    return engine.decode_forward, result


@pytest.mark.parametrize("method,budget", [("vanilla", None), ("longflow", 48)])
def test_a_batch_of_one_compiles_with_kernel_tuning_and_keeps_its_tokens(tiny_cuda, method, budget):
    """`engine.compile_tuning` left at None tunes a batch of one only; there Inductor lowers every
    matmul to a Triton reduction of its own (not cuBLAS), and the tokens stay the eager forward's."""
    model, tokenizer = tiny_cuda
    tuned, result = one_row(tiny_cuda, method, budget, EngineConfig(batch_size=1))
    _, eager = one_row(tiny_cuda, method, budget, EngineConfig(batch_size=1, compile=False))
    assert tuned.tuning and not tuned.failed
    assert result.cuda_graph and result.tokens == eager.tokens
    untuned = Engine(model, lambda: policy_of(method, budget), [], tokenizer.pad_token_id,
                     EngineConfig(batch_size=3)).decode_forward
    assert not untuned.tuning


@pytest.mark.parametrize("method,budget", [("vanilla", None), ("longflow", 48)])
def test_the_one_row_products_through_the_gemv_kernel_keep_the_tokens(tiny_cuda, method, budget):
    """`engine.compile_gemv` at a batch of one: the compiled step's products replaced by the GEMV
    kernel (under PDL on sm_90), inside the engine's CUDA graph, 300 steps, give the eager tokens."""
    with fresh_cache():  # a cached graph would run no pass, and count nothing
        compiled, result = one_row(tiny_cuda, method, budget, EngineConfig(batch_size=1, compile_gemv=True))
    _, eager = one_row(tiny_cuda, method, budget, EngineConfig(batch_size=1, compile=False))
    assert not compiled.failed and compiled.gemv.replaced > 0 and compiled.gemv.fused["norm"] > 0
    assert result.cuda_graph and result.tokens == eager.tokens


@pytest.mark.parametrize("method,budget", [("vanilla", None), ("longflow", 48)])
def test_compiled_decoding_gives_the_uncompiled_tokens(tiny_cuda, method, budget):
    """Inductor's kernels inside the engine's CUDA graph against the eager forward, 300 steps, LongFlow
    evicting at every one. The tiny models are fp32: fusion reorders the sums of RMSNorm and the
    softmax, which moves logits by about 1e-6 relative, far below the gap between the two best logits
    of a random model; in bf16 rounding moves them by about 1e-2 and a near-tie could flip a token."""
    model, tokenizer = tiny_cuda
    prompts = [tokenizer(t * 4)["input_ids"] for t in TEXTS]

    def run(compile_step):
        engine = Engine(model, lambda: policy_of(method, budget), [], tokenizer.pad_token_id,
                        EngineConfig(compile=compile_step))
        result = engine.generate(prompts, GenerationConfig(max_new_tokens=300, ignore_eos=True), [0, 1, 2])
        return engine.decode_forward, result

    (compiled, result), (_, eager) = run(True), run(False)
    assert not compiled.failed and compiled.compile_seconds > 0
    assert result.cuda_graph and eager.cuda_graph
    assert result.tokens == eager.tokens


@pytest.mark.parametrize("method,budget", [("vanilla", None), ("longflow", 48), ("rkv", 64)])
def test_compiled_prefill_gives_the_uncompiled_tokens(tiny_cuda, method, budget):
    """Inductor's prompt forward (`engine.compile_prefill`, rows and length dynamic) against the eager
    one: prompts of three lengths, statically batched and served continuously with admissions of one
    and two rows; the tokens identical, and warming up built every prompt graph the runs used."""
    model, tokenizer = tiny_cuda
    prompts = [tokenizer(t * repeats)["input_ids"] for t, repeats in zip(TEXTS, (4, 7, 2), strict=False)]
    generation = GenerationConfig(max_new_tokens=120, ignore_eos=True)

    def run(compile_prefill):
        config = EngineConfig(batch_size=2, prefill_rows=2, refill_rows=1, check_every=8,
                              compile_prefill=compile_prefill)
        engine = Engine(model, lambda: policy_of(method, budget), [], tokenizer.pad_token_id, config)
        engine.warm_up()
        compiled = engine.prefill_forward
        seconds = None if compiled is None else compiled.compile_seconds
        static = engine.generate(prompts, generation, [0, 1, 2]).tokens
        rounds = engine.serve(prompts, generation, [0, 1, 2], limits=[120, 40, 80])
        served = {item.index: item.tokens for round_ in rounds for item in round_.finished}
        return compiled, seconds, static, served

    compiled, warmed, *tokens = run(True)
    _, _, *eager = run(False)
    assert compiled is not None and not compiled.failed and warmed > 0
    assert compiled.compile_seconds == warmed  # nothing compiled after the warm-up
    assert tokens == eager


# The step methods whose score the fused kernel computes (`KVPolicy.fused_score`), every variant.
FUSED_SCORES = [("h2o", {"variant": "paper"}), ("h2o", {"variant": "lf_repo"}), ("vatp", {"variant": "paper"}),
                ("vatp", {"variant": "lf_repo"}), ("tova", {}), ("longflow", {"granularity": "kv_head"})]


@pytest.fixture(scope="module")
def tiny_qwen3_cuda():
    return load_model(tiny_spec("qwen3"), torch.device("cuda"))


@pytest.mark.parametrize("cuda_graph", [True, False], ids=["graph", "eager_step"])
@pytest.mark.parametrize("method,fields", FUSED_SCORES,
                         ids=["-".join([method, *fields.values()]) for method, fields in FUSED_SCORES])
def test_fused_scores_give_the_eager_tokens(tiny_qwen3_cuda, method, fields, cuda_graph):
    """H2O, VATP, TOVA and LongFlow per KV head through the fused kernel (`use_kernel: auto` on CUDA)
    against their eager attention with probabilities: 300 greedy tokens identical, evicting at every
    step (budget 48, prompts of 4 repetitions cut at prefill). The tiny model is fp32, where the
    kernel's logits and the eager matmul's agree to rounding; in bf16 the eager path rounds the logits
    to bf16 first and a near-tie between two slots' scores could go the other way."""
    model, tokenizer = tiny_qwen3_cuda
    prompts = [tokenizer(t * 4)["input_ids"] for t in TEXTS]
    eager_kernel = "reference" if method == "longflow" else "eager"

    def run(kernel):
        engine = Engine(model, lambda: policy_of(method, 48, use_kernel=kernel, **fields), [],
                        tokenizer.pad_token_id, EngineConfig(cuda_graph=cuda_graph))
        return engine.generate(prompts, GenerationConfig(max_new_tokens=300, ignore_eos=True), [0, 1, 2])

    fused, eager = run("auto"), run(eager_kernel)
    assert fused.cuda_graph == cuda_graph
    assert fused.tokens == eager.tokens
    assert max(fused.peak_slots) <= 48
