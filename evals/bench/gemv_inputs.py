"""An Inductor graph pass for the one-row step: store a matrix-vector product's input when it is costly
to recompute, instead of letting Inductor inline it into the product's reduction.

At a batch of one, Inductor with coordinate-descent tuning rewrites each `x @ W^T` (x `[1, K]`) as
`(x.unsqueeze(2) * W^T.unsqueeze(0)).sum(1)`, a reduction whose programs each evaluate x's pointwise
expression for their own outputs. On GPUs it stores x only if the expression has more than
`realize_opcount_threshold` operations (30); for the down projection's `silu(gate) * up` (10
operations, one an exponential) every program recomputes 12288 sigmoids. Lowering the threshold
stores it, and with it every small expression a broadcast reads (rotary pieces, norms' scaled inputs:
20 stored nodes a layer instead of 12 in a one-layer Qwen3). This pass stores just the inputs of those
reductions whose expression holds an exponential or another transcendental op, the rule Inductor
applies on the CPU. Used by `evals.bench.mlp_fusion` and `evals.bench.compile_options` as the
Inductor option `{"post_grad_custom_post_pass": "store_costly_gemv_inputs"}`; not an engine setting
until a benchmark shows the step faster with it (docs/engine.md, "Vanilla at batch 1").
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten, prims = torch.ops.aten, torch.ops.prims

TRANSCENDENTAL = {aten.exp.default, aten.sigmoid.default, aten.tanh.default, aten.log.default,
                  aten.erf.default, aten.pow.Tensor_Tensor}


def inlined(node: torch.fx.Node) -> bool:
    """Whether Inductor may inline `node` into its readers: a pointwise op or a view. Anything else
    (a reduction, a matmul left to a library, a custom op, a graph input) is stored."""
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and (torch.Tag.pointwise in target.tags or target.is_view))


def gemv_input(node: torch.fx.Node) -> torch.fx.Node | None:
    """x if `node` is the one-row product `sum(mul(unsqueeze(x, 2), unsqueeze(permute(W), 0)), [1])`."""
    if node.target is not aten.sum.dim_IntList or list(node.args[1]) != [1]:
        return None
    product = node.args[0]
    if not isinstance(product, torch.fx.Node) or product.target is not aten.mul.Tensor:
        return None
    row, _ = product.args
    if not isinstance(row, torch.fx.Node) or row.target is not aten.unsqueeze.default or row.args[1] != 2:
        return None
    x = row.args[0]
    value = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    # a graph of dynamic rows has a symbolic size here, which must not become a guard
    return x if value is not None and statically_known_true(value.shape[0] == 1) else None


def costly(node: torch.fx.Node) -> bool:
    """Whether the expression that Inductor would inline for `node` holds a transcendental op: its
    ancestors through pointwise ops and views, up to stored values."""
    seen, todo = set(), [node]
    while todo:
        current = todo.pop()
        if current in seen or not inlined(current):
            continue
        seen.add(current)
        if current.target in TRANSCENDENTAL:
            return True
        todo += [arg for arg in current.all_input_nodes]
    return False


class StoreCostlyGemvInputs(CustomGraphPass):
    """Inserts `prims.inductor_force_stride_order` (which Inductor lowers by storing its input in the
    given strides) between each one-row product and its input, where that input is `costly`."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            x = gemv_input(node)
            if x is None or x.target is prims.inductor_force_stride_order.default or not costly(x):
                continue
            row = node.args[0].args[0]
            with graph.inserting_after(x):
                stride = list(x.meta["val"].stride())
                stored = graph.call_function(prims.inductor_force_stride_order.default, (x, stride))
            stored.meta["val"] = x.meta["val"]
            row.replace_input_with(x, stored)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))


PASSES = {"store_costly_gemv_inputs": StoreCostlyGemvInputs}


def resolve_passes(options: dict) -> dict:
    """`options` with a graph pass named by string (JSON cannot hold the object) replaced by the pass."""
    return {key: PASSES[value]() if isinstance(value, str) and key.endswith("_pass") and value in PASSES else value
            for key, value in options.items()}
