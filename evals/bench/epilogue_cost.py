"""What each part of the fused call costs at Figure 1's shapes: the attention pass with LongFlow's
score scratch (logit + log2 ||v||_1) or the bare logit (TOVA's and H2O's), alone and with the score
pass, against cuDNN SDPA and `flash_decode` (the pass with no scratch) in the same process.

    python -m evals.bench.epilogue_cost

Timing as `evals.bench.attention` (CUDA graphs over input sets that overflow L2), at the heuristic's
launch configuration. Needs a CUDA GPU.
"""

from __future__ import annotations

import torch

from evals.bench.attention import HEAD_DIM, KV_HEADS, Q_HEADS, cache_sets, graph_ms, method_calls


def main() -> None:
    from longflow.kernels.longflow_attention import SCORES, Epilogue, _l2_bytes, _multiprocessors, _run, default_config

    device = torch.device("cuda")
    scale = HEAD_DIM**-0.5
    for batch in (16, 64, 128):
        for slots in (1024, 3200, 8192):
            sets = cache_sets(batch, slots, device)
            cudnn = graph_ms([method_calls("sdpa_cudnn", *s)[0] for s in sets])
            plain = graph_ms([method_calls("flash_decode", *s)[0] for s in sets])
            config = default_config(batch, KV_HEADS, Q_HEADS, slots, HEAD_DIM, _multiprocessors(device),
                                    _l2_bytes(device))
            parts = [f"batch {batch:>3}, {slots:>4} slots: cuDNN {cudnn:.4f} ms; x cuDNN: "
                     f"flash_decode {plain / cudnn:.3f}"]
            for name in ("longflow", "attention"):
                epilogue = Epilogue(score=SCORES[name], per_kv_head=False,
                                    next_slot=torch.zeros(batch, 1, dtype=torch.long, device=device))
                full = graph_ms([lambda i=i, e=epilogue, c=config: _run(*i, scale, None, c, epilogue=e)
                                 for i in sets])
                alone = graph_ms([lambda i=i, e=epilogue, c=config: _run(*i, scale, None, c, attention_only=True,
                                                                         epilogue=e) for i in sets])
                parts.append(f"{name} {full / cudnn:.3f} (its pass {alone / cudnn:.3f})")
            print(", ".join(parts), flush=True)
            del sets
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
