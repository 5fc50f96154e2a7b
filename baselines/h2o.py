"""H2O: keep the recent tokens and the "heavy hitters", the tokens that received the most attention.

Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models", NeurIPS 2023, arXiv:2306.14048 (official code: FMInference/H2O). Both variants and every
deviation: docs/methods.md, "H2O".

Variants (`variant`):
  - `paper`: score_j = the attention slot j has received, accumulated over every query so far,
    prefill queries included, per KV head (summed over the G query heads of its group). Kept: the
    last `recent` tokens by position, and of the rest the top `heavy` by score, per KV head.
  - `lf_repo` (the LongFlow authors' baseline): the score is the CURRENT step's attention only (no
    accumulation), summed over all query heads; one selection shared by the heads of a layer.

Both keep heavy = floor(heavy_ratio * budget) and recent = budget - heavy (heavy = recent = budget/2
by default), and evict one token per step (`compress_every` = 1): once the cache is full, the slot
the next token overwrites is the lowest-scored slot outside the recent window.

Deviations from the paper, and why:
  - Budget accounting. The paper's code holds heavy + recent tokens after an eviction and appends
    the new token on top, so a query sees heavy + recent + 1 tokens. Here `budget` is a hard cap
    that counts the new token: every query attends to the last `recent` positions (itself included)
    and `heavy` heavy hitters, heavy + recent = budget. The eviction at step t therefore protects the
    newest recent - 1 tokens, so that the recent window is whole again once token t + 1 is written.
    To match a run of heavy = recent = h there (the LongFlow authors' `H2OCache(hh_size=h,
    recent_size=h)` included), use budget 2h + 1 with heavy_ratio 0.5: heavy h, recent h + 1, and
    the query sees the same 2h + 1 tokens (docs/methods.md, "H2O").
  - Prompt longer than the budget: the same rule on the prompt's accumulated attention (column sums
    of the causal prompt attention), keeping the last recent - 1 prompt tokens and the top heavy of
    the rest (budget - 1 in all, so that the first decode token fits). `lf_repo` uses those column
    sums too, summed over all heads: the prefill forward is that variant's "current step".
  - GQA (the paper predates it): one score per KV head, summed over its query heads.
  - Softmax and scores are in float32; a new token's score starts at 0 and receives the attention
    of the step that writes it, its own query included, as in the paper's code.
  - `compress_every` other than 1 is not implemented (the paper evicts every step).

`VATPPolicy` (baselines/vatp.py) reuses this machinery with a different score and attention sinks.

Notation: B batch, Hq query heads, Hkv KV heads, G = Hq / Hkv, S slots, L padded prompt length,
D head dim.
"""

from __future__ import annotations

import torch

from longflow.errors import UserError
from longflow.policy import CacheSpec, KVPolicy

VARIANTS = ("paper", "lf_repo")

# Elements of one chunk of prompt attention probabilities: bounds the prefill scoring memory
# (float32 logits and probabilities of `[B, Hkv, G, chunk, L]`, 256 MiB each) for long prompts.
CHUNK_ELEMENTS = 1 << 26


def prompt_attention_sums(
    q: torch.Tensor, k: torch.Tensor, pad: torch.Tensor, scale: float, chunk_elements: int = CHUNK_ELEMENTS
) -> torch.Tensor:
    """Attention each prompt token receives from all real prompt queries (causal), per KV head.

    The column sums of the prompt's softmax attention, summed over the G query heads of each KV
    head. Computed in chunks of queries, so memory stays bounded whatever the prompt length;
    padding queries contribute nothing and padding keys receive nothing.

    Args:
        q: `[B, Hq, L, D]`; k: `[B, Hkv, L, D]` (after RoPE); pad: `[B, L]` bool, True = real token.

    Returns:
        `[B, Hkv, L]` float32.
    """
    batch, q_heads, length, head_dim = q.shape
    kv_heads = k.shape[1]
    group = q_heads // kv_heads
    keys = k.unsqueeze(2).transpose(-1, -2)  # [B, Hkv, 1, D, L]
    index = torch.arange(length, device=q.device)
    sums = torch.zeros(batch, kv_heads, length, dtype=torch.float32, device=q.device)
    chunk = max(1, chunk_elements // (batch * q_heads * length))
    for start in range(0, length, chunk):
        end = min(length, start + chunk)  # queries [start, end) see keys [0, end) at most
        queries = q[:, :, start:end].reshape(batch, kv_heads, group, end - start, head_dim)
        # logits in the model dtype, softmax in float32, as `decode_attention` does
        logits = torch.matmul(queries, keys[..., :end]).float() * scale  # [B, Hkv, G, c, end]
        rows, cols = index[start:end, None], index[None, :end]
        # A padding query sees only itself (no NaN); its row is zeroed below.
        allowed = ((cols <= rows) & pad[:, None, :end]) | (cols == rows)  # [B, c, end]
        logits = logits.masked_fill(~allowed[:, None, None], float("-inf"))
        probs = torch.softmax(logits, dim=-1) * pad[:, None, None, start:end, None]
        sums[..., :end] += probs.sum(dim=(2, 3))
    return sums


class H2OPolicy(KVPolicy):
    """H2O (see the module docstring). Fields: `variant`, `heavy_ratio`, `compress_every`."""

    name = "h2o"

    def __init__(
        self,
        budget: int | None = None,
        variant: str = "paper",
        heavy_ratio: float = 0.5,
        compress_every: int = 1,
    ):
        super().__init__(budget)
        if variant not in VARIANTS:
            raise UserError(f"{self.name}: variant must be one of {VARIANTS}, got {variant!r}")
        if not 0 <= heavy_ratio < 1:
            raise UserError(f"{self.name}: heavy_ratio must be in [0, 1), got {heavy_ratio}")
        if compress_every != 1:
            raise UserError(f"{self.name}: only compress_every=1 (one eviction per step) is implemented")
        self.variant = variant
        self.heavy_ratio = heavy_ratio
        self.compress_every = compress_every
        # paper: per-KV-head selection on accumulated attention; lf_repo: shared, current step only.
        self.shared_selection = variant == "lf_repo"
        self.accumulate = variant == "paper"
        if budget is not None:
            if budget <= self.sinks:
                raise UserError(f"{self.name}: budget ({budget}) must exceed the {self.sinks} sink tokens")
            self.heavy = int((budget - self.sinks) * heavy_ratio)
            self.recent = budget - self.sinks - self.heavy  # >= 1: the current token

    @property
    def sinks(self) -> int:
        """Leading positions that are never evicted (none for H2O)."""
        return 0

    # ---- the score: the one thing VATP changes -------------------------------------------------

    def score(self, attention: torch.Tensor, norms: torch.Tensor | None) -> torch.Tensor:
        """Scores `[B, Hkv, N]` from received attention `[B, Hkv, N]` (summed over the group's query
        heads) and value norms (`value_norms`); identical across heads for a shared selection."""
        if self.shared_selection:
            return attention.sum(dim=1, keepdim=True).expand_as(attention)
        return attention

    def value_norms(self, values: torch.Tensor) -> torch.Tensor | None:
        """Per-token value norms `[B, Hkv, N]` from values `[B, Hkv, N, D]` (H2O needs none)."""
        return None

    def held_value_norms(self, layer: int) -> torch.Tensor | None:
        """The value norms of the held slots `[B, Hkv, S]`, at decode (H2O needs none)."""
        return None

    def protected(self, positions: torch.Tensor, newest: torch.Tensor) -> torch.Tensor:
        """Slots never evicted: the newest `recent - 1` positions (the token written next completes
        the recent window) and the sinks. positions `[B, Hkv, N]`, newest `[B]` -> `[B, Hkv, N]` bool.
        Free and padding slots may come out True; callers mask them afterwards."""
        recent = positions >= (newest - (self.recent - 2))[:, None, None]
        return recent | (positions < self.sinks)

    # ---- hooks -------------------------------------------------------------------------------

    def allocate(self, spec: CacheSpec) -> None:
        super().allocate(spec)
        slots = self.capacity(spec)
        # Accumulated attention per slot, moved with the slot: reset when a slot is overwritten.
        self.received = [
            torch.zeros(spec.batch, spec.kv_heads, slots, dtype=torch.float32, device=spec.device)
            for _ in range(spec.layers)
        ] if self.accumulate else []
        self.prompt_sums: torch.Tensor | None = None

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        # The prompt's column sums are needed by `prefill_scores` (prompt longer than the budget)
        # and by `on_prompt_stored` (paper: the accumulation starts with the prefill queries); both
        # run inside the base class's `attend`, which is the last place that sees q and k.
        if self.prefilling and (self.accumulate or self.prefill_keep(self.spec) < k.shape[2]):
            self.prompt_sums = prompt_attention_sums(q, k, self.pad, scale)
        return super().attend(layer, q, k, v, scale)

    def prefill_scores(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        scores = self.score(self.prompt_sums, self.value_norms(v))  # [B, Hkv, L]
        newest = self.pad.sum(dim=-1) - 1  # position of each row's last prompt token
        protected = self.protected(self.prompt_positions[:, None, :], newest)
        scores = scores.masked_fill(protected, float("inf"))
        return scores.masked_fill(~self.pad[:, None, :], float("-inf"))

    def on_prompt_stored(self, layer: int, kept: torch.Tensor) -> None:
        if self.accumulate:
            held = kept.shape[-1]
            slots = self.layers[layer]
            received = self.prompt_sums.gather(2, kept) * slots.valid[..., :held]
            self.received[layer][..., :held].copy_(received)
        self.prompt_sums = None  # per layer: the next layer's `attend` computes its own

    def choose_next_slot(self, layer: int, q: torch.Tensor, probs: torch.Tensor) -> None:
        """probs `[B, Hkv, G, S]`; `next_slot[layer]` still holds the slot written this step."""
        slots = self.layers[layer]
        attention = probs.sum(dim=2)  # [B, Hkv, S]
        if self.accumulate:
            received = self.received[layer]
            received.scatter_(2, self.next_slot[layer][..., None], 0.0)  # a new token starts at 0
            received += attention
            attention = received
        scores = self.score(attention, self.held_value_norms(layer))
        scores = scores.masked_fill(self.protected(slots.positions, self.positions), float("inf"))
        scores = scores.masked_fill(~slots.valid, float("-inf"))  # free slots are filled first
        self.next_slot[layer].copy_(scores.argmin(dim=-1))
