"""InfoKV: the top-k entropy (chunked) against its formula, the entropy each token is stored with is
that of the distribution it was drawn from (a position-shift check against a plain HF forward), the
representation change against hidden states read by hand, and alpha = 1 selecting exactly what
RPC's attention rule alone selects (a plain transcription of the official rule)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import drive_layer, hf_attention, tiny_model, tiny_spec

from baselines.infokv import InfoKVPolicy, infokv_scores, representation_change, topk_entropy
from longflow.config import EngineConfig, GenerationConfig
from longflow.engine import Engine
from longflow.errors import UserError
from longflow.models import load_model

pytestmark = pytest.mark.filterwarnings("ignore:.*leaves no room:UserWarning")


def entropy_by_formula(logits: torch.Tensor, k: int) -> torch.Tensor:
    """H = -sum p log p of the softmax over the k largest logits of one position `[V]`."""
    top = torch.sort(logits.double(), descending=True).values[:k]
    p = torch.exp(top - top.max())
    p = p / p.sum()
    return -(p * p.log()).sum()


def test_topk_entropy_in_chunks_is_the_formula():
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 50) * 3
    for chunk in (50, 3 * 50, 10 ** 6):  # one position, one batch of positions, all at once
        entropy = topk_entropy(logits, 6, chunk_elements=chunk)
        for b in range(3):
            for i in range(7):
                assert abs(float(entropy[b, i]) - float(entropy_by_formula(logits[b, i], 6))) < 1e-5
    assert torch.allclose(topk_entropy(logits, 10 ** 4), -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1),
                          atol=1e-5)  # k beyond the vocabulary: the full distribution


def test_representation_change_compares_each_layer_with_the_last_hidden_state():
    torch.manual_seed(1)
    states = tuple(torch.randn(2, 3, 16) for _ in range(4))  # 3 layers: 3 inputs + the last hidden state
    change = representation_change(states, "output")
    assert change.shape == (3, 2, 3)
    for layer in range(3):
        for b in range(2):
            for i in range(3):
                cos = float(states[layer + 1][b, i] @ states[-1][b, i]) / float(
                    states[layer + 1][b, i].norm() * states[-1][b, i].norm())
                assert abs(float(change[layer, b, i]) - (1 - cos)) < 1e-5
    assert change[-1].abs().max() < 1e-6  # the last layer's output is the last hidden state
    torch.testing.assert_close(representation_change(states, "input")[0], 1 - F.cosine_similarity(states[0],
                                                                                                  states[-1], dim=-1))


# ---- through the engine: the entropy of the distribution each token was drawn from --------------

TOP_K, TAU = 5, 1.0


def reference_evolution(model, sequence: list[int], top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(E as InfoKV defines it, E with the entropy of the token's OWN position's logits instead),
    `[layers, T]` each, from one plain HF forward over the whole sequence."""
    with hf_attention(model), torch.no_grad():
        out = model(torch.tensor([sequence]), output_hidden_states=True)
    logits, states = out.logits[0], out.hidden_states
    own = torch.stack([entropy_by_formula(logits[i], top_k) for i in range(len(sequence))]).float()
    drawn = torch.cat([torch.zeros(1), own[:-1]])  # position 0: first_entropy 0
    final = states[-1][0]
    change = torch.stack([1 - F.cosine_similarity(h[0], final, dim=-1) for h in states[1:]])  # [layers, T]
    return (change + TAU) * drawn, (change + TAU) * own


@pytest.mark.parametrize("granularity", ["layer", "kv_head"])
@pytest.mark.parametrize("budget", [512, 48])
def test_each_slot_holds_the_entropy_of_the_distribution_its_token_was_drawn_from(budget, granularity):
    model, tokenizer = tiny_model("qwen3")
    with torch.no_grad():  # a hand-set LM head: random weights give near-uniform logits, alike at every position
        model.lm_head.weight.mul_(40.0)
    prompts = [[5 + (7 * i + 3 * n) % 300 for i in range(n)] for n in (9, 60)]  # 60 > 48: cut at prefill
    made = []

    def factory():
        made.append(InfoKVPolicy(budget, top_k=TOP_K, tau=TAU, compress_every=8, granularity=granularity))
        return made[-1]

    generation = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    result = Engine(model, factory, [], tokenizer.pad_token_id).generate(prompts, generation, [0, 1])
    policy = made[0]
    for row, prompt in enumerate(prompts):
        # The last generated token was never fed back: the cache holds the prompt and all others.
        expected, unshifted = reference_evolution(model, prompt + result.tokens[row][:-1], TOP_K)
        for layer, slots in enumerate(policy.layers):
            for head in range(slots.keys.shape[1]):
                held = slots.valid[row, head]
                if budget == 512:
                    assert slots.positions[row, head][held].tolist() == list(range(len(prompt) + 39))
                else:
                    # Once a cut ran, the forward attends to fewer tokens than the reference's: compare the
                    # prompt (attended to in full at prefill), cut at prefill and moved by every compaction.
                    held = held & (slots.positions[row, head] < len(prompt))
                positions = slots.positions[row, head][held]
                got = slots.state["evolution"][row, head][held]
                torch.testing.assert_close(got, expected[layer, positions], rtol=1e-4, atol=1e-5)
                assert not torch.allclose(got, unshifted[layer, positions], rtol=1e-2, atol=1e-3)


# ---- alpha = 1 is RPC's attention rule -------------------------------------------------------------


def rpc_keep(queries, keys, prompt_len: int, window: int, keep: int, kernel: int = 7) -> list[int]:
    """The generated tokens RPC keeps, transcribed from its official rule for one row: softmax of the
    window queries over keys[prompt_len:-window] (scale 1/sqrt(D)), summed over the queries, averaged
    over all query heads, average-pooled with zero padding, top `keep`, in position order.

    queries: `[Hq, W, D]`; keys: `[Hq, T, D]` (each query head's KV head's keys)."""
    scores = torch.softmax(queries @ keys[:, prompt_len:-window].transpose(-1, -2) / keys.shape[-1] ** 0.5, dim=-1)
    scores = scores.sum(dim=1).mean(dim=0)  # [T - prompt - W]
    pooled = F.avg_pool1d(scores[None, None], kernel, stride=1, padding=kernel // 2)[0, 0]
    return sorted((pooled.topk(keep).indices + prompt_len).tolist())


def test_alpha_one_selects_exactly_what_the_attention_term_selects():
    torch.manual_seed(2)
    rows, q_heads, kv_heads, slots, window, dim = 2, 4, 2, 30, 6, 8
    queries = torch.randn(rows, q_heads, window, dim)
    keys = torch.randn(rows, kv_heads, slots, dim)
    prompt = 5
    candidates = torch.zeros(rows, kv_heads, slots, dtype=torch.bool)
    candidates[..., prompt:slots - window] = True
    evolution = (torch.rand(rows, 1, slots) * 10).expand(-1, kv_heads, -1)  # one per token, as a shared selection keeps
    every = torch.ones(rows, window, dtype=torch.bool)
    keep = 8
    for alpha, same in ((1.0, True), (0.0, False)):
        scores = infokv_scores(queries, every, keys, candidates, evolution, dim ** -0.5, alpha=alpha, kernel=7,
                               shared=True, normalize_attention=True)
        for row in range(rows):
            chosen = sorted(scores[row, 0].topk(keep).indices.tolist())
            expected = rpc_keep(queries[row], keys[row].repeat_interleave(q_heads // kv_heads, dim=0), prompt, window,
                                keep)
            assert (chosen == expected) == same
            assert torch.equal(scores[row, 0], scores[row, 1])  # one selection per layer


def test_a_compression_keeps_the_prompt_the_window_and_rpcs_choice():
    torch.manual_seed(3)
    q_heads, kv_heads, dim, length = 4, 2, 8, 6
    pad = torch.ones(1, length, dtype=torch.bool)
    q, k, v = torch.randn(1, q_heads, length, dim), torch.randn(1, kv_heads, length, dim), torch.randn(1, kv_heads,
                                                                                                       length, dim)
    steps = [(torch.randn(1, q_heads, 1, dim), torch.randn(1, kv_heads, 1, dim), torch.randn(1, kv_heads, 1, dim))
             for _ in range(30)]
    policy = InfoKVPolicy(24, alpha=1.0, window=4, compress_every=8)  # cut 24 -> 16: 6 prompt + 4 newest + 6
    held, _ = drive_layer(policy, q, k, v, pad, steps, dim ** -0.5)
    # The cut runs after the step that fills the 24th slot; the next step's log holds its 16 and one new token.
    after = next(step for step in range(1, len(held)) if len(held[step][0][0]) < len(held[step - 1][0][0]))
    cut = after - 1
    all_keys = torch.cat([k] + [s[1] for s in steps[:cut + 1]], dim=2)[0]  # [Hkv, 24, D]: every token, held
    window_queries = torch.cat([s[0] for s in steps[cut - 3:cut + 1]], dim=2)[0]  # [Hq, 4, D]
    expected = rpc_keep(window_queries, all_keys.repeat_interleave(q_heads // kv_heads, dim=0), length, 4, 6)
    assert all_keys.shape[1] == 24
    assert held[after][0][0] == set(range(length)) | set(expected) | set(range(20, 25))


@pytest.mark.gpu
@pytest.mark.parametrize("compile_step", [False, True])
def test_observing_keeps_the_decode_step_in_its_cuda_graph(compile_step):
    """The logits and hidden states InfoKV observes, under the captured decode step (and the compiled
    forward inside it): every step replays, and the tokens and per-slot E are the eager run's."""
    model, tokenizer = load_model(tiny_spec("qwen3"), torch.device("cuda"))
    prompts = [[5 + (7 * i + 3 * n) % 300 for i in range(n)] for n in (9, 60)]
    made = []

    def run(cuda_graph):
        def factory():
            made.append(InfoKVPolicy(48, compress_every=8))
            return made[-1]

        config = EngineConfig(cuda_graph=cuda_graph, compile=compile_step and cuda_graph)
        engine = Engine(model, factory, [], tokenizer.pad_token_id, config)
        return engine.generate(prompts, GenerationConfig(max_new_tokens=200, ignore_eos=True), [0, 1]), made[-1]

    (graphed, graphed_policy), (eager, eager_policy) = run(True), run(False)
    assert graphed.cuda_graph and not eager.cuda_graph
    assert graphed.tokens == eager.tokens
    for mine, theirs in zip(graphed_policy.layers, eager_policy.layers, strict=True):
        torch.testing.assert_close(mine.state["evolution"], theirs.state["evolution"], rtol=1e-3, atol=1e-4)


def test_bad_fields_are_user_errors():
    with pytest.raises(UserError, match="alpha"):
        InfoKVPolicy(64, alpha=1.5)
    with pytest.raises(UserError, match="layer_state"):
        InfoKVPolicy(64, layer_state="middle")
    with pytest.raises(UserError, match="granularity"):
        InfoKVPolicy(64, granularity="head")
