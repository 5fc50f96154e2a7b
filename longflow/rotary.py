"""RoPE arithmetic on cached tensors, with the model's own rotary embedding (scaled RoPE included).

The models rotate a query or key x at position p as x cos(p) + rotate_half(x) sin(p), with
`(cos, sin) = rotary(x, position_ids)`, `[..., D]` per position (transformers' convention: the two
halves of the head dimension are paired).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """RoPE's pairing of the two halves of the head dimension: (x1, x2) -> (-x2, x1)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def unrotate(x: torch.Tensor, positions: torch.Tensor, rotary: Callable) -> torch.Tensor:
    """Vectors before RoPE from vectors after it, each rotated back by its own position, in float32.

    The inverse of x cos + rotate_half(x) sin at the same angle is x cos - rotate_half(x) sin.
    x: `[n, H, w, D]`; positions: `[n, w]` (>= 0).
    """
    cos, sin = rotary(x.float(), positions)  # [n, w, D]
    cos, sin = cos.float()[:, None], sin.float()[:, None]
    x = x.float()
    return x * cos - rotate_half(x) * sin


def mean_rotation(rotary: Callable, positions: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The RoPE rotation averaged over positions, as a matrix: R such that R x = mean_p RoPE_p(x).

    positions: `[n, f]` -> `[n, D, D]` float32. RoPE_p(x) = cos(p) * x + sin(p) * rotate_half(x),
    and rotate_half is the matrix P with P[i, i + D/2] = -1 and P[i + D/2, i] = 1 (i < D/2).
    """
    cos, sin = rotary(torch.empty(0, dtype=torch.float32, device=positions.device), positions)
    cos, sin = cos.float().mean(dim=1), sin.float().mean(dim=1)  # [n, D]
    half = head_dim // 2
    pairing = torch.zeros(head_dim, head_dim, device=positions.device)
    pairing[:half, half:] = -torch.eye(half, device=positions.device)
    pairing[half:, :half] = torch.eye(half, device=positions.device)
    identity = torch.eye(head_dim, device=positions.device)
    return cos[:, :, None] * identity + sin[:, :, None] * pairing
