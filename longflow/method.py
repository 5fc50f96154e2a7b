"""LongFlow: evict, every step, the slot whose contribution to the current attention output is smallest.

Su et al. 2026, "LongFlow", arXiv:2603.11504 (the project's own method; docs/methods.md, "LongFlow").

Per layer and decode step, over static buffers (keys/values `[B, Hkv, S, D]`, S = budget):
  1. the new token's K/V overwrite slot `next_slot[b]`, chosen at the previous step (the lowest
     free slot while any is free);
  2. the current query attends to every valid slot;
  3. score_j = sum over all query heads h and dims d of |p_hj v_hj,d| / (Hq * D): the L1 norm of
     slot j's contribution to the attention output, from the CURRENT query only (no state);
  4. next_slot[b] = argmin of the score over valid slots, free slots first.
Steps 2-4 are one fused Triton operator on CUDA (`longflow.kernels.longflow_attention`), so the
eviction costs about as much as plain decode attention; on the CPU the PyTorch reference computes
the same thing. One token is evicted per step and the cache never holds more than `budget` slots.

Fields (`conf/method/longflow.yaml`):
  - `budget`: KV slots per layer, a hard cap (prefill included).
  - `granularity`: `layer` (the paper: one slot per layer, shared by all KV heads) or `kv_head`
    (beyond the paper, off by default: each KV head evicts its own slot by the score summed over
    its G query heads; computed in plain PyTorch with `decode_attention`, not fused).
  - `n_sink`: beyond the paper (default 0): the first `n_sink` positions are never evicted, at
    prefill (their SnapKV score is +inf) and at decode.
  - `protect_newest`: beyond the paper (default off): the token written this step is never the
    next one evicted.
  - `use_kernel`: `auto` (Triton on CUDA, the reference on the CPU), `triton` or `reference`.
  - `variant`: `paper` or `lf_repo` (the LongFlow authors' code). They decode identically and
    differ only in the prefill rule below.
Prefill, when the prompt is longer than the budget: SnapKV (the rule for methods without their
own), one selection per layer (`layer`) or per KV head (`kv_head`), keeping budget - 1 tokens so
that the first decode token finds a free slot: the 32 newest prompt tokens and the best of the
rest by the window queries' attention, avg-pooled over 5. `paper`: that attention is a softmax
over all prompt keys (causal); `lf_repo`: over the keys before the window only, pooled over those
alone, as the authors' code does.

Notation: B batch, Hq query heads, Hkv KV heads, G = Hq / Hkv, S slots, L padded prompt length,
D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longflow.attention import decode_attention
from longflow.errors import UserError
from longflow.kernels import longflow_attention, reference
from longflow.policy import KVPolicy, snapkv_scores

GRANULARITIES = ("layer", "kv_head")
KERNELS = ("auto", "triton", "reference")
VARIANTS = ("paper", "lf_repo")


@dataclass(eq=False)
class LongFlowPolicy(KVPolicy):
    """LongFlow (see the module docstring for every field and deviation)."""

    budget: int
    granularity: str = "layer"
    n_sink: int = 0
    protect_newest: bool = False
    use_kernel: str = "auto"
    variant: str = "paper"

    name = "longflow"

    def __post_init__(self):
        if self.budget is None:
            raise UserError(f"{self.name} needs a budget (KV slots per layer)")
        super().__init__(self.budget)
        if self.granularity not in GRANULARITIES:
            raise UserError(
                f"{self.name}: granularity must be one of {GRANULARITIES}, got {self.granularity!r}"
            )
        if self.use_kernel not in KERNELS:
            raise UserError(f"{self.name}: use_kernel must be one of {KERNELS}, got {self.use_kernel!r}")
        if self.variant not in VARIANTS:
            raise UserError(f"{self.name}: variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.n_sink < 0:
            raise UserError(f"{self.name}: n_sink must be >= 0, got {self.n_sink}")
        protected = self.n_sink + int(self.protect_newest)
        if self.budget <= protected:
            raise UserError(f"{self.name}: budget ({self.budget}) must exceed the {protected} protected "
                            "slots (n_sink + protect_newest), or nothing could be evicted")
        self.shared_selection = self.granularity == "layer"

    # ---- decode ------------------------------------------------------------------------------

    def decode(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """q `[B, Hq, D]` -> out `[B, Hq, D]`; writes `next_slot[layer]` in place, no host sync."""
        if self.granularity == "kv_head":
            return self._decode_per_head(layer, q, scale)
        slots = self.layers[layer]
        # One shared selection: every KV head of `valid` and `positions` holds the same row.
        protect = self._protected(slots.positions[:, 0])  # [B, S] or None
        attention = self._attention(q)
        out, next_slot = attention(q, slots.keys, slots.values, slots.valid[:, 0], scale, protect=protect)
        self.next_slot[layer].copy_(next_slot[:, None].expand_as(self.next_slot[layer]))
        return out

    def _attention(self, q: torch.Tensor):
        if self.use_kernel == "reference" or (self.use_kernel == "auto" and not q.is_cuda):
            return reference
        return longflow_attention

    def _decode_per_head(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """`granularity: kv_head`: the same score per KV head, summed over its G query heads."""
        slots = self.layers[layer]
        out, probs = decode_attention(q, slots.keys, slots.values, slots.valid, scale)  # probs [B, Hkv, G, S]
        # sum_h,d |p_hj v_jd| = sum_h p_hj ||v_j||_1; the constant 1 / (G * D) does not move the argmin.
        score = probs.sum(dim=2) * slots.values.float().abs().sum(dim=-1)  # [B, Hkv, S]
        protect = self._protected(slots.positions)
        if protect is not None:
            score = score.masked_fill(protect, float("inf"))
        score = score.masked_fill(~slots.valid, -1.0)  # free slots first, even if "protected"
        self.next_slot[layer].copy_(score.argmin(dim=-1))
        return out

    def _protected(self, positions: torch.Tensor) -> torch.Tensor | None:
        """Slots never evicted (sinks, the newest token) from their positions (-1 = free); None if none."""
        protect = None
        if self.n_sink:
            protect = (positions >= 0) & (positions < self.n_sink)
        if self.protect_newest:
            newest = positions == self.positions.view(-1, *([1] * (positions.dim() - 1)))
            protect = newest if protect is None else protect | newest
        return protect

    # ---- prefill -----------------------------------------------------------------------------

    def prefill_scores(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """SnapKV (see the module docstring), with the first `n_sink` positions always kept."""
        scores = snapkv_scores(q, k, self.pad, scale, shared=self.shared_selection,
                               before_window=self.variant == "lf_repo")  # [B, Hkv, L]
        if self.n_sink:
            # SnapKV's observation window scores +inf; the sinks rank above it (the window can be
            # longer than the budget), so the window drops to the largest finite score.
            scores = scores.clamp(max=torch.finfo(scores.dtype).max)
            sinks = (self.prompt_positions < self.n_sink) & self.pad  # [B, L]
            scores = scores.masked_fill(sinks[:, None, :], float("inf"))
        return scores
