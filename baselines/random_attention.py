"""Random Attention: keep the prompt, the newest tokens and a uniformly random sample of the rest.

"Random Attention: Rethinking KV Cache Eviction for Efficient Reasoning", arXiv 2609.03430; official
code SalesforceAIResearch/Random-Attention (Apache-2.0), read at commit 066c520: the `random_pp`
eviction mode of `EvictLayer._run_eviction` in kvcompress/engine/cache_utils.py (its trigger in
`post_attention_update`, the selection in the `random_pp` branch, the chronological compaction
before the gather), with the paper's settings from scripts/run_cell.sh (`--token_budget K
--residual_length 64 --eviction_mode random_pp`). docs/methods.md, "Random Attention".

An interval method, per KV head, that reads no attention. A cut of a row keeps

  - the `recent` (64) newest tokens (the official residual buffer),
  - the prompt's first min(prompt, K - 1) tokens, K the slots a cut keeps beside the newest
    (`protect_prompt`; the official `pl = min(prompt_len, K - 1)`, so at least one slot is drawn),
  - and the rest of K by a uniform random draw, fresh at every cut, per row, layer and KV head:
    the K - p candidates of the highest uniform noise (the official `torch.rand(...).topk(K)`),

in position order. The noise is the engine's per-row generator (`longflow.sampling.row_uniform`, a
hash of a counter, not a torch Generator): a pure function of (`seed`, layer, KV head, the slot's
token position, the row's newest position at the cut). A row's draws therefore depend on nothing
but its own sequence: not on its batch-mates, its row, the batch size, continuous batching, or a
resumed run. The row's sampling seed is not among them (the policy is not handed it), so the
samples of one prompt draw alike while their tokens agree.

Budget, by `budget_mode`:
  - `cap` (default, memory-fair): capacity = budget; a full row is cut to budget - compress_every
    (the official interval, 64, is its residual length): the newest 64 and K = budget - 128 others.
    A budget that leaves no room shrinks the interval to a quarter of it, and the newest kept to
    half a cut where even that does not fit, with a warning.
  - `target` (the official schedule, recorded as such): a cut keeps `budget` slots (K = budget -
    64 and the newest 64) and the cache grows to budget + compress_every before the next (the
    official cache reaches K + 64 tokens, attends over them and then cuts, when the budget is a
    multiple of 64, as every budget of its paper is).

A prompt longer than the slots (capacity - 1) is cut at prefill by the same rule, with the prompt's
last token as the newest: its first and last tokens kept, a random sample between. The official
code never cuts a prompt; its first cut keeps the same (the prompt's first K - 1 tokens protected).
Deviations: the noise is the hash above, not `torch.rand` (whose draws depend on the batch and on
every earlier draw of the process); each row is cut when its own cache is full, where the official
trigger (length a multiple of 64 above the budget) counts one batch of replicas of a prompt.

Notation: n rows, Hkv KV heads, S slots, B batch, L padded prompt length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baselines.rpc import capped_interval
from longflow.errors import UserError
from longflow.policy import CacheSpec, KVPolicy, Observation, one_of
from longflow.sampling import row_uniform
from longflow.slots import SlotState, prompt_mark

BUDGET_MODES = ("cap", "target")
PROMPT = "prompt"  # per-slot state: the slot holds a prompt token
# Bits of the noise counter given to the token position, the KV head and the layer; the seed takes
# the rest of the 63.
POSITION_BITS, HEAD_BITS, LAYER_BITS = 24, 10, 12


def uniform_scores(seed: int, layer: int, positions: torch.Tensor, newest: torch.Tensor) -> torch.Tensor:
    """Uniform noise in (0, 1) per slot, `[n, Hkv, S]` float32, a pure function of (seed, layer, KV
    head, the slot's position, the row's newest position) through the engine's per-row generator.

    positions: `[n, Hkv, S]` int64 (any value where free); newest: `[n]` int64.
    """
    rows, heads, slots = positions.shape
    head = torch.arange(heads, device=positions.device)[None, :, None]
    counter = ((seed << LAYER_BITS | layer) << HEAD_BITS | head) << POSITION_BITS | positions.clamp(min=0)
    step = newest[:, None, None].expand(rows, heads, slots)
    return row_uniform(counter.reshape(-1), step.reshape(-1), 1).view(rows, heads, slots)


def random_keep_scores(noise: torch.Tensor, valid: torch.Tensor, protect: torch.Tensor) -> torch.Tensor:
    """`[n, Hkv, S]` keep scores: +inf where protected, the noise elsewhere, -inf where not valid; a
    top-k of them keeps the protected slots and a uniform random sample of the others."""
    scores = noise.masked_fill(protect, float("inf"))
    return scores.masked_fill(~valid, float("-inf"))


def first_prompt(prompt: torch.Tensor, count: int | torch.Tensor) -> torch.Tensor:
    """`[n, Hkv, S]` bool: the first `count` (an int, or `[n, Hkv, 1]`) of the `prompt` slots, in slot order."""
    return prompt & (prompt.cumsum(dim=-1) <= count)


@dataclass(eq=False)
class RandomAttentionPolicy(KVPolicy):
    """Random Attention (see the module docstring). Fields: `recent` (64, the official
    `--residual_length`), `compress_every` (64, the official eviction period, the same residual
    length), `protect_prompt` (true: `random_pp`, the paper's method; false: its `random` ablation,
    no prompt protection), `seed` (0, of the noise), `budget_mode` (`cap` | `target`)."""

    recent: int = 64
    compress_every: int = 64
    protect_prompt: bool = True
    seed: int = 0
    budget_mode: str = "cap"

    name = "random_attention"
    schedule = "interval"
    shared_selection = False

    def __post_init__(self):
        super().__post_init__()
        one_of(self.name, "budget_mode", self.budget_mode, BUDGET_MODES)
        if self.recent < 1 or self.compress_every < 1:
            raise UserError(f"{self.name}: recent and compress_every must be >= 1, got {self.recent}, "
                            f"{self.compress_every}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2 ** 17:
            raise UserError(f"{self.name}: seed must be an integer in [0, 2^17), got {self.seed!r}")
        self.newest_kept = self.recent
        if self.budget is not None:
            if self.budget_mode == "cap":
                interval, self.newest_kept = capped_interval(self.name, self.budget, self.compress_every,
                                                             self.recent)
                self.slots_held, self.keep_after = self.budget, self.budget - interval
            else:
                self.slots_held, self.keep_after = self.budget + self.compress_every, self.budget
                if self.keep_after <= self.recent:
                    raise UserError(f"{self.name}: budget {self.budget} must exceed recent={self.recent} "
                                    "under budget_mode=target")

    def capacity(self, spec: CacheSpec) -> int:
        super().capacity(spec)  # the budget is set
        return self.slots_held

    def slot_state(self) -> dict[str, SlotState]:
        return {PROMPT: prompt_mark()}

    def protected(self, obs: Observation) -> torch.Tensor:
        """The `recent` newest tokens and, with `protect_prompt`, the prompt's first K - 1 held slots
        (K = keep_after - recent: the slots a cut keeps beside the newest)."""
        valid, positions = obs.valid, obs.positions
        protect = valid & (positions > obs.newest[:, None, None] - self.newest_kept)
        if self.protect_prompt:
            room = max(0, self.keep_after - self.newest_kept - 1)
            protect = protect | first_prompt(obs.state(PROMPT) & valid, room)
        return protect

    def score(self, obs: Observation) -> torch.Tensor:
        """`[n, Hkv, S]`: +inf on the protected slots, fresh uniform noise on the others, -inf where free."""
        noise = uniform_scores(self.seed, obs.layer, obs.positions, obs.newest)
        return random_keep_scores(noise, obs.valid, self.protected(obs))

    def prefill_scores(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       scale: float) -> torch.Tensor:
        """`[B, Hkv, L]`: the cut's rule over the prompt of a row longer than its slots, with the
        prompt's last token as the newest: its newest `recent` and (with `protect_prompt`) its first
        `prefill_keep - recent - 1` tokens protected, noise elsewhere, -inf on padding."""
        batch, kv_heads, length = k.shape[0], k.shape[1], k.shape[2]
        keep = min(self.prefill_keep(self.spec), self.layers[layer].slots - 1, length)
        positions = self.prompt_positions[:, None, :].expand(batch, kv_heads, length)
        held = self.pad[:, None, :].expand(batch, kv_heads, length)
        last = positions[:, 0, -1]  # [B]: the last prompt token's position (left padding)
        recent = min(self.newest_kept, keep)
        protect = held & (positions > last[:, None, None] - recent)
        if self.protect_prompt:
            protect = protect | (held & (positions < max(0, keep - recent - 1)))
        noise = uniform_scores(self.seed, layer, positions, last)
        return random_keep_scores(noise, held, protect)
