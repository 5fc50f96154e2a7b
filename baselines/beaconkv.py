"""BeaconKV: recent queries plus "beacon" queries, kept by farthest point sampling, score the cache.

Kim, Kim, Shim and Choi 2026, "BeaconKV: Key-Value Cache Compression Guided by Beacon Queries for
Efficient Large Reasoning Model Inference", arXiv 2609.04971 (ICML 2026). The official code
(aiha-lab/BeaconKV) could not be read here; the rule comes from full-text summaries of the paper
(Sec. 3-6, App. A/C/D); docs/methods.md, "BeaconKV", lists what is faithful and what is assumed.

Some decode queries revisit distant context (the paper's "thought revisiting tokens"); a scorer
that looks only at the newest queries evicts what they read. BeaconKV keeps, per layer and query
head, a small bank of past queries BEFORE RoPE that are geometrically diverse (farthest point
sampling, FPS, under cosine distance), and scores the cache with

    observation set = the `n_recent` newest queries (after RoPE, at their own positions)
                      + the `n_beacons` beacons, each rotated by RoPE to the CURRENT position
    score_j         = aggregate (max or mean) over the observation queries and the G query heads
                      of a KV head of softmax_j(q . k_j / sqrt(D)) over the candidate keys
                      (`softmax_over: held`: over every held key the query sees, its own
                      position and older; the beacons, at the current one, see all)

so a beacon asks which keys a revisit at this step would attend to.

The bank (a "fill-compress" cycle, paper): filled at prefill by FPS over the prompt's queries;
every decode query is appended; when the bank holds `buffer_size` (32) queries it is cut back to
`n_beacons` (16) by FPS; after every cache compression the beacons and the queries appended since
are FPS-merged back to `n_beacons` too. FPS (paper): the first point is the query least similar on
average to the whole set, each next one the farthest (cosine distance) from those chosen.

Here the appended queries are never copied: they are the newest ones, which the query history
(`longflow.history`) already holds after RoPE, so a decode step does nothing beyond the harness's
own query write and stays CUDA-graph safe; the merges run on the host between steps
(`after_step`), all layers at once, rotating the appended queries back by their own positions
(`longflow.rotary.unrotate`).

Schedule (paper, a hard cap): when a row holds `budget` slots it is cut to
floor(keep_fraction x budget) = 7/8 of it, so a compression every budget/8 generated tokens. Always
kept: the last `keep_last` (32) tokens and, with `keep_prompt`, the prompt (assumed: the paper's
"leading prefix" is not sized; RPC, its baseline, keeps the whole prompt). When the prompt and the
last tokens do not fit in the cut, the prompt's tokens compete by score. Selection per KV head.
A prompt longer than the budget: SnapKV (the harness's rule; no prefill rule is described), or with
`prefill: by_score` the score, read with the bank each layer builds from its prompt first.

Fields (`conf/method/beaconkv.yaml`): `n_recent` 16, `n_beacons` 16 (0: no bank, the paper's
(32, 0) ablation point, RPC's observation set), `buffer_size` 32,
`keep_fraction` 0.875, `keep_last` 32 (paper); `keep_prompt` true, `aggregate` max (paper; one
source reports mean better), `score_on` softmax, `softmax_over` candidates (RPC's domain; `held`:
the keys the query's attention covers), `kernel` 7 (assumptions: RPC's average pool).

Notation: n rows, Hq query heads, Hkv KV heads, G = Hq / Hkv, S slots, Q observation queries,
P points sampled, D head dim, K beacons.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from longflow.errors import UserError
from longflow.policy import IDLE, CacheSpec, KVPolicy, Observation, device_index, one_of
from longflow.rotary import rotate_half, unrotate

AGGREGATES = ("max", "mean")
SCORES_ON = ("softmax", "logits")
SOFTMAX_OVER = ("candidates", "held")
# float32 temporaries of one scoring call (the observation queries' logits over the slots) and of
# one merge (the points of the banks merged together): rows and layers are taken in chunks below it.
SCORE_BYTES = 1 << 30
TEMPORARIES = 3  # float32 tensors of a logit's size alive at once in `beacon_scores`


def rotate(x: torch.Tensor, positions: torch.Tensor, rotary: Callable) -> torch.Tensor:
    """RoPE applied at `positions`, in float32: x `[n, H, w, D]` before RoPE, positions `[n, w]`."""
    cos, sin = rotary(x.float(), positions)  # [n, w, D]
    cos, sin = cos.float()[:, None], sin.float()[:, None]
    x = x.float()
    return x * cos + rotate_half(x) * sin


def farthest_point_sampling(points: torch.Tensor, valid: torch.Tensor,
                            count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FPS under cosine distance, per leading row and head: `count` of the valid points.

    The first point is the one of least mean cosine similarity to the valid points; each next one
    maximizes the distance 1 - cos to the nearest point chosen so far. Ties go to the lowest index.
    No P x P matrix: the mean similarity is u_i . mean(u), and each pick updates the distances once.

    Args:
        points: `[n, H, P, D]`; valid: `[n, P]` bool.

    Returns:
        indices `[n, H, count]` into P, in the order picked, and picked `[n, count]` bool (False
        where a row has fewer than `count` valid points; those indices repeat valid ones).
    """
    unit = points.float() / points.float().norm(dim=-1, keepdim=True).clamp(min=1e-8)
    mask = valid[:, None, :]  # [n, 1, P]
    total = valid.sum(dim=-1)  # [n]
    mean = (unit * mask[..., None]).sum(dim=2) / total.clamp(min=1)[:, None, None]  # [n, H, D]
    similarity = (unit * mean[:, :, None]).sum(dim=-1)  # [n, H, P]
    chosen = [similarity.masked_fill(~mask, float("inf")).argmin(dim=-1)]  # [n, H]
    taken = torch.zeros_like(similarity, dtype=torch.bool)
    nearest = torch.full_like(similarity, float("inf"))
    for _ in range(count - 1):
        last = chosen[-1]
        taken.scatter_(-1, last[..., None], True)
        picked = unit.gather(2, last[..., None, None].expand(-1, -1, 1, unit.shape[-1]))  # [n, H, 1, D]
        nearest = torch.minimum(nearest, 1.0 - (unit * picked).sum(dim=-1))
        chosen.append(nearest.masked_fill(~mask | taken, float("-inf")).argmax(dim=-1))
    indices = torch.stack(chosen, dim=-1)
    return indices, torch.arange(count, device=points.device) < total[:, None]


def beacon_scores(queries: torch.Tensor, query_valid: torch.Tensor, keys: torch.Tensor,
                  candidates: torch.Tensor, domain: torch.Tensor, scale: float, *, aggregate: str,
                  score_on: str, kernel: int) -> torch.Tensor:
    """Scores of the candidate keys by the observation queries (recent and re-rotated beacons).

    Per query head h and observation query i: softmax_j(q_hi . k_j x scale) over the keys of
    query i's `domain` (`score_on: softmax`) or the logit itself (`logits`); then `aggregate` (max
    or mean) over the valid queries and the G query heads of each KV head, at the candidates; then
    an average over the `kernel` neighbouring candidate slots (slots in position order; only
    candidates are averaged).

    Args:
        queries: `[n, Hq, Q, D]` after RoPE; query_valid: `[n, Q]` bool.
        keys: `[n, Hkv, S, D]`; candidates: `[n, Hkv, S]` bool.
        domain: `[n, Hkv, Q, S]` bool (or broadcastable), the keys each query's softmax runs over;
            it holds every candidate.

    Returns:
        `[n, Hkv, S]` float32, -inf outside the candidates.
    """
    rows, q_heads, count, head_dim = queries.shape
    kv_heads = keys.shape[1]
    grouped = queries.float().view(rows, kv_heads, q_heads // kv_heads * count, head_dim)
    logits = torch.matmul(grouped, keys.float().transpose(-1, -2)) * scale  # [n, Hkv, G*Q, S]
    logits = logits.view(rows, kv_heads, q_heads // kv_heads, count, -1)
    outside = ~candidates[:, :, None, None]
    values = logits.masked_fill(~domain[:, :, None], float("-inf"))
    if score_on == "softmax":
        values = torch.softmax(values, dim=-1).nan_to_num(0.0)
    used = query_valid[:, None, None, :, None]  # [n, 1, 1, Q, 1]
    if aggregate == "max":
        score = values.masked_fill(~used, float("-inf")).amax(dim=(2, 3))
    else:
        weights = used.float().expand_as(values)
        score = (values.masked_fill(outside, 0.0) * weights).sum(dim=(2, 3)) / weights.sum(dim=(2, 3)).clamp(min=1)
    held = candidates.float()
    score = score.masked_fill(~candidates, 0.0)
    if kernel > 1:
        def pool(x):
            return F.avg_pool1d(x.flatten(0, 1)[:, None], kernel, stride=1, padding=kernel // 2).view_as(x)

        score = pool(score) / pool(held).clamp(min=1e-12)
    return score.masked_fill(~candidates, float("-inf"))


@dataclass(eq=False)
class BeaconKVPolicy(KVPolicy):
    """BeaconKV (see the module docstring for every field and assumption)."""

    n_recent: int = 16
    n_beacons: int = 16
    buffer_size: int = 32
    keep_fraction: float = 0.875
    keep_last: int = 32
    keep_prompt: bool = True
    aggregate: str = "max"
    score_on: str = "softmax"
    softmax_over: str = "candidates"
    kernel: int = 7

    name = "beaconkv"
    schedule = "interval"
    shared_selection = False

    def __post_init__(self):
        super().__post_init__()
        one_of(self.name, "aggregate", self.aggregate, AGGREGATES)
        one_of(self.name, "score_on", self.score_on, SCORES_ON)
        one_of(self.name, "softmax_over", self.softmax_over, SOFTMAX_OVER)
        if self.n_recent < 0 or self.n_beacons < 0 or self.n_recent + self.n_beacons < 1:
            raise UserError(f"{self.name}: needs n_recent, n_beacons >= 0, not both 0, got {self.n_recent}, "
                            f"{self.n_beacons}")
        if self.buffer_size <= self.n_beacons:
            raise UserError(f"{self.name}: buffer_size ({self.buffer_size}) must exceed n_beacons ({self.n_beacons})")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise UserError(f"{self.name}: kernel must be odd and >= 1, got {self.kernel}")
        if not 0.0 < self.keep_fraction < 1.0 or self.keep_last < max(1, self.n_recent):
            # The candidates must be older than every recent query, which then needs no causal mask.
            raise UserError(f"{self.name}: needs 0 < keep_fraction < 1 and keep_last >= max(1, n_recent), got "
                            f"{self.keep_fraction}, {self.keep_last}")
        if self.budget is not None:
            self.keep_after = math.floor(self.keep_fraction * self.budget)
            if self.keep_after <= self.keep_last or self.keep_after >= self.budget:
                raise UserError(f"{self.name}: budget {self.budget} too small: a compression keeps "
                                f"{self.keep_after} slots, which must exceed keep_last={self.keep_last} "
                                "and free at least one")

    def query_window(self) -> int:
        # The queries appended to the bank since its last cut are the newest ones: the history holds them.
        return max(self.n_recent, self.buffer_size - self.n_beacons) if self.n_beacons else self.n_recent

    def prepare(self, spec: CacheSpec) -> None:
        if spec.rotary is None:
            raise UserError(f"{self.name} rotates beacons to the current position: the model needs a rotary embedding")

    # ---- the beacon bank -----------------------------------------------------------------------

    def allocate(self, spec: CacheSpec) -> None:
        super().allocate(spec)
        shape = (spec.batch, spec.q_heads, self.n_beacons, spec.head_dim)
        # Beacons before RoPE, float32, per layer; a row may hold fewer than n_beacons (a short prompt).
        self.beacons = [torch.zeros(shape, dtype=torch.float32, device=spec.device) for _ in range(spec.layers)]
        self.beacon_valid = torch.zeros(spec.batch, self.n_beacons, dtype=torch.bool, device=spec.device)
        self.prompt_end = torch.zeros(spec.batch, dtype=torch.long, device=spec.device)
        self.appended = [0] * spec.batch  # queries appended to each row's bank since its last cut (host)

    def begin_prefill(self, pad: torch.Tensor, positions: torch.Tensor) -> None:
        super().begin_prefill(pad, positions)
        self.prompt_end.copy_(pad.sum(dim=-1))

    def store_prompt(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> None:
        """The bank (FPS over the prompt's queries before RoPE), then the prompt's slots (the base
        class): a prompt cut by `prefill: by_score` is scored with this layer's own bank."""
        if self.n_beacons:
            points = unrotate(q, self.prompt_positions, self.spec.rotary)  # [B, Hq, L, D]
            indices, picked = farthest_point_sampling(points, self.pad, self.n_beacons)
            self.beacons[layer].copy_(points.gather(2, indices[..., None].expand(-1, -1, -1, points.shape[-1])))
            self.beacon_valid.copy_(picked)
        super().store_prompt(layer, q, k, v, scale)

    def begin_decode(self, positions: torch.Tensor) -> None:
        super().begin_decode(positions)
        self.appended = [0] * self.spec.batch

    def begin_serving(self, positions: torch.Tensor) -> None:
        super().begin_serving(positions)
        self.appended = [0] * self.spec.batch

    def admit(self, rows: torch.Tensor, staged: BeaconKVPolicy) -> None:
        super().admit(rows, staged)
        for mine, theirs in zip(self.beacons, staged.beacons, strict=True):
            mine.index_copy_(0, rows, theirs)
        self.beacon_valid.index_copy_(0, rows, staged.beacon_valid)
        self.prompt_end.index_copy_(0, rows, staged.prompt_end)
        for row in rows.tolist():
            self.appended[row] = 0

    def after_step(self, step: int) -> None:
        """Every row appended one query: compress the full rows (merging their banks first), then
        cut the banks that reached `buffer_size`."""
        self.appended = [n + 1 for n in self.appended]
        super().after_step(step)
        due = [row for row, n in enumerate(self.appended)
               if n >= self.buffer_size - self.n_beacons and self.held[row] != IDLE and self.n_beacons]
        if due:
            self.merge(due)

    @torch.no_grad()
    def merge(self, rows: list[int]) -> None:
        """Beacons and the queries appended since the last cut, FPS-reduced back to `n_beacons`, in
        every layer (host hook, between steps): layers in groups of at most SCORE_BYTES of points."""
        spec = self.spec
        index = device_index(rows, spec.device)
        window = self.buffer_size - self.n_beacons
        newest = self.written(index)
        appended = device_index([min(self.appended[row], window) for row in rows], spec.device)
        positions = newest[:, None] - window + 1 + torch.arange(window, device=spec.device)  # [n, w]
        fresh = (positions >= 0) & (torch.arange(window, device=spec.device) >= window - appended[:, None])
        point_valid = torch.cat([self.beacon_valid.index_select(0, index), fresh], dim=-1)  # [n, K + w]
        per_layer = len(rows) * spec.q_heads * self.buffer_size * spec.head_dim * 4
        group = max(1, SCORE_BYTES // per_layer)
        for start in range(0, spec.layers, group):
            layers = range(start, min(spec.layers, start + group))
            recent = torch.cat([self.history.recent(layer, newest, index, window)[0] for layer in layers])
            recent = unrotate(recent, positions.clamp(min=0).repeat(len(layers), 1), spec.rotary)
            beacons = torch.cat([self.beacons[layer].index_select(0, index) for layer in layers])
            points = torch.cat([beacons, recent], dim=2)  # [g * n, Hq, K + w, D]
            indices, picked = farthest_point_sampling(points, point_valid.repeat(len(layers), 1), self.n_beacons)
            kept = points.gather(2, indices[..., None].expand(-1, -1, -1, points.shape[-1]))
            for j, layer in enumerate(layers):
                self.beacons[layer].index_copy_(0, index, kept[j * len(rows):(j + 1) * len(rows)])
        self.beacon_valid.index_copy_(0, index, picked[:len(rows)])
        for row in rows:
            self.appended[row] = 0

    @torch.no_grad()
    def compress(self, rows: list[int]) -> None:
        if self.n_beacons:  # the paper merges after a compression; here first, so the cut reads the merged bank
            self.merge(rows)
        super().compress(rows)

    # ---- the score -------------------------------------------------------------------------------

    def protected(self, obs: Observation) -> torch.Tensor:
        """The last `keep_last` tokens, and with `keep_prompt` the prompt when it fits in the cut."""
        rows = self._rows(obs)
        newest = obs.newest[:, None, None]
        positions, valid = obs.positions, obs.valid
        protect = valid & (positions > newest - self.keep_last)
        if self.keep_prompt:
            prompt = valid & (positions < self.prompt_end.index_select(0, rows)[:, None, None])
            fits = prompt.sum(dim=-1, keepdim=True) + self.keep_last <= self.keep_after  # [n, Hkv, 1]
            protect = protect | (prompt & fits)
        return protect

    def score(self, obs: Observation) -> torch.Tensor:
        """`[n, Hkv, S]`: `beacon_scores` of the unprotected held slots by the `n_recent` newest
        queries and the beacons rotated to the newest position."""
        rows = self._rows(obs)
        newest = obs.newest
        queries, query_valid, query_positions = [], [], []
        if self.n_recent:
            recent, positions, recent_valid = self.history.recent(obs.layer, newest, rows, self.n_recent)
            queries.append(recent.float())
            query_valid.append(recent_valid)
            query_positions.append(positions)
        if self.n_beacons:
            beacons = self.beacons[obs.layer].index_select(0, rows)
            at_newest = newest[:, None].expand(-1, self.n_beacons)
            queries.append(rotate(beacons, at_newest, self.spec.rotary))
            query_valid.append(self.beacon_valid.index_select(0, rows))
            query_positions.append(at_newest)
        queries, query_valid = torch.cat(queries, dim=2), torch.cat(query_valid, dim=-1)
        candidates = obs.valid & ~self.protected(obs)
        if self.softmax_over == "candidates":
            domain = candidates[:, :, None]  # [n, Hkv, 1, S]
        else:  # causal: a recent query sees no newer key (the candidates are older than all of them)
            seen = obs.positions[:, :, None, :] <= torch.cat(query_positions, dim=-1)[:, None, :, None]
            domain = obs.valid[:, :, None] & seen  # [n, Hkv, Q, S]
        keys = obs.keys
        step = max(1, SCORE_BYTES // (TEMPORARIES * 4 * queries.shape[1] * queries.shape[2] * keys.shape[2]))
        return torch.cat([
            beacon_scores(queries[i:i + step], query_valid[i:i + step], keys[i:i + step], candidates[i:i + step],
                          domain[i:i + step], obs.scale, aggregate=self.aggregate, score_on=self.score_on,
                          kernel=self.kernel)
            for i in range(0, len(rows), step)
        ])

    def _rows(self, obs: Observation) -> torch.Tensor:
        return obs.rows if obs.rows is not None else torch.arange(self.spec.batch, device=self.spec.device)
