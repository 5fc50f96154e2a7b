"""InfoKV: attention plus information, the entropy of each token and how its representation changes.

Kai, Xiao, Birch and Lin 2026, "Information-Aware KV Cache Compression for Long Reasoning", arXiv
2606.26875. No code was found and the paper's text was not reachable here: the formulas come from
a full-text summary (docs/methods.md, "InfoKV", lists what is faithful and what is assumed). The
attention term is that of RPC (Song et al. 2025, "Reasoning Path Compression", official code
jiwonsong-dev/ReasoningPathCompression), whose schedule the paper's decode experiments follow; its
`rpc/rpc_utils.py` gives the rule followed here: softmax over the generated keys before the window
(line 112), summed over the window queries (113), averaged over all query heads for
`aggregation='all'` (115-121), average-pooled over 7 with zero padding (136), top-k (142), the
prompt and the last R tokens kept (147-154).

Per layer l and held token i, at each compression:

    H_i     = entropy of the top-`top_k` (256) renormalized softmax of the logits token i was
              drawn from (the forward at position i - 1; `first_entropy` for position 0)
    D_i^l   = 1 - cos(h_i^l, h_i^final), h^l the hidden state of layer l (`layer_state`),
              h^final the model's last hidden state (after the final norm, what the LM head reads)
    E_i^l   = (D_i^l + tau) H_i                         (tau = 1: no zero at the final layer)
    A_i^l   = RPC's attention: the `window` (32) newest queries' softmax over the candidate keys,
              summed over the queries, averaged over all query heads (one selection per layer,
              `granularity: layer`), average-pooled over `kernel` (7) slots, scaled to sum to 1
    S_i^l   = alpha A_i^l + (1 - alpha) softmax_i(E^l)  over the candidates

The candidates are the held tokens except the `window` newest and, with `keep_prompt`, the prompt
(RPC keeps both); when the prompt and the window do not fit in a cut, the prompt's tokens compete
by S. A cut keeps the top S plus those.

Where E comes from (`observe`, the engine's hook; nothing leaves the decode step's CUDA graph): the
engine hands every forward's logits and hidden states to the policy. At a decode step the token
stored in it was drawn from the PREVIOUS forward's logits, whose top-k entropy waits in a `[B]`
buffer; the step's own hidden states give its D^l, and E^l is written into the slot that holds it
in each layer (a per-slot state that follows its slot through compactions); the step's logits
then give the entropy of the next token. At prefill the engine hands the logits of every prompt
position: their entropy is computed in chunks of positions (`ENTROPY_ELEMENTS` logits at a time),
shifted by one position, and written with D^l into the kept prompt slots.

Schedule: an interval method. The paper (and RPC) recompresses every `compress_every` (1024)
generated tokens to a ratio of them; under the harness's cap the cache fills to `budget` and is
cut to budget - compress_every (R-KV's capped form; a budget at or below the interval shrinks it,
and a cut that would keep no more than the window sets the window to half the slots the cut
keeps, both with a warning).
A prompt longer than the budget is cut at prefill by SnapKV (one selection per layer): E is only
known after the prompt's forward, when each layer has already stored its prompt (see docs).

Notation: B batch, n rows, Lq positions of a forward, L padded prompt length, V vocabulary, Hq
query heads, Hkv KV heads, G = Hq / Hkv, S slots, W window queries, D head dim.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from longflow.errors import UserError
from longflow.policy import CacheSpec, KVPolicy, Observation, keep_after_cut, one_of
from longflow.slots import SlotState

GRANULARITIES = ("layer", "kv_head")
LAYER_STATES = ("output", "input")
# Logits whose top-k one chunk of the prompt's entropy takes at once: a bound on the temporaries,
# whatever the batch, the prompt length and the vocabulary.
ENTROPY_ELEMENTS = 1 << 26
# float32 temporaries of one scoring call (the window queries' logits over the slots): rows in chunks below it.
SCORE_BYTES = 1 << 30
TEMPORARIES = 3  # float32 tensors of a logit's size alive at once in `infokv_scores`


def topk_entropy(logits: torch.Tensor, top_k: int, chunk_elements: int = ENTROPY_ELEMENTS) -> torch.Tensor:
    """Entropy of the softmax over each position's `top_k` largest logits, renormalized.

    logits: `[B, Lq, V]` -> `[B, Lq]` float32, in chunks of positions of at most `chunk_elements` logits.
    """
    batch, length, vocab = logits.shape
    top_k = min(top_k, vocab)
    step = max(1, chunk_elements // (batch * vocab))
    parts = []
    for start in range(0, length, step):
        top = logits[:, start:start + step].topk(top_k, dim=-1, sorted=False).values.float()
        log_p = torch.log_softmax(top, dim=-1)
        parts.append(-(log_p.exp() * log_p).sum(dim=-1))
    return torch.cat(parts, dim=1)


def drawn_entropy(entropy: torch.Tensor, positions: torch.Tensor, first: float) -> torch.Tensor:
    """The entropy of the distribution each token was drawn from: that of the position before it.

    entropy: `[B, L]` of each position's own prediction; positions: `[B, L]` (0 = a row's first
    token, which no distribution precedes: `first`). -> `[B, L]`.
    """
    shifted = torch.cat([entropy.new_full((entropy.shape[0], 1), first), entropy[:, :-1]], dim=1)
    return shifted.masked_fill(positions == 0, first)


def representation_change(hidden_states: tuple[torch.Tensor, ...], layer_state: str) -> torch.Tensor:
    """D^l = 1 - cos(h^l, h^final) per layer: `[layers, B, Lq]` float32.

    hidden_states: transformers' tuple of layers + 1 tensors `[B, Lq, hidden]`: the input of each
    layer (the embeddings first), then the last hidden state. `layer_state: output`: h^l is what
    layer l writes (entry l + 1; the last layer's is the last hidden state, so its D is 0);
    `input`: what it reads (entry l).
    """
    final = hidden_states[-1].float()
    states = hidden_states[1:] if layer_state == "output" else hidden_states[:-1]
    return torch.stack([1.0 - F.cosine_similarity(h.float(), final, dim=-1, eps=1e-8) for h in states])


def infokv_scores(queries: torch.Tensor, query_valid: torch.Tensor, keys: torch.Tensor, candidates: torch.Tensor,
                  evolution: torch.Tensor, scale: float, *, alpha: float, kernel: int, shared: bool,
                  normalize_attention: bool) -> torch.Tensor:
    """S = alpha A + (1 - alpha) softmax(E) over the candidate keys (see the module docstring).

    Args:
        queries: `[n, Hq, W, D]` after RoPE; query_valid: `[n, W]` bool.
        keys: `[n, Hkv, S, D]` (slots in position order); candidates: `[n, Hkv, S]` bool.
        evolution: `[n, Hkv, S]` E of each slot's token.
        shared: A averaged over all query heads (one selection per layer), else over each KV head's G.

    Returns:
        `[n, Hkv, S]` float32, -inf outside the candidates.
    """
    rows, q_heads, window, head_dim = queries.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    grouped = queries.float().view(rows, kv_heads, q_heads // kv_heads * window, head_dim)
    logits = torch.matmul(grouped, keys.float().transpose(-1, -2)) * scale  # [n, Hkv, G*W, S]
    logits = logits.view(rows, kv_heads, q_heads // kv_heads, window, slots)
    logits = logits.masked_fill(~candidates[:, :, None, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0) * query_valid[:, None, None, :, None]
    attention = probs.sum(dim=3).mean(dim=2)  # [n, Hkv, S]: summed over the queries, mean over the group
    if shared:
        attention = attention.mean(dim=1, keepdim=True).expand_as(attention)
    if kernel > 1:  # zero outside the candidates, as RPC pools the generated keys with zero padding
        attention = F.avg_pool1d(attention.flatten(0, 1)[:, None], kernel, stride=1,
                                 padding=kernel // 2).view(rows, kv_heads, slots)
    attention = attention.masked_fill(~candidates, 0.0)
    if normalize_attention:
        attention = attention / attention.sum(dim=-1, keepdim=True).clamp(min=1e-30)
    information = torch.softmax(evolution.float().masked_fill(~candidates, float("-inf")), dim=-1).nan_to_num(0.0)
    scores = alpha * attention + (1.0 - alpha) * information
    return scores.masked_fill(~candidates, float("-inf"))


@dataclass(eq=False)
class InfoKVPolicy(KVPolicy):
    """InfoKV (see the module docstring for every field and assumption)."""

    alpha: float = 0.95
    top_k: int = 256
    tau: float = 1.0
    window: int = 32
    kernel: int = 7
    compress_every: int = 1024
    keep_prompt: bool = True
    granularity: str = "layer"
    layer_state: str = "output"
    first_entropy: float = 0.0
    normalize_attention: bool = True

    name = "infokv"
    schedule = "interval"
    observes = frozenset({"logits", "prompt_logits", "hidden_states"})

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.alpha <= 1.0:
            raise UserError(f"{self.name}: alpha must be in [0, 1], got {self.alpha}")
        one_of(self.name, "granularity", self.granularity, GRANULARITIES)
        one_of(self.name, "layer_state", self.layer_state, LAYER_STATES)
        if self.top_k < 1 or self.window < 1 or self.compress_every < 1:
            raise UserError(f"{self.name}: top_k, window and compress_every must be >= 1, got {self.top_k}, "
                            f"{self.window}, {self.compress_every}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise UserError(f"{self.name}: kernel must be odd and >= 1, got {self.kernel}")
        self.shared_selection = self.granularity == "layer"
        self.recent = self.window  # the window in force: queries scored with and newest tokens kept
        if self.budget is not None:
            self.keep_after = keep_after_cut(self.name, self.budget, self.compress_every, least_kept=2)
            if self.keep_after <= self.window:
                # A budget this small (a test's, a small sweep point) keeps a window of half the cut.
                self.recent = self.keep_after // 2
                warnings.warn(f"{self.name}: budget {self.budget} leaves no room for window={self.window}; "
                              f"using {self.recent}", stacklevel=3)

    def query_window(self) -> int:
        return self.recent

    def slot_state(self) -> dict[str, SlotState]:
        return {"evolution": SlotState()}  # E of the slot's token per layer, written by `observe`

    # ---- observing the forward -------------------------------------------------------------------

    def allocate(self, spec: CacheSpec) -> None:
        super().allocate(spec)
        # The top-k entropy of the latest logits: that of the distribution the next stored token is drawn from.
        self.pending = torch.zeros(spec.batch, dtype=torch.float32, device=spec.device)
        self.prompt_end = torch.zeros(spec.batch, dtype=torch.long, device=spec.device)

    def begin_prefill(self, pad: torch.Tensor, positions: torch.Tensor) -> None:
        super().begin_prefill(pad, positions)
        self.prompt_end.copy_(pad.sum(dim=-1))

    def admit(self, rows: torch.Tensor, staged: InfoKVPolicy) -> None:
        super().admit(rows, staged)
        self.pending.index_copy_(0, rows, staged.pending)
        self.prompt_end.index_copy_(0, rows, staged.prompt_end)

    def observe(self, logits: torch.Tensor, hidden_states: tuple[torch.Tensor, ...] | None) -> None:
        """logits `[B, Lq, V]`, hidden_states: layers + 1 tensors `[B, Lq, hidden]` (see `representation_change`)."""
        change = representation_change(hidden_states, self.layer_state)  # [layers, B, Lq]
        if self.prefilling:
            entropy = topk_entropy(logits, self.top_k)  # [B, L]
            drawn = drawn_entropy(entropy, self.prompt_positions, self.first_entropy)
            evolution = (change + self.tau) * drawn  # [layers, B, L]
            length = logits.shape[1]
            offset = (length - self.prompt_end)[:, None, None]  # a prompt position's index in the padded prompt
            for layer, slots in enumerate(self.layers):
                index = (offset + slots.positions).clamp(0, length - 1).flatten(1)  # [B, Hkv * S]
                value = evolution[layer].gather(1, index).view_as(slots.positions)
                slots.state["evolution"].copy_(torch.where(slots.valid, value, 0.0))
            self.pending.copy_(entropy[:, -1])
            return
        # A decode step: the token it stored (at `positions`) was drawn from the previous logits.
        evolution = (change[:, :, -1] + self.tau) * self.pending  # [layers, B]
        for layer, slots in enumerate(self.layers):
            stored = slots.positions == self.positions[:, None, None]
            state = slots.state["evolution"]
            state.copy_(torch.where(stored, evolution[layer][:, None, None], state))
        self.pending.copy_(topk_entropy(logits[:, -1:], self.top_k)[:, 0])

    # ---- the score -------------------------------------------------------------------------------

    def protected(self, obs: Observation) -> torch.Tensor:
        """The `window` newest tokens, and with `keep_prompt` the prompt when it fits in the cut."""
        positions, valid = obs.positions, obs.valid
        protect = valid & (positions > obs.newest[:, None, None] - self.recent)
        if self.keep_prompt:
            ends = self.prompt_end if obs.rows is None else self.prompt_end.index_select(0, obs.rows)
            prompt = valid & (positions < ends[:, None, None])
            fits = prompt.sum(dim=-1, keepdim=True) + self.recent <= self.keep_after  # [n, Hkv, 1]
            protect = protect | (prompt & fits)
        return protect

    def score(self, obs: Observation) -> torch.Tensor:
        """`infokv_scores` of the unprotected held slots with the `window` newest queries."""
        queries, _, query_valid = obs.queries(self.recent)
        candidates = obs.valid & ~self.protected(obs)
        keys, evolution = obs.keys, obs.state("evolution")
        step = max(1, SCORE_BYTES // (TEMPORARIES * 4 * queries.shape[1] * queries.shape[2] * keys.shape[2]))
        return torch.cat([
            infokv_scores(queries[i:i + step], query_valid[i:i + step], keys[i:i + step], candidates[i:i + step],
                          evolution[i:i + step], obs.scale, alpha=self.alpha, kernel=self.kernel,
                          shared=self.shared_selection, normalize_attention=self.normalize_attention)
            for i in range(0, len(keys), step)
        ])
