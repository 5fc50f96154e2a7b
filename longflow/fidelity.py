"""Teacher-forced fidelity: a KV method's next-token distributions against the full cache's, step by step.

One pass decodes a batch in lockstep over two caches of the same model: the full cache (the
reference) and the method's. At every step both caches receive the same token, the reference's
greedy choice, so the method is never pushed off the reference's path by its own mistakes; at
every output step t the pass records, per row,

    agreement[t] = argmax(method's logits) == reference token t      (after the same logits processing:
                                                                      the repetition penalty, if any)
    kl[t]        = KL(p_full || p_method) of the model's next-token distributions, in nats
                   (float32 log-softmax of the raw logits, before any logits processing)

Step 0 is the token predicted from the prompt; the prompt forward attends to the whole prompt for
every method (compression only decides what is kept after it), so step 0 always agrees. A row stops
at the reference's EOS (included) or after `max_new_tokens`; so the same pass yields the full cache's
greedy output. Greedy decoding only: under sampling, "the token the reference chose" is a draw.

The steps are built from the engine's (`prompt_forward`, `emit`, `run_steps`): static buffers
written in place, no host sync, so on a GPU the two forwards of a step replay as one CUDA graph.
Cost: two forwards per output token (the full cache's and the method's), and memory for both caches.

Notation: B batch, T max_new_tokens, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from longflow.cache import PolicyCache
from longflow.config import GenerationConfig
from longflow.engine import DecodeState, Engine
from longflow.errors import UserError
from longflow.policy import KVPolicy
from longflow.sampling import select_tokens


@dataclass
class FidelityResult:
    """One teacher-forced batch: the reference's greedy output and, per row and output step, the
    method's agreement with it and KL divergence from it (lists as long as the row's tokens)."""

    tokens: list[list[int]]  # the full cache's greedy output, the final EOS included
    finish_reasons: list[str]  # "eos" | "length"
    agreement: list[list[bool]]
    kl: list[list[float]]
    cuda_graph: bool  # whether the steps ran as graph replays


class FidelityState:
    """The per-step statistics, written in place at each row's output step: agree `[B, T + 1]` bool,
    kl `[B, T + 1]` float32 (entries past a row's end are left over from padding steps and ignored;
    column T takes those of rows that have generated all T tokens, as `DecodeState.out` does)."""

    def __init__(self, batch: int, max_new_tokens: int, device: torch.device):
        self.agree = torch.zeros(batch, max_new_tokens + 1, dtype=torch.bool, device=device)
        self.kl = torch.zeros(batch, max_new_tokens + 1, dtype=torch.float32, device=device)


def compare(state: DecodeState, fidelity: FidelityState, reference_logits: torch.Tensor, logits: torch.Tensor,
            generation: GenerationConfig) -> torch.Tensor:
    """The reference's greedy token `[B]` for each row's output `state.step`; records the method's agreement and
    KL there. reference_logits, logits: `[B, V]` of the full cache and of the method."""
    token = select_tokens(reference_logits, generation, state.seeds, state.step, state.seen)
    choice = select_tokens(logits, generation, state.seeds, state.step, state.seen)
    log_p = F.log_softmax(reference_logits.float(), dim=-1)
    log_q = F.log_softmax(logits.float(), dim=-1)
    kl = F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(dim=-1)  # sum p (log p - log q)
    kl = kl.clamp(min=0.0)  # rounding can take a zero divergence a hair below 0
    column = state.step[:, None]
    fidelity.agree.scatter_(1, column, (choice == token)[:, None])
    fidelity.kl.scatter_(1, column, kl[:, None])
    return token


def teacher_forced_prefill(engine: Engine, reference: PolicyCache, cache: PolicyCache, state: DecodeState,
                           fidelity: FidelityState, input_ids: torch.Tensor, pad: torch.Tensor,
                           generation: GenerationConfig) -> None:
    """The prompt `[B, L]` through both caches, then output 0 and its statistics."""
    reference_logits, logits = engine.prompt_forward((reference, cache), state, input_ids, pad)
    engine.emit(state, compare(state, fidelity, reference_logits, logits, generation), generation)


def teacher_forced_step(engine: Engine, reference: PolicyCache, cache: PolicyCache, state: DecodeState,
                        fidelity: FidelityState, generation: GenerationConfig) -> None:
    """The reference's last token into both caches, then the next output and its statistics."""
    token, positions = state.token[:, None], state.positions[:, None]
    reference_logits = engine.forward(reference, token, positions)
    logits = engine.forward(cache, token, positions)
    state.positions += 1
    engine.emit(state, compare(state, fidelity, reference_logits, logits, generation), generation)


@torch.inference_mode()
def teacher_force(engine: Engine, prompts: list[list[int]], generation: GenerationConfig,
                  reference_factory: Callable[[], KVPolicy]) -> FidelityResult:
    """Teacher-forced statistics of `engine`'s method against `reference_factory`'s policy (the full
    cache: `baselines.vanilla.VanillaPolicy`) over one batch of tokenised prompts."""
    if not generation.greedy:
        raise UserError("teacher-forced fidelity needs greedy decoding (generation.temperature=0), "
                        f"got temperature {generation.temperature}")
    if not prompts:
        raise ValueError("teacher_force needs at least one prompt")
    input_ids, pad = engine.batch_inputs(prompts)
    batch, steps = len(prompts), generation.max_new_tokens
    reference = engine.new_cache(reference_factory, batch, pad.shape[1], generation)
    cache = engine.new_cache(engine.policy_factory, batch, pad.shape[1], generation)
    state = DecodeState(batch, steps, engine.vocab, [0] * batch, engine.pad_id, engine.device,
                        track_seen=generation.repetition_penalty != 1.0)
    fidelity = FidelityState(batch, steps, engine.device)
    teacher_forced_prefill(engine, reference, cache, state, fidelity, input_ids, pad, generation)
    _, used_graph = engine.run_steps(
        lambda: teacher_forced_step(engine, reference, cache, state, fidelity, generation),
        (reference.policy, cache.policy), state, steps - 1,
    )
    tokens, reasons = engine.outputs(state, generation)
    agree, kl = fidelity.agree.tolist(), fidelity.kl.tolist()
    return FidelityResult(
        tokens=tokens, finish_reasons=reasons,
        agreement=[row[:len(t)] for row, t in zip(agree, tokens, strict=True)],
        kl=[row[:len(t)] for row, t in zip(kl, tokens, strict=True)],
        cuda_graph=used_graph,
    )
