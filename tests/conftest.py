"""Shared fixtures: tiny random-weight models of the three supported families, and the data root."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from evals.configs import group_options, method_config, model_spec
from longflow.methods import build_policy, method_factory
from longflow.models import ModelSpec, load_model
from longflow.policy import CacheSpec

REPO = Path(__file__).resolve().parents[1]

FAMILIES = ("llama", "qwen2", "qwen3")
VARIANTS = ("paper", "lf_repo")
# Two prompts longer than the small budgets of the method tests, so that prefill compression runs.
LONG_TEXTS = ["Solve for x: 3x + 7 = 22, then add five.", "A train leaves at noon at 60 mph; when?"]


def tiny_spec(family: str, **overrides) -> ModelSpec:
    """The `conf/model/tiny_<family>.yaml` model, as the entry point would build it."""
    return model_spec(f"tiny_{family}", **overrides)


def tiny_model(family: str):
    """(model, tokenizer) with random float32 weights on the CPU, `kv_policy` attention set."""
    return load_model(tiny_spec(family), torch.device("cpu"))


@pytest.fixture(scope="session", params=FAMILIES)
def tiny(request):
    """Each tiny family in turn: (model, tokenizer)."""
    return tiny_model(request.param)


@pytest.fixture(scope="session")
def data_root() -> Path:
    """The benchmark JSONL folder: $LONGFLOW_DATA_ROOT, else ../shared/data beside the repo."""
    root = Path(os.environ.get("LONGFLOW_DATA_ROOT", REPO.parent / "shared" / "data"))
    if not (root / "gsm8k.jsonl").exists():
        pytest.skip(f"benchmark data not found under {root} (set LONGFLOW_DATA_ROOT)")
    return root


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA: skipped on CPU machines (CI), run on the GPU through `device`."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def generate(tiny, factory, texts, max_new_tokens=24):
    """Greedy generation of `texts` through the engine with `factory`'s policy, EOS ignored.

    Returns (prompt token lists, `BatchResult`).
    """
    from longflow.config import GenerationConfig
    from longflow.engine import Engine
    from longflow.models import eos_token_ids

    model, tokenizer = tiny
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    engine = Engine(model, factory, eos_token_ids(model, tokenizer), tokenizer.pad_token_id)
    generation = GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True)
    return prompts, engine.generate(prompts, generation, list(range(len(prompts))))


def method_names() -> list[str]:
    """Every method config of conf/method/: tests cover a method as soon as its yaml exists."""
    return group_options("method")


COMPRESSING = [name for name in method_names() if name != "vanilla"]


def method_variants() -> list[tuple[str, str | None]]:
    """(method, variant) for every compressing method: both variants where its config has a `variant`."""
    return [(name, variant) for name in COMPRESSING
            for variant in (VARIANTS if "variant" in method_config(name) else (None,))]


def policy_of(name: str, budget: int | None, **overrides):
    """The policy of `conf/method/<name>.yaml` with fields replaced, as the entry point builds it."""
    return build_policy({**method_config(name), **overrides}, budget)


def capped_policy(name: str, budget: int, **overrides):
    """`policy_of`, with its class wrapped by `capped`."""
    factory = method_factory({**method_config(name), **overrides})
    return capped(factory.func)(budget=budget, **factory.keywords)


def method_defaults(cls) -> dict:
    """A method's own config fields and their defaults (the base class's `budget` and `budget_scope`
    come from the run, not from the method's yaml)."""
    return {f.name: f.default for f in dataclasses.fields(cls) if f.name not in ("budget", "budget_scope")}


def capped(cls):
    """`cls` with the budget asserted as a hard cap after every store, attention call and step (under
    `budget_scope: total`, on the layers together: each within its own capacity)."""

    class Checked(cls):
        def _check(self, layer):
            held = self.layers[layer].valid.sum(dim=-1)  # [B, Hkv]
            if self.budget_scope == "total":  # each layer within its capacity, all of them within layers x budget
                assert int(held.max()) <= self.layers[layer].slots, f"{self.name}: layer {layer} over its capacity"
                total = sum(slots.valid.sum(dim=-1).amax(dim=-1) for slots in self.layers)  # [B]
                assert int(total.max()) <= self.budget * len(self.layers), f"{self.name}: over layers x budget"
                return
            assert int(held.max()) <= self.budget, f"{self.name}: {int(held.max())} slots > budget {self.budget}"

        def store(self, layer, k, v):
            out = super().store(layer, k, v)
            if not self.prefilling:
                self._check(layer)
            return out

        def attend(self, layer, q, k, v, scale):
            out = super().attend(layer, q, k, v, scale)
            self._check(layer)
            return out

        def after_step(self, step):
            super().after_step(step)
            for layer in range(len(self.layers)):
                self._check(layer)

    return Checked


def drive_layer(policy, q, k, v, pad, steps, scale, rotary=None):
    """Drives one layer of `policy` through prefill and decode as the engine does (the host hooks
    `before_step` and `after_step` around each step).

    `rotary`: the model's rotary embedding, for policies that need it (`CacheSpec.rotary`).
    Returns (held positions per step `[step][row][head] -> set`, the slots that step's query
    attended to; attention output per step).
    """
    batch, q_heads, length, head_dim = q.shape
    policy.allocate(CacheSpec(batch=batch, layers=1, q_heads=q_heads, kv_heads=k.shape[1], head_dim=head_dim,
                              prompt_len=length, max_new_tokens=len(steps) + 1, dtype=torch.float32,
                              device=torch.device("cpu"), rotary=rotary))
    policy.begin_prefill(pad, (pad.long().cumsum(dim=-1) - 1).clamp(min=0))
    policy.store(0, k, v)
    policy.attend(0, q, k, v, scale)
    positions = pad.sum(dim=-1)
    policy.begin_decode(positions)
    held_log, out_log = [], []
    for step, (qs, ks, vs) in enumerate(steps):
        policy.before_step(step)
        policy.store(0, ks, vs)
        out_log.append(policy.attend(0, qs, ks, vs, scale)[:, 0])
        slots = policy.layers[0]
        held_log.append([[set(slots.positions[b, h][slots.valid[b, h]].tolist()) for h in range(k.shape[1])]
                         for b in range(batch)])
        policy.after_step(step)
        positions += 1
    return held_log, out_log
