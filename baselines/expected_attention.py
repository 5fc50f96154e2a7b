"""Expected Attention: keep the keys that future queries are expected to attend to most.

Devoto et al. 2025, "Expected Attention: KV Cache Compression by Estimating Attention from Future
Queries Distribution", arXiv:2510.00636 (the kvpress authors; the formulas as kvpress's
`ExpectedAttentionPress`, the decode schedule as its `DecodingPress`); docs/methods.md,
"Expected Attention".

Queries before RoPE are modelled as a Gaussian per query head h: mean mu_h and covariance
Sigma_h of the recent queries (the `n_queries` newest, recovered from the stored queries after
RoPE by rotating each back by its own position, so no model change is needed; the first `n_sink`
positions' queries left out). RoPE over the next `n_future_positions` positions is averaged into
one matrix R (from the model's own rotary embedding), and for every held key k_j (after RoPE):

    z_hj    = k_j . (R mu_h) / sqrt(D) + k_j^T (R Sigma_h R^T) k_j / (2 D)
    score_j = (mean over the G query heads of KV head kv(h) of softmax_j(z_hj) + epsilon) * ||v_j||_2

the softmax over the held keys outside the first `n_sink` positions, which are always kept. An
interval method: every `compress_every` steps (512, `DecodingPress`'s interval) a full cache keeps
its budget - compress_every best keys per KV head, in position order. A prompt longer than the
budget is scored the same way from the prompt's own queries, keeping budget - 1 tokens.

Fields: `compress_every`, `n_future_positions` (512), `n_sink` (4), `use_covariance` (true),
`use_vnorm` (true), `epsilon` (0; AMS uses 0.01), `n_queries` (256, `DecodingPress`'s buffer),
`query_stats`: a calibration file of query statistics (`query_mean` `[layers, Hq, D]`,
`query_cov` `[layers, Hq, D, D]`, before RoPE), used instead of the recent queries, as kvpress's
`ExpectedAttentionStatsPress`; then no query is stored.

Deviations from kvpress: the future positions are the absolute ones (newest + 1 ...), where its
decoding press counts them from the length of its hidden-state buffer; its decoding statistics
leave out the 4 oldest buffered states, here the queries of the first `n_sink` positions (the same
at prefill); queries are the stored ones, not recomputed from hidden states (the same values);
float32 throughout; the sinks' score is the maximum of their row (kvpress: of the batch).

Notation: n rows, Hq query heads, Hkv KV heads, G = Hq / Hkv, S slots, w queries, f future
positions, D head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from longflow.calibration import check_shape, load_calibration
from longflow.errors import UserError
from longflow.policy import CacheSpec, KVPolicy, Observation, keep_after_cut
from longflow.rotary import mean_rotation, unrotate
from longflow.selection import sink_mask

SCORE_BYTES = 1 << 30  # the k^T Sigma k temporaries scored in one call
STATS = ("query_mean", "query_cov")


def query_statistics(queries: torch.Tensor, valid: torch.Tensor,
                     covariance: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mean `[n, Hq, D]` and (population) covariance `[n, Hq, D, D]` of the valid queries.

    queries: `[n, Hq, w, D]` float32 before RoPE; valid: `[n, w]` bool.
    """
    weight = valid[:, None, :, None].float()
    count = valid.sum(dim=-1).clamp(min=1)[:, None, None].float()  # [n, 1, 1]
    mean = (queries * weight).sum(dim=2) / count
    if not covariance:
        return mean, None
    centered = (queries - mean[:, :, None]) * weight
    return mean, torch.matmul(centered.transpose(-1, -2), centered) / count[..., None]


def expected_attention_scores(keys: torch.Tensor, values: torch.Tensor, scored: torch.Tensor, mean: torch.Tensor,
                              cov: torch.Tensor | None, rotation: torch.Tensor, use_vnorm: bool,
                              epsilon: float) -> torch.Tensor:
    """Expected-attention scores `[n, Hkv, S]` float32, -inf where not `scored`.

    keys, values: `[n, Hkv, S, D]` (keys after RoPE); scored: `[n, Hkv, S]` bool; mean `[n, Hq, D]`
    and cov `[n, Hq, D, D]` (or None): query statistics before RoPE; rotation: `[n, D, D]`, the
    averaged future RoPE.
    """
    rows, kv_heads, slots, head_dim = keys.shape
    group = mean.shape[1] // kv_heads
    mean = torch.einsum("nij,nhj->nhi", rotation, mean).view(rows, kv_heads, group, 1, head_dim)
    keys = keys.float()
    logits = torch.matmul(mean, keys[:, :, None].transpose(-1, -2))[..., 0, :] / math.sqrt(head_dim)  # [n, Hkv, G, S]
    if cov is not None:
        cov = torch.matmul(rotation[:, None], torch.matmul(cov, rotation[:, None].transpose(-1, -2)))
        cov = cov.view(rows, kv_heads, group, head_dim, head_dim)
        quadratic = (torch.matmul(keys[:, :, None], cov) * keys[:, :, None]).sum(dim=-1)  # [n, Hkv, G, S]
        logits = logits + quadratic / head_dim / 2
    logits = logits.masked_fill(~scored[:, :, None], float("-inf"))
    scores = torch.softmax(logits, dim=-1).nan_to_num(0.0).mean(dim=2)  # [n, Hkv, S]
    if use_vnorm:
        scores = (scores + epsilon) * values.float().norm(dim=-1)
    return scores.masked_fill(~scored, float("-inf"))


@dataclass(eq=False)
class ExpectedAttentionPolicy(KVPolicy):
    """Expected Attention (see the module docstring for every field and deviation)."""

    compress_every: int = 512
    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    n_queries: int = 256
    query_stats: str | None = None

    name = "expected_attention"
    schedule = "interval"
    shared_selection = False

    def __post_init__(self):
        super().__post_init__()
        for field in ("compress_every", "n_future_positions", "n_queries"):
            if getattr(self, field) < 1:
                raise UserError(f"{self.name}: {field} must be >= 1, got {getattr(self, field)}")
        if self.n_sink < 0 or self.epsilon < 0:
            raise UserError(f"{self.name}: n_sink and epsilon must be >= 0, got {self.n_sink}, {self.epsilon}")
        if self.query_stats is not None:
            load_calibration(self.query_stats, self.name, STATS)  # a bad file fails before any model loads
        if self.budget is not None:
            # least_kept: a compression must keep more than the sinks
            self.keep_after = keep_after_cut(self.name, self.budget, self.compress_every, least_kept=self.n_sink + 1)

    def query_window(self) -> int:
        return 0 if self.query_stats is not None else self.n_queries

    def prepare(self, spec: CacheSpec) -> None:
        if spec.rotary is None:
            raise UserError(f"{self.name} averages RoPE over future positions: the model needs a rotary embedding")
        self.stats = None
        if self.query_stats is not None:
            stats = load_calibration(self.query_stats, self.name, STATS)
            check_shape(stats["query_mean"], (spec.layers, spec.q_heads, spec.head_dim), "query_mean")
            check_shape(stats["query_cov"], (spec.layers, spec.q_heads, spec.head_dim, spec.head_dim), "query_cov")
            self.stats = {key: value.to(spec.device, torch.float32) for key, value in stats.items()}

    # ---- scores ---------------------------------------------------------------------------------

    def score(self, obs: Observation) -> torch.Tensor:
        """At a compression: statistics of the `n_queries` newest queries (or the calibration file's)."""
        rows = obs.keys.shape[0]
        if self.stats is not None:
            mean = self.stats["query_mean"][obs.layer].expand(rows, -1, -1)
            cov = self.stats["query_cov"][obs.layer].expand(rows, -1, -1, -1) if self.use_covariance else None
        else:
            queries, positions, valid = obs.queries(self.n_queries)
            valid = valid & (positions >= self.n_sink)
            mean, cov = query_statistics(unrotate(queries, positions.clamp(min=0), obs.spec.rotary), valid,
                                         self.use_covariance)
        return self._scores(obs.keys, obs.values, obs.valid, obs.positions, obs.newest, mean, cov, obs.spec.rotary)

    def protected(self, obs: Observation) -> torch.Tensor:
        return sink_mask(obs.positions, self.n_sink)

    def prefill_scores(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """The prompt scored from its own queries (all of them after the sinks), sinks on top."""
        positions = self.prompt_positions  # [B, L]
        valid = self.pad & (positions >= self.n_sink)
        if self.stats is not None:
            mean = self.stats["query_mean"][layer].expand(q.shape[0], -1, -1)
            cov = self.stats["query_cov"][layer].expand(q.shape[0], -1, -1, -1) if self.use_covariance else None
        else:
            mean, cov = query_statistics(unrotate(q, positions, self.spec.rotary), valid, self.use_covariance)
        held = self.pad[:, None, :].expand(-1, k.shape[1], -1)
        key_positions = positions[:, None, :].expand_as(held)
        scores = self._scores(k, v, held, key_positions, self.pad.sum(dim=-1) - 1, mean, cov, self.spec.rotary)
        return scores.masked_fill(held & sink_mask(key_positions, self.n_sink), float("inf"))

    def _scores(self, keys, values, held, positions, newest, mean, cov, rotary) -> torch.Tensor:
        """Scores `[n, Hkv, S]` over row chunks of at most SCORE_BYTES of temporaries; the sinks held get
        their row's maximum (they rank first among equals; `protected` keeps them anyway)."""
        rows, kv_heads, slots, head_dim = keys.shape
        future = newest[:, None] + 1 + torch.arange(self.n_future_positions, device=keys.device)  # [n, f]
        rotation = mean_rotation(rotary, future, head_dim)
        step = max(1, SCORE_BYTES // (mean.shape[1] * slots * head_dim * 4))
        scored = held & (positions >= self.n_sink)
        scores = torch.cat([
            expected_attention_scores(keys[i:i + step], values[i:i + step], scored[i:i + step], mean[i:i + step],
                                      None if cov is None else cov[i:i + step], rotation[i:i + step],
                                      self.use_vnorm, self.epsilon)
            for i in range(0, rows, step)
        ])
        best = scores.masked_fill(~scored, float("-inf")).flatten(1).amax(dim=1)[:, None, None]  # [n, 1, 1]
        return torch.where(held & ~scored, best.expand_as(scores), scores)
