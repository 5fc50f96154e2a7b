"""LKV, reconstructed: learned per-head budgets (LKV-H) and a learned query-agnostic token score (LKV-T).

"LKV: End-to-End Learning of Head-wise Budgets and Token Selection for LLM KV Cache Eviction",
Zhou et al., arXiv 2605.06676 (2026). No code or weights exist; this is a reconstruction whose
parameters are trained here, on the canary, by `python -m evals.canary.train_lkv` (self-distillation
from the full-cache model through a Soft-TopK mask). What is the paper's and what is assumed:
docs/methods.md, "LKV".

The learned parameters, one file (`weights`, safetensors), per layer l and KV head h:

- LKV-H, `budget_logits` `[layers, Hkv]`: shares p = softmax over all layers x heads. A layer holds
  its heads in one buffer, so the budget counts a layer's slots (`budget_scope: total`: the layers
  together hold at most layers x budget slots) and a head holds at most its layer's. With
  m_l = max_h p[l, h], the layer's slots and each head's capacity are

      slots[l]    = max(2, floor(layers x budget x m_l / sum_l' m_l'))
      capacity[l, h] = max(2, floor(slots[l] x p[l, h] / m_l))      (the layer's largest head: slots[l])

  (`head_budgets`); uniform shares give every head the budget.
- LKV-T, a per-head scorer over the features of a slot (`slot_features`):
  x = [k (the key after RoPE, D numbers), log ||v||, log(1 + position)], F = D + 2, and

      score = x . w_linear + relu(x @ w_in + b_in) . w_out       (w_in `[F, hidden]`, w_out `[hidden]`)

  (`token_scores`). It reads no query and no attention: the decode step computes no probabilities
  (flash decoding on CUDA). The score of a slot never changes, so evicting the lowest-scored slot
  at every step keeps exactly the newest token and the top capacity - 1 scores of the rest, the
  selection the training relaxes. So it is computed once per token, when its slot is written (the
  decode token in `store`, the kept prompt tokens by the state's `on_prompt`), and kept in the
  per-slot state `score`, which moves with its slot; a decode step's score reads it.

A step method through the shared rule (lowest score evicted, per KV head); a prompt longer than a
head's capacity is cut by the same score (`prefill: by_score`). `weights: null`, or a file made for
a model of another shape with `other_models: prior`, is the prior the training starts from: uniform
shares and score = log(1 + position) (a sliding window), with a warning for the second.

Notation: n rows, L layers, Hkv KV heads, S slots, D head dim, F features, H hidden units.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch

from longflow.calibration import load_calibration
from longflow.errors import UserError
from longflow.policy import CacheSpec, KVPolicy, Observation, PromptObservation, one_of
from longflow.slots import SlotState

PARAMETERS = ("budget_logits", "w_linear", "w_in", "b_in", "w_out")
OTHER_MODELS = ("prior", "error")
SCORE = "score"  # per-slot state: LKV-T's score of the slot's token


def slot_features(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """keys, values `[..., S, D]`, positions `[..., S]` -> `[..., S, D + 2]` float32:
    [k, log ||v||, log(1 + position)] (free slots and padding, position -1, read as position 0)."""
    norms = values.float().norm(dim=-1).clamp(min=1e-6).log()
    return torch.cat([keys.float(), norms[..., None], torch.log1p(positions.clamp(min=0).float())[..., None]], dim=-1)


def token_scores(features: torch.Tensor, w_linear: torch.Tensor, w_in: torch.Tensor, b_in: torch.Tensor,
                 w_out: torch.Tensor) -> torch.Tensor:
    """LKV-T of one layer: features `[n, Hkv, S, F]`, w_linear `[Hkv, F]`, w_in `[Hkv, F, H]`,
    b_in `[Hkv, H]`, w_out `[Hkv, H]` -> scores `[n, Hkv, S]`, higher = keep."""
    hidden = torch.relu(torch.einsum("nhsf,hfk->nhsk", features, w_in) + b_in[:, None, :])
    return torch.einsum("nhsf,hf->nhs", features, w_linear) + torch.einsum("nhsk,hk->nhs", hidden, w_out)


def prior_parameters(layers: int, kv_heads: int, head_dim: int, hidden: int) -> dict[str, torch.Tensor]:
    """The parameters of no training: uniform shares, score = log(1 + position), a silent MLP."""
    features = head_dim + 2
    w_linear = torch.zeros(layers, kv_heads, features)
    w_linear[..., -1] = 1.0
    return {"budget_logits": torch.zeros(layers, kv_heads), "w_linear": w_linear,
            "w_in": torch.zeros(layers, kv_heads, features, hidden), "b_in": torch.zeros(layers, kv_heads, hidden),
            "w_out": torch.zeros(layers, kv_heads, hidden)}


def head_budgets(budget_logits: torch.Tensor, budget: int) -> tuple[list[int], list[list[int]]]:
    """LKV-H's rounding: budget_logits `[L, Hkv]` -> (slots per layer, capacity per layer and head);
    see the module docstring. The layers' slots sum to at most L x budget."""
    shares = torch.softmax(budget_logits.double().flatten(), dim=0).view_as(budget_logits)
    largest = shares.amax(dim=1)  # [L]
    layers = budget_logits.shape[0]
    slots = [max(2, math.floor(layers * budget * float(m) / float(largest.sum()) + 1e-9)) for m in largest]
    heads = [[max(2, math.floor(slots[layer] * float(p) / float(largest[layer]) + 1e-9)) for p in shares[layer]]
             for layer in range(layers)]
    return slots, heads


def prompt_scores(prompt: PromptObservation) -> torch.Tensor:
    """`SlotState.on_prompt` of `score`: LKV-T's scores of the prompt's tokens, `[B, Hkv, L]`."""
    return prompt.policy.token_scores(prompt.layer, prompt.keys, prompt.values, prompt.positions)


@dataclass(eq=False)
class LKVPolicy(KVPolicy):
    """LKV (see the module docstring). Fields: `weights` (the trained file, or None for the prior),
    `other_models` (`prior` or `error`: what a file made for another model shape does)."""

    weights: str | None = None
    other_models: str = "prior"
    hidden: int = 16  # the prior's MLP width when no file is used (a file brings its own)
    budget_scope: str = field(default="total", kw_only=True)
    prefill: str = field(default="by_score", kw_only=True)

    name = "lkv"
    shared_selection = False
    step_probs = False
    prompt_score_is_stateless = True

    def __post_init__(self):
        super().__post_init__()
        one_of(self.name, "other_models", self.other_models, OTHER_MODELS)
        if self.budget_scope != "total":
            raise UserError(f"{self.name}: its budgets differ by layer and head; budget_scope must be 'total', "
                            f"got {self.budget_scope!r}")
        if self.hidden < 1:
            raise UserError(f"{self.name}: hidden must be >= 1, got {self.hidden}")
        if self.weights is not None:
            load_calibration(self.weights, self.name, PARAMETERS)  # a bad file fails before any model loads

    def prepare(self, spec: CacheSpec) -> None:
        """The parameters for this model: the file's, or the prior (no file, or one of another shape)."""
        params = None
        if self.weights is not None:
            params = load_calibration(self.weights, self.name, PARAMETERS)
            shape = (spec.layers, spec.kv_heads, spec.head_dim + 2)
            if tuple(params["w_linear"].shape) != shape:
                message = (f"{self.name}: {self.weights!r} was trained for (layers, KV heads, head dim + 2) = "
                           f"{tuple(params['w_linear'].shape)}, this model has {shape}")
                if self.other_models == "error":
                    raise UserError(message)
                warnings.warn(f"{message}: using the prior (uniform budgets, newest tokens kept)", stacklevel=2)
                params = None
        if params is None:
            params = prior_parameters(spec.layers, spec.kv_heads, spec.head_dim, self.hidden)
        self.params = {name: tensor.to(device=spec.device, dtype=torch.float32) for name, tensor in params.items()}
        self.layer_slots, self.head_slots = head_budgets(self.params["budget_logits"].cpu(), self.budget)

    def layer_capacities(self, spec: CacheSpec) -> list[int]:
        return list(self.layer_slots)

    def capacity(self, spec: CacheSpec) -> int:
        """The largest layer's slots: what a prompt may keep at most (each head keeps its capacity - 1)."""
        return max(self.layer_slots)

    def head_capacities(self, spec: CacheSpec, layer: int) -> list[int] | None:
        return list(self.head_slots[layer])

    def slot_state(self) -> dict[str, SlotState]:
        return {SCORE: SlotState(on_prompt=prompt_scores)}

    def token_scores(self, layer: int, keys: torch.Tensor, values: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
        """LKV-T of `layer`'s tokens: keys, values `[n, Hkv, S, D]`, positions `[n, Hkv, S]` -> `[n, Hkv, S]`."""
        features = slot_features(keys, values, positions)
        return token_scores(features, *(self.params[name][layer] for name in PARAMETERS[1:]))

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The base class's store, and at decode the new token's score into the slot it was written to
        (`next_slot[layer]`, which this step's `decode` then moves on). Static, no sync."""
        out = super().store(layer, k, v)
        if not self.prefilling:
            written = self.next_slot[layer][..., None]  # [B, Hkv, 1]
            positions = self.positions[:, None, None].expand(-1, k.shape[1], 1)
            self.layers[layer].state[SCORE].scatter_(2, written, self.token_scores(layer, k, v, positions))
        return out

    def score(self, obs: Observation) -> torch.Tensor:
        """The stored scores of the slots; a prompt's (`prefill: by_score`) computed from its tokens."""
        if isinstance(obs, PromptObservation):
            return prompt_scores(obs)
        return obs.state(SCORE)
