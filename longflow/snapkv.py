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

    As the official SnapKV: the window queries' attention paid to each key before the window,
    summed over the queries, average-pooled over `kernel` keys (zero beyond the keys before the
    window: the window's own columns never enter the pool); the window tokens themselves get +inf
    so that they are always kept; padding gets -inf. By default the window queries' softmax runs
    over all prompt keys (causal), as SnapKV's; `before_window` restricts it to the keys before the
    window, as the LongFlow authors' SnapKV does (`lf_repo`). GQA: probabilities are summed over the
    query heads of a KV head; `shared` sums over all heads for methods with one selection per layer.

    Args:
        q: `[B, Hq, L, D]`; k: `[B, Hkv, L, D]`; pad: `[B, L]` bool.

    Returns:
        `[B, Hkv, L]` float32 (identical across heads when `shared`).
    """
    batch, kv_heads, length = pad.shape[0], k.shape[1], pad.shape[1]
    window = min(window, length)
    scored = length - window  # the keys before the window, the only ones SnapKV scores
    if before_window:
        q_heads, head_dim = q.shape[1], q.shape[3]
        last = q[:, :, scored:].float().view(batch, kv_heads, q_heads // kv_heads, window, head_dim)
        logits = torch.matmul(last, k[:, :, :scored].float().unsqueeze(2).transpose(-1, -2)) * scale
        logits = logits.masked_fill(~pad[:, None, None, None, :scored], float("-inf"))
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # [B, Hkv, G, W, L - W]
    else:
        probs = window_probs(q, k, pad, scale, window)[..., :scored]  # [B, Hkv, G, W, L - W]
    scores = probs.sum(dim=(2, 3))  # [B, Hkv, L - W]
    if shared:
        scores = scores.sum(dim=1, keepdim=True).expand_as(scores)
    if scored:
        scores = F.avg_pool1d(scores.flatten(0, 1).unsqueeze(1), kernel, stride=1, padding=kernel // 2)
    scores = scores.reshape(batch, kv_heads, scored)
    scores = torch.cat([scores, scores.new_full((batch, kv_heads, window), float("inf"))], dim=-1)
    return scores.masked_fill(~pad[:, None, :], float("-inf"))
