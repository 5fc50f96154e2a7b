"""The slot cache of one generation batch: static per-layer K/V buffers and the per-slot state of a method.

Every method keeps its cache here, allocated once per batch and written in place by explicit slot
index, as in gpt-fast's `KVCache`: a decode step never concatenates or gathers, its shapes never
change, and it does not synchronise with the host, so it can be captured in a CUDA graph. The
cache owns the writes (a decode token into the slot chosen at the previous step, the kept prompt
tokens at prefill), the compaction of interval methods, per-row reset and the peak count; methods
own only the choice of slots (`longflow.selection`).

Per-slot state (`SlotState`: H2O's accumulated attention, VATP's value norms, AMS's credit, ...)
lives beside the buffers `[B, Hkv, S]` and follows the slot: it is set when a slot is written,
moved when slots are compacted and cleared when a slot or a row is freed.

Capacities: every layer has its own number of slots (`capacities`), and a layer's KV heads may
hold fewer slots than the layer (`head_capacities`): head h never uses slots >= its capacity
(`LayerSlots.usable`).

Notation: B batch, Hkv KV heads, S slots of a layer, D head dim, n rows or kept slots.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from longflow.kernels import compact_in_place, write_token
from longflow.selection import first_free


@dataclass(frozen=True)
class SlotState:
    """One per-slot tensor of a method, `[B, Hkv, S]`.

    `fill`: the value of a free slot, and of a written one when `on_write` is None. `on_write`:
    the value of written slots from their values, `[..., n, D] -> [..., n]` (VATP's norms).
    `on_prompt`: the value of the prompt tokens kept at prefill, from the layer's prompt
    (`longflow.policy.PromptObservation` -> `[B, Hkv, L]`; H2O's attention received from the
    prompt's queries), instead of `on_write`'s. Module-level functions, not bound methods: the cache
    that holds them belongs to the policy, and a reference back would keep a batch's buffers alive.
    """

    dtype: torch.dtype = torch.float32
    fill: float = 0.0
    on_write: Callable[[torch.Tensor], torch.Tensor] | None = None
    on_prompt: Callable[[Any], torch.Tensor] | None = None



def held_prompt(prompt) -> torch.Tensor:
    """`SlotState.on_prompt` of `prompt_mark`: every real prompt token, `[B, Hkv, L]` bool."""
    return prompt.valid


def prompt_mark() -> SlotState:
    """A per-slot bool: the slot holds a prompt token (set at prefill; a decode write clears it)."""
    return SlotState(dtype=torch.bool, fill=False, on_prompt=held_prompt)

class LayerSlots:
    """Static buffers of one layer.

    keys, values: `[B, Hkv, S, D]`; valid: `[B, Hkv, S]` bool (False = free or padding);
    positions: `[B, Hkv, S]` int64, the token position held by each slot (-1 when free);
    state: name -> `[B, Hkv, S]`; usable: `[Hkv, S]` bool, False beyond a KV head's capacity, or
    None when every head may use every slot. Methods with one shared selection per layer keep all
    heads of `valid` and `positions` equal.
    """

    def __init__(self, batch: int, kv_heads: int, slots: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, states: Mapping[str, SlotState], head_capacities: list[int] | None):
        shape = (batch, kv_heads, slots)
        self.keys = torch.zeros(*shape, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.valid = torch.zeros(shape, dtype=torch.bool, device=device)
        self.positions = torch.full(shape, -1, dtype=torch.long, device=device)
        self.state = {name: torch.full(shape, spec.fill, dtype=spec.dtype, device=device)
                      for name, spec in states.items()}
        self.usable = None
        if head_capacities is not None:
            limits = torch.tensor(head_capacities, device=device)
            self.usable = torch.arange(slots, device=device) < limits[:, None]  # [Hkv, S]

    @property
    def slots(self) -> int:
        return self.keys.shape[2]


class SlotCache:
    """The K/V slots of every layer of one batch, the slot each layer writes next, and the peak held.

    next_slot: per layer `[B, Hkv]` int64, the slot the next decode token overwrites (methods set
    it in place during the step); peak: `[B]` int64, the most slots a row held in any layer and head.
    """

    def __init__(self, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 capacities: list[int], head_capacities: list[list[int] | None] | None = None,
                 states: Mapping[str, SlotState] | None = None):
        self.states = dict(states or {})
        heads = head_capacities or [None] * len(capacities)
        self.layers = [LayerSlots(batch, kv_heads, slots, head_dim, dtype, device, self.states, caps)
                       for slots, caps in zip(capacities, heads, strict=True)]
        self.next_slot = [torch.zeros(batch, kv_heads, dtype=torch.long, device=device) for _ in capacities]
        self.peak = torch.zeros(batch, dtype=torch.long, device=device)

    # ---- writes --------------------------------------------------------------------------------

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
              advance: bool = False, find_free: bool = False) -> None:
        """A decode token into `next_slot[layer]`: k, v `[B, Hkv, 1, D]`, positions `[B]`. Static, no sync.

        `advance`: then the next slot is the following one, at most the last (a cache filled in
        order, whose method has nothing to choose); `find_free`: the lowest free slot (`first_free`,
        an interval method's between its compressions).
        """
        slots = self.layers[layer]
        index = self.next_slot[layer]  # [B, Hkv]
        for name, spec in self.states.items():  # before `advance` moves the index
            value = spec.fill if spec.on_write is None else spec.on_write(v).to(spec.dtype)
            slots.state[name].scatter_(2, index[..., None], value)
        if k.is_cuda and k.stride(-1) == 1 and v.stride(-1) == 1:
            # One kernel for the four writes below (launches, not bytes, are their cost); CUDA
            # implies Linux, where Triton is installed.
            write_token(slots.keys, slots.values, slots.valid, slots.positions, index, k, v, positions, advance,
                        find_free, slots.usable)
        else:
            batch, kv_heads, _, head_dim = k.shape
            where = index[..., None, None].expand(batch, kv_heads, 1, head_dim)
            slots.keys.scatter_(2, where, k)
            slots.values.scatter_(2, where, v)
            slots.valid.scatter_(2, index[..., None], True)
            slots.positions.scatter_(2, index[..., None], positions[:, None, None].expand(-1, kv_heads, 1))
            if advance:
                torch.clamp(index + 1, max=slots.slots - 1, out=index)
            elif find_free:
                index.copy_(first_free(slots.valid, slots.usable))

    def store_prompt(self, layer: int, k: torch.Tensor, v: torch.Tensor, kept: torch.Tensor | int,
                     pad: torch.Tensor, positions: torch.Tensor) -> None:
        """The kept prompt tokens into slots 0..n-1 of `layer`, in the order of `kept`.

        Args:
            k, v: `[B, Hkv, L, D]` over the left-padded prompt; pad: `[B, L]` bool (True = real
                token); positions: `[B, L]` int64.
            kept: `[B, Hkv, n]` indices into L (L itself: no token, the slot stays free), or an int n
                for the last n prompt tokens.

        Padding among the kept tokens is stored as free slots; slots from n on stay free. The
        next slot is the first free one.
        """
        slots = self.layers[layer]
        batch, kv_heads, length, head_dim = k.shape
        stored = None
        if isinstance(kept, int):
            count = kept
            slots.keys[:, :, :count] = k[:, :, length - count:]
            slots.values[:, :, :count] = v[:, :, length - count:]
            kept = torch.arange(length - count, length, device=k.device).expand(batch, kv_heads, count)
        else:
            count = kept.shape[-1]
            stored = kept < length
            kept = kept.clamp(max=length - 1)
            gather = kept[..., None].expand(-1, -1, -1, head_dim)
            slots.keys[:, :, :count] = k.gather(2, gather)
            slots.values[:, :, :count] = v.gather(2, gather)
        valid = pad[:, None, :].expand(batch, kv_heads, length).gather(2, kept)
        if stored is not None:
            valid = valid & stored
        slots.valid[:, :, :count] = valid
        held = positions[:, None, :].expand(batch, kv_heads, length).gather(2, kept)
        slots.positions[:, :, :count] = held.masked_fill(~valid, -1)
        for name, spec in self.states.items():
            if spec.on_write is not None:
                slots.state[name][:, :, :count] = spec.on_write(slots.values[:, :, :count]).to(spec.dtype)
        self.next_slot[layer].copy_(first_free(slots.valid, slots.usable))

    @torch.no_grad()  # a move within the buffers; a forward run with gradients on may have stored into them
    def compact(self, layer: int, rows: torch.Tensor | None, keep: torch.Tensor,
                rank: torch.Tensor | None = None) -> None:
        """Move the kept slots of `rows` to the low slots and free the rest; the next slot is the first free.

        Args:
            rows: `[n]` row indices, or None for every row.
            keep: `[n, Hkv, S]` bool, the slots kept.
            rank: `[n, Hkv, S]`, the order of the kept slots (ascending, stable); their positions when None.

        K and V, the bytes that count: on the GPU, in position order (`rank` None), one kernel moves
        each kept slot down in place (`compact_in_place`). Its premise, that a kept slot never moves
        up, is that the held slots are in position order, as every interval method's are (prefill
        stores the prompt so, decode appends to the first free slot);
        `tests/test_interval_compression.py::test_kept_slots_never_move_up` checks it for each of
        them. Otherwise two passes when every row is cut (a gather of the kept slots, then the write
        back with the freed ones zeroed: a move within one buffer needs a copy), three for some rows
        (the rows' kept slots by one indexing read, the zeroing, the write into the rows). Freed
        slots are zeroed, their state set to its fill.
        """
        slots = self.layers[layer]

        def select(tensor):
            return tensor if rows is None else tensor.index_select(0, rows)

        positions = select(slots.positions)
        key = positions if rank is None else rank
        order = torch.where(keep, key, torch.iinfo(torch.long).max).argsort(dim=-1, stable=True)  # [n, Hkv, S]
        kept = keep.gather(-1, order)
        if rank is None and slots.keys.is_cuda:
            compact_in_place(slots.keys, slots.values, order, kept, rows)
        elif rows is None:
            gather = order[..., None].expand(-1, -1, -1, slots.keys.shape[-1])
            for buffer in (slots.keys, slots.values):
                torch.where(kept[..., None], buffer.gather(2, gather), buffer.new_zeros(()), out=buffer)
        else:
            # One indexing read of the rows' kept slots instead of a row copy and a gather.
            heads = torch.arange(order.shape[1], device=order.device)[None, :, None]
            for buffer in (slots.keys, slots.values):
                moved = buffer[rows[:, None, None], heads, order]  # [n, Hkv, S, D]
                buffer.index_copy_(0, rows, moved.masked_fill_(~kept[..., None], 0.0))
        self._assign(slots.valid, rows, kept)
        self._assign(slots.positions, rows, positions.gather(-1, order).masked_fill(~kept, -1))
        for name, spec in self.states.items():
            state = slots.state[name]
            self._assign(state, rows, select(state).gather(-1, order).masked_fill(~kept, spec.fill))
        self.next_slot[layer].copy_(first_free(slots.valid, slots.usable))

    @staticmethod
    def _assign(target: torch.Tensor, rows: torch.Tensor | None, value: torch.Tensor) -> None:
        if rows is None:
            target.copy_(value)
        else:
            target.index_copy_(0, rows, value)

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Free every slot of `rows` (`[n]` indices) in every layer, and their peak: the rows can take a
        new sequence (continuous batching)."""
        for layer, slots in enumerate(self.layers):
            slots.keys.index_fill_(0, rows, 0.0)
            slots.values.index_fill_(0, rows, 0.0)
            slots.valid.index_fill_(0, rows, False)
            slots.positions.index_fill_(0, rows, -1)
            for name, spec in self.states.items():
                slots.state[name].index_fill_(0, rows, spec.fill)
            self.next_slot[layer].index_fill_(0, rows, 0)
        self.peak.index_fill_(0, rows, 0)

    def adopt(self, rows: torch.Tensor, other: SlotCache) -> None:
        """Rows `[n]` take the n rows of `other` (same capacities): buffers, state, next slots and peaks."""
        if [layer.keys.shape[1:] for layer in self.layers] != [layer.keys.shape[1:] for layer in other.layers]:
            raise ValueError("adopt needs a slot cache of the same layer capacities")
        for mine, theirs, next_mine, next_theirs in zip(self.layers, other.layers, self.next_slot, other.next_slot,
                                                        strict=True):
            for name in ("keys", "values", "valid", "positions"):
                getattr(mine, name).index_copy_(0, rows, getattr(theirs, name))
            for name in self.states:
                mine.state[name].index_copy_(0, rows, theirs.state[name])
            next_mine.index_copy_(0, rows, next_theirs)
        self.peak.index_copy_(0, rows, other.peak)

    # ---- the peak --------------------------------------------------------------------------------

    def record_peak(self, layers: list[int] | None = None) -> None:
        """Fold the slots held now in `layers` (default: all), per row over heads, into the peak.

        A store fills a free slot or overwrites one, so the count never falls while decoding:
        its peak is the count at the end or just before a method frees slots. Methods that free
        slots (compressions) call this first; the decode step itself stays free of the reduction.
        """
        for slots in self.layers if layers is None else [self.layers[i] for i in layers]:
            held = slots.valid.sum(dim=-1).amax(dim=-1)  # [B]
            torch.maximum(self.peak, held, out=self.peak)

    def peak_slots(self) -> list[int]:
        """Peak KV slots held per sequence, over all layers and heads, so far (syncs the host)."""
        self.record_peak()
        return self.peak.tolist()
