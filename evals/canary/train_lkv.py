"""Trains LKV's parameters (`baselines.lkv`) on a canary model by self-distillation from the full cache.

    python -m evals.canary.train_lkv --out evals/canary/lkv          # the canary's artifact (CPU, one thread)
    python -m evals.canary.train_lkv --out evals/canary/lkv_suite --model canary_suite \
        --families state,lookup,plan,redundant,chain --steps 200 --eval-items 8   # the suite model's
    python -m evals.canary.train_lkv --out /tmp/lkv --steps 5 --eval-items 8   # a smoke run

`--model` names a config of conf/model (its checkpoint folder and tokenizer); `--families` the
families of `evals.canary.families` whose training items it sees (the canary's task is the state
family). Teacher: the frozen model with the full cache. Student: the same frozen model whose attention
in every layer and KV head sees a soft keep-mask over the keys: row i of an output token keeps key i
and a Soft-TopK of capacity - 1 among the keys before it, ranked by LKV-T's score, with the
capacities of LKV-H (`head_budgets` without the floors, so that they are differentiable); prompt
rows attend to the whole prompt, as the engine's prefill does. The mask enters as log(mask) added to
the attention logits. Because the score of a key never changes, the hard limit of this mask is
exactly what argmin eviction holds at every decode step (and what `prefill: by_score` keeps of the
prompt): no simplification of the decode-time selection beyond the relaxation itself.

Soft-TopK (the paper names it; its form is an assumption here): mask_j = sigmoid((s_j - tau) / t)
with tau the threshold at which the mask sums to the count k (started at the midpoint of the k-th
and k+1-th scores, refined by Newton steps of at most 4 t), differentiated implicitly through tau
(d tau / d s_j = sigma'_j / sum sigma', d tau / d k = -t / sum sigma'). The temperature t falls
geometrically from `temperature_start` to `temperature_end`.

Loss: KL(teacher || student) of the next-token distributions, mean over output tokens. Each step
draws one family (uniformly, from its own generator: one family draws nothing), items of it from a
seeded generator (the task's step-count law, one count per batch) and one of `budgets`; rows equal
to an item of the family's held-out split are left out of the loss and counted, per family (the
suite trainer's helpers). At the end the first `eval_items` of each family's held-out split are
scored teacher-forced with the hard mask at each budget of `eval_budgets` (an item is solved when
every output token is the argmax: exactly when greedy decoding under LKV writes the reference).
`<out>/lkv.safetensors` holds the parameters, `<out>/train_log.json` the config, model, environment,
curve, budgets and held-out accuracy; both are rewritten every `checkpoint_every` steps and after
each family's scores, so a run cut short leaves its last state.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AttentionInterface, AutoTokenizer, Qwen3ForCausalLM

from baselines.lkv import PARAMETERS, head_budgets, prior_parameters, slot_features, token_scores
from evals.canary.batches import LINE_TOKENS
from evals.canary.families import FAMILIES, MAX_STEPS, MIN_STEPS
from evals.canary.suite_batches import FamilyBatches, heldout_mask, suite_batches
from evals.canary.train import environment
from evals.canary.train_suite import prompt_length, teacher_forced
from evals.configs import model_spec
from evals.fingerprint import checkpoint_fingerprint
from longflow.errors import UserError, report
from longflow.models import checkpoint_location

ATTENTION = "lkv_soft_eviction"


@dataclass
class LKVTrainConfig:
    seed: int = 0
    steps: int = 150
    tokens_per_step: int = 1024  # programs per step: as many of the drawn length as fit (at least one)
    lr: float = 1e-2  # Adam, constant
    budgets: list[int] = field(default_factory=lambda: [96, 192, 384])  # one drawn per step
    temperature_start: float = 0.1  # Soft-TopK temperature, in score units (the prior's scores differ by 1 / position)
    temperature_end: float = 0.01
    newton: int = 3  # Newton steps refining the Soft-TopK threshold
    hidden: int = 16  # LKV-T's MLP width
    init_scale: float = 0.01  # std of the MLP's first layer at the start (its output layer starts at zero)
    eval_items: int = 32  # the first items of each family's held-out split (the harness run's limit=32)
    eval_budgets: list[int] = field(default_factory=lambda: [96, 192, 384])
    eval_rows: int = 4  # held-out programs per forward (the masked attention holds rows x T x T per head)
    model: str = "canary"  # a config of conf/model: the frozen teacher and student, and its tokenizer
    # Families of evals.canary.families drawn for training and scored; the canary's task is "state".
    families: list[str] = field(default_factory=lambda: ["state"])
    checkpoint_every: int = 25  # steps between rewrites of the parameters and the log
    threads: int = 1

    def __post_init__(self):
        if not self.families or len(set(self.families)) != len(self.families) or set(self.families) - set(FAMILIES):
            raise UserError(f"families must be distinct names of {list(FAMILIES)}, got {self.families}")
        if self.checkpoint_every < 1:
            raise UserError(f"checkpoint_every must be a positive number of steps, got {self.checkpoint_every}")


def soft_topk(scores: torch.Tensor, candidates: torch.Tensor, count: torch.Tensor, temperature: float,
              newton: int) -> torch.Tensor:
    """A soft keep-mask of `count` among the candidates of each row, differentiable in scores and count.

    scores `[..., R, S]` (one row per query), candidates `[..., R, S]` bool, count `[...]` float (one
    per leading index, the same for every row) -> mask `[..., R, S]` in [0, 1], 0 off the candidates,
    1 on every candidate of a row with at most `count` of them. As temperature -> 0 it is the top-k
    (k = floor(count)) indicator.
    """
    masked = scores.masked_fill(~candidates, -1e9)  # finite: no inf - inf in the threshold's updates
    k = count.detach().floor().long().clamp(min=1)  # [...]
    rows = candidates.sum(dim=-1)  # [..., R]
    kk = k[..., None].expand_as(rows)
    fewer = rows > count.detach()[..., None]  # rows that drop some candidates
    top = masked.topk(min(int(k.max()) + 1, scores.shape[-1]), dim=-1).values  # [..., R, kmax + 1]
    kth = top.gather(-1, (kk - 1).clamp(max=top.shape[-1] - 1)[..., None])[..., 0]
    after = top.gather(-1, kk.clamp(max=top.shape[-1] - 1)[..., None])[..., 0]
    with torch.no_grad():
        tau = torch.where(fewer, (kth + after) / 2, 0.0)
        target = count.detach()[..., None]
        for _ in range(newton):
            sig = torch.sigmoid((masked - tau[..., None]) / temperature)
            slope = (sig * (1 - sig)).sum(dim=-1).clamp(min=1e-12) / temperature
            step = ((sig.sum(dim=-1) - target) / slope).clamp(-4 * temperature, 4 * temperature)  # damped
            tau = torch.where(fewer, tau + step, tau)
        sig = torch.sigmoid((masked - tau[..., None]) / temperature)
        weight = sig * (1 - sig) * candidates
        total = weight.sum(dim=-1, keepdim=True).clamp(min=1e-12)
        weight = weight / total
    # Implicit differentiation through the threshold: tau moves with the scores and the count.
    live = torch.where(candidates, scores - scores.detach(), 0.0)
    tau = tau + (weight * live).sum(dim=-1) - temperature * (count - count.detach())[..., None] / total[..., 0]
    mask = torch.sigmoid((masked - tau[..., None]) / temperature) * candidates
    return torch.where(fewer[..., None], mask, candidates.to(scores.dtype))


def hard_topk(scores: torch.Tensor, candidates: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The hard keep-mask: the top floor(count) candidates of each row (all when fewer), as float."""
    k = count.floor().long()
    masked = scores.masked_fill(~candidates, float("-inf"))
    rank = masked.argsort(dim=-1, descending=True).argsort(dim=-1)
    return ((rank < k[..., None, None]) & candidates).to(scores.dtype)


def capacities(budget_logits: torch.Tensor, budget: int) -> torch.Tensor:
    """LKV-H's capacities `[L, Hkv]` before `head_budgets`' floors: differentiable in the logits."""
    shares = torch.softmax(budget_logits.flatten(), dim=0).view_as(budget_logits)
    largest = shares.amax(dim=1, keepdim=True)
    layer = budget_logits.shape[0] * budget * largest / largest.sum()
    return (layer * shares / largest).clamp(min=2)


class SoftEviction:
    """The student's attention: every layer's attention under LKV's keep-mask (see the module docstring).

    `params`: LKV's tensors (`baselines.lkv.PARAMETERS`), leaves that train; `prompt_len` and `budget`
    are set per batch; `hard`: the hard mask with `head_budgets`' integer capacities (evaluation).
    """

    def __init__(self, params: dict[str, torch.Tensor]):
        self.params, self.prompt_len, self.budget = params, 0, 0
        self.temperature, self.newton, self.hard = 1.0, 3, False

    def counts(self) -> torch.Tensor:
        """`[L, Hkv]` tokens each head keeps besides the newest: its capacity - 1."""
        if self.hard:
            _, heads = head_budgets(self.params["budget_logits"].detach(), self.budget)
            return torch.tensor(heads, dtype=torch.float32) - 1
        return capacities(self.params["budget_logits"], self.budget) - 1

    def attention(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        """query `[B, Hq, T, D]`, key, value `[B, Hkv, T, D]` (after RoPE) -> `[B, T, Hq, D]`, None."""
        layer = module.layer_idx
        batch, kv_heads, length, head_dim = key.shape
        positions = torch.arange(length).expand(batch, kv_heads, length)
        scores = token_scores(slot_features(key, value, positions),
                              *(self.params[name][layer] for name in PARAMETERS[1:]))  # [B, Hkv, T]
        rows = torch.arange(length)
        before = rows[None, :] < rows[:, None]  # key j strictly before query i
        decode = rows >= self.prompt_len  # rows the engine computes at decode steps
        candidates = (before & decode[:, None]).expand(batch, kv_heads, length, length)
        count = self.counts()[layer].expand(batch, kv_heads)
        grid = scores[:, :, None, :].expand(batch, kv_heads, length, length)
        if self.hard:
            keep = hard_topk(grid, candidates, count)
        else:
            keep = soft_topk(grid, candidates, count, self.temperature, self.newton)
        causal = rows[None, :] <= rows[:, None]
        full = causal & ~decode[:, None] | torch.eye(length, dtype=torch.bool)  # prompt rows; the newest key
        keep = torch.where(full, 1.0, keep)
        bias = torch.where(causal, keep.clamp(min=1e-30).log(), float("-inf"))  # [B, Hkv, T, T]
        group = query.shape[1] // kv_heads
        q = query.view(batch, kv_heads, group, length, head_dim)
        logits = torch.einsum("bhgtd,bhsd->bhgts", q, key) * scaling + bias[:, :, None]
        out = torch.einsum("bhgts,bhsd->bhgtd", torch.softmax(logits, dim=-1), value)
        return out.reshape(batch, kv_heads * group, length, head_dim).transpose(1, 2).contiguous(), None


def output_log_probs(model, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """`[B, output, V]` log-probabilities of the next token at the output positions."""
    logits = model(input_ids=tokens[:, :-1]).logits[:, prompt_len - 1:].float()
    return F.log_softmax(logits, dim=-1)


def temperature_at(config: LKVTrainConfig, step: int) -> float:
    progress = step / max(1, config.steps - 1)
    return config.temperature_start * (config.temperature_end / config.temperature_start) ** progress


def initial_parameters(config: LKVTrainConfig, model, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The prior (`baselines.lkv.prior_parameters`) with a small random first MLP layer, as trainable leaves."""
    spec = model.config
    params = prior_parameters(spec.num_hidden_layers, spec.num_key_value_heads, spec.head_dim, config.hidden)
    params["w_in"] = torch.randn(params["w_in"].shape, generator=generator) * config.init_scale
    return {name: tensor.requires_grad_() for name, tensor in params.items()}


def fit(config: LKVTrainConfig, model, student: SoftEviction, families: dict[str, FamilyBatches],
        checkpoint) -> dict:
    """The training loop; returns what the log keeps of it. `checkpoint(run)` every `checkpoint_every` steps."""
    optimizer = torch.optim.Adam(list(student.params.values()), lr=config.lr)
    generator = torch.Generator().manual_seed(config.seed)
    draws = torch.Generator().manual_seed(config.seed + 1)
    choices = torch.Generator().manual_seed(config.seed + 3)
    excluded = dict.fromkeys(config.families, 0)
    run, start = {"curve": [], "steps": 0, "heldout_rows_excluded": excluded}, time.perf_counter()
    for step in range(config.steps):
        name = config.families[int(torch.randint(len(config.families), (1,), generator=choices))]
        family = families[name]
        # The task's law of step counts (log-uniform, `CanaryTask.program`), one count per batch.
        low, high = math.log(MIN_STEPS), math.log(MAX_STEPS + 1)
        steps = min(MAX_STEPS, int(math.exp(low + (high - low) * torch.rand(1, generator=draws).item())))
        budget = config.budgets[int(torch.randint(len(config.budgets), (1,), generator=draws))]
        prompt_len = prompt_length(family)
        length = prompt_len + LINE_TOKENS * steps + 9
        params = family.draw(generator, max(1, config.tokens_per_step // length), steps)
        keep = ~heldout_mask(params, family.heldout)
        excluded[name] += int((~keep).sum())
        tokens = family.tokens(params)
        model.set_attn_implementation("sdpa")
        with torch.no_grad():
            teacher = output_log_probs(model, tokens, prompt_len)
        model.set_attn_implementation(ATTENTION)
        student.prompt_len, student.budget = prompt_len, budget
        student.temperature = temperature_at(config, step)
        log_probs = output_log_probs(model, tokens, prompt_len)
        kl = (teacher.exp() * (teacher - log_probs)).sum(dim=-1).mean(dim=-1)  # [B]
        loss = (kl * keep).sum() / keep.sum().clamp(min=1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        point = {"step": step + 1, "seconds": round(time.perf_counter() - start, 1),
                 **({"family": name} if len(config.families) > 1 else {}), "program_steps": steps,
                 "rows": len(params), "budget": budget, "temperature": round(student.temperature, 4),
                 "kl": round(loss.item(), 5)}
        run["curve"].append(point)
        run.update(steps=step + 1, train_seconds=point["seconds"])
        print(json.dumps(point), flush=True)
        if (step + 1) % config.checkpoint_every == 0 or step + 1 == config.steps:
            checkpoint(run)
    return run


def train(config: LKVTrainConfig, out: Path) -> dict:
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    spec = model_spec(config.model)
    folder = checkpoint_location(spec.hub_id)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    families = {name: family for name, family in suite_batches(tokenizer, torch.device("cpu")).items()
                if name in config.families}
    # bf16-stored weights in float32 arithmetic: the harness on a CPU.
    model = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.requires_grad_(False)
    student = SoftEviction(initial_parameters(config, model, torch.Generator().manual_seed(config.seed + 2)))
    student.newton = config.newton
    AttentionInterface.register(ATTENTION, student.attention)
    out.mkdir(parents=True, exist_ok=True)
    log = {"config": asdict(config),
           "model": {"name": spec.name, "hub_id": spec.hub_id, "checkpoint": checkpoint_fingerprint(spec.hub_id)},
           "environment": {**environment(torch.device("cpu")), "threads": config.threads}}

    def checkpoint(run: dict) -> None:
        params = {name: tensor.detach().contiguous() for name, tensor in student.params.items()}
        # The model it was made for, which a run checks against its own (`longflow.calibration.made_for`).
        save_file(params, str(out / "lkv.safetensors"), metadata=made_for_record(log["model"]))
        shares = torch.softmax(params["budget_logits"].flatten(), dim=0).view_as(params["budget_logits"])
        log.update({"parameters": sum(tensor.numel() for tensor in params.values()),
                    **{key: value for key, value in run.items() if key != "curve"},
                    "head_shares": [[round(float(p), 4) for p in row] for row in shares]})
        log["curve"] = run["curve"]  # last: the long part of the file
        (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")

    run = fit(config, model, student, families, checkpoint)
    model.set_attn_implementation(ATTENTION)
    student.hard = True
    logits = student.params["budget_logits"].detach()
    run["budgets"] = {}
    for budget in config.eval_budgets:
        slots, heads = head_budgets(logits, budget)
        run["budgets"][str(budget)] = {"layer_slots": slots, "head_capacities": heads}
    run["heldout_teacher_forced"] = {}
    for name, family in families.items():
        student.prompt_len, scores = prompt_length(family), {}
        for budget in config.eval_budgets:
            student.budget, began = budget, time.perf_counter()
            scores[str(budget)] = {**teacher_forced(model, family, family.heldout[:config.eval_items],
                                                    rows=config.eval_rows),
                                   "seconds": round(time.perf_counter() - began, 1)}
            print(f"{name} held-out, teacher-forced, hard mask, budget {budget}: {json.dumps(scores[str(budget)])}",
                  flush=True)
        run["heldout_teacher_forced"][name] = scores
        checkpoint(run)
    return log


def made_for_record(model: dict) -> dict[str, str]:
    """The safetensors metadata naming the model a file was trained for (`longflow.calibration.MADE_FOR`)."""
    record = {"model": model["name"], "hub_id": model["hub_id"], "checkpoint": model["checkpoint"]}
    return {key: value for key, value in record.items() if value is not None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals.canary.train_lkv", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for lkv.safetensors and train_log.json")
    for name, value in asdict(LKVTrainConfig()).items():
        if name == "families":
            kind, description = (lambda text: text.split(",")), "comma-separated"
        else:
            kind, description = (json.loads, "a JSON list") if isinstance(value, list) else (type(value), None)
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=value, help=description)
    args = vars(parser.parse_args(argv))
    out = args.pop("out")
    try:
        log = train(LKVTrainConfig(**args), out)
    except UserError as error:
        return report(error)
    heldout = {name: {budget: entry["accuracy"] for budget, entry in scores.items()}
               for name, scores in log["heldout_teacher_forced"].items()}
    print(json.dumps({"train_seconds": log["train_seconds"], "head_shares": log["head_shares"], "heldout": heldout}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
