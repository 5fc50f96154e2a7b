"""AMS: adaptive mass-segmented compression, a quota layer over any scorer.

Yang & Shen 2026, "Adaptive Mass-Segmented KV Compression for Long-Context Reasoning",
arXiv:2605.23200 (official code: EIT-NLP/AdaptiveMassSegment, a kvpress fork,
`kvpress/presses/adaptive_segment_head_press.py`, defaults `evaluation/evaluate_registry.py`;
docs/methods.md, "AMS").

An interval method: every `compress_every` steps (512) a full cache of T = budget slots keeps
t = budget - compress_every, per KV head, in position order. At each compression, per layer:

  1. window evidence: the attention of the last W = min(`window_size`, I - 1, T - 1, t) queries
     (causal) over the slots before the window (I: the interval in force, the decode queries the
     official trigger has buffered at a compression, at most its buffer of 256), averaged over the
     W queries, average-pooled over `window_kernel` (5) neighbours, averaged over the G query heads
     of each KV head; the W window slots get the maximum of the row;
  2. mass = normalize(relu(evidence) + 1e-12) over the slots; with `use_credit`, a per-slot credit
     (kept in the cache, moved with its slot, 0 for a new token) becomes `credit_decay` x credit +
     (1 - credit_decay) x mass, and the mass used is normalize(`mix_beta` x mass + (1 - mix_beta) x
     normalize(credit));
  3. segments: cut where the cumulative mass crosses `segment_mass` (0.02), 2 x 0.02, ... (cuts
     clamped to [1, T - 1]); segments longer than `max_seg_len` (1024) split; segments shorter
     than `min_seg_len` (32) merged with their successors until long enough;
  4. quotas: min(`min_keep_per_segment` (8), length) each, the rest of t shared in proportion to
     the segments' mass (rounded, capped by length), then +-1 round-robin in segment order until
     the quotas sum to t (decrements never below a segment's minimum);
  5. candidates: the top-quota slots of each segment by the scorer's score (`scorer`: any
     stateless method of this harness: TOVA, KeyDiff, Expected Attention, R-KV, LongFlow);
  6. kept: the first `n_sink` (4) and last `always_keep_last` (32) slots, then the best
     candidates by the score (all non-kept slots instead, when the candidates are too few), by
     the selection rule of every method (`longflow.selection.choose_keep`).

A prompt longer than the budget is cut by SnapKV (AMS has no prefill rule), per KV head.

Defaults are the paper runs' (`AMS_DEFAULTS` of the official registry), not the press class's
own (which has min_seg_len 64, max_seg_len 2048, no sinks, nothing kept last).

Deviations from the official code:
  - The segmentation is per row (`segment_over: row`); the official one is computed from the
    mass averaged over the batch, which makes a row depend on its batch-mates (the same at batch
    size 1). `segment_over: batch` replicates it over the rows compressed together.
  - The window queries are the stored ones, after RoPE at their own positions; the official code
    recomputes them from buffered hidden states and rotates all W with the current token's angle.
    Scores and masses are float32 (official: the model dtype). The window slots' evidence is the
    maximum of the row (official: of the batch).
  - A row is compressed when its cache is full (every compress_every steps); the official trigger
    counts decode steps per layer and compresses whatever exceeds the target.
  - The official quota loop never ends when more segments than t exist and each holds one slot;
    here the quotas then stop at one per segment and the final selection takes the best t.
  - Scorers: TOVA scores the newest token by its own attention (kvpress pads it with the
    maximum); R-KV is this harness's (the R-KV authors' code: logits max over a group, redundancy
    over all held keys), where the AMS code's RKVPress averages probabilities over the group and
    protects the first 4 and last 8 tokens; Expected Attention's future positions are absolute.

Notation: n rows, Hkv KV heads, G = Hq / Hkv, T slots (all held at a compression), W window, N
lines (rows x KV heads, or KV heads), K segments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from longflow.errors import UserError
from longflow.policy import CacheSpec, KVPolicy, Observation, keep_after_cut
from longflow.selection import choose_keep, chosen_mask
from longflow.slots import SlotState

SEGMENT_OVER = ("row", "batch")
# The official trigger (`DecodingPress.hidden_states_buffer_size`, AMS_DEFAULTS) buffers at most this
# many decode hidden states, from which the press recomputes its window queries.
HIDDEN_STATES_BUFFER = 256


def to_mass(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """relu(x) + eps, normalised to sum 1 over the last dimension."""
    x = torch.relu(x) + eps
    return x / x.sum(dim=-1, keepdim=True)


def window_evidence(queries: torch.Tensor, query_positions: torch.Tensor, keys: torch.Tensor,
                    key_positions: torch.Tensor, kernel: int) -> torch.Tensor:
    """AMS's segmentation signal `[n, Hkv, T]` float32.

    queries: `[n, Hq, W, D]` (after RoPE), query_positions `[n, W]`; keys: `[n, Hkv, T, D]` in
    position order, the last W being the window's tokens; key_positions `[n, Hkv, T]`. Softmax over
    all keys a query may see (position <= its own) of q.k / sqrt(D); the W window slots get the
    row's maximum.
    """
    rows, q_heads, window, head_dim = queries.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    grouped = queries.float().view(rows, kv_heads, q_heads // kv_heads, window, head_dim)
    logits = torch.matmul(grouped, keys.float()[:, :, None].transpose(-1, -2)) / head_dim ** 0.5  # [n, Hkv, G, W, T]
    visible = key_positions[:, :, None, None, :] <= query_positions[:, None, None, :, None]
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
    scores = probs[..., :slots - window].mean(dim=3)  # [n, Hkv, G, T - W]
    if kernel > 1:
        flat = scores.flatten(0, 2)[:, None]
        scores = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2).view_as(scores)
    scores = scores.mean(dim=2)  # [n, Hkv, T - W]
    best = scores.flatten(1).amax(dim=1)[:, None, None].expand(-1, kv_heads, window)
    return torch.cat([scores, best], dim=-1)


def segments(mass: torch.Tensor, step: float, min_len: int, max_len: int) -> torch.Tensor:
    """Segment index of every slot, `[N, T]` int64 (0, 1, ... in slot order), from `[N, T]` masses.

    Cuts where the cumulative mass reaches step, 2 step, ... < 1 (first index at or above, clamped
    to [1, T - 1]); then every segment longer than `max_len` split from its start; then each
    segment shorter than `min_len` merged with its successors until long enough (the last may stay
    short). The merge is a scan over the segments, vectorised over the lines, of as many passes as
    the most segments of min_len a line can hold (each pass moves a line's scan on by at least
    min_len; a finished line stays put), so that no pass asks the device whether to go on.
    """
    lines, slots = mass.shape
    device = mass.device
    targets = torch.arange(step, 1.0, step, dtype=mass.dtype, device=device)
    cuts = torch.searchsorted(mass.cumsum(dim=-1), targets.expand(lines, -1).contiguous()).clamp(1, slots - 1)
    boundary = torch.zeros(lines, slots + 1, dtype=torch.bool, device=device)
    boundary[:, 0] = True  # two fills, not an index list (a copy from host memory the host waits on)
    boundary[:, slots] = True
    boundary.scatter_(1, cuts, True)
    index = torch.arange(slots + 1, device=device).expand(lines, -1)
    start = torch.where(boundary, index, 0).cummax(dim=1).values  # start of each position's segment
    offset = index - start
    boundary |= (offset > 0) & (offset % max_len == 0)
    # Next boundary at or after each position; a merged segment ends at the first one min_len on.
    following = torch.where(boundary, index, slots).flip(1).cummin(dim=1).values.flip(1)  # [N, T + 1]
    kept = torch.zeros_like(boundary)
    kept[:, 0] = True
    begin = torch.zeros(lines, dtype=torch.long, device=device)
    for _ in range(-(-slots // min_len)):
        end = following.gather(1, (begin + min_len).clamp(max=slots)[:, None])[:, 0]
        end = torch.where(begin < slots, end, slots)
        kept.scatter_(1, end[:, None], True)
        begin = end
    return kept[:, :slots].long().cumsum(dim=1) - 1


def round_robin(capacity: torch.Tensor, count: torch.Tensor, most: int) -> torch.Tensor:
    """Units given one at a time to the segments in order, pass after pass, to those with capacity
    left, until `count` `[N]` are given (or none has capacity): the units each got, `[N, K]`.

    P full passes give min(capacity, P) each; P is the largest with sum <= count, found by
    bisection (over [0, `most`], a host bound of the capacities: a bisection step past convergence
    changes nothing); the remainder goes to the first segments with capacity > P.
    """
    low = torch.zeros_like(count)
    high = capacity.amax(dim=-1)
    for _ in range(most.bit_length() + 1):
        middle = (low + high + 1) // 2
        fits = torch.minimum(capacity, middle[:, None]).sum(dim=-1) <= count
        low = torch.where(fits, middle, low)
        high = torch.where(fits, high, middle - 1)
    given = torch.minimum(capacity, low[:, None])
    left = count - given.sum(dim=-1)
    eligible = capacity > low[:, None]
    extra = eligible & (eligible.long().cumsum(dim=-1) <= left[:, None])
    return given + extra.long()


def quotas(segment: torch.Tensor, mass: torch.Tensor, keep: int, min_keep: int) -> torch.Tensor:
    """Slots kept per segment, `[N, K]` (K = T, the most segments a line can have, known without
    reading the device; empty ones get 0)."""
    lines, width = segment.shape
    length = torch.zeros(lines, width, dtype=torch.long, device=segment.device).scatter_add_(
        1, segment, torch.ones_like(segment))
    weight = torch.zeros(lines, width, dtype=mass.dtype, device=mass.device).scatter_add_(1, segment, mass)
    floor = torch.minimum(length, torch.full_like(length, min_keep))
    base = floor.sum(dim=-1)
    # More guaranteed slots than t: down to one per segment, round-robin.
    over = (base - keep).clamp(min=0)
    shrunk = floor - round_robin((floor - 1).clamp(min=0), over, width)
    # Otherwise the rest by mass, then +-1 round-robin to exactly t.
    rest = (keep - base).clamp(min=0)
    weight = weight.double()  # the official shares are Python floats
    share = torch.round(rest[:, None] * (weight / (weight.sum(dim=-1, keepdim=True) + 1e-12))).long()
    shared = torch.minimum(length, floor + share)
    total = shared.sum(dim=-1)
    shared = shared - round_robin(shared - floor, (total - keep).clamp(min=0), width)
    shared = shared + round_robin(length - shared, (keep - total).clamp(min=0), width)
    return torch.where((base >= keep)[:, None], shrunk, shared)


def candidates(score: torch.Tensor, segment: torch.Tensor, quota: torch.Tensor) -> torch.Tensor:
    """`[N, T]` bool: the top-quota slots of each segment by `score` `[N, T]` (ties: the lower slot)."""
    by_score = score.argsort(dim=-1, descending=True, stable=True)
    order = by_score.gather(-1, segment.gather(-1, by_score).argsort(dim=-1, stable=True))  # by segment, then score
    grouped = segment.gather(-1, order)
    first = torch.searchsorted(grouped, grouped, right=False)  # where each segment begins in `order`
    rank = torch.arange(score.shape[-1], device=score.device) - first
    chosen = rank < quota.gather(-1, grouped)
    return torch.zeros_like(chosen).scatter_(-1, order, chosen)


@dataclass(eq=False)
class AMSPolicy(KVPolicy):
    """AMS (see the module docstring for every field and deviation)."""

    scorer: KVPolicy | None = None
    compress_every: int = 512
    window_size: int = 32
    window_kernel: int = 5
    segment_mass: float = 0.02
    min_seg_len: int = 32
    max_seg_len: int = 1024
    min_keep_per_segment: int = 8
    n_sink: int = 4
    always_keep_last: int = 32
    use_credit: bool = True
    credit_decay: float = 0.8
    mix_beta: float = 0.7
    segment_over: str = "row"

    name = "ams"
    schedule = "interval"
    shared_selection = False

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.scorer, KVPolicy) or isinstance(self.scorer, AMSPolicy):
            raise UserError(f"{self.name}: scorer must be a method config (`_target_` of a KV method other "
                            f"than AMS), got {self.scorer!r}")
        if self.scorer.slot_state() or getattr(self.scorer, "variant", "paper") != "paper":
            raise UserError(f"{self.name}: the scorer {self.scorer.name!r} keeps state or is a variant other than "
                            "paper; AMS scores its slots only at its compressions")
        checks = {
            "compress_every >= 1": self.compress_every >= 1, "window_size >= 1": self.window_size >= 1,
            "window_kernel odd and >= 1": self.window_kernel >= 1 and self.window_kernel % 2 == 1,
            "0 < segment_mass <= 1": 0 < self.segment_mass <= 1,
            "1 <= min_seg_len <= max_seg_len": 1 <= self.min_seg_len <= self.max_seg_len,
            "min_keep_per_segment >= 0": self.min_keep_per_segment >= 0,
            "n_sink, always_keep_last >= 0": self.n_sink >= 0 and self.always_keep_last >= 0,
            "0 <= credit_decay < 1": 0 <= self.credit_decay < 1, "0 <= mix_beta <= 1": 0 <= self.mix_beta <= 1,
            f"segment_over in {SEGMENT_OVER}": self.segment_over in SEGMENT_OVER,
        }
        for rule, holds in checks.items():
            if not holds:
                raise UserError(f"{self.name}: needs {rule}")
        if self.budget is not None:
            self.keep_after = keep_after_cut(self.name, self.budget, self.compress_every, least_kept=2)

    def slot_state(self) -> dict[str, SlotState]:
        return {"credit": SlotState()} if self.use_credit else {}

    def query_window(self) -> int:
        return max(self.window_size, self.scorer.query_window())

    def prepare(self, spec: CacheSpec) -> None:
        self.scorer.prepare(spec)

    def keep_mask(self, obs: Observation, count: int) -> torch.Tensor:
        """The slots a compression keeps, `[n, Hkv, T]` bool (see the module docstring, steps 1-6)."""
        keys, positions = obs.keys, obs.positions
        rows, kv_heads, slots, _ = keys.shape
        # The official window stops one short of the queries buffered since the last compression (one
        # interval), which bounds it when the interval is at most `window_size`.
        buffered = min(self.budget - self.keep_after, HIDDEN_STATES_BUFFER)
        window = min(self.window_size, max(buffered - 1, 1), slots - 1, count)
        queries, query_positions, _ = obs.queries(window)
        evidence = window_evidence(queries, query_positions, keys, positions, self.window_kernel)
        score = self.scorer.score(obs).expand(rows, kv_heads, slots).float()
        mass = to_mass(evidence)
        if self.use_credit:
            credit = self.credit_decay * obs.state("credit") + (1 - self.credit_decay) * mass
            if obs.rows is None:
                obs.slots.state["credit"].copy_(credit)
            else:
                obs.slots.state["credit"].index_copy_(0, obs.rows, credit)
            mass = to_mass(self.mix_beta * mass + (1 - self.mix_beta) * to_mass(credit))
        lines = to_mass(mass.mean(dim=0) if self.segment_over == "batch" else mass.flatten(0, 1))  # [N, T]
        segment = segments(lines, self.segment_mass, self.min_seg_len, self.max_seg_len)
        quota = quotas(segment, lines, count, self.min_keep_per_segment)
        if self.segment_over == "batch":  # one segmentation per KV head, shared by the rows
            segment = segment.expand(rows, -1, -1).flatten(0, 1)
            quota = quota.expand(rows, -1, -1).flatten(0, 1)
        chosen = candidates(score.flatten(0, 1), segment, quota).view(rows, kv_heads, slots)
        last = min(self.always_keep_last, count)
        sinks = min(self.n_sink, count - last)
        index = torch.arange(slots, device=keys.device)
        must = ((index < sinks) | (index >= slots - last)).expand(rows, kv_heads, slots)
        need = count - min(slots, sinks + last)  # |must| from the host's sizes (sinks <= count - last)
        enough = ((chosen & ~must).sum(dim=-1, keepdim=True) >= need)  # else: the best of every other slot
        allowed = torch.where(enough, chosen | must, torch.ones_like(must))
        return chosen_mask(choose_keep(score, allowed, count, protect=must), obs.valid)
