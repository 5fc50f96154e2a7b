"""What several test modules share (test modules never import each other): tiny models, method
policies as the entry point builds them, one layer driven through the engine's own calls, and HF's
attention for reference runs."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import types
from contextlib import contextmanager
from pathlib import Path

import torch

from evals.configs import group_options, method_config, model_spec
from longflow.cache import ATTENTION_NAME, PolicyCache, kv_policy_attention
from longflow.engine import Stepper, prompt_positions
from longflow.methods import build_policy, method_factory
from longflow.models import ModelSpec, eos_token_ids, load_model
from longflow.policy import VARIANTS, CacheSpec, KVPolicy

REPO = Path(__file__).resolve().parents[2]

# The Tritons the kernels are compiled for sm_90 with (in a process of their own, the interpreter
# off): the installed one, and the GPU image's where `make install` put it beside (`$(VENV)/gpu-triton`).
GPU_TRITON = Path(sys.prefix) / "gpu-triton"
SM90_TRITONS = {"installed": None} | ({"gpu image": GPU_TRITON} if GPU_TRITON.is_dir() else {})


def sm90_process(triton: str, *command: str) -> subprocess.CompletedProcess:
    """`python *command` from the repository with Triton's interpreter off and `SM90_TRITONS[triton]`
    first on the path; its output as text."""
    env = os.environ | {"TRITON_INTERPRET": "0"}
    if SM90_TRITONS[triton] is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(SM90_TRITONS[triton]), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, *command], capture_output=True, text=True, env=env, timeout=1800,
                          cwd=REPO)

FAMILIES = ("llama", "qwen2", "qwen3")
# Short prompts of different lengths, for the engine against HF's generate.
TEXTS = ["What is 2 + 3?", "hi", "Compute the sum of the first ten odd numbers, please."]
# Two prompts longer than the small budgets of the method tests, so that prefill compression runs.
LONG_TEXTS = ["Solve for x: 3x + 7 = 22, then add five.", "A train leaves at noon at 60 mph; when?"]

# ---- tiny models ------------------------------------------------------------------------------


def tiny_spec(family: str, **overrides) -> ModelSpec:
    """The `conf/model/tiny_<family>.yaml` model, as the entry point would build it."""
    return model_spec(f"tiny_{family}", **overrides)


def tiny_model(family: str):
    """(model, tokenizer) with random float32 weights on the CPU, `kv_policy` attention set."""
    return load_model(tiny_spec(family), torch.device("cpu"))


def generate(tiny, factory, texts, max_new_tokens=24):
    """Greedy generation of `texts` through the engine with `factory`'s policy, EOS ignored.

    Returns (prompt token lists, `BatchResult`).
    """
    from longflow.config import GenerationConfig
    from longflow.engine import Engine

    model, tokenizer = tiny
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    engine = Engine(model, factory, eos_token_ids(model, tokenizer), tokenizer.pad_token_id)
    generation = GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True)
    return prompts, engine.generate(prompts, generation, list(range(len(prompts))))


@contextmanager
def hf_attention(model):
    """HF's own SDPA attention and DynamicCache, for the reference run."""
    model.set_attn_implementation("sdpa")
    try:
        yield model
    finally:
        model.set_attn_implementation(ATTENTION_NAME)


def hf_generate(model, tokenizer, prompts, **kwargs) -> list[list[int]]:
    """Batched, left-padded `model.generate`; returns the new tokens of each row."""
    length = max(map(len, prompts))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (length - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in prompts])
    eos = eos_token_ids(model, tokenizer)
    with hf_attention(model), torch.no_grad():
        out = model.generate(input_ids, attention_mask=mask, pad_token_id=pad, eos_token_id=eos, **kwargs)
    rows = out[:, length:].tolist()
    return [row[: next((i + 1 for i, t in enumerate(row) if t in eos), len(row))] for row in rows]


def filled_attention(q, k, v, valid, lengths, scale):
    """The truth, in float64: softmax over slots j < lengths[b] with valid[b, j]; query head h reads
    KV head h // G (HF's `repeat_kv`). q `[B, Hq, D]`; k, v `[B, Hkv, S, D]` -> `[B, Hq, D]`."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(group, dim=1) for x in (k, v))  # [B, Hq, S, D]
    logits = torch.einsum("bhd,bhsd->bhs", q.double(), k) * scale
    slots = torch.arange(k.shape[2], device=k.device)
    seen = valid & (slots[None, :] < lengths[:, None])  # [B, S]
    logits = logits.masked_fill(~seen[:, None, :], float("-inf"))
    return torch.einsum("bhs,bhsd->bhd", torch.softmax(logits, dim=-1), v)


# ---- methods ----------------------------------------------------------------------------------


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


def synthetic_calibration(tmp_path: Path, layers: int, q_heads: int, seed: int = 0) -> str:
    """A CompressKV calibration file of random head and layer scores, for a model of this shape."""
    from evals.calibrate import normalise, write_calibration

    generator = torch.Generator().manual_seed(seed)
    path = tmp_path / f"synthetic-{layers}x{q_heads}.pt"
    write_calibration(path, torch.rand(layers, q_heads, generator=generator),
                      normalise(torch.rand(layers, generator=generator) ** 3))
    return str(path)


def lkv_weights_file(tmp_path: Path, layers: int, kv_heads: int, head_dim: int, budget_logits,
                     w_linear=None, hidden: int = 4, seed: int = 0) -> str:
    """An LKV parameter file of the model's shape: the given shares `[layers, Hkv]` and linear score
    `[layers, Hkv, head_dim + 2]`, a random MLP when `w_linear` is None (else none)."""
    from safetensors.torch import save_file

    from baselines.lkv import prior_parameters

    params = prior_parameters(layers, kv_heads, head_dim, hidden)
    params["budget_logits"] = torch.as_tensor(budget_logits, dtype=torch.float32)
    if w_linear is None:
        generator = torch.Generator().manual_seed(seed)
        for name in ("w_linear", "w_in", "b_in", "w_out"):
            params[name] = torch.randn(params[name].shape, generator=generator)
    else:
        params["w_linear"] = torch.as_tensor(w_linear, dtype=torch.float32)
    path = tmp_path / "lkv.safetensors"
    save_file(params, str(path))
    return str(path)


def method_defaults(cls) -> dict:
    """A method's own config fields and their defaults (the base class's `budget`, `budget_scope` and
    `prefill` come from the run or the class, not from the method's yaml)."""
    base = {f.name for f in dataclasses.fields(KVPolicy)}
    return {f.name: f.default for f in dataclasses.fields(cls) if f.name not in base}


def capped(cls):
    """`cls` with the budget asserted as a hard cap after every store, attention call and step (under
    `budget_scope: total`, on the layers together: each within its own capacity; with per-head
    capacities, each KV head within its own)."""

    class Checked(cls):
        def _check(self, layer):
            slots = self.layers[layer]
            held = slots.valid.sum(dim=-1)  # [B, Hkv]
            if slots.usable is not None:
                assert (held <= slots.usable.sum(dim=-1)).all(), f"{self.name}: a head of layer {layer} over capacity"
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


# ---- one layer, driven as the engine does ------------------------------------------------------


def drive_layer(policy, q, k, v, pad, steps, scale, rotary=None):
    """Drives one layer of `policy` through prefill and decode by the engine's own calls: the model's
    (`PolicyCache.update`, then the `kv_policy` attention function) and the step loop's host hooks
    (`longflow.engine.Stepper`).

    `rotary`: the model's rotary embedding, for policies that need it (`CacheSpec.rotary`).
    Returns (held positions per step `[step][row][head] -> set`, the slots that step's query
    attended to; attention output per step).
    """
    batch, q_heads, length, head_dim = q.shape
    policy.allocate(CacheSpec(batch=batch, layers=1, q_heads=q_heads, kv_heads=k.shape[1], head_dim=head_dim,
                              prompt_len=length, max_new_tokens=len(steps) + 1, dtype=torch.float32,
                              device=torch.device("cpu"), rotary=rotary, scale=scale))
    cache, module = PolicyCache(policy, 1), types.SimpleNamespace(layer_idx=0)

    def layer(qs, ks, vs):
        keys, values = cache.update(ks, vs, 0)
        return kv_policy_attention(module, qs, keys, values, None, scaling=scale, kv_cache=cache)[0]

    policy.begin_prefill(pad, prompt_positions(pad))
    layer(q, k, v)
    positions = pad.sum(dim=-1)
    policy.begin_decode(positions)
    held_log, out_log = [], []
    pending = iter(steps)

    def step():
        out_log.append(layer(*next(pending))[:, 0])
        slots = policy.layers[0]
        held_log.append([[set(slots.positions[b, h][slots.valid[b, h]].tolist()) for h in range(k.shape[1])]
                         for b in range(batch)])
        positions.add_(1)

    Stepper(step, (policy,), torch.device("cpu"), cuda_graph=False).run(len(steps))
    return held_log, out_log
