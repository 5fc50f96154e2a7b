"""One-row products (GEMV) that load their weights before waiting for their input.

At a batch of one the decode step is a chain of matrix-vector products, each reading its weights once
and the previous kernel's output (docs/engine.md, "Vanilla at batch 1"). Under programmatic dependent
launch (PDL, sm_90) a kernel's programs start while the kernel before drains: here each program
loads its rows' first `head_k` columns of weights, which depend on nothing, and only then waits
(`gdc_wait`) for the input. Inductor's reductions, which the compiled step otherwise runs, place
that wait before their loop, so none of their loads moves ahead of it; cuBLAS has no such wait.

One launch computes, for one input, the products of up to three weights that read it (q, k and v; gate
and up), concatenated in its output, with what Inductor fuses around a product:
- the input's RMSNorm (`norm`): its scale is one number per row, so the sum of squares runs beside
  the products and scales each result once; each program reads the whole input anyway;
- SwiGLU (`swiglu`): the input `[2K]` is gate then up, and the product reads `silu(gate) * up`;
- the residual (`residual`), added in the store.
Sums are float32 (the RMSNorm's too, as transformers computes it); unlike the eager forward, the
normed input is not rounded to the weights' dtype before the product.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():
    # As in longflow_attention: the interpreter's switch is read when a kernel is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from longflow.kernels.reductions import reduce_sum  # noqa: E402

MAX_WEIGHTS = 3  # q, k and v


@dataclass(frozen=True)
class GemvConfig:
    """A launch configuration: rows per program, columns per loop step, columns loaded before the wait
    (all three powers of two), warps. The default is what `python -m evals.bench.gemv_chain --sweep`
    found fastest under PDL for Qwen3-8B's q|k|v and down on an H100 (`results/engine/gemv_chain_h100*.txt`);
    for o and gate|up it was not among the three fastest, which were within 1% of each other."""

    block_n: int = 4
    block_k: int = 2048
    head_k: int = 2048
    warps: int = 8

    def __str__(self) -> str:
        return f"{self.block_n}x{self.block_k} head {self.head_k} warps {self.warps}"


@triton.jit
def _input(x, cols, col_ok, K: tl.constexpr, SWIGLU: tl.constexpr):
    """The product's input at `cols` in float32: `x[cols]`, or `silu(x[cols]) * x[K + cols]`."""
    if SWIGLU:
        gate = tl.load(x + cols, mask=col_ok, other=0.0).to(tl.float32)
        up = tl.load(x + K + cols, mask=col_ok, other=0.0).to(tl.float32)
        return gate / (1.0 + tl.exp(-gate)) * up  # tl.sigmoid: see longflow.kernels.reductions
    else:
        return tl.load(x + cols, mask=col_ok, other=0.0).to(tl.float32)


@triton.jit
def _scaled(inputs, norm, cols, col_ok, NORM: tl.constexpr):
    """`inputs` times the RMSNorm weight at `cols` (with NORM)."""
    if NORM:
        return inputs * tl.load(norm + cols, mask=col_ok, other=0.0).to(tl.float32)
    else:
        return inputs


@triton.jit
def gemv_kernel(x, out, weight0, weight1, weight2, norm, residual, rows0, rows1, N, eps, K: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HEAD_K: tl.constexpr, SWIGLU: tl.constexpr,
                NORM: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    """`out[n] = sum_k weight[n, k] * input[k] (+ residual[n])` for this program's BLOCK_N rows, where
    `weight` `[N, K]` is weight0 `[rows0, K]`, weight1 `[rows1, K]` and weight2 stacked (each
    row-major; rows0 and rows1 multiples of BLOCK_N, so that a program reads one of them); `x` `[K]`
    (`[2K]`, gate then up, with SWIGLU), `out` and `residual` `[N]`; with NORM the input is `x`
    RMS-normed and times `norm` `[K]`."""
    first = tl.program_id(0) * BLOCK_N
    if first < rows0:
        weight = weight0 + first.to(tl.int64) * K
    elif first < rows0 + rows1:
        weight = weight1 + (first - rows0).to(tl.int64) * K
    else:
        weight = weight2 + (first - rows0 - rows1).to(tl.int64) * K
    local = tl.arange(0, BLOCK_N)
    rows = first + local
    row_ok = rows < N
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    head = tl.arange(0, HEAD_K)
    head_ok = head < K
    head_weights = tl.load(weight + local[:, None] * K + head[None, :], mask=row_ok[:, None] & head_ok[None, :],
                           other=0.0)
    if PDL:
        # everything above reads weights only; the input is the previous kernel's output
        tl.extra.cuda.gdc_wait()
    inputs = _input(x, head, head_ok, K, SWIGLU)
    squares = reduce_sum(inputs * inputs, 0)  # read only with NORM; the compiler drops it otherwise
    acc = reduce_sum(head_weights.to(tl.float32) * _scaled(inputs, norm, head, head_ok, NORM)[None, :], 1)
    for start in tl.static_range(HEAD_K, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        w = tl.load(weight + local[:, None] * K + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        inputs = _input(x, cols, col_ok, K, SWIGLU)
        squares += reduce_sum(inputs * inputs, 0)
        acc += reduce_sum(w.to(tl.float32) * _scaled(inputs, norm, cols, col_ok, NORM)[None, :], 1)
    if NORM:
        acc = acc / tl.sqrt(squares / K + eps)
    if RESIDUAL:
        acc += tl.load(residual + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out + rows, acc.to(out.dtype.element_ty), mask=row_ok)


def _pdl_available(device: torch.device) -> bool:
    """Programmatic dependent launch: sm_90 and later, not in the interpreter."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
            and os.environ.get("TRITON_INTERPRET") != "1")


def gemv(x: torch.Tensor, weights: list[torch.Tensor], out: torch.Tensor | None = None, *,
         norm: torch.Tensor | None = None, residual: torch.Tensor | None = None, eps: float = 1e-6,
         swiglu: bool = False, config: GemvConfig = GemvConfig(), pdl: bool | None = None) -> torch.Tensor:
    """`out` `[N]` = `weights` stacked `[N, K]` @ input (+ `residual` `[N]`), N the weights' rows summed.

    The input is `x` `[K]` (any shape of K elements), its RMSNorm with weight `norm` `[K]` and `eps`,
    or with `swiglu`, `silu(x[:K]) * x[K:]` for `x` of 2K elements. `weights`: one to three `[N_i, K]`
    contiguous tensors of one dtype, which is `out`'s (allocated when None). `pdl` (default: where
    available) launches the kernel as a programmatic dependent of the kernel before it."""
    if not 1 <= len(weights) <= MAX_WEIGHTS:
        raise ValueError(f"gemv takes 1 to {MAX_WEIGHTS} weights, got {len(weights)}")
    k = weights[0].shape[1]
    if any(w.dim() != 2 or w.shape[1] != k or not w.is_contiguous() or w.dtype != weights[0].dtype for w in weights):
        raise ValueError("gemv's weights must be contiguous [N_i, K] tensors of one K and dtype")
    if x.numel() != (2 * k if swiglu else k):
        raise ValueError(f"gemv's input has {x.numel()} elements for weights of {k} columns (swiglu={swiglu})")
    rows = [w.shape[0] for w in weights]
    n = sum(rows)
    if out is None:
        out = torch.empty(n, device=weights[0].device, dtype=weights[0].dtype)
    if residual is not None and residual.numel() != n:
        raise ValueError(f"gemv's residual has {residual.numel()} elements for {n} rows")
    block_n = config.block_n
    while block_n > 1 and any(r % block_n for r in rows[:-1]):
        block_n //= 2  # a program must read one weight only
    width = triton.next_power_of_2(k)
    head_k, block_k = min(config.head_k, width), min(config.block_k, width)
    padded = weights + [weights[0]] * (MAX_WEIGHTS - len(weights))
    rows0, rows1 = (rows + [0])[:2]  # one weight: all N rows are weight0's
    pdl = _pdl_available(x.device) if pdl is None else pdl
    options = {"launch_pdl": True} if pdl else {}
    gemv_kernel[(triton.cdiv(n, block_n),)](
        x.contiguous(), out, *padded, norm, None if residual is None else residual.contiguous(), rows0, rows1, n,
        eps, k, block_n, block_k, head_k, swiglu, norm is not None, residual is not None, pdl,
        num_warps=config.warps, **options)
    return out
