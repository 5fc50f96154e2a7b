"""StreamingLLM: attention sinks plus a sliding window of the most recent tokens.

Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks", ICLR 2024,
arXiv:2309.17453. What each variant computes, and why: docs/methods.md, "StreamingLLM".

Kept, in both variants: the first `n_sink` positions and the most recent budget - n_sink, i.e.
every query attends to the sinks and to the last budget - n_sink positions, itself included (the
budget counts every held slot, the sinks too). Once the cache is full, the slot the next token
overwrites is the oldest non-sink slot (free slots first). A prompt longer than the budget is cut
the same way at prefill (sinks + the last budget - n_sink - 1 prompt tokens, so that the first
decode token fits), not by SnapKV: the method has its own rule.

Variants (`variant`):
  - `paper`: `n_sink` (4) sinks; every key keeps the rotation of its real position.
  - `lf_repo` (the LongFlow authors' baseline, transformers' `SinkCache` driven by `generate`):
    `lf_n_sink` (32) sinks, and the kept keys are re-rotated as SinkCache does. At every step whose
    token cannot be appended without sliding the window (its position >= budget - 1), each kept
    non-sink key is rotated back by one position, in place, before the new key is written; the
    query keeps its real position (`generate` derives position ids from the attention mask). A key
    that has been through k such steps is rotated to its real position minus k, so its rotary
    distance to the query is twice the real one; sinks are never re-rotated. The rotation of the
    i-th oldest kept key uses SinkCache's own arithmetic: the products of the model's cos/sin at
    positions n_sink + i + 1 and n_sink + i (in float32, cast to the model dtype, taken from the
    model's rotary module, so scaled RoPE such as Llama 3.1's is handled), applied in the model
    dtype, so rounding accumulates over the steps as it does there.

Deviations from the paper, `paper` variant: StreamingLLM assigns positions by index within the
cache (keys are cached before RoPE and re-rotated), so the distance between a sink and the window
stays bounded. Here, as for every method of this harness, keys are cached after RoPE with their
real positions, which keep counting after eviction. The selection does not use attention, so the
decode attention computes no probabilities (`step_probs = False`): on CUDA it is flash decoding
(`KVPolicy.attention_only`), the fastest attention the harness has for a cache with holes.

Deviations from the authors' runs, `lf_repo` variant: with batches, their `SinkCache` takes the
first `n_sink` entries of the left-padded cache as sinks (padding, for padded rows) and one
rotation table from row 0's positions; here every row has its own first positions as sinks and
the table of an unpadded row, i.e. a row behaves as it does alone in their code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from longflow.errors import UserError
from longflow.policy import CacheSpec, KVPolicy, Observation
from longflow.rotary import rotate_half
from longflow.selection import sink_mask


def sink_rerotation(rotary, window: int, n_sink: int, dtype: torch.dtype,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """SinkCache's one-position back-rotation of the i-th oldest kept key, `(cos, sin)` `[window - n_sink - 1, D]`.

    Row i rotates from position n_sink + i + 1 to n_sink + i: cos(a - b) and sin(b - a) written
    as products of the model's cos/sin at a = n_sink + i + 1 and b = n_sink + i, in float32, then
    cast to `dtype`, which is how transformers' `SinkCache` builds it.
    """
    positions = torch.arange(window, device=device)[None]
    cos, sin = rotary(torch.empty(0, dtype=dtype, device=device), positions)  # [1, window, D] in dtype
    cos, sin = cos[0].float(), sin[0].float()
    new_cos, old_cos = cos[n_sink + 1:], cos[n_sink:-1]
    new_sin, old_sin = sin[n_sink + 1:], sin[n_sink:-1]
    back_cos = new_cos * old_cos + new_sin * old_sin
    back_sin = -new_sin * old_cos + new_cos * old_sin
    return back_cos.to(dtype), back_sin.to(dtype)


@dataclass(eq=False)
class StreamingPolicy(KVPolicy):
    """StreamingLLM `paper` (see the module docstring). Fields: `variant`, `n_sink` (paper),
    `lf_n_sink` (lf_repo); the config's `variant` picks the class (`StreamingLfRepoPolicy`).

    `self.sinks` is the number of sinks in force: `n_sink`, or for `lf_repo`, `lf_n_sink`.
    """

    variant: str = "paper"
    n_sink: int = 4
    lf_n_sink: int = 32

    name = "streaming"
    shared_selection = True  # positions are the same in every head
    step_probs = False  # the score is the position
    variant_classes = {"paper": "baselines.streaming.StreamingPolicy",
                       "lf_repo": "baselines.streaming.StreamingLfRepoPolicy"}
    own_variant = "paper"
    sink_field: ClassVar[str] = "n_sink"  # the field of the sinks in force
    # The least budget beyond the sinks: the newest token.
    least_window: ClassVar[int] = 1

    def __post_init__(self):
        super().__post_init__()
        sinks = getattr(self, self.sink_field)
        if sinks < 0:
            raise UserError(f"{self.name}: {self.sink_field} must be >= 0, got {sinks}")
        least = sinks + self.least_window
        if self.budget is not None and self.budget < least:
            raise UserError(f"{self.name}: budget ({self.budget}) must be at least {least} with "
                            f"{self.sink_field}={sinks}")
        self.sinks = sinks

    def prefill_scores(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Newer is better, sinks always: the score of a prompt token is its position."""
        positions = self.prompt_positions[:, None, :].float()  # [B, 1, L]
        scores = positions.masked_fill(sink_mask(self.prompt_positions[:, None, :], self.sinks), float("inf"))
        scores = scores.masked_fill(~self.pad[:, None, :], float("-inf"))
        return scores.expand(-1, k.shape[1], -1)  # [B, Hkv, L]

    def score(self, obs: Observation) -> torch.Tensor:
        """Newer is better: a slot's score is its position (the oldest non-sink slot goes next)."""
        return obs.positions

    def protected(self, obs: Observation) -> torch.Tensor:
        """The sinks (free slots, position -1, come out True and stay free)."""
        return sink_mask(obs.positions, self.sinks)


@dataclass(eq=False)
class StreamingLfRepoPolicy(StreamingPolicy):
    """StreamingLLM `lf_repo` (see the module docstring): `lf_n_sink` sinks, and the kept keys re-rotated
    as transformers' SinkCache does."""

    variant: str = "lf_repo"

    own_variant = "lf_repo"
    sink_field = "lf_n_sink"
    # SinkCache keeps the last window - sinks - 1 keys when it slides; with none, its slice
    # `[-window + sinks + 1:]` would keep the whole cache.
    least_window = 2

    def prepare(self, spec: CacheSpec) -> None:
        if spec.rotary is None:
            raise UserError(f"{self.name} lf_repo re-rotates cached keys: the model needs a rotary embedding")
        self.rerotation = sink_rerotation(spec.rotary, self.budget, self.sinks, spec.dtype, spec.device)

    def compresses_within(self, prompt_tokens: int, total_tokens: int, spec: CacheSpec) -> bool:
        """The base rule; `lf_repo` re-rotates the kept keys from the step that writes position
        budget - 1 on, free slot or not, so the last step that matters (it writes position
        total - 2) must come before it."""
        if self.variant == "lf_repo" and total_tokens - 2 >= self.budget - 1:
            return True
        return not self.holds_every_token(prompt_tokens, total_tokens, spec)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.prefilling:
            self._rerotate(layer)
        return super().store(layer, k, v)

    def _rerotate(self, layer: int) -> None:
        """`lf_repo`: rotate the kept non-sink keys back by one position where the window slides.

        In place and static (no host sync): a row slides when its position >= budget - 1; the
        i-th oldest kept non-sink key uses row i of the table. The slot about to be overwritten
        (the oldest non-sink) has i = -1 and is left as it is.
        """
        slots = self.layers[layer]
        back_cos, back_sin = self.rerotation  # [R, D]
        newest = self.positions[:, None, None]  # [B, 1, 1]
        positions = slots.positions[:, :1]  # [B, 1, S], the same in every head
        oldest_kept = newest - (self.budget - self.sinks) + 1
        rank = positions - oldest_kept
        moves = (slots.valid[:, :1] & (positions >= self.sinks) & (rank >= 0)
                 & (newest >= self.budget - 1))  # [B, 1, S]
        index = rank.clamp(0, back_cos.shape[0] - 1)
        keys = slots.keys
        rotated = keys * back_cos[index] + rotate_half(keys) * back_sin[index]
        keys.copy_(torch.where(moves[..., None], rotated, keys))
