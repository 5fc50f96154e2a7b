"""Reusing the full cache's records (`reuse_full_cache`): items that a method cannot compress are
copied from the full cache's run of the same config instead of being generated again.

Greedy decoding gives the full cache's tokens for as long as the method's cache holds every token:
each step then attends to the same keys and values. Which sequences that holds for is the method's
own question (`longflow.policy.KVPolicy.compresses_within`, from its capacities, margins and
schedules; a method that cannot vouch for it is never reused), asked of the prompt and the length
of the full cache's output for that item. Modes:

- `off`: generate every item (ad-hoc runs' default);
- `exact`: copy an item's full-cache record when the method guarantees that it cannot compress
  within prompt + that output (`experiment=table1`'s);
- `lf_repo`: the LongFlow authors' rule, from their scripts: copy when the full-cache output is
  shorter than `LF_REPO_BELOW` tokens, whatever the method and the prompt. Not exact: a method
  whose budget is smaller than prompt + output compresses such an item, and its own answer could
  differ (tables mark these runs).

The full cache's run is found through the run store's identity (`evals.store`): the same identity
with the full cache as its method. A copied record is the full cache's, field for field (then
graded again by the run's own grader, `evals.pipeline`), marked `reused_from_full_cache` with the
source run's name; its `seconds` are None (a copy was not timed, and no batch record is written
for it, so speed and latency metrics come from generated records only), and its `peak_slots` are
the slots its sequence holds at its last step (exact) or None (lf_repo: the method never ran it).
Sampling cannot be reused (its tokens are not a function of the cache alone): the option is
refused.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from evals.configs import method_config
from evals.store import GENERATIONS, IDENTITY, peek_records, read_json_file, run_name
from longflow.errors import UserError
from longflow.methods import TARGET, without_execution_fields
from longflow.policy import ALIGN, CacheSpec, round_up

logger = logging.getLogger(__name__)

MODES = ("off", "exact", "lf_repo")
# The authors' threshold: their scripts regenerate the items whose full-cache answer has at least
# this many tokens and copy the rest.
LF_REPO_BELOW = 2048
MARK = "reused_from_full_cache"
# The identity key; absent when `off`, so that runs made before the option keep their names.
KEY = "reuse_full_cache"
FULL_CACHE = "vanilla"


def reuse_option(value: Any, generation_name: str, generation, uses_budget: bool) -> str:
    """The `reuse_full_cache` field, checked: one of MODES, and not `off` only with greedy decoding.
    The full cache itself (a method that uses no budget) has nothing to reuse: always `off`."""
    if value not in MODES:
        raise UserError(f"reuse_full_cache must be one of {MODES}, got {value!r}")
    if value != "off" and not generation.greedy:
        raise UserError(f"reuse_full_cache={value} needs greedy decoding (a copied record is the full cache's "
                        f"greedy output); generation {generation_name!r} samples at temperature "
                        f"{generation.temperature}")
    return value if uses_budget else "off"


def with_mode(identity: dict[str, Any], mode: str) -> dict[str, Any]:
    """A run's identity with its reuse mode (none when `off`)."""
    return identity if mode == "off" else {**identity, KEY: mode}


def full_cache_params() -> dict[str, Any]:
    """The full cache's method fields as its run records them (`evals.pipeline.Setup`): its config
    of `conf/method/`, class, name and execution fields aside, with its one variant."""
    config = without_execution_fields(method_config(FULL_CACHE))
    return {**{key: value for key, value in config.items() if key not in ("name", TARGET)}, "variant": "paper"}


def full_cache_identity(identity: dict[str, Any]) -> dict[str, Any]:
    """The identity of the full cache's run of the same model, dataset, prompt format and generation."""
    source = {key: value for key, value in identity.items() if key not in (KEY, "run_id")}
    return {**source, "method": FULL_CACHE, "variant": "paper", "method_params": full_cache_params(), "budget": None}


def find_full_cache_run(results_dir: Path, identity: dict[str, Any]) -> Path | None:
    """The run directory of `identity` (the full cache's) under `results_dir`, or None when it has none."""
    path = Path(results_dir) / run_name(identity)
    if not (path / IDENTITY).exists():
        return None
    if read_json_file(path / IDENTITY) != json.loads(json.dumps(identity, default=str)):
        return None
    return path


def row_spec(engine, prompt_tokens: int, generation) -> CacheSpec:
    """The shapes of one row of `prompt_tokens` alone in a batch, as the engine allocates it."""
    return CacheSpec(batch=1, layers=engine.num_layers, q_heads=engine.q_heads, kv_heads=engine.kv_heads,
                     head_dim=engine.head_dim, prompt_len=round_up(prompt_tokens, ALIGN),
                     max_new_tokens=generation.max_new_tokens, dtype=engine.dtype, device=engine.device,
                     rotary=engine.rotary, vocab=engine.vocab, scale=engine.scale)


def reusable(mode: str, policy, record: dict, spec: CacheSpec) -> bool:
    """Whether the full cache's `record` stands for the method's own under `mode`."""
    if record.get("finish_reason") == "none" or not record.get("output_tokens"):
        return False  # never generated (prompt too long): the method's run records that itself
    if mode == "lf_repo":
        return record["output_tokens"] < LF_REPO_BELOW
    prompt = record["prompt_tokens"]
    return not policy.compresses_within(prompt, prompt + record["output_tokens"], spec)


def copied(record: dict, source: str, mode: str) -> dict:
    """The full cache's record as the method's, marked with its source run."""
    held = record["prompt_tokens"] + record["output_tokens"] - 1  # the output's last token is never stored
    return {**record, "seconds": None, "peak_slots": held if mode == "exact" else None, MARK: source}


def split_work(work: list, mode: str, policy, identity: dict[str, Any], results_dir: Path, engine, generation,
               tokenizer, prompts: dict) -> tuple[list, list[dict]]:
    """(the units of `work` to generate, the records copied for the others) under `mode`.

    work: (item, sample) units; prompts: item id -> prompt token ids. A unit is copied only when
    the full cache's run holds its record for the same prompt tokens; a missing run is said once,
    and everything is generated."""
    if mode == "off" or not work:
        return work, []
    source_identity = full_cache_identity(identity)
    source = find_full_cache_run(results_dir, source_identity)
    if source is None:
        logger.warning("reuse_full_cache=%s: no full-cache run %s in %s (run method=%s first); generating every "
                       "item", mode, run_name(source_identity), results_dir, FULL_CACHE)
        return work, []
    records = {(record["id"], record["sample"]): record for record in peek_records(source / GENERATIONS)}
    generate, reused = [], []
    for item, sample in work:
        record = records.get((item.id, sample))
        same_prompt = (record is not None and record["prompt_tokens"] == len(prompts[item.id])
                       and record["prompt"] == tokenizer.decode(prompts[item.id], skip_special_tokens=False))
        if same_prompt and reusable(mode, policy, record, row_spec(engine, record["prompt_tokens"], generation)):
            reused.append(copied(record, source.name, mode))
        else:
            generate.append((item, sample))
    logger.info("reuse_full_cache=%s: %d of %d samples copied from %s, %d to generate", mode, len(reused),
                len(work), source.name, len(generate))
    return generate, reused
