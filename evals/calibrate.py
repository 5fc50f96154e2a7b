"""CompressKV's offline calibration: `python -m evals.calibrate [overrides]` writes the head and layer
scores of a model into the file that `method.calibration` names.

    python -m evals.calibrate model=canary dataset=canary limit=32 budget=128 device=cpu
    python -m evals.calibrate model=qwen3_8b dataset=math500 limit=64 budget=1024 out=calib/qwen3_8b.pt

The overrides are those of `python -m evals.run` (conf/config.yaml: model, dataset, generation,
budget, limit, device, engine); two keys are this command's own: `out=` (default
results/calibration/compresskv/<model>-v<FORMAT>.pt) and `stride=` (every how many output tokens
the layer error is measured, default 8).

1. Every item is decoded greedily with the full cache by the harness's engine and graded.
2. Each (prompt + output) is run again, teacher-forced, with an attention function that records
   every layer's queries, keys and values (after RoPE).
3. Semantic retrieval heads (official `Retrieval_Head_Identification/
   semantic_retrieval_head_detection.py:223-234, 297-303`): at every output token, each query head
   scores the attention mass that the query which produced the token pays to the earlier
   positions holding the same token (`retrieval_mass`), summed over the item's tokens; a head's
   score is the mean over the items graded correct. A substitution, stated: the official sweep
   inserts a needle sentence into essays and counts the mass on the needle span at the steps whose
   token occurs in it, for the tests with ROUGE-1 recall > 50; here the "needle" of a token is every
   earlier occurrence of it, in the harness's own reasoning data (which any model the harness loads
   can read, the canary's own tokenizer included), and success is the harness's grading.
4. Layer eviction error (official `longbench/model/modeling_llama_new.py:527-548, 600-696`,
   `pred_get_importance_score.py:197`, `get_avg.py:37-43`): at every `stride`-th output token and in
   every layer, the relative error ||o_proj(attn(q, K_kept, V_kept)) - o_proj(attn(q, K, V))||_F /
   (||o_proj(attn(q, K, V))||_F + 1e-5) where K_kept is what CompressKV keeps of the context at
   `budget` slots (`baselines.compresskv.srh_scores` with the layer's top heads: the last 8 queries
   as the window, top budget - 8 of the older keys); summed over tokens and items, L1-normalised
   over the layers per dataset, averaged over the datasets, L1-normalised. A substitution, stated:
   the official measures the decode of LongBench prompts compressed once at prefill.

The file (`torch.save`, loaded with `longflow.calibration.load_calibration`): `head_scores`
`[layers, q_heads]`, `layer_scores` `[layers]` float32, and what made them: `format`, `model`,
`hub_id`, `revision`, `checkpoint`, `datasets`, `items`, `items_correct`, `budget`, `window`,
`selection_heads`, `stride`, `max_new_tokens`.

Notation: H query heads, Hkv KV heads, G = H / Hkv, N tokens (prompt + output), T output tokens, P
prompt tokens, D head dim.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from evals.configs import compose_config
from longflow.errors import UserError, report

FORMAT = 1  # the file layout's version: bump it when keys or their meaning change
OWN_KEYS = ("out", "stride")
ATTENTION = "longflow_calibration_capture"
WINDOW, SELECTION_HEADS = 8, 4  # CompressKV's official window and first_k (baselines.compresskv defaults)
CHUNK = 256  # query rows per softmax in `retrieval_mass`: memory stays O(H x CHUNK x N)


@torch.no_grad()
def retrieval_mass(queries: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor, prompt_len: int,
                   scale: float) -> torch.Tensor:
    """Per query head, the attention mass paid to earlier copies of each output token, summed `[H]`.

    queries: `[H, N, D]`, keys: `[Hkv, N, D]` (after RoPE) of the sequence `ids` `[N + 1]` (prompt then
    output; the forward ran on ids[:-1]). Output token t (ids[P + t]) was produced by the query at
    position P + t - 1; its mass is its causal softmax summed over the positions j <= P + t - 1
    with ids[j] == ids[P + t].
    """
    heads, length = queries.shape[0], queries.shape[1]
    group = heads // keys.shape[0]
    keys = keys.float().repeat_interleave(group, dim=0)  # [H, N, D]
    column = torch.arange(length, device=queries.device)
    total = torch.zeros(heads, dtype=torch.float32, device=queries.device)
    for start in range(prompt_len - 1, length, CHUNK):
        rows = torch.arange(start, min(length, start + CHUNK), device=queries.device)
        logits = torch.matmul(queries[:, rows].float(), keys.transpose(-1, -2)) * scale  # [H, c, N]
        logits = logits.masked_fill(column[None, None, :] > rows[None, :, None], float("-inf"))
        copies = ids[:length][None, :] == ids[rows + 1][:, None]  # [c, N]
        total += (torch.softmax(logits, dim=-1) * copies).sum(dim=(1, 2))
    return total


@torch.no_grad()
def layer_error(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, o_proj, heads: torch.Tensor,
                steps: list[int], budget: int, scale: float) -> float:
    """The summed relative error of one layer's output at the query positions `steps` when the cache
    holds what CompressKV keeps at `budget` slots, against the full cache.

    queries `[H, N, D]`, keys and values `[Hkv, N, D]` (after RoPE); o_proj: the layer's output
    projection, `[..., H * D] -> [..., hidden]`; heads: `[k]` the layer's selecting query heads. A
    position p whose context (p + 1 tokens) fits the budget adds 0.
    """
    from baselines.compresskv import srh_scores
    from longflow.selection import choose_keep

    heads_q, length, head_dim = queries.shape
    group = heads_q // keys.shape[0]
    error = 0.0
    for p in steps:
        if p + 1 <= budget:
            continue
        context = p + 1
        window = torch.arange(p - WINDOW + 1, p + 1, device=queries.device)
        positions = torch.arange(context, device=queries.device)[None, None].expand(1, keys.shape[0], -1)
        held = torch.ones_like(positions, dtype=torch.bool)
        scores = srh_scores(queries[None, :, window], window[None], torch.ones(1, WINDOW, dtype=torch.bool),
                            keys[None, :, :context], positions, held, heads, scale, kernel=5, pooling="avgpool")
        kept = choose_keep(scores[:, :1], held[:, :1], budget)[0, 0]  # [budget]
        query = queries[:, p].float()  # [H, D]

        def output(index, query=query, p=p):
            k = keys[:, index].float().repeat_interleave(group, dim=0)  # [H, n, D]
            v = values[:, index].float().repeat_interleave(group, dim=0)
            probs = torch.softmax(torch.einsum("hd,hnd->hn", query, k) * scale, dim=-1)
            out = torch.einsum("hn,hnd->hd", probs, v).reshape(1, heads_q * head_dim)
            return o_proj(out.to(o_proj.weight.dtype)).float()

        full = output(torch.arange(context, device=queries.device))
        error += float((output(kept) - full).norm() / (full.norm() + 1e-5))
    return error


def normalise(values: torch.Tensor) -> torch.Tensor:
    """L1-normalised over the last dimension (the official `x / x.sum()`, with get_avg.py's 1e-12)."""
    return values / (values.sum(dim=-1, keepdim=True) + 1e-12)


def write_calibration(path: Path, head_scores: torch.Tensor, layer_scores: torch.Tensor, **made_by: Any) -> None:
    """The calibration file: the two score tensors and the (plain) values that describe how they were made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"head_scores": head_scores.float().cpu(), "layer_scores": layer_scores.float().cpu(),
                "format": FORMAT, **made_by}, path)


class Capture:
    """An attention function that computes plain causal attention and keeps, per layer, its q, k, v
    (`[H, N, D]`, `[Hkv, N, D]`: a batch of one), output projection and softmax scale."""

    def __init__(self):
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any, float]] = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        self.layers[module.layer_idx] = (query[0], key[0], value[0], module.o_proj, scale)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale,
                                                               enable_gqa=True)
        return out.transpose(1, 2), None


@torch.inference_mode()
def calibrate(cfg: dict[str, Any], out: Path | None, stride: int) -> Path:
    """Runs steps 1-4 of the module docstring for a resolved run config; returns the file written."""
    from transformers import AttentionInterface

    from baselines.vanilla import VanillaPolicy
    from evals.fingerprint import checkpoint_fingerprint
    from evals.grading import GradeRequest, grade_many
    from evals.pipeline import decode, load_jobs
    from evals.prompts import build_messages, render_prompt, truncate_prompt
    from longflow.cache import ATTENTION_NAME
    from longflow.config import EngineConfig, GenerationConfig, from_mapping
    from longflow.engine import Engine
    from longflow.models import ModelSpec, eos_token_ids, load_model, resolve_device

    budget = cfg["budget"]
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= WINDOW:
        raise UserError(f"calibrate: budget must be an integer above the window ({WINDOW}), got {budget!r}")
    if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
        raise UserError(f"calibrate: stride must be a positive integer, got {stride!r}")
    spec = from_mapping(ModelSpec, cfg["model"], "model")
    generation_params = {k: v for k, v in cfg["generation"].items() if k not in ("name", "protocol")}
    generation = from_mapping(GenerationConfig, {**generation_params, "temperature": 0.0, "n_samples": 1},
                              "generation")
    engine_config = from_mapping(EngineConfig, {**cfg["engine"], "continuous": False, "cuda_graph": False,
                                                "compile": False}, "engine")
    protocol = cfg["generation"]["protocol"]
    device = resolve_device(cfg["device"])
    jobs = load_jobs(cfg["dataset"], cfg.get("limit"))
    out = out or Path("results/calibration/compresskv") / f"{spec.name}-v{FORMAT}.pt"

    model, tokenizer = load_model(spec, device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    engine = Engine(model, VanillaPolicy, eos_token_ids(model, tokenizer), pad_id, engine_config)
    eos = engine.eos_ids.tolist()
    config = model.config.get_text_config()
    layers, q_heads = config.num_hidden_layers, config.num_attention_heads

    sequences = []  # per dataset: (prompt ids, output ids, graded correct) per item
    for job in jobs:
        prompts = [truncate_prompt(render_prompt(tokenizer, build_messages(item, job.kind, protocol),
                                                 thinking=spec.thinks, protocol=protocol),
                                   generation.max_prompt_tokens, generation.truncation_side) for item in job.items]
        tokens, reasons = [], []
        for start in range(0, len(prompts), engine_config.batch_size):
            batch = prompts[start:start + engine_config.batch_size]
            result = engine.generate(batch, generation, list(range(len(batch))))
            tokens, reasons = tokens + result.tokens, reasons + result.finish_reasons
        grades = grade_many([GradeRequest(kind=job.kind, output=decode(tokenizer, output, eos), gold=item.gold,
                                          finish_reason=reason, thinks=spec.thinks)
                             for item, output, reason in zip(job.items, tokens, reasons, strict=True)],
                            workers=cfg["grading"]["workers"], timeout=cfg["grading"]["timeout"])
        sequences.append([(prompt, output, grade.correct)
                          for prompt, output, grade in zip(prompts, tokens, grades, strict=True) if output])
        reasons = Counter(grade.reason for grade in grades)

    capture = Capture()
    AttentionInterface.register(ATTENTION, capture)
    model.set_attn_implementation(ATTENTION)
    try:
        def forward(prompt: list[int], output: list[int]) -> torch.Tensor:
            ids = torch.tensor(prompt + output, device=device)
            capture.layers.clear()
            model(input_ids=ids[None, :-1], use_cache=False)
            return ids

        # Semantic retrieval heads, over the items graded correct.
        head_sums, correct = torch.zeros(layers, q_heads), 0
        for prompt, output, solved in (unit for job_units in sequences for unit in job_units):
            if solved:
                ids = forward(prompt, output)
                head_sums += torch.stack([retrieval_mass(q, k, ids, len(prompt), scale)
                                          for q, k, _, _, scale in map(capture.layers.get, range(layers))]).cpu()
                correct += 1
        if not correct:
            raise UserError(f"calibrate: none of the {sum(map(len, sequences))} items was graded correct (last "
                            f"dataset's reasons: {dict(reasons)}), so no retrieval succeeded: use more items, a larger "
                            "generation.max_new_tokens, a larger grading.timeout, or a dataset the model solves")
        head_scores = head_sums / correct
        ranking = head_scores.argsort(dim=-1, descending=True, stable=True)[:, :SELECTION_HEADS].to(device)

        # Layer errors, over every item, per dataset.
        layer_means = []
        for job_units in sequences:
            errors = torch.zeros(layers, dtype=torch.float64)
            for prompt, output, _ in job_units:
                forward(prompt, output)
                steps = list(range(len(prompt) - 1, len(prompt) + len(output) - 1, stride))
                for i in range(layers):
                    q, k, v, o_proj, scale = capture.layers[i]
                    errors[i] += layer_error(q, k, v, o_proj, ranking[i], steps, budget, scale)
            layer_means.append(normalise(errors))
    finally:
        model.set_attn_implementation(ATTENTION_NAME)
    items = sum(len(job_units) for job_units in sequences)
    layer_scores = normalise(torch.stack(layer_means).mean(dim=0))
    write_calibration(out, head_scores, layer_scores, model=spec.name, hub_id=spec.hub_id, revision=spec.revision,
                      checkpoint=checkpoint_fingerprint(spec.hub_id) if spec.weights != "random" else None,
                      datasets=[job.name for job in jobs], items=items, items_correct=correct, budget=budget,
                      window=WINDOW, selection_heads=SELECTION_HEADS, stride=stride,
                      max_new_tokens=generation.max_new_tokens)
    return out


def main(argv: list[str]) -> int:
    own = {key: value for key, _, value in (arg.partition("=") for arg in argv) if key in OWN_KEYS}
    overrides = [arg for arg in argv if arg.partition("=")[0] not in OWN_KEYS]
    try:
        path = calibrate(compose_config(overrides), Path(own["out"]) if "out" in own else None,
                         int(own.get("stride", 8)))
    except UserError as error:
        return report(error)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
