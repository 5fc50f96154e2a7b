"""Vanilla: the full KV cache, no eviction. The reference for accuracy and speed.

Slots are allocated for the whole padded prompt plus `max_new_tokens`, and token t of the output
goes to slot `L + t`, so the cache holds tokens in position order like HF's `DynamicCache`.
`budget` is accepted for a uniform interface and ignored; `variant` too (the full cache has none).

Decode attention reads only the slots filled so far (prompt + tokens written), not the whole
allocation: on CUDA through the flash-decoding kernel `longflow.kernels.flash_decode`, whose grid
is static and which reads each row's filled length on the device, so the step stays one CUDA
graph. `use_kernel`, a switch for tests and benchmarks (runs keep `auto`): `auto` (that kernel on CUDA,
the eager two-matmul attention of `longflow.attention` on the CPU, exact over all slots since free
ones are masked), `triton` (the kernel everywhere, through Triton's interpreter on the CPU: tests)
or `eager`.

`one_launch` (off by default: tested on a GPU, and no faster in the batch-1 step on an H100,
docs/engine.md): with the kernel, a layer's step is one launch, `longflow.kernels.append_decode`
(the token's write, the attention and the combine of its splits), where the base class's write,
`flash_decode` and its combine are three.
At batch 1 the step is about 450 short kernels, and launches are part of its time. `store` then
hands the token's k and v to `attend` instead of writing them, which transformers' attention
modules allow: what `Cache.update` returns is what they pass to the attention function. Both
switches choose how, not what, the method computes (`execution_fields`): runs resume across them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longflow.attention import decode_attention
from longflow.kernels import append_decode, flash_decode
from longflow.policy import ALIGN, DECODE_KERNELS, CacheSpec, KVPolicy, one_of, round_up, triton_decode


@dataclass(eq=False)
class VanillaPolicy(KVPolicy):
    variant: str = "paper"
    use_kernel: str = "auto"
    one_launch: bool = False

    name = "vanilla"
    uses_budget = False
    # One variant only: a run's identity records `paper` whatever `variant` says, so the paper and
    # lf_repo sweeps share the full cache's runs.
    has_variants = False
    fills_in_order = True  # the slot write moves next_slot on (see `decode`)
    execution_fields = KVPolicy.execution_fields | {"one_launch"}

    def __post_init__(self):
        self.budget = None  # built directly (tests) with a budget: still the full cache
        super().__post_init__()
        one_of(self.name, "use_kernel", self.use_kernel, DECODE_KERNELS)

    def capacity(self, spec: CacheSpec) -> int:
        # Rounded up so that the eager decode matmuls' rows stay 16-byte aligned (see `ALIGN`).
        return round_up(spec.prompt_len + spec.max_new_tokens, ALIGN)

    def prefill_keep(self, spec: CacheSpec) -> int:
        return spec.prompt_len

    def compresses_within(self, prompt_tokens: int, total_tokens: int, spec: CacheSpec) -> bool:
        return False  # the full cache itself

    def allocate(self, spec: CacheSpec) -> None:
        super().allocate(spec)
        # `append_decode`'s counters per (row, KV head), which each launch leaves at 0 again.
        self.arrivals = torch.zeros(spec.batch * spec.kv_heads, dtype=torch.int32, device=spec.device)

    def on_prompt_stored(self, layer: int, kept: torch.Tensor, scores: torch.Tensor | None) -> None:
        self.next_slot[layer].fill_(kept.shape[-1])

    def appends(self, k: torch.Tensor) -> bool:
        """Whether a decode step's write goes into `append_decode` (the token's k, v `[B, Hkv, 1, D]`)."""
        return (self.one_launch and triton_decode(self.use_kernel, k) and k.shape[2] == 1 and not self.slots.states
                and self.history is None)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.prefilling or not self.appends(k):
            return super().store(layer, k, v)
        return k, v  # written by `attend`, in the attention's launch

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        if self.prefilling or not self.appends(k):
            return super().attend(layer, q, k, v, scale)
        slots = self.layers[layer]
        out = append_decode(q[:, :, 0], k, v, slots.keys, slots.values, slots.valid, slots.positions,
                            self.next_slot[layer], self.positions, self.arrivals, scale)
        return out.unsqueeze(1)

    def decode(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        slots = self.layers[layer]
        # The step's token went to the slot after the last filled one, and the write moved next_slot
        # on (`fills_in_order`), so it is now the count of filled slots. A sequence never fills the
        # last slot (its last token is never stored); a row that decodes padding past its end
        # (continuous batching) keeps overwriting that slot instead, next_slot being clamped to it.
        next_slot = self.next_slot[layer]  # [B, Hkv], every head equal
        if triton_decode(self.use_kernel, q):
            return flash_decode(q, slots.keys, slots.values, slots.valid[:, 0], next_slot[:, 0], scale)
        out, _ = decode_attention(q, slots.keys, slots.values, slots.valid, scale)
        return out
