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
    its G query heads; the same fused kernel with one selection per KV head, `scored_attention`).
  - `n_sink`: beyond the paper (default 0): the first `n_sink` positions are never evicted, at
    prefill (their SnapKV score is +inf) and at decode.
  - `protect_newest`: beyond the paper (default off): the token written this step is never the
    next one evicted.
  - `use_kernel`: `auto` (Triton on CUDA, the reference on the CPU), `triton` or `reference`; a
    switch for tests and benchmarks (runs keep `auto`).
  - `variant`: `paper` or `lf_repo` (the LongFlow authors' code). They decode identically and
    differ only in the prefill rule below.
  - `prefill` (of every method, `KVPolicy`): `snapkv` (default) or `by_score` (the prompt cut by
    the score above, with the last prompt query's attention; beyond the paper).
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

from longflow.errors import UserError
from longflow.kernels import reference, scored_attention
from longflow.policy import VARIANTS, FusedScore, KVPolicy, Observation, one_of, overrides, triton_decode
from longflow.selection import sink_mask
from longflow.snapkv import snapkv_scores

GRANULARITIES = ("layer", "kv_head")
KERNELS = ("auto", "triton", "reference")


@dataclass(eq=False)
class LongFlowPolicy(KVPolicy):
    """LongFlow (see the module docstring for every field and deviation)."""

    granularity: str = "layer"
    n_sink: int = 0
    protect_newest: bool = False
    use_kernel: str = "auto"
    variant: str = "paper"

    name = "longflow"

    def __post_init__(self):
        super().__post_init__()
        one_of(self.name, "granularity", self.granularity, GRANULARITIES)
        one_of(self.name, "use_kernel", self.use_kernel, KERNELS)
        one_of(self.name, "variant", self.variant, VARIANTS)
        if self.n_sink < 0:
            raise UserError(f"{self.name}: n_sink must be >= 0, got {self.n_sink}")
        protected = self.n_sink + int(self.protect_newest)
        if self.budget is not None and self.budget <= protected:
            raise UserError(f"{self.name}: budget ({self.budget}) must exceed the {protected} protected "
                            "slots (n_sink + protect_newest), or nothing could be evicted")
        self.shared_selection = self.granularity == "layer"

    def compresses_within(self, prompt_tokens: int, total_tokens: int, spec) -> bool:
        """The base rule: the fused decode (its own `decode`) chooses the next slot by the base
        class's selection rule, free slots first, and changes no cached key or value."""
        return not self.holds_every_token(prompt_tokens, total_tokens, spec)

    # ---- decode ------------------------------------------------------------------------------

    def decode(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """q `[B, Hq, D]` -> out `[B, Hq, D]`; writes `next_slot[layer]` in place, no host sync.

        `granularity: layer`: one fused call (the kernel returns the next slot itself, by the rule of
        `longflow.selection`); `kv_head`: the base class's step, with `score` per KV head (on the
        kernel, `fused_score`).
        """
        if self.granularity == "kv_head":
            return super().decode(layer, q, scale)
        slots = self.layers[layer]
        # One shared selection: every KV head of `valid` and `positions` holds the same row.
        protect = self._protected(slots.positions[:, 0], self.positions)  # [B, S] or None
        next_slot = self.next_slot[layer]  # [B, Hkv]
        if not triton_decode(self.use_kernel, q):
            out, chosen = reference(q, slots.keys, slots.values, slots.valid[:, 0], scale, protect=protect)
            next_slot.copy_(chosen[:, None].expand_as(next_slot))
            return out
        # `longflow.kernels.longflow_attention`'s two launches, with the chosen slot written into every
        # KV head's entry by the kernel itself: a copy launch less per layer (36 a step, 0.05 ms at
        # batch 128 in the profile at d2bc528, `results/engine/profile_decode_b128_d2bc528.csv`).
        return scored_attention(q, slots.keys, slots.values, slots.valid[:, 0], next_slot, scale, score="longflow",
                                protect=protect)

    def fused_score(self, q: torch.Tensor) -> FusedScore | None:
        """`score` per KV head (`granularity: kv_head`) in the fused kernel, as `decode` picks it."""
        if not triton_decode(self.use_kernel, q) or overrides(self, LongFlowPolicy, ("score",)):
            return None
        return FusedScore("longflow")

    def score(self, obs: Observation) -> torch.Tensor:
        """sum over query heads h and dims d of |p_hj v_j,d|: per KV head (its G query heads) for
        `kv_head`, over all heads for `layer`. The constant 1 / (Hq D) of the paper's score is left
        out: it moves no argmin and no top-k."""
        # sum_h,d |p_hj v_jd| = sum_h p_hj ||v_j||_1
        score = obs.probs.sum(dim=2) * obs.values.float().abs().sum(dim=-1)  # [n, Hkv, S]
        if self.shared_selection:
            return score.sum(dim=1, keepdim=True).expand_as(score)
        return score

    def protected(self, obs: Observation) -> torch.Tensor | None:
        return self._protected(obs.positions, obs.newest)

    def _protected(self, positions: torch.Tensor, newest: torch.Tensor) -> torch.Tensor | None:
        """Slots never evicted (sinks, the newest token) from their positions (-1 = free) and the
        newest position `[B]`; None if none."""
        protect = None
        if self.n_sink:
            protect = sink_mask(positions, self.n_sink)
        if self.protect_newest:
            newest = positions == newest.view(-1, *([1] * (positions.dim() - 1)))
            protect = newest if protect is None else protect | newest
        return protect

    # ---- prefill -----------------------------------------------------------------------------

    def snapkv_scores(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """SnapKV (see the module docstring), with the first `n_sink` positions always kept."""
        scores = snapkv_scores(q, k, self.pad, scale, shared=self.shared_selection,
                               before_window=self.variant == "lf_repo")  # [B, Hkv, L]
        if self.n_sink:
            # SnapKV's observation window scores +inf; the sinks rank above it (the window can be
            # longer than the budget), so the window drops to the largest finite score.
            scores = scores.clamp(max=torch.finfo(scores.dtype).max)
            sinks = sink_mask(self.prompt_positions, self.n_sink) & self.pad  # [B, L]
            scores = scores.masked_fill(sinks[:, None, :], float("inf"))
        return scores
