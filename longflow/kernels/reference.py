"""LongFlow decode attention in plain PyTorch: the CPU path and the oracle of the Triton kernel.

A literal transcription of docs/methods.md (LongFlow, Su et al. 2026, arXiv 2603.11504), float32 math:

    p_hj      = softmax_j over valid slots of q_h . k_{kv(h), j} * scale     (kv(h) = h // G)
    out_h     = sum_j p_hj v_{kv(h), j}
    score_j   = sum_h sum_d |p_hj v_{kv(h), j, d}| / (Hq * D)
    next_slot = the lowest free slot if any, else argmin_j score_j over valid slots

Notation: B batch, Hq query heads, Hkv KV heads, G = Hq / Hkv, S slots, D head dim.
"""

from __future__ import annotations

import torch


def longflow_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    valid: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output and LongFlow slot scores.

    Args:
        q: `[B, Hq, D]`; k, v: `[B, Hkv, S, D]`; valid: `[B, S]` bool (False = free or padding).
        scale: softmax scale, `D ** -0.5` when None.

    Returns:
        out: `[B, Hq, D]` in the dtype of q.
        score: `[B, S]` float32; meaningless (but finite or NaN-free only where valid) on free slots.
    """
    batch, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    scale = head_dim**-0.5 if scale is None else scale
    grouped = q.float().view(batch, kv_heads, q_heads // kv_heads, head_dim)  # [B, Hkv, G, D]
    logits = torch.matmul(grouped, k.float().transpose(-1, -2)) * scale  # [B, Hkv, G, S]
    logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    values = v.float()
    out = torch.matmul(probs, values).view(batch, q_heads, head_dim)  # [B, Hq, D]
    # |p_hj v_jd| summed over d is p_hj ||v_j||_1 because p >= 0.
    contribution = probs * values.abs().sum(dim=-1)[:, :, None, :]  # [B, Hkv, G, S]
    score = contribution.sum(dim=(1, 2)) / (q_heads * head_dim)  # [B, S]
    return out.to(q.dtype), score


def choose_slot(
    score: torch.Tensor, valid: torch.Tensor, protect: torch.Tensor | None = None
) -> torch.Tensor:
    """`[B, S]` scores -> `[B]` int64: the lowest free slot, else the lowest-scoring unprotected slot.

    Free slots get key -1 (below every score, which is >= 0) and protected valid slots +inf;
    `torch.argmin` returns the first of tied minima, so the lowest free index wins.
    """
    key = score.masked_fill(~valid, -1.0)
    if protect is not None:
        key = key.masked_fill(protect & valid, float("inf"))
    return key.argmin(dim=-1)


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    valid: torch.Tensor,
    scale: float | None = None,
    *,
    protect: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `longflow.kernels.longflow_attention`: returns (out `[B, Hq, D]`, next_slot `[B]`).

    `protect` (`[B, S]` bool, optional): valid slots that are attended but never chosen for
    eviction (sinks, the newest token); free slots are still chosen first.
    """
    out, score = longflow_scores(q, k, v, valid, scale)
    return out, choose_slot(score, valid, protect)
