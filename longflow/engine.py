"""The batched generation loop: prefill, then one token per step over a KV policy's static cache.

Written as small named steps (`prefill`, `decode_one_token`, `decode_n_tokens`) in the manner of
gpt-fast. The decode step changes only preallocated tensors in place and never reads a value back
to the host (finished rows are tracked on the device), so on a GPU it is captured once in a CUDA
graph and replayed: the model's Python code then costs nothing per step. The host looks at the
device only every `check_every` steps.

Two ways to batch:
- `generate`: a static batch. Every row starts together and the batch runs until its last row ends.
- `serve`: continuous batching, in the manner of nano-vllm's scheduler. A fixed number of rows
  decode together; every `check_every` steps the rows that finished hand their outputs back and
  take the next prompts of the queue, prefilled apart (a small batch of their own through a fresh
  policy) and copied into those rows (`KVPolicy.admit`), while the graph of the decode step,
  captured once, goes on being replayed. Every row has its own output step, position and length
  limit, so an item's tokens do not depend on which rows decode beside it.
`longflow.fidelity` builds its teacher-forced pass, two caches in lockstep, from the same steps.

Notation: B batch (rows), L padded prompt length, T max_new_tokens, V vocab.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from longflow.cache import PolicyCache
from longflow.compile import compiled_forward
from longflow.config import EngineConfig, GenerationConfig, VerifyConfig
from longflow.policy import ALIGN, CacheSpec, KVPolicy, round_up
from longflow.sampling import select_tokens
from longflow.verify import FullCache, RoundSeconds, Verifier


@dataclass
class BatchResult:
    """What one static batch produced. Token lists hold the generated ids, the final EOS included."""

    tokens: list[list[int]]
    finish_reasons: list[str]  # "eos" | "length"
    prompt_tokens: list[int]
    prefill_seconds: float  # prompt forward and first token: the batch's time to first token
    step_seconds: list[float]  # wall time of each decode step, device-synchronised
    peak_slots: list[int]  # most KV slots held by each row, over layers and heads
    peak_memory_bytes: int | None  # peak device memory during the batch (None on CPU)
    cuda_graph: bool  # whether the decode steps ran as graph replays
    # With verification (`longflow.verify`): step_seconds holds each round's, and each row's
    # statistics (`Verifier.row_stats`) and where the rounds spent their time are here.
    verify: list[dict] | None = None
    round_seconds: RoundSeconds | None = None


@dataclass
class Served:
    """One sequence that `Engine.serve` finished."""

    index: int  # its place in the prompts handed to `serve`
    tokens: list[int]  # the generated ids, the final EOS included
    finish_reason: str  # "eos" | "length"
    prompt_tokens: int
    seconds: float  # from the start of its prefill to the check that found it finished
    peak_slots: int  # most KV slots it held, over layers and heads
    verify: dict | None = None  # its verification statistics (`Verifier.row_stats`), when verifying


@dataclass
class Staged:
    """An admission prefilled apart, waiting for its rows (`Engine.serve` with overlapped admissions)."""

    rows: list[int]
    indices: list[int]  # the queue's prompts it holds, in the order of `rows`
    cache: PolicyCache
    state: DecodeState
    started: float  # host clock at the start of its prefill


@dataclass
class ServeRound:
    """What `Engine.serve` did between two looks at the device: the sequences it finished, and the
    work since the previous round (the admissions' prefills, the decode steps of every row)."""

    finished: list[Served]
    prefill_seconds: float
    step_seconds: list[float]
    peak_memory_bytes: int | None
    cuda_graph: bool
    rows: int  # rows decoding together
    admitted: int  # sequences prefilled into free rows for the round (beside it, when overlapped)


class DecodeState:
    """The preallocated tensors one decode step reads and writes, one row per sequence.

    token, positions: `[B]` the last token and its position; step: `[B]` int64, the index of each
    row's next output token; limit: `[B]` int64, the tokens a row may generate; out: `[B, T + 1]`
    output ids (column T takes the writes of rows that have finished); finished: `[B]` bool; seen:
    `[B, V]` bool for the repetition penalty (None when unused); seeds: `[B]` sampling seeds.
    """

    def __init__(self, batch: int, max_new_tokens: int, vocab: int, seeds: list[int], pad_id: int,
                 device: torch.device, track_seen: bool, limits: list[int] | None = None, finished: bool = False):
        self.token = torch.full((batch,), pad_id, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)
        self.step = torch.zeros(batch, dtype=torch.long, device=device)
        self.limit = torch.tensor(limits or [max_new_tokens] * batch, dtype=torch.long, device=device)
        self.out = torch.full((batch, max_new_tokens + 1), pad_id, dtype=torch.long, device=device)
        self.finished = torch.full((batch,), finished, dtype=torch.bool, device=device)
        self.seen = torch.zeros(batch, vocab, dtype=torch.bool, device=device) if track_seen else None
        self.seeds = torch.tensor(seeds, dtype=torch.long, device=device)

    def admit(self, rows: torch.Tensor, staged: DecodeState) -> None:
        """Rows `[n]` take over the n sequences of `staged`, just prefilled (continuous batching)."""
        for name in ("token", "positions", "step", "limit", "out", "finished", "seen", "seeds"):
            mine = getattr(self, name)
            if mine is not None:
                mine.index_copy_(0, rows, getattr(staged, name))


class Engine:
    """Generates for tokenised prompts with a fresh KV policy per batch (`generate`) or per queue (`serve`)."""

    def __init__(
        self,
        model: PreTrainedModel,
        policy_factory: Callable[[], KVPolicy],
        eos_ids: list[int],
        pad_id: int,
        config: EngineConfig | None = None,
        verify: VerifyConfig | None = None,
    ):
        self.model = model
        self.policy_factory = policy_factory
        self.config = config or EngineConfig()
        # VeriCache (`longflow.verify`): the policy drafts, a full cache beside it verifies.
        self.verify = verify if verify is not None and verify.enabled else None
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
        # The attention modules' softmax scale, which the policies' scores use too.
        self.scale = next((module.scaling for module in model.modules()
                           if hasattr(module, "scaling") and hasattr(module, "layer_idx")), None)
        self.warmed_sizes: set[int] = set()  # the batch sizes `warm_up` ran
        # Seconds spent capturing step graphs (`stepper`), summed over batches, queues and
        # verification's graphs: a one-time cost of each, outside every step time.
        self.capture_seconds = 0.0
        # The decode steps' and the prompts' forwards, compiled (`longflow.compile`); None: the
        # model's own, eagerly.
        self.decode_forward = None
        self.prefill_forward = None
        if self.device.type == "cuda":
            if self.config.compile:
                tuning = self.config.compile_tuning
                self.decode_forward = compiled_forward(model, tuning=self.config.batch_size == 1 if tuning is None
                                                       else tuning, gemv=self.config.compile_gemv)
            if self.config.compile_prefill:
                self.prefill_forward = compiled_forward(model, prompt=True)

    # ---- the steps ---------------------------------------------------------------------------

    def forward(self, cache: PolicyCache, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions `[B, Lq]` -> logits of the last position `[B, V]`.

        A policy that observes the forward (`KVPolicy.observes`) gets its logits, those of every
        prompt position at prefill when it asks for them, and every layer's hidden states when it
        asks for them; nothing is computed for the others.
        """
        policy = cache.policy
        observes = policy.observes
        every_position = policy.prefilling and "prompt_logits" in observes
        model = (self.prefill_forward if policy.prefilling else self.decode_forward) or self.model
        output = model(
            input_ids=input_ids,
            position_ids=positions,
            past_key_values=cache,
            kv_cache=cache,
            use_cache=True,
            logits_to_keep=1,
            output_hidden_states="hidden_states" in observes or every_position,
        )
        if observes:
            logits = PromptLogits(self.model, output.hidden_states[-1]) if every_position else output.logits
            policy.observe(logits, output.hidden_states if "hidden_states" in observes else None)
        return output.logits[:, -1]

    def prefill(self, cache, state, input_ids, pad, generation, full: PolicyCache | None = None) -> None:
        """Prompt forward `[B, L]`, then the first token into `state`. With a verifying full cache
        `full`, the prompt goes through it too, and its logits give the first token."""
        caches = (cache,) if full is None else (full, cache)
        logits = self.prompt_forward(caches, state, input_ids, pad)[0]
        self.emit(state, select_tokens(logits, generation, state.seeds, state.step, state.seen), generation)

    def prompt_forward(self, caches, state, input_ids, pad) -> list[torch.Tensor]:
        """The prompt `[B, L]` through each cache in `caches`, which then expect the first decode
        step at `state.positions`; returns each cache's last logits `[B, V]`."""
        positions = prompt_positions(pad)
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
        """Record `token` `[B]` as each running row's next output, in place. A finished row emits
        padding into the column past its output, and its step stays where it ended."""
        running = ~state.finished
        token = torch.where(running, token, self.pad_id)
        state.out.scatter_(1, state.step[:, None], token[:, None])
        if state.seen is not None:
            state.seen.scatter_(1, token[:, None], True)
        state.step += running
        if not generation.ignore_eos:
            state.finished |= torch.isin(token, self.eos_ids)
        state.finished |= state.step >= state.limit
        state.token.copy_(token)

    def decode_one_token(self, cache, state, generation) -> None:
        logits = self.forward(cache, state.token[:, None], state.positions[:, None])
        state.positions += 1
        self.emit(state, select_tokens(logits, generation, state.seeds, state.step, state.seen), generation)

    def decode_n_tokens(self, cache, state, generation, steps: int) -> tuple[list[float], bool]:
        """Runs up to `steps` decode steps; returns (seconds per step, whether a graph was used)."""
        return self.run_steps(lambda: self.decode_one_token(cache, state, generation), (cache.policy,), state, steps)

    def run_steps(self, run_step: Callable[[], None], policies, state, steps: int) -> tuple[list[float], bool]:
        """Runs `run_step` up to `steps` times, until every row of `state` has finished (see `Stepper`)."""
        stepper = self.stepper(run_step, policies)
        seconds = []
        while len(seconds) < steps:
            seconds += stepper.run(min(self.config.check_every, steps - len(seconds)))
            if bool(state.finished.all()):
                break
        return seconds, stepper.graph is not None

    def stepper(self, run_step: Callable[[], None], policies, graph: bool = True) -> Stepper:
        """A `Stepper` of `run_step` on this engine's device, captured when `engine.cuda_graph` and
        `graph` allow, its capture time added to `capture_seconds`."""
        return Stepper(run_step, policies, self.device, self.config.cuda_graph and graph, self.count_capture)

    def count_capture(self, seconds: float) -> None:
        self.capture_seconds += seconds

    # ---- a static batch ----------------------------------------------------------------------

    @torch.inference_mode()
    def warm_up(self, rows: int | None = None) -> None:
        """One tiny batch of `rows` rows (default `batch_size`), so that one-time costs (kernel loading,
        library handles, Triton and `torch.compile` compilation for that batch size, graph pools) stay
        out of the first timed batch of that size. Once per size: a second call for it does nothing.
        With the prompt forward compiled, one row's prefill too: its graph is the one that admissions
        of a single row run."""
        rows = rows or self.config.batch_size
        if rows in self.warmed_sizes:
            return
        self.warmed_sizes.add(rows)
        generation = GenerationConfig(max_new_tokens=4, ignore_eos=True)
        self.generate([[self.pad_id] * ALIGN] * rows, generation, list(range(rows)))
        if self.prefill_forward is not None and rows > 1:
            # Admissions of a single row run the compiled prompt forward's graph for one row.
            cache, state = self.stage([0], [generation.max_new_tokens], ALIGN, generation, track_seen=False)
            self.prefill(cache, state, *self.batch_inputs([[self.pad_id] * ALIGN]), generation)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], generation: GenerationConfig, seeds: list[int],
                 limits: list[int] | None = None) -> BatchResult:
        """One static batch. `limits`: the most tokens each row generates (default `max_new_tokens`)."""
        check_inputs(prompts, seeds, limits, generation)
        input_ids, pad = self.batch_inputs(prompts)
        batch = len(prompts)
        on_gpu = self.device.type == "cuda"
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(self.device)
        cache = self.new_cache(self.policy_factory, batch, pad.shape[1], generation)
        full = self.new_full_cache(batch, pad.shape[1], generation) if self.verify else None
        state = DecodeState(batch, generation.max_new_tokens, self.vocab, seeds, self.pad_id, self.device,
                            track_seen=generation.repetition_penalty != 1.0, limits=limits)

        synchronize(self.device)
        start = time.perf_counter()
        self.prefill(cache, state, input_ids, pad, generation, full)
        synchronize(self.device)
        prefill_seconds = time.perf_counter() - start
        verifier = None
        if full is None:
            step_seconds, used_graph = self.decode_n_tokens(cache, state, generation, generation.max_new_tokens - 1)
        else:
            verifier = self.verifier(cache, full, state, generation)
            step_seconds = []
            while not bool(state.finished.all()):
                step_seconds.append(verifier.run_round())
            used_graph = verifier.step.graph is not None

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
            verify=None if verifier is None else verifier.row_stats(),
            round_seconds=None if verifier is None else verifier.seconds,
        )

    # ---- verification ------------------------------------------------------------------------

    def new_full_cache(self, batch: int, prompt_len: int, generation: GenerationConfig) -> PolicyCache:
        """The full cache that verifies a batch's drafts (`longflow.verify.FullCache`)."""
        horizon, host = self.verify.horizon, self.verify.full_cache == "host"
        return self.new_cache(lambda: FullCache(horizon=horizon, host=host), batch, prompt_len, generation)

    def verifier(self, cache: PolicyCache, full: PolicyCache, state: DecodeState,
                 generation: GenerationConfig) -> Verifier:
        """The rounds of a batch whose caches are prefilled."""
        self.verify.check_generation(generation)
        return Verifier(self.model, cache, full, state, self.verify.horizon, self.forward,
                        self.stepper,
                        None if generation.ignore_eos else self.eos_ids)

    # ---- continuous batching -----------------------------------------------------------------

    @torch.inference_mode()
    def serve(self, prompts: list[list[int]], generation: GenerationConfig, seeds: list[int],
              limits: list[int] | None = None) -> Iterator[ServeRound]:
        """Continuous batching over the queue `prompts` (taken in their order), `batch_size` rows at
        a time; yields a `ServeRound` at every check that finished sequences, until all are done.

        The rows' cache is allocated once, for the longest prompt of the queue. Free rows are refilled
        once `refill_rows` of them are free (or as many as the queue still holds); each admission
        prefills at most `prefill_rows` prompts together through a policy of their own and copies
        them into the free rows. A row left without work when the queue is empty is released and
        decodes padding, unread, until the last sequence ends.

        With `engine.overlap_admissions` (not with verification), an admission made while some row
        decodes is prefilled beside the next round instead of before it (on a GPU on a stream of its
        own, while the round's graph replays run) and copied into its rows at the round's check:
        the decoding rows do not wait for it, and the admitted ones start a round later. The tokens
        are the same either way.
        """
        check_inputs(prompts, seeds, limits, generation)
        limits = limits or [generation.max_new_tokens] * len(prompts)
        rows = min(self.config.batch_size, len(prompts))
        length = round_up(max(len(p) for p in prompts), ALIGN)
        on_gpu = self.device.type == "cuda"
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(self.device)
        cache = self.new_cache(self.policy_factory, rows, length, generation)
        full = self.new_full_cache(rows, length, generation) if self.verify else None
        state = DecodeState(rows, generation.max_new_tokens, self.vocab, [0] * rows, self.pad_id, self.device,
                            track_seen=generation.repetition_penalty != 1.0, finished=True)
        cache.policy.begin_serving(state.positions)
        verifier = None
        if full is None:
            stepper = self.stepper(lambda: self.decode_one_token(cache, state, generation), (cache.policy,))
        else:
            full.policy.begin_serving(state.positions)
            verifier = self.verifier(cache, full, state, generation)
        queue = deque(range(len(prompts)))
        holder: list[int | None] = [None] * rows  # the prompt index each row decodes
        started = [0.0] * rows
        released: set[int] = set()
        overlap = self.config.overlap_admissions and verifier is None
        side = torch.cuda.Stream(self.device) if overlap and on_gpu else None
        adopted: list[Staged] = []  # the last round's admissions, alive until the device has copied them
        while True:
            free = [row for row in range(rows) if holder[row] is None]
            ready = len(free) >= min(self.config.refill_rows, rows, len(queue))
            admitted, prefill_seconds = free[:len(queue)] if ready else [], 0.0
            chunks = [admitted[first:first + self.config.prefill_rows]
                      for first in range(0, len(admitted), self.config.prefill_rows)]
            # Beside the round only while some row decodes: with none (the first admission, or every
            # row found finished at one check) nothing would hide the prefill.
            beside = overlap and bool(admitted) and any(index is not None for index in holder)
            if not beside:
                for chunk in chunks:
                    indices = [queue.popleft() for _ in chunk]
                    start = time.perf_counter()
                    self.admit(cache, state, chunk, [prompts[i] for i in indices], [seeds[i] for i in indices],
                               [limits[i] for i in indices], length, generation, full, verifier)
                    synchronize(self.device)
                    prefill_seconds += time.perf_counter() - start
                    for row, index in zip(chunk, indices, strict=True):
                        holder[row], started[row] = index, start
            if all(index is None for index in holder):
                return
            launched = time.perf_counter()
            if verifier is None:
                timer = stepper.launch(self.config.check_every)
                staged = []
                if beside:
                    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                        for chunk in chunks:
                            indices, start = [queue.popleft() for _ in chunk], time.perf_counter()
                            staged_cache, staged_state, _ = self.prefill_apart(
                                [prompts[i] for i in indices], [seeds[i] for i in indices],
                                [limits[i] for i in indices], length, generation, state.seen is not None)
                            staged.append(Staged(chunk, indices, staged_cache, staged_state, start))
                step_seconds = timer.seconds()  # waits for the device, the prefills beside included
            else:  # rounds of h + 1 tokens at most, about `check_every` tokens between looks
                step_seconds = [verifier.run_round()
                                for _ in range(max(1, self.config.check_every // (self.verify.horizon + 1)))]
            adopted.clear()  # the device has run the copies of the round before
            round_end = time.perf_counter()
            finished = state.finished.tolist()
            done = [row for row in range(rows) if holder[row] is not None and finished[row]]
            served = self.harvest(cache, state, done, [holder[row] for row in done], [started[row] for row in done],
                                  prompts, generation, verifier)
            for row in done:
                holder[row] = None
            if beside:
                start = time.perf_counter()
                if side is not None:
                    torch.cuda.current_stream(self.device).wait_stream(side)
                for admission in staged:
                    self.adopt(cache, state, admission.rows, admission.cache, admission.state)
                    for row, index in zip(admission.rows, admission.indices, strict=True):
                        holder[row], started[row] = index, admission.started
                adopted.extend(staged)
                # What the admissions added to the round's time: the prefills' host work and device
                # work that the steps did not hide, and the copies into the rows.
                prefill_seconds = max(0.0, round_end - launched - sum(step_seconds)) + time.perf_counter() - start
            idle = [row for row in range(rows) if holder[row] is None and row not in released] if not queue else []
            if idle:  # free rows the queue can no longer fill (some may have waited for `refill_rows`)
                cache.policy.release(idle)
                if full is not None:
                    full.policy.release(idle)
                released.update(idle)
            yield ServeRound(
                finished=served, prefill_seconds=prefill_seconds, step_seconds=step_seconds,
                peak_memory_bytes=torch.cuda.max_memory_allocated(self.device) if on_gpu else None,
                cuda_graph=(stepper if verifier is None else verifier.step).graph is not None, rows=rows,
                admitted=len(admitted),
            )

    def prefill_apart(self, prompts: list[list[int]], seeds: list[int], limits: list[int], length: int,
                      generation: GenerationConfig, track_seen: bool, verifying: bool = False,
                      ) -> tuple[PolicyCache, DecodeState, PolicyCache | None]:
        """`prompts` prefilled through a policy of their own, allocated like the rows' (prompt length
        `length`), and when `verifying` through a full cache of their own too, for rows to adopt."""
        input_ids, pad = self.batch_inputs(prompts)
        staged, staged_state = self.stage(seeds, limits, length, generation, track_seen)
        staged_full = self.new_full_cache(len(prompts), length, generation) if verifying else None
        self.prefill(staged, staged_state, input_ids, pad, generation, staged_full)
        return staged, staged_state, staged_full

    def admit(self, cache: PolicyCache, state: DecodeState, rows: list[int], prompts: list[list[int]],
              seeds: list[int], limits: list[int], length: int, generation: GenerationConfig,
              full: PolicyCache | None = None, verifier: Verifier | None = None) -> None:
        """Prefills `prompts` through a policy of their own, allocated like the rows' (prompt length
        `length`), and hands them to `rows` of `cache` and `state`; with verification, through a full
        cache of their own too, handed to `rows` of `full`, and the rows' statistics restart."""
        staged, staged_state, staged_full = self.prefill_apart(prompts, seeds, limits, length, generation,
                                                               state.seen is not None, verifying=full is not None)
        self.adopt(cache, state, rows, staged, staged_state)
        if full is not None:
            index = torch.tensor(rows, dtype=torch.long, device=self.device)
            full.policy.admit(index, staged_full.policy)
            verifier.reset_rows(index)

    def stage(self, seeds: list[int], limits: list[int], length: int, generation: GenerationConfig,
              track_seen: bool) -> tuple[PolicyCache, DecodeState]:
        """A fresh policy and decode state for `len(seeds)` prompts padded to `length`, to prefill
        before `adopt` hands them to rows."""
        staged = self.new_cache(self.policy_factory, len(seeds), length, generation)
        return staged, DecodeState(len(seeds), generation.max_new_tokens, self.vocab, seeds, self.pad_id,
                                   self.device, track_seen=track_seen, limits=limits)

    def adopt(self, cache: PolicyCache, state: DecodeState, rows: list[int], staged: PolicyCache,
              staged_state: DecodeState) -> None:
        """Rows `rows` of `cache` and `state` take over the sequences `staged` has just prefilled."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        cache.policy.admit(index, staged.policy)
        state.admit(index, staged_state)

    def harvest(self, cache: PolicyCache, state: DecodeState, rows: list[int], indices: list[int],
                started: list[float], prompts: list[list[int]], generation: GenerationConfig,
                verifier: Verifier | None = None) -> list[Served]:
        """The finished `rows`' outputs (syncs the host)."""
        if not rows:
            return []
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        tokens, reasons = self.outputs(state, generation, index)
        peaks = cache.policy.peak_slots()
        stats = [None] * len(rows) if verifier is None else verifier.row_stats(rows)
        now = time.perf_counter()
        return [Served(index=indices[j], tokens=tokens[j], finish_reason=reasons[j],
                       prompt_tokens=len(prompts[indices[j]]), seconds=now - started[j], peak_slots=peaks[row],
                       verify=stats[j])
                for j, row in enumerate(rows)]

    # ---- shared ------------------------------------------------------------------------------

    def batch_inputs(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded input ids `[B, L]` and their mask `[B, L]` bool (True = real token), on the device.

        L is padded to a multiple of ALIGN: a prompt length like 635 makes the rows of SDPA's mask
        and of the decode matmuls' operands misaligned for 16-byte loads, and the GPU falls back to
        kernels 2-3x slower (seen on an H200). The extra left padding is masked out like the rest.
        """
        batch, length = len(prompts), round_up(max(len(p) for p in prompts), ALIGN)
        input_ids = torch.full((batch, length), self.pad_id, dtype=torch.long)
        pad = torch.zeros(batch, length, dtype=torch.bool)
        for row, prompt in enumerate(prompts):
            input_ids[row, length - len(prompt):] = torch.tensor(prompt)
            pad[row, length - len(prompt):] = True
        return input_ids.to(self.device), pad.to(self.device)

    def new_cache(self, policy_factory: Callable[[], KVPolicy], batch: int, prompt_len: int,
                  generation: GenerationConfig) -> PolicyCache:
        """A fresh policy from `policy_factory`, allocated for `batch` rows of prompts padded to `prompt_len`."""
        policy = policy_factory()
        policy.allocate(CacheSpec(
            batch=batch, layers=self.num_layers, q_heads=self.q_heads, kv_heads=self.kv_heads,
            head_dim=self.head_dim, prompt_len=prompt_len, max_new_tokens=generation.max_new_tokens,
            dtype=self.dtype, device=self.device, rotary=self.rotary, vocab=self.vocab, scale=self.scale,
        ))
        return PolicyCache(policy, self.num_layers)

    def outputs(self, state: DecodeState, generation: GenerationConfig,
                rows: torch.Tensor | None = None) -> tuple[list[list[int]], list[str]]:
        """Each row's generated ids, up to and with its EOS, and its finish reason, for every row or
        `rows` `[n]` (syncs the host)."""
        out, steps = state.out, state.step
        if rows is not None:
            out, steps = out.index_select(0, rows), steps.index_select(0, rows)
        out, steps = out.tolist(), steps.tolist()
        eos = set(self.eos_ids.tolist())
        tokens, reasons = [], []
        for ids, count in zip(out, steps, strict=True):
            ids = ids[:count]
            ended = not generation.ignore_eos and bool(ids) and ids[-1] in eos
            tokens.append(ids)
            reasons.append("eos" if ended else "length")
        return tokens, reasons


class PromptLogits:
    """The logits of every prompt position `[B, L, V]`, computed from the final hidden states
    `[B, L, hidden]` for the positions an index asks for. A prompt's logits materialised at once
    are B x L x V (64 x 512 x 151,936 in bf16: 10 GiB for Qwen3-8B); a policy that reads them in
    chunks of positions (InfoKV's entropies) holds one chunk's. `[...]` indexes like the tensor;
    `clone()` materialises the whole."""

    def __init__(self, model: PreTrainedModel, hidden: torch.Tensor):
        self.head = model.get_output_embeddings()
        # The logit soft-capping some architectures apply after the head (none of Llama, Qwen2, Qwen3).
        self.softcap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
        self.hidden = hidden
        self.shape = torch.Size((*hidden.shape[:2], self.head.out_features))

    def __getitem__(self, index) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        logits = self.head(self.hidden[index[:2]])
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits[(..., *index[2:])] if len(index) > 2 else logits

    def clone(self) -> torch.Tensor:
        return self[:, :]


def prompt_positions(pad: torch.Tensor) -> torch.Tensor:
    """The position of every token of a left-padded prompt, `[B, L]` bool -> `[B, L]` int64 (0 on padding)."""
    return (pad.long().cumsum(dim=-1) - 1).clamp(min=0)


def check_inputs(prompts: list[list[int]], seeds: list[int], limits: list[int] | None,
                 generation: GenerationConfig) -> None:
    if not prompts or len(prompts) != len(seeds):
        raise ValueError("the engine needs one seed per prompt and at least one prompt")
    if min(len(p) for p in prompts) == 0:
        raise ValueError("empty prompt")
    if limits is not None and (len(limits) != len(prompts)
                               or not all(1 <= limit <= generation.max_new_tokens for limit in limits)):
        raise ValueError(f"limits must give each prompt a count in [1, {generation.max_new_tokens}]")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stepper:
    """Runs a decode step, with each policy's host hooks around every step, as CUDA-graph replays.

    On a GPU the step is captured once, at the first step after the first (eager) one that no
    policy asks to run eagerly, and replayed from then on; the steps a policy asks for
    (`before_step`) always run eagerly. Step indices count from the Stepper's creation.
    """

    def __init__(self, run_step: Callable[[], None], policies, device: torch.device, cuda_graph: bool,
                 on_capture: Callable[[float], None] | None = None):
        self.run_step, self.policies = run_step, policies
        self.device = device
        self.graph: torch.cuda.CUDAGraph | None = None
        self.tried = not (device.type == "cuda" and cuda_graph)
        self.count = 0
        self.on_capture = on_capture  # told the capture's seconds (host clock, device drained)

    def run(self, steps: int) -> list[float]:
        """Runs `steps` steps; returns the seconds of each."""
        return self.launch(steps).seconds()

    def launch(self, steps: int) -> StepTimer:
        """Enqueues `steps` steps (on a GPU the host returns once they are queued, unless a hook
        syncs); their timer's `seconds` waits for them."""
        timer = StepTimer(self.device)
        for _ in range(steps):
            step = self.count
            eager = any([policy.before_step(step) for policy in self.policies])  # every policy's hook runs
            if not self.tried and step >= 1 and not eager:
                start = time.perf_counter()
                self.graph, self.tried = capture(self.run_step), True
                if self.on_capture is not None:
                    synchronize(self.device)
                    self.on_capture(time.perf_counter() - start)
            # A step's time includes its hooks' work: the interval methods' compressions are part
            # of what a method costs per token (the capture itself, a one-time cost, is not).
            timer.start()
            if self.graph is not None and not eager:
                self.graph.replay()
            else:
                self.run_step()
            for policy in self.policies:
                policy.after_step(step)
            timer.stop()
            self.count += 1
        return timer


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
