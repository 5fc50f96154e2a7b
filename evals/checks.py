"""A run config's own fields checked before torch is imported (a typo answers in a second, not after
the imports): its keys against those of `conf/config.yaml` with a did-you-mean, the scalar fields,
a model folder that does not exist, and the generation and engine configs (`longflow.config`,
torch-free). The method, the model and the
device are checked by `evals.pipeline.Setup`, which builds them."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from evals.configs import CONF_DIR, compose_config, default_config, group_options
from evals.shards import Shard
from longflow.config import EngineConfig, GenerationConfig, VerifyConfig, from_mapping
from longflow.errors import UserError

# Keys of the generation group that name it rather than configure `GenerationConfig`.
GENERATION_LABELS = ("name", "protocol")


def did_you_mean(word: str, choices: Iterable[Any]) -> str:
    """`" (did you mean X?)"` for the choice nearest `word` (difflib), or "" when none is near."""
    near = difflib.get_close_matches(word, [str(choice) for choice in choices], n=1)
    return f" (did you mean {near[0]}?)" if near else ""


def check_keys(section: Any, allowed: Iterable[str], name: str) -> None:
    """`section` is a mapping whose keys are among `allowed`, or a UserError naming the first unknown
    key, the nearest known one and the known ones."""
    if not isinstance(section, dict):
        raise UserError(f"{name} must be a mapping, got {section!r}")
    allowed = sorted(allowed)
    unknown = sorted(set(section) - set(allowed))
    if unknown:
        where = unknown[0] if name == "the config" else f"{name}.{unknown[0]}"
        raise UserError(f"unknown key {where}{did_you_mean(unknown[0], allowed)}; {name} takes: {', '.join(allowed)}")


def positive_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value > 0


def check_fields(cfg: dict[str, Any]) -> None:
    """Every field of a composed run config that needs no model, method class or torch, or a
    UserError naming the first bad one. The keys a config takes are the default config's."""
    schema = default_config()
    check_keys(cfg, schema, "the config")
    for section in ("dataset", "grading"):
        check_keys(cfg[section], schema[section], section)
    for key in schema["grading"]:
        if not positive_int(cfg["grading"][key]):
            # The grader's hard time limit is whole seconds (signal.alarm).
            raise UserError(f"grading.{key} must be a positive integer, got {cfg['grading'][key]!r}")
    if not positive_int(cfg["budget"]):
        raise UserError(f"budget must be a positive integer number of KV slots, got {cfg['budget']!r}")
    limit = cfg.get("limit")
    if limit is not None and not positive_int(limit):
        raise UserError(f"limit must be a positive integer or null, got {limit!r}")
    if not isinstance(cfg["require_gpu"], bool):
        raise UserError(f"require_gpu must be true or false, got {cfg['require_gpu']!r}")
    for key in ("fidelity", "overwrite", "allow_code_change", "allow_other_model_files"):
        if not isinstance(cfg[key], bool):
            raise UserError(f"{key} must be true or false, got {cfg[key]!r}")
    check_model_folder(cfg["model"])
    if not isinstance(cfg["results_dir"], str) or not cfg["results_dir"]:
        raise UserError(f"results_dir must be a folder path, got {cfg['results_dir']!r}")
    if Shard.parse(cfg.get("shard")) is not None and cfg["overwrite"]:
        raise UserError("overwrite=true with shard= would delete the other shards' samples; overwrite the run "
                        "once without shard=, or resume it with allow_code_change=true")
    generation = {key: value for key, value in cfg["generation"].items() if key not in GENERATION_LABELS}
    generation = from_mapping(GenerationConfig, generation, "generation")
    from_mapping(EngineConfig, cfg["engine"], "engine")
    from_mapping(VerifyConfig, cfg.get("verify", {}), "verify").check_generation(generation)


def check_model_folder(model: dict[str, Any]) -> None:
    """A pretrained model's `hub_id` written as a path (absolute, from `.` or `~`, or with more than
    one `/`, which no hub id has) names a folder, from the working directory or else the project
    root (`longflow.models.checkpoint_location`): otherwise the hub would answer that it is no repo id."""
    hub_id = model.get("hub_id")
    if model.get("weights") == "random" or not isinstance(hub_id, str):
        return
    if not (hub_id.startswith(("/", ".", "~")) or hub_id.count("/") > 1 or "\\" in hub_id):
        return
    path = Path(hub_id).expanduser()
    if not (path.is_dir() or (not path.is_absolute() and (CONF_DIR.parent / path).is_dir())):
        raise UserError(f"model.hub_id={hub_id!r}: no such folder (a local checkpoint is a folder written by "
                        "save_pretrained; a hub id is <org>/<name>)")


def config_groups() -> list[str]:
    """The config groups a command line chooses from (`conf/<group>/`; Hydra's own aside)."""
    return sorted(path.name for path in CONF_DIR.iterdir() if path.is_dir() and path.name != "hydra")


def check_choices(overrides: Sequence[str]) -> None:
    """Every group option of `overrides` (`method=h2o,magic`) exists, or a UserError naming the nearest
    and the valid ones."""
    groups = config_groups()
    for argument in overrides:
        key, _, value = argument.lstrip("+~").partition("=")
        if key not in groups or not value or value == "null":
            continue
        options = group_options(key)
        for choice in value.split(","):
            if choice not in options:
                raise UserError(f"unknown {key} {choice!r}{did_you_mean(choice, options)}; "
                                f"choose one of: {', '.join(options)}")


def check_override_keys(job: Sequence[str]) -> None:
    """Each `key=value` of one job's overrides names a key of the config its group choices compose,
    or a UserError with the nearest key (Hydra would advise appending `+key`, which is wrong for a
    typo). Added (`+`), deleted (`~`) and Hydra's own keys are left to Hydra. Called once Hydra has
    refused the job's composition: it composes the choices alone."""
    groups = config_groups()
    choices = [argument for argument in job if argument.partition("=")[0].lstrip("+~") in groups]
    added = [argument.partition("=")[0].lstrip("+") for argument in job if argument.startswith("+")]
    base = None
    for argument in job:
        key = argument.partition("=")[0]
        if (key.startswith(("+", "~")) or key in groups or key.startswith(("hydra.", "hydra/"))
                or any(key == new or key.startswith(f"{new}.") for new in added)):
            continue
        base = base if base is not None else compose_config(choices)
        section, path = base, []
        for part in key.split("."):
            if not isinstance(section, dict) or part not in section:
                where = ".".join(path) or "the config"
                known = sorted(section) if isinstance(section, dict) else []
                takes = f"; {where} takes: {', '.join(known)}" if known else ""
                raise UserError(f"unknown key {'.'.join([*path, part])}{did_you_mean(part, known)}{takes}")
            section, path = section[part], [*path, part]
