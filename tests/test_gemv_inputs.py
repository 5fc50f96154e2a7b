"""`evals.bench.gemv_inputs`: the pass stores the one-row down projection's input (the SwiGLU product,
which holds an exponential) and no other product's input, and the graph computes what it did."""

from __future__ import annotations

import torch
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

import evals.bench.mlp_fusion as mlp_fusion
from evals.bench.gemv_inputs import StoreCostlyGemvInputs, resolve_passes

aten, prims = torch.ops.aten, torch.ops.prims
HIDDEN, INTERMEDIATE = 64, 192


def one_row_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The rewrite Inductor applies to a one-row matmul on CUDA under coordinate-descent tuning."""
    return (a.unsqueeze(2) * b.unsqueeze(0)).sum(dim=1)


def inputs():
    generator = torch.Generator().manual_seed(0)

    def randn(*shape, scale=0.1):
        return (torch.randn(*shape, generator=generator) * scale).to(torch.bfloat16)

    return (randn(1, HIDDEN, scale=1.0), 1 + randn(HIDDEN), randn(INTERMEDIATE, HIDDEN), randn(INTERMEDIATE, HIDDEN),
            randn(HIDDEN, INTERMEDIATE))


def stored_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [node for node in graph.nodes if node.target is prims.inductor_force_stride_order.default]


def test_only_the_swiglu_product_is_stored():
    args = inputs()
    traced = make_fx(mlp_fusion.block, decomposition_table=select_decomp_table() | {aten.mm.default: one_row_mm})(*args)
    products = [node for node in traced.graph.nodes if node.target is aten.sum.dim_IntList]
    assert len(products) == 3  # gate, up, down
    before = traced(*args)
    StoreCostlyGemvInputs()(traced.graph)
    (stored,) = stored_nodes(traced.graph)
    ancestors, todo = set(), [stored]
    while todo:
        node = todo.pop()
        ancestors.add(node.target)
        todo += node.all_input_nodes
    assert aten.exp.default in ancestors or aten.sigmoid.default in ancestors
    assert stored.users and all(user.target is aten.unsqueeze.default for user in stored.users)
    StoreCostlyGemvInputs()(traced.graph)  # a second run stores nothing more
    assert len(stored_nodes(traced.graph)) == 1
    traced.recompile()
    assert torch.equal(traced(*args), before)  # a store changes no value


def test_inductor_lowers_the_stored_product(monkeypatch):
    """Through Inductor (the CPU backend, the one-row rewrite put in as on CUDA): the pass's store lowers,
    and the block gives the eager block's values to bf16 rounding."""
    monkeypatch.setitem(torch._inductor.decomposition.decompositions, aten.mm.default, one_row_mm)
    args = inputs()
    torch._dynamo.reset()
    with torch._inductor.config.patch(post_grad_custom_post_pass=StoreCostlyGemvInputs(), fx_graph_cache=False):
        out = torch.compile(mlp_fusion.block, fullgraph=True)(*args)
    torch._dynamo.reset()
    reference = mlp_fusion.block(*args).float()
    assert (out.float() - reference).abs().max() <= 0.02 * reference.abs().max()


def test_a_pass_is_named_in_json_options():
    options = resolve_passes({"combo_kernels": True, "post_grad_custom_post_pass": "store_costly_gemv_inputs"})
    assert options["combo_kernels"] is True
    assert isinstance(options["post_grad_custom_post_pass"], StoreCostlyGemvInputs)
