"""The Triton kernels of `longflow.kernels`, compiled for an H100/H200 (sm_90) on a machine without a GPU.

The CPU tests run every kernel through Triton's interpreter, which accepts code that the compiler
refuses: a jit helper's constexpr parameter left to its default, for one, reaches the compiler as a
plain string there. Such a kernel passes CI and fails on the first GPU that launches it. Here the host
functions are called on small CPU tensors at Qwen3-8B's head shapes and every distinct launch is
compiled for sm_90 (`evals.bench.aot`, which records and specialises them), whose shared memory must
fit one program there (a launch would fail otherwise).

Run as a script, by its path (`tests/test_kernels_compile.py` does, in a process of its own): imported as
`helpers.sm90` it would load `helpers/__init__`, which defines the kernels for the interpreter first. It
prints one JSON object, the kernels compiled and how many launches of each, and exits non-zero on a
compile error.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, when run by its path
from evals.bench.aot import (  # noqa: E402, I001  (first: it turns the interpreter off)
    SHARED_BYTES,
    compile_launch,
    kernel_modules,
    record_launches,
    specialise,
)
import torch  # noqa: E402
import triton  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


def all_kernels() -> set[str]:
    """The launchable kernels of the package: its JIT functions named `*_kernel` (the others are helpers)."""
    return {f"{module.__name__}.{name}" for module in kernel_modules() for name, value in vars(module).items()
            if isinstance(value, JITFunction) and name.endswith("_kernel")}


def compile_launches(launches) -> dict[str, int]:
    """Compiles each distinct launch for sm_90 and checks that its shared memory fits a program; the
    count of distinct launches per kernel."""
    seen, counts = set(), {}
    for kernel, arguments, options in launches:
        signature, constexprs, attrs = specialise(kernel, arguments)
        name = f"{kernel.fn.__module__}.{kernel.fn.__name__}"
        key = (name, tuple(signature.items()), repr(sorted(constexprs.items())), repr(sorted(attrs.items())),
               tuple(sorted(options.items())))
        if key in seen:
            continue
        seen.add(key)
        compiled = compile_launch(kernel, arguments, options)
        if compiled.metadata.shared > SHARED_BYTES:
            raise RuntimeError(f"{name} {options} takes {compiled.metadata.shared} bytes of shared memory, "
                               f"more than sm_90's {SHARED_BYTES}")
        counts[name] = counts.get(name, 0) + 1
    return counts


def host_calls() -> None:
    """Every host function of the package in the modes the engine and the benchmarks use, at Qwen3-8B's
    head shapes (32 query heads, 8 KV heads, head dim 128) and a few hundred slots."""
    from longflow.kernels import (
        append_decode,
        compact_in_place,
        flash_decode,
        gemv,
        longflow_attention,
        newest_duplicates,
        scored_attention,
        similarity_sums,
        window_importance,
        write_token,
    )
    from longflow.kernels.longflow_attention import SCORES, LaunchConfig
    from longflow.kernels.onchip import onchip_attention

    q_heads, kv_heads, slots, head_dim = 32, 8, 320, 128
    hidden, intermediate = q_heads * head_dim, 12288
    for dtype in (torch.bfloat16, torch.float32):
        x, up = torch.randn(hidden, dtype=dtype), torch.randn(2 * intermediate, dtype=dtype)
        qkv = [torch.randn(n, hidden, dtype=dtype) for n in (hidden, kv_heads * head_dim, kv_heads * head_dim)]
        for pdl in (False, True):
            gemv(x, qkv, norm=x, pdl=pdl)
            gemv(x, qkv[:1], residual=x, pdl=pdl)
            gemv(up, [torch.randn(hidden, intermediate, dtype=dtype)], residual=x, swiglu=True, pdl=pdl)
    for batch, dtype in ((1, torch.bfloat16), (64, torch.bfloat16), (2, torch.float32)):
        q = torch.randn(batch, q_heads, head_dim, dtype=dtype)
        keys, values = (torch.randn(batch, kv_heads, slots, head_dim, dtype=dtype) for _ in range(2))
        valid = torch.ones(batch, kv_heads, slots, dtype=torch.bool)
        positions = torch.zeros(batch, kv_heads, slots, dtype=torch.long)
        next_slot = torch.full((batch, kv_heads), 100, dtype=torch.long)
        lengths = next_slot[:, 0]
        arrivals = torch.zeros(batch * kv_heads, dtype=torch.int32)
        token = torch.randn(batch, kv_heads, 1, head_dim, dtype=dtype)
        token_positions = torch.zeros(batch, dtype=torch.long)
        state = torch.zeros(batch, kv_heads, slots)
        longflow_attention(q, keys, values, valid[:, 0])
        longflow_attention(q, keys, values, valid[:, 0], protect=valid[:, 0], config=LaunchConfig(scratch="fp16"))
        longflow_attention(q, keys, values, valid[:, 0], config=LaunchConfig(vnorm="reduce", prefetch=False))
        if dtype != torch.float32:  # the on-chip pass (16-bit only), called past `_run`'s check for CUDA
            onchip_attention(q, keys, values, valid[:, 0], next_slot[:, :1], head_dim**-0.5)
            onchip_attention(q, keys, values, valid, next_slot, head_dim**-0.5, protect=valid, block_n=32)
            onchip_attention(q, keys, values, valid[:, 0], next_slot, head_dim**-0.5, score=False)
        for score, spec in SCORES.items():
            for per_kv_head in {True, spec.accumulate}:
                scored_attention(q, keys, values, valid, next_slot, score=score, per_kv_head=per_kv_head,
                                 received=state if spec.accumulate else None,
                                 norms=state if spec.norms else None)
        flash_decode(q, keys, values, valid[:, 0], lengths)
        flash_decode(q, keys, values, valid, None)
        flash_decode(q, keys, values, valid[:, 0], lengths, arrivals=arrivals)
        append_decode(q, token, token, keys, values, valid, positions, next_slot, token_positions, arrivals)
        write_token(keys, values, valid, positions, next_slot, token, token, token_positions)
        write_token(keys, values, valid, positions, next_slot, token, token, token_positions, advance=True)
        write_token(keys, values, valid, positions, next_slot, token, token, token_positions, find_free=True)
        write_token(keys, values, valid, positions, next_slot, token, token, token_positions, find_free=True,
                    usable=valid[0])
        inverse_norms, _ = similarity_sums(keys, valid)
        newest_duplicates(keys, inverse_norms, 0.5)
        window = torch.randn(batch, q_heads, 8, head_dim, dtype=dtype)
        window_importance(window, torch.ones(batch, 8, dtype=torch.bool), keys, valid, head_dim**-0.5)
        order = torch.arange(slots).expand(batch, kv_heads, slots).contiguous()
        compact_in_place(keys, values, order, valid)
        compact_in_place(keys, values, order[:1], valid[:1], rows=torch.zeros(1, dtype=torch.long))
    # The on-chip pass at the most slots its scratch holds, in each tile size: its shared memory fits.
    q = torch.randn(1, q_heads, head_dim, dtype=torch.bfloat16)
    keys = torch.randn(1, kv_heads, 8192, head_dim, dtype=torch.bfloat16)
    for block_n in (64, 32):
        onchip_attention(q, keys, keys, torch.ones(1, 8192, dtype=torch.bool), torch.zeros(1, 1, dtype=torch.long),
                         head_dim**-0.5, block_n=block_n)


def main() -> None:
    counts = compile_launches(record_launches(host_calls))
    print(json.dumps({"triton": triton.__version__, "kernels": sorted(all_kernels()), "compiled": counts}))


if __name__ == "__main__":
    main()
