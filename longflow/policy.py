"""The KV-policy interface: the one thing a KV-cache method implements.

A policy owns the KV cache of one generation batch. Every method keeps its cache in static slot
buffers (`LayerSlots`), allocated once per batch and written in place by explicit slot index, as in
gpt-fast's `KVCache`: a decode step never concatenates or gathers, its shapes never change, and it
does not synchronise with the host, so it can be captured in a CUDA graph. Methods differ only in
which slot the next token overwrites and which prompt tokens survive prefill.

Call order, driven by the engine (`longflow.engine`) through `PolicyCache` and the `kv_policy`
attention function (`longflow.cache`):

    allocate(spec)                        once per batch
    begin_prefill(pad, positions)         host, before the prompt forward
      per layer: store(...) then attend(...)
    begin_decode(positions)               host, once; `positions` is the engine's static tensor
      before_step(step)                   host, before each step: True if the step must run eagerly
      per step, per layer: store(...) then attend(...)
      after_step(step)                    host, between steps (interval methods compress here)

Notation: B batch, Hq query heads, Hkv KV heads, G = Hq / Hkv, S slots, L padded prompt length,
D head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from longflow.attention import decode_attention, prefill_attention, window_probs

# Slot and prompt lengths are kept multiples of ALIGN where the engine chooses them: rows of bf16
# matmul operands and SDPA masks whose length is not a multiple of 8 elements lose 16-byte alignment,
# and the GPU falls back to kernels 2-3x slower.
ALIGN = 16


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class CacheSpec:
    """Shapes of one generation batch, known before prefill."""

    batch: int
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    prompt_len: int  # padded prompt length L
    max_new_tokens: int
    dtype: torch.dtype
    device: torch.device
    # The model's rotary embedding, `(x, position_ids [B, L]) -> (cos, sin) [B, L, D]` in x's dtype,
    # for methods that re-rotate cached keys (None when the engine did not find one).
    rotary: Callable | None = None


class LayerSlots:
    """Static KV buffers of one layer.

    keys, values: `[B, Hkv, S, D]`; valid: `[B, Hkv, S]` bool (False = free or padding);
    positions: `[B, Hkv, S]` int64, the token position held by each slot (-1 when free).
    Methods with one shared selection per layer keep all heads of `valid` and `positions` equal.
    """

    def __init__(self, spec: CacheSpec, slots: int):
        shape = (spec.batch, spec.kv_heads, slots)
        self.keys = torch.zeros(*shape, spec.head_dim, dtype=spec.dtype, device=spec.device)
        self.values = torch.zeros_like(self.keys)
        self.valid = torch.zeros(shape, dtype=torch.bool, device=spec.device)
        self.positions = torch.full(shape, -1, dtype=torch.long, device=spec.device)

    @property
    def slots(self) -> int:
        return self.keys.shape[2]


def snapkv_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    pad: torch.Tensor,
    scale: float,
    window: int = 32,
    kernel: int = 5,
    shared: bool = False,
    before_window: bool = False,
) -> torch.Tensor:
    """SnapKV prompt scores (Li et al. 2024): attention of the last `window` queries, avg-pooled.

    The window tokens themselves get +inf so that they are always kept; padding gets -inf.
    GQA: probabilities are summed over the query heads of a KV head; `shared` sums over all heads
    for methods with one selection per layer. By default the window queries' softmax runs over
    all prompt keys (causal); `before_window` restricts it, and the pooling, to the keys before the
    window, as the LongFlow authors' SnapKV does (`lf_repo`).

    Args:
        q: `[B, Hq, L, D]`; k: `[B, Hkv, L, D]`; pad: `[B, L]` bool.

    Returns:
        `[B, Hkv, L]` float32 (identical across heads when `shared`).
    """
    batch, kv_heads, length = pad.shape[0], k.shape[1], pad.shape[1]
    window = min(window, length)
    scored = length - window if before_window else length  # keys that the window's softmax covers
    if before_window:
        q_heads, head_dim = q.shape[1], q.shape[3]
        last = q[:, :, scored:].float().view(batch, kv_heads, q_heads // kv_heads, window, head_dim)
        logits = torch.matmul(last, k[:, :, :scored].float().unsqueeze(2).transpose(-1, -2)) * scale
        logits = logits.masked_fill(~pad[:, None, None, None, :scored], float("-inf"))
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # [B, Hkv, G, W, L - W]
    else:
        probs = window_probs(q, k, pad, scale, window)  # [B, Hkv, G, W, L]
    scores = probs.sum(dim=(2, 3))  # [B, Hkv, scored]
    if shared:
        scores = scores.sum(dim=1, keepdim=True).expand_as(scores)
    if scored:
        scores = F.avg_pool1d(scores.flatten(0, 1).unsqueeze(1), kernel, stride=1, padding=kernel // 2)
    scores = scores.reshape(batch, kv_heads, scored)
    scores = torch.cat([scores, scores.new_full((batch, kv_heads, length - scored), float("inf"))], dim=-1)
    scores[..., -window:] = float("inf")
    return scores.masked_fill(~pad[:, None, :], float("-inf"))


class KVPolicy:
    """Base class of every KV-cache method.

    Subclasses set `name`, and override some of:
      - `capacity(spec)`: slots allocated per layer (default: the budget);
      - `prefill_keep(spec)`: how many prompt tokens survive prefill (default: capacity - 1, so
        that the first decode token finds a free slot);
      - `prefill_scores(...)`: the prompt-compression rule (default: SnapKV);
      - `choose_next_slot(layer, probs)`: the per-step eviction rule;
      - `decode(layer, q, scale)`: the whole decode attention, when the method fuses it;
      - `before_step(step)`: whether the coming step does host-side work inside the forward
        (the engine then runs it eagerly, not as a CUDA-graph replay);
      - `after_step(step)`: host-side work between steps (interval compression).
    """

    name = "base"
    shared_selection = True  # one selection per layer, shared by all KV heads

    def __init__(self, budget: int | None = None):
        if budget is not None and budget <= 0:
            raise ValueError(f"budget must be a positive number of KV slots, got {budget}")
        self.budget = budget
        self.spec: CacheSpec | None = None
        self.layers: list[LayerSlots] = []
        self.next_slot: list[torch.Tensor] = []

    # ---- sizes -------------------------------------------------------------------------------

    def capacity(self, spec: CacheSpec) -> int:
        if self.budget is None:
            raise ValueError(f"method {self.name!r} needs a budget")
        return self.budget

    def prefill_keep(self, spec: CacheSpec) -> int:
        return self.capacity(spec) - 1

    # ---- lifecycle ---------------------------------------------------------------------------

    def allocate(self, spec: CacheSpec) -> None:
        """Allocate the static buffers of one batch (called again for every batch)."""
        self.spec = spec
        slots = self.capacity(spec)
        self.layers = [LayerSlots(spec, slots) for _ in range(spec.layers)]
        self.next_slot = [
            torch.zeros(spec.batch, spec.kv_heads, dtype=torch.long, device=spec.device)
            for _ in range(spec.layers)
        ]
        self.peak = torch.zeros(spec.batch, dtype=torch.long, device=spec.device)
        self.prefilling = False

    def begin_prefill(self, pad: torch.Tensor, positions: torch.Tensor) -> None:
        """pad: `[B, L]` bool (True = real token); positions: `[B, L]` int64."""
        self.prefilling = True
        self.pad = pad
        self.prompt_positions = positions
        # Real tokens per row, on the host for methods whose storage depends on them (one sync per
        # batch, before the prompt forward).
        self.prompt_lengths: list[int] = pad.sum(dim=-1).tolist()

    def begin_decode(self, positions: torch.Tensor) -> None:
        """positions: `[B]` int64, the position of the token each row writes at the current step.

        The engine updates this tensor in place before every step; the policy keeps the reference.
        """
        self.prefilling = False
        self.positions = positions

    def before_step(self, step: int) -> bool:
        """Host hook before decode step `step` (0-based). True when the step does host-side work
        inside the forward, so that the engine runs it eagerly instead of replaying its CUDA graph
        (R-KV's `lf_repo` cut, which needs the step's own query). Default: every step is static."""
        return False

    def after_step(self, step: int) -> None:
        """Host hook after decode step `step` (0-based); no-op for per-step methods."""

    # ---- called from the model ---------------------------------------------------------------

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`PolicyCache.update`: k, v `[B, Hkv, Lq, D]` after RoPE.

        At prefill nothing is stored yet: which prompt tokens survive depends on the prompt's own
        attention, so `attend` stores them. At decode the new token overwrites `next_slot`.
        """
        if self.prefilling:
            return k, v
        slots = self.layers[layer]
        index = self.next_slot[layer]  # [B, Hkv]
        batch, kv_heads, _, head_dim = k.shape
        slots.keys.scatter_(2, index[..., None, None].expand(batch, kv_heads, 1, head_dim), k)
        slots.values.scatter_(2, index[..., None, None].expand(batch, kv_heads, 1, head_dim), v)
        slots.valid.scatter_(2, index[..., None], True)
        slots.positions.scatter_(2, index[..., None], self.positions[:, None, None].expand(-1, kv_heads, 1))
        return slots.keys, slots.values

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """The attention function: q `[B, Hq, Lq, D]` -> `[B, Lq, Hq, D]` (HF's layout)."""
        if self.prefilling:
            out = prefill_attention(q, k, v, self.pad, scale)
            self._store_prompt(layer, q, k, v, scale)
            return out.transpose(1, 2)
        return self.decode(layer, q[:, :, 0], scale).unsqueeze(1)

    # ---- method hooks ------------------------------------------------------------------------

    def decode(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """q `[B, Hq, D]` -> out `[B, Hq, D]`; sets `next_slot[layer]` for the next step."""
        slots = self.layers[layer]
        out, probs = decode_attention(q, slots.keys, slots.values, slots.valid, scale)
        self.choose_next_slot(layer, q, probs)
        return out

    def choose_next_slot(self, layer: int, q: torch.Tensor, probs: torch.Tensor) -> None:
        """probs `[B, Hkv, G, S]` of the current step; write `self.next_slot[layer]` in place."""
        raise NotImplementedError

    def prefill_scores(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Prompt scores `[B, Hkv, L]`, higher = keep; padding must score -inf. Default: SnapKV."""
        return snapkv_scores(q, k, self.pad, scale, shared=self.shared_selection)

    def on_prompt_stored(self, layer: int, kept: torch.Tensor) -> None:
        """Called after prefill with the kept prompt indices `[B, Hkv, n]` (methods with state)."""

    # ---- helpers -----------------------------------------------------------------------------

    def first_free_slot(self, layer: int) -> torch.Tensor:
        """`[B, Hkv]`: the lowest free slot index (0 when none is free)."""
        return (~self.layers[layer].valid).to(torch.uint8).argmax(dim=-1)

    def _store_prompt(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
        spec, slots = self.spec, self.layers[layer]
        length = k.shape[2]
        keep = min(self.prefill_keep(spec), length)
        batch, kv_heads = spec.batch, spec.kv_heads
        if max(self.prompt_lengths) <= keep:
            # Every real token fits; with left padding they are all among the last `keep` positions.
            kept = torch.arange(length - keep, length, device=k.device).expand(batch, kv_heads, keep)
            slots.keys[:, :, :keep] = k[:, :, length - keep:]
            slots.values[:, :, :keep] = v[:, :, length - keep:]
        else:
            scores = self.prefill_scores(layer, q, k, v, scale)
            kept = scores.topk(keep, dim=-1).indices.sort(dim=-1).values  # [B, Hkv, keep]
            gather = kept[..., None].expand(-1, -1, -1, k.shape[-1])
            slots.keys[:, :, :keep] = k.gather(2, gather)
            slots.values[:, :, :keep] = v.gather(2, gather)
        pad = self.pad[:, None, :].expand(batch, kv_heads, length)
        slots.valid[:, :, :keep] = pad.gather(2, kept)
        positions = self.prompt_positions[:, None, :].expand(batch, kv_heads, length).gather(2, kept)
        slots.positions[:, :, :keep] = positions.masked_fill(~slots.valid[:, :, :keep], -1)
        self.next_slot[layer].copy_(self.first_free_slot(layer))
        self.on_prompt_stored(layer, kept)

    def record_peak(self, layers: list[int] | None = None) -> None:
        """Fold the slots held now in `layers` (default: all), per row over heads, into the peak.

        A store fills a free slot or overwrites one, so the count never falls while decoding:
        its peak is the count at the end or just before a method frees slots. Methods that free
        slots (R-KV's cuts) call this first; the decode step itself stays free of the reduction.
        """
        for slots in self.layers if layers is None else [self.layers[i] for i in layers]:
            held = slots.valid.sum(dim=-1).amax(dim=-1)  # [B]
            torch.maximum(self.peak, held, out=self.peak)

    def peak_slots(self) -> list[int]:
        """Peak KV slots held per sequence, over all layers and heads, so far (syncs the host)."""
        self.record_peak()
        return self.peak.tolist()
