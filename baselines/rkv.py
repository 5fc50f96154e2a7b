"""R-KV: redundancy-aware KV-cache compression for reasoning models.

Reference: Cai et al. 2025, "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models"
(arXiv 2505.24133; official code github.com/Zefan-Cai/R-KV). What each variant computes, and why:
docs/methods.md, "R-KV".

R-KV is an interval method. The cache grows until it is full, then one compression keeps the
newest tokens plus the best-scoring older tokens, where the score trades importance (attention of
the newest queries) against redundancy (similarity of a key to the other keys):

    Z_j = lam * I_j - (1 - lam) * R_j

Notation: B batch, Hq query heads, Hkv KV heads, G = Hq / Hkv, S slots, W window queries,
P protected newest tokens, N scored keys, D head dim.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from longflow import kernels
from longflow.errors import UserError
from longflow.policy import CacheSpec, KVPolicy, Observation, device_index, one_of, shrink_interval
from longflow.selection import choose_keep, chosen_mask

BUDGET_MODES = ("cap", "target")
SCORE_BYTES = 2 << 30  # temporaries of one `rkv_scores` call
# Off the GPU the keys' similarities are computed in blocks of slots, SIMILARITY_BLOCKS per side: a
# block pair and its transpose are one product (the matrix is symmetric), so of the S x S products
# only (k + 1) / 2k are computed and written (5/8 for k = 4), and a temporary is one block pair's.
# On a GPU a Triton kernel searches without them (`longflow.kernels.newest_duplicates`).
SIMILARITY_BLOCKS = 4
PAIR_BYTES = 6  # temporaries per key pair of a block: the float32 similarity, its comparison, transposed
KEY_BYTES = 24  # per key and dimension off the 16-bit GPU path: its float32 key copies alive at once (about six)
# Per slot and KV head off the 16-bit GPU path: the importance's float32 logits, one per (query head
# of the group, window query); their maximum over the group and its scaled, masked and softmaxed
# copies, about three per window query alive at once; and the `[B, Hkv, S]` float32 vectors
# (importance, norms, column sums, scores...), about sixteen alive at once. On that path instead the
# importance kernel's float32 scratch, one per window query, and at most STORED_SLOT_BYTES besides
# (42 bytes a slot were measured in all, scratch included, at window 8 on the H200:
# tests/test_rkv.py's bound).
LOGIT_BYTES = 4
WINDOW_BYTES = 12
SLOT_BYTES = 64
SCRATCH_BYTES = 4
STORED_SLOT_BYTES = 40
# Layers are scored in one call only while their keys, which that call's stacking copies, stay under
# this. An estimate, not a measurement: a 256 MB copy reads and writes about 0.5 GB, ~0.13 ms at
# 4 TB/s, about what the ~40 launches of a call that it saves cost.
STACKED_KEY_BYTES = 256 << 20


def reads_keys_as_stored(queries: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether `rkv_scores` takes its 16-bit GPU path: 16-bit keys read as stored, with no float32
    copy (their products are exact in the float32 accumulator)."""
    return keys.is_cuda and keys.dtype in (torch.float16, torch.bfloat16) and queries.dtype == keys.dtype


def score_bytes(kv_heads: int, slots: int, head_dim: int, group: int, window: int, as_stored: bool) -> int:
    """Temporaries of `rkv_scores` per row (and layer): on the 16-bit GPU path (`as_stored`), the
    importance kernel's scratch and the per-slot vectors; off it, the importance's logits and their
    window copies, the per-slot vectors, the float32 key copies and the CPU's largest block pair of
    similarities (an over-count for float32 keys on a GPU, whose search needs no pairs: those are
    the small canary's)."""
    if as_stored:
        return kv_heads * slots * (SCRATCH_BYTES * window + STORED_SLOT_BYTES)
    per_slot = LOGIT_BYTES * group * window + WINDOW_BYTES * window + SLOT_BYTES
    block = -(-slots // SIMILARITY_BLOCKS)
    return kv_heads * (block * block * PAIR_BYTES + slots * (head_dim * KEY_BYTES + per_slot))


def blocked_newest_duplicates(unit: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row i of the similarities S_ij = u_i . u_j of unit keys `[B, Hkv, S, D]`: the newest
    (largest) slot j != i with S_ij > threshold, and that S_ij; slot S - 1 and 0 where there is none.

    The slots are taken newest first, so that a row's first duplicate is its newest, and cut into
    SIMILARITY_BLOCKS spans; each pair of spans (a <= c) is one product, read along its rows for the
    rows of a and along its columns for those of c, and a row takes its duplicate from the newest
    span that holds one. Returns (slot `[B, Hkv, S]` int64, similarity `[B, Hkv, S]` float32).
    """
    slots = unit.shape[-2]
    reverse = unit.flip(-2)  # row r: slot S - 1 - r
    edges = [slots * b // SIMILARITY_BLOCKS for b in range(SIMILARITY_BLOCKS + 1)]
    spans = [(low, high) for low, high in zip(edges[:-1], edges[1:], strict=True) if high > low]
    found = {}  # (rows' span, columns' span) -> (found, first index, similarity) for the rows' span
    for a, (a0, a1) in enumerate(spans):
        for c in range(a, len(spans)):
            c0, c1 = spans[c]
            block = torch.matmul(reverse[..., a0:a1, :], reverse[..., c0:c1, :].transpose(-1, -2))
            if a == c:
                block.diagonal(dim1=-2, dim2=-1).zero_()  # S_ii = 0
            duplicate = block > threshold
            first = duplicate.view(torch.uint8).argmax(dim=-1, keepdim=True)  # the rows of a, in c
            found[a, c] = (duplicate.gather(-1, first)[..., 0], c0 + first[..., 0], block.gather(-1, first)[..., 0])
            if a < c:  # the rows of c, in a: the comparison transposed (a byte a pair) for a contiguous search
                first = duplicate.mT.contiguous().view(torch.uint8).argmax(dim=-1, keepdim=True).mT
                found[c, a] = (duplicate.gather(-2, first)[..., 0, :], a0 + first[..., 0, :],
                               block.gather(-2, first)[..., 0, :])
    index = torch.zeros(unit.shape[:-1], dtype=torch.long, device=unit.device)
    similarity = torch.zeros(unit.shape[:-1], dtype=unit.dtype, device=unit.device)
    for x, (x0, x1) in enumerate(spans):
        for y in reversed(range(len(spans))):  # the newest span last: it wins
            hit, first, value = found[x, y]
            index[..., x0:x1] = torch.where(hit, first, index[..., x0:x1])
            similarity[..., x0:x1] = torch.where(hit, value, similarity[..., x0:x1])
    return slots - 1 - index.flip(-1), similarity.flip(-1)


def window_importance(queries: torch.Tensor, query_valid: torch.Tensor, keys: torch.Tensor, older: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """R-KV's importance before its max-pool, `[B, Hkv, S]` float32, -inf where not `older`: the mean
    over the valid window queries of the softmax, over the older keys, of each KV head's logits, which
    are the max over its G query heads (official compute_attention_scores).

    queries `[B, Hq, W, D]`, query_valid `[B, W]`, keys `[B, Hkv, S, D]` (float32, or the 16-bit GPU
    path's keys as stored: `reads_keys_as_stored`), older `[B, Hkv, S]` bool: the keys the window
    scores."""
    batch, q_heads, window, head_dim = queries.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    inf = float("inf")
    # The G query heads' windows as one [G * W, D] block per KV head: one product with the keys as they
    # are (a broadcast over G would copy them G times), the same products.
    grouped = queries.reshape(batch, kv_heads, q_heads // kv_heads * window, head_dim)
    if reads_keys_as_stored(queries, keys):
        logits = torch.bmm(grouped.flatten(0, 1), keys.flatten(0, 1).transpose(-1, -2), out_dtype=torch.float32)
    else:
        logits = torch.matmul(grouped.float(), keys.transpose(-1, -2))
    logits = logits.view(batch, kv_heads, -1, window, slots).amax(dim=2) * scale  # [B, Hkv, W, S]
    logits = logits.masked_fill(~older[:, :, None, :], -inf)
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a row without older keys gives NaN -> 0
    probs = probs * query_valid[:, None, :, None]
    importance = probs.sum(dim=2) / query_valid.sum(dim=-1).clamp(min=1)[:, None, None]  # [B, Hkv, S]
    return importance.masked_fill(~older, -inf)


def rkv_scores(
    queries: torch.Tensor,
    query_valid: torch.Tensor,
    keys: torch.Tensor,
    held: torch.Tensor,
    scale: float,
    *,
    protect: int,
    kernel: int,
    lam: float,
    threshold: float,
) -> torch.Tensor:
    """R-KV scores (`paper` variant) of the tokens held in slots that are in position order.

    The last W slots are the tokens of the W window queries; the last `protect` slots (P >= W)
    are always kept. Importance uses the attention of the window's queries over the keys before
    the window (so no causal mask is needed); redundancy uses every held key.

    Logits of a KV head = max over its G query heads; I = maxpool(mean over the W queries of
    softmax over the keys before the window); S = cosine similarity of the held keys with a zero
    diagonal, and in each row i the most recent j with S_ij > threshold zeroed (the newest
    duplicate survives); R = softmax over all held j (the window included, as the official code,
    which then drops the window) of the mean over held rows i of S_ij.

    Args:
        queries: `[B, Hq, W, D]` window queries (after RoPE); query_valid: `[B, W]` bool.
        keys: `[B, Hkv, S, D]`; held: `[B, Hkv, S]` bool (False = free or padding).
        scale: softmax scale (1/sqrt(D)).

    Returns:
        `[B, Hkv, S]` float32: Z on the candidates (held, older than the protected tokens),
        +inf on the held protected tokens, -inf on slots not held.
    """
    batch, window = queries.shape[0], queries.shape[2]
    kv_heads, slots = keys.shape[1], keys.shape[2]
    # On the GPU, 16-bit keys are read as stored: their products are exact in the float32 accumulator,
    # so a float32 copy of them (the largest temporary, and a third of the traffic at Figure 3's
    # batch) buys nothing. Float32 keys (the canary) keep the float32 path.
    half = reads_keys_as_stored(queries, keys)
    stored_keys, keys = keys, (keys if half else keys.float())  # `keys`: float32 except on the 16-bit path
    inf = float("inf")
    index = torch.arange(slots, device=keys.device)
    older = held & (index < slots - window)  # keys the window queries score, [B, Hkv, S]
    candidates = held & (index < slots - protect)

    # On the 16-bit GPU path one Triton kernel (2.8x the PyTorch form on the H200), to float32 rounding.
    importance = (kernels.window_importance if half else window_importance)(queries, query_valid, keys, older, scale)
    # Max-pool over neighbouring held tokens; -inf around the older keys, as the official pool over
    # keys[:-w] pads with -inf.
    importance = F.max_pool1d(importance.view(batch * kv_heads, 1, slots), kernel, stride=1,
                              padding=kernel // 2).view(batch, kv_heads, slots)

    # Redundancy. Free slots get a zero unit key, so that they add nothing to any S_ij. The sum over
    # rows i of S_ij is linear in the unit keys, u_j . sum_i u_i - |u_j|^2 without the diagonal, so
    # the S x S matrix is needed only to find each row's newest duplicate, whose S_ij is then taken
    # off its column: two passes over it (compare, search) instead of about ten (mask, compare,
    # flip, search, scatter, mask, sum), which made this function memory-bound on the S x S
    # temporaries at large batch; and of the symmetric matrix only half is computed
    # (`blocked_newest_duplicates`). Row i's most recent duplicate j (largest slot = newest position) is not
    # counted in column j.
    if half:
        # A Triton kernel searches for the duplicates in the keys as stored, and the column sums are
        # products with the keys, u_j . sum_i u_i = r_j k_j . sum_i r_i k_i with r = held / ||k||:
        # no [B, Hkv, S, D] temporaries (unit keys and their products), which after the S x S
        # matrix were most of a compression's memory traffic at Figure 3's batch; r and the column
        # sums come from a second kernel, in two reads of the stored keys. Float32 keys take the
        # same arithmetic in PyTorch's products (the outputs the committed canary runs hold); the
        # CPU keeps the unit keys (the interpreter would run the kernels too slowly), with the same
        # sums to float32 rounding.
        inverse, column_sums = kernels.similarity_sums(keys, held)  # [B, Hkv, S] each
        newest, left_out = kernels.newest_duplicates(keys, inverse, threshold)
    elif keys.is_cuda:
        key_norms = keys.norm(dim=-1)  # [B, Hkv, S]
        inverse = held / (key_norms + 1e-8)
        newest, left_out = kernels.newest_duplicates(stored_keys, inverse, threshold)  # [B, Hkv, S] each
        total = torch.matmul(inverse[..., None, :], keys)  # sum_i u_i, [B, Hkv, 1, D]
        column_sums = inverse * torch.matmul(keys, total.transpose(-1, -2))[..., 0] - (inverse * key_norms).square()
    else:
        key_norms = keys.norm(dim=-1)  # [B, Hkv, S]
        unit = keys / (key_norms[..., None] + 1e-8) * held[..., None]  # [B, Hkv, S, D]
        newest, left_out = blocked_newest_duplicates(unit, threshold)
        column_sums = (unit * unit.sum(dim=-2, keepdim=True)).sum(dim=-1) - unit.square().sum(dim=-1)
    column_sums = column_sums - torch.zeros_like(column_sums).scatter_add_(-1, newest, left_out)
    mean = column_sums / held.sum(dim=-1, keepdim=True).clamp(min=1)  # mean over held rows i
    redundancy = torch.softmax(mean.masked_fill(~held, -inf), dim=-1).nan_to_num(0.0)  # over held j

    scores = lam * importance - (1.0 - lam) * redundancy
    scores = scores.masked_fill(~candidates, -inf)
    return torch.where(held & (index >= slots - protect), inf, scores)


def lf_repo_scores(
    queries: torch.Tensor,
    query_valid: torch.Tensor,
    keys: torch.Tensor,
    held: torch.Tensor,
    *,
    kernel: int,
    lam: float,
) -> torch.Tensor:
    """R-KV scores as the LongFlow authors compute them (`lf_repo`), one score per key and row.

    The keys are scored in CACHE order, which is what their max-pool runs along.
      importance: per query head (each KV head serves its G query heads), softmax over the
        scored keys of q.k / sqrt(D), summed over the window queries, max-pooled along the cache
        order (-inf beyond the ends), then averaged over the query heads;
      redundancy: each key divided by its squared norm, the Gram matrix of those averaged over
        each row, softmax over the keys, then averaged over the KV heads.
    No causal mask: every scored key is older than every window query.

    Args:
        queries: `[R, Hq, W, D]` window queries (after RoPE); query_valid: `[R, W]` bool.
        keys: `[R, Hkv, N, D]` scored keys in cache order; held: `[R, N]` bool (False = padding).

    Returns:
        `[R, N]` float32 Z, -inf where not held.
    """
    rows, q_heads, window, head_dim = queries.shape
    kv_heads, count = keys.shape[1], keys.shape[2]
    keys = keys.float()
    outside = ~held[:, None, :]  # [R, 1, N]
    grouped = queries.float().reshape(rows, kv_heads, q_heads // kv_heads * window, head_dim)
    # Divided by sqrt(D), as their code does, whatever the model's own softmax scale.
    logits = torch.matmul(grouped, keys.transpose(-1, -2)) / math.sqrt(head_dim)  # [R, Hkv, G*W, N]
    logits = logits.view(rows, q_heads, window, count).masked_fill(outside[:, :, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0) * query_valid[:, None, :, None]
    importance = probs.sum(dim=2).masked_fill(outside, float("-inf"))  # [R, Hq, N]
    importance = F.max_pool1d(importance, kernel, stride=1, padding=kernel // 2).mean(dim=1)  # [R, N]

    unit = (keys / keys.square().sum(dim=-1, keepdim=True)).masked_fill(outside[..., None], 0.0)
    # Row i of their Gram matrix sums to u_i . sum_j u_j: no N x N matrix needed.
    mean = (unit * unit.sum(dim=-2, keepdim=True)).sum(dim=-1) / held.sum(dim=-1).clamp(min=1)[:, None, None]
    redundancy = torch.softmax(mean.masked_fill(outside, float("-inf")), dim=-1).mean(dim=1)  # [R, N]
    scores = lam * importance - (1.0 - lam) * redundancy
    return scores.masked_fill(~held, float("-inf"))


@dataclass(eq=False)
class RKV(KVPolicy):
    """R-KV (Cai et al. 2025) over static slot buffers.

    Variants (`variant`):
      - "paper" (official code): per KV head (`shared_selection = False`); the window is the last
        `window` (8) queries, `kernel` 7, `lam` 0.1, duplicate `threshold` 0.5; a compression keeps
        top(target - window) by Z plus the window, in position order.
      - "lf_repo" (the LongFlow authors' baseline, their `RKVCache`): `lf_repo_scores` (per-query-
        head importance over `lf_queries` (9) queries, pool kernel `lf_kernel` (5), keys divided
        by their squared norm, one selection per layer); only the keys older than the
        `lf_protect` (128) newest are scored, and those newest are all kept. The cut happens
        INSIDE the decode step, before attention, when the stored token makes the row hold more
        than budget - `lf_margin` (4) tokens, with the step's own query among the window; it
        keeps budget - lf_margin - 2 lf_protect scored tokens, in score order, then the
        lf_protect newest, and slot order stays the authors' cache order (their max-pool runs
        along it). A prompt of more than budget - lf_margin tokens is cut the same way at
        prefill, with its 8 newest queries. `window`, `kernel`, `threshold`, `compress_every` and
        `budget_mode` belong to the paper variant and are ignored.

    Budget. `paper`, by `budget_mode`:
      - "cap" (default): `budget` is a hard cap. Capacity = budget; the cache fills to the budget
        and is cut to target = budget - compress_every, so it refills to exactly the budget in
        `compress_every` steps.
      - "target": the official schedule, recorded as such (peak slots above the budget). The
        cache is compressed to target = budget and grows to capacity = budget + compress_every - 1
        (the official cache reaches budget + 127 between steps). A cut happens every
        compress_every - 1 steps here, since the step that fills the capacity is followed by the
        cut, where the official code appends the 128th token and cuts in the same step.
    `lf_repo`: the authors' own accounting, under the cap. A query attends to at most budget -
    lf_margin tokens; the token stored in a cutting step needs one slot more before the cut, so the
    capacity is budget - lf_margin + 1 <= budget. The same `budget` as their `cache_budget`
    reproduces their runs.

    How it maps onto the slot buffers: a decode step writes the new token into the first free
    slot, records its query into the query history (`longflow.history`, a ring of the last W
    queries per layer) and attends. Held slots are always the low ones. Prompt lengths are known on
    the host, so the host knows when each row is full without reading the device:
      - paper: the base class's interval schedule: `after_step` compresses the full rows (all of
        them when they are in step): it scores the row's slots, keeps the top ones by the
        selection rule, and compacts them into the low slots in position order, so the last W
        slots are the window;
      - lf_repo: `before_step` names the rows that cut in the coming step, which the engine then
        runs eagerly (every lf_protect + 1 steps a row); every other step stays static and
        CUDA-graph safe.

    Prompt longer than the budget (paper): a row whose prompt exceeds capacity - 1 (cap) or the
    target (target, as the official code) is compressed at prefill by the same score, with its
    last W prompt queries as the window, to the post-compression size (top(target - W) + W). Rows
    are decided one by one, so a row never depends on its batch-mates.

    Deviations from the official code, `paper` (docs/methods.md, "R-KV"):
      - In a row i with no S_ij > threshold the official code zeroes S_i0 (the max over an
        all-zero index tensor is 0); here nothing is zeroed in such a row.
      - "Most recent duplicate" and the max-pool neighbours are by position. The official code
        uses the cache index, which after a first compression is in score order (topk).
      - Scores are float32 throughout (the official casts the importance to the model dtype).
      - The official trigger is `total length % 128 == 0` for batch size 1; here each row is cut
        when its own slots are full, which gives the same period per row.
      - Attention of the decode step uses all held slots; the official step that triggers a cut
        attends to the uncut cache (budget + 128) and cuts afterwards.
    Deviations from the authors' runs, `lf_repo`: scores in float32 (theirs cast the importance
    to the model dtype); each row is cut when its own cache is full and only real tokens are held,
    where their batched cache cuts all rows together and counts, scores and keeps left padding.

    Each variant is its own class over the shared fields (`RKV`): `RKVPolicy` (paper) and
    `RKVLfRepoPolicy` (lf_repo); a method config names `RKVPolicy` and its `variant` picks the class
    (`KVPolicy.variant_classes`). As the scorer of another method (AMS), `RKVPolicy.score` is the
    `paper` score of the slots held, with the W newest queries; it needs no budget.
    """

    variant: str = "paper"
    window: int = 8
    kernel: int = 7
    lam: float = 0.1
    threshold: float = 0.5
    compress_every: int = 128
    budget_mode: str = "cap"
    lf_queries: int = 9
    lf_kernel: int = 5
    lf_protect: int = 128
    lf_margin: int = 4

    name = "rkv"
    schedule = "interval"
    variant_classes = {"paper": "baselines.rkv.RKVPolicy", "lf_repo": "baselines.rkv.RKVLfRepoPolicy"}

    def __post_init__(self):
        super().__post_init__()
        one_of(self.name, "budget_mode", self.budget_mode, BUDGET_MODES)
        if not 0.0 <= self.lam <= 1.0:
            raise UserError(f"rkv: lam must be in [0, 1], got {self.lam}")
        if self.compress_every < 1:
            raise UserError(f"rkv: compress_every must be >= 1, got {self.compress_every}")

    def _check_window(self) -> None:
        if self.queries_held < 1 or self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            raise UserError(
                f"rkv needs a window >= 1 and an odd pool kernel, got {self.queries_held}, {self.pool_kernel}"
            )

    # ---- sizes -------------------------------------------------------------------------------

    def capacity(self, spec: CacheSpec) -> int:
        super().capacity(spec)  # the budget is set
        return self.slots_held

    def query_window(self) -> int:
        return self.queries_held

    def prompt_cut(self, length: int) -> bool:
        """Whether a row's prompt of `length` real tokens is compressed at prefill."""
        raise NotImplementedError

    def held_after_prompt(self, length: int) -> int:
        return self.keep_after if self.prompt_cut(length) else length


@dataclass(eq=False)
class RKVPolicy(RKV):
    """R-KV `paper` (see `RKV`): the base class's interval schedule, cut by `rkv_scores`."""

    own_variant = "paper"

    def __post_init__(self):
        super().__post_init__()
        # W window queries, pool kernel, P protected newest tokens, in force
        self.queries_held, self.pool_kernel, self.protect = self.window, self.kernel, self.window
        self.shared_selection = False
        self._check_window()
        if self.budget is not None:
            self._paper_sizes()

    def _paper_sizes(self) -> None:
        budget = self.budget
        # The interval in force: a budget below compress_every (the demo's, a small sweep point)
        # could never be cut; the interval shrinks to a quarter of the budget.
        interval = self.compress_every
        if self.budget_mode == "cap":
            interval = shrink_interval(self.name, budget, interval, self.window + 1)
        self.interval = interval
        if self.budget_mode == "cap":
            self.slots_held, self.keep_after = budget, budget - interval
        else:
            self.slots_held, self.keep_after = budget + interval - 1, budget
        if self.keep_after >= self.slots_held:
            raise UserError(f"rkv: a compression must free slots (budget_mode={self.budget_mode} needs "
                            f"compress_every >= 2, got {interval})")
        if self.keep_after <= self.protect:
            raise UserError(
                f"rkv: budget {budget} too small: a compression keeps {self.keep_after} tokens, which must "
                f"exceed the {self.protect} protected ones (budget_mode={self.budget_mode}, "
                f"compress_every={interval}, variant=paper)"
            )

    def prompt_cut(self, length: int) -> bool:
        limit = self.slots_held - 1 if self.budget_mode == "cap" else self.keep_after
        return length > limit

    def prefill_keep(self, spec: CacheSpec) -> int:
        """The most prompt tokens a row keeps (an uncut row all of its own, at most capacity - 1
        under the cap, the target under `target`); the cut rows keep `keep_after` of them."""
        return self.keep_after if self.budget_mode == "target" else super().prefill_keep(spec)

    def compresses_within(self, prompt_tokens: int, total_tokens: int, spec: CacheSpec) -> bool:
        """The base rule: its capacity and `prefill_keep` are the cut's sizes."""
        return not self.holds_every_token(prompt_tokens, total_tokens, spec)

    # ---- the score -----------------------------------------------------------------------------

    def score(self, obs: Observation) -> torch.Tensor:
        """The `paper` score `[n, Hkv, S]` of the slots held (in position order), with the W newest
        queries: +inf on the W newest slots, -inf on the slots not held."""
        queries, _, query_valid = obs.queries(self.queries_held)
        return self._chunked_scores(queries, query_valid, obs.keys, obs.valid, obs.scale)

    def prefill_scores(self, layer, q, k, v, scale) -> torch.Tensor:
        """`[B, Hkv, L]`: R-KV scores of the prompt with its last W queries as the window. In the
        rows that are cut, only the top `keep_after` tokens score above -inf: the base class keeps
        the top `prefill_keep`, which holds every token of the uncut rows, and `on_prompt_stored`
        frees the rest of a cut row."""
        length = k.shape[2]
        window = min(self.queries_held, length)
        held = self.pad[:, None, :].expand(-1, k.shape[1], -1)
        scores = self._chunked_scores(q[:, :, length - window:], self.pad[:, length - window:], k, held, scale)
        best = chosen_mask(choose_keep(scores, held, min(self.keep_after, length)), held)
        cut = torch.tensor([self.prompt_cut(n) for n in self.prompt_lengths], device=k.device)
        return scores.masked_fill(cut[:, None, None] & ~best, float("-inf"))

    def on_prompt_stored(self, layer: int, kept: torch.Tensor, scores: torch.Tensor | None) -> None:
        """Frees the tokens that a cut row does not keep; the base class then compacts the held
        slots into the low ones (left padding leaves free slots below the prompt)."""
        if scores is not None:
            survives = scores.gather(-1, kept) > float("-inf")  # [B, Hkv, n]
            self.layers[layer].valid[..., :kept.shape[-1]] &= survives

    def _chunked_scores(self, queries, query_valid, keys, held, scale) -> torch.Tensor:
        """`rkv_scores` over the leading dimension in chunks of at most `SCORE_BYTES` of temporaries."""
        kv_heads, slots = keys.shape[1], keys.shape[2]
        group, window = queries.shape[1] // kv_heads, queries.shape[2]
        step = max(1, SCORE_BYTES // score_bytes(kv_heads, slots, keys.shape[3], group, window,
                                                 reads_keys_as_stored(queries, keys)))
        return torch.cat([
            rkv_scores(
                queries[i:i + step], query_valid[i:i + step], keys[i:i + step], held[i:i + step], scale,
                protect=min(self.protect, slots), kernel=self.pool_kernel, lam=self.lam,
                threshold=self.threshold,
            )
            for i in range(0, keys.shape[0], step)
        ])

    # ---- interval compression ----------------------------------------------------------------

    def keep_masks(self, rows: torch.Tensor | None) -> Iterator[torch.Tensor]:
        """The slots a cut of `rows` (None: every row) keeps in each layer (`[n, Hkv, S]` bool): `keep_after` by the
        score of the query ring. Layers are scored together, as many as `SCORE_BYTES` of temporaries
        and `STACKED_KEY_BYTES` of copied keys allow: a row is cut on its own whenever the rows are
        out of step, and one call per layer would be mostly kernel launches; at a large batch each
        layer's keys are read in place instead."""
        spec = self.spec
        count = spec.batch if rows is None else len(rows)
        # The ring's queries and the cache's keys are both in the model's dtype.
        as_stored = spec.device.type == "cuda" and spec.dtype in (torch.float16, torch.bfloat16)
        per_item = score_bytes(spec.kv_heads, self.slots_held, spec.head_dim, spec.q_heads // spec.kv_heads,
                               self.queries_held, as_stored)  # per (layer, row)
        layer_keys = count * spec.kv_heads * self.slots_held * spec.head_dim * spec.dtype.itemsize
        group = max(1, min(SCORE_BYTES // (per_item * count), STACKED_KEY_BYTES // layer_keys))

        def stacked(tensors: list[torch.Tensor]) -> torch.Tensor:  # one layer's own buffer is read in place
            return tensors[0] if len(tensors) == 1 else torch.cat(tensors)

        for start in range(0, spec.layers, group):
            layers = range(start, min(spec.layers, start + group))
            observed = [Observation(self, i, rows=rows) for i in layers]
            keys = stacked([obs.keys for obs in observed])  # [n*g, Hkv, S, D]
            held = stacked([obs.valid for obs in observed])
            # The ring in its own order: the importance averages over the window's queries.
            queries = stacked([self.history.ring(i, rows) for i in layers])
            every = torch.ones(len(keys), self.queries_held, dtype=torch.bool, device=spec.device)
            scores = self._chunked_scores(queries, every, keys, held, self.scale)
            keep = chosen_mask(choose_keep(scores, held, self.keep_after), held)  # [n*g, Hkv, S]
            yield from keep.split(count)


@dataclass(eq=False)
class RKVLfRepoPolicy(RKV):
    """R-KV `lf_repo` (see `RKV`): cut inside the decode step by `lf_repo_scores`, in cache order."""

    variant: str = "lf_repo"

    own_variant = "lf_repo"

    def __post_init__(self):
        super().__post_init__()
        if self.lf_margin < 1:
            raise UserError(f"rkv: lf_margin must be >= 1 (the slot a cutting step stores into), "
                            f"got {self.lf_margin}")
        if self.lf_protect < 1:
            raise UserError(f"rkv: lf_protect must be >= 1, got {self.lf_protect}")
        self.queries_held, self.pool_kernel, self.protect = self.lf_queries, self.lf_kernel, self.lf_protect
        self.shared_selection = True
        self._check_window()
        if self.budget is not None:
            self._lf_repo_sizes()
        self.cutting: list[int] = []  # rows cut inside the coming step (host, per step)

    def _lf_repo_sizes(self) -> None:
        budget, margin = self.budget, self.lf_margin
        if budget - margin - 2 * self.protect < 1:
            # Their code needs budget > 2 * 128 + 4; a smaller budget (the demo's, a small sweep
            # point) keeps the schedule with a protected tail of a quarter of the budget.
            shrunk = max(1, (budget - margin) // 4)
            warnings.warn(f"rkv: budget {budget} leaves no room for lf_protect={self.protect}; using {shrunk}",
                          stacklevel=4)
            self.protect = shrunk
        self.hold_limit = budget - margin  # most tokens a query attends to
        self.slots_held = self.hold_limit + 1
        self.keep_after = self.hold_limit - self.protect  # tokens a cut keeps
        self.keep_scored = self.hold_limit - 2 * self.protect  # of which chosen by score
        if self.keep_scored < 1:
            raise UserError(f"rkv: budget {budget} too small for lf_repo: a cut keeps {self.keep_scored} "
                            f"scored tokens (budget - lf_margin - 2 * lf_protect)")

    def prompt_cut(self, length: int) -> bool:
        return length > self.hold_limit

    # ---- the schedule --------------------------------------------------------------------------

    def compresses_within(self, prompt_tokens: int, total_tokens: int, spec: CacheSpec) -> bool:
        """It cuts inside the step whose token would make a row hold more than budget - lf_margin, one
        slot below its capacity, so the tokens the steps that matter store (all but the output's
        last) must fit that."""
        if self.prompt_cut(prompt_tokens) or total_tokens - 1 > self.hold_limit:
            return True
        return not self.holds_every_token(prompt_tokens, total_tokens, spec)

    def allocate(self, spec: CacheSpec) -> None:
        super().allocate(spec)
        self.cutting = []

    def before_step(self, step: int) -> bool:
        """The rows whose token of this step would exceed budget - lf_margin are cut in it."""
        self.cutting = [row for row, n in enumerate(self.held) if n + 1 > self.hold_limit]
        return bool(self.cutting)

    def after_step(self, step: int) -> None:
        """Every row stored one token; the rows cut in the step hold `keep_after`."""
        cut = set(self.cutting)
        self.held = [self.keep_after if row in cut else n + 1 for row, n in enumerate(self.held)]
        self.cutting = []

    def decode(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Attend over the held slots, point at the first free slot: static, except in the steps named
        by `before_step`, which cut first (with this step's query, already recorded)."""
        if self.cutting:  # an eager step: cut before attention
            self._cut_in_step(layer)
        return super().decode(layer, q, scale)

    # ---- prefill -----------------------------------------------------------------------------

    def store_prompt(self, layer, q, k, v, scale) -> None:
        self._store_prompt_lf_repo(layer, q, k, v)

    def _store_prompt_lf_repo(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores each row's prompt in the low slots: whole, or, for a row of more than budget -
        lf_margin tokens, the top `keep_scored` of the tokens before the `protect` newest (by the
        score of its 8 newest queries, the authors' prefill window), in score order, then those newest.

        q: `[B, Hq, L, D]`; k, v: `[B, Hkv, L, D]` over the left-padded prompt.
        """
        length, device = k.shape[2], k.device
        counts = torch.tensor([self.held_after_prompt(n) for n in self.prompt_lengths], device=device)
        held = int(counts.max())
        column = torch.arange(held, device=device)
        order = length - counts[:, None] + column  # [B, held]: the whole prompt; `length` = no token
        cut = [row for row, n in enumerate(self.prompt_lengths) if self.prompt_cut(n)]
        if cut:
            rows = torch.tensor(cut, device=device)
            scored, window = length - self.protect, self.queries_held - 1
            pad = self.pad.index_select(0, rows)
            scores = lf_repo_scores(q.index_select(0, rows)[:, :, length - window:], pad[:, length - window:],
                                    k.index_select(0, rows)[:, :, :scored], pad[:, :scored],
                                    kernel=self.pool_kernel, lam=self.lam)
            chosen = choose_keep(scores, pad[:, :scored], self.keep_scored)  # by score, highest first
            newest = torch.arange(scored, length, device=device).expand(len(cut), -1)
            order[rows, :self.keep_after] = torch.cat([chosen, newest], dim=-1)
        order = order.masked_fill(column >= counts[:, None], length)
        kept = order[:, None, :].expand(-1, k.shape[1], -1)
        self.slots.store_prompt(layer, k, v, kept, self.pad, self.prompt_positions)

    def _cut_in_step(self, layer: int) -> None:
        """Cuts the rows of `self.cutting` (every slot held, the step's token stored last) to
        `keep_after` tokens: the top `keep_scored` of the slots before the `protect` newest, scored
        with the W newest queries (the step's own the newest), in score order, then the newest."""
        slots = self.layers[layer]
        device = slots.keys.device
        rows = device_index(self.cutting, device)
        self.record_peak([layer])  # the rows are full: their peak, before the cut frees slots
        queries, _, query_valid = self.history.recent(layer, self.positions.index_select(0, rows), rows)
        scored = self.slots_held - self.protect
        keys = slots.keys.index_select(0, rows)[:, :, :scored]
        every = torch.ones(len(self.cutting), scored, dtype=torch.bool, device=device)
        scores = lf_repo_scores(queries, query_valid, keys, every, kernel=self.pool_kernel, lam=self.lam)
        chosen = choose_keep(scores, every, self.keep_scored)
        tail = torch.arange(scored, self.slots_held, device=device).expand(len(self.cutting), -1)
        order = torch.cat([chosen, tail], dim=-1)  # [n, keep_after]: the slots kept, in their new order
        heads, total = slots.keys.shape[1], slots.slots
        rank = torch.full((len(self.cutting), total), total, dtype=torch.long, device=device)
        rank.scatter_(-1, order, torch.arange(order.shape[-1], device=device).expand_as(order))
        rank = rank[:, None, :].expand(-1, heads, -1)
        self.slots.compact(layer, rows, rank < total, rank)
