"""The one-row MLP block as the engine compiles it: is the SwiGLU product worth fusing into the down
projection?

    python -m evals.bench.mlp_fusion
    python -m evals.bench.mlp_fusion --kernels 4 '{"realize_opcount_threshold": 8}'

At a batch of one, Inductor with coordinate-descent tuning (the engine's `TUNING_OPTIONS`) lowers each
matrix-vector product to a reduction and inlines its input's pointwise work into it. For the down
projection that input is `silu(gate) * up`, 12288 values that every program of the reduction reads
and recomputes (a sigmoid each) for its own outputs. This benchmark times Qwen3-8B's post-attention
block (RMSNorm, gate, up, SwiGLU, down, residual) at one row, 36 layers of distinct weights in one
CUDA graph, compiled:
  - `fused`: as one function, as in the model's compiled step;
  - `materialized`: as two, the product stored between them (by the gate and up kernel);
  - once per extra JSON object, as `fused` with those Inductor options on top.
and, for scale, eager (cuBLAS). Each line gives the weights' bytes over the time; `--kernels N` adds
each setting's N costliest kernels per layer. What it measured, and what the whole step did with the
product stored: docs/engine.md ("Vanilla at batch 1"). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch._inductor.utils import fresh_cache

from evals.bench.attention import captured, replay_ms, replays_in_turns_ms
from evals.bench.common import require_cuda, run
from evals.bench.weight_matmuls import HIDDEN, INTERMEDIATE, LAYERS
from longflow.compile import TUNING_OPTIONS

EPS = 1e-6  # Qwen3-8B's RMSNorm


def normed(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Qwen3's RMSNorm, in float32 as transformers computes it. `hidden` `[rows, HIDDEN]`."""
    x = hidden.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * x.to(hidden.dtype)


def product(hidden, norm, gate, up):
    """`silu(gate x) * up x` `[rows, INTERMEDIATE]` of the normed hidden state."""
    x = normed(hidden, norm)
    return F.silu(F.linear(x, gate)) * F.linear(x, up)


def down_residual(hidden, act, down):
    return hidden + F.linear(act, down)


def block(hidden, norm, gate, up, down):
    return down_residual(hidden, product(hidden, norm, gate, up), down)


def settings(extra: list[dict]) -> dict[str, tuple[dict | None, bool]]:
    """name -> (Inductor options or None for eager, whether the product is stored between two graphs)."""
    named = {"eager (cuBLAS)": (None, False), "fused": (TUNING_OPTIONS, False),
             "materialized": (TUNING_OPTIONS, True)}
    return named | {f"fused + {json.dumps(options)}": (TUNING_OPTIONS | options, False)
                    for options in extra}


def layer_calls(layers: list[dict], hidden: torch.Tensor, options: dict | None, materialized: bool) -> list:
    """One call per layer, compiled with `options` (eager if None)."""
    if options is None:
        return [lambda w=w: block(hidden, **w) for w in layers]
    compile_ = lambda fn: torch.compile(fn, fullgraph=True, options=options)  # noqa: E731
    if materialized:
        front, back = compile_(product), compile_(down_residual)
        return [lambda w=w: back(hidden, front(hidden, w["norm"], w["gate"], w["up"]), w["down"]) for w in layers]
    fused = compile_(block)
    return [lambda w=w: fused(hidden, **w) for w in layers]


def costliest_kernels(graph: torch.cuda.CUDAGraph, count: int) -> list[tuple[str, float]]:
    """The `count` kernels of one replay of `graph` with the most time, (name, ms per layer)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        replay_ms(graph, 1)
    totals = defaultdict(float)
    for event in profiler.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time_total / 1e3 / LAYERS
    return sorted(totals.items(), key=lambda item: -item[1])[:count]


def check_close(name: str, out: torch.Tensor, reference: torch.Tensor) -> None:
    """Refuses a setting whose output is not `reference`'s: bf16 products summed in other orders are
    equal to rounding, not bit for bit, so within 2% of the reference's largest magnitude."""
    error = (out.float() - reference.float()).abs().max().item()
    if error > 0.02 * reference.float().abs().max().item():
        raise AssertionError(f"{name}: differs from eager by {error:.3g}")


def print_rates(graphs: dict[str, torch.cuda.CUDAGraph], total_bytes: int, kernels: int) -> None:
    """Each graph's replay (in turns) with the weights' bytes over it, and its `kernels` costliest
    kernels per layer."""
    for name, ms in replays_in_turns_ms(graphs).items():
        print(f"{name}: {ms:.3f} ms, {total_bytes / ms / 1e9:.2f} TB/s", flush=True)
        for kernel, kernel_ms in costliest_kernels(graphs[name], kernels):
            print(f"    {kernel_ms * 1e3:7.1f} us/layer  {kernel[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("options", nargs="*", type=json.loads, help="Inductor options on top of the engine's, JSON")
    parser.add_argument("--kernels", type=int, default=0, help="each setting's costliest kernels listed")
    args = parser.parse_args()
    require_cuda("evals.bench.mlp_fusion")
    device, dtype = torch.device("cuda"), torch.bfloat16

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype) * 0.02

    layers = [dict(norm=1 + weight(HIDDEN), gate=weight(INTERMEDIATE, HIDDEN), up=weight(INTERMEDIATE, HIDDEN),
                   down=weight(HIDDEN, INTERMEDIATE)) for _ in range(LAYERS)]
    hidden = torch.randn(1, HIDDEN, device=device, dtype=dtype)
    total = sum(w.numel() * w.element_size() for layer in layers for w in layer.values())
    reference = None
    graphs = {}
    for name, (options, materialized) in settings(args.options).items():
        torch._dynamo.reset()  # each setting compiles afresh: Dynamo's cache does not key on the options
        with fresh_cache(), torch._inductor.config.patch(options or {}):
            calls = layer_calls(layers, hidden, options, materialized)
            graphs[name] = captured(calls)
            out = calls[-1]()
        if reference is None:
            reference = out
        check_close(name, out, reference)
    print(f"weights {total / 1e9:.2f} GB in {LAYERS} layers, one row")
    # each graph was captured under its own options: `interleaved_ms` would capture (and compile) again
    print_rates(graphs, total, args.kernels)


if __name__ == "__main__":
    run(main)
