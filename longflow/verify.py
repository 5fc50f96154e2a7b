"""VeriCache (Yao et al. 2026, arXiv 2605.17613): lossless greedy decoding over any compressed cache.

The run's method keeps its compressed cache as in ordinary decoding and drafts with it; a full
cache kept beside it verifies. One round, per row, from the invariant that both caches hold every
committed token but the last one, t0 (the next step's input):

1. snapshot the compressed cache's per-row state (`RowState`);
2. draft h greedy tokens d_1..d_h through the ordinary decode step (inputs t0, d_1..d_{h-1});
3. one forward of the h + 1 tokens [t0, d_1..d_h] over the full cache (`FullCache`, causal within
   the block), which writes their K/V there; v_1..v_{h+1} are its greedy tokens;
4. a = the longest prefix with d_j = v_j; the row commits v_1..v_{a+1} (= d_1..d_a and the full
   cache's token at the first mismatch, or the bonus token when a = h), cut at EOS and at its limit;
5. the full cache keeps t0, d_1..d_a (its length moves on by a + 1; the rest is invalidated);
6. the compressed cache is brought back in step: a row with a = h holds t0, d_1..d_{h-1} already
   and appends d_h (one replay step); any other row is restored to the snapshot and replays
   t0, d_1..d_a (a + 1 steps) through the ordinary step. Replay outputs are ignored.

Every committed token is the full cache's greedy token at its position, so the output is vanilla
greedy decoding's whatever the method (up to the numerics of a multi-token forward against
single-token ones). Rows advance independently: each has its own a, position and lengths.

Notation: B batch (rows), h horizon, Lq = h + 1, S slots, Hq/Hkv query/KV heads, D head dim.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from longflow.policy import ALIGN, CacheSpec, KVPolicy, round_up


@dataclass(eq=False)
class FullCache(KVPolicy):
    """Every token of every row, in position order: the left-padded prompt in slots 0..L-1, output
    token t in slot L + t (as the full cache, `baselines.vanilla`), with room for one block of
    `horizon` + 1 verified tokens past the longest output.

    At decode a forward is one verify block: `store` writes its Lq tokens at each row's length
    (`next_slot`, every head equal) with the positions of `block_positions` `[B, Lq]`, and `attend`
    lets query j of a row see the slots of positions up to its own. `commit` then keeps a prefix of
    each row's block. `host`: the buffers live in host memory (pinned when the model is on a GPU)
    and each layer's are copied to the device for the block's attention (`transfer_seconds`).
    """

    horizon: int = 1
    host: bool = False

    name = "full_cache"
    uses_budget = False

    def __post_init__(self):
        self.budget = None
        super().__post_init__()

    def capacity(self, spec: CacheSpec) -> int:
        # The last committed token is never stored, and a block starts at most at L + T - 2.
        return round_up(spec.prompt_len + spec.max_new_tokens + self.horizon, ALIGN)

    def prefill_keep(self, spec: CacheSpec) -> int:
        return spec.prompt_len

    def compresses_within(self, prompt_tokens: int, total_tokens: int, spec: CacheSpec) -> bool:
        return False

    def allocate(self, spec: CacheSpec) -> None:
        device = spec.device
        if self.host:
            spec = CacheSpec(**{**spec.__dict__, "device": torch.device("cpu")})
        super().allocate(spec)
        self.device = device
        self.block_positions = torch.zeros(spec.batch, self.horizon + 1, dtype=torch.long, device=device)
        self.transfer_seconds = 0.0
        self.staging: list[torch.Tensor] | None = None  # `host`: the device copy of the layer being verified
        if self.host and device.type == "cuda":
            for slots in self.layers:
                slots.keys, slots.values = slots.keys.pin_memory(), slots.values.pin_memory()

    def on_prompt_stored(self, layer: int, kept: torch.Tensor, scores: torch.Tensor | None) -> None:
        self.next_slot[layer].fill_(kept.shape[-1])

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v `[B, Hkv, Lq, D]`: the block into slots next_slot .. next_slot + Lq - 1 of each row."""
        if self.prefilling:
            return k, v
        slots = self.layers[layer]
        keys, values, valid, positions = self.working(layer)
        batch, kv_heads, length, head_dim = k.shape
        index = (self.next_slot[layer][:, :1].to(k.device) + torch.arange(length, device=k.device))  # [B, Lq]
        heads = index[:, None, :].expand(batch, kv_heads, length)
        keys.scatter_(2, heads[..., None].expand(-1, -1, -1, head_dim), k)
        values.scatter_(2, heads[..., None].expand(-1, -1, -1, head_dim), v)
        valid.scatter_(2, heads, True)
        positions.scatter_(2, heads, self.block_positions[:, None, :].expand(batch, kv_heads, length))
        if self.host:  # the block goes back to the host buffers too
            host = heads.to("cpu")
            for mine, theirs in ((slots.keys, k), (slots.values, v)):
                mine.scatter_(2, host[..., None].expand(-1, -1, -1, head_dim), theirs.to("cpu"))
            slots.valid.scatter_(2, host, True)
            slots.positions.scatter_(2, host, self.block_positions.to("cpu")[:, None, :].expand(-1, kv_heads, -1))
        return keys, values

    def working(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The layer's keys, values, valid and positions on the model's device: the buffers
        themselves, or (`host`) copies of them into one staging set shared by the layers."""
        slots = self.layers[layer]
        if not self.host:
            return slots.keys, slots.values, slots.valid, slots.positions
        start = time.perf_counter()
        if self.staging is None or self.staging[0].shape != slots.keys.shape:
            self.staging = [torch.empty_like(tensor, device=self.device)
                            for tensor in (slots.keys, slots.values, slots.valid, slots.positions)]
        for target, source in zip(self.staging, (slots.keys, slots.values, slots.valid, slots.positions),
                                  strict=True):
            target.copy_(source, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.transfer_seconds += time.perf_counter() - start
        return tuple(self.staging)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q `[B, Hq, Lq, D]` over the block's layer (k, v: what `store` returned) -> `[B, Lq, Hq, D]`."""
        if self.prefilling:
            return super().attend(layer, q, k, v, scale)
        _, _, valid, positions = self.staging if self.host else self.working(layer)
        return block_attention(q, k, v, valid[:, 0], positions[:, 0], self.block_positions, scale)

    def commit(self, advance: torch.Tensor) -> None:
        """Each row keeps the first `advance[b]` `[B]` tokens of its block; the rest are freed."""
        for layer, slots in enumerate(self.layers):
            next_slot = self.next_slot[layer]
            next_slot += advance.to(next_slot.device)[:, None]
            kept = torch.arange(slots.slots, device=next_slot.device) < next_slot[:, :, None]  # [B, Hkv, S]
            slots.valid &= kept
            slots.positions.masked_fill_(~kept, -1)


def block_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor,
                    positions: torch.Tensor, query_positions: torch.Tensor, scale: float,
                    fused: bool | None = None) -> torch.Tensor:
    """Attention of a block of queries over position-ordered slots, causal by position.

    q: `[B, Hq, Lq, D]`; keys, values: `[B, Hkv, S, D]`; valid, positions: `[B, S]` (every head
    equal); query_positions: `[B, Lq]`. Query j sees the valid slots whose position is at most its
    own. Returns `[B, Lq, Hq, D]`. `fused` (default: on CUDA) SDPA with the mask; otherwise the two
    matmuls of `longflow.attention.decode_attention`, the full cache's decode attention on the CPU, so
    that the numerics match it there.
    """
    batch, q_heads, length, head_dim = q.shape
    kv_heads = keys.shape[1]
    seen = valid[:, None, :] & (positions[:, None, :] <= query_positions[:, :, None])  # [B, Lq, S]
    if q.is_cuda if fused is None else fused:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=seen[:, None], scale=scale, enable_gqa=True)
        return out.transpose(1, 2)
    group = q_heads // kv_heads
    grouped = q.reshape(batch, kv_heads, group * length, head_dim)
    logits = torch.matmul(grouped, keys.transpose(-1, -2)).float() * scale  # [B, Hkv, G * Lq, S]
    mask = seen[:, None, None].expand(batch, kv_heads, group, length, -1).reshape(batch, kv_heads, group * length, -1)
    probs = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
    out = torch.matmul(probs.to(values.dtype), values)  # [B, Hkv, G * Lq, D]
    return out.view(batch, q_heads, length, head_dim).transpose(1, 2)


# ---- the compressed cache's per-row state --------------------------------------------------------


class RowState:
    """Every per-row piece of a policy's batch state, found by walking everything the policy holds
    (its fields, its `BatchState`, and every list, dict and object under them, at any depth):

    - tensors whose first dimension is the batch (the slot buffers and their per-slot states, the
      next slots, the peak, the query rings, a method's own buffers);
    - host lists of one number per row (interval counts), wherever they sit: a field, or an entry
      of a list or dict (CompressKV's per-layer counts are a list of such lists).

    A method declares nothing, but its host state must take one of these forms: whatever else it
    holds on the host (numbers, strings, and containers of them) is taken to be shared by the rows,
    and `check_shared` raises when a round changed it, since no row could be rolled back through it
    (a count of the whole batch, a per-row count in another form). A tensor that only looks per-row
    (its first dimension happens to equal the batch) is restored to values it never changed; so is
    a host list that only looks per-row.

    `save` copies all of them into preallocated buffers (the host lists into lists); `save_rows`
    and `restore_rows` copy some rows, in place (the CUDA graph of the decode step keeps reading the
    same tensors). The host lists are reached by their path from the policy at every call, as a
    method may replace a list with a new one as it decodes.
    """

    def __init__(self, policy: KVPolicy, batch: int):
        self.policy, self.batch = policy, batch
        self.tensors: list[tuple[Any, Any]] = []  # (owner, key) of each per-row tensor
        storages: set[tuple] = set()
        for _, owner, key, value in self._walk():
            if isinstance(value, torch.Tensor):
                ident = (value.data_ptr(), tuple(value.shape))
                if value.dim() and value.shape[0] == batch and ident not in storages and not expanded(value):
                    storages.add(ident)
                    self.tensors.append((owner, key))
        self.saved_tensors = [self._get(owner, key).clone() for owner, key in self.tensors]
        self.save_host()

    @staticmethod
    def _get(owner, key):
        return owner[key] if isinstance(owner, (list, tuple, dict)) else getattr(owner, key)

    def _per_row(self, value) -> bool:
        return isinstance(value, list) and len(value) == self.batch and set(map(type, value)) <= ROW_NUMBERS

    def _walk(self, node=None, path: tuple = (), seen: set[int] | None = None):
        """(path, owner, key, value) of everything the policy reaches, depth first, each object once
        (by its first path). A path is the steps from the policy: a field name, or a list, tuple or
        dict key as a 1-tuple. Entered: lists, tuples, dicts, and objects other than tensors,
        modules, classes and callables; a per-row host list is not."""
        node, seen = (self.policy, {id(self.policy)}) if node is None else (node, seen)
        if isinstance(node, (list, tuple)):
            items, item = list(enumerate(node)), True
        elif isinstance(node, dict):
            items, item = list(node.items()), True
        else:
            items, item = list(vars(node).items()), False
        for key, value in items:
            if not isinstance(value, SHARED_VALUES):
                if id(value) in seen:
                    continue
                seen.add(id(value))
            step = path + ((key,) if item else key,)
            yield step, node, key, value
            if isinstance(value, (list, tuple, dict)) and not self._per_row(value) or (
                    hasattr(value, "__dict__") and not isinstance(value, NOT_ENTERED)):
                yield from self._walk(value, step, seen)

    def resolve(self, path: tuple):
        """The value at `path` from the policy (see `_walk`)."""
        node = self.policy
        for step in path:
            node = node[step[0]] if isinstance(step, tuple) else getattr(node, step)
        return node

    def host_state(self) -> tuple[list[tuple], dict[tuple, Any]]:
        """(the path of each per-row host list, {path: value} of every other host value)."""
        lists, shared = [], {}
        for path, _, _, value in self._walk():
            if self._per_row(value):
                lists.append(path)
            elif isinstance(value, SHARED_VALUES):
                shared[path] = value
        return lists, shared

    def save(self) -> None:
        for (owner, key), saved in zip(self.tensors, self.saved_tensors, strict=True):
            saved.copy_(self._get(owner, key))
        self.save_host()

    def save_host(self) -> None:
        """The host side of `save`: the per-row host lists, found again (a method may have made new
        ones since), copied; the shared host state noted for `check_shared`."""
        self.lists, self.shared = self.host_state()
        self.saved_lists = [list(self.resolve(path)) for path in self.lists]

    def check_shared(self) -> None:
        """Raises RuntimeError if the host state outside the per-row lists changed since `save`."""
        _, now = self.host_state()
        changed = sorted((path for path in now.keys() | self.shared.keys() if now.get(path) != self.shared.get(path)),
                         key=path_name)
        if changed:
            raise RuntimeError(
                f"{self.policy.name}: host state {', '.join(map(path_name, changed))} changed in a verify round, "
                "but is not one number per row: VeriCache cannot roll it back per row. Keep a row's host state in a "
                "list of one number per row (a field, or an entry of lists or dicts), or in a tensor whose first "
                "dimension is the batch")

    def save_rows(self, rows: list[int]) -> None:
        self._copy_rows(rows, to_saved=True)

    def restore_rows(self, rows: list[int]) -> None:
        self._copy_rows(rows, to_saved=False)

    def _copy_rows(self, rows: list[int], to_saved: bool) -> None:
        if not rows:
            return
        indices: dict[torch.device, torch.Tensor] = {}
        for (owner, key), saved in zip(self.tensors, self.saved_tensors, strict=True):
            live = self._get(owner, key)
            if live.device not in indices:
                indices[live.device] = torch.tensor(rows, dtype=torch.long, device=live.device)
            index = indices[live.device]
            source, target = (live, saved) if to_saved else (saved, live)
            target.index_copy_(0, index, source.index_select(0, index))
        for path, saved in zip(self.lists, self.saved_lists, strict=True):
            live = self.resolve(path)
            source, target = (live, saved) if to_saved else (saved, live)
            for row in rows:
                target[row] = source[row]


# The types of a per-row host list's entries (`IDLE`, a released row's count, is a float).
ROW_NUMBERS = {int, float, bool}
# The host values `RowState.check_shared` compares (containers of them are walked into).
SHARED_VALUES = (bool, int, float, str, type(None), torch.dtype, torch.device)
# Objects `RowState` does not walk into: a tensor is state itself; a model, a class or a function
# (the rotary embedding) is no batch's state.
NOT_ENTERED = (torch.Tensor, torch.nn.Module, type, Callable)


def path_name(path: tuple) -> str:
    """A `RowState` path as code would write it from the policy: `batch.held`, `layer_held[1]`."""
    return "".join(f"[{step[0]!r}]" if isinstance(step, tuple) else f".{step}" for step in path).lstrip(".")


def expanded(tensor: torch.Tensor) -> bool:
    """Whether several elements share memory (an `expand`ed view): a view of state held elsewhere."""
    return any(stride == 0 and size > 1 for stride, size in zip(tensor.stride(), tensor.shape, strict=True))


# ---- the rounds ------------------------------------------------------------------------------------


@dataclass
class RoundSeconds:
    """Where a batch's rounds spent their time: the draft and replay steps (through the ordinary
    decode step) and the verify forwards, each a list of per-call seconds, and the full cache's
    host-to-device copies (`full_cache: host`)."""

    draft: list[float]
    verify: list[float]
    replay: list[float]
    transfer: float = 0.0


class Verifier:
    """The rounds of one batch (see the module docstring), over its compressed cache `cache` and
    full cache `full` (`PolicyCache`s), and the engine's `DecodeState` `state`.

    `forward(cache, input_ids, positions) -> logits`: the engine's forward of the compressed step;
    `make_stepper(run_step, policies, cuda_graph)`: the engine's `Stepper` (hooks, CUDA graphs; the
    verify forward of a full cache in host memory copies and syncs per layer, so it runs eagerly); `eos_ids`:
    `[n]` EOS ids (None: EOS ignored). Per-row statistics, on the device: `rounds` `[B]`, the rounds
    a row was running in; `accepted` `[B, h + 1]`, how many rounds accepted a drafts; `drafted`
    `[B]`, the committed tokens that came from accepted drafts (read only the compressed cache).
    """

    def __init__(self, model, cache, full, state, horizon: int, forward: Callable, make_stepper: Callable,
                 eos_ids: torch.Tensor | None):
        self.model, self.cache, self.full, self.state = model, cache, full, state
        self.horizon, self.forward, self.eos_ids = horizon, forward, eos_ids
        batch, device = state.token.shape[0], state.token.device
        width = horizon + 1
        self.rows = RowState(cache.policy, batch)
        self.drafts = torch.zeros(batch, width, dtype=torch.long, device=device)  # t0, d_1..d_h
        self.feed = torch.zeros(batch, width, dtype=torch.long, device=device)  # replay inputs
        self.verdict = torch.zeros(batch, width, dtype=torch.long, device=device)  # v_1..v_{h+1}
        self.input = torch.zeros(batch, dtype=torch.long, device=device)
        self.column = torch.zeros(1, dtype=torch.long, device=device)  # the step's index within its phase
        self.drafting = torch.ones((), dtype=torch.bool, device=device)
        self.start = torch.zeros(batch, dtype=torch.long, device=device)
        self.offsets = torch.arange(width, device=device)
        self.rounds = torch.zeros(batch, dtype=torch.long, device=device)
        self.accepted = torch.zeros(batch, width, dtype=torch.long, device=device)
        self.drafted = torch.zeros(batch, dtype=torch.long, device=device)
        self.seconds = RoundSeconds([], [], [])
        self.step = make_stepper(self.compressed_step, (cache.policy,), True)
        self.check = make_stepper(self.verify_forward, (), not full.policy.host)

    def compressed_step(self) -> None:
        """One ordinary decode step over the compressed cache: input `input` at the state's positions.
        Drafting, its greedy token is the next input and draft; replaying, the next input is `feed`'s."""
        logits = self.forward(self.cache, self.input[:, None], self.state.positions[:, None])
        self.state.positions += 1
        token = logits.float().argmax(dim=-1)
        self.column += 1
        self.drafts.index_copy_(1, self.column.clamp(max=self.horizon), token[:, None])
        fed = self.feed.gather(1, self.column.clamp(max=self.horizon).expand(token.shape[0])[:, None])[:, 0]
        self.input.copy_(torch.where(self.drafting, token, fed))

    def verify_forward(self) -> None:
        """[t0, d_1..d_h] `[B, h + 1]` through the full cache; its greedy tokens into `verdict`."""
        positions = self.start[:, None] + self.offsets
        self.full.policy.block_positions.copy_(positions)
        output = self.model(input_ids=self.drafts, position_ids=positions, past_key_values=self.full,
                            kv_cache=self.full, use_cache=True, logits_to_keep=0)
        self.verdict.copy_(output.logits.float().argmax(dim=-1))

    def run_round(self) -> float:
        """One round for every row; returns its seconds (syncs the host once, for the replay plan)."""
        state, horizon = self.state, self.horizon
        synchronize(state.token.device)
        begin = time.perf_counter()
        running = ~state.finished
        self.rows.save()
        self.start.copy_(state.positions)
        self.drafts[:, 0] = state.token
        self.input.copy_(state.token)
        self.column.zero_()
        self.drafting.fill_(True)
        self.seconds.draft += self.step.run(horizon)
        self.seconds.verify += self.check.run(1)

        match = (self.drafts[:, 1:] == self.verdict[:, :horizon]).long().cumprod(dim=-1)
        accepted = match.sum(dim=-1)  # [B], a
        committed = self.commit(accepted, running)
        going = running & ~state.finished
        self.full.policy.commit(torch.where(going, accepted + 1, 0))
        self.rounds += running
        self.accepted.scatter_add_(1, accepted[:, None], running.long()[:, None])
        self.drafted += torch.where(running, torch.minimum(accepted, committed), 0)

        # The replay plan, on the host: r = 1 (append d_h), a + 1 (restore, replay), 0 (restore only).
        whole = going & (accepted == horizon)
        replays = torch.where(whole, 1, torch.where(going, accepted + 1, 0)).tolist()
        restored = [row for row, (ok, r) in enumerate(zip(whole.tolist(), replays, strict=True)) if not ok]
        self.rows.restore_rows(restored)
        self.feed.copy_(torch.where(whole[:, None] & (self.offsets == 0), self.drafts[:, horizon:], self.drafts))
        self.input.copy_(self.feed[:, 0])
        self.column.zero_()
        self.drafting.fill_(False)
        longest = max(replays)
        for step in range(longest):
            self.seconds.replay += self.step.run(1)
            self.rows.save_rows([row for row, r in enumerate(replays) if r == step + 1 < longest])
        self.rows.restore_rows([row for row, r in enumerate(replays) if r < longest])
        self.rows.check_shared()
        state.positions.copy_(torch.where(going, self.start + accepted + 1, self.start))
        self.seconds.transfer = getattr(self.full.policy, "transfer_seconds", 0.0)
        synchronize(state.token.device)
        return time.perf_counter() - begin

    def commit(self, accepted: torch.Tensor, running: torch.Tensor) -> torch.Tensor:
        """Each running row's next tokens v_1..v_{a+1} into the output, up to its first EOS and its
        limit; updates step, token and finished as `Engine.emit` does. Returns the counts `[B]`."""
        state, verdict = self.state, self.verdict
        take = (self.offsets <= accepted[:, None]) & (self.offsets < (state.limit - state.step)[:, None])
        take &= running[:, None]
        if self.eos_ids is not None:
            eos = torch.isin(verdict, self.eos_ids) & take
            first = torch.where(eos.any(dim=-1), eos.long().argmax(dim=-1), self.horizon + 1)
            take &= self.offsets <= first[:, None]
        count = take.sum(dim=-1)
        columns = torch.where(take, state.step[:, None] + self.offsets, state.out.shape[1] - 1)
        state.out.scatter_(1, columns, torch.where(take, verdict, state.out.gather(1, columns)))
        last = verdict.gather(1, (count - 1).clamp(min=0)[:, None])[:, 0]
        state.token.copy_(torch.where(count > 0, last, state.token))
        state.step += count
        if self.eos_ids is not None:
            state.finished |= (torch.isin(verdict, self.eos_ids) & take).any(dim=-1)
        state.finished |= state.step >= state.limit
        return count

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Rows `[n]` start a new sequence (continuous batching): their statistics restart."""
        for stat in (self.rounds, self.accepted, self.drafted):
            stat.index_fill_(0, rows, 0)

    def row_stats(self, rows: list[int] | None = None) -> list[dict[str, Any]]:
        """Each row's (or `rows`') statistics: verify rounds, accepted drafts per round as a histogram
        over 0..h, and the committed tokens that came from accepted drafts (syncs the host)."""
        rounds, accepted, drafted = self.rounds.tolist(), self.accepted.tolist(), self.drafted.tolist()
        return [{"verify_rounds": rounds[row], "accepted_histogram": accepted[row], "drafted_tokens": drafted[row]}
                for row in (range(len(rounds)) if rows is None else rows)]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
