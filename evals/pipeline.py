"""The evaluation pipeline behind `python -m evals.run` (`evals.run`: the command line): a resolved
config checked into a `Setup`, its datasets' jobs, and each dataset run generated in batches,
graded and stored, with the teacher-forced fidelity pass.

One run directory per dataset under `results_dir` (see `evals.store`): generations.jsonl,
batches.jsonl, metrics.json, config.yaml, run.json, provenance.json, and with `fidelity=true`
fidelity.jsonl (`run_fidelity`). Starting the same config again resumes: only the missing items are
generated. `shard=i/n` generates every n-th item of each dataset into the same run directory as the
other shards (`evals.shards`).
"""

from __future__ import annotations

import copy
import gc
import logging
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from baselines.vanilla import VanillaPolicy
from evals.checks import check_fields
from evals.datasets import fingerprint, load, registry_spec
from evals.fingerprint import (
    CodeChanged,
    check_code,
    checkpoint_fingerprint,
    code_record,
    grader_changes,
    grader_record,
    policy_file_fields,
)
from evals.gpus import job_device
from evals.grading import GradeRequest, grade_many
from evals.grading.regrade import grade_again, regrade_files
from evals.metrics import summarize
from evals.prompts import build_messages, render_prompt, truncate_prompt
from evals.reuse import reuse_option, split_work, with_mode
from evals.shards import Shard
from evals.store import CONFIG, GENERATIONS, GRADER, ITEMS, PROVENANCE, RunDir, in_scope, provenance, stable_hash
from longflow.calibration import made_for
from longflow.config import EngineConfig, GenerationConfig, VerifyConfig, from_mapping
from longflow.engine import Engine
from longflow.errors import UserError, out_of_memory
from longflow.fidelity import teacher_force
from longflow.methods import TARGET, build_policy, without_execution_fields
from longflow.models import (
    ModelSpec,
    check_device,
    check_fits_device,
    context_length,
    eos_token_ids,
    load_model,
)

logger = logging.getLogger(__name__)


class StaleRuns(UserError):
    """The runs of a config refused for their code (`evals.fingerprint.CodeChanged`), once its other
    runs were done: `refused`, (dataset, its refusal) pairs; `metrics`, the other runs' metrics."""

    def __init__(self, refused: list[tuple[str, CodeChanged]], metrics: list[dict[str, Any]]):
        self.refused, self.metrics = refused, metrics
        more = f" (and {len(refused) - 1} more runs of this config)" if len(refused) > 1 else ""
        super().__init__(f"{refused[0][1]}{more}")


class Interrupted(Exception):
    """Ctrl-C during a dataset run: what was saved, and where."""

    def __init__(self, run: Path, saved: int):
        super().__init__(f"interrupted; {saved} samples saved in {run}; run the same command to resume")


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
    return int(stable_hash([seed, dataset, item_id, sample], length=15), 16)


def load_jobs(dataset_cfg: dict[str, Any], limit: int | None) -> list[Job]:
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


@dataclass(frozen=True)
class Setup:
    """A resolved run config, checked before anything heavy is loaded."""

    method: str
    method_params: dict  # the method config's fields (its class, `_target_`, `name` and execution fields aside)
    policy: Any  # longflow.policy.KVPolicy, built and checked once; each batch gets a copy
    budget: int | None
    generation_name: str
    protocol: str
    generation_params: dict
    generation: Any  # longflow.config.GenerationConfig
    engine: Any  # longflow.config.EngineConfig
    model: Any  # longflow.models.ModelSpec
    limit: int | None
    grading: dict
    shard: Any  # evals.shards.Shard | None
    fidelity: bool = False
    overwrite: bool = False  # start every run of the config again, its stored records deleted
    allow_code_change: bool = False  # resume a run made by other code (`evals.fingerprint`)
    allow_other_model_files: bool = False  # a method file made for another checkpoint (`check_method_files`)
    reuse_full_cache: str = "off"  # evals.reuse.MODES
    verify: Any = None  # longflow.config.VerifyConfig

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Setup:
        """Every value of the config checked, or a UserError naming the first bad one."""
        check_fields(cfg)
        check_device(cfg["device"])
        method_config = dict(cfg["method"])
        method = method_config["name"]
        # The method checks its fields and the budget, and drops a budget it does not take.
        policy = build_policy(method_config, cfg["budget"])
        if not getattr(type(policy), "has_variants", True):
            # Both variant names make the same run, so that the paper and lf_repo sweeps of Table 1 share it.
            method_config["variant"] = "paper"
        # The class path is code, not a setting: like the rest of the code it is not in a run's identity;
        # nor are the fields that pick an implementation of the same method (the decode kernel).
        method_params = {key: value for key, value in without_execution_fields(method_config).items()
                         if key not in ("name", TARGET)}
        generation_params = dict(cfg["generation"])
        generation_name, protocol = generation_params.pop("name"), generation_params.pop("protocol")
        limit = cfg.get("limit")
        generation = from_mapping(GenerationConfig, generation_params, "generation")
        verify = from_mapping(VerifyConfig, cfg.get("verify", {}), "verify")  # checked by check_fields
        return cls(
            method=method, method_params=method_params, policy=policy, budget=policy.budget,
            generation_name=generation_name,
            protocol=protocol, generation_params=generation_params,
            generation=generation, engine=from_mapping(EngineConfig, cfg["engine"], "engine"),
            model=from_mapping(ModelSpec, cfg["model"], "model"), limit=limit, grading=dict(cfg["grading"]),
            shard=Shard.parse(cfg.get("shard")),
            fidelity=fidelity_option(cfg.get("fidelity", False), generation_name, generation),
            overwrite=cfg["overwrite"], allow_code_change=cfg["allow_code_change"],
            allow_other_model_files=cfg.get("allow_other_model_files", False),
            reuse_full_cache=reuse_option(cfg.get("reuse_full_cache", "off"), generation_name, generation,
                                          type(policy).uses_budget),
            verify=verify,
        )

    def identity(self, job: Job, tokenizer) -> dict[str, Any]:
        """Everything that changes a dataset run's outputs (see `evals.store`)."""
        spec, random = self.model, self.model.weights == "random"
        identity = {
            "model": spec.name, "hub_id": spec.hub_id, "revision": spec.revision, "weights": spec.weights,
            "architecture": spec.architecture if random else None, "init_seed": spec.init_seed if random else None,
            "dtype": spec.dtype, "thinks": spec.thinks,
            "method": self.method, "variant": self.method_params.get("variant", "paper"),
            "method_params": self.method_params, "budget": self.budget,
            "generation": self.generation_name, "protocol": self.protocol, "generation_params": self.generation_params,
            "dataset": job.name, "kind": job.kind, "dataset_size": job.size, "dataset_fingerprint": job.fingerprint,
            # The prompt format, not the rendered prompts: `limit` only selects which items are done.
            "template": stable_hash([getattr(tokenizer, "chat_template", None), self.protocol, spec.thinks]),
        }
        checkpoint = None if random else checkpoint_fingerprint(spec.hub_id)
        if checkpoint is not None:  # absent for hub ids: their revision names the weights
            identity["checkpoint"] = checkpoint
        if self.verify is not None and self.verify.enabled:
            # Only then, so that the identities of the runs made before verification existed stay theirs.
            # The horizon changes the acceptance figures (not the tokens); where the full cache lives
            # changes only the speed, like the engine's fields.
            identity["verify"] = {"name": self.verify.name, "horizon": self.verify.horizon}
        return with_mode(identity, self.reuse_full_cache)


def check_method_files(setup: Setup) -> None:
    """A file the method's config names (a calibration, learned weights) that records the model it
    was made for (`longflow.calibration.made_for`) must have been made for the run's model: the
    canary and the canary suite's model share a shape, so the canary's file loads without an error on
    the other and gives another method than the one meant. Random weights are nobody's checkpoint."""
    if setup.model.weights == "random" or setup.allow_other_model_files:
        return
    checkpoint = checkpoint_fingerprint(setup.model.hub_id)
    for field, path in policy_file_fields(setup.policy).items():
        recorded = made_for(path)
        if "checkpoint" in recorded and checkpoint is not None:
            other = recorded["checkpoint"] != checkpoint
        else:  # a hub model has no local checkpoint to hash: its id names it
            other = "hub_id" in recorded and recorded["hub_id"] != setup.model.hub_id
        if other:
            made = recorded.get("model") or recorded.get("hub_id")
            raise UserError(
                f"method.{field}={getattr(setup.policy, field)!r} was made for the model {made!r} "
                f"(checkpoint {recorded.get('checkpoint', recorded.get('hub_id'))}), not for this run's "
                f"{setup.model.name!r} ({checkpoint or setup.model.hub_id}): pass the file made for it "
                f"(method.{field}=...), or allow_other_model_files=true to use this one knowingly")


def check_results_dir(path: Path) -> None:
    """`results_dir` can be created and written to (checked before hours of generation, not after)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise UserError(f"results_dir {str(path)!r} is not a writable folder ({error.strerror})") from None


def check_context(setup: Setup) -> None:
    """`max_new_tokens` must leave room for a prompt in the model's positions, or every item would be
    recorded as prompt_too_long."""
    positions = context_length(setup.model)
    if positions is not None and setup.generation.max_new_tokens >= positions:
        raise UserError(f"generation.max_new_tokens={setup.generation.max_new_tokens} leaves no room for a prompt: "
                        f"model {setup.model.name} has {positions} positions")


def evaluate(cfg: dict[str, Any], config_yaml: str | None = None) -> list[dict[str, Any]]:
    """Runs (or resumes) every dataset of a resolved plain-dict config; returns their metrics.

    `config_yaml`, the resolved config, is stored in each run directory. A run made by other code is
    refused (`evals.fingerprint.check_code`) without stopping the others: StaleRuns once they are done.
    """
    check_device(cfg["device"])
    device = job_device(cfg["device"])  # first: it may narrow the visible GPUs, which only works before CUDA starts
    setup = Setup.from_config(cfg)
    if cfg.get("require_gpu") and device.type != "cuda":
        raise UserError(
            f"this experiment needs a CUDA GPU (none visible here) and hub access to {setup.model.hub_id}; "
            "run it on a GPU machine with the model downloadable or cached"
        )
    check_fits_device(setup.model, device, cfg["device"])
    jobs = load_jobs(cfg["dataset"], setup.limit)
    check_context(setup)
    check_method_files(setup)
    check_results_dir(Path(cfg["results_dir"]))
    model, tokenizer = load_model(setup.model, device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    engine = Engine(model, lambda: copy.deepcopy(setup.policy), eos_token_ids(model, tokenizer), pad_id,
                    setup.engine, setup.verify)
    seeds = {"generation": setup.generation.seed, "dataset": cfg["dataset"]["seed"], "init": setup.model.init_seed}
    code, grader = code_record(setup.policy), grader_record()
    metrics, refused = [], []
    for job in jobs:
        try:
            metrics.append(run_dataset(job, setup, engine, tokenizer, Path(cfg["results_dir"]), config_yaml, seeds,
                                       code, grader))
        except CodeChanged as error:  # that run's concern: the config's other runs are independent of it
            refused.append((job.name, error))
    if refused:
        raise StaleRuns(refused, metrics)
    return metrics


def check_budget_bounds(setup: Setup, job: Job, prompts: dict[str, list[int]]) -> None:
    """A warning when the budget holds the longest prompt and all its new tokens: the method never
    evicts, and its rows are a full cache's under the method's name."""
    if setup.budget is None or not prompts:
        return
    longest = max(len(ids) for ids in prompts.values())
    if setup.budget >= longest + setup.generation.max_new_tokens:
        logger.warning("budget %d >= the longest %s prompt (%d tokens) + max_new_tokens (%d): %s never evicts "
                       "here, its results are the full cache's", setup.budget, job.name, longest,
                       setup.generation.max_new_tokens, setup.method)


def run_dataset(job: Job, setup: Setup, engine, tokenizer, results_dir: Path, config_yaml: str | None,
                seeds: dict[str, int], code: dict[str, Any], grader: dict[str, Any]) -> dict[str, Any]:
    """Generates, grades and stores the missing samples of one dataset; returns its metrics. `code`
    (`evals.fingerprint.code_record`) must match the run's last start unless the setup allows a change;
    stored grades from another grader than `grader` (`evals.fingerprint.grader_record`) are made again."""
    generation = setup.generation
    prompts = {}
    for item in job.items:
        ids = render_prompt(tokenizer, build_messages(item, job.kind, setup.protocol), thinking=setup.model.thinks,
                            protocol=setup.protocol)
        prompts[item.id] = truncate_prompt(ids, generation.max_prompt_tokens, generation.truncation_side)
    check_budget_bounds(setup, job, prompts)
    identity = setup.identity(job, tokenizer)
    max_positions = engine.model.config.get_text_config().max_position_embeddings

    current = {item.id for item in job.items}  # every shard's: the metrics cover the whole run
    mine = setup.shard.select(job.items) if setup.shard else job.items

    def metrics_of(records: list[dict], batches: list[dict], fidelity: list[dict]) -> dict[str, Any]:
        return summarize(identity, in_scope(records, current), batches, in_scope(fidelity, current))

    with RunDir(results_dir, identity, setup.shard) as run:
        identity = {**identity, "run_id": run.path.name}
        if setup.overwrite:
            run.clear()
        else:
            check_code(run.path, run.read_json(PROVENANCE, default=[]), code, setup.allow_code_change)
        start = []  # this start's position in provenance.json, under the write lock (shards start at once)

        def add_start(entries: list[dict]) -> list[dict]:
            start.append(len(entries))
            return [*entries, provenance(seeds, engine.device, code)]

        def store(records: list[dict], batch: dict | None = None) -> dict[str, Any]:
            # Each record names the start that made it: what made a run's records is the code of those
            # starts, not of a later start that found nothing to do (evals.report.provenance).
            return run.commit([{**record, "start": start[0]} for record in records], batch, metrics_of)

        run.update_json(PROVENANCE, add_start, default=[])
        run.write_json(ITEMS, [item.id for item in job.items])
        if config_yaml is not None:
            run.write_text(CONFIG, config_yaml)
        grade_with(run, grader, setup.grading)
        done = {(r["id"], r["sample"]) for r in run.generations()}
        work = [(item, sample) for item in mine for sample in range(generation.n_samples)
                if (item.id, sample) not in done]
        work.sort(key=lambda unit: -len(prompts[unit[0].id]))  # similar lengths batch together
        name = f"{setup.method}/{job.name}" + (f" shard {setup.shard}" if setup.shard else "")
        planned = len(mine) * generation.n_samples
        if not work:
            print(f"complete: nothing to generate in {run.path}")
        elif len(work) < planned:
            print(f"resuming {run.path}: {planned - len(work)} of {planned} done, generating {len(work)}")
        progress = tqdm(total=len(work), desc=name, unit="sample", dynamic_ncols=True, disable=not work)
        too_long = [u for u in work if len(prompts[u[0].id]) + generation.max_new_tokens > max_positions]
        if too_long:
            store([failure_record(item, sample, job, len(prompts[item.id]), "prompt_too_long")
                   for item, sample in too_long])
            progress.update(len(too_long))
        work = [u for u in work if u not in too_long]
        work, reused = split_work(work, setup.reuse_full_cache, setup.policy, identity, results_dir, engine,
                                  generation, tokenizer, prompts)
        if reused:
            # Copies of the full cache's records, graded by whatever grader graded that run.
            grade_again(reused, job.kind, setup.model.thinks, setup.grading["workers"], setup.grading["timeout"])
            store(reused)
            progress.update(len(reused))
        try:
            for new_records, batch in generate_batches(work, job, setup, engine, tokenizer, prompts):
                store(new_records, batch)
                progress.update(len(new_records))
            progress.close()
            if setup.fidelity and not isinstance(setup.policy, VanillaPolicy):  # the reference: nothing to compare
                run_fidelity(run, job, setup, engine, prompts, mine)
        except KeyboardInterrupt:
            progress.close()
            raise Interrupted(run.path, len(run.generations())) from None  # what the file holds
        metrics = run.commit([], None, metrics_of)
    every = " (every shard's)" if setup.shard else ""
    accuracy = "n/a" if metrics["accuracy"] is None else f"{100 * metrics['accuracy']:.1f}%"  # as the tables write it
    print(f"{run.path}: accuracy {accuracy} over {metrics['n_items']} items{every}, "
          f"{fmt(metrics['tokens_per_second'])} tok/s, peak KV slots {metrics['peak_kv_slots']}")
    if "fidelity" in metrics:
        summary = metrics["fidelity"]
        print(f"{run.path}: teacher-forced agreement {fmt(summary['agreement'])}, KL {fmt(summary['kl'])} nats, "
              f"divergence step {summary['divergence_step']} over {summary['n_items']} items")
    return metrics


def grade_with(run: RunDir, grader: dict[str, Any], grading: dict[str, Any]) -> None:
    """Makes `grader` the one grader of the run's grades: stored outputs graded by another (its
    sources or packages changed, or the run predates grader records) are graded again, as
    `python -m evals.grading` does, so that a resumed run never mixes grades of two graders."""
    before = run.read_json(GRADER)
    if isinstance(before, dict) and before.get("fingerprint") == grader["fingerprint"]:
        return
    if not (run.path / GENERATIONS).exists():
        run.write_json(GRADER, grader)
        return
    print(f"re-grading {run.path}: its stored grades are from another grader ({grader_changes(before, grader)})")
    with run.writing():
        regrade_files(run.path, grading["workers"], grading["timeout"], grader)


def generate_batches(work, job: Job, setup: Setup, engine, tokenizer, prompts) -> Iterator[tuple[list[dict], dict]]:
    """(records, batch record) of the (item, sample) units of `work`, graded, in groups of at most
    `batch_size`: static engine batches, or, with `engine.continuous`, the units that continuous
    batching finished since the last group (in the order they finished).

    A batch or a serving pass that runs out of device memory goes on at half the size, and later
    ones keep the smaller size (`batch_size` in the batch record); nothing generated is lost: the
    units a pass had finished are kept, the ones it was decoding start again. Out of memory at size
    1 raises UserError.
    """
    batch_size, remaining = setup.engine.batch_size, list(work)
    produce = serve_units if setup.engine.continuous else batch_units
    if remaining:
        # At the size the first batch will have, and only when something is generated: a job of two
        # items, or one whose items all come from the full cache's run, compiles nothing for 64 rows.
        engine.warm_up(min(batch_size, len(remaining)))
    while remaining:
        done: set[int] = set()
        try:
            for group, outputs, batch in produce(remaining, batch_size, job, setup, engine, prompts):
                done.update(id(unit) for unit in group)
                records = graded_records(group, outputs, job, setup, engine, tokenizer, prompts)
                yield records, {**batch, "batch_size": batch_size}
        except Exception as error:
            if not out_of_memory(error):
                raise
            if batch_size == 1:
                item = remaining[0][0]
                raise UserError(
                    f"out of memory on {engine.device} generating one sequence (item {item.id} of {job.name}, "
                    f"{len(prompts[item.id])} prompt tokens + up to {setup.generation.max_new_tokens} new); lower "
                    "generation.max_new_tokens or use a device with more memory") from None
            failed = batch_size
        else:
            return
        # Outside the except block: the exception's frames (and the tensors they hold) are gone.
        remaining = [unit for unit in remaining if id(unit) not in done]
        batch_size = max(1, failed // 2)
        free_device_memory(engine.device)
        logger.warning("out of memory at batch size %d on %s; going on at %d", failed, engine.device, batch_size)


@dataclass(frozen=True)
class Outputs:
    """What the engine generated for a group of units, one entry per unit."""

    tokens: list[list[int]]
    finish_reasons: list[str]
    prompt_tokens: list[int]
    seconds: list[float]
    peak_slots: list[int]
    verify: list[dict | None]  # each unit's verification statistics (`Verifier.row_stats`), or None


def batch_units(work, batch_size: int, job: Job, setup: Setup, engine, prompts):
    """Static batches of `batch_size` units: (units, their outputs, the batch's timing record) each."""
    for start in range(0, len(work), batch_size):
        units = work[start:start + batch_size]
        result = engine.generate(
            [prompts[item.id] for item, _ in units], setup.generation,
            [row_seed(setup.generation.seed, job.name, item.id, sample) for item, sample in units],
        )
        outputs = Outputs(result.tokens, result.finish_reasons, result.prompt_tokens, batch_seconds(result),
                          result.peak_slots, result.verify or [None] * len(units))
        yield units, outputs, timing_record(engine, len(units), result.prefill_seconds, result.step_seconds,
                                            sum(len(t) for t in result.tokens), result.peak_memory_bytes,
                                            result.cuda_graph, continuous=False)


def serve_units(work, batch_size: int, job: Job, setup: Setup, engine, prompts):
    """Continuous batching over `work` on `batch_size` rows: the units finished since the last group,
    once there are `batch_size` of them (grading starts worker processes: not for every few rows),
    and the rest at the end; the timing record covers every prefill and step since the last group."""
    serving = Engine(engine.model, engine.policy_factory, engine.eos_ids.tolist(), engine.pad_id,
                     replace(setup.engine, batch_size=batch_size), engine.verify)
    pending, prefill, steps, memory, graph = [], 0.0, [], None, False
    rounds = serving.serve(
        [prompts[item.id] for item, _ in work], setup.generation,
        [row_seed(setup.generation.seed, job.name, item.id, sample) for item, sample in work],
    )
    try:
        for round_ in rounds:
            pending += round_.finished
            prefill += round_.prefill_seconds
            steps += round_.step_seconds
            memory, graph = round_.peak_memory_bytes, graph or round_.cuda_graph
            if len(pending) >= batch_size:
                yield group_of(work, pending, engine, prefill, steps, memory, graph)
                pending, prefill, steps = [], 0.0, []
    except KeyboardInterrupt:
        if pending:  # Ctrl-C loses only the sequences still decoding
            yield group_of(work, pending, engine, prefill, steps, memory, graph)
        raise
    if pending:
        yield group_of(work, pending, engine, prefill, steps, memory, graph)


def group_of(work, served: list, engine, prefill: float, steps: list[float], memory, graph: bool):
    """(units, outputs, timing record) of the sequences `served` (`longflow.engine.Served`)."""
    units = [work[item.index] for item in served]
    outputs = Outputs([item.tokens for item in served], [item.finish_reason for item in served],
                      [item.prompt_tokens for item in served], [item.seconds for item in served],
                      [item.peak_slots for item in served], [item.verify for item in served])
    return units, outputs, timing_record(engine, len(served), prefill, steps, sum(len(t) for t in outputs.tokens),
                                         memory, graph, continuous=True)


def timing_record(engine, size: int, prefill_seconds: float, step_seconds: list[float], generated: int,
                  peak_memory_bytes, cuda_graph: bool, continuous: bool) -> dict:
    device = engine.device
    return {
        "size": size, "prefill_seconds": prefill_seconds, "step_seconds": [round(s, 7) for s in step_seconds],
        "generated_tokens": generated, "peak_memory_bytes": peak_memory_bytes, "cuda_graph": cuda_graph,
        "continuous": continuous, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }


def graded_records(units, outputs: Outputs, job: Job, setup: Setup, engine, tokenizer, prompts) -> list[dict]:
    """The graded record of each unit from its outputs."""
    eos_ids = engine.eos_ids.tolist()
    texts = [decode(tokenizer, tokens, eos_ids) for tokens in outputs.tokens]
    grades = grade_many(
        [GradeRequest(kind=job.kind, output=text, gold=item.gold, finish_reason=reason, thinks=setup.model.thinks)
         for (item, _), text, reason in zip(units, texts, outputs.finish_reasons, strict=True)],
        workers=setup.grading["workers"], timeout=setup.grading["timeout"],
    ) if units else []
    return [
        {
            "id": item.id, "dataset": job.name, "sample": sample, "prompt_tokens": outputs.prompt_tokens[row],
            # The prompt as the model saw it (chat template, thinking switch, truncation), specials kept.
            "prompt": tokenizer.decode(prompts[item.id], skip_special_tokens=False),
            "output": texts[row], "output_tokens": len(outputs.tokens[row]),
            "finish_reason": outputs.finish_reasons[row], "extracted": grades[row].extracted, "gold": item.gold,
            "correct": grades[row].correct, "reason": grades[row].reason, "seconds": outputs.seconds[row],
            "peak_slots": outputs.peak_slots[row],
            **(outputs.verify[row] or {}),
        }
        for row, (item, sample) in enumerate(units)
    ]


def free_device_memory(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def fidelity_option(value, generation_name: str, generation) -> bool:
    """The `fidelity` field, checked: a boolean, and true only with greedy decoding."""
    if not isinstance(value, bool):
        raise UserError(f"fidelity must be true or false, got {value!r}")
    if value and not generation.greedy:
        raise UserError(f"fidelity=true needs greedy decoding (it follows the full cache's greedy tokens); "
                        f"generation {generation_name!r} samples at temperature {generation.temperature}")
    return value


def run_fidelity(run, job: Job, setup: Setup, engine, prompts: dict, items: list) -> None:
    """The teacher-forced pass (`longflow.fidelity`) of the method against the full cache, over the
    `items` (this shard's) that fidelity.jsonl lacks; appends their records batch by batch, so a
    killed pass resumes like generation. Items whose prompt and output cannot fit the model's
    positions have no record."""
    generation = setup.generation
    max_positions = engine.model.config.get_text_config().max_position_embeddings
    stored = {record["id"] for record in run.fidelity()}
    work = [item for item in items
            if item.id not in stored and len(prompts[item.id]) + generation.max_new_tokens <= max_positions]
    work.sort(key=lambda item: -len(prompts[item.id]))  # similar lengths batch together
    progress = tqdm(total=len(work), desc=f"{setup.method}/{job.name} fidelity", unit="item", dynamic_ncols=True,
                    disable=not work)
    for start in range(0, len(work), setup.engine.batch_size):
        batch_items = work[start:start + setup.engine.batch_size]
        result = teacher_force(engine, [prompts[item.id] for item in batch_items], generation, VanillaPolicy)
        new_records = [
            {
                "id": item.id, "dataset": job.name, "prompt_tokens": len(prompts[item.id]),
                "reference_tokens": len(result.tokens[row]), "reference_finish": result.finish_reasons[row],
                "agreement": [int(agrees) for agrees in result.agreement[row]],
                "kl": [float(f"{kl:.4g}") for kl in result.kl[row]],  # 4 significant digits: the file stays small
            }
            for row, item in enumerate(batch_items)
        ]
        run.append_fidelity(new_records)
        progress.update(len(batch_items))
    progress.close()


def decode(tokenizer, tokens: list[int], eos_ids: list[int]) -> str:
    """Output text without the closing EOS and special tokens ("</think>" is not special: it stays)."""
    if tokens and tokens[-1] in eos_ids:
        tokens = tokens[:-1]
    return tokenizer.decode(tokens, skip_special_tokens=True)


def batch_seconds(result) -> list[float]:
    """Each row's generation time: the batch's prefill plus the decode steps (with verification, the
    rounds) until it finished."""
    cumulative, total = [], 0.0
    for step in result.step_seconds:
        total += step
        cumulative.append(total)
    if result.verify is not None:
        done = [stats["verify_rounds"] for stats in result.verify]
    else:
        done = [len(t) - 1 for t in result.tokens]
    return [result.prefill_seconds + (cumulative[count - 1] if count >= 1 and cumulative else 0.0)
            for count in done]


def failure_record(item, sample: int, job: Job, prompt_tokens: int, reason: str) -> dict:
    """The record of a sample that never reached generation."""
    return {"id": item.id, "dataset": job.name, "sample": sample, "prompt_tokens": prompt_tokens,
            "output": "", "output_tokens": 0, "finish_reason": "none", "extracted": None, "gold": item.gold,
            "correct": False, "reason": reason, "seconds": 0.0, "peak_slots": None}


def fmt(value) -> str:
    return "n/a" if value is None else f"{value:.3g}"
