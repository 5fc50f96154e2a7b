"""Runtime configs of the library, as dataclasses checked on construction.

The Hydra entry point converts its DictConfig into these (`from_mapping`); library code never sees a
DictConfig. Hydra knows no types for these fields (the YAML groups are plain), so a value given as
`generation.max_new_tokens=abc` arrives as a string: every field is type-checked here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from longflow.errors import UserError

Config = TypeVar("Config")

# The annotation of each checked field -> the Python types its value may have (bool is no int here).
_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,), "int | None": (int, type(None)),
          "bool | None": (bool, type(None))}


def from_mapping(cls: type[Config], values: Mapping[str, Any], prefix: str) -> Config:
    """`cls(**values)`, with an unknown key reported as the config key `prefix.key` (one line)."""
    allowed = [field.name for field in fields(cls)]
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        raise UserError(f"unknown key {prefix}.{unknown[0]}; {prefix} takes: {', '.join(allowed)}")
    return cls(**values)


def check_types(config: Any, prefix: str) -> None:
    """Every field of a checked dataclass holds a value of its annotated type."""
    for field in fields(config):
        value, kinds = getattr(config, field.name), _TYPES.get(str(field.type))
        if kinds is None:
            continue
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            wanted = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
                      "int | None": "an integer or null", "bool | None": "true, false or null"}[str(field.type)]
            raise UserError(f"{prefix}.{field.name} must be {wanted}, got {value!r}")

TRUNCATION_SIDES = ("left", "right")


@dataclass(frozen=True)
class GenerationConfig:
    """How tokens are chosen and when a sequence stops.

    `temperature == 0` means greedy decoding. `seed` drives sampling; every row of a batch draws from
    its own stream (see `longflow.sampling`), so a sample does not depend on its batch-mates.
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    n_samples: int = 1
    seed: int = 0
    ignore_eos: bool = False
    max_prompt_tokens: int | None = None
    truncation_side: str = "left"  # which end of an over-long prompt is cut (the tokenizer's terms)

    def __post_init__(self):
        check_types(self, "generation")
        if self.max_new_tokens <= 0:
            raise UserError(f"generation.max_new_tokens must be positive, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise UserError(f"generation.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"generation.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UserError(f"generation.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise UserError(f"generation.repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.n_samples <= 0:
            raise UserError(f"generation.n_samples must be positive, got {self.n_samples}")
        if self.temperature == 0 and self.n_samples > 1:
            raise UserError("generation.n_samples > 1 needs sampling (temperature > 0): greedy samples are identical")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens <= 0:
            raise UserError(f"generation.max_prompt_tokens must be positive or null, got {self.max_prompt_tokens}")
        if self.truncation_side not in TRUNCATION_SIDES:
            raise UserError(
                f"generation.truncation_side must be one of {TRUNCATION_SIDES}, got {self.truncation_side!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs: batching, CUDA-graph capture and compilation of the decode step, host checks.

    None of them changes the tokens produced, so none is part of a run's identity.
    `continuous`: continuous batching (`Engine.serve`: a finished row takes the next prompt at once)
    rather than static batches (`Engine.generate`: a batch runs until its longest row ends).
    `compile`: the decode step's model forward through `torch.compile` (`longflow.compile`), on a
    GPU only: on the CPU, where the tests run, compiling costs more than it saves, and the option
    is ignored like `cuda_graph`.
    `compile_tuning`: Inductor's coordinate-descent tuning of its generated kernels (gpt-fast's
    setting). At a batch of one it also turns the matrix-vector products into Triton reductions
    fused with the ops around them, instead of cuBLAS calls; at larger batches the matmuls stay
    cuBLAS's. With it, Inductor's combo kernels (independent kernels launched as one;
    `longflow.compile.TUNING_OPTIONS`). Compiling takes about 30 s longer. None (default): on when
    `batch_size` is 1.
    `compile_gemv`: in the compiled decode step, the products of one row (a batch of one) through the
    project's GEMV kernel instead of Inductor's reductions, with the RMSNorm, SwiGLU and residual add
    around them, q/k/v and gate/up each one launch, under programmatic dependent launch on sm_90
    (`longflow.one_row_products`). Off by default: docs/engine.md has its measurements.
    `compile_prefill`: the prompt forwards (a static batch's prefill, continuous batching's
    admissions) through `torch.compile` too, on a GPU only, one graph for every prompt length and
    number of rows above one (`longflow.compile`). It removes the eager forward's per-op launches
    and unfused elementwise kernels: an admission 22-40% shorter on an H200 at Qwen3-8B's shapes,
    against about 75 s of compiling at the run's start, which a run pays back only after hours of
    admissions; hence off by default (docs/engine.md).
    `overlap_admissions`: under continuous batching, an admission made while some row decodes is
    prefilled beside the next round of steps (on a stream of its own on a GPU) and adopted at its
    check, instead of stalling every row for its prefill; the admitted rows start a round later.
    Not with verification. Off by default: with compute-bound prefills (512-token prompts on an 8B
    model) the steps beside them slowed by what the stall saved (docs/engine.md).
    """

    batch_size: int = 64  # rows decoding together
    cuda_graph: bool = True
    compile: bool = True
    compile_tuning: bool | None = None
    compile_gemv: bool = False
    compile_prefill: bool = False
    overlap_admissions: bool = False
    check_every: int = 16  # decode steps between host checks for finished rows
    continuous: bool = True
    prefill_rows: int = 16  # most prompts prefilled together when finished rows are refilled
    # Fewest free rows refilled together (fewer when the queue holds fewer): a prefill of one or two
    # prompts costs about as much as one of several (launch-bound), so refilling every row the moment
    # it finishes pays a whole prefill per item.
    refill_rows: int = 4

    def __post_init__(self):
        check_types(self, "engine")
        for name in ("batch_size", "check_every", "prefill_rows", "refill_rows"):
            if getattr(self, name) <= 0:
                raise UserError(f"engine.{name} must be positive, got {getattr(self, name)}")


VERIFY_MODES = ("none", "vericache")
FULL_CACHE_PLACEMENTS = ("gpu", "host")


@dataclass(frozen=True)
class VerifyConfig:
    """Lossless decoding over a compressed cache (VeriCache, `longflow.verify`): the run's method drafts
    `horizon` greedy tokens with its compressed cache, one forward over the full cache kept beside it
    verifies them, and the longest agreeing prefix is committed with the full cache's next token.

    `name`: `none` (ordinary decoding) or `vericache`. `horizon`: drafted tokens per round (25, the
    paper's setting for a compressor that keeps a fifth of the cache). `full_cache`: where the full
    cache lives, `gpu` (beside the compressed one) or `host` (pinned host memory, each layer copied
    to the device for the verify forward, the copies timed); on a CPU run both are the same memory.
    The tokens do not depend on `horizon` or `full_cache` (greedy is lossless by construction); the
    acceptance figures depend on `horizon`.
    """

    name: str = "none"
    horizon: int = 25
    full_cache: str = "gpu"

    def __post_init__(self):
        check_types(self, "verify")
        if self.name not in VERIFY_MODES:
            raise UserError(f"verify.name must be one of {VERIFY_MODES}, got {self.name!r}")
        if self.horizon <= 0:
            raise UserError(f"verify.horizon must be positive, got {self.horizon}")
        if self.full_cache not in FULL_CACHE_PLACEMENTS:
            raise UserError(f"verify.full_cache must be one of {FULL_CACHE_PLACEMENTS}, got {self.full_cache!r}")

    @property
    def enabled(self) -> bool:
        return self.name != "none"

    def check_generation(self, generation: GenerationConfig) -> None:
        """The decoding settings verification supports: greedy, without a repetition penalty."""
        if not self.enabled:
            return
        if not generation.greedy:
            raise UserError("verify=vericache verifies greedy tokens only: generation=sampling (temperature "
                            f"{generation.temperature}) would need the rejection-sampling rule, not implemented")
        if generation.repetition_penalty != 1.0:
            raise UserError("verify=vericache does not support generation.repetition_penalty != 1.0")
