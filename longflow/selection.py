"""The one slot-selection rule of every KV method: free slots first, protected slots last, lowest score.

A method only scores its slots (higher = keep) and says which ones it protects; these functions
choose. They are the contract of the fused LongFlow kernel too (`longflow.kernels.longflow_attention`
implements `choose_next` inside its score pass: free slots key -1, protected valid slots +inf,
ties to the lowest slot index), and of the decode-attention benchmark.

- `choose_next`: the slot the next token overwrites, per row (and KV head): the lowest free slot
  while one is free, else the valid unprotected slot of lowest score (ties: the lowest index).
- `choose_keep`: the slots a compression keeps: every protected valid slot, then the best
  scored ones (ties: the highest index kept, so the lowest goes first, as in `choose_next`);
  never a free slot unless fewer than `count` slots are valid.
- `first_free`: the lowest free slot, for methods that never evict between compressions.
- `chosen_mask`: the kept slots of a `choose_keep` as a mask; `sink_mask`: the attention sinks, the
  first n positions that a method never evicts.

Scores may be float (any scale) or integer (StreamingLLM ranks by position). Notation: `[..., S]`
with any leading dimensions (`[B, Hkv, S]` or `[B, S]`).
"""

from __future__ import annotations

import torch


def _extremes(dtype: torch.dtype) -> tuple[float | int, float | int]:
    """(lowest, highest) key of a score dtype: +-inf for floats, the integer limits otherwise."""
    if dtype.is_floating_point:
        return float("-inf"), float("inf")
    info = torch.iinfo(dtype)
    return info.min, info.max


def selection_keys(
    score: torch.Tensor, valid: torch.Tensor, protect: torch.Tensor | None = None,
    usable: torch.Tensor | None = None,
) -> torch.Tensor:
    """The key each slot is ranked by: its score; +max when protected or not usable; -max when free.

    Args:
        score: `[..., S]`; valid: `[..., S]` bool (False = free or padding); protect: `[..., S]`
            bool or None (a protected free slot is still free); usable: bool, broadcastable to
            `[..., S]`, False for slots a KV head may never hold (per-head capacities), or None.

    Free slots are written with `torch.where` rather than `masked_fill(~valid)`: one kernel
    instead of two, which counts in a decode step that runs it in every layer.
    """
    lowest, highest = _extremes(score.dtype)
    key = score if protect is None else score.masked_fill(protect, highest)
    key = torch.where(valid, key, lowest)
    if usable is not None:
        key = key.masked_fill(~usable, highest)
    return key


def choose_next(
    score: torch.Tensor, valid: torch.Tensor, protect: torch.Tensor | None = None,
    usable: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[..., S]` -> `[...]` int64: the lowest free slot, else the unprotected slot of lowest score.

    `torch.argmin` returns the first of tied minima, so among free slots the lowest index wins.
    """
    return selection_keys(score, valid, protect, usable).argmin(dim=-1)


def choose_keep(
    score: torch.Tensor, valid: torch.Tensor, count: int, protect: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[..., S]` -> `[..., count]` int64: the slots kept by a compression, best first.

    Protected valid slots rank above every score, free slots below every score: a compression
    keeps the protected slots, then the `count - |protected|` best scored; among equal keys the
    higher slot index first. Callers that need the kept slots in position or slot order sort the
    result.

    Ties are broken by index, not left to `topk`, whose order among equal keys changes with S: a
    prompt cut keeps SnapKV's whole observation window (+inf) when it fits, and when it does not,
    the tokens dropped from it would otherwise depend on how far the batch pads the prompt.
    """
    key = selection_keys(score, valid, protect)
    order = key.flip(-1).sort(dim=-1, descending=True, stable=True).indices[..., :count]
    return key.shape[-1] - 1 - order


def first_free(valid: torch.Tensor, usable: torch.Tensor | None = None) -> torch.Tensor:
    """`[..., S]` bool -> `[...]` int64: the lowest free slot (0 when none is free)."""
    free = ~valid if usable is None else ~valid & usable
    return free.to(torch.uint8).argmax(dim=-1)


def chosen_mask(chosen: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """chosen `[..., n]` slot indices, valid `[..., S]` bool -> `[..., S]` bool: the chosen slots that are valid."""
    return torch.zeros_like(valid).scatter_(-1, chosen, True) & valid


def sink_mask(positions: torch.Tensor, count: int) -> torch.Tensor:
    """`[..., S]` positions -> bool: the attention sinks, the first `count` positions, never evicted.

    Free slots (position -1) come out True too, which every use allows (a protected free slot is
    still free, and the first chosen): one comparison, in a decode step that runs it per layer.
    """
    return positions < count
