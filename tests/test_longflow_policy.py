"""LongFlowPolicy on its own: decode against docs/methods.md's formula, slot filling, the budget cap.

Without CUDA the Triton path runs in the interpreter (switch set before Triton defines the kernels).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from baselines.vanilla import VanillaPolicy  # noqa: E402
from longflow.config import GenerationConfig  # noqa: E402
from longflow.engine import Engine  # noqa: E402
from longflow.errors import UserError  # noqa: E402
from longflow.method import LongFlowPolicy  # noqa: E402
from longflow.models import eos_token_ids  # noqa: E402
from longflow.policy import CacheSpec  # noqa: E402

pytestmark = pytest.mark.kernels

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BATCH, LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM = 3, 2, 8, 2, 16
SCALE = HEAD_DIM**-0.5


def spec(prompt_len: int = 8, max_new_tokens: int = 8, dtype=torch.float32) -> CacheSpec:
    return CacheSpec(batch=BATCH, layers=LAYERS, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                     prompt_len=prompt_len, max_new_tokens=max_new_tokens, dtype=dtype, device=DEVICE)


def formula(q, keys, values, valid):
    """docs/methods.md, LongFlow, transcribed head by head: (out `[B, Hq, D]`, next_slot `[B]`).

    valid `[B, S]`; score_j = sum_h sum_d |p_hj v_hj,d| / (Hq D); the lowest free slot first.
    """
    batch, q_heads, head_dim = q.shape
    group = q_heads // keys.shape[1]
    out = torch.empty(batch, q_heads, head_dim, dtype=torch.float64)
    next_slot = torch.empty(batch, dtype=torch.long)
    for b in range(batch):
        score = torch.zeros(keys.shape[2], dtype=torch.float64)
        for h in range(q_heads):
            k, v = keys[b, h // group].double(), values[b, h // group].double()
            logits = (k @ q[b, h].double()) * SCALE
            logits[~valid[b]] = float("-inf")
            p = torch.softmax(logits, dim=0)
            out[b, h] = p @ v
            score += (p[:, None] * v).abs().sum(dim=1)
        score /= q_heads * head_dim
        free = (~valid[b]).nonzero()
        next_slot[b] = free[0, 0] if len(free) else score.masked_fill(~valid[b], float("inf")).argmin()
    return out, next_slot


def fill_layer(policy: LongFlowPolicy, layer: int, gen: torch.Generator) -> torch.Tensor:
    """Random K/V in every slot; row 0 full, row 1 free at slots 3 and 7, row 2 left-padded by 5."""
    slots = policy.layers[layer]
    shape = slots.keys.shape
    slots.keys.copy_(torch.randn(shape, generator=gen))
    slots.values.copy_(torch.randn(shape, generator=gen))
    valid = torch.ones(BATCH, slots.slots, dtype=torch.bool)
    valid[1, [3, 7]] = False
    valid[2, :5] = False
    slots.valid.copy_(valid[:, None, :].expand(shape[:3]))
    positions = torch.arange(slots.slots).expand(BATCH, KV_HEADS, -1)
    slots.positions.copy_(positions.masked_fill(~slots.valid.cpu(), -1))
    return valid


@pytest.mark.parametrize("use_kernel", ["reference", "triton"])
def test_decode_matches_the_formula(use_kernel):
    policy = LongFlowPolicy(budget=40, use_kernel=use_kernel)
    policy.allocate(spec())
    gen = torch.Generator().manual_seed(0)
    valid = fill_layer(policy, 1, gen)
    q = 2 * torch.randn(BATCH, Q_HEADS, HEAD_DIM, generator=gen)
    out = policy.decode(1, q.to(DEVICE), SCALE)

    slots = policy.layers[1]
    want_out, want_slot = formula(q, slots.keys.cpu(), slots.values.cpu(), valid)
    assert torch.allclose(out.cpu().double(), want_out, rtol=1e-4, atol=1e-5)
    next_slot = policy.next_slot[1].cpu()
    assert (next_slot == next_slot[:, :1]).all(), "one shared slot per layer"
    assert next_slot[:, 0].tolist() == want_slot.tolist()
    assert next_slot[1, 0] == 3 and next_slot[2, 0] == 0, "the lowest free slot is filled first"
    assert (policy.next_slot[0] == 0).all(), "other layers untouched"


def test_per_head_granularity_scores_each_kv_head():
    policy = LongFlowPolicy(budget=40, granularity="kv_head")
    policy.allocate(spec())
    gen = torch.Generator().manual_seed(1)
    valid = fill_layer(policy, 0, gen)
    q = torch.randn(BATCH, Q_HEADS, HEAD_DIM, generator=gen)
    policy.decode(0, q.to(DEVICE), SCALE)
    slots, group = policy.layers[0], Q_HEADS // KV_HEADS
    for head in range(KV_HEADS):  # each KV head on its own is LongFlow with G query heads
        heads = slice(head * group, (head + 1) * group)
        keys, values = slots.keys[:, head:head + 1].cpu(), slots.values[:, head:head + 1].cpu()
        _, want = formula(q[:, heads], keys, values, valid)
        assert policy.next_slot[0][:, head].cpu().tolist() == want.tolist()


def run_decode(policy: LongFlowPolicy, steps: int, gen: torch.Generator, start: int = 0) -> list[int]:
    """`steps` store+attend steps on every layer; returns the slots held after each step (max)."""
    positions = torch.full((BATCH,), start, dtype=torch.long, device=DEVICE)
    policy.begin_decode(positions)
    held = []
    for _ in range(steps):
        for layer in range(LAYERS):
            k, v = (torch.randn(BATCH, KV_HEADS, 1, HEAD_DIM, generator=gen).to(DEVICE) for _ in range(2))
            q = torch.randn(BATCH, Q_HEADS, 1, HEAD_DIM, generator=gen).to(DEVICE)
            keys, values = policy.store(layer, k, v)
            out = policy.attend(layer, q, keys, values, SCALE)
            assert out.shape == (BATCH, 1, Q_HEADS, HEAD_DIM)
        held.append(max(int(s.valid.sum(dim=-1).max()) for s in policy.layers))
        positions += 1
    return held


@pytest.mark.parametrize("granularity,n_sink,protect_newest,use_kernel", [
    ("layer", 0, False, "reference"),
    ("layer", 3, True, "reference"),
    ("layer", 2, False, "triton"),
    ("kv_head", 2, True, "reference"),
])
def test_budget_is_never_exceeded(granularity, n_sink, protect_newest, use_kernel):
    budget, steps = 10, 16
    policy = LongFlowPolicy(budget=budget, granularity=granularity, n_sink=n_sink,
                            protect_newest=protect_newest, use_kernel=use_kernel)
    policy.allocate(spec(max_new_tokens=steps))
    held = run_decode(policy, steps, torch.Generator().manual_seed(2))
    assert held == list(range(1, budget + 1)) + [budget] * (steps - budget), "fills free slots, then evicts"
    assert max(policy.peak_slots()) == budget
    for slots in policy.layers:
        positions = slots.positions.cpu()
        if granularity == "layer":
            assert (positions == positions[:, :1]).all(), "one shared selection"
            assert (slots.valid == slots.valid[:, :1]).all()
        for sink in range(n_sink):
            assert (positions == sink).any(dim=-1).all(), f"sink position {sink} was evicted"
        if protect_newest:
            assert (positions == steps - 1).any(dim=-1).all()


def test_prefill_keeps_budget_minus_one_and_the_sinks():
    budget, length = 12, 40
    policy = LongFlowPolicy(budget=budget, n_sink=2)
    policy.allocate(spec(prompt_len=length))
    gen = torch.Generator().manual_seed(3)
    pad = torch.ones(BATCH, length, dtype=torch.bool)
    pad[1, :6] = False  # left padding
    positions = (pad.long().cumsum(dim=-1) - 1).clamp(min=0)
    policy.begin_prefill(pad.to(DEVICE), positions.to(DEVICE))
    for layer in range(LAYERS):
        q = torch.randn(BATCH, Q_HEADS, length, HEAD_DIM, generator=gen).to(DEVICE)
        k, v = (torch.randn(BATCH, KV_HEADS, length, HEAD_DIM, generator=gen).to(DEVICE) for _ in range(2))
        keys, values = policy.store(layer, k, v)
        policy.attend(layer, q, keys, values, SCALE)
    for layer, slots in enumerate(policy.layers):
        assert (slots.valid.sum(dim=-1) == budget - 1).all()
        held = slots.positions[:, 0].cpu()
        assert ((held == 0).any(dim=-1) & (held == 1).any(dim=-1)).all(), "sinks kept at prefill"
        assert (policy.next_slot[layer] == budget - 1).all(), "the first decode token goes to the free slot"
    assert max(run_decode(policy, 5, gen, start=length)) == budget


def authors_snapkv(q, k, keep, window=32, kernel=5):
    """The LongFlow authors' prefill SnapKV for one unpadded row, with loops: q `[Hq, n, D]`, k
    `[Hkv, n, D]` -> the kept positions. The window queries' softmax runs over the keys before the
    window only; summed over heads and queries; average-pooled over those keys (zero beyond them);
    the top keep - window of them, and the window."""
    q_heads, n, dim = q.shape
    group, scored = q_heads // k.shape[0], n - window
    sums = torch.zeros(scored, dtype=torch.float64)
    for h in range(q_heads):
        for t in range(scored, n):
            logits = torch.tensor([float(q[h, t] @ k[h // group, j]) * dim ** -0.5 for j in range(scored)],
                                  dtype=torch.float64)
            sums += torch.softmax(logits, dim=0)
    half = kernel // 2
    pooled = torch.tensor([float(sums[max(0, j - half):j + half + 1].sum()) / kernel for j in range(scored)])
    top = pooled.argsort(descending=True)[:keep - window].tolist()
    return sorted(top) + list(range(scored, n))


def test_lf_repo_prefill_is_the_authors_snapkv():
    """Rows of 60 and 50 real tokens (left padding) above the budget, one of 20 below it."""
    budget, length, lengths = 41, 60, [60, 50, 20]
    gen = torch.Generator().manual_seed(5)
    pad = torch.arange(length) >= (length - torch.tensor(lengths))[:, None]
    q = torch.randn(BATCH, Q_HEADS, length, HEAD_DIM, generator=gen)
    k, v = (torch.randn(BATCH, KV_HEADS, length, HEAD_DIM, generator=gen) for _ in range(2))
    held = {}
    for variant in ("lf_repo", "paper"):
        policy = LongFlowPolicy(budget=budget, variant=variant, use_kernel="reference")
        policy.allocate(CacheSpec(batch=BATCH, layers=1, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                  prompt_len=length, max_new_tokens=4, dtype=torch.float32,
                                  device=torch.device("cpu")))
        policy.begin_prefill(pad, (pad.long().cumsum(dim=-1) - 1).clamp(min=0))
        policy.attend(0, q, *policy.store(0, k, v), SCALE)
        slots = policy.layers[0]
        held[variant] = [sorted(slots.positions[b, 0][slots.valid[b, 0]].tolist()) for b in range(BATCH)]
    for b, n in enumerate(lengths):
        row = slice(length - n, length)
        expected = authors_snapkv(q[b, :, row], k[b, :, row], budget - 1) if n > budget - 1 else list(range(n))
        assert held["lf_repo"][b] == expected
    assert held["paper"][:2] != held["lf_repo"][:2]  # the paper's softmax over all keys chooses otherwise


def test_rejects_bad_fields():
    with pytest.raises(UserError, match="granularity"):
        LongFlowPolicy(budget=8, granularity="token")
    with pytest.raises(UserError, match="use_kernel"):
        LongFlowPolicy(budget=8, use_kernel="cuda")
    with pytest.raises(UserError, match="protected slots"):
        LongFlowPolicy(budget=4, n_sink=3, protect_newest=True)
    with pytest.raises(UserError, match="needs a budget"):
        LongFlowPolicy(budget=None).allocate(spec())


# ---- through the engine, on the tiny models of conftest.py ---------------------------------------

TEXTS = ["What is 2 + 3?", "hi", "Compute the sum of the first ten odd numbers, please."]


def generate(model, tokenizer, policy_factory, max_new_tokens):
    prompts = [tokenizer(text)["input_ids"] for text in TEXTS]
    engine = Engine(model, policy_factory, eos_token_ids(model, tokenizer), tokenizer.pad_token_id)
    generation = GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True)
    return engine.generate(prompts, generation, seeds=[0, 1, 2]), max(map(len, prompts))


@pytest.mark.parametrize("use_kernel,max_new_tokens", [("auto", 24), ("triton", 6)])
def test_big_budget_generates_the_vanilla_tokens(tiny, use_kernel, max_new_tokens):
    """docs/methods.md: with budget >= prompt + max_new_tokens a method must equal full-cache greedy decoding."""
    model, tokenizer = tiny  # on the CPU: "triton" runs the kernel in Triton's interpreter
    if use_kernel == "triton" and torch.cuda.is_available():
        pytest.skip("tiny models live on the CPU here; test_kernel_in_cuda_graph covers the GPU")
    vanilla, length = generate(model, tokenizer, VanillaPolicy, max_new_tokens)
    budget = length + max_new_tokens
    longflow, _ = generate(model, tokenizer, lambda: LongFlowPolicy(budget=budget, use_kernel=use_kernel),
                           max_new_tokens)
    assert longflow.tokens == vanilla.tokens


def test_small_budget_caps_the_cache(tiny):
    model, tokenizer = tiny
    result, _ = generate(model, tokenizer, lambda: LongFlowPolicy(budget=8), 20)
    assert max(result.peak_slots) == 8
    assert all(len(tokens) == 20 for tokens in result.tokens)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_in_cuda_graph_generates_the_vanilla_tokens():
    from helpers import tiny_model

    model, tokenizer = tiny_model("qwen3")
    model.to(DEVICE)
    vanilla, length = generate(model, tokenizer, VanillaPolicy, 24)
    budget = length + 24
    longflow, _ = generate(model, tokenizer, lambda: LongFlowPolicy(budget=budget, use_kernel="triton"), 24)
    assert longflow.cuda_graph
    assert longflow.tokens == vanilla.tokens
    small, _ = generate(model, tokenizer, lambda: LongFlowPolicy(budget=8, use_kernel="triton"), 24)
    assert max(small.peak_slots) == 8
