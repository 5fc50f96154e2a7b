"""TOVA: evict, every step, the token the current query attends to least, averaged over all heads.

Oren et al. 2024, "Transformers are Multi-State RNNs", arXiv:2401.06104 (official code:
schwartz-lab-NLP/TOVA, `src/tova_cache.py`; docs/methods.md, "TOVA").

Per layer and decode step: the new token's K/V overwrite the slot chosen at the previous step; the
current query attends to every held slot; slot j scores

    score_j = mean over all query heads h of p_hj

(one selection per layer, shared by its KV heads); the next slot is the lowest free one, else the
lowest-scoring one (`longflow.selection`). A prompt longer than the budget is cut by the same rule
with the last prompt query's attention, keeping budget - 1 tokens. No field but the decode kernel's
switch `use_kernel` (H2O's, baselines/h2o.py: on CUDA the fused kernel computes the score and the next
slot; outside the yaml and a run's identity).

Deviations from the official code:
  - Budget accounting. Its cache holds `cache_size` tokens after a reduction and appends the new
    token, so a query sees cache_size + 1 tokens; here the budget counts the new token: its
    `cache_size` c is budget c + 1 (the query sees the same c + 1 tokens).
  - Softmax and scores in float32 (theirs in the model dtype).
  - Nothing is protected, as in the official code; kvpress's TOVAPress instead keeps the newest
    token (its score padded with the maximum).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longflow.attention import window_probs
from longflow.policy import DECODE_KERNELS, FusedScore, KVPolicy, Observation, one_of, overrides, triton_decode


@dataclass(eq=False)
class TOVAPolicy(KVPolicy):
    """TOVA (see the module docstring)."""

    use_kernel: str = "auto"

    name = "tova"

    def __post_init__(self):
        super().__post_init__()
        one_of(self.name, "use_kernel", self.use_kernel, DECODE_KERNELS)

    def fused_score(self, q: torch.Tensor) -> FusedScore | None:
        """`score` in the fused kernel: the step's attention summed over every query head, / Hq."""
        if not triton_decode(self.use_kernel, q) or overrides(self, TOVAPolicy, ("score",)):
            return None
        return FusedScore("attention", weight=1 / q.shape[1])

    def score(self, obs: Observation) -> torch.Tensor:
        """The newest query's attention `[n, Hkv, G, S]` averaged over every query head -> `[n, Hkv, S]`."""
        probs = obs.probs
        return probs.mean(dim=(1, 2))[:, None].expand(-1, probs.shape[1], -1)

    def prefill_scores(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """The last prompt query's attention over the prompt, averaged over every query head."""
        probs = window_probs(q, k, self.pad, scale, window=1)  # [B, Hkv, G, 1, L]
        return probs.mean(dim=(1, 2, 3))[:, None].expand(-1, k.shape[1], -1)
