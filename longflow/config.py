"""Runtime configs of the library, as dataclasses checked on construction.

The Hydra entry point converts its DictConfig into these; library code never sees a DictConfig.
"""

from __future__ import annotations

from dataclasses import dataclass

from longflow.errors import UserError

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
    """How the engine runs: batch size and CUDA-graph capture of the decode step.

    Neither changes the tokens produced, so neither is part of a run's identity.
    """

    batch_size: int = 64
    cuda_graph: bool = True
    check_every: int = 16  # decode steps between host checks for "every row finished"

    def __post_init__(self):
        if self.batch_size <= 0:
            raise UserError(f"engine.batch_size must be positive, got {self.batch_size}")
        if self.check_every <= 0:
            raise UserError(f"engine.check_every must be positive, got {self.check_every}")
