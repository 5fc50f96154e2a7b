"""The last W queries of every layer, for methods that score the cache with recent queries.

R-KV scores with its 8 newest queries, AMS with 32, Expected Attention estimates query statistics
from 256. The queries are recorded after RoPE, as the attention sees them, into a static ring per
layer (`[B, Hq, W, D]`, slot = position mod W): one scatter per decode step, no host sync. Methods
that need them before RoPE (Expected Attention) rotate them back by their own positions
(`longflow.rotary.unrotate`), which needs no change to the model.

Notation: B batch, Hq query heads, W window, D head dim, n selected rows, L padded prompt length.
"""

from __future__ import annotations

import torch


class QueryHistory:
    """Rings of the last `window` post-RoPE queries, one per layer, and the position of each entry."""

    def __init__(self, layers: int, batch: int, q_heads: int, window: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.window = window
        self.rings = [torch.zeros(batch, q_heads, window, head_dim, dtype=dtype, device=device)
                      for _ in range(layers)]

    def record_prompt(self, layer: int, q: torch.Tensor, pad: torch.Tensor) -> None:
        """Ring slot r gets the row's newest prompt query t with t mod W == r (zero if none).

        q: `[B, Hq, L, D]` over the left-padded prompt; pad: `[B, L]` bool.
        """
        length, window = q.shape[2], self.window
        lengths = pad.sum(dim=-1, keepdim=True)  # [B, 1]
        slot = torch.arange(window, device=q.device)
        newest = lengths - 1 - torch.remainder(lengths - 1 - slot, window)  # position, [B, W]
        source = (length - lengths + newest).clamp(min=0)  # index in the padded prompt
        queries = q.gather(2, source[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[3]))
        self.rings[layer].copy_(queries.masked_fill((newest < 0)[:, None, :, None], 0.0))

    def record(self, layer: int, q: torch.Tensor, positions: torch.Tensor) -> None:
        """The step's query `[B, Hq, D]` at `positions` `[B]`, in place."""
        ring = self.rings[layer]
        batch, q_heads, head_dim = q.shape
        slot = torch.remainder(positions, self.window)[:, None, None, None]
        ring.scatter_(2, slot.expand(batch, q_heads, 1, head_dim), q.unsqueeze(2).to(ring.dtype))

    def adopt(self, rows: torch.Tensor, other: QueryHistory) -> None:
        """Rows `[n]` take the n rows of `other` (continuous batching)."""
        for mine, theirs in zip(self.rings, other.rings, strict=True):
            mine.index_copy_(0, rows, theirs)

    def ring(self, layer: int, rows: torch.Tensor | None = None) -> torch.Tensor:
        """`[n, Hq, W, D]` in ring order (slot = position mod W), for scores that do not depend on order."""
        ring = self.rings[layer]
        return ring if rows is None else ring.index_select(0, rows)

    def recent(self, layer: int, newest: torch.Tensor, rows: torch.Tensor | None = None,
               window: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The last `window` (default W) queries up to position `newest` `[n]`, oldest first.

        Returns queries `[n, Hq, w, D]`, their positions `[n, w]` and valid `[n, w]` bool (False
        before position 0).
        """
        window = self.window if window is None else window
        ring = self.ring(layer, rows)
        positions = newest[:, None] - window + 1 + torch.arange(window, device=ring.device)  # [n, w]
        slot = torch.remainder(positions, self.window)[:, None, :, None].expand(-1, ring.shape[1], -1, ring.shape[3])
        return ring.gather(2, slot), positions, positions >= 0

