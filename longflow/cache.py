"""Transformers integration: a `Cache` subclass and the `kv_policy` attention function.

Both are transformers' public extension points, so no model class is patched and any model of the
Llama, Qwen2 and Qwen3 families works. The model calls `cache.update(k, v, layer)` and then the
attention function of `config._attn_implementation`; both hand over to the batch's `KVPolicy`.

The attention function needs the cache, which the model passes only to `update`. The engine
therefore passes it a second time as the forward kwarg `kv_cache`, which transformers forwards to
every attention call untouched.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, Cache

from longflow.policy import KVPolicy

ATTENTION_NAME = "kv_policy"


class PolicyCache(Cache):
    """A transformers `Cache` whose storage and eviction belong to a `KVPolicy`."""

    def __init__(self, policy: KVPolicy, num_layers: int):
        super().__init__(layers=[])
        self.policy = policy
        self.num_layers = num_layers
        self.seen_tokens = 0

    def __len__(self) -> int:
        return self.num_layers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx == 0:
            self.seen_tokens += key_states.shape[2]
        return self.policy.store(layer_idx, key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # Tokens seen, not slots held: position ids never come from the cache length (the engine
        # passes them explicitly), this only answers transformers' bookkeeping.
        return self.seen_tokens

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def reset(self) -> None:
        self.seen_tokens = 0


def kv_policy_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    kv_cache: PolicyCache | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over the policy's slots. query `[B, Hq, Lq, D]` -> (`[B, Lq, Hq, D]`, None).

    `attention_mask` is ignored: padding and free slots are tracked by the policy itself.
    """
    if kv_cache is None:
        raise RuntimeError(
            f"attn_implementation={ATTENTION_NAME!r} needs the forward kwarg kv_cache=<PolicyCache>; "
            "generate with longflow.engine"
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return kv_cache.policy.attend(module.layer_idx, query, key, value, scale), None


AttentionInterface.register(ATTENTION_NAME, kv_policy_attention)
