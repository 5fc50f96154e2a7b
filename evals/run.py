"""The entry point: `python -m evals.run [overrides]` evaluates a model x method x budget on datasets.

    python -m evals.run                                   # the embedded default (tiny model, demo set)
    python -m evals.run model=r1_distill_llama_8b method=longflow budget=2400 dataset=all
    python -m evals.run -m method=vanilla,h2o,longflow budget=1024,2048 dataset=gsm8k limit=64

One run directory per dataset under `results_dir` (see `evals.store`): generations.jsonl,
batches.jsonl, metrics.json, config.yaml, run.json, provenance.json. Starting the same config again
resumes: only the missing items are generated.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from longflow.errors import UserError

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
GROUPS = ("model", "method", "dataset", "generation", "experiment")


@dataclass(frozen=True)
class Job:
    """One dataset's work within a run config: the items and how to render and grade them."""

    name: str
    kind: str
    items: list  # list[evals.datasets.Item], limited
    size: int  # the whole dataset's item count
    fingerprint: str  # content hash of the whole dataset


def row_seed(seed: int, dataset: str, item_id: str, sample: int) -> int:
    """A per-row sampling seed that depends only on the item and sample (not on batching)."""
    from evals.store import stable_hash

    return int(stable_hash([seed, dataset, item_id, sample], length=15), 16)


def load_jobs(dataset_cfg: dict[str, Any], limit: int | None) -> list[Job]:
    from evals.datasets import fingerprint, load, registry_spec

    overrides = dataset_cfg.get("overrides") or {}
    unknown = set(overrides) - set(dataset_cfg["names"])
    if unknown:
        raise UserError(f"dataset.overrides names {sorted(unknown)}, which are not in dataset.names")
    jobs = []
    for name in dataset_cfg["names"]:
        settings = {"shuffle_choices": dataset_cfg["shuffle_choices"], "seed": dataset_cfg["seed"]}
        if dataset_cfg.get("root"):
            settings["root"] = str(Path(dataset_cfg["root"]).expanduser())
        spec = registry_spec(name, **{**settings, **overrides.get(name, {})})
        items = load(spec)
        jobs.append(Job(name=name, kind=spec.kind, items=items[:limit] if limit else items, size=len(items),
                        fingerprint=fingerprint(items)))
    return jobs


def evaluate(
    cfg: dict[str, Any], config_yaml: str | None = None, on_batch: Callable[[], None] | None = None
) -> list[dict[str, Any]]:
    """Runs (or resumes) every dataset of a resolved plain-dict config; returns their metrics.

    `config_yaml` is stored in each run directory; `on_batch` is called after every stored batch
    (tests use it to simulate a crash).
    """
    import torch
    from tqdm import tqdm

    from evals.grading import GradeRequest, grade_many
    from evals.metrics import summarize
    from evals.prompts import build_messages, render_prompt
    from evals.store import CONFIG, METRICS, PROVENANCE, RunDir, provenance, stable_hash
    from longflow.config import EngineConfig, GenerationConfig
    from longflow.engine import Engine
    from longflow.methods import build_policy, policy_class
    from longflow.models import ModelSpec, eos_token_ids, load_model, resolve_device

    method_cfg = dict(cfg["method"])
    method = method_cfg.pop("name")
    policy_class(method)  # unknown method: fail before anything is loaded
    budget = None if method == "vanilla" else cfg["budget"]
    if method != "vanilla" and (not isinstance(budget, int) or budget <= 0):
        raise UserError(f"budget must be a positive integer number of KV slots, got {cfg['budget']!r}")
    build_policy(method, budget, **method_cfg)  # bad method parameters: fail early too
    generation_cfg = dict(cfg["generation"])
    generation_name, protocol = generation_cfg.pop("name"), generation_cfg.pop("protocol")
    generation = GenerationConfig(**generation_cfg)
    engine_config = EngineConfig(**cfg["engine"])
    model_cfg = dict(cfg["model"])
    spec = ModelSpec(**model_cfg)
    limit = cfg.get("limit")
    if limit is not None and (not isinstance(limit, int) or limit <= 0):
        raise UserError(f"limit must be a positive integer or null, got {limit!r}")

    device = resolve_device(cfg["device"])
    if cfg.get("require_gpu") and device.type != "cuda":
        raise UserError(
            f"this experiment needs a CUDA GPU (none visible here) and hub access to {spec.hub_id}; "
            "run it on a GPU machine with the model downloadable or cached"
        )
    jobs = load_jobs(cfg["dataset"], limit)
    model, tokenizer = load_model(spec, device)
    engine = Engine(model, lambda: build_policy(method, budget, **method_cfg), eos_token_ids(model, tokenizer),
                    tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
                    engine_config)
    max_positions = model.config.get_text_config().max_position_embeddings
    engine.warm_up()

    all_metrics = []
    for job in jobs:
        prompts = {}
        for item in job.items:
            ids = render_prompt(tokenizer, build_messages(item, job.kind, protocol), thinking=spec.thinks)
            if generation.max_prompt_tokens is not None:
                # Keep the end: it holds the question's tail and the generation prompt.
                ids = ids[-generation.max_prompt_tokens:]
            prompts[item.id] = ids
        identity = {
            "model": spec.name, "hub_id": spec.hub_id, "revision": spec.revision, "weights": spec.weights,
            "architecture": spec.architecture if spec.weights == "random" else None,
            "init_seed": spec.init_seed if spec.weights == "random" else None, "dtype": spec.dtype,
            "method": method, "variant": method_cfg.get("variant", "paper"), "method_params": method_cfg,
            "thinks": spec.thinks, "budget": budget, "generation": generation_name, "protocol": protocol,
            "generation_params": generation_cfg, "dataset": job.name, "kind": job.kind, "dataset_size": job.size,
            "dataset_fingerprint": job.fingerprint,
            # The prompt format, not the rendered prompts: `limit` only selects which items are done.
            "template": stable_hash([getattr(tokenizer, "chat_template", None), protocol, spec.thinks]),
        }
        with RunDir(Path(cfg["results_dir"]), identity) as run:
            identity = {**identity, "run_id": run.path.name}
            sessions = run.read_json(PROVENANCE, default=[])
            run.write_json(PROVENANCE, [*sessions, provenance({"generation": generation.seed,
                                                              "dataset": cfg["dataset"]["seed"],
                                                              "init": spec.init_seed})])
            if config_yaml is not None:
                run.write_text(CONFIG, config_yaml)
            records = run.generations()
            done = {(r["id"], r["sample"]) for r in records}
            work = [(item, sample) for item in job.items for sample in range(generation.n_samples)
                    if (item.id, sample) not in done]
            work.sort(key=lambda unit: -len(prompts[unit[0].id]))  # similar lengths batch together
            progress = tqdm(total=len(work), desc=f"{method}/{job.name}", unit="sample", dynamic_ncols=True)
            too_long = [u for u in work if len(prompts[u[0].id]) + generation.max_new_tokens > max_positions]
            if too_long:
                run.append([failure_record(item, sample, job, prompts, "prompt_too_long")
                            for item, sample in too_long])
                progress.update(len(too_long))
            work = [u for u in work if u not in too_long]
            for start in range(0, len(work), engine_config.batch_size):
                units = work[start:start + engine_config.batch_size]
                result = engine.generate(
                    [prompts[item.id] for item, _ in units], generation,
                    [row_seed(generation.seed, job.name, item.id, sample) for item, sample in units],
                )
                texts = [decode(tokenizer, tokens, engine.eos_ids.tolist()) for tokens in result.tokens]
                grades = grade_many(
                    [GradeRequest(kind=job.kind, output=text, gold=item.gold, finish_reason=reason,
                                  thinks=spec.thinks)
                     for (item, _), text, reason in zip(units, texts, result.finish_reasons, strict=True)],
                    workers=cfg["grading"]["workers"], timeout=cfg["grading"]["timeout"],
                )
                seconds = batch_seconds(result)
                run.append(
                    [
                        {
                            "id": item.id, "dataset": job.name, "sample": sample,
                            "prompt_tokens": result.prompt_tokens[row], "output": texts[row],
                            "output_tokens": len(result.tokens[row]), "finish_reason": result.finish_reasons[row],
                            "extracted": grades[row].extracted, "gold": item.gold, "correct": grades[row].correct,
                            "reason": grades[row].reason, "seconds": seconds[row],
                            "peak_slots": result.peak_slots[row],
                        }
                        for row, (item, sample) in enumerate(units)
                    ],
                    {
                        "size": len(units), "prefill_seconds": result.prefill_seconds,
                        "step_seconds": [round(s, 7) for s in result.step_seconds],
                        "generated_tokens": sum(len(t) for t in result.tokens),
                        "peak_memory_bytes": result.peak_memory_bytes, "cuda_graph": result.cuda_graph,
                        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    },
                )
                run.write_json(METRICS, summarize(identity, run.generations(), run.batches()))
                progress.update(len(units))
                if on_batch is not None:
                    on_batch()
            progress.close()
            metrics = summarize(identity, run.generations(), run.batches())
            run.write_json(METRICS, metrics)
            all_metrics.append(metrics)
            print(f"{run.path}: accuracy {fmt(metrics['accuracy'])} over {metrics['n_items']} items, "
                  f"{fmt(metrics['tokens_per_second'])} tok/s, peak KV slots {metrics['peak_kv_slots']}")
    return all_metrics


def decode(tokenizer, tokens: list[int], eos_ids: list[int]) -> str:
    """Output text without the closing EOS and special tokens ("</think>" is not special: it stays)."""
    if tokens and tokens[-1] in eos_ids:
        tokens = tokens[:-1]
    return tokenizer.decode(tokens, skip_special_tokens=True)


def batch_seconds(result) -> list[float]:
    """Each row's generation time: the batch's prefill plus the decode steps until it finished."""
    cumulative, total = [], 0.0
    for step in result.step_seconds:
        total += step
        cumulative.append(total)
    return [result.prefill_seconds + (cumulative[len(t) - 2] if len(t) >= 2 and cumulative else 0.0)
            for t in result.tokens]


def failure_record(item, sample: int, job: Job, prompts: dict, reason: str) -> dict:
    return {"id": item.id, "dataset": job.name, "sample": sample, "prompt_tokens": len(prompts[item.id]),
            "output": "", "output_tokens": 0, "finish_reason": "none", "extracted": None, "gold": item.gold,
            "correct": False, "reason": reason, "seconds": 0.0, "peak_slots": None}


def fmt(value) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def check_choices(argv: list[str]) -> None:
    """Unknown config-group options fail here with one line naming the valid ones.

    Hydra would report them with its own multi-line error and exit code 1; users get exit code 2
    and the list of choices instead.
    """
    for argument in argv:
        key, _, value = argument.lstrip("+~").partition("=")
        if key not in GROUPS or not value or value == "null":
            continue
        options = sorted(p.stem for p in (CONF_DIR / key).glob("*.yaml"))
        for choice in value.split(","):
            if choice not in options:
                raise UserError(f"unknown {key} {choice!r}; choose one of: {', '.join(options)}")


def _hydra_main() -> None:
    import hydra
    from omegaconf import OmegaConf

    @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
    def main(config) -> None:
        try:
            evaluate(OmegaConf.to_container(config, resolve=True), OmegaConf.to_yaml(config, resolve=True))
        except UserError as error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(2)

    main()


if __name__ == "__main__":
    try:
        check_choices(sys.argv[1:])
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    _hydra_main()
