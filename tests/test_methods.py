"""The contract every KV method keeps (docs/methods.md, "Rules every method follows"), for every method
of the registry and both variants, on the tiny Llama, Qwen2 and Qwen3 models, batched with left padding:

- with a budget above prompt + max_new_tokens, greedy tokens equal the full cache's;
- with a budget below the prompts, no layer ever holds more than `budget` slots, checked after
  every store and every attention call, prefill included.
"""

from __future__ import annotations

import pytest
from conftest import VARIANTS, capped, generate

from baselines.vanilla import VanillaPolicy
from evals.configs import method_params
from longflow.methods import METHODS, build_policy, policy_class

# Small budgets shrink R-KV's compression interval, with a warning that is expected here.
pytestmark = pytest.mark.filterwarnings("ignore:rkv.*leaves no room:UserWarning")

COMPRESSING = sorted(set(METHODS) - {"vanilla"})
TEXTS = ["What is 2 + 3?", "hi", "Compute the sum of the first ten odd numbers, please."]
LONG_TEXTS = ["Solve for x: 3x + 7 = 22, then add five. " * 2, "A train leaves at noon at 60 mph; when? " * 3]


@pytest.fixture(scope="module")
def full_cache(tiny):
    return generate(tiny, VanillaPolicy, TEXTS, max_new_tokens=32)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("method", COMPRESSING)
def test_large_budget_equals_full_cache(tiny, full_cache, method, variant):
    prompts, expected = full_cache
    budget = max(map(len, prompts)) + 32 + 3  # + 3: R-KV lf_repo attends to at most budget - 4 tokens
    fields = {**method_params(method), "variant": variant}
    _, result = generate(tiny, lambda: build_policy(method, budget, **fields), TEXTS, max_new_tokens=32)
    assert result.tokens == expected.tokens


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("method", COMPRESSING)
def test_budget_is_a_hard_cap_at_every_step(tiny, method, variant):
    budget = 40
    fields = {**method_params(method), "variant": variant}
    cls = capped(policy_class(method))
    prompts, result = generate(tiny, lambda: cls(budget=budget, **fields), LONG_TEXTS, max_new_tokens=160)
    assert min(map(len, prompts)) > budget  # prefill compression runs
    assert max(result.peak_slots) <= budget
    assert all(len(tokens) == 160 for tokens in result.tokens)

