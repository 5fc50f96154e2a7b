"""The settings that tell otherwise-equal runs apart, as labels.

A table row is a model, a KV budget and a method (with its variant, budget form and verifier), a
column an item set; but any field of a run config can be swept (`method.heavy_ratio=0.25`,
`model.hub_id=<another checkpoint>`, `generation.max_new_tokens=512`), and each value is a run of its
own (its identity, run.json, differs). Runs that would share a cell and differ in such a setting are
different experiments, not reruns of one: the model of another checkpoint is a model of its own
("canary (hub_id=/ckpt/b)", with its own FullKV), and another method or generation setting a row of
its own ("H2O (heavy_ratio=0.25)"), each labelled by every setting in which the runs differ.

A run's settings are its frame's `config.*` columns (`settings`): `config.model.<field>` (what names
the weights), `config.method.<parameter>`, `config.generation.<parameter>` (the prompt protocol
included), and `config.<key>` for the rest of its identity (the prompt template, the dataset's
content, verification, reuse of the full cache's records). Runs without run.json have none and are
never split.
"""

from __future__ import annotations

import json
from typing import Any

import pandas as pd

PREFIX = "config."
MODEL = "model"
# Identity keys that a run's model config sets: another value is another model.
MODEL_FIELDS = ("hub_id", "revision", "weights", "checkpoint", "architecture", "init_seed", "dtype", "thinks")
# Identity keys a table already shows as a row or column key (the method's variant and budget form are
# in its label), or that only restate one.
SHOWN = {"model", "method", "variant", "budget", "generation", "dataset", "dataset_size", "kind", "run_id"}
MISSING = "-"


def settings(identity: dict[str, Any] | None) -> dict[str, Any]:
    """A run's settings as flat `config.*` columns (`{"config.method.heavy_ratio": 0.25, ...}`), from
    its identity; {} without one. A list or dict value is written as JSON text."""
    if identity is None:
        return {}
    found = {f"{MODEL}.{key}": identity[key] for key in MODEL_FIELDS if key in identity}
    method = {key: value for key, value in (identity.get("method_params") or {}).items()
              if key not in ("variant", "budget_mode")}
    found.update({f"method.{key}": value for key, value in method.items()})
    found.update({f"generation.{key}": value for key, value in (identity.get("generation_params") or {}).items()})
    if "protocol" in identity:
        found["generation.protocol"] = identity["protocol"]
    rest = set(identity) - SHOWN - set(MODEL_FIELDS) - {"method_params", "generation_params", "protocol"}
    for key in sorted(rest):
        value = identity[key]
        if isinstance(value, dict):
            found.update({f"{key}.{inner}": item for inner, item in value.items()})
        else:
            found[key] = value
    return {PREFIX + key: json.dumps(value, sort_keys=True) if isinstance(value, list | dict) else value
            for key, value in found.items()}


def setting_columns(runs: pd.DataFrame, section: str | None = None) -> list[str]:
    """The frame's `config.*` columns, those of one section (`model`, `method`, ...) when given: the
    model's fields in `MODEL_FIELDS` order, then the method's, the generation's and the rest, each
    alphabetically."""
    start = PREFIX if section is None else f"{PREFIX}{section}."
    sections = [f"{PREFIX}{MODEL}.", f"{PREFIX}method.", f"{PREFIX}generation."]

    def order(column: str) -> tuple:
        section = next((i for i, prefix in enumerate(sections) if column.startswith(prefix)), len(sections))
        name = column.removeprefix(f"{PREFIX}{MODEL}.")
        return section, MODEL_FIELDS.index(name) if section == 0 and name in MODEL_FIELDS else 0, column

    return sorted((column for column in runs.columns if column.startswith(start)), key=order)


def as_text(value: Any) -> str:
    return MISSING if value is None or (isinstance(value, float) and pd.isna(value)) else str(value)


def known(runs: pd.DataFrame) -> pd.Series:
    """Whether each run has settings (a run.json)."""
    columns = setting_columns(runs)
    return runs[columns].notna().any(axis=1) if columns else pd.Series(False, index=runs.index)


def differing(runs: pd.DataFrame, columns: list[str], keys: list[str]) -> list[str]:
    """The fewest of `columns`, in order, that tell apart the runs of each value of `keys`: a column
    is taken when it takes more than one value (a missing one counts as one) among runs that the
    columns taken before it do not tell apart (a local checkpoint's content hash, which follows its
    path, is not named beside the path)."""
    texts = runs[columns].map(as_text)
    taken: list[str] = []
    for column in columns:
        groups = [runs[key] for key in keys] + [texts[other] for other in taken]
        if (texts[column].groupby(groups, sort=False, dropna=False).nunique() > 1).any():
            taken.append(column)
    return taken


def labelled(names: pd.Series, runs: pd.DataFrame, fields: list[str]) -> pd.Series:
    """`names` followed by each run's values of `fields`: "H2O (heavy_ratio=0.25, max_new_tokens=512)"."""
    if not fields:
        return names
    parts = runs[fields].map(as_text)
    suffix = [", ".join(f"{field.rsplit('.', 1)[-1]}={value}" for field, value in zip(fields, row, strict=True))
              for row in parts.itertuples(index=False, name=None)]
    return pd.Series([f"{name} ({text})" for name, text in zip(names, suffix, strict=True)], index=names.index)


def split_labels(runs: pd.DataFrame, row_keys: list[str]) -> pd.DataFrame:
    """`runs` (labelled: `model_label`, `method_label`, `items`) with the labels of otherwise-equal runs
    told apart: `model_label` by the model fields that differ among the runs of one model, then
    `method_label` by the other settings that differ among runs of one row (`row_keys`) and item set.
    Every run of a model (of a row) is labelled by the same fields, so that a row reads alike in
    every column."""
    runs = runs.copy()
    has = known(runs)
    if not has.any():
        return runs
    model_fields = setting_columns(runs, MODEL)
    for _, group in runs[has].groupby("model_label", sort=False):
        fields = differing(group, model_fields, ["model_label"])
        runs.loc[group.index, "model_label"] = labelled(group["model_label"], group, fields)
    others = [column for column in setting_columns(runs) if column not in model_fields]
    with_settings = runs[has]
    for _, group in with_settings.groupby(row_keys, sort=False, dropna=False):
        fields = differing(group, others, ["items"])
        runs.loc[group.index, "method_label"] = labelled(group["method_label"], group, fields)
    return runs
