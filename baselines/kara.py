"""Kara (and KvLLM): each window of generated tokens compressed once, by attention inside the window.

Han & Wu 2026, "Kara: Efficient Reasoning LLM Serving via Sliding-Window KV Cache Compression",
arXiv 2607.01237 (no official code). A RECONSTRUCTION from the abstract, two secondary summaries
and a full-text note on its Sec. 3.1-3.3 and 4; every rule marked (A) below is an assumption, a
named field here (docs/methods.md, "Kara").

Generated tokens are grouped into consecutive windows of W (`window`) tokens. When a window is
complete it is scored once and never again (nor is the prompt):

    p_ij    = softmax_j(q_i . k_j * scale) over the window's keys, NO causal mask (i, j in the window)
    score_j = sum over the window's queries i and the query heads h of p_hij

summed over every query head of the layer (one selection per layer, `per_kv_head: false`, (A)) or
over the G heads of each KV head (`per_kv_head: true`). Token2Chunk (`token2chunk`) then keeps
quota = ceil(`ratio` * W) tokens of the window: the top-quota tokens are the candidates; each pair
of consecutive candidates (by position) spanning at most `chunk_width` tokens whose weaker endpoint
scores at least the `endpoint_quantile` quantile of the candidates' scores is a chunk; chunks are
accepted best first (by the weaker endpoint's score, (A)) while their tokens fit a chunk budget of
floor(`chunk_budget` * quota) tokens, and every token inside an accepted chunk is kept; the rest of
the quota is filled with the best single tokens.

Budget (`budget_mode`):
  - `ratio` (the paper's, not memory-fair): the non-kept tokens of a window are freed at once; the
    prompt is kept whole; the cache grows as prompt + quota per window + the open window, so the
    run's budget bounds nothing; the peak is recorded. The slots are allocated for the worst case,
    padded prompt + ceil(max_new_tokens / W) * quota + W.
  - `cap` (default, a deviation): the budget is a hard cap. A scored window's tokens stay held,
    ranked: Token2Chunk's kept tokens above its dropped ones, each by its score normalised to sum
    1 over its window (so that windows compare; `history_eviction: fifo` ranks by age instead);
    the prompt ranks above every scored token. When a window completes and the cache could not
    hold the next one (min(W, tokens still to be stored) slots; the output's last token never
    is), the lowest-ranked tokens are freed until it can. A window's dropped tokens therefore go
    first, as the paper drops them, but only when the memory is needed: with a budget that holds
    the whole sequence nothing is evicted (the full cache's tokens). W shrinks to a quarter of the
    budget when an open window would take more than half of it (`shrink_interval`); a prompt
    longer than budget - W is cut at prefill by SnapKV (the harness's rule for methods without a
    prompt rule).

How it maps onto the slot cache: an interval schedule (decode attention without probabilities,
every token into the first free slot); the W newest post-RoPE queries of each layer come from the
query history; at a window's end (`after_step`, host-side, counted per row, so rows need not be in
step) each layer's slots are re-ranked and compacted in position order (`SlotCache.compact`).

Notation: n rows, Hq query heads, Hkv KV heads, G = Hq / Hkv, W window, S slots, D head dim, N lines
(rows x KV heads), m candidates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from longflow.errors import UserError
from longflow.policy import IDLE, CacheSpec, KVPolicy, Observation, shrink_interval
from longflow.selection import choose_keep
from longflow.slots import SlotState

BUDGET_MODES = ("cap", "ratio")
HISTORY_EVICTIONS = ("score", "fifo")
RANK = "rank"  # per-slot state: the prompt +inf, a scored token (kept: 1 +) its normalised score


def window_scores(queries: torch.Tensor, keys: torch.Tensor, scale: float, shared: bool) -> torch.Tensor:
    """Bidirectional attention each window token receives from the whole window.

    queries: `[n, Hq, W, D]` and keys: `[n, Hkv, W, D]`, both of the window's tokens in position order
    (after RoPE). Softmax over the W keys with no causal mask, summed over the W queries and the G
    query heads of each KV head; `shared`: summed over all heads (identical across KV heads).

    Returns `[n, Hkv, W]` float32; each line sums to W * G (W * Hq when shared).
    """
    rows, q_heads, window, head_dim = queries.shape
    kv_heads = keys.shape[1]
    grouped = queries.float().view(rows, kv_heads, q_heads // kv_heads, window, head_dim)
    logits = torch.matmul(grouped, keys.float().unsqueeze(2).transpose(-1, -2)) * scale  # [n, Hkv, G, W, W]
    scores = torch.softmax(logits, dim=-1).sum(dim=(2, 3))
    if shared:
        scores = scores.sum(dim=1, keepdim=True).expand_as(scores)
    return scores


def token2chunk(scores: torch.Tensor, quota: int, chunk_width: int, chunk_tokens: int,
                endpoint_quantile: float) -> torch.Tensor:
    """Token2Chunk: which of a window's tokens are kept, `[N, W]` bool, exactly `quota` per line.

    scores: `[N, W]` (window tokens in position order). Candidates: the top `quota` (ties: the lower
    position). A chunk: two consecutive candidates (by position) i < i' with i' - i + 1 <=
    `chunk_width`, whose weaker endpoint scores at least the `endpoint_quantile` quantile of the
    candidates' scores. Chunks are taken best first (weaker endpoint's score) while the tokens they
    add, endpoints included, fit `chunk_tokens`; a chunk that does not fit is skipped. Then the best
    single tokens fill the quota.
    """
    lines, window = scores.shape
    quota = min(quota, window)
    position = torch.arange(window, device=scores.device)
    candidates = scores.topk(quota, dim=-1).indices.sort(dim=-1).values  # [N, m] by position
    candidate_scores = scores.gather(-1, candidates)
    start, end = candidates[:, :-1], candidates[:, 1:]
    weaker = torch.minimum(candidate_scores[:, :-1], candidate_scores[:, 1:])  # [N, m - 1]
    floor = torch.quantile(candidate_scores, endpoint_quantile, dim=-1, keepdim=True)
    eligible = (end - start + 1 <= chunk_width) & (weaker >= floor)
    order = torch.where(eligible, weaker, float("-inf")).argsort(dim=-1, descending=True, stable=True)
    chunked = torch.zeros(lines, window, dtype=torch.bool, device=scores.device)
    used = torch.zeros(lines, dtype=torch.long, device=scores.device)
    for rank in range(quota - 1):
        pick = order[:, rank:rank + 1]
        first, last = start.gather(-1, pick), end.gather(-1, pick)  # [N, 1]
        span = (position >= first) & (position <= last)  # [N, W]
        added = (span & ~chunked).sum(dim=-1)
        take = eligible.gather(-1, pick)[:, 0] & (used + added <= chunk_tokens)
        chunked |= span & take[:, None]
        used += added * take
    key = torch.where(chunked, float("inf"), scores.float())
    kept = key.topk(quota, dim=-1).indices
    return torch.zeros_like(chunked).scatter_(-1, kept, True)


@dataclass(eq=False)
class KaraPolicy(KVPolicy):
    """Kara (see the module docstring for every field, assumption and deviation)."""

    window: int = 128
    ratio: float = 0.3
    chunk_width: int = 16
    chunk_budget: float = 0.5
    endpoint_quantile: float = 0.5
    per_kv_head: bool = False
    budget_mode: str = "cap"
    history_eviction: str = "score"

    name = "kara"
    schedule = "interval"

    def __post_init__(self):
        super().__post_init__()
        checks = {
            "window >= 2": self.window >= 2, "0 < ratio <= 1": 0 < self.ratio <= 1,
            "chunk_width >= 2": self.chunk_width >= 2, "0 <= chunk_budget <= 1": 0 <= self.chunk_budget <= 1,
            "0 <= endpoint_quantile <= 1": 0 <= self.endpoint_quantile <= 1,
            f"budget_mode in {BUDGET_MODES}": self.budget_mode in BUDGET_MODES,
            f"history_eviction in {HISTORY_EVICTIONS}": self.history_eviction in HISTORY_EVICTIONS,
        }
        for rule, holds in checks.items():
            if not holds:
                raise UserError(f"{self.name}: needs {rule}")
        self.shared_selection = not self.per_kv_head
        self.span = self.window  # the window in force
        if self.budget_mode == "cap":
            if self.budget is None:
                raise UserError(f"{self.name}: budget_mode cap needs a budget")
            # An open window may take at most half of the budget, else a quarter of it.
            self.span = shrink_interval(self.name, self.budget, self.window, least_kept=self.budget // 2)
        self.quota = math.ceil(self.ratio * self.span)

    # ---- sizes -------------------------------------------------------------------------------

    def capacity(self, spec: CacheSpec) -> int:
        if self.budget_mode == "cap":
            return super().capacity(spec)
        return spec.prompt_len + math.ceil(spec.max_new_tokens / self.span) * self.quota + self.span

    def prefill_keep(self, spec: CacheSpec) -> int:
        """cap: room for the first window (or for the whole output, when shorter: the output's last
        token is never stored, so max_new_tokens - 1 slots); ratio: the whole prompt."""
        if self.budget_mode == "ratio":
            return spec.prompt_len
        return self.budget - min(self.span, spec.max_new_tokens - 1)

    def query_window(self) -> int:
        return self.span

    def slot_state(self) -> dict[str, SlotState]:
        return {RANK: SlotState()} if self.budget_mode == "cap" else {}

    def on_prompt_stored(self, layer: int, kept: torch.Tensor, scores: torch.Tensor | None) -> None:
        if self.budget_mode == "cap":
            slots = self.layers[layer]
            slots.state[RANK].masked_fill_(slots.valid, float("inf"))

    # ---- per-row window counts (host) --------------------------------------------------------

    def begin_decode(self, positions: torch.Tensor) -> None:
        super().begin_decode(positions)
        self.filled = [0] * self.spec.batch  # tokens in each row's open window
        self.stored = [0] * self.spec.batch  # decode tokens each row has stored

    def begin_serving(self, positions: torch.Tensor) -> None:
        super().begin_serving(positions)
        self.filled = [IDLE] * self.spec.batch
        self.stored = [0] * self.spec.batch

    def admit(self, rows: torch.Tensor, staged: KVPolicy) -> None:
        super().admit(rows, staged)
        for row in rows.tolist():
            self.filled[row], self.stored[row] = 0, 0

    def release(self, rows: list[int]) -> None:
        super().release(rows)
        for row in rows:
            self.filled[row] = IDLE

    def after_step(self, step: int) -> None:
        """Rows whose open window is now complete have it scored (and, `ratio`, cut) in every layer."""
        self.filled = [n + 1 for n in self.filled]
        self.stored = [n + 1 for n in self.stored]
        done = [row for row, n in enumerate(self.filled) if n >= self.span]
        if not done:
            return
        # cap: rows are grouped by the room their next window needs (less near the end of the output,
        # whose last token is never stored: max_new_tokens - 1 - stored tokens are still to come)
        groups: dict[int, list[int]] = {}
        for row in done:
            self.filled[row] = 0
            room = max(0, min(self.span, self.spec.max_new_tokens - 1 - self.stored[row]))
            groups.setdefault(room, []).append(row)
        for room, rows in groups.items():
            self.close_window(rows, room)

    # ---- a window's end ----------------------------------------------------------------------

    @torch.no_grad()
    def close_window(self, rows: list[int], room: int) -> None:
        """Score the completed window of `rows` in every layer; `ratio`: free its dropped tokens; `cap`:
        rank its tokens, then free the lowest-ranked slots until `room` slots are free."""
        self.record_peak()  # the rows hold their most now, before slots are freed
        index = self.row_index(rows)
        last = self.written(index)[:, None]  # [n, 1]: the token the step wrote, held by every head
        for layer in range(self.spec.layers):
            obs = Observation(self, layer, rows=index, newest=last[:, 0])
            valid, positions = obs.valid, obs.positions
            in_window = valid & (positions > (last - self.span)[..., None])  # W slots per line
            order = torch.where(in_window, positions, torch.iinfo(torch.long).max).argsort(dim=-1)
            slots = order[..., :self.span]  # [n, Hkv, W], by position
            keys = obs.keys.gather(2, slots[..., None].expand(-1, -1, -1, obs.keys.shape[-1]))
            queries, _, _ = obs.queries(self.span)
            scores = window_scores(queries, keys, obs.scale, self.shared_selection)  # [n, Hkv, W]
            kept = token2chunk(scores.flatten(0, 1), self.quota, self.chunk_width,
                               int(self.chunk_budget * self.quota), self.endpoint_quantile).view_as(scores)
            if self.budget_mode == "ratio":
                keep = (valid & ~in_window).scatter(-1, slots, kept)
            else:
                rank = self.window_rank(scores, kept, positions.gather(-1, slots), last)
                state = obs.state(RANK).scatter(-1, slots, rank)
                if index is None:
                    obs.slots.state[RANK].copy_(state)
                else:
                    obs.slots.state[RANK].index_copy_(0, index, state)
                chosen = choose_keep(state, valid, self.budget - room)
                keep = torch.zeros_like(valid).scatter_(-1, chosen, True) & valid
            self.slots.compact(layer, index, keep)

    def window_rank(self, scores: torch.Tensor, kept: torch.Tensor, positions: torch.Tensor,
                    last: torch.Tensor) -> torch.Tensor:
        """cap: the rank `[n, Hkv, W]` of a scored window's tokens, in [0, 2): Token2Chunk's kept tokens
        1 + their within-window score (sums to 1 over the window; `fifo`: their position over the
        newest's + 1, so older windows go first), the dropped ones 0 + the same. last: `[n, 1]`."""
        if self.history_eviction == "fifo":
            within = positions.float() / (last.float() + 1)[..., None]
        else:
            within = scores / scores.sum(dim=-1, keepdim=True)
        return kept.float() + within
