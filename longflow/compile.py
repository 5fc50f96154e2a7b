"""The model's forward through `torch.compile`, the KV policy one opaque op per layer: the decode
step's, and optionally the prompt's (prefill).

Inside the engine's CUDA graph the eager forward still launches every elementwise op as its own
kernel: RMSNorm's casts, square, mean, rsqrt and products, the rotary embedding's halves and
concatenation, SwiGLU, the residual adds; a few microseconds each, a few dozen per layer. Inductor
fuses them around the matmuls. What is compiled is a call of the transformers model itself, so its
classes and extension points (`Cache`, `AttentionInterface`) stay as they are.

The policy's part of a layer (the slot write of `PolicyCache.update`, the attention of `kv_policy`,
the choice of the next slot; at prefill the prompt's attention and the choice of the prompt tokens
kept) is Python over the policy's own buffers, which Dynamo must not trace: every buffer would
become a graph input mutated in place, and the policy, new for each batch, would fail the guards at
every batch. The compiled forward therefore gets a stand-in cache (`OpaqueCache`) whose `update`
stores nothing and whose policy's `attend` is a custom op of that `CompiledForward`
(`longflow::policy_attention_<n>`, one per instance). The op runs the policy of the call in progress
(`CompiledForward.active`, set around each call) `store` then `attend`, eagerly: the order of the
eager forward, where nothing reads the cache between the two (at prefill `store` keeps nothing and
hands the prompt's keys and values on, as `OpaqueCache.update` does). It declares no mutation, which
is sound because the buffers it writes are read by no other op of the graph and the ops of
successive layers are ordered by their data. The forward is then one graph with no break and its
layers unrolled, the layer index a constant of each op call, so nothing recompiles per layer.

Decode (`compiled_forward(model, tuning)`): one token per row. The batch size is specialised at the first
compilation and made dynamic at the first other one (Dynamo's automatic dynamic shapes; a batch of 1
keeps its own graph). Compilation happens at the first decode step of a batch, which the engine runs
eagerly before capturing its graph; Inductor's default mode, since the engine owns the CUDA graph.
With `tuning` (the engine's default at a batch of one), Inductor's coordinate-descent tuning: at
M = 1 Inductor then lowers each matmul to a Triton reduction of its own, fused with the norm before
it or the activation and residual after it (gpt-fast's setting); at larger batches the matmuls stay
cuBLAS's and tuning measured nothing (docs/engine.md). Tuning also turns on Inductor's combo
kernels, which launch independent kernels of a layer (its projections' reductions) as one: at a
batch of one the step is a few hundred kernels of a few microseconds each, whose ramps and tails
the combined launches share (4-7% of the step on the H200; at batch 128, nothing).

Prefill (`compiled_forward(model, prompt=True)`, `engine.compile_prefill`): the prompt forward of a batch or of an
admission. Its rows and prompt length are dynamic from the first call (`maybe_mark_dynamic`), so
that one graph serves every admission of two rows or more whatever the prompts' padded length, and a
single row gets one more (Dynamo specialises sizes of 1). It cannot be a CUDA graph: the policies'
prompt rules read the prompts' lengths on the host and choose the kept tokens with data-dependent
shapes, inside the op. What compiling targets is the eager forward's per-op Python and its unfused
elementwise kernels around the matmuls, which the profile put at about half an admission's device
time and most of its host time at small admissions (docs/engine.md, "Where an admission's time
goes"); what it saves on a GPU is not yet measured.
"""

from __future__ import annotations

import itertools
import logging
import time
import types
import warnings
from collections.abc import Callable

import torch
from torch._dynamo.utils import counters
from transformers import Cache, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from longflow.one_row_products import OneRowProducts
from longflow.policy import KVPolicy

logger = logging.getLogger(__name__)

# Inductor's options with `tuning` (see the module's docstring and docs/engine.md for their figures).
TUNING_OPTIONS = {"coordinate_descent_tuning": True, "combo_kernels": True}

_instances = itertools.count()  # a fresh op name per `CompiledForward`


def policy_attention_op(name: str, running: Callable[[], KVPolicy]):
    """The custom op `longflow::<name>`: `running()`'s policy's part of one layer (its `store`, then
    its `attend`), query `[B, Hq, Lq, D]`, key and value `[B, Hkv, Lq, D]` after RoPE -> attention
    output `[B, Lq, Hq, D]`; Lq is 1 at decode, the prompt length at prefill."""

    @torch.library.custom_op(f"longflow::{name}", mutates_args=())
    def policy_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int,
                         scale: float) -> torch.Tensor:
        policy = running()
        policy.store(layer, key, value)
        return policy.attend(layer, query, key, value, scale).contiguous()

    @policy_attention.register_fake
    def _(query, key, value, layer, scale):
        batch, heads, length, head_dim = query.shape
        return query.new_empty(batch, length, heads, head_dim)

    return policy_attention


class _OpaquePolicy:
    """What `kv_policy_attention` calls as `kv_cache.policy.attend` inside the compiled forward."""

    def __init__(self, op):
        self.op = op

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scale: float) -> torch.Tensor:
        return self.op(query, key, value, layer, scale)


class OpaqueCache(Cache):
    """Stands in for `PolicyCache` in the compiled forward: `update` hands the new token's key and
    value on to the attention call, whose op stores them. One per compiled model, so that Dynamo's
    guards on it hold for every batch."""

    def __init__(self, num_layers: int, op):
        super().__init__(layers=[])
        self.num_layers = num_layers
        self.policy = _OpaquePolicy(op)

    def __len__(self) -> int:
        return self.num_layers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


class CompiledForward:
    """The model's forward, compiled; called with the model's own keyword arguments.

    `tuning`: Inductor's coordinate-descent tuning and combo kernels (`TUNING_OPTIONS`,
    `EngineConfig.compile_tuning`). `gemv`: one-row products through `longflow.kernels.gemv`
    (`longflow.one_row_products`, `EngineConfig.compile_gemv`; `self.gemv` is the pass, which counts
    what it replaced). `prompt`: for
    prompt forwards, whose rows and length are marked dynamic at every call (see the module's
    docstring). `active`: the policy of the call in progress, which its op runs (None between calls).
    `compile_seconds`: wall time of the calls that compiled (tracing, Inductor, the first run's
    autotuning), summed; each compilation is also logged. After a compilation failure (a model
    Dynamo cannot trace whole) it warns once and calls the model eagerly from then on.
    """

    def __init__(self, model: PreTrainedModel, backend: str = "inductor", tuning: bool = False,
                 prompt: bool = False, gemv: bool = False):
        self.model = model
        self.active: KVPolicy | None = None
        self.cache = OpaqueCache(model.config.get_text_config().num_hidden_layers,
                                 policy_attention_op(f"policy_attention_{next(_instances)}", self.running))
        self.tuning = tuning
        self.prompt = prompt
        self.gemv = OneRowProducts() if gemv else None
        options = {**(TUNING_OPTIONS if tuning else {}),
                   **({"post_grad_custom_pre_pass": self.gemv} if gemv else {})} or None
        # Dynamo keeps compiled graphs, and counts recompilations against `recompile_limit` (8), per
        # code object. Every instance shared `_forward`'s: the graphs of every model, batch size and
        # tuning in the process added up, and past the limit a fullgraph compile raises
        # FailOnRecompileLimitHit (three tiny models with and without tuning reached it). A copy of
        # the code per instance gives each its own count.
        forward = types.FunctionType(CompiledForward._forward.__code__.replace(), globals(), "_forward")
        self.compiled = torch.compile(types.MethodType(forward, self), backend=backend, fullgraph=True,
                                      options=options)
        self.compile_seconds = 0.0
        self.failed = False

    @property
    def phase(self) -> str:
        return "prefill" if self.prompt else "decode"

    def running(self) -> KVPolicy:
        return self.active

    def _forward(self, **kwargs) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        output = self.model(past_key_values=self.cache, kv_cache=self.cache, **kwargs)
        return output.logits, output.hidden_states

    def __call__(self, *, past_key_values, kv_cache, **kwargs) -> CausalLMOutputWithPast:
        if self.failed:
            return self.model(past_key_values=past_key_values, kv_cache=kv_cache, **kwargs)
        if self.prompt:
            for name in ("input_ids", "position_ids"):
                torch._dynamo.maybe_mark_dynamic(kwargs[name], 0)
                torch._dynamo.maybe_mark_dynamic(kwargs[name], 1)
        graphs = counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        self.active = kv_cache.policy
        try:
            logits, hidden_states = self.compiled(**kwargs)
        except (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit) as error:
            # Raised while compiling, before any op ran.
            warnings.warn(f"torch.compile of the {self.phase} forward failed, running it eagerly: {error}",
                          stacklevel=2)
            self.failed = True
            return self.model(past_key_values=past_key_values, kv_cache=kv_cache, **kwargs)
        finally:
            self.active = None
        if counters["stats"]["unique_graphs"] != graphs:
            seconds = time.perf_counter() - start
            self.compile_seconds += seconds
            rows, length = kwargs["input_ids"].shape
            logger.info("compiled the %s forward for %d rows of %d tokens in %.1f s", self.phase, rows, length,
                        seconds)
        return CausalLMOutputWithPast(logits=logits, hidden_states=hidden_states)


def compiled_forward(model: PreTrainedModel, tuning: bool = False, prompt: bool = False,
                     gemv: bool = False) -> CompiledForward:
    """The model's `CompiledForward` for `tuning`, `prompt` and `gemv`, shared by every engine over it
    (kept on the model, so that its compiled graphs live as long as the model)."""
    if not isinstance(getattr(model, "longflow_compiled_forwards", None), dict):
        model.longflow_compiled_forwards = {}
    key = (tuning, prompt, gemv)
    if key not in model.longflow_compiled_forwards:
        model.longflow_compiled_forwards[key] = CompiledForward(model, tuning=tuning, prompt=prompt, gemv=gemv)
    return model.longflow_compiled_forwards[key]

