"""KeyDiff: keep the keys least similar to the mean key direction; attention-free.

"KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
Resource-Constrained Environments", arXiv:2504.15364; the score as kvpress's `KeyDiffPress`, the
schedule as its block-wise form (kvpress `BlockPress`); docs/methods.md, "KeyDiff".

Per KV head and row, over the keys held (after RoPE):

    a       = mean over held keys i of k_i / ||k_i||
    score_j = -cos(k_j, a)

An interval method: the cache fills its `budget` slots, then every `compress_every` steps (128,
`BlockPress`'s block) keeps the budget - compress_every best by that score, per KV head, in
position order. It reads no attention, so decode attention computes no probabilities (flash
decoding on CUDA, `KVPolicy.attention_only`). Fields: `compress_every` (a budget at or below it
shrinks it to a quarter of the budget, with a warning); `prefill`: `by_score` (a prompt longer than
the budget is cut by the same score, as kvpress's `KeyDiffPress` at prefill).

Deviations: the score is float32 (kvpress: the model dtype); a prompt longer than the budget is
scored at once (kvpress's `KeyDiffPress` at prefill) and keeps budget - 1 tokens, not block by
block; the paper processes generated tokens in blocks too, which is this schedule.

Notation: n rows, Hkv KV heads, S slots, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from longflow.errors import UserError
from longflow.policy import KVPolicy, Observation, keep_after_cut


def keydiff_scores(keys: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """keys `[n, Hkv, S, D]`, held `[n, Hkv, S]` bool -> `[n, Hkv, S]` float32, -inf where not held."""
    keys = keys.float()
    unit = F.normalize(keys, p=2, dim=-1) * held[..., None]
    anchor = unit.sum(dim=2, keepdim=True) / held.sum(dim=-1).clamp(min=1)[..., None, None]  # [n, Hkv, 1, D]
    return (-F.cosine_similarity(keys, anchor, dim=-1)).masked_fill(~held, float("-inf"))


@dataclass(eq=False)
class KeyDiffPolicy(KVPolicy):
    """KeyDiff (see the module docstring). Fields: `compress_every`."""

    compress_every: int = 128
    prefill: str = field(default="by_score", kw_only=True)  # kvpress's KeyDiffPress scores the prompt alike

    name = "keydiff"
    schedule = "interval"
    shared_selection = False

    def __post_init__(self):
        super().__post_init__()
        if self.compress_every < 1:
            raise UserError(f"{self.name}: compress_every must be >= 1, got {self.compress_every}")
        if self.budget is not None:
            self.keep_after = keep_after_cut(self.name, self.budget, self.compress_every, least_kept=1)

    def score(self, obs: Observation) -> torch.Tensor:
        return keydiff_scores(obs.keys, obs.valid)
