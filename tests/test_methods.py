"""The contract every KV method keeps (docs/methods.md, "Rules every method follows"), for every method
config of conf/method/ and both variants where it has them, on the tiny Llama, Qwen2 and Qwen3 models,
batched with left padding:

- with a budget above prompt + max_new_tokens, greedy tokens equal the full cache's;
- with a budget below the prompts, no layer ever holds more than `budget` slots, checked after
  every store and every attention call, prefill included.
"""

from __future__ import annotations

import gc
import weakref

import pytest
from helpers import capped_policy, generate, method_names, method_variants, policy_of

from baselines.vanilla import VanillaPolicy

# Small budgets shrink the compression interval of interval methods, with a warning expected here.
pytestmark = pytest.mark.filterwarnings("ignore:.*leaves no room:UserWarning")

TEXTS = ["What is 2 + 3?", "hi", "Compute the sum of the first ten odd numbers, please."]
LONG_TEXTS = ["Solve for x: 3x + 7 = 22, then add five. " * 2, "A train leaves at noon at 60 mph; when? " * 3]


@pytest.fixture(scope="module")
def full_cache(tiny):
    return generate(tiny, VanillaPolicy, TEXTS, max_new_tokens=32)


@pytest.mark.parametrize("method,variant", method_variants())
def test_large_budget_equals_full_cache(tiny, full_cache, method, variant):
    prompts, expected = full_cache
    budget = max(map(len, prompts)) + 32 + 3  # + 3: R-KV lf_repo attends to at most budget - 4 tokens
    fields = {} if variant is None else {"variant": variant}
    _, result = generate(tiny, lambda: policy_of(method, budget, **fields), TEXTS, max_new_tokens=32)
    assert result.tokens == expected.tokens


@pytest.mark.parametrize("method,variant", method_variants())
def test_budget_is_a_hard_cap_at_every_step(tiny, method, variant):
    budget = 40
    fields = {} if variant is None else {"variant": variant}
    prompts, result = generate(tiny, lambda: capped_policy(method, budget, **fields), LONG_TEXTS,
                               max_new_tokens=160)
    assert min(map(len, prompts)) > budget  # prefill compression runs
    assert max(result.peak_slots) <= budget
    assert all(len(tokens) == 160 for tokens in result.tokens)



@pytest.mark.parametrize("method", method_names())
def test_a_finished_batch_frees_its_policy_without_garbage_collection(tiny, method):
    """A policy (and the KV buffers it owns) is released by reference counting when its batch ends:
    a reference cycle would keep a whole batch's cache alive into the next batch's peak memory."""
    released = []

    def factory():
        policy = policy_of(method, 40)  # the full cache drops it (uses_budget)
        released.append(weakref.ref(policy))
        return policy

    gc.disable()
    try:
        generate(tiny, factory, LONG_TEXTS, max_new_tokens=8)
        assert released and all(ref() is None for ref in released)
    finally:
        gc.enable()
