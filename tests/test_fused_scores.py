"""H2O, VATP, TOVA and LongFlow per KV head decoded through the fused kernel's score epilogues give the
eager path's steps: the same held slots at every step, outputs, accumulated scores, value norms and
next slots, for every variant, on rows of different prompt lengths (prefill compression in some), GQA
and plain MHA.

On a machine without CUDA the kernel runs in Triton's interpreter (`use_kernel: triton`; the
environment line above the imports); shapes stay small there.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from helpers import drive_layer, generate, tiny_model  # noqa: E402

import longflow.policy  # noqa: E402
from baselines.h2o import H2OPolicy  # noqa: E402
from baselines.tova import TOVAPolicy  # noqa: E402
from baselines.vatp import VATPPolicy  # noqa: E402
from longflow.errors import UserError  # noqa: E402
from longflow.kernels import scored_attention  # noqa: E402
from longflow.method import LongFlowPolicy  # noqa: E402

pytestmark = pytest.mark.kernels

# The layer and the tiny model live on the CPU here: with CUDA present the kernel would get CPU tensors
# outside the interpreter. test_gpu's test_fused_scores_give_the_eager_tokens covers the GPU.
on_the_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through Triton's interpreter")

METHODS = {
    "h2o_paper": lambda budget, kernel: H2OPolicy(budget, use_kernel=kernel),
    "h2o_lf_repo": lambda budget, kernel: H2OPolicy(budget, variant="lf_repo", use_kernel=kernel),
    "vatp_paper": lambda budget, kernel: VATPPolicy(budget, n_sink=2, use_kernel=kernel),
    "vatp_lf_repo": lambda budget, kernel: VATPPolicy(budget, variant="lf_repo", use_kernel=kernel),
    "tova": lambda budget, kernel: TOVAPolicy(budget, use_kernel=kernel),
    "longflow_kv_head": lambda budget, kernel: LongFlowPolicy(budget, granularity="kv_head", n_sink=1,
                                                              protect_newest=True,
                                                              use_kernel="reference" if kernel == "eager" else kernel),
}


def random_case(seed, q_heads, kv_heads, batch=3, length=14, head_dim=16, steps=16):
    """Left-padded prompts of three lengths (14, 9, 4 real tokens) and the decode steps' q, k, v."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([length, 9, 4][:batch])
    pad = torch.arange(length)[None, :] >= (length - lengths)[:, None]
    q = 2 * torch.randn(batch, q_heads, length, head_dim, generator=gen)
    k = torch.randn(batch, kv_heads, length, head_dim, generator=gen)
    v = torch.randn(batch, kv_heads, length, head_dim, generator=gen)
    decode = [(2 * torch.randn(batch, q_heads, 1, head_dim, generator=gen),
               torch.randn(batch, kv_heads, 1, head_dim, generator=gen),
               torch.randn(batch, kv_heads, 1, head_dim, generator=gen)) for _ in range(steps)]
    return q, k, v, pad, decode


@on_the_cpu
@pytest.mark.parametrize("budget", [8, 20])  # prompts cut at prefill and full caches early / free slots long
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=["gqa", "mha"])
@pytest.mark.parametrize("method", list(METHODS))
def test_fused_steps_are_the_eager_steps(method, heads, budget, monkeypatch):
    q, k, v, pad, steps = random_case(list(METHODS).index(method) + budget, *heads)
    scale = q.shape[-1] ** -0.5
    eager, fused = METHODS[method](budget, "eager"), METHODS[method](budget, "triton")
    held_eager, outs_eager = drive_layer(eager, q, k, v, pad, steps, scale)
    launches = []

    def counted(*args, **kwargs):
        launches.append(kwargs["score"])
        return scored_attention(*args, **kwargs)

    monkeypatch.setattr(longflow.policy, "scored_attention", counted)
    held_fused, outs_fused = drive_layer(fused, q, k, v, pad, steps, scale)
    assert len(launches) == len(steps)  # every step through the kernel
    assert held_fused == held_eager
    for got, expected in zip(outs_fused, outs_eager, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    mine, theirs = fused.layers[0], eager.layers[0]
    assert mine.state.keys() == theirs.state.keys()
    for name in mine.state:  # the accumulated attention (updated by the kernel) and the norms
        torch.testing.assert_close(mine.state[name], theirs.state[name], rtol=1e-5, atol=1e-6)
    assert torch.equal(fused.next_slot[0], eager.next_slot[0])


def test_cpu_default_is_eager_and_bad_switch_is_a_user_error():
    q, k, v, pad, steps = random_case(0, 4, 2, steps=2)
    policy = H2OPolicy(8)
    drive_layer(policy, q, k, v, pad, steps, 0.25)
    assert policy.fused_score(q[:, :, 0]) is None  # auto on the CPU
    for cls in (H2OPolicy, VATPPolicy, TOVAPolicy):
        with pytest.raises(UserError, match="use_kernel"):
            cls(8, use_kernel="fused")


class DoubledTOVA(TOVAPolicy):
    """A user's method that changes TOVA's score: the fused epilogue (TOVA's) must not apply to it."""

    def score(self, obs):
        return 2 * super().score(obs)


def test_a_subclass_with_its_own_score_stays_eager():
    q, k, v, pad, steps = random_case(0, 4, 2, steps=2)
    policy = DoubledTOVA(8, use_kernel="triton")
    drive_layer(policy, q, k, v, pad, steps, 0.25)
    assert policy.fused_score(q[:, :, 0]) is None
    assert TOVAPolicy(8, use_kernel="triton").fused_score(q[:, :, 0]) is not None


@on_the_cpu
def test_a_tiny_model_generates_the_eager_tokens_through_the_kernel():
    """The whole model (tiny Qwen3, fp32, 2 layers) through the engine: H2O's fused steps give the
    eager steps' tokens, with the prompts cut at prefill and an eviction at every step."""
    model, tokenizer = tiny_model("qwen3")
    texts = ["Solve for x: 3x + 7 = 22, then add five.", "A train leaves at noon at 60 mph; when?"]
    _, fused = generate((model, tokenizer), lambda: H2OPolicy(12, use_kernel="triton"), texts, max_new_tokens=10)
    _, eager = generate((model, tokenizer), lambda: H2OPolicy(12, use_kernel="eager"), texts, max_new_tokens=10)
    assert fused.tokens == eager.tokens
