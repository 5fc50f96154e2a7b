"""The KV-policy interface: a method scores its slots, this base class does everything else.

A method is a `KVPolicy` subclass (a dataclass whose fields are its config, checked once in
`__post_init__`) that writes `score(obs)`: per-slot scores `[B, Hkv, S]`, higher = keep, from an
`Observation` of one layer (its slots, the step's attention, the recent queries, the per-slot
state it declared). It may also say what it protects (`protected`), how it compresses a prompt
longer than its budget (the `prefill` field: SnapKV or its own score; or a `prefill_scores` of its
own) and which per-slot state it keeps (`slot_state`). Its `schedule` says when it runs:

- `step`: every decode step, per layer: the step's attention, then the next slot is chosen by the
  one rule of `longflow.selection` (free slots first, protected last, lowest score);
- `interval`: the cache fills its free slots; when a row is full (after the step that fills it)
  every layer of that row is cut to `keep_after` slots, kept by the same rule (`compress`), and
  compacted in position order.

The base class owns the slot cache (`longflow.slots.SlotCache`), the query history
(`longflow.history`), prompt compression, the budget's capacities and the peak count. A step
method whose score is a function of the step's probabilities and per-slot state may declare it as
an epilogue of the fused decode kernel (`fused_score`: H2O, VATP, TOVA); `decode` then runs that
kernel, which also chooses the next slot. Methods that fuse the whole decode attention otherwise
override `decode` (LongFlow's kernel returns the next slot itself; the full cache appends).

Call order, driven by the engine (`longflow.engine`) through `PolicyCache` and the `kv_policy`
attention function (`longflow.cache`):

    allocate(spec)                        once per batch: a fresh `BatchState`
    begin_prefill(pad, positions)         host, before the prompt forward
      per layer: store(...) then attend(...), which stores the kept prompt tokens
                                          (prefill_scores when the prompt is cut, then
                                          on_prompt_stored(layer, kept, scores))
      observe(logits, hidden_states)      after the forward, for policies that ask (`observes`)
    begin_decode(positions)               host, once; `positions` is the engine's static tensor
      before_step(step)                   host, before each step: True if the step must run eagerly
      per step, per layer: store(...) then attend(...); then observe(...)
      after_step(step)                    host, between steps (interval methods compress here);
                                          `positions` already holds the next step's positions
                                          (a compression's `Observation.newest` is `written(rows)`)

Continuous batching (`Engine.serve`) allocates one policy for its rows and calls
`begin_serving(positions)` instead of prefilling it; between steps, `admit(rows, staged)` copies in
sequences that a second policy of the same config (`staged`) has just prefilled, and `release(rows)`
frees rows left without work. A method whose state lives in the slot cache, the query history and
the interval count needs nothing more; one that keeps other per-row state extends `admit`.

Notation: B batch, Hq query heads, Hkv KV heads, G = Hq / Hkv, S slots, L padded prompt length,
D head dim, n rows.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from longflow.attention import decode_attention, masked_decode_attention, prefill_attention, window_probs
from longflow.errors import UserError
from longflow.history import QueryHistory
from longflow.kernels import flash_decode, scored_attention
from longflow.selection import choose_keep, choose_next, chosen_mask, selection_keys
from longflow.slots import LayerSlots, SlotCache, SlotState
from longflow.snapkv import snapkv_scores

# Slot and prompt lengths are kept multiples of ALIGN where the engine chooses them: rows of bf16
# matmul operands and SDPA masks whose length is not a multiple of 8 elements lose 16-byte alignment,
# and the GPU falls back to kernels 2-3x slower.
ALIGN = 16
SCHEDULES = ("step", "interval")
# The slot count of a released row (continuous batching): it never reaches a capacity, so an interval
# method never compresses a row that decodes padding.
IDLE = float("-inf")
BUDGET_SCOPES = ("per_layer", "total")
OBSERVABLE = frozenset({"logits", "prompt_logits", "hidden_states"})
# The variants of the methods the LongFlow authors ran (a method's `variant` field): `paper`, the method as
# its paper and official code define it; `lf_repo`, as the authors' baseline code runs it (docs/methods.md).
VARIANTS = ("paper", "lf_repo")
# How a prompt longer than the budget is cut, for a method without a prompt rule of its own (`KVPolicy.prefill`).
PREFILL_RULES = ("snapkv", "by_score")
# The hooks that decide what a row's cache holds and what its queries attend to. The base rule of
# `KVPolicy.compresses_within` holds for a class that keeps all of them as they are here; one that
# overrides any of them answers the question itself, or is never taken to hold the full cache.
STORAGE_HOOKS = ("capacity", "layer_capacities", "head_capacities", "prefill_keep", "held_after_prompt",
                 "allocate", "begin_prefill", "begin_decode", "begin_serving", "admit", "before_step",
                 "after_step", "store", "attend", "decode", "attention_only", "choose_next_slot", "store_prompt",
                 "compress", "keep_masks")
# A step method's decode kernel (its `use_kernel` field, where it has one): `auto`, the Triton kernel on
# CUDA (the fused kernel with the method's score epilogue, `fused_score`; vanilla's flash decoding)
# and the eager attention elsewhere; `triton`, the kernel everywhere (Triton's interpreter on the CPU:
# tests); `eager`.
DECODE_KERNELS = ("auto", "triton", "eager")


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
    # for methods that re-rotate cached keys or queries (None when the engine did not find one).
    rotary: Callable | None = None
    vocab: int | None = None  # for policies that observe the logits (static buffers of `[B, vocab]`)
    # The model's softmax scale (the attention modules' `scaling`); None: 1 / sqrt(head_dim).
    scale: float | None = None

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5 if self.scale is None else self.scale


def shrink_interval(name: str, budget: int, compress_every: int, least_kept: int) -> int:
    """The compression interval of an interval method under the cap (capacity = budget, cut to budget -
    interval): `compress_every`, or, when a cut would keep fewer than `least_kept` slots (a budget
    below the interval: the demo's, a small sweep point), a quarter of the budget, with a warning.
    Raises UserError when even that cut would keep fewer than `least_kept`."""
    if budget - compress_every >= least_kept:
        return compress_every
    shrunk = max(2, budget // 4)
    if budget - shrunk < least_kept:
        raise UserError(f"{name}: budget {budget} too small: a compression must keep at least {least_kept} "
                        f"slot{'s' if least_kept > 1 else ''}")
    warnings.warn(f"{name}: budget {budget} leaves no room for compress_every={compress_every}; using {shrunk}",
                  stacklevel=4)
    return shrunk


def keep_after_cut(name: str, budget: int, compress_every: int, least_kept: int) -> int:
    """The slots an interval method keeps at a cut under the cap: budget - `shrink_interval(...)`."""
    return budget - shrink_interval(name, budget, compress_every, least_kept)


def device_index(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """Host ints as an int64 tensor `[n]` on `device`, without a host sync: on CUDA through pinned
    memory and an asynchronous copy (a copy from pageable memory waits for the stream to drain)."""
    index = torch.tensor(list(values), dtype=torch.long)
    if device.type != "cuda":
        return index.to(device)
    return index.pin_memory().to(device, non_blocking=True)


def one_of(name: str, field_name: str, value: Any, choices: Sequence) -> None:
    """Raises the UserError of a config field whose value is not among `choices`."""
    if value not in choices:
        raise UserError(f"{name}: {field_name} must be one of {tuple(choices)}, got {value!r}")


@dataclass(frozen=True)
class FusedScore:
    """A step method's score as the epilogue of the fused decode kernel (`KVPolicy.fused_score`).

    `score`: a key of `longflow.kernels.longflow_attention.SCORES`; `weight`: its factor; `received`
    and `norms`: the names of the slot states it reads (`slot_state`), `received` updated in place.
    """

    score: str
    weight: float = 1.0
    received: str | None = None
    norms: str | None = None


def triton_decode(use_kernel: str, q: torch.Tensor) -> bool:
    """Whether a `use_kernel` field (`DECODE_KERNELS`) picks the Triton kernel for a step on q's device."""
    return use_kernel == "triton" or (use_kernel == "auto" and q.is_cuda)


def overrides(policy: KVPolicy, owner: type, names: Sequence[str]) -> bool:
    """Whether `policy`'s class replaces any of `owner`'s methods `names`: a subclass that changes the
    score keeps the eager path, since `owner`'s fused epilogue computes `owner`'s score."""
    return any(getattr(type(policy), name) is not getattr(owner, name) for name in names)


class Observation:
    """What a scorer reads about one layer: at a decode step (every row) or a compression (some rows).

    keys, values: `[n, Hkv, S, D]`; valid, positions: `[n, Hkv, S]`; newest: `[n]`, the position of
    the newest token (the one written this step); `state(name)`: a per-slot state `[n, Hkv, S]` (the
    cache's own tensor at a decode step, so a scorer may update it in place); `probs`: the newest
    query's attention `[n, Hkv, G, S]` float32 (the step's own at a decode step, computed from the
    query history at a compression); `queries(w)`: the last w queries after RoPE, oldest first.
    In its `head_zero` view (`one_head`), every `Hkv` above is 1, KV head 0's (the queries stay whole).
    """

    def __init__(self, policy: KVPolicy, layer: int, rows: torch.Tensor | None = None,
                 probs: torch.Tensor | None = None, newest: torch.Tensor | None = None):
        self.policy, self.layer, self.rows = policy, layer, rows
        self.slots: LayerSlots = policy.layers[layer]
        self._probs = probs
        self._newest = newest  # `[n]`, given where the engine's positions are not the written token's
        # KV head 0 alone (`[n, 1, ...]`, `head_zero`) for a shared selection, whose heads hold the same slots:
        # what is computed per slot from keys, values, validity, positions or states is then one head's.
        self.one_head = False

    def _rows(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.rows is None else tensor.index_select(0, self.rows)

    def _select(self, tensor: torch.Tensor) -> torch.Tensor:
        """A per-slot tensor `[B, Hkv, ...]` of the observed rows (and head)."""
        tensor = self._rows(tensor)
        return tensor[:, :1] if self.one_head else tensor

    @property
    def keys(self) -> torch.Tensor:
        return self._select(self.slots.keys)

    @property
    def values(self) -> torch.Tensor:
        return self._select(self.slots.values)

    @property
    def valid(self) -> torch.Tensor:
        return self._select(self.slots.valid)

    @property
    def positions(self) -> torch.Tensor:
        return self._select(self.slots.positions)

    @property
    def newest(self) -> torch.Tensor:
        return self._rows(self.policy.positions) if self._newest is None else self._newest

    @property
    def spec(self) -> CacheSpec:
        return self.policy.spec

    @property
    def scale(self) -> float:
        return self.policy.scale

    def state(self, name: str) -> torch.Tensor:
        return self._select(self.slots.state[name])

    def queries(self, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(queries `[n, Hq, w, D]`, their positions `[n, w]`, valid `[n, w]`): the last `window`."""
        return self.policy.history.recent(self.layer, self.newest, self.rows, window)

    @property
    def probs(self) -> torch.Tensor:
        if self._probs is None:
            if self.policy.history is None:
                raise RuntimeError(f"{self.policy.name}: the score read obs.probs, which the step did not compute "
                                   "(the class sets step_probs = False, or scores at an interval) and no query "
                                   "history can give (query_window() is 0)")
            newest, _, _ = self.queries(1)  # [n, Hq, 1, D]
            # every KV head's, kept whole (a `head_zero` view shares them) and cut on the way out
            keys, values, valid = (self._rows(t) for t in (self.slots.keys, self.slots.values, self.slots.valid))
            _, self._probs = decode_attention(newest[:, :, 0], keys, values, valid, self.scale)
        return self._probs[:, :1] if self.one_head else self._probs

    def head_zero(self) -> Observation:
        """This observation cut to KV head 0 (`one_head`), its probabilities shared once computed."""
        view = copy.copy(self)
        view.one_head = True
        return view


class PromptObservation(Observation):
    """The prompt of one layer seen as slots, for `prefill: by_score`: the same API as `Observation`.

    keys, values: the prompt's `[B, Hkv, L, D]`; valid: its real tokens; positions: theirs (-1 on
    padding); newest: each row's last prompt position; probs: the last prompt query's attention;
    queries(w): the last w prompt queries. A prompt has no per-slot state: `state` raises UserError.
    """

    def __init__(self, policy: KVPolicy, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        self.policy, self.layer, self.rows, self._probs = policy, layer, None, None
        self.q, self._keys, self._values = q, k, v
        pad = policy.pad[:, None, :].expand(-1, k.shape[1], -1)  # [B, Hkv, L]
        self._valid = pad
        self._positions = policy.prompt_positions[:, None, :].expand_as(pad).masked_fill(~pad, -1)

    keys = property(lambda self: self._keys)
    values = property(lambda self: self._values)
    valid = property(lambda self: self._valid)
    positions = property(lambda self: self._positions)

    @property
    def newest(self) -> torch.Tensor:
        return self.policy.pad.sum(dim=-1) - 1

    def state(self, name: str) -> torch.Tensor:
        raise UserError(f"{self.policy.name}: prefill=by_score applies the score to the prompt, which has no "
                        f"per-slot state {name!r}; use prefill=snapkv")

    def queries(self, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        length = self.q.shape[2]
        taken = min(window, length)
        queries = self.q[:, :, length - taken:]
        positions = self.policy.prompt_positions[:, length - taken:]
        valid = self.policy.pad[:, length - taken:]
        if taken < window:  # a window longer than the prompt: the missing oldest entries are invalid
            missing = window - taken
            queries = torch.cat([queries.new_zeros(*queries.shape[:2], missing, queries.shape[3]), queries], dim=2)
            positions = torch.cat([positions.new_full((positions.shape[0], missing), -1), positions], dim=1)
            valid = torch.cat([valid.new_zeros(valid.shape[0], missing), valid], dim=1)
        return queries, positions, valid

    @property
    def probs(self) -> torch.Tensor:
        if self._probs is None:
            scale = self.policy.scale
            self._probs = window_probs(self.q, self._keys, self.policy.pad, scale, window=1)[:, :, :, 0]
        return self._probs


@dataclass(eq=False)
class BatchState:
    """Everything a policy holds for one batch, made by `KVPolicy.allocate`; the policy keeps its config.

    slots: the slot cache; history: the recent queries (None when the method reads none); scale:
    the model's softmax scale; prefilling: between `begin_prefill` and `begin_decode`; pad `[B, L]`
    bool, prompt_positions `[B, L]` and prompt_lengths (host ints): the prompt; positions `[B]`:
    the engine's static tensor of the position each row writes at the current step; held: host
    count of the slots each row holds (interval methods; `IDLE` for a released row).
    """

    spec: CacheSpec
    slots: SlotCache
    history: QueryHistory | None
    scale: float
    prefilling: bool = False
    pad: torch.Tensor | None = None
    prompt_positions: torch.Tensor | None = None
    prompt_lengths: list[int] = field(default_factory=list)
    positions: torch.Tensor | None = None
    held: list[float] = field(default_factory=list)


class OfBatch:
    """A policy attribute that lives on its `BatchState` (read and written through the policy)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, policy: KVPolicy | None, owner: type | None = None):
        if policy is None:
            return self
        if policy.batch is None:
            raise AttributeError(f"{policy.name}: {self.name} belongs to a batch; call allocate(spec) first")
        return getattr(policy.batch, self.name)

    def __set__(self, policy: KVPolicy, value) -> None:
        if policy.batch is None:
            raise AttributeError(f"{policy.name}: {self.name} belongs to a batch; call allocate(spec) first")
        setattr(policy.batch, self.name, value)


@dataclass(eq=False)
class KVPolicy:
    """Base class of every KV-cache method (see the module docstring).

    A policy object is its method's config (the dataclass fields, checked once in `__post_init__`)
    and its behaviour; what belongs to one batch (the slot cache, the query history, the prompt's
    padding and positions, the current positions, the host slot counts) is a `BatchState` that
    `allocate` makes, read through the policy's attributes of the same names (`self.layers`,
    `self.positions`, ...).

    Fields: `budget`, the KV slots a sequence may hold per layer (the run's `budget`; None for the
    full cache); `budget_scope`: `per_layer` (each layer holds at most `budget`) or `total`
    (the layers together hold at most layers x budget, for methods whose capacities differ by
    layer); `prefill`: how a prompt longer than the budget is cut, for a method without a prompt
    rule of its own (one that does not override `prefill_scores`):
      - `snapkv` (default): SnapKV's window attention (`longflow.snapkv`);
      - `by_score`: the method's own `score` and `protected`, applied to the prompt as if its
        tokens were slots (`PromptObservation`: the last prompt query's attention as `probs`, the
        last prompt queries as `queries(w)`); kept: the protected tokens, then the top-scoring ones.
        A score that reads per-slot state cannot be evaluated on a prompt (UserError).
    Subclasses add their own fields and check them in `__post_init__`, raising UserError.
    """

    budget: int | None = None
    budget_scope: str = field(default="per_layer", kw_only=True)
    prefill: str = field(default="snapkv", kw_only=True)

    name: ClassVar[str] = "base"
    schedule: ClassVar[str] = "step"
    # What the engine hands to `observe` after each forward: a subset of OBSERVABLE.
    observes: ClassVar[frozenset[str]] = frozenset()
    shared_selection = True  # one selection per layer, shared by all KV heads (set per instance)
    # Decode tokens fill the slots in order: the slot write itself advances `next_slot` (vanilla).
    fills_in_order: ClassVar[bool] = False
    # A step-schedule method whose `score` reads the step's attention probabilities (`Observation.probs`);
    # without them its decode attention is flash decoding on CUDA, which computes none.
    step_probs: ClassVar[bool] = True
    # Whether `score` of a prompt (`PromptObservation`, `prefill: by_score`) reads no per-slot state even
    # though the method keeps some (LKV: its state is the score it computes from a slot's own token).
    prompt_score_is_stateless: ClassVar[bool] = False
    # Whether the run's `budget` bounds this method (False: the full cache, which holds every token
    # and records no budget). `build_policy` reads it, so no caller decides by the method's name.
    uses_budget: ClassVar[bool] = True
    # Variants written as classes of their own: `variant` value -> the class's dotted path. A method
    # config that names this class and such a variant builds that class (`longflow.methods`); each
    # of them computes its `own_variant`.
    variant_classes: ClassVar[dict[str, str]] = {}
    own_variant: ClassVar[str | None] = None
    # Fields that choose how the method is computed, not what it computes (the decode kernel,
    # `DECODE_KERNELS`): `longflow.methods.without_execution_fields` leaves them out of what names a
    # method's results, so a run started through the kernel resumes through the eager path. A subclass
    # with a switch of that kind adds its name.
    execution_fields: ClassVar[frozenset[str]] = frozenset({"use_kernel"})

    # The per-batch state, through the policy (see `BatchState`).
    slots = OfBatch()
    history = OfBatch()
    scale = OfBatch()
    prefilling = OfBatch()
    pad = OfBatch()
    prompt_positions = OfBatch()
    prompt_lengths = OfBatch()
    positions = OfBatch()
    held = OfBatch()

    def __post_init__(self):
        if self.budget is not None and (isinstance(self.budget, bool) or not isinstance(self.budget, int)
                                        or self.budget <= 0):
            raise UserError(f"budget must be a positive integer number of KV slots, got {self.budget!r}")
        one_of(self.name, "budget_scope", self.budget_scope, BUDGET_SCOPES)
        one_of(self.name, "prefill", self.prefill, PREFILL_RULES)
        if self.prefill != "snapkv" and self.has_prompt_rule():
            raise UserError(f"{self.name} cuts a prompt by its own rule (its prefill_scores); prefill must stay "
                            f"'snapkv', got {self.prefill!r}")
        if self.variant_classes:
            variant = getattr(self, "variant", None)
            one_of(self.name, "variant", variant, tuple(self.variant_classes))
            if variant != self.own_variant:
                raise UserError(f"{self.name}: variant {variant} is the class "
                                f"{self.variant_classes[variant].rpartition('.')[2]} (a method config picks it by "
                                "its variant)")
        if self.schedule not in SCHEDULES or not self.observes <= OBSERVABLE:  # the class's own declarations
            raise ValueError(f"{type(self).__name__}: schedule must be one of {SCHEDULES} and observes a subset of "
                             f"{sorted(OBSERVABLE)}, got {self.schedule!r}, {sorted(self.observes)}")
        self.batch: BatchState | None = None

    @classmethod
    def has_prompt_rule(cls) -> bool:
        """Whether the class cuts a long prompt by a rule of its own (it overrides `prefill_scores`)."""
        return cls.prefill_scores is not KVPolicy.prefill_scores

    @property
    def spec(self) -> CacheSpec | None:
        """The shapes of the current batch (None before the first `allocate`)."""
        return None if self.batch is None else self.batch.spec

    # ---- what a method declares --------------------------------------------------------------

    def capacity(self, spec: CacheSpec) -> int:
        """Slots per layer (default: the budget)."""
        if self.budget is None:
            raise UserError(f"method {self.name!r} needs a budget")
        return self.budget

    def layer_capacities(self, spec: CacheSpec) -> list[int]:
        """Slots of each layer (default: `capacity` everywhere). Under `budget_scope: total` they may
        differ and must sum to at most layers x budget."""
        return [self.capacity(spec)] * spec.layers

    def head_capacities(self, spec: CacheSpec, layer: int) -> list[int] | None:
        """Slots each KV head of `layer` may hold, at most the layer's (default None: all of them)."""
        return None

    def prefill_keep(self, spec: CacheSpec) -> int:
        """Prompt tokens kept per layer (default: capacity - 1, so that the first decode token finds a free slot)."""
        return self.capacity(spec) - 1

    def compresses_within(self, prompt_tokens: int, total_tokens: int, spec: CacheSpec) -> bool:
        """Whether a sequence of `prompt_tokens` real prompt tokens whose output ends at `total_tokens`
        (prompt + output) may attend to anything but its whole past: True when the method compresses
        it, or cannot guarantee that it does not. False means its greedy tokens are the full cache's
        (`evals.reuse` copies the full cache's record then). `spec`: the batch's shapes, of one row.

        The base rule (`holds_every_token`) answers for a class that keeps every `STORAGE_HOOKS`
        hook of this class; any other answers "cannot guarantee" unless it overrides this."""
        cls = type(self)
        if any(getattr(cls, hook) is not getattr(KVPolicy, hook) for hook in STORAGE_HOOKS):
            return True
        return not self.holds_every_token(prompt_tokens, total_tokens, spec)

    def holds_every_token(self, prompt_tokens: int, total_tokens: int, spec: CacheSpec) -> bool:
        """The base rules' answer: every token of the sequence stays in the cache.

        The prompt is stored whole when it fits `prefill_keep` and every head's capacity less the
        slot of the first decode token (`store_prompt`), whatever the batch's padding: capacities
        here do not depend on the padded length. The output's last token is never stored, so the
        decode steps that matter store total - prompt - 1 tokens; with at most C = the smallest
        layer or head capacity slots held, a step method finds a free slot for each (free slots
        go first) and an interval method's row reaches C only after the last step that matters
        (it is cut after the step that fills it). Protection windows and scores are then never
        consulted, and a compression of a batch-mate touches only that row."""
        layers = self.layer_capacities(spec)
        heads = [self.head_capacities(spec, layer) for layer in range(spec.layers)]
        least = min(min(caps) if caps is not None else slots for slots, caps in zip(layers, heads, strict=True))
        return prompt_tokens <= min(self.prefill_keep(spec), least - 1) and total_tokens - 1 <= least

    def slot_state(self) -> dict[str, SlotState]:
        """The per-slot state the method keeps in the cache (default: none)."""
        return {}

    def query_window(self) -> int:
        """How many recent queries per layer the method reads (`Observation.queries`); 0 = none."""
        return 0

    def score(self, obs: Observation) -> torch.Tensor:
        """Per-slot scores `[n, Hkv, S]` (or broadcastable), higher = keep."""
        raise NotImplementedError(f"{type(self).__name__} writes no score")

    def protected(self, obs: Observation) -> torch.Tensor | None:
        """Slots never evicted, `[n, Hkv, S]` bool (free slots may be True: they are still free), or None.
        A shared selection asks with the observation's `head_zero` view, whose tensors hold KV head 0 alone."""
        return None

    def prefill_scores(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Prompt scores `[B, Hkv, L]`, higher = keep; padding must score -inf. By the `prefill`
        field: SnapKV (`snapkv_scores`), or the method's `score` on the prompt (`by_score`)."""
        if self.prefill == "by_score":
            prompt = PromptObservation(self, layer, q, k, v)
            score = self.score(prompt).expand_as(prompt.valid)
            return selection_keys(score.float(), prompt.valid, self.protected(prompt))
        return self.snapkv_scores(layer, q, k, v, scale)

    def snapkv_scores(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """SnapKV's prompt scores `[B, Hkv, L]`, one selection per layer or per KV head as the method's."""
        return snapkv_scores(q, k, self.pad, scale, shared=self.shared_selection)

    def on_prompt_stored(self, layer: int, kept: torch.Tensor, scores: torch.Tensor | None) -> None:
        """Called after prefill with the kept prompt indices `[B, Hkv, n]` (methods with state) and the
        prompt scores `[B, Hkv, L]` that chose them (`prefill_scores`; None when every token fit)."""

    def prepare(self, spec: CacheSpec) -> None:
        """What a method needs from the model, checked and loaded once per batch, before the buffers
        (the rotary embedding, a calibration file). Also called by a method that uses this one as
        its scorer (AMS)."""

    def observe(self, logits: torch.Tensor, hidden_states: tuple[torch.Tensor, ...] | None) -> None:
        """The forward's logits `[B, Lq, V]` (the last position only, unless `prompt_logits` is observed
        at prefill: then every prompt position's, as a `longflow.engine.PromptLogits` that computes
        the positions an index asks for) and, when `hidden_states` is observed, every layer's input and
        the final norm's output, `[B, Lq, hidden]` each. Runs inside the captured decode step: copy
        into static buffers."""

    # ---- the slot cache ----------------------------------------------------------------------

    @property
    def layers(self) -> list[LayerSlots]:
        return self.slots.layers

    @property
    def next_slot(self) -> list[torch.Tensor]:
        return self.slots.next_slot

    def allocate(self, spec: CacheSpec) -> None:
        """A fresh `BatchState` with the static buffers of one batch (called again for every batch)."""
        self.prepare(spec)
        capacities = self.layer_capacities(spec)
        if self.budget_scope == "total" and sum(capacities) > spec.layers * self.budget:
            raise UserError(f"{self.name}: the layers' capacities ({sum(capacities)} slots) exceed the total "
                            f"budget of {spec.layers} x {self.budget}")
        heads = [self.head_capacities(spec, layer) for layer in range(spec.layers)]
        for layer, caps in enumerate(heads):
            if caps is not None and (len(caps) != spec.kv_heads or max(caps) > capacities[layer] or min(caps) < 2):
                raise UserError(f"{self.name}: layer {layer}'s head capacities {caps} must be {spec.kv_heads} "
                                f"numbers in [2, {capacities[layer]}]")
        states = self.slot_state()
        if self.prefill == "by_score" and states and not self.prompt_score_is_stateless:
            raise UserError(f"{self.name}: prefill=by_score applies the score to the prompt, which has no per-slot "
                            f"state ({', '.join(states)}); use prefill=snapkv")
        slots = SlotCache(spec.batch, spec.kv_heads, spec.head_dim, spec.dtype, spec.device, capacities,
                          heads if any(caps is not None for caps in heads) else None, states)
        window = self.query_window()
        history = QueryHistory(spec.layers, spec.batch, spec.q_heads, window, spec.head_dim, spec.dtype,
                               spec.device) if window else None
        self.batch = BatchState(spec, slots, history, spec.softmax_scale)

    def begin_prefill(self, pad: torch.Tensor, positions: torch.Tensor) -> None:
        """pad: `[B, L]` bool (True = real token); positions: `[B, L]` int64."""
        batch = self.batch
        batch.prefilling, batch.pad, batch.prompt_positions = True, pad, positions
        # Real tokens per row, on the host for methods whose storage depends on them (one sync per
        # batch, before the prompt forward).
        batch.prompt_lengths = pad.sum(dim=-1).tolist()

    def begin_decode(self, positions: torch.Tensor) -> None:
        """positions: `[B]` int64, the position of the token each row writes at the current step.

        The engine updates this tensor in place before every step; the policy keeps the reference.
        """
        self.batch.prefilling, self.batch.positions = False, positions
        if self.schedule == "interval":  # host count of the slots each row holds, the same in every layer
            self.held = [self.held_after_prompt(n) for n in self.prompt_lengths]

    # ---- continuous batching -----------------------------------------------------------------

    def begin_serving(self, positions: torch.Tensor) -> None:
        """Decode with no sequence in any row yet: rows get theirs from `admit`. positions: as `begin_decode`."""
        self.batch.prefilling, self.batch.positions = False, positions
        self.held = [IDLE] * self.spec.batch

    def admit(self, rows: torch.Tensor, staged: KVPolicy) -> None:
        """Rows `[n]` take over the n sequences that `staged` (this method, allocated with the same
        capacities) has just prefilled: their slots, per-slot state, recent queries and slot counts."""
        self.slots.adopt(rows, staged.slots)
        if self.history is not None:
            self.history.adopt(rows, staged.history)
        if self.schedule == "interval":
            for row, held in zip(rows.tolist(), staged.held, strict=True):
                self.held[row] = held

    def release(self, rows: list[int]) -> None:
        """Rows left without a sequence: their slots are freed, and they are never compressed."""
        self.slots.reset_rows(torch.tensor(rows, dtype=torch.long, device=self.spec.device))
        for row in rows:
            self.held[row] = IDLE

    def held_after_prompt(self, length: int) -> int:
        """Slots a row of `length` real prompt tokens holds after prefill."""
        return min(length, self.prefill_keep(self.spec))

    def before_step(self, step: int) -> bool:
        """Host hook before decode step `step` (0-based). True when the step does host-side work
        inside the forward, so that the engine runs it eagerly instead of replaying its CUDA graph
        (R-KV's `lf_repo` cut, which needs the step's own query). Default: every step is static."""
        return False

    def after_step(self, step: int) -> None:
        """Host hook after decode step `step` (0-based). Interval methods: cut the rows now full."""
        if self.schedule != "interval":
            return
        self.held = [n + 1 for n in self.held]
        capacity = self.layers[0].slots
        full = [row for row, n in enumerate(self.held) if n >= capacity]
        if full:
            self.compress(full)
            for row in full:
                self.held[row] = self.keep_after

    # ---- called from the model ---------------------------------------------------------------

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`PolicyCache.update`: k, v `[B, Hkv, Lq, D]` after RoPE.

        At prefill nothing is stored yet: which prompt tokens survive depends on the prompt's own
        attention, so `attend` stores them. At decode the new token overwrites `next_slot`.
        """
        if self.prefilling:
            return k, v
        # An interval method's next slot is the first free one; the write's kernel finds it (`decode` has
        # nothing left to choose).
        self.slots.write(layer, k, v, self.positions, advance=self.fills_in_order,
                         find_free=self.schedule == "interval")
        slots = self.layers[layer]
        return slots.keys, slots.values

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """The attention function: q `[B, Hq, Lq, D]` -> `[B, Lq, Hq, D]` (HF's layout)."""
        if self.prefilling:
            out = prefill_attention(q, k, v, self.pad, scale)
            if self.history is not None:
                self.history.record_prompt(layer, q, self.pad)
            self.store_prompt(layer, q, k, v, scale)
            return out.transpose(1, 2)
        if self.history is not None:
            self.history.record(layer, q[:, :, 0], self.positions)
        return self.decode(layer, q[:, :, 0], scale).unsqueeze(1)

    # ---- decode ------------------------------------------------------------------------------

    def decode(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """q `[B, Hq, D]` -> out `[B, Hq, D]`; sets `next_slot[layer]` for the next step (an interval
        method's write has set it already). Static, no sync."""
        slots = self.layers[layer]
        if self.schedule == "step" and self.step_probs:
            fused = self.fused_score(q)
            if fused is not None and slots.usable is None:  # the kernel has no per-head capacities
                return self.fused_decode(layer, q, scale, fused)
            out, probs = decode_attention(q, slots.keys, slots.values, slots.valid, scale)
            self.choose_next_slot(layer, probs)
            return out
        out = self.attention_only(q, slots, scale)
        if self.schedule != "interval":  # an interval method's write has moved next_slot to the first free slot
            self.choose_next_slot(layer)
        return out

    def fused_score(self, q: torch.Tensor) -> FusedScore | None:
        """The step's score as an epilogue of the fused decode kernel, for a step on q's device, or
        None (default): the eager attention with probabilities, then `score`. A method that returns
        one computes in the kernel what its `score` gives (its tests compare the two paths); the
        protected slots are still its `protected`."""
        return None

    def fused_decode(self, layer: int, q: torch.Tensor, scale: float, fused: FusedScore) -> torch.Tensor:
        """The step in one launch pair (`longflow.kernels.scored_attention`): attention, `fused`'s score
        with its slot states updated in place, and `next_slot[layer]` by the selection rule."""
        slots = self.layers[layer]
        obs = Observation(self, layer)
        valid, protect = slots.valid, self.protected(obs.head_zero() if self.shared_selection else obs)
        protect = None if protect is None else protect.expand_as(valid)
        if self.shared_selection:  # every KV head of `valid` and `positions` holds the same row
            valid, protect = valid[:, 0], None if protect is None else protect[:, 0]
        state = slots.state
        return scored_attention(
            q, slots.keys, slots.values, valid, self.next_slot[layer], scale, score=fused.score,
            per_kv_head=not self.shared_selection, protect=protect, weight=fused.weight,
            received=None if fused.received is None else state[fused.received],
            norms=None if fused.norms is None else state[fused.norms])

    def attention_only(self, q: torch.Tensor, slots: LayerSlots, scale: float) -> torch.Tensor:
        """Decode attention without probabilities, q `[B, Hq, D]` -> `[B, Hq, D]`, over every slot
        with `valid` masking the free ones (they lie anywhere after a compression). On CUDA flash
        decoding, for the strongest baseline: SDPA given a mask leaves its flash and cuDNN backends
        and builds a `[B, Hq, 1, S]` mask per layer and step, and the eager attention with
        probabilities writes and reads them in fp32."""
        if q.is_cuda:
            return flash_decode(q, slots.keys, slots.values, slots.valid, None, scale)
        return masked_decode_attention(q, slots.keys, slots.values, slots.valid, scale)

    def choose_next_slot(self, layer: int, probs: torch.Tensor | None = None) -> None:
        """`next_slot[layer]` by the selection rule from `score` and `protected`; probs `[B, Hkv, G, S]`
        of the step (None: computed from the query history if the score needs them)."""
        slots = self.layers[layer]
        # One selection for every KV head: the heads hold the same slots and score them alike, so head 0's
        # choice is every head's, for 1/Hkv of the bytes (this runs eagerly, in every layer). The score is
        # computed whole, since one head's may read every head's probabilities (TOVA's mean).
        one_head = self.shared_selection and slots.usable is None
        obs = Observation(self, layer, probs=probs)
        score = self.score(obs)
        protect = self.protected(obs.head_zero() if one_head else obs)
        score, valid = (score[:, :1], slots.valid[:, :1]) if one_head else (score, slots.valid)
        self.next_slot[layer].copy_(choose_next(score, valid, protect, slots.usable).expand_as(self.next_slot[layer]))

    # ---- prefill -----------------------------------------------------------------------------

    def store_prompt(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> None:
        """The prompt's kept tokens into the layer's slots: all of them when they fit, else the top
        `prefill_keep` by `prefill_scores` (per KV head, at most its capacity - 1), in position order."""
        spec, slots = self.spec, self.layers[layer]
        length = k.shape[2]
        keep = min(self.prefill_keep(spec), slots.slots - 1, length)  # a layer may hold less than the budget
        counts = None
        if slots.usable is not None:  # per-head capacities: each head keeps at most its capacity - 1
            counts = (slots.usable.sum(dim=-1) - 1).clamp(max=keep)  # [Hkv]
        scores = None
        if max(self.prompt_lengths) <= (keep if counts is None else int(counts.min())):
            # Every real token fits; with left padding they are all among the last `keep` positions.
            self.slots.store_prompt(layer, k, v, keep, self.pad, self.prompt_positions)
            kept = torch.arange(length - keep, length, device=k.device).expand(spec.batch, spec.kv_heads, keep)
        else:
            pad = self.pad[:, None, :].expand(-1, k.shape[1], -1)
            scores = self.prefill_scores(layer, q, k, v, scale)
            kept = choose_keep(scores, pad, keep)  # [B, Hkv, keep], best first
            if counts is not None:  # a head's ranks beyond its count are dropped (sorted last, stored free)
                kept = torch.where(torch.arange(keep, device=k.device) < counts[:, None], kept, length)
            kept = kept.sort(dim=-1).values
            self.slots.store_prompt(layer, k, v, kept, self.pad, self.prompt_positions)
        kept = kept.clamp(max=length - 1)
        self.prompt_state(layer, q, k, v, kept)
        self.on_prompt_stored(layer, kept, scores)
        if self.schedule == "interval":
            # Held slots first, in position order: left padding leaves free slots below the prompt.
            self.slots.compact(layer, None, self.layers[layer].valid.clone())

    def prompt_state(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kept: torch.Tensor) -> None:
        """The per-slot states with an `on_prompt` rule, for the kept prompt tokens `[B, Hkv, n]`."""
        rules = {name: state for name, state in self.slots.states.items() if state.on_prompt is not None}
        if not rules:
            return
        prompt, slots, count = PromptObservation(self, layer, q, k, v), self.layers[layer], kept.shape[-1]
        valid = slots.valid[..., :count]
        for name, state in rules.items():
            value = state.on_prompt(prompt).gather(2, kept).to(state.dtype)
            slots.state[name][..., :count].copy_(torch.where(valid, value, state.fill))

    # ---- interval compression ----------------------------------------------------------------

    @torch.no_grad()
    def compress(self, rows: list[int]) -> None:
        """Cut the given rows (all slots held) to `keep_after` slots, in every layer (host hook).

        `keep_after`: set by every interval method (its capacity minus its interval). No host sync:
        the row index goes to the device asynchronously (`row_index`), and when every row is cut
        (rows in step, the common case) the scores and the compaction work on the buffers themselves."""
        self.slots.record_peak()  # the rows are full: their peak, before the cut frees slots
        index = self.row_index(rows)
        for layer, keep in zip(range(self.spec.layers), self.keep_masks(index), strict=True):
            self.slots.compact(layer, index, keep)

    def row_index(self, rows: Sequence[int]) -> torch.Tensor | None:
        """Host row numbers as the `[n]` index of an `Observation` or a compaction: None when they are
        every row of the batch in order, else `device_index(rows)`."""
        if list(rows) == list(range(self.spec.batch)):
            return None
        return device_index(rows, self.spec.device)

    def keep_masks(self, rows: torch.Tensor | None) -> Iterator[torch.Tensor]:
        """The slots a compression of `rows` `[n]` (None: every row) keeps in each layer, `[n, Hkv, S]`
        bool, layer by layer (a method that scores several layers at once overrides this)."""
        newest = self.written(rows)
        for layer in range(self.spec.layers):
            yield self.keep_mask(Observation(self, layer, rows=rows, newest=newest), self.keep_after)

    def written(self, rows: torch.Tensor | None) -> torch.Tensor:
        """The position of the newest token `rows` `[n]` (None: every row) hold, between steps: the
        engine's positions have moved on to the token the next step writes by the time `after_step` runs."""
        positions = self.positions if rows is None else self.positions.index_select(0, rows)
        return positions - 1

    def keep_mask(self, obs: Observation, count: int) -> torch.Tensor:
        """The slots a compression keeps, `[n, Hkv, S]` bool: `count` of them by the selection rule."""
        valid = obs.valid
        return chosen_mask(choose_keep(self.score(obs).expand_as(valid), valid, count, self.protected(obs)), valid)

    # ---- the peak ----------------------------------------------------------------------------

    def record_peak(self, layers: list[int] | None = None) -> None:
        self.slots.record_peak(layers)

    def peak_slots(self) -> list[int]:
        """Peak KV slots held per sequence, over all layers and heads, so far (syncs the host)."""
        return self.slots.peak_slots()
