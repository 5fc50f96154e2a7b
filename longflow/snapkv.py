"""SnapKV prompt scores (Li et al. 2024, arXiv:2404.14469): the rule that compresses a prompt longer than
the budget for methods without a prompt rule of their own (`KVPolicy.prefill_scores`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longflow.attention import window_probs


def snapkv_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    pad: torch.Tensor,
    scale: float,
    window: int = 32,
    kernel: int = 5,
    shared: bool = False,
    before_window: bool = False,
) -> torch.Tensor:
    """SnapKV prompt scores (Li et al. 2024): attention of the last `window` queries, avg-pooled.

    The window tokens themselves get +inf so that they are always kept; padding gets -inf.
    GQA: probabilities are summed over the query heads of a KV head; `shared` sums over all heads
    for methods with one selection per layer. By default the window queries' softmax runs over
    all prompt keys (causal); `before_window` restricts it, and the pooling, to the keys before the
    window, as the LongFlow authors' SnapKV does (`lf_repo`).

    Args:
        q: `[B, Hq, L, D]`; k: `[B, Hkv, L, D]`; pad: `[B, L]` bool.

    Returns:
        `[B, Hkv, L]` float32 (identical across heads when `shared`).
    """
    batch, kv_heads, length = pad.shape[0], k.shape[1], pad.shape[1]
    window = min(window, length)
    scored = length - window if before_window else length  # keys that the window's softmax covers
    if before_window:
        q_heads, head_dim = q.shape[1], q.shape[3]
        last = q[:, :, scored:].float().view(batch, kv_heads, q_heads // kv_heads, window, head_dim)
        logits = torch.matmul(last, k[:, :, :scored].float().unsqueeze(2).transpose(-1, -2)) * scale
        logits = logits.masked_fill(~pad[:, None, None, None, :scored], float("-inf"))
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # [B, Hkv, G, W, L - W]
    else:
        probs = window_probs(q, k, pad, scale, window)  # [B, Hkv, G, W, L]
    scores = probs.sum(dim=(2, 3))  # [B, Hkv, scored]
    if shared:
        scores = scores.sum(dim=1, keepdim=True).expand_as(scores)
    if scored:
        scores = F.avg_pool1d(scores.flatten(0, 1).unsqueeze(1), kernel, stride=1, padding=kernel // 2)
    scores = scores.reshape(batch, kv_heads, scored)
    scores = torch.cat([scores, scores.new_full((batch, kv_heads, length - scored), float("inf"))], dim=-1)
    scores[..., -window:] = float("inf")
    return scores.masked_fill(~pad[:, None, :], float("-inf"))
