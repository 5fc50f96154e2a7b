"""The compiled decode step's one-row products through `longflow.kernels.gemv` (`engine.compile_gemv`).

At a batch of one, Inductor's tuned step lowers every linear layer to a Triton reduction of its own,
fused with the RMSNorm before it or the SwiGLU and residual add around it. Those reductions wait for
the previous kernel before loading anything; the GEMV kernel loads its first weights before that wait
under programmatic dependent launch (docs/engine.md, "Vanilla at batch 1"). `OneRowProducts` is an
Inductor post-grad pass (`post_grad_custom_pre_pass`) that puts the kernel, as the custom op
`longflow::one_row_product`, in place of those products. It reads the graph as AOTAutograd
leaves it, where a linear layer without bias is `mm(reshape(x), permute(weight, [1, 0]))` with the
weight a graph input, or under coordinate-descent tuning on a GPU, Inductor's decomposition of that
`mm` into a product and a sum (`_one_row_product`), so no model class is patched and no module
matched by name:
- products of `[1, K]` rows only (a batch of one at decode; the batched step and the prefill keep
  Inductor's), whose weight is a graph input; products with a bias (`addmm`, Qwen2's q, k and v) are
  left as they are;
- products reading one input (q, k and v; gate and up) become one launch, up to three weights, their
  outputs slices of its output;
- an input that is an RMSNorm as transformers' Llama, Qwen2 and Qwen3 write it
  (`weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`, x in float32) is replaced by the norm's own
  input, the kernel computing the norm;
- an input `silu(gate) * up`, where gate and up are one launch's two halves in that order, is read
  from that launch's output, the kernel computing the SwiGLU;
- a lone product whose only use is added to a tensor of its shape (the residual) adds it in the store.
Anything else is left to Inductor, so the pass can only narrow what it replaces.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx import Graph, Node
from torch.fx.node import map_arg

from longflow import kernels

aten, prims = torch.ops.aten, torch.ops.prims
VIEWS = (aten.reshape.default, aten.view.default)
GROUP = 3  # the most weights one launch reads (q, k and v; `longflow.kernels.gemv`)
KERNEL = Path(__file__).parent / "kernels" / "gemv.py"


@torch.library.custom_op("longflow::one_row_product", mutates_args=())
def one_row_product(x: torch.Tensor, weights: list[torch.Tensor], norm: torch.Tensor | None,
                    residual: torch.Tensor | None, eps: float, swiglu: bool) -> torch.Tensor:
    """`[1, N]` = the input times `weights` stacked `[N, K]`^T (+ `residual`, N elements): the input
    is `x` (K elements), its RMSNorm with weight `norm` `[K]`, or `silu(x[:K]) * x[K:]` with `swiglu`.
    On a GPU `longflow.kernels.gemv`; on the CPU (tests) the same sums in PyTorch, in float32."""
    if x.is_cuda:
        return kernels.gemv(x, weights, norm=norm, residual=residual, eps=eps, swiglu=swiglu)[None]
    inputs = x.reshape(-1).float()
    if swiglu:
        gate, up = inputs.chunk(2)
        inputs = torch.nn.functional.silu(gate) * up
    if norm is not None:
        inputs = inputs * torch.rsqrt(inputs.square().mean() + eps) * norm.float()
    out = inputs @ torch.cat(weights).float().T
    if residual is not None:
        out = out + residual.reshape(-1).float()
    return out.to(weights[0].dtype)[None]


@one_row_product.register_fake
def _(x, weights, norm, residual, eps, swiglu):
    return x.new_empty(1, sum(w.shape[0] for w in weights), dtype=weights[0].dtype)


def _is(node, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _val(node: Node):
    return node.meta.get("val")


def _is_weight(node, dims: int) -> bool:
    """A graph input (a parameter, or a constant under freezing) of `dims` dimensions, row-major."""
    return (isinstance(node, Node) and node.op in ("placeholder", "get_attr") and isinstance(_val(node), torch.Tensor)
            and _val(node).dim() == dims and _val(node).is_contiguous())


def _source(node: Node) -> Node:
    """`node` through reshapes and slices that keep every element (the LM head's `[:, -1:]` of one token)."""
    while True:
        if _is(node, *VIEWS):
            node = node.args[0]
        elif _is(node, aten.slice.Tensor) and tuple(_val(node).shape) == tuple(_val(node.args[0]).shape):
            node = node.args[0]
        else:
            return node


def _cast(node, dtype=None):
    """The input of a `convert_element_type` (to `dtype`, if given), else `node`."""
    if _is(node, prims.convert_element_type.default) and dtype in (None, node.args[1]):
        return node.args[0]
    return node


def _pairs(node: Node):
    return ((node.args[0], node.args[1]), (node.args[1], node.args[0]))


def rms_norm_of(node) -> tuple[Node, Node, float] | None:
    """(input, weight, eps) when `node` is `weight * (x * rsqrt(mean(x^2, -1, keepdim) + eps)).to(dtype)`
    with x its input in float32 (transformers' Llama, Qwen2 and Qwen3 RMSNorm), else None."""
    if not _is(node, aten.mul.Tensor) or len(node.args) != 2:
        return None
    for weight, normed in _pairs(node):
        scaled = _cast(normed)
        if not _is_weight(weight, 1) or not _is(scaled, aten.mul.Tensor):
            continue
        for upcast, scale in _pairs(scaled):
            if not _is(scale, aten.rsqrt.default) or not _is(shifted := scale.args[0], aten.add.Tensor):
                continue
            mean, eps = shifted.args
            if not _is(mean, aten.mean.dim) or not isinstance(eps, float):
                continue
            dims, keepdim = mean.args[1], (mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim"))
            square = mean.args[0]
            if (keepdim and list(dims) in ([-1], [_val(square).dim() - 1]) and _is(square, aten.pow.Tensor_Scalar)
                    and square.args[0] is upcast and square.args[1] == 2):
                return _cast(upcast, torch.float32), weight, eps
    return None


def swiglu_of(node) -> tuple[Node, Node] | None:
    """(gate, up) when `node` is `silu(gate) * up`, SiLU as AOTAutograd decomposes it
    (`g / (1 + exp(-g))`, g in float32), else None."""
    if not _is(node, aten.mul.Tensor) or len(node.args) != 2:
        return None
    for activated, up in _pairs(node):
        silu = _cast(activated)
        if _is(silu, aten.silu.default):
            return _cast(silu.args[0], torch.float32), up
        if not _is(silu, aten.div.Tensor):
            continue
        gate, denominator = silu.args
        if not _is(denominator, aten.add.Tensor) or denominator.args[1] != 1:
            continue
        exp = denominator.args[0]
        if _is(exp, aten.exp.default) and _is(exp.args[0], aten.neg.default) and exp.args[0].args[0] is gate:
            return _cast(gate, torch.float32), up
    return None


def _unsqueezed(node, dim: int):
    """The input of `unsqueeze(x, dim)`, through a `convert_element_type` to float32, else None."""
    if _is(node, aten.unsqueeze.default) and node.args[1] == dim:
        return _cast(node.args[0], torch.float32)
    return None


def _transposed_weight(node) -> Node | None:
    """W when `node` is `permute(W, [1, 0])`, W a row-major graph input `[N, K]`."""
    if _is(node, aten.permute.default) and list(node.args[1]) == [1, 0] and _is_weight(node.args[0], 2):
        return node.args[0]
    return None


def _one_row_product(node: Node) -> tuple[Node, Node] | None:
    """(rows `[1, K]`, weight `[N, K]`) when `node` is the product `rows @ weight^T` `[1, N]` in a
    static shape, in either form the graph gives it:
    - `mm(rows, permute(weight, [1, 0]))` (cuBLAS; the CPU);
    - `(rows.unsqueeze(2) * permute(weight, [1, 0]).unsqueeze(0)).sum(1)`, with casts to float32
      before and back after: Inductor's decomposition of a one-row `mm` under coordinate-descent
      tuning on a GPU, which it lowers to a reduction (`torch/_inductor/decomposition.py`, `mm`)."""
    if _is(node, aten.mm.default):
        rows, weight = node.args[0], _transposed_weight(node.args[1])
    else:
        summed = _cast(node, _val(node).dtype) if _is(node, prims.convert_element_type.default) else node
        if not (_is(summed, aten.sum.dim_IntList) and list(summed.args[1]) == [1] and len(summed.args) == 2
                and not summed.kwargs and _is(product := summed.args[0], aten.mul.Tensor)):
            return None
        if summed is not node and len(summed.users) != 1:
            return None
        if summed is node and any(_is(user, prims.convert_element_type.default) for user in node.users):
            return None  # the product is the cast back, matched at that node
        rows, weight = _unsqueezed(product.args[0], 2), _transposed_weight(_unsqueezed(product.args[1], 0))
    if rows is None or weight is None or _val(weight).dtype != _val(node).dtype:
        return None
    shape = _val(rows).shape
    if not (len(shape) == 2 and isinstance(shape[0], int) and shape[0] == 1 and shape[1] == _val(weight).shape[1]):
        return None
    return rows, weight


def _residual_add(product: Node, order: dict[Node, int]) -> tuple[Node, Node] | None:
    """(the add, the residual) when `product`'s only use is a reshape whose only use adds it to a
    tensor of its shape and dtype defined before `product` (where the op goes)."""
    if len(product.users) != 1 or not _is(shaped := next(iter(product.users)), *VIEWS) or len(shaped.users) != 1:
        return None
    add = next(iter(shaped.users))
    if not _is(add, aten.add.Tensor) or add.kwargs or len(add.args) != 2:
        return None
    residual = add.args[1] if add.args[0] is shaped else add.args[0]
    if not isinstance(residual, Node) or residual is shaped:
        return None
    same = (tuple(_val(residual).shape) == tuple(_val(add).shape) == tuple(_val(shaped).shape)
            and _val(residual).dtype == _val(add).dtype)
    # A node the pass inserted precedes every product not yet replaced.
    if not same or order.get(residual, -1) >= order[product]:
        return None
    return add, residual


class OneRowProducts(CustomGraphPass):
    """The post-grad pass described in the module's docstring. Over every graph it ran on: `replaced`
    counts the products it replaced, `launches` the ops it inserted, `fused` what those ops took
    over besides the products (`norm`, `swiglu`, `residual`)."""

    def __init__(self):
        self.replaced = 0
        self.launches = 0
        self.fused = Counter()

    def uuid(self) -> bytes:
        # Inductor's FX graph cache keys compiled graphs on it: this file and the kernel's.
        return get_hash_for_files((__file__, str(KERNEL)))

    def __call__(self, graph: Graph) -> None:
        order = {node: index for index, node in enumerate(graph.nodes)}
        groups: dict[Node, list[tuple[Node, Node]]] = {}
        for node in graph.nodes:
            if (product := _one_row_product(node)) is not None:
                rows, weight = product
                groups.setdefault(_source(rows), []).append((node, weight))
        pieces: dict[Node, tuple[Node, int, int]] = {}  # a slice of an inserted op -> (op, offset, rows)
        for source, products in groups.items():
            for start in range(0, len(products), GROUP):
                self._replace(graph, source, products[start:start + GROUP], pieces, order)
        graph.eliminate_dead_code()
        graph.lint()

    def _input(self, source: Node, k: int, pieces) -> tuple[Node, Node | None, float, bool] | None:
        """(x, norm weight, eps, swiglu) for the op reading `source`, or None where the kernel cannot."""
        if (norm := rms_norm_of(source)) is not None:
            hidden, weight, eps = norm
            if _val(hidden).numel() == k and _val(weight).numel() == k:
                return hidden, weight, eps, False
        if (swiglu := swiglu_of(source)) is not None:
            gate, up = (pieces.get(_source(node)) for node in swiglu)
            if gate and up and gate[0] is up[0] and gate[1:] == (0, k) and up[1:] == (k, k) \
                    and _val(gate[0]).shape[1] == 2 * k:
                return gate[0], None, 0.0, True
        if _val(source).numel() == k:
            return source, None, 0.0, False
        return None

    def _replace(self, graph: Graph, source: Node, products: list[tuple[Node, Node]], pieces, order) -> None:
        weights = [weight for _, weight in products]
        k = _val(weights[0]).shape[1]  # every product of `source` has its K (`_one_row_product`)
        if any(_val(w).dtype != _val(weights[0]).dtype for w in weights):
            return
        spec = self._input(source, k, pieces)
        if spec is None:
            return
        x, norm, eps, swiglu = spec
        first = products[0][0]
        fused = _residual_add(first, order) if len(products) == 1 else None
        with graph.inserting_before(first):
            op = _call(graph, one_row_product._opoverload,
                       (x, weights, norm, None if fused is None else fused[1], eps, swiglu))
            if fused is not None:
                add = fused[0]
                add.replace_all_uses_with(_call(graph, aten.reshape.default, (op, list(_val(add).shape))))
            elif len(products) == 1:
                first.replace_all_uses_with(op)
                pieces[op] = (op, 0, _val(weights[0]).shape[0])
            else:
                offset = 0
                for product, weight in products:
                    rows = _val(weight).shape[0]
                    piece = _call(graph, aten.slice.Tensor, (op, 1, offset, offset + rows))
                    product.replace_all_uses_with(piece)
                    pieces[piece] = (op, offset, rows)
                    offset += rows
        self.replaced += len(products)
        self.launches += 1
        self.fused.update(name for name, used in (("norm", norm is not None), ("swiglu", swiglu),
                                                  ("residual", fused is not None)) if used)


def _call(graph: Graph, target, args: tuple) -> Node:
    """A new node calling `target`, its `val` (a fake tensor) computed as Inductor's lowering needs it."""
    node = graph.call_function(target, args)
    values = map_arg(args, _val)
    fake_mode = torch._guards.detect_fake_mode([v for v in torch.utils._pytree.tree_leaves(values)
                                                if isinstance(v, torch.Tensor)])
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        node.meta["val"] = target(*values)
    return node
