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

Decode kernel (`use_kernel`, a switch for tests and benchmarks that changes no score, outside the
yaml and a run's identity as vanilla's): `auto` (default) computes the step on CUDA in the fused
decode kernel (`longflow.kernels.scored_attention`: attention, the score above with the accumulator
updated in place, and the next slot, in LongFlow's two launches), elsewhere in the eager attention
with float32 probabilities; `triton` the kernel everywhere (Triton's interpreter on the CPU), `eager`
the eager path everywhere. The kernel's logits are float32 products of the model-dtype q and k, the
eager path's are rounded to the model dtype first (as HF's eager attention): in bf16 the two may
break a near-tie differently.

`VATPPolicy` (baselines/vatp.py) reuses this machinery with a different score and attention sinks.

Notation: B batch, Hq query heads, Hkv KV heads, G = Hq / Hkv, S slots, L padded prompt length,
D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longflow.errors import UserError
from longflow.policy import (
    DECODE_KERNELS,
    VARIANTS,
    FusedScore,
    KVPolicy,
    Observation,
    one_of,
    overrides,
    triton_decode,
)
from longflow.selection import sink_mask
from longflow.slots import SlotState

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


@dataclass(eq=False)
class H2OPolicy(KVPolicy):
    """H2O (see the module docstring). Fields: `variant`, `heavy_ratio`, `compress_every`, `use_kernel`."""

    variant: str = "paper"
    heavy_ratio: float = 0.5
    compress_every: int = 1
    use_kernel: str = "auto"

    name = "h2o"

    def __post_init__(self):
        super().__post_init__()
        one_of(self.name, "variant", self.variant, VARIANTS)
        one_of(self.name, "use_kernel", self.use_kernel, DECODE_KERNELS)
        if not 0 <= self.heavy_ratio < 1:
            raise UserError(f"{self.name}: heavy_ratio must be in [0, 1), got {self.heavy_ratio}")
        if self.compress_every != 1:
            raise UserError(f"{self.name}: only compress_every=1 (one eviction per step) is implemented")
        # paper: per-KV-head selection on accumulated attention; lf_repo: shared, current step only.
        self.shared_selection = self.variant == "lf_repo"
        self.accumulate = self.variant == "paper"
        if self.budget is not None:
            if self.budget <= self.sinks:
                raise UserError(f"{self.name}: budget ({self.budget}) must exceed the {self.sinks} sink tokens")
            self.heavy = int((self.budget - self.sinks) * self.heavy_ratio)
            self.recent = self.budget - self.sinks - self.heavy  # >= 1: the current token

    @property
    def sinks(self) -> int:
        """Leading positions that are never evicted (none for H2O)."""
        return 0

    # ---- the score: the one thing VATP changes -------------------------------------------------

    def weigh(self, attention: torch.Tensor, norms: torch.Tensor | None) -> torch.Tensor:
        """Scores `[B, Hkv, N]` from received attention `[B, Hkv, N]` (summed over the group's query
        heads) and value norms (`value_norms`); identical across heads for a shared selection."""
        if self.shared_selection:
            return attention.sum(dim=1, keepdim=True).expand_as(attention)
        return attention

    def value_norms(self, values: torch.Tensor) -> torch.Tensor | None:
        """Per-token value norms `[B, Hkv, N]` from values `[B, Hkv, N, D]` (H2O needs none)."""
        return None

    def held_value_norms(self, obs: Observation) -> torch.Tensor | None:
        """The value norms of the held slots `[B, Hkv, S]`, at decode (H2O needs none)."""
        return None

    def slot_state(self) -> dict[str, SlotState]:
        # Accumulated attention per slot (paper), moved with the slot: a written slot starts at 0, a
        # kept prompt token at the attention it received from the prompt's queries.
        return {"received": SlotState(on_prompt=prompt_received)} if self.accumulate else {}

    def score(self, obs: Observation) -> torch.Tensor:
        """The step's attention `[B, Hkv, S]` (summed over each group's query heads), accumulated into
        the slots' received attention (paper), weighed by `weigh`."""
        attention = obs.probs.sum(dim=2)  # [B, Hkv, S]
        if self.accumulate:
            received = obs.state("received")
            received += attention
            attention = received
        return self.weigh(attention, self.held_value_norms(obs))

    def fused_score(self, q: torch.Tensor) -> FusedScore | None:
        """`score` in the fused kernel: the accumulated attention per KV head (paper), the step's
        attention summed over all heads (lf_repo)."""
        if not triton_decode(self.use_kernel, q) or overrides(self, H2OPolicy, ("score", "weigh", "held_value_norms")):
            return None
        return FusedScore("accumulated", received="received") if self.accumulate else FusedScore("attention")

    def protected(self, obs: Observation) -> torch.Tensor:
        """The newest `recent - 1` positions (the token written next completes the recent window) and
        the sinks; free slots may come out True (they stay free)."""
        return self.protected_positions(obs.positions, obs.newest)

    def protected_positions(self, positions: torch.Tensor, newest: torch.Tensor) -> torch.Tensor:
        """positions `[B, Hkv, N]`, newest `[B]` -> `[B, Hkv, N]` bool."""
        recent = positions >= (newest - (self.recent - 2))[:, None, None]
        return recent | sink_mask(positions, self.sinks) if self.sinks else recent

    # ---- prefill -------------------------------------------------------------------------------

    def prefill_scores(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        scores = self.weigh(prompt_attention_sums(q, k, self.pad, scale), self.value_norms(v))  # [B, Hkv, L]
        newest = self.pad.sum(dim=-1) - 1  # position of each row's last prompt token
        protected = self.protected_positions(self.prompt_positions[:, None, :], newest)
        scores = scores.masked_fill(protected, float("inf"))
        return scores.masked_fill(~self.pad[:, None, :], float("-inf"))


def prompt_received(prompt) -> torch.Tensor:
    """The attention each prompt token received from the prompt's queries `[B, Hkv, L]` (a
    `longflow.policy.PromptObservation`): where the paper's accumulation starts."""
    return prompt_attention_sums(prompt.q, prompt.keys, prompt.policy.pad, prompt.scale)
