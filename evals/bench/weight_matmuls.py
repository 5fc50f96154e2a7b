"""The decode step's weight matmuls alone, at Qwen3-8B's shapes: separate or concatenated projections,
cuBLAS or Inductor's autotuned GEMMs, at one and at 128 rows.

    python -m evals.bench.weight_matmuls            # cuBLAS, then max-autotune (about a minute of compiling)
    python -m evals.bench.weight_matmuls --eager    # cuBLAS only

A step reads every weight once: 36 layers of q, k, v, o, gate, up and down projections and the LM
head, 15.1 GB in bf16, whose read at the copy rate (about 4.3 TB/s on an H200) is the step's floor
besides the KV cache. transformers' Qwen3 modules keep q/k/v and gate/up as separate linears, so a
layer is seven GEMMs; concatenated, q|k|v and gate|up read the same bytes in two. Each setting runs
all 36 layers (distinct weights, so nothing stays in L2) and the head in one CUDA graph; the median
replay (`evals.bench.attention`'s timing) is printed with the weights' bytes over it. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from evals.bench.attention import graph_ms

HIDDEN, KV, INTERMEDIATE, VOCAB, LAYERS = 4096, 1024, 12288, 151936, 36  # Qwen3-8B


def separate(x, x_mlp, q, k, v, o, gate, up, down):
    return (F.linear(x, q), F.linear(x, k), F.linear(x, v), F.linear(x, o), F.linear(x, gate), F.linear(x, up),
            F.linear(x_mlp, down))


def concatenated(x, x_mlp, qkv, o, gate_up, down):
    return F.linear(x, qkv), F.linear(x, o), F.linear(x, gate_up), F.linear(x_mlp, down)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eager", action="store_true", help="cuBLAS only, no Inductor autotuning")
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16

    def weight(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, device=device, dtype=dtype) * 0.02

    joined = [dict(qkv=weight(HIDDEN + 2 * KV, HIDDEN), o=weight(HIDDEN, HIDDEN),
                   gate_up=weight(2 * INTERMEDIATE, HIDDEN), down=weight(HIDDEN, INTERMEDIATE)) for _ in range(LAYERS)]
    # The separate projections are row blocks of the concatenated weights: the same bytes, read by
    # seven GEMMs instead of four.
    layers = [dict(zip(("q", "k", "v"), w["qkv"].split([HIDDEN, KV, KV]), strict=True), o=w["o"],
                   **dict(zip(("gate", "up"), w["gate_up"].chunk(2), strict=True)), down=w["down"]) for w in joined]
    head = weight(VOCAB, HIDDEN)
    total = sum(t.numel() * 2 for w in joined for t in w.values()) + head.numel() * 2
    print(f"weights {total / 1e9:.2f} GB")
    for rows in (1, 128):
        x = torch.randn(rows, HIDDEN, device=device, dtype=dtype)
        x_mlp = torch.randn(rows, INTERMEDIATE, device=device, dtype=dtype)
        settings = {"cuBLAS, separate": (separate, layers), "cuBLAS, concatenated": (concatenated, joined)}
        if not args.eager:
            torch._dynamo.reset()
            mode = "max-autotune-no-cudagraphs"
            settings |= {"max-autotune, separate": (torch.compile(separate, mode=mode), layers),
                         "max-autotune, concatenated": (torch.compile(concatenated, mode=mode), joined)}
        for name, (layer, weights) in settings.items():
            def step(layer=layer, weights=weights, x=x, x_mlp=x_mlp):
                for w in weights:
                    layer(x, x_mlp, **w)
                F.linear(x, head)
            ms = graph_ms([step])
            print(f"{rows:>3} rows, {name}: {ms:.3f} ms, {total / ms / 1e9:.2f} TB/s", flush=True)


if __name__ == "__main__":
    main()
