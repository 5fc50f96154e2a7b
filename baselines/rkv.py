"""R-KV: redundancy-aware KV-cache compression for reasoning models.

Reference: Cai et al. 2025, "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models"
(arXiv 2505.24133; official code github.com/Zefan-Cai/R-KV). Spec: METHODS.md, section R-KV.

R-KV is an interval method. The cache grows until it is full, then one compression keeps the
observation window (the newest tokens, whose queries were recorded) plus the best-scoring older
tokens, where the score trades importance (attention of the window's queries) against redundancy
(cosine similarity of a key to the other keys):

    Z_j = lam * I_j - (1 - lam) * R_j

Notation: B batch, Hq query heads, Hkv KV heads, G = Hq / Hkv, S slots, W window queries,
P protected newest tokens, D head dim.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from longflow.policy import CacheSpec, KVPolicy

VARIANTS = ("paper", "lf_repo")
BUDGET_MODES = ("cap", "target")
SCORE_BYTES = 2 << 30  # S x S work scored in one call (similarity matrices and their masks)


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
    variant: str = "paper",
) -> torch.Tensor:
    """R-KV scores of the tokens held in slots that are in position order (oldest first).

    The last W slots are the tokens of the W window queries; the last `protect` slots (P >= W)
    are always kept. Importance uses the attention of the window's queries over the keys before
    the window (so no causal mask is needed); redundancy uses every held key.

    paper: logits of a KV head = max over its G query heads; I = maxpool(mean over the W queries
      of softmax over the keys before the window); S = cosine similarity of the held keys with a
      zero diagonal, and in each row i the most recent j with S_ij > threshold zeroed (the newest
      duplicate survives); R = softmax over all held j (the window included, as the official
      code, which then drops the window) of the mean over held rows i of S_ij.
    lf_repo: keys divided by their squared norm, no diagonal zeroing, no threshold; importance
      summed over the W queries; Z averaged over the KV heads (one selection per layer).

    Args:
        queries: `[B, Hq, W, D]` window queries (after RoPE); query_valid: `[B, W]` bool.
        keys: `[B, Hkv, S, D]`; held: `[B, Hkv, S]` bool (False = free or padding).
        scale: softmax scale (1/sqrt(D)).

    Returns:
        `[B, Hkv, S]` float32: Z on the candidates (held, older than the protected tokens),
        +inf on the held protected tokens, -inf on slots not held.
    """
    batch, q_heads, window, head_dim = queries.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    keys = keys.float()
    inf = torch.tensor(float("inf"), device=keys.device)
    index = torch.arange(slots, device=keys.device)
    older = held & (index < slots - window)  # keys the window queries score, [B, Hkv, S]
    candidates = held & (index < slots - protect)

    # Importance. Logits of a KV head = max over its query heads (official compute_attention_scores).
    grouped = queries.float().view(batch, kv_heads, q_heads // kv_heads, window, head_dim)
    logits = torch.matmul(grouped, keys.unsqueeze(2).transpose(-1, -2)).amax(dim=2) * scale  # [B, Hkv, W, S]
    logits = logits.masked_fill(~older[:, :, None, :], -inf)
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a row without older keys gives NaN -> 0
    probs = probs * query_valid[:, None, :, None]
    importance = probs.sum(dim=2)  # [B, Hkv, S]
    if variant == "paper":
        importance = importance / query_valid.sum(dim=-1).clamp(min=1)[:, None, None]
    # Max-pool over neighbouring held tokens; -inf around the older keys, as the official pool over
    # keys[:-w] pads with -inf.
    importance = importance.masked_fill(~older, -inf)
    importance = F.max_pool1d(importance.view(batch * kv_heads, 1, slots), kernel, stride=1,
                              padding=kernel // 2).view(batch, kv_heads, slots)

    # Redundancy.
    norm = keys.norm(dim=-1, keepdim=True)
    unit = keys / (norm + 1e-8) if variant == "paper" else keys / norm.square().clamp(min=1e-12)
    similarity = torch.matmul(unit, unit.transpose(-1, -2))  # [B, Hkv, S, S]
    similarity.masked_fill_(~(held[..., :, None] & held[..., None, :]), 0.0)
    if variant == "paper":
        similarity.diagonal(dim1=-2, dim2=-1).zero_()
        duplicate = similarity > threshold
        # The most recent duplicate j of row i (largest slot = newest position) is not counted.
        newest = slots - 1 - duplicate.flip(-1).to(torch.uint8).argmax(dim=-1, keepdim=True)  # [B, Hkv, S, 1]
        retain = torch.zeros_like(duplicate).scatter_(-1, newest, duplicate.any(dim=-1, keepdim=True))
        similarity.masked_fill_(retain, 0.0)
    mean = similarity.sum(dim=-2) / held.sum(dim=-1, keepdim=True).clamp(min=1)  # mean over held rows i
    redundancy = torch.softmax(mean.masked_fill(~held, -inf), dim=-1).nan_to_num(0.0)  # over held j

    scores = lam * importance - (1.0 - lam) * redundancy
    if variant == "lf_repo":
        # One selection per layer: candidates are the same in every head.
        scores = scores.masked_fill(~candidates, 0.0).mean(dim=1, keepdim=True).expand_as(scores)
    scores = scores.masked_fill(~candidates, -inf)
    return torch.where(held & (index >= slots - protect), inf, scores)


class RKVPolicy(KVPolicy):
    """R-KV (Cai et al. 2025) over static slot buffers.

    Variants (`variant`):
      - "paper" (official code): per KV head (`shared_selection = False`); the window is the last
        `window` (8) queries, `kernel` 7, `lam` 0.1, duplicate `threshold` 0.5; a compression keeps
        top(target - window) by Z plus the window.
      - "lf_repo" (the LongFlow authors' baseline): keys divided by their squared norm, no diagonal
        zeroing, threshold or duplicate retention; one shared selection per layer (Z averaged over
        the KV heads); importance summed over `lf_queries` (9 = 8 + current) queries; pool kernel
        `lf_kernel` (5); the `lf_protect` (128) newest tokens are all kept; a compression keeps
        target - `lf_margin` (4) tokens in all. What METHODS.md leaves open is taken from the
        paper variant: max over the group for the logits, softmax over the keys before the
        window's queries, max-pooling, mean over rows then softmax for the redundancy.

    Budget (`budget_mode`):
      - "cap" (default): `budget` is a hard cap. Capacity = budget; the cache fills to the budget
        and is cut to target = budget - compress_every, so it refills to exactly the budget in
        `compress_every` steps.
      - "target": the official schedule, recorded as such (peak slots above the budget). The
        cache is compressed to target = budget and grows to capacity = budget + compress_every - 1
        (the official cache reaches budget + 127 between steps). A cut happens every
        compress_every - 1 steps here, since the step that fills the capacity is followed by the
        cut, where the official code appends the 128th token and cuts in the same step.

    How it maps onto the slot buffers: a decode step (static, CUDA-graph safe) writes the new
    token into the first free slot, records its query into a per-layer ring of the last W queries
    (`[B, Hq, W, D]`, slot = position mod W) and attends. Prompt lengths are known on the host, so
    `after_step` knows when each row is full without reading the device, and compresses exactly
    those rows (all of them when they are in step): it scores the row's slots, keeps the top
    ones, and compacts them into the low slots in position order, so the free slots are the high
    ones, slot order is position order, and the last W slots are the window.

    Prompt longer than the budget: a row whose prompt exceeds capacity - 1 (cap) or the target
    (target, as the official code) is compressed at prefill by the same score, with its last W
    prompt queries as the window, to the post-compression size (top(target - W) + W for the paper
    variant). Rows are decided one by one, so a row never depends on its batch-mates.

    Deviations from the official code (where METHODS.md and it differ, METHODS.md rules):
      - In a row i with no S_ij > threshold the official code zeroes S_i0 (the max over an
        all-zero index tensor is 0); here nothing is zeroed in such a row.
      - "Most recent duplicate" and the max-pool neighbours are by position. The official code
        uses the cache index, which after a first compression is in score order (topk).
      - Scores are float32 throughout (the official casts the importance to the model dtype).
      - The official trigger is `total length % 128 == 0` for batch size 1; here each row is cut
        when its own slots are full, which gives the same period per row.
      - Attention of the decode step uses all held slots; the official step that triggers a cut
        attends to the uncut cache (budget + 128) and cuts afterwards.
    """

    name = "rkv"

    def __init__(
        self,
        budget: int | None = None,
        variant: str = "paper",
        window: int = 8,
        kernel: int = 7,
        lam: float = 0.1,
        threshold: float = 0.5,
        compress_every: int = 128,
        budget_mode: str = "cap",
        lf_queries: int = 9,
        lf_kernel: int = 5,
        lf_protect: int = 128,
        lf_margin: int = 4,
    ):
        super().__init__(budget=budget)
        if budget is None:
            raise ValueError("rkv needs a budget")
        if variant not in VARIANTS:
            raise ValueError(f"rkv variant must be one of {VARIANTS}, got {variant!r}")
        if budget_mode not in BUDGET_MODES:
            raise ValueError(f"rkv budget_mode must be one of {BUDGET_MODES}, got {budget_mode!r}")
        if not 0.0 <= lam <= 1.0:
            raise ValueError(f"rkv lam must be in [0, 1], got {lam}")
        if compress_every < 1:
            raise ValueError(f"rkv compress_every must be >= 1, got {compress_every}")
        paper = variant == "paper"
        protected = window if paper else lf_protect
        margin = 0 if paper else lf_margin
        if budget_mode == "cap" and budget - compress_every - margin <= protected:
            # A budget below the interval (the demo's, a small sweep point) could never be cut; the
            # interval, and lf_repo's protected tail that equals it, shrink to a quarter of the budget.
            shrunk = max(2, budget // 4)
            warnings.warn(f"rkv: budget {budget} leaves no room for compress_every={compress_every}; "
                          f"using {shrunk}", stacklevel=2)
            compress_every = shrunk
            lf_protect = max(min(lf_protect, shrunk), lf_queries)
        self.variant = variant
        self.budget_mode = budget_mode
        self.lam = lam
        self.threshold = threshold
        self.compress_every = compress_every
        self.queries_held = window if paper else lf_queries  # W
        self.kernel = kernel if paper else lf_kernel
        self.protect = window if paper else lf_protect  # P
        self.shared_selection = not paper
        if self.queries_held < 1 or self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(
                f"rkv needs a window >= 1 and an odd pool kernel, got {self.queries_held}, {self.kernel}"
            )
        if self.protect < self.queries_held:
            raise ValueError(f"rkv lf_protect ({lf_protect}) must be >= lf_queries ({lf_queries})")
        if budget_mode == "cap":
            self.slots, target = budget, budget - compress_every
        else:
            self.slots, target = budget + compress_every - 1, budget
        self.keep_after = target if paper else target - lf_margin  # tokens a compression keeps
        if self.keep_after >= self.slots:
            raise ValueError(f"rkv: a compression must free slots (budget_mode={budget_mode} needs "
                             f"compress_every >= 2, got {compress_every})")
        if self.keep_after <= self.protect:
            raise ValueError(
                f"rkv budget {budget} too small: a compression keeps {self.keep_after} tokens, which must "
                f"exceed the {self.protect} protected ones (budget_mode={budget_mode}, "
                f"compress_every={compress_every}, variant={variant})"
            )

    # ---- sizes -------------------------------------------------------------------------------

    def capacity(self, spec: CacheSpec) -> int:
        return self.slots

    def prompt_cut(self, length: int) -> bool:
        """Whether a row's prompt of `length` real tokens is compressed at prefill."""
        limit = self.slots - 1 if self.budget_mode == "cap" else self.keep_after
        return length > limit

    # ---- lifecycle ---------------------------------------------------------------------------

    def allocate(self, spec: CacheSpec) -> None:
        super().allocate(spec)
        # Ring of the last W queries per layer, slot = position mod W.
        self.rings = [
            torch.zeros(spec.batch, spec.q_heads, self.queries_held, spec.head_dim, dtype=spec.dtype,
                        device=spec.device)
            for _ in range(spec.layers)
        ]
        self.scale = spec.head_dim ** -0.5

    def begin_prefill(self, pad: torch.Tensor, positions: torch.Tensor) -> None:
        super().begin_prefill(pad, positions)
        self.cut_rows = torch.tensor([self.prompt_cut(n) for n in self.prompt_lengths], device=pad.device)
        self.prompt_scores: torch.Tensor | None = None

    def begin_decode(self, positions: torch.Tensor) -> None:
        super().begin_decode(positions)
        # Host count of the slots each row holds (the same in every layer and head).
        self.held = [self.keep_after if self.prompt_cut(n) else n for n in self.prompt_lengths]

    def after_step(self, step: int) -> None:
        """Every row stored one token; cut the rows whose slots are now all held."""
        self.held = [n + 1 for n in self.held]
        full = [row for row, n in enumerate(self.held) if n >= self.slots]
        if full:
            self.compress(full)
            for row in full:
                self.held[row] = self.keep_after

    # ---- prefill -----------------------------------------------------------------------------

    def attend(self, layer, q, k, v, scale):
        if self.prefilling:
            self.scale = scale
            self._record_prompt_queries(layer, q)
            if any(self.prompt_cut(n) for n in self.prompt_lengths):
                self.prompt_scores = self._prompt_scores(q, k, scale)
        return super().attend(layer, q, k, v, scale)

    def _record_prompt_queries(self, layer: int, q: torch.Tensor) -> None:
        """Ring slot r gets the row's newest prompt query t with t mod W == r (zero if none)."""
        length, ring = q.shape[2], self.queries_held
        lengths = self.pad.sum(dim=-1, keepdim=True)  # [B, 1]
        slot = torch.arange(ring, device=q.device)
        newest = lengths - 1 - torch.remainder(lengths - 1 - slot, ring)  # position, [B, W]
        source = (length - lengths + newest).clamp(min=0)  # index in the padded prompt
        queries = q.gather(2, source[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[3]))
        self.rings[layer].copy_(queries.masked_fill((newest < 0)[:, None, :, None], 0.0))

    def _prompt_scores(self, q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
        """`[B, Hkv, L]`: R-KV scores of the prompt with its last W queries as the window. In the
        rows that are cut, only the top `keep_after` tokens score above -inf (never kept)."""
        length = k.shape[2]
        window = min(self.queries_held, length)
        held = self.pad[:, None, :].expand(-1, k.shape[1], -1)
        scores = self._chunked_scores(q[:, :, length - window:], self.pad[:, length - window:], k, held, scale)
        top = scores.topk(min(self.keep_after, length), dim=-1).indices
        best = torch.zeros_like(held).scatter_(-1, top, True)
        return scores.masked_fill(self.cut_rows[:, None, None] & ~best, float("-inf"))

    def prefill_scores(self, layer, q, k, v, scale):
        # The padded prompt exceeds the slots: the base class keeps the top `capacity - 1`, which
        # holds every token of the uncut rows and the top `keep_after` of the cut ones (the rest of
        # a cut row scores -inf and is freed in `on_prompt_stored`).
        return self.prompt_scores

    def on_prompt_stored(self, layer: int, kept: torch.Tensor) -> None:
        """Frees the tokens that a cut row does not keep, then compacts: left padding leaves free
        slots below the prompt, and the free slots must be the high ones."""
        keep = self.layers[layer].valid.clone()
        if self.prompt_scores is not None:
            survives = self.prompt_scores.gather(-1, kept) > float("-inf")  # [B, Hkv, n]
            keep[..., :kept.shape[-1]] &= survives
            self.prompt_scores = None
        self._compact(layer, slice(None), keep)

    def _chunked_scores(self, queries, query_valid, keys, held, scale) -> torch.Tensor:
        """`rkv_scores` over the leading dimension in chunks of at most `SCORE_BYTES` of S x S work."""
        kv_heads, slots = keys.shape[1], keys.shape[2]
        step = max(1, SCORE_BYTES // (kv_heads * slots ** 2 * 16))
        return torch.cat([
            rkv_scores(
                queries[i:i + step], query_valid[i:i + step], keys[i:i + step], held[i:i + step], scale,
                protect=min(self.protect, slots), kernel=self.kernel, lam=self.lam,
                threshold=self.threshold, variant=self.variant,
            )
            for i in range(0, keys.shape[0], step)
        ])

    # ---- decode ------------------------------------------------------------------------------

    def decode(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Static step: record the query, attend over the held slots, point at the first free slot."""
        batch, q_heads, head_dim = q.shape
        ring = self.rings[layer]
        slot = torch.remainder(self.positions, self.queries_held)[:, None, None, None]
        ring.scatter_(2, slot.expand(batch, q_heads, 1, head_dim), q.unsqueeze(2).to(ring.dtype))
        slots = self.layers[layer]
        group = q_heads // slots.keys.shape[1]
        mask = slots.valid.repeat_interleave(group, dim=1).unsqueeze(2)  # [B, Hq, 1, S]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), slots.keys, slots.values, attn_mask=mask, scale=scale, enable_gqa=True
        )
        self.next_slot[layer].copy_(self.first_free_slot(layer))
        return out.squeeze(2)

    @torch.no_grad()
    def compress(self, rows: list[int]) -> None:
        """Cut the given rows (all slots held) to `keep_after` tokens, in every layer (host hook).

        Layers are scored together, as many as `SCORE_BYTES` of S x S work allows: a row is cut
        on its own whenever the rows are out of step, and one call per layer would be mostly
        kernel launches.
        """
        self.record_peak()  # the rows are full: their peak, before the cut frees slots
        spec, count = self.spec, len(rows)
        index = torch.tensor(rows, dtype=torch.long, device=spec.device)
        per_item = spec.kv_heads * self.slots ** 2 * 16  # bytes of S x S temporaries per (layer, row)
        group = max(1, SCORE_BYTES // (per_item * count))
        for start in range(0, spec.layers, group):
            layers = range(start, min(spec.layers, start + group))
            keys = torch.cat([self.layers[i].keys.index_select(0, index) for i in layers])  # [n*g, Hkv, S, D]
            held = torch.cat([self.layers[i].valid.index_select(0, index) for i in layers])
            queries = torch.cat([self.rings[i].index_select(0, index) for i in layers])
            every = torch.ones(len(keys), self.queries_held, dtype=torch.bool, device=spec.device)
            scores = self._chunked_scores(queries, every, keys, held, self.scale)
            chosen = scores.topk(self.keep_after, dim=-1).indices  # [n*g, Hkv, keep]
            keep = torch.zeros_like(held).scatter_(-1, chosen, True) & held
            for j, layer in enumerate(layers):
                self._compact(layer, index, keep[j * count:(j + 1) * count])

    def _compact(self, layer: int, rows: torch.Tensor | slice, keep: torch.Tensor) -> None:
        """Move the kept slots of `rows` to the low slots in position order; free the rest.

        keep: `[n, Hkv, S]` bool for the selected rows. One gather within the static buffers.
        """
        slots = self.layers[layer]
        select = (lambda t: t[rows]) if isinstance(rows, slice) else (lambda t: t.index_select(0, rows))
        positions = select(slots.positions)
        big = torch.iinfo(positions.dtype).max
        order = torch.where(keep, positions, big).argsort(dim=-1, stable=True)  # [n, Hkv, S]
        kept = keep.gather(-1, order)
        positions = positions.gather(-1, order).masked_fill(~kept, -1)
        gather = order[..., None].expand(-1, -1, -1, slots.keys.shape[-1])
        new = {
            "keys": select(slots.keys).gather(2, gather),
            "values": select(slots.values).gather(2, gather),
            "valid": kept,
            "positions": positions,
        }
        for name, tensor in new.items():
            target = getattr(slots, name)
            if isinstance(rows, slice):
                target[rows] = tensor
            else:
                target.index_copy_(0, rows, tensor)
        self.next_slot[layer].copy_(self.first_free_slot(layer))
