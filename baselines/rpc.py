"""RPC: Reasoning Path Compression, keep the generated tokens the newest queries attend to.

Song et al. 2025, "Reasoning Path Compression: Compressing Generation Trajectories for Efficient LLM
Reasoning", arXiv 2505.13866 (NeurIPS 2025); official code jiwonsong-dev/ReasoningPathCompression
(MIT), read at commit 00e64b7: the score and the selection are `RPCCluster.compress_kv`
(rpc/rpc_utils.py:94-171), the defaults `init_rpc` and `set_rpc_config` (rpc_utils.py:14-36,
174-188), when a layer compresses and which queries select the `q_len == 1` branch of the patched
attention (rpc/qwen2_custom.py:90-128; rpc/llama_custom.py:78-119 is the same). docs/methods.md, "RPC".

An interval method. A compression scores the generated tokens older than the R newest (the
candidates) with the attention of the newest queries (the selectors):

    a_hj    = sum over selectors s of w_s softmax_j(q_hs . k_j / sqrt(D))   softmax over candidates only
    score_j = avgpool_7(mean over ALL query heads h of a_hj)                one selection per layer

and keeps the prompt, the R newest tokens and the top candidates by the score, in position order.
The official selectors are the queries of the R - 1 newest tokens with the newest counted twice
(`selectors: recent`: it caches each query once the cache is within R - 1 tokens of a compression,
the compressing step's own included, then concatenates the compressing query again,
qwen2_custom.py:95-97, rpc_utils.py:96-97); `new` is its option of the newest query alone.

Budget, by `budget_mode`:
  - `cap` (default, memory-fair): `budget` is a hard cap. The cache fills to the budget and a full
    row is cut to budget - compress_every slots: the prompt (at most the room a cut leaves beside
    the R newest; a longer one's first tokens), the R newest, and the rest by the score. The
    interval is the paper's P, shrunk to a quarter of a smaller budget (and R halved to fit where
    even that leaves no room), with a warning; the ratio `c` does not enter.
  - `ratio` (the paper's schedule, not a cap): the whole prompt is kept, and the n-th compression
    (n = 0, 1, ...) fires when a row holds n T + P + R generated tokens, T = int(P / c), keeping
    (n + 1) T of its n T + P candidates plus the R newest; so the cache grows by P - T tokens per
    compression and `budget` bounds nothing. The slots allocated are the padded prompt plus the
    most generated tokens a row can hold within `max_new_tokens`; the peak actually held is
    recorded, as every run's, and exceeds the budget.

Deviations from the official code: scores in float32 (official: the softmax in float32, the sum
over selectors in the model dtype); each row is compressed when its own count is reached (the
official cache counts one batch together); the candidates of `cap` may include prompt tokens
beyond the room a cut leaves (the official code keeps every prompt token, which no cap can); a
prompt longer than the budget is cut at prefill by SnapKV (the harness's rule for methods without
one: the official code never compresses a prompt).

Notation: n rows, Hq query heads, Hkv KV heads, G = Hq / Hkv, S slots, W selector queries, D head dim.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from longflow.errors import UserError
from longflow.policy import IDLE, CacheSpec, KVPolicy, Observation, one_of, shrink_interval
from longflow.slots import SlotState, prompt_mark

BUDGET_MODES = ("cap", "ratio")
POOLINGS = ("avgpool", "maxpool")
AGGREGATIONS = ("all", "group")
SELECTORS = ("recent", "new")
PROMPT = "prompt"  # per-slot state: the slot holds a prompt token


def selector_weights(window: int, selectors: str, device: torch.device | str | None = None) -> torch.Tensor:
    """`[W]` float32 on `device`, oldest first: the weight of each of the W newest queries in the score.

    `recent`: the official selectors, the W - 1 newest queries with the newest counted twice
    (W = 1: the newest once); `new`: the newest alone. Made where it is used: a copy from host
    memory at every compression would make the host wait for the device.
    """
    # Built from comparisons: an indexed write of a Python number into a CUDA tensor synchronises.
    position = torch.arange(window, device=device)
    newest = (position == window - 1).float()
    if selectors == "recent" and window > 1:
        return (position >= 1).float() + newest
    return newest


def rpc_scores(
    queries: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    candidates: torch.Tensor,
    *,
    kernel: int,
    pooling: str,
    aggregation: str,
) -> torch.Tensor:
    """RPC scores of the candidate slots; the candidates of a row and KV head must be contiguous slots
    (slots in position order, the prompt before them and the newest tokens after).

    Per query head, the softmax over the candidates of q . k / sqrt(D) (the official scale, whatever
    the model's), summed over the selector queries with `weights`; then the mean over all query
    heads (`all`, one selection per layer) or over each KV head's G query heads (`group`); then an
    average (or max) pool of `kernel` over the candidates, zero beyond them, divided by `kernel`
    at the ends too, as `F.avg_pool1d` over the candidates alone with zero padding.

    Args:
        queries: `[n, Hq, W, D]` selector queries (after RoPE), oldest first; weights: `[n, W]`.
        keys: `[n, Hkv, S, D]`; candidates: `[n, Hkv, S]` bool.

    Returns:
        `[n, Hkv, S]` float32, -inf outside the candidates.
    """
    rows, q_heads, window, head_dim = queries.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    group = q_heads // kv_heads
    grouped = queries.float().reshape(rows, kv_heads, group * window, head_dim)
    logits = torch.matmul(grouped, keys.float().transpose(-1, -2)) / math.sqrt(head_dim)  # [n, Hkv, G*W, S]
    logits = logits.view(rows, kv_heads, group, window, slots)
    outside = ~candidates[:, :, None, None, :]
    probs = torch.softmax(logits.masked_fill(outside, float("-inf")), dim=-1).nan_to_num(0.0)
    attention = (probs * weights.float()[:, None, None, :, None]).sum(dim=3)  # [n, Hkv, G, S]
    if aggregation == "all":
        pooled = attention.mean(dim=(1, 2))[:, None, :]  # [n, 1, S]
    else:
        pooled = attention.mean(dim=2)  # [n, Hkv, S]
    # Zero outside the candidates already (softmax over them alone): a pool over every slot is the
    # official pool over the candidates with zero padding (a max pool too, the values being >= 0).
    pool = F.avg_pool1d if pooling == "avgpool" else F.max_pool1d
    pooled = pool(pooled, kernel, stride=1, padding=kernel // 2).expand(rows, kv_heads, slots)
    return pooled.masked_fill(~candidates, float("-inf"))


def top_candidates(score: torch.Tensor, count: int) -> torch.Tensor:
    """`[n, Hkv, S]` scores (-inf = not a candidate) -> `[n, Hkv, S]` bool: the `count` best candidates
    of each row and KV head (fewer where it has fewer)."""
    chosen = torch.zeros_like(score, dtype=torch.bool)
    if count > 0:
        chosen.scatter_(-1, score.topk(min(count, score.shape[-1]), dim=-1).indices, True)
    return chosen & (score > float("-inf"))


def capped_interval(name: str, budget: int, compress_every: int, recent: int) -> tuple[int, int]:
    """(interval, newest tokens kept) in force under the cap: `compress_every` and `recent` when a cut
    to budget - compress_every keeps more than `recent`; else the interval shrinks to a quarter of the
    budget (`shrink_interval`), and where even that leaves no room, the newest kept are half of a cut."""
    try:
        return shrink_interval(name, budget, compress_every, recent + 1), recent
    except UserError:
        interval = shrink_interval(name, budget, compress_every, 2)
        shrunk = (budget - interval) // 2
        warnings.warn(f"{name}: budget {budget} leaves no room for {recent} newest tokens; using {shrunk}",
                      stacklevel=3)
        return interval, shrunk


def ratio_peak(max_new_tokens: int, period: int, kept: int, window: int) -> int:
    """The most generated tokens a row holds within `max_new_tokens` under the paper's schedule: the
    n-th compression at n kept + period + window held, down to (n + 1) kept + window."""
    held = cuts = peak = 0
    left = max_new_tokens
    while True:
        trigger = cuts * kept + period + window
        if left < trigger - held:
            return max(peak, held + left)
        left -= trigger - held
        peak, held, cuts = trigger, (cuts + 1) * kept + window, cuts + 1


@dataclass(eq=False)
class RPCPolicy(KVPolicy):
    """RPC (see the module docstring). Fields, defaults from `init_rpc` (rpc_utils.py:178-188):
    `compress_every` (P, 1024), `window` (R, 32), `ratio` (c, 4), `kernel` (7), `pooling`
    (`avgpool` | `maxpool`), `aggregation` (`all` | `group`), `selectors` (`recent` | `new`),
    `budget_mode` (`cap` | `ratio`)."""

    compress_every: int = 1024
    window: int = 32
    ratio: float = 4.0
    kernel: int = 7
    pooling: str = "avgpool"
    aggregation: str = "all"
    selectors: str = "recent"
    budget_mode: str = "cap"

    name = "rpc"
    schedule = "interval"

    def __post_init__(self):
        super().__post_init__()
        for field, options in (("budget_mode", BUDGET_MODES), ("pooling", POOLINGS),
                               ("aggregation", AGGREGATIONS), ("selectors", SELECTORS)):
            one_of(self.name, field, getattr(self, field), options)
        if self.compress_every < 1 or self.window < 1:
            raise UserError(f"{self.name}: compress_every and window must be >= 1, got "
                            f"{self.compress_every}, {self.window}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise UserError(f"{self.name}: kernel must be odd and >= 1, got {self.kernel}")
        if not self.ratio >= 1.0:
            raise UserError(f"{self.name}: ratio must be >= 1, got {self.ratio}")
        self.kept_per_cut = int(self.compress_every / self.ratio)  # T of the paper's schedule
        if self.kept_per_cut < 1:
            raise UserError(f"{self.name}: compress_every / ratio must be >= 1, got "
                            f"{self.compress_every} / {self.ratio}")
        self.shared_selection = self.aggregation == "all"
        self.newest_kept = self.window
        if self.budget is not None and self.budget_mode == "cap":
            interval, self.newest_kept = capped_interval(self.name, self.budget, self.compress_every, self.window)
            self.keep_after = self.budget - interval
        self.generated: list[float] = []  # ratio: generated tokens each row holds (IDLE: no sequence)
        self.cuts: list[int] = []  # ratio: compressions of each row so far

    # ---- sizes -------------------------------------------------------------------------------

    def capacity(self, spec: CacheSpec) -> int:
        budget = super().capacity(spec)
        if self.budget_mode == "cap":
            return budget
        return spec.prompt_len + ratio_peak(spec.max_new_tokens, self.compress_every, self.kept_per_cut,
                                            self.window)

    def query_window(self) -> int:
        return self.window

    def slot_state(self) -> dict[str, SlotState]:
        return {PROMPT: prompt_mark()}

    # ---- the score ---------------------------------------------------------------------------

    def protected(self, obs: Observation) -> torch.Tensor:
        """The newest `window` tokens and the prompt; under `cap`, only the prompt's first slots that
        fit beside the newest in a cut (slots are in position order, the prompt first)."""
        valid, positions = obs.valid, obs.positions
        newest = valid & (positions > obs.newest[:, None, None] - self.newest_kept)
        prompt = obs.state(PROMPT) & valid
        if self.budget_mode == "cap":
            prompt = prompt & (prompt.cumsum(dim=-1) <= self.keep_after - self.newest_kept)
        return newest | prompt

    def score(self, obs: Observation) -> torch.Tensor:
        """`[n, Hkv, S]`: `rpc_scores` of the slots neither protected nor free, -inf elsewhere."""
        candidates = obs.valid & ~self.protected(obs)
        queries, _, query_valid = obs.queries(self.newest_kept)
        weights = selector_weights(self.newest_kept, self.selectors, queries.device) * query_valid
        return rpc_scores(queries, weights, obs.keys, candidates, kernel=self.kernel, pooling=self.pooling,
                          aggregation=self.aggregation)

    # ---- the paper's schedule (`ratio`) ------------------------------------------------------

    def begin_decode(self, positions: torch.Tensor) -> None:
        super().begin_decode(positions)
        self.generated = [0] * self.spec.batch
        self.cuts = [0] * self.spec.batch

    def begin_serving(self, positions: torch.Tensor) -> None:
        super().begin_serving(positions)
        self.generated = [IDLE] * self.spec.batch
        self.cuts = [0] * self.spec.batch

    def admit(self, rows: torch.Tensor, staged: KVPolicy) -> None:
        super().admit(rows, staged)
        for row, generated, cuts in zip(rows.tolist(), staged.generated, staged.cuts, strict=True):
            self.generated[row], self.cuts[row] = generated, cuts

    def release(self, rows: list[int]) -> None:
        super().release(rows)
        for row in rows:
            self.generated[row] = IDLE

    def after_step(self, step: int) -> None:
        """`cap`: the base class cuts the full rows. `ratio`: each row whose generated tokens reach
        cuts T + P + R is compressed to (cuts + 1) T of them plus the R newest."""
        if self.budget_mode == "cap":
            return super().after_step(step)
        self.generated = [n + 1 for n in self.generated]
        due = [row for row, n in enumerate(self.generated)
               if n == self.cuts[row] * self.kept_per_cut + self.compress_every + self.window]
        if not due:
            return
        self.record_peak()  # the rows are at their most, before the cut frees slots
        for cuts in sorted({self.cuts[row] for row in due}):
            rows = [row for row in due if self.cuts[row] == cuts]
            kept = (cuts + 1) * self.kept_per_cut
            self.compress_to(rows, kept)
            for row in rows:
                self.generated[row], self.cuts[row] = kept + self.window, cuts + 1

    @torch.no_grad()
    def compress_to(self, rows: list[int], kept: int) -> None:
        """Keeps the protected slots and the `kept` best candidates of `rows`, in every layer."""
        index = self.row_index(rows)
        newest = self.written(index)
        for layer in range(self.spec.layers):
            obs = Observation(self, layer, rows=index, newest=newest)
            keep = (self.protected(obs) & obs.valid) | top_candidates(self.score(obs), kept)
            self.slots.compact(layer, index, keep)
