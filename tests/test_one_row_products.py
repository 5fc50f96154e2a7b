"""`longflow.one_row_products` on the CPU through Inductor: the compiled decode step of each tiny
family at a batch of one, its one-row products replaced by `longflow::one_row_product` (q/k/v and
gate/up one launch each, the RMSNorms, SwiGLU and residual adds taken over as docs/engine.md says),
gives the eager forward's tokens; a batch of two and what the pass does not recognise keep Inductor's
products. Each in both forms of a product: `mm`, as on the CPU, and the product and sum that Inductor
decomposes a one-row `mm` into on a GPU under kernel tuning (the `reduction` form, its decomposition
put in the CPU's table for the test). The op's CPU path against the formulas in float64 (its GPU path
is the kernel of tests/test_gemv_kernel.py; tests/test_gpu.py runs the pass on a GPU)."""

from __future__ import annotations

import pytest
import torch
import torch._inductor.decomposition as inductor_decompositions
import torch.nn.functional as F
from helpers import LONG_TEXTS, TEXTS, policy_of, tiny_model
from torch._decomp.decompositions import pw_cast_for_opmath
from torch._inductor.utils import fresh_cache
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from longflow.compile import CompiledForward
from longflow.config import GenerationConfig
from longflow.engine import Engine
from longflow.one_row_products import OneRowProducts, one_row_product

pytestmark = pytest.mark.slow  # Inductor compiles C++ on the CPU


@pw_cast_for_opmath
def one_row_reduction(rows, weight_t, out_dtype=None):
    """Inductor's decomposition of `mm` on a GPU under coordinate-descent tuning, for one row."""
    if rows.shape[0] != 1:
        return NotImplemented
    return (rows.unsqueeze(2) * weight_t.unsqueeze(0)).sum(dim=1)


@pytest.fixture(params=["mm", "reduction"])
def product_form(request, monkeypatch):
    """The form the pass sees a product in (see the module's docstring), compiled afresh: a graph
    from Inductor's caches, whose keys do not hold the decomposition table, runs no pass."""
    torch._dynamo.reset()
    if request.param == "reduction":
        monkeypatch.setitem(inductor_decompositions.decompositions, torch.ops.aten.mm.default, one_row_reduction)
    inductor_decompositions.fast_random_decomps.cache_clear()  # the table is cached at its first use
    with fresh_cache():
        yield request.param
    monkeypatch.undo()
    inductor_decompositions.fast_random_decomps.cache_clear()


def generate(model, tokenizer, compiled, texts, steps=20):
    engine = Engine(model, lambda: policy_of("vanilla", None), [], tokenizer.pad_token_id)
    engine.decode_forward = compiled
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    return engine.generate(prompts, GenerationConfig(max_new_tokens=steps, ignore_eos=True),
                           list(range(len(texts)))).tokens


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_of_one_gives_the_eager_tokens(family, dtype, product_form):
    """Per layer: q, k, v (Qwen2's have biases, `addmm`, and stay Inductor's), o, gate, up and down;
    then the LM head after the final norm. In bf16 the kernel does not round the normed input to bf16
    as the eager forward does; 20 steps of a random tiny model still give its tokens."""
    model, tokenizer = tiny_model(family)
    model = model.to(dtype)
    layers = model.config.num_hidden_layers
    compiled = CompiledForward(model, tuning=True, gemv=True)
    assert generate(model, tokenizer, compiled, TEXTS[:1]) == generate(model, tokenizer, None, TEXTS[:1])
    assert not compiled.failed
    qkv = 0 if family == "qwen2" else 3
    assert compiled.gemv.replaced == layers * (qkv + 4) + 1
    assert compiled.gemv.launches == layers * (bool(qkv) + 3) + 1
    # the norms before q|k|v (not Qwen2's) and gate|up and the final one; the residual after o and down
    assert compiled.gemv.fused == {"norm": layers * (1 + bool(qkv)) + 1, "swiglu": layers, "residual": 2 * layers}


def test_a_batch_of_two_keeps_inductors_products(product_form):
    model, tokenizer = tiny_model("qwen3")
    compiled = CompiledForward(model, tuning=True, gemv=True)
    assert generate(model, tokenizer, compiled, LONG_TEXTS, steps=4) == generate(model, tokenizer, None, LONG_TEXTS,
                                                                                   steps=4)
    assert compiled.gemv.replaced == compiled.gemv.launches == 0


def test_what_the_pass_does_not_recognise_stays_unfused(product_form):
    """A norm of another form (Gemma's `1 + weight`, its scale in bf16) and a GELU instead of SiLU: the
    products are replaced, reading the norm's and the activation's output as Inductor computes them."""
    generator = torch.Generator().manual_seed(0)
    up, down = torch.randn(64, 32, generator=generator), torch.randn(32, 32, generator=generator)
    scale = torch.randn(32, generator=generator)

    def block(x):
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + scale)
        gate, value = F.linear(normed, up).chunk(2, dim=-1)
        return F.linear(F.gelu(gate) * value, down)

    products = OneRowProducts()
    compiled = torch.compile(block, options={"post_grad_custom_pre_pass": products})
    x = torch.randn(1, 32, generator=generator)
    torch.testing.assert_close(compiled(x), block(x), rtol=1e-5, atol=1e-5)
    assert products.replaced == 2 and products.launches == 2 and not products.fused


def test_the_ops_cpu_path_is_the_formulas():
    generator = torch.Generator().manual_seed(1)
    weights = [torch.randn(n, 48, generator=generator) for n in (8, 4, 4)]
    x, residual = 3 * torch.randn(1, 1, 48, generator=generator), torch.randn(16, generator=generator)
    norm = Qwen3RMSNorm(48, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(48, generator=generator))
        expected = F.linear(norm(x.double()).reshape(1, 48), torch.cat(weights).double()) + residual.double()
    got = one_row_product(x, weights, norm.weight.float(), residual, 1e-6, False)
    assert got.shape == (1, 16)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    both = torch.randn(96, generator=generator)
    got = one_row_product(both, weights[:1], None, None, 0.0, True)
    expected = F.linear(F.silu(both[:48].double()) * both[48:].double(), weights[0].double())[None]
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
