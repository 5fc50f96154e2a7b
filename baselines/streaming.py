"""StreamingLLM: attention sinks plus a sliding window of the most recent tokens.

Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks", ICLR 2024,
arXiv:2309.17453.

Kept: the first `n_sink` (4) positions and the most recent budget - n_sink, i.e. every query
attends to the sinks and to the last budget - n_sink positions, itself included. Once the cache is
full, the slot the next token overwrites is the oldest non-sink slot (free slots first). A prompt
longer than the budget is cut the same way at prefill (sinks + the last budget - n_sink - 1 prompt
tokens, so that the first decode token fits), not by SnapKV: the method has its own rule.

`variant` is accepted for the uniform interface; `paper` and `lf_repo` are identical (METHODS.md
describes one method).

Deviation from the paper: StreamingLLM assigns positions by index within the cache (keys are cached
before RoPE and re-rotated), so the distance between a sink and the window stays bounded. Here, as
for every method of this harness, keys are cached after RoPE with their real positions, which keep
counting after eviction. The selection does not use attention; decode attention is the shared
eager `decode_attention`, as for every method (vanilla included), so step times compare eviction
alone.
"""

from __future__ import annotations

import torch

from longflow.errors import UserError
from longflow.policy import KVPolicy

VARIANTS = ("paper", "lf_repo")  # identical here


class StreamingPolicy(KVPolicy):
    """StreamingLLM (see the module docstring). Fields: `variant` (no effect), `n_sink`."""

    name = "streaming"
    shared_selection = True  # positions are the same in every head

    def __init__(self, budget: int | None = None, variant: str = "paper", n_sink: int = 4):
        super().__init__(budget)
        if variant not in VARIANTS:
            raise UserError(f"{self.name}: variant must be one of {VARIANTS}, got {variant!r}")
        if n_sink < 0:
            raise UserError(f"{self.name}: n_sink must be >= 0, got {n_sink}")
        if budget is not None and budget <= n_sink:
            raise UserError(f"{self.name}: budget ({budget}) must exceed n_sink ({n_sink})")
        self.variant = variant
        self.n_sink = n_sink

    def prefill_scores(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Newer is better, sinks always: the score of a prompt token is its position."""
        positions = self.prompt_positions[:, None, :].float()  # [B, 1, L]
        scores = positions.masked_fill(positions < self.n_sink, float("inf"))
        scores = scores.masked_fill(~self.pad[:, None, :], float("-inf"))
        return scores.expand(-1, k.shape[1], -1)  # [B, Hkv, L]

    def choose_next_slot(self, layer: int, q: torch.Tensor, probs: torch.Tensor | None) -> None:
        """The oldest non-sink slot; free slots come first (a free slot's position is -1)."""
        slots = self.layers[layer]
        sink = slots.valid & (slots.positions < self.n_sink)
        age = slots.positions.masked_fill(sink, torch.iinfo(torch.long).max)  # [B, Hkv, S]
        self.next_slot[layer].copy_(age.argmin(dim=-1))
