"""LKV: its budgets' rounding by the formula of docs/methods.md, argmin eviction against a plain
simulation on hand-set scores, the per-head caps at every step through the engine, the slot
features, and the training's Soft-TopK against a hard top-k. Large budget = the full cache's
tokens and the hard cap (the prior, on the tiny models): test_methods.py."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import LONG_TEXTS, capped, drive_layer, generate, lkv_weights_file, tiny_model
from safetensors.torch import load_file
from transformers import AttentionInterface

from baselines.lkv import PARAMETERS, LKVPolicy, head_budgets, prior_parameters, slot_features, token_scores
from evals.canary.train_lkv import ATTENTION, SoftEviction, capacities, hard_topk, soft_topk
from longflow.cache import ATTENTION_NAME
from longflow.errors import UserError
from longflow.policy import PromptObservation


def test_budgets_by_the_formula():
    logits = torch.tensor([[0.0, -1.0], [0.5, 0.5], [-2.0, 0.3]])
    budget = 100
    p = [[math.exp(x) for x in row] for row in logits.tolist()]
    total = sum(map(sum, p))
    p = [[x / total for x in row] for row in p]
    largest = [max(row) for row in p]
    expected_slots = [math.floor(3 * budget * m / sum(largest)) for m in largest]
    expected_heads = [[max(2, math.floor(s * x / m)) for x in row] for s, m, row in zip(expected_slots, largest, p,
                                                                                         strict=True)]
    slots, heads = head_budgets(logits, budget)
    assert slots == expected_slots and heads == expected_heads
    assert sum(slots) <= 3 * budget and all(max(h) == s and min(h) >= 2 for s, h in zip(slots, heads, strict=True))
    assert head_budgets(torch.zeros(4, 2), 96) == ([96] * 4, [[96, 96]] * 4)  # uniform shares: the budget
    # The training's capacities are the same numbers before the floors.
    assert torch.allclose(capacities(logits, budget).floor(), torch.tensor(expected_heads, dtype=torch.float32))


def test_slot_features_as_documented():
    keys, values = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)
    positions = torch.tensor([0, 1, 7, -1, 30]).expand(2, 3, 5)
    features = slot_features(keys, values, positions)
    assert features.shape == (2, 3, 5, 6)
    assert torch.equal(features[..., :4], keys)
    assert torch.allclose(features[..., 4], values.norm(dim=-1).log())
    assert torch.allclose(features[..., 5], torch.tensor([0.0, math.log(2), math.log(8), 0.0, math.log(31)]))


def simulate(scores, prompt_len, capacity, steps):
    """One KV head by hand: the prompt's top capacity - 1 by score, then each step's token added and
    attended, and a full cache's lowest-scored slot evicted. Returns the held positions per step."""
    held = set(range(prompt_len))
    if prompt_len > capacity - 1:
        held = set(sorted(held, key=lambda p: -scores[p])[:capacity - 1])
    log = []
    for t in range(steps):
        held.add(prompt_len + t)
        log.append(set(held))
        if len(held) == capacity:
            held.remove(min(held, key=lambda p: scores[p]))
    return log


def test_argmin_eviction_equals_a_plain_simulation(tmp_path):
    torch.manual_seed(0)
    batch, q_heads, kv_heads, length, head_dim, steps, budget = 2, 4, 2, 12, 8, 20, 9
    # score = the key's first coordinate; the second head gets 6 slots of the first's 9.
    w_linear = torch.zeros(1, kv_heads, head_dim + 2)
    w_linear[..., 0] = 1.0
    logits = [[0.0, math.log(6.5 / 9)]]
    policy = LKVPolicy(budget, weights=lkv_weights_file(tmp_path, 1, kv_heads, head_dim, logits, w_linear))
    pad = torch.ones(batch, length, dtype=torch.bool)
    q, k, v = (torch.randn(batch, n, length, head_dim) for n in (q_heads, kv_heads, kv_heads))
    decode = [tuple(torch.randn(batch, n, 1, head_dim) for n in (q_heads, kv_heads, kv_heads)) for _ in range(steps)]
    held_log, _ = drive_layer(policy, q, k, v, pad, decode, head_dim ** -0.5)
    assert policy.head_slots == [[9, 6]]
    for b in range(batch):
        for h, capacity in enumerate((9, 6)):
            scores = k[b, h, :, 0].tolist() + [float(ks[b, h, 0, 0]) for _, ks, _ in decode]
            assert [log[b][h] for log in held_log] == simulate(scores, length, capacity, steps)


def test_every_head_within_its_capacity_at_every_step(tmp_path):
    model, tokenizer = tiny_model("qwen3")  # 2 layers, 2 KV heads, head dim 16
    path = lkv_weights_file(tmp_path, 2, 2, 16, [[0.4, -0.3], [0.0, 0.2]])
    made = []

    def factory():
        made.append(capped(LKVPolicy)(24, weights=path))
        return made[-1]

    prompts, result = generate((model, tokenizer), factory, LONG_TEXTS, max_new_tokens=60)
    assert min(map(len, prompts)) > 24  # the prompt is cut at prefill
    policy = made[0]
    assert len({c for caps in policy.head_slots for c in caps}) > 2  # the heads' capacities differ
    full = [slots.valid.sum(dim=-1)[0].tolist() for slots in policy.layers]
    assert full == policy.head_slots  # after 60 steps every head is full, at its own capacity
    assert max(result.peak_slots) == max(policy.layer_slots)


class Recomputed(LKVPolicy):
    """LKV whose decode step scores every slot again from its key, value and position (the rule
    without a stored score), checking the stored scores of the held slots against that first."""

    def score(self, obs):
        valid = obs.valid
        fresh = token_scores(slot_features(obs.keys, obs.values, obs.positions),
                             *(self.params[name][obs.layer] for name in PARAMETERS[1:]))
        if not isinstance(obs, PromptObservation):
            torch.testing.assert_close(obs.state("score")[valid], fresh[valid], rtol=1e-6, atol=1e-6)
            self.checked += int(valid.sum())
        return fresh


def test_stored_scores_are_the_per_step_recomputation(tmp_path):
    """The score stored when a slot is written (prompt and decode tokens, across evictions) equals its
    recomputation at every later step, and the tokens are those of the recomputing rule."""
    model, tokenizer = tiny_model("qwen3")
    path = lkv_weights_file(tmp_path, 2, 2, 16, [[0.4, -0.3], [0.0, 0.2]])
    made = []

    def recomputed():
        made.append(Recomputed(24, weights=path))
        made[-1].checked = 0
        return made[-1]

    _, stored = generate((model, tokenizer), lambda: LKVPolicy(24, weights=path), LONG_TEXTS, max_new_tokens=40)
    _, fresh = generate((model, tokenizer), recomputed, LONG_TEXTS, max_new_tokens=40)
    assert made[0].checked > 0
    assert stored.tokens == fresh.tokens


def test_a_file_of_another_shape(tmp_path):
    model, tokenizer = tiny_model("qwen3")
    path = lkv_weights_file(tmp_path, 4, 2, 32, [[0.0, 0.0]] * 4)
    with pytest.warns(UserWarning, match="using the prior"):
        generate((model, tokenizer), lambda: LKVPolicy(24, weights=path), LONG_TEXTS, max_new_tokens=4)
    with pytest.raises(UserError, match="trained for"):
        generate((model, tokenizer), lambda: LKVPolicy(24, weights=path, other_models="error"), LONG_TEXTS,
                 max_new_tokens=4)


def test_bad_fields():
    with pytest.raises(UserError, match="not found"):
        LKVPolicy(24, weights="no/such/file.safetensors")
    with pytest.raises(UserError, match="budget_scope"):
        LKVPolicy(24, budget_scope="per_layer")
    with pytest.raises(UserError, match="other_models"):
        LKVPolicy(24, other_models="guess")


def test_soft_topk_hard_limit_is_the_top_k():
    torch.manual_seed(0)
    scores = torch.randn(3, 2, 7, 20)
    candidates = torch.rand(3, 2, 7, 20) < 0.8
    count = torch.tensor([[4.0, 9.0]] * 3)
    soft = soft_topk(scores, candidates, count, temperature=1e-6, newton=3)
    expected = torch.zeros_like(scores)
    for index in torch.cartesian_prod(*map(torch.arange, scores.shape[:3])).tolist():
        b, h, r = index
        ids = candidates[b, h, r].nonzero()[:, 0]
        k = min(int(count[b, h]), len(ids))
        best = ids[scores[b, h, r, ids].topk(k).indices]
        expected[b, h, r, best] = 1.0
    assert torch.allclose(soft, expected, atol=1e-3)
    assert torch.equal(hard_topk(scores, candidates, count), expected)


def test_soft_topk_keeps_the_count_and_passes_gradients():
    torch.manual_seed(1)
    scores = torch.randn(1, 2, 5, 30, requires_grad=True)
    candidates = torch.ones(1, 2, 5, 30, dtype=torch.bool)
    count = torch.tensor([[6.5, 12.0]], requires_grad=True)
    mask = soft_topk(scores, candidates, count, temperature=0.5, newton=8)
    assert torch.allclose(mask.sum(dim=-1), count.detach()[..., None].expand(1, 2, 5), atol=1e-3)
    (mask * torch.randn_like(mask)).sum().backward()
    assert scores.grad.abs().sum() > 0 and count.grad.abs().sum() > 0
    # The implicit gradient keeps the count: no score moves the mask's sum.
    kept = torch.autograd.grad(soft_topk(scores, candidates, count, 0.5, 8).sum(), scores)[0]
    assert kept.abs().max() < 1e-5


def test_parameters_named_as_the_file():
    assert PARAMETERS == ("budget_logits", "w_linear", "w_in", "b_in", "w_out")
    assert set(prior_parameters(2, 2, 8, 4)) == set(PARAMETERS)


def test_the_training_mask_in_its_hard_limit_is_what_the_engine_decodes(tmp_path):
    """The student's forward with the hard mask, fed the engine's own greedy output under LKV, predicts
    that output token for token: the training relaxes exactly the method's selection."""
    model, tokenizer = tiny_model("qwen3")
    path = lkv_weights_file(tmp_path, 2, 2, 16, [[0.4, -0.3], [0.0, 0.2]])
    prompts, result = generate((model, tokenizer), lambda: LKVPolicy(24, weights=path), LONG_TEXTS[:1],
                               max_new_tokens=48)
    prompt_len = len(prompts[0])
    assert prompt_len > 24  # the prompt is cut, and the decode steps evict
    student = SoftEviction(load_file(path))
    student.hard, student.prompt_len, student.budget = True, prompt_len, 24
    AttentionInterface.register(ATTENTION, student.attention)
    model.set_attn_implementation(ATTENTION)
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompts[0] + result.tokens[0][:-1]])).logits[0, prompt_len - 1:]
    finally:
        model.set_attn_implementation(ATTENTION_NAME)
    assert logits.argmax(dim=-1).tolist() == result.tokens[0]
