"""The batched generation loop: prefill, then one token per step over a KV policy's static cache.

Written as small named steps (`prefill`, `decode_one_token`, `decode_n_tokens`) in the manner of
gpt-fast. The decode step changes only preallocated tensors in place and never reads a value back
to the host (finished rows are tracked on the device), so on a GPU it is captured once per batch in
a CUDA graph and replayed: the model's Python code then costs nothing per step. The host looks at
the device only every `check_every` steps, to stop when every row has finished.
`longflow.fidelity` builds its teacher-forced pass, two caches in lockstep, from the same steps.

Notation: B batch, L padded prompt length, T max_new_tokens, V vocab.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from longflow.cache import PolicyCache
from longflow.compile import compiled_decode
from longflow.config import EngineConfig, GenerationConfig
from longflow.policy import ALIGN, CacheSpec, KVPolicy, round_up
from longflow.sampling import select_tokens


@dataclass
class BatchResult:
    """What one batch produced. Token lists hold the generated ids, the final EOS included."""

    tokens: list[list[int]]
    finish_reasons: list[str]  # "eos" | "length"
    prompt_tokens: list[int]
    prefill_seconds: float  # prompt forward and first token: the batch's time to first token
    step_seconds: list[float]  # wall time of each decode step, device-synchronised
    peak_slots: list[int]  # most KV slots held by each row, over layers and heads
    peak_memory_bytes: int | None  # peak device memory during the batch (None on CPU)
    cuda_graph: bool  # whether the decode steps ran as graph replays


class DecodeState:
    """The preallocated tensors one decode step reads and writes.

    token, positions: `[B]` the last token and its position; step: 0-d, index of the next output
    token; out: `[B, T]` output ids; finished: `[B]` bool; seen: `[B, V]` bool for the repetition
    penalty (None when unused); seeds: `[B]` sampling seeds.
    """

    def __init__(self, batch: int, max_new_tokens: int, vocab: int, seeds: list[int], pad_id: int,
                 device: torch.device, track_seen: bool):
        self.token = torch.full((batch,), pad_id, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)
        self.step = torch.zeros((), dtype=torch.long, device=device)
        self.out = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long, device=device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.seen = torch.zeros(batch, vocab, dtype=torch.bool, device=device) if track_seen else None
        self.seeds = torch.tensor(seeds, dtype=torch.long, device=device)


class Engine:
    """Generates for batches of tokenised prompts with a fresh KV policy per batch."""

    def __init__(
        self,
        model: PreTrainedModel,
        policy_factory: Callable[[], KVPolicy],
        eos_ids: list[int],
        pad_id: int,
        config: EngineConfig | None = None,
    ):
        self.model = model
        self.policy_factory = policy_factory
        self.config = config or EngineConfig()
        self.device = next(model.parameters()).device
        self.eos_ids = torch.tensor(eos_ids, dtype=torch.long, device=self.device)
        self.pad_id = pad_id
        text_config = model.config.get_text_config()
        self.num_layers = text_config.num_hidden_layers
        self.q_heads = text_config.num_attention_heads
        self.kv_heads = text_config.num_key_value_heads
        self.head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // self.q_heads
        self.vocab = text_config.vocab_size
        self.dtype = next(model.parameters()).dtype
        # Handed to the policies that re-rotate cached keys (StreamingLLM's `lf_repo`), so that they
        # use the model's own frequencies and scaling (Llama 3.1's `rope_scaling` included).
        self.rotary = getattr(model.get_decoder(), "rotary_emb", None)
        # The decode steps' forward, compiled (`longflow.compile`); None: the model's own, eagerly.
        self.decode_forward = compiled_decode(model) if self.config.compile and self.device.type == "cuda" else None

    # ---- the steps ---------------------------------------------------------------------------

    def forward(self, cache: PolicyCache, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions `[B, Lq]` -> logits of the last position `[B, V]`.

        A policy that observes the forward (`KVPolicy.observes`) gets its logits, those of every
        prompt position at prefill when it asks for them, and every layer's hidden states when it
        asks for them; nothing is computed for the others.
        """
        policy = cache.policy
        observes = policy.observes
        model = self.model if policy.prefilling or self.decode_forward is None else self.decode_forward
        output = model(
            input_ids=input_ids,
            position_ids=positions,
            past_key_values=cache,
            kv_cache=cache,
            use_cache=True,
            logits_to_keep=0 if policy.prefilling and "prompt_logits" in observes else 1,
            output_hidden_states="hidden_states" in observes,
        )
        if observes:
            policy.observe(output.logits, output.hidden_states)
        return output.logits[:, -1]

    def prefill(self, cache, state, input_ids, pad, generation) -> None:
        """Prompt forward `[B, L]`, then the first token into `state`."""
        (logits,) = self.prompt_forward((cache,), state, input_ids, pad)
        self.emit(state, select_tokens(logits, generation, state.seeds, state.step, state.seen), generation)

    def prompt_forward(self, caches, state, input_ids, pad) -> list[torch.Tensor]:
        """The prompt `[B, L]` through each cache in `caches`, which then expect the first decode
        step at `state.positions`; returns each cache's last logits `[B, V]`."""
        positions = (pad.long().cumsum(dim=-1) - 1).clamp(min=0)
        logits = []
        for cache in caches:
            cache.policy.begin_prefill(pad, positions)
            logits.append(self.forward(cache, input_ids, positions))
        if state.seen is not None:
            state.seen.scatter_(1, input_ids, pad)
        state.positions.copy_(pad.sum(dim=-1))
        for cache in caches:
            cache.policy.begin_decode(state.positions)
        return logits

    def emit(self, state: DecodeState, token: torch.Tensor, generation: GenerationConfig) -> None:
        """Record `token` `[B]` as output `step`, in place (finished rows emit padding)."""
        token = torch.where(state.finished, self.pad_id, token)
        state.out.scatter_(1, state.step.expand(token.shape[0], 1), token[:, None])
        if state.seen is not None:
            state.seen.scatter_(1, token[:, None], True)
        if not generation.ignore_eos:
            state.finished |= torch.isin(token, self.eos_ids)
        state.token.copy_(token)
        state.step += 1

    def decode_one_token(self, cache, state, generation) -> None:
        logits = self.forward(cache, state.token[:, None], state.positions[:, None])
        state.positions += 1
        self.emit(state, select_tokens(logits, generation, state.seeds, state.step, state.seen), generation)

    def decode_n_tokens(self, cache, state, generation, steps: int) -> tuple[list[float], bool]:
        """Runs up to `steps` decode steps; returns (seconds per step, whether a graph was used)."""
        return self.run_steps(lambda: self.decode_one_token(cache, state, generation), (cache.policy,), state, steps)

    def run_steps(self, run_step: Callable[[], None], policies, state, steps: int) -> tuple[list[float], bool]:
        """Runs `run_step` up to `steps` times, with each policy's host hooks around every step,
        until every row of `state` has finished.

        On a GPU the step is captured once, at the first step after the first (eager) one that no
        policy asks to run eagerly, and replayed from then on; the steps a policy asks for
        (`before_step`) always run eagerly.
        """
        timer = StepTimer(self.device)
        graph, tried = None, not (self.device.type == "cuda" and self.config.cuda_graph)
        for step in range(steps):
            eager = any([policy.before_step(step) for policy in policies])  # every policy's hook runs
            if not tried and step >= 1 and not eager:
                graph, tried = capture(run_step), True
            timer.start()
            if graph is not None and not eager:
                graph.replay()
            else:
                run_step()
            timer.stop()
            for policy in policies:
                policy.after_step(step)
            if (step + 1) % self.config.check_every == 0 and bool(state.finished.all()):
                break
        return timer.seconds(), graph is not None

    # ---- a batch -----------------------------------------------------------------------------

    def warm_up(self) -> None:
        """One tiny batch, so that one-time costs (kernel loading, library handles, Triton
        compilation, graph pools) stay out of the first timed batch."""
        self.generate([[self.pad_id] * ALIGN], GenerationConfig(max_new_tokens=4, ignore_eos=True), [0])

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], generation: GenerationConfig, seeds: list[int]) -> BatchResult:
        if not prompts or len(prompts) != len(seeds):
            raise ValueError("generate needs one seed per prompt and at least one prompt")
        input_ids, pad = self.batch_inputs(prompts)
        batch = len(prompts)
        on_gpu = self.device.type == "cuda"
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(self.device)
        cache = self.new_cache(self.policy_factory, pad, generation)
        state = DecodeState(batch, generation.max_new_tokens, self.vocab, seeds, self.pad_id, self.device,
                            track_seen=generation.repetition_penalty != 1.0)

        synchronize(self.device)
        start = time.perf_counter()
        self.prefill(cache, state, input_ids, pad, generation)
        synchronize(self.device)
        prefill_seconds = time.perf_counter() - start
        step_seconds, used_graph = self.decode_n_tokens(cache, state, generation, generation.max_new_tokens - 1)

        tokens, reasons = self.outputs(state, generation)
        return BatchResult(
            tokens=tokens,
            finish_reasons=reasons,
            prompt_tokens=[len(p) for p in prompts],
            prefill_seconds=prefill_seconds,
            step_seconds=step_seconds,
            peak_slots=cache.policy.peak_slots(),
            peak_memory_bytes=torch.cuda.max_memory_allocated(self.device) if on_gpu else None,
            cuda_graph=used_graph,
        )

    def batch_inputs(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded input ids `[B, L]` and their mask `[B, L]` bool (True = real token), on the device.

        L is padded to a multiple of ALIGN: a prompt length like 635 makes the rows of SDPA's mask
        and of the decode matmuls' operands misaligned for 16-byte loads, and the GPU falls back to
        kernels 2-3x slower (seen on an H200). The extra left padding is masked out like the rest.
        """
        if min(len(p) for p in prompts) == 0:
            raise ValueError("empty prompt")
        batch, length = len(prompts), round_up(max(len(p) for p in prompts), ALIGN)
        input_ids = torch.full((batch, length), self.pad_id, dtype=torch.long)
        pad = torch.zeros(batch, length, dtype=torch.bool)
        for row, prompt in enumerate(prompts):
            input_ids[row, length - len(prompt):] = torch.tensor(prompt)
            pad[row, length - len(prompt):] = True
        return input_ids.to(self.device), pad.to(self.device)

    def new_cache(self, policy_factory: Callable[[], KVPolicy], pad: torch.Tensor,
                  generation: GenerationConfig) -> PolicyCache:
        """A fresh policy from `policy_factory`, allocated for the batch of `pad` `[B, L]`."""
        policy = policy_factory()
        policy.allocate(CacheSpec(
            batch=pad.shape[0], layers=self.num_layers, q_heads=self.q_heads, kv_heads=self.kv_heads,
            head_dim=self.head_dim, prompt_len=pad.shape[1], max_new_tokens=generation.max_new_tokens,
            dtype=self.dtype, device=self.device, rotary=self.rotary, vocab=self.vocab,
        ))
        return PolicyCache(policy, self.num_layers)

    def outputs(self, state: DecodeState, generation: GenerationConfig) -> tuple[list[list[int]], list[str]]:
        """Each row's generated ids, up to and with its first EOS, and its finish reason (syncs the host)."""
        out, finished = state.out.tolist(), state.finished.tolist()
        eos = set(self.eos_ids.tolist())
        tokens, reasons = [], []
        for row, ids in enumerate(out):
            end = next((i + 1 for i, t in enumerate(ids) if t in eos), None) if not generation.ignore_eos else None
            tokens.append(ids[:end] if end else ids)
            reasons.append("eos" if end and finished[row] else "length")
        return tokens, reasons


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def capture(step: Callable[[], None]) -> torch.cuda.CUDAGraph | None:
    """Captures one decode step as a CUDA graph, or returns None (with a warning) if it can't be.

    The step has already run once eagerly (the first decode step), which is the warm-up capture
    needs; capture itself records kernels without running them, so no token is produced twice.
    """
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            step()
    except Exception as error:  # noqa: BLE001 - any capture failure falls back to eager steps
        warnings.warn(f"CUDA graph capture failed, decoding eagerly: {error}", stacklevel=2)
        torch.cuda.synchronize()
        return None
    return graph


class StepTimer:
    """Per-step wall times: CUDA events on a GPU (read once at the end, no sync per step), a host
    clock on the CPU, where every op is synchronous."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.starts: list = []
        self.stops: list = []

    def start(self) -> None:
        self.starts.append(self._mark())

    def stop(self) -> None:
        self.stops.append(self._mark())

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self) -> list[float]:
        if not self.cuda:
            return [stop - start for start, stop in zip(self.starts, self.stops, strict=True)]
        torch.cuda.synchronize()
        return [start.elapsed_time(stop) / 1000 for start, stop in zip(self.starts, self.stops, strict=True)]
