"""Vanilla: the full KV cache, no eviction. The reference for accuracy and speed.

Slots are allocated for the whole padded prompt plus `max_new_tokens`, and token t of the output
goes to slot `L + t`, so the cache holds tokens in position order like HF's `DynamicCache`.
`budget` is accepted for a uniform interface and ignored; `variant` too (the full cache has none).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longflow.attention import decode_attention
from longflow.policy import ALIGN, CacheSpec, KVPolicy, round_up


@dataclass(eq=False)
class VanillaPolicy(KVPolicy):
    variant: str = "paper"

    name = "vanilla"

    def __post_init__(self):
        self.budget = None
        super().__post_init__()

    def capacity(self, spec: CacheSpec) -> int:
        # Rounded up so that the decode matmuls' rows stay 16-byte aligned (see `ALIGN`).
        return round_up(spec.prompt_len + spec.max_new_tokens, ALIGN)

    def prefill_keep(self, spec: CacheSpec) -> int:
        return spec.prompt_len

    def on_prompt_stored(self, layer: int, kept: torch.Tensor) -> None:
        self.next_slot[layer].fill_(self.spec.prompt_len)

    def decode(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        # The same eager attention as the scoring methods (K/V read once, no repeat_kv), so that
        # their step-time difference is the cost of scoring and eviction alone.
        slots = self.layers[layer]
        out, _ = decode_attention(q, slots.keys, slots.values, slots.valid, scale)
        self.next_slot[layer].add_(1)
        return out
