"""The batch-1 step's weight reads alone: can a chain of one-row products run at the copy rate?

    python -m evals.bench.gemv_chain                 # eager, Inductor, and the Triton GEMV with and without PDL
    python -m evals.bench.gemv_chain --sweep         # each shape's launch configurations first
    python -m evals.bench.gemv_chain --sweep --norms # with the decoder layer's RMSNorms and residual adds

At a batch of one the decode step is a chain of matrix-vector products, each reading its weights once
and the previous product's output. In the engine's compiled step (docs/engine.md, "Vanilla at batch
1") the large ones run near the copy rate and the small ones do not (on an H100, gate|up at 3.1 TB/s,
q|k|v and down at 2.5-2.6, o at 1.9-2.6): a short kernel's ramp and drain are a large part of it. This
benchmark times that chain alone. Per layer, Qwen3-8B's products with q|k|v and gate|up concatenated:
  qkv [6144, 4096] -> o [4096, 4096] (reading qkv's first 4096 outputs, attention's stand-in)
  -> gate|up [24576, 4096] -> down [4096, 12288] (reading silu(gate) * up) -> the next layer's qkv,
36 layers of distinct weights (13.9 GB) in one CUDA graph. With `--norms` the chain is the decoder
layer's: Qwen3's RMSNorm before q|k|v and before gate|up, the residual added after o and after down;
the Triton GEMV then computes the norm in its input's load (RMSNorm's scale is one number a row, so
the sum of squares runs beside the products and scales the result once) and adds the residual in
its store, as Inductor fuses them into its reductions. Timed as
  - `eager`: cuBLAS (`F.linear`) and PyTorch's SwiGLU;
  - `inductor`: each layer compiled with the engine's options at a batch of one (`TUNING_OPTIONS`);
  - `triton`: `longflow.kernels.gemv`, each program `block_n` rows, the SwiGLU computed where down
    reads it (the engine's kernel with `engine.compile_gemv`);
  - `triton_pdl`: the same kernels under programmatic dependent launch (sm_90): a kernel's programs
    start while the one before drains, load the first `head_k` columns of their weights (which do not
    depend on it), and wait (`gdc_wait`) only before reading its output;
  - with `--norms`, `triton_split` and `triton_split_pdl`: the norms left to Inductor's kernels
    (compiled with the engine's options, and its own PDL in the second) and the products reading
    their output, as a graph pass that put only the products in place of Inductor's would leave them.
Each line gives the weights' bytes over the time; `--kernels N` adds each setting's N costliest
kernels per layer. The Triton kernel is the project's, not a library's, because the question is
whether loading weights before the wait pays, which neither cuBLAS nor Inductor's reductions do.
Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import itertools
from functools import partial

import torch
import torch.nn.functional as F
from torch._inductor.utils import fresh_cache

from evals.bench.attention import captured, graph_ms
from evals.bench.common import require_cuda, run
from evals.bench.mlp_fusion import EPS, check_close, normed, print_rates
from evals.bench.weight_matmuls import HIDDEN, INTERMEDIATE, KV, LAYERS
from longflow.compile import TUNING_OPTIONS
from longflow.kernels.gemv import GemvConfig, gemv

QKV = HIDDEN + 2 * KV  # q, k and v concatenated


def layer_shapes() -> dict[str, tuple[int, int]]:
    """Each product's weight shape `[N, K]` in a layer, in chain order."""
    return {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTERMEDIATE, HIDDEN),
            "down": (HIDDEN, INTERMEDIATE)}


def eager_layer(x: torch.Tensor, qkv, o, gate_up, down, ln1=None, ln2=None) -> torch.Tensor:
    """One layer's chain, `x` `[1, HIDDEN]` -> `[1, HIDDEN]`, through cuBLAS (the reference); with the
    RMSNorm weights `ln1`, `ln2` `[HIDDEN]` (`--norms`), the decoder layer's norms and residual adds."""
    if ln1 is None:
        attended = F.linear(x, qkv)[:, :HIDDEN]
        gate, up = F.linear(F.linear(attended, o), gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, down)
    attended = F.linear(normed(x, ln1), qkv)[:, :HIDDEN]
    hidden = x + F.linear(attended, o)
    gate, up = F.linear(normed(hidden, ln2), gate_up).chunk(2, dim=-1)
    return hidden + F.linear(F.silu(gate) * up, down)


class TritonChain:
    """The chain through `gemv`, with its intermediate buffers allocated once (graph-capturable).
    `norm_kernel` (`--norms` only): the RMSNorms computed apart, by this function of (`[1, HIDDEN]`
    hidden, weight), and the products reading its output, instead of the norm in the products' load."""

    def __init__(self, configs: dict[str, GemvConfig], pdl: bool, device: torch.device, dtype: torch.dtype,
                 norm_kernel=None):
        self.configs, self.pdl, self.norm_kernel = configs, pdl, norm_kernel
        self.buffers = {name: torch.empty(n, device=device, dtype=dtype) for name, (n, _) in layer_shapes().items()}

    def normed_input(self, x: torch.Tensor, norm: torch.Tensor | None):
        """(the product's input, the norm left for the product to apply) for `x` `[HIDDEN]`."""
        if norm is None or self.norm_kernel is None:
            return x, norm
        return self.norm_kernel(x[None], norm)[0], None

    def layer(self, x: torch.Tensor, qkv, o, gate_up, down, ln1=None, ln2=None) -> torch.Tensor:
        """`x` `[HIDDEN]` -> the down product's buffer `[HIDDEN]`; with `ln1`, `ln2` as `eager_layer`."""
        buf, cfg, pdl = self.buffers, self.configs, self.pdl
        residual = ln1 is not None
        source, norm = self.normed_input(x, ln1)
        gemv(source, [qkv], buf["qkv"], norm=norm, eps=EPS, config=cfg["qkv"], pdl=pdl)
        # o reads qkv's first HIDDEN outputs, attention's stand-in
        gemv(buf["qkv"][:HIDDEN], [o], buf["o"], residual=x if residual else None, config=cfg["o"], pdl=pdl)
        source, norm = self.normed_input(buf["o"], ln2)
        gemv(source, [gate_up], buf["gate_up"], norm=norm, eps=EPS, config=cfg["gate_up"], pdl=pdl)
        return gemv(buf["gate_up"], [down], buf["down"], residual=buf["o"] if residual else None, swiglu=True,
                    config=cfg["down"], pdl=pdl)


def candidate_configs(k: int, full: bool) -> list[GemvConfig]:
    """Launch configurations that tile a row of `k`; `full` for the wide sweep."""
    grid = dict(block_n=(1, 2, 4, 8), block_k=(512, 1024, 2048), head_k=(1024, 2048, 4096), warps=(4, 8)) if full \
        else dict(block_n=(1, 4, 8), block_k=(1024, 2048), head_k=(2048, 4096), warps=(4, 8))
    configs = [GemvConfig(*values) for values in itertools.product(*grid.values())]
    return [c for c in configs if c.head_k <= k and (k - c.head_k) % c.block_k == 0]


def swept(layers: list[dict], pdl: bool, full: bool) -> dict[str, GemvConfig]:
    """Each product's fastest configuration: its 36 launches (distinct weights, one input) in one graph,
    with or without PDL, each candidate timed; the three fastest printed. With the layers' norms
    (`--norms`), q|k|v and gate|up are timed with a norm and o and down with a residual."""
    configs = {}
    norms = "ln1" in layers[0]
    for name, (n, k) in layer_shapes().items():
        weight = layers[0][name]
        out = torch.empty(n, device=weight.device, dtype=weight.dtype)
        source = torch.randn(2 * k if name == "down" else k, device=weight.device, dtype=weight.dtype)
        extras = {}
        if norms:
            norm = {"qkv": "ln1", "gate_up": "ln2"}.get(name)
            extras = {"norm": layers[0][norm]} if norm else {"residual": torch.randn_like(out)}
        timed = {config: graph_ms([partial(gemv, source, [layer[name]], out, swiglu=name == "down", config=config,
                                           pdl=pdl, eps=EPS, **extras) for layer in layers])
                 for config in candidate_configs(k, full)}
        configs[name] = min(timed, key=timed.get)
        print(f"{name} [{n}, {k}]{' PDL' if pdl else ''}: " + "; ".join(
            f"{c}: {ms * 1e3:.1f} us, {n * k * 2 / ms / 1e9:.2f} TB/s"
            for c, ms in sorted(timed.items(), key=lambda item: item[1])[:3]), flush=True)
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="time each shape's configurations first")
    parser.add_argument("--full", action="store_true", help="with --sweep: the wide grid")
    parser.add_argument("--kernels", type=int, default=0, help="each setting's costliest kernels listed")
    parser.add_argument("--norms", action="store_true", help="the decoder layer's RMSNorms and residual adds too")
    args = parser.parse_args()
    require_cuda("evals.bench.gemv_chain")
    device, dtype = torch.device("cuda"), torch.bfloat16
    layers = [{name: torch.randn(n, k, device=device, dtype=dtype) / k**0.5 for name, (n, k) in layer_shapes().items()}
              for _ in range(LAYERS)]
    if args.norms:
        for layer in layers:
            layer.update(ln1=1 + 0.1 * torch.randn(HIDDEN, device=device, dtype=dtype),
                         ln2=1 + 0.1 * torch.randn(HIDDEN, device=device, dtype=dtype))
    total = sum(w.numel() * w.element_size() for layer in layers for w in layer.values())
    x = torch.randn(HIDDEN, device=device, dtype=dtype)

    configs = {pdl: swept(layers, pdl, args.full) if args.sweep else dict.fromkeys(layer_shapes(), GemvConfig())
               for pdl in (False, True)}

    # A graph replays into the tensors it was captured with: `alive` keeps each setting's chain buffers
    # and every layer output (warm-up ones included) from going back to the allocator.
    graphs, first_layer, alive = {}, {}, {}
    settings = ["eager", "inductor", "triton", "triton_pdl"] + ["triton_split", "triton_split_pdl"] * args.norms
    for setting in settings:
        torch._dynamo.reset()
        with fresh_cache():
            if setting in ("eager", "inductor"):
                layer_fn = eager_layer if setting == "eager" else torch.compile(
                    eager_layer, fullgraph=True, options=TUNING_OPTIONS)
                first = x[None]
            else:
                pdl = setting.endswith("_pdl")
                norm_kernel = None
                if setting.startswith("triton_split"):
                    # Inductor's norm kernel, under its own PDL beside PDL products
                    norm_kernel = torch.compile(normed, fullgraph=True,
                                                options=TUNING_OPTIONS | {"triton.enable_pdl": pdl})
                chain = TritonChain(configs[pdl], pdl, device, dtype, norm_kernel)
                layer_fn, first = chain.layer, x
            outputs = [first.clone()]
            alive[setting] = (layer_fn, outputs)
            graphs[setting] = captured([lambda w=w, f=layer_fn, o=outputs: o.append(f(o[-1], **w)) for w in layers])
            first_layer[setting] = layer_fn(first, **layers[0]).flatten().clone()
    for setting, out in first_layer.items():
        check_close(f"{setting}'s first layer", out, first_layer["eager"])
    print(f"weights {total / 1e9:.2f} GB in {LAYERS} layers, one row")
    print_rates(graphs, total, args.kernels)


if __name__ == "__main__":
    run(main)
