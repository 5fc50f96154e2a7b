"""CompressKV: tokens chosen by a layer's semantic retrieval heads, layer budgets by eviction error.

Lin et al. 2025, "CompressKV: Semantic Retrieval Heads Know What Tokens are Not Important Before
Generation", arXiv 2508.02401 (revised as arXiv 2606.24467); official code github.com/TUDa-HWAI/
CompressKV at e8af510 (no licence file: read, not copied). What follows it, what extends it and
every assumption: docs/methods.md, "CompressKV".

Selection (`srh_scores`; `methods/compresskv/snapkv_utils.py:47-84`): in layer l, the first
`selection_heads` (4) query heads of the layer's semantic-retrieval ranking score the keys: logits
of the last `window` (8) queries against the held keys (the KV head of each query head, causal
inside the window), softmax in float32, summed over the window's queries for the keys before the
window, pooled over `kernel` (5) neighbours (`pooling`: avgpool, zero-padded as `F.avg_pool1d`),
averaged over the selecting heads. The window's tokens are always kept; the same tokens for every
KV head of the layer (one shared selection).

Layer budgets (`layer_budgets`; `longbench/pred_compresskv.py:18-50`, called at :146): with
normalised layer error scores r_l from a calibration file, b_l = clip(min + round(r_l (budget L -
min L)), min, max) with min = `min_layer_budget` (32) and max = `max_layer_ratio` (3) x budget,
then +-1 in order of r_l until the budgets sum to budget x L (`budget_scope: total`: the layers
together hold at most L x budget slots; one layer may hold up to 3 x budget). Without a calibration
file, every layer gets the budget (:148). `budget_scope: per_layer` caps every layer at the budget,
which makes the budgets uniform.

The official code compresses the prompt only (`q_len > 1`) and lets decoding append. Extensions,
both named here as such:
  - decode (A): the cache of each layer grows to b_l, then is cut to b_l - `compress_every`
    (128, shrunk to a quarter of b_l for a small layer) by the same selection, with the last
    `window` decode queries: the interval schedule of every interval method here;
  - a budget above max_new_tokens gives every layer the budget: it covers the whole sequence of a
    row whose prompt is short enough, which must then decode as the full cache (the official
    per-layer budgets put a low-error layer below it), and the capacities, shared by a batch's
    rows, come from the run's settings only, so that no row's depend on its batch-mates.

Calibration file (`calibration`, made by `python -m evals.calibrate`): `head_scores` `[L, Hq]`
(semantic retrieval score per query head; the ranking is their descending order) and
`layer_scores` `[L]` (normalised layer errors). Without one (null): every query head selects (A)
and the budgets are uniform.

Other deviations: a prompt longer than b_l keeps b_l - 1 tokens (room for the first decode token)
where the official keeps b_l; the pool runs along the held slots in position order, which for a
compacted decode cache skips evicted neighbours; `n_sink` (0) first positions may be protected, for
the reading of `first_k = 4` as "first 4 tokens" (the official code uses it as 4 heads,
`snapkv_utils.py:35`).

Notation: n rows, Hq query heads, Hkv KV heads, G = Hq / Hkv, k selecting heads, w window, S slots
(or L prompt positions), D head dim, L layers (in `layer_budgets`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from longflow.calibration import check_shape, load_calibration
from longflow.errors import UserError
from longflow.policy import IDLE, CacheSpec, KVPolicy, Observation, shrink_interval
from longflow.selection import choose_keep

POOLINGS = ("avgpool", "maxpool")
CALIBRATION = ("head_scores", "layer_scores")


def layer_budgets(scores: list[float], total: int, low: int, high: int) -> list[int]:
    """Error-aware layer budgets (official `error_aware_layer_budget_allocation`): `low` each plus a
    share of the rest in proportion to `scores` (rounded half to even), clipped to [low, high], then
    +1 to the layers below `high` in descending score order (pass after pass) while the sum is short
    of `total`, or -1 to those above `low` in ascending order while it is over. The sum is `total`
    unless every layer sits at a bound."""
    budgets = [min(max(low + round(score * (total - low * len(scores))), low), high) for score in scores]
    descending = sorted(range(len(scores)), key=lambda i: -scores[i])
    ascending = sorted(range(len(scores)), key=lambda i: scores[i])
    diff = total - sum(budgets)
    while diff:
        order = descending if diff > 0 else ascending
        movable = [i for i in order if (budgets[i] < high if diff > 0 else budgets[i] > low)]
        if not movable:
            break
        for i in movable[:abs(diff)]:
            budgets[i] += 1 if diff > 0 else -1
        diff = total - sum(budgets)
    return budgets


def srh_scores(queries: torch.Tensor, query_positions: torch.Tensor, query_valid: torch.Tensor,
               keys: torch.Tensor, key_positions: torch.Tensor, held: torch.Tensor, heads: torch.Tensor,
               scale: float, kernel: int, pooling: str) -> torch.Tensor:
    """CompressKV's token scores `[n, Hkv, S]` float32 (identical across KV heads).

    queries: `[n, Hq, w, D]` the window's (after RoPE), query_positions `[n, w]`, query_valid `[n, w]`
    bool; keys: `[n, Hkv, S, D]` in position order, key_positions `[n, Hkv, S]`, held `[n, Hkv, S]`;
    heads: `[k]` the selecting query heads. A key scores the attention the window's queries pay it
    (softmax over the keys each may see), summed over the queries, for the keys before the window,
    pooled along the slots, averaged over the k heads. The window's keys get +inf, keys not held -inf.
    """
    q_heads, kv_heads = queries.shape[1], keys.shape[1]
    group = q_heads // kv_heads
    selected = queries[:, heads].float()  # [n, k, w, D]
    own_keys = keys[:, heads // group].float()  # [n, k, S, D]
    positions = key_positions[:, heads // group]  # [n, k, S]
    logits = torch.matmul(selected, own_keys.transpose(-1, -2)) * scale  # [n, k, w, S]
    visible = held[:, heads // group, None, :] & (positions[:, :, None, :] <= query_positions[:, None, :, None])
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    probs = probs * query_valid[:, None, :, None]
    first = torch.where(query_valid, query_positions, torch.iinfo(torch.long).max).amin(dim=-1)  # [n]
    before = held[:, 0] & (key_positions[:, 0] < first[:, None])  # [n, S], the keys scored
    sums = probs.sum(dim=2) * before[:, None]  # [n, k, S]
    pool = F.avg_pool1d if pooling == "avgpool" else F.max_pool1d
    pooled = pool(sums, kernel, stride=1, padding=kernel // 2)
    scores = pooled.mean(dim=1)  # [n, S]
    scores = torch.where(held[:, 0] & ~before, float("inf"), scores).masked_fill(~held[:, 0], float("-inf"))
    return scores[:, None].expand(-1, kv_heads, -1)


@dataclass(eq=False)
class CompressKVPolicy(KVPolicy):
    """CompressKV (see the module docstring for every field, extension and deviation)."""

    calibration: str | None = None
    window: int = 8
    kernel: int = 5
    pooling: str = "avgpool"
    selection_heads: int = 4
    min_layer_budget: int = 32
    max_layer_ratio: float = 3.0
    compress_every: int = 128
    n_sink: int = 0
    budget_scope: str = field(default="total", kw_only=True)

    name = "compresskv"
    schedule = "interval"
    shared_selection = True

    def __post_init__(self):
        super().__post_init__()
        checks = {
            "window >= 1": self.window >= 1, "kernel odd and >= 1": self.kernel >= 1 and self.kernel % 2 == 1,
            f"pooling in {POOLINGS}": self.pooling in POOLINGS, "selection_heads >= 1": self.selection_heads >= 1,
            "min_layer_budget >= 1": self.min_layer_budget >= 1, "max_layer_ratio >= 1": self.max_layer_ratio >= 1,
            "compress_every >= 1": self.compress_every >= 1, "n_sink >= 0": self.n_sink >= 0,
        }
        for rule, holds in checks.items():
            if not holds:
                raise UserError(f"{self.name}: needs {rule}")
        if self.calibration is not None:
            load_calibration(self.calibration, self.name, CALIBRATION)  # a bad file fails before any model loads

    # ---- what the calibration and the batch decide (once per batch) --------------------------

    def prepare(self, spec: CacheSpec) -> None:
        """The selecting heads of every layer `[L, k]` and the layer capacities, from the calibration file."""
        scores = None
        heads = torch.arange(spec.q_heads).expand(spec.layers, -1)  # no ranking: every head selects
        if self.calibration is not None:
            tensors = load_calibration(self.calibration, self.name, CALIBRATION)
            check_shape(tensors["head_scores"], (spec.layers, spec.q_heads), "head_scores")
            check_shape(tensors["layer_scores"], (spec.layers,), "layer_scores")
            order = tensors["head_scores"].float().argsort(dim=-1, descending=True, stable=True)
            heads = order[:, :min(self.selection_heads, spec.q_heads)]
            scores = tensors["layer_scores"].double().tolist()
        self.heads = heads.to(spec.device)
        self.capacities = self.budgets(spec, scores)
        self.intervals = [shrink_interval(self.name, slots, self.compress_every, least_kept=self.window + 1)
                          for slots in self.capacities]

    def budgets(self, spec: CacheSpec, scores: list[float] | None) -> list[int]:
        """Slots per layer: `layer_budgets` under `budget_scope: total` with a calibration file, else the
        budget; the budget too when it exceeds max_new_tokens. From the run's settings only, never the
        batch's prompts: a row decodes as it would alone."""
        budget = super().capacity(spec)
        # A budget above max_new_tokens covers every row whose prompt is short enough, which must then
        # hold its whole sequence (up to budget - 1 slots) in every layer: within L x budget slots only
        # uniform capacities can, and capacities are the batch's, so every row of such a run gets them.
        if scores is None or self.budget_scope == "per_layer" or budget > spec.max_new_tokens:
            return [budget] * spec.layers
        # A budget below the minimum: the minimum is the budget (the total must hold).
        return layer_budgets(scores, budget * spec.layers, min(self.min_layer_budget, budget),
                             int(self.max_layer_ratio * budget))

    def layer_capacities(self, spec: CacheSpec) -> list[int]:
        return list(self.capacities)

    def prefill_keep(self, spec: CacheSpec) -> int:
        return max(self.capacities) - 1  # each layer keeps at most its own capacity - 1

    def query_window(self) -> int:
        return self.window

    # ---- scores ------------------------------------------------------------------------------

    def prefill_scores(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       scale: float) -> torch.Tensor:
        """The prompt's scores `[B, Hkv, L]`, its last `window` queries as the window (sinks: +inf)."""
        length = q.shape[2]
        window = min(self.window, length)
        held = self.pad[:, None, :].expand(-1, k.shape[1], -1)
        positions = self.prompt_positions[:, None, :].expand_as(held)
        scores = srh_scores(q[:, :, length - window:], self.prompt_positions[:, length - window:],
                            self.pad[:, length - window:], k, positions, held, self.heads[layer], scale,
                            self.kernel, self.pooling)
        return scores.masked_fill(held & (positions < self.n_sink), float("inf"))

    def protected(self, obs: Observation) -> torch.Tensor | None:
        return obs.positions < self.n_sink if self.n_sink else None

    # ---- per-layer interval cuts (host) ------------------------------------------------------

    def begin_decode(self, positions: torch.Tensor) -> None:
        super().begin_decode(positions)
        keeps = [min(self.prefill_keep(self.spec), slots - 1) for slots in self.capacities]
        self.layer_held = [[min(n, keep) for n in self.prompt_lengths] for keep in keeps]

    def begin_serving(self, positions: torch.Tensor) -> None:
        super().begin_serving(positions)
        self.layer_held = [[IDLE] * self.spec.batch for _ in self.capacities]

    def admit(self, rows: torch.Tensor, staged: KVPolicy) -> None:
        super().admit(rows, staged)
        for mine, theirs in zip(self.layer_held, staged.layer_held, strict=True):
            for row, held in zip(rows.tolist(), theirs, strict=True):
                mine[row] = held

    def release(self, rows: list[int]) -> None:
        super().release(rows)
        for held in self.layer_held:
            for row in rows:
                held[row] = IDLE

    def after_step(self, step: int) -> None:
        """Every layer stored one token per row; the rows a layer now holds in full are cut in it."""
        for layer, (held, slots, interval) in enumerate(zip(self.layer_held, self.capacities, self.intervals,
                                                            strict=True)):
            held[:] = [n + 1 for n in held]
            full = [row for row, n in enumerate(held) if n >= slots]
            if full:
                self.cut(layer, full, slots - interval)
                for row in full:
                    held[row] = slots - interval

    @torch.no_grad()
    def cut(self, layer: int, rows: list[int], count: int) -> None:
        """Layer `layer` of `rows` (every slot held) keeps its `count` best slots, in position order."""
        self.record_peak([layer])  # the rows are full: their peak, before the cut frees slots
        index = self.row_index(rows)
        obs = Observation(self, layer, rows=index, newest=self.written(index))
        valid, positions = obs.valid, obs.positions
        queries, query_positions, query_valid = obs.queries(self.window)
        scores = srh_scores(queries, query_positions, query_valid, obs.keys, positions, valid, self.heads[layer],
                            obs.scale, self.kernel, self.pooling)
        chosen = choose_keep(scores, valid, count, self.protected(obs))
        self.slots.compact(layer, index, torch.zeros_like(valid).scatter_(-1, chosen, True) & valid)
