"""VATP: value-aware token pruning, H2O's received attention weighted by the value vector's norm.

Guo et al. 2024, "Attention Score is not All You Need for Token Importance Indicator in KV Cache
Reduction: Value Also Matters", EMNLP 2024, arXiv:2406.12335.

Variants (`variant`):
  - `paper`: score_j = ||v_j||_1 * (attention slot j has received, accumulated over every query so
    far, prefill queries included, summed over the G query heads), per KV head. The first `n_sink`
    (20) positions are always kept; of the remaining budget - n_sink slots, the last `recent`
    tokens and the top `heavy` by score (heavy = recent = (budget - n_sink) / 2 by default).
  - `lf_repo` (the LongFlow authors' baseline): score_j = (current-step attention summed over the
    queries, mean over the query heads) * (mean over the KV heads of ||v_j||_2); one selection
    shared by the heads of a layer; no sink protection (`n_sink` is ignored). Heavy and recent
    split the budget as H2O's (their cache takes hh_size and recent_size as H2O's does).

Everything else (one eviction per step, budget accounting with the new token counted, prompt
compression by the same rule on the prompt's column-summed attention, float32 scores) is H2O's,
inherited from `baselines.h2o.H2OPolicy`, whose docstring states those deviations; as there, the
authors' hh_size = recent_size = h is budget 2h + 1 here (docs/methods.md, "VATP"). Beyond them:
  - The value norms are taken of the values as cached (the model dtype), accumulated in float32,
    and computed once per token: when its value is written (prefill, or the decode step that writes
    its slot), into a per-slot state of the cache that moves with the slot like H2O's scores, so a
    decode step does not read the whole value cache a second time.
  - Decode kernel: H2O's `use_kernel` (baselines/h2o.py): on CUDA the fused kernel computes the score
    above from the step's probabilities and the kept norms, the accumulator updated in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from baselines.h2o import H2OPolicy
from longflow.errors import UserError
from longflow.policy import FusedScore, Observation, overrides, triton_decode
from longflow.slots import SlotState


@dataclass(eq=False)
class VATPPolicy(H2OPolicy):
    """VATP (see the module docstring). Fields: `variant`, `heavy_ratio`, `compress_every`, `use_kernel`,
    `n_sink`."""

    n_sink: int = 20

    name = "vatp"

    def __post_init__(self):
        if self.n_sink < 0:  # checked first: H2O's checks split the budget after the sinks
            raise UserError(f"{self.name}: n_sink must be >= 0, got {self.n_sink}")
        super().__post_init__()

    @property
    def sinks(self) -> int:
        return self.n_sink if self.variant == "paper" else 0

    def value_norms(self, values: torch.Tensor) -> torch.Tensor:
        """values `[..., N, D]` -> `[..., N]` float32: ||v||_1 (paper) or ||v||_2 (lf_repo)."""
        return value_norm(values, self.norm_order)

    @property
    def norm_order(self) -> int:
        return 1 if self.variant == "paper" else 2

    def weigh(self, attention: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
        """attention `[B, Hkv, N]` (summed over each group's query heads), norms `[B, Hkv, N]`."""
        if not self.shared_selection:
            return attention * norms  # per KV head
        mean_attention = attention.sum(dim=1, keepdim=True) / self.spec.q_heads  # [B, 1, N]
        return (mean_attention * norms.mean(dim=1, keepdim=True)).expand_as(attention)

    def fused_score(self, q: torch.Tensor) -> FusedScore | None:
        """`score` in the fused kernel: accumulated attention x the KV head's own ||v||_1 (paper); the
        step's attention averaged over the query heads x ||v||_2 averaged over the KV heads (lf_repo)."""
        if not triton_decode(self.use_kernel, q) or overrides(self, VATPPolicy, ("score", "weigh", "held_value_norms")):
            return None
        if self.accumulate:
            return FusedScore("accumulated_vnorm", received="received", norms="norms")
        return FusedScore("attention_vnorm_mean", weight=1 / q.shape[1], norms="norms")

    # ---- the norm of each held value, kept per slot -------------------------------------------

    def slot_state(self) -> dict[str, SlotState]:
        # A function of the values alone, not a bound method: the cache that holds it belongs to this
        # policy, and a reference back would keep a whole batch's KV buffers alive until the next
        # garbage collection, and the next batch's peak memory would hold two caches.
        return {**super().slot_state(), "norms": SlotState(on_write=partial(value_norm, order=self.norm_order))}

    def held_value_norms(self, obs: Observation) -> torch.Tensor:
        return obs.state("norms")


def value_norm(values: torch.Tensor, order: int) -> torch.Tensor:
    """values `[..., N, D]` -> `[..., N]` float32 norms of order `order`."""
    return torch.linalg.vector_norm(values, ord=order, dim=-1, dtype=torch.float32)
