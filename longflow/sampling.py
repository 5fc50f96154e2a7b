"""Token selection without host synchronisation.

Sampling uses the exponential race (argmax of p / E with E ~ Exp(1) is a draw from p), as gpt-fast
and nano-vllm do, because `torch.multinomial` synchronises with the host. The noise is not drawn
from a torch Generator: each row hashes its own (seed, step, token) counter, so a row's sample
depends only on its seed and step, never on which other prompts share its batch or on the batch
size, and a resumed run redraws exactly the samples it lost.
"""

from __future__ import annotations

import torch

from longflow.config import GenerationConfig


def _logical_shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    # torch's >> on int64 is arithmetic; masking off the sign-extended bits makes it logical.
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (multiplication wraps modulo 2^64)."""
    x = x + -7046029254386353131  # 0x9E3779B97F4A7C15 as signed int64
    x = (x ^ _logical_shift_right(x, 30)) * -4658895280553007687  # 0xBF58476D1CE4E5B9
    x = (x ^ _logical_shift_right(x, 27)) * -7723592293110705685  # 0x94D049BB133111EB
    return x ^ _logical_shift_right(x, 31)


def row_uniform(seeds: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform noise in (0, 1), `[B, vocab]` float32, a pure function of (seeds[b], step[b], token).

    seeds: `[B]` int64; step: `[B]` int64, each row's output step (a tensor so that a captured graph
    sees its updates).
    """
    tokens = torch.arange(vocab, device=seeds.device, dtype=torch.long)
    row = _splitmix64(seeds * 1_000_003 + step)  # [B]
    bits = _splitmix64(row[:, None] ^ tokens[None, :])  # [B, V]
    mantissa = _logical_shift_right(bits, 40).to(torch.float32)  # 24 random bits
    return (mantissa + 0.5) / float(1 << 24)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF's rule: a seen token's logit is divided by `penalty` if positive, multiplied if negative.

    logits: `[B, V]` float32; seen: `[B, V]` bool.
    """
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set to -inf every logit outside the top-k and outside the top-p nucleus. `[B, V]`."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token when the mass before it already reaches top_p; the first token always stays.
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def select_tokens(
    logits: torch.Tensor,
    config: GenerationConfig,
    seeds: torch.Tensor,
    step: torch.Tensor,
    seen: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next token per row, `[B, V]` -> `[B]` int64, without a host sync."""
    logits = logits.float()
    if config.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, seen, config.repetition_penalty)
    if config.greedy:
        return logits.argmax(dim=-1)
    logits = filter_top_k_top_p(logits / config.temperature, config.top_k, config.top_p)
    probs = torch.softmax(logits, dim=-1)
    exponential = -torch.log(row_uniform(seeds, step, logits.shape[-1]))
    return (probs / exponential).argmax(dim=-1)
