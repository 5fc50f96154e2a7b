"""Plain PyTorch attention used by the KV policies.

Decode attention is written with two matmuls instead of SDPA because the eviction methods need the
probabilities, and grouping the query heads of a KV head (`[B, Hkv, G, D]`) reads every K/V slot
once without `repeat_kv`. Prefill attention goes through SDPA, since it only needs the output.

Notation: B batch, Hq query heads, Hkv KV heads, G = Hq / Hkv, S slots, L prompt length, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def group_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """`[B, Hq, D]` -> `[B, Hkv, G, D]` (query head h belongs to KV head h // G, as in HF `repeat_kv`)."""
    batch, q_heads, head_dim = q.shape
    return q.view(batch, kv_heads, q_heads // kv_heads, head_dim)


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode query against a slot cache.

    Args:
        q: `[B, Hq, D]` current query (after RoPE).
        keys, values: `[B, Hkv, S, D]`.
        valid: `[B, Hkv, S]` or `[B, 1, S]` bool, False for free or padding slots.
        scale: softmax scale (1/sqrt(D) for the models here).

    Returns:
        out: `[B, Hq, D]` in the dtype of `values`.
        probs: `[B, Hkv, G, S]` float32 attention probabilities, exactly 0 on invalid slots.
    """
    kv_heads = keys.shape[1]
    grouped = group_queries(q, kv_heads)
    # Logits in the model's dtype (fp32 accumulation inside the matmul), softmax in fp32, as HF's
    # eager attention does: upcasting K first would write and read an fp32 copy of the whole cache.
    logits = torch.matmul(grouped, keys.transpose(-1, -2)).float() * scale  # [B, Hkv, G, S]
    logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.matmul(probs.to(values.dtype), values)  # [B, Hkv, G, D]
    return out.flatten(1, 2), probs


def masked_decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, scale: float
) -> torch.Tensor:
    """One decode query against a slot cache, output only: SDPA with the validity mask.

    For methods that need no probabilities at the step (the interval methods score at their
    compressions). q: `[B, Hq, D]`; keys, values: `[B, Hkv, S, D]`; valid: `[B, Hkv, S]` -> `[B, Hq, D]`.
    """
    group = q.shape[1] // keys.shape[1]
    mask = valid.repeat_interleave(group, dim=1).unsqueeze(2)  # [B, Hq, 1, S]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(2)


def prefill_mask(pad: torch.Tensor) -> torch.Tensor:
    """Causal mask over a left-padded prompt: `[B, L]` bool (True = real token) -> `[B, 1, L, L]` bool.

    A padding query would see no key at all and give NaN; it is allowed to see itself instead (its
    output is never used), so that no NaN enters the hidden states.
    """
    length = pad.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=pad.device).tril()
    mask = causal & pad[:, None, None, :]
    return mask | torch.eye(length, dtype=torch.bool, device=pad.device)


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention over a left-padded prompt.

    Args:
        q: `[B, Hq, L, D]`; k, v: `[B, Hkv, L, D]`; pad: `[B, L]` bool, True for real tokens.

    Returns:
        `[B, Hq, L, D]`.
    """
    return F.scaled_dot_product_attention(q, k, v, attn_mask=prefill_mask(pad), scale=scale, enable_gqa=True)


def window_probs(
    q: torch.Tensor, k: torch.Tensor, pad: torch.Tensor, scale: float, window: int
) -> torch.Tensor:
    """Attention probabilities of the last `window` prompt queries over all prompt keys.

    Used by prefill compression rules (SnapKV's observation window, R-KV's). With left padding the
    last `window` positions are real tokens of every row whose prompt has at least `window` tokens.

    Args:
        q: `[B, Hq, L, D]`; k: `[B, Hkv, L, D]`; pad: `[B, L]` bool.

    Returns:
        `[B, Hkv, G, window, L]` float32, causal and padding-masked.
    """
    batch, q_heads, length, head_dim = q.shape
    kv_heads = k.shape[1]
    window = min(window, length)
    last = q[:, :, -window:].float().view(batch, kv_heads, q_heads // kv_heads, window, head_dim)
    logits = torch.matmul(last, k.float().unsqueeze(2).transpose(-1, -2)) * scale  # [B, Hkv, G, W, L]
    mask = prefill_mask(pad)[:, :, -window:, :]  # [B, 1, W, L]
    logits = logits.masked_fill(~mask.unsqueeze(2), float("-inf"))
    return torch.softmax(logits, dim=-1)
