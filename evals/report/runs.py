"""Run directories as one frame for the reports: which runs (a runs folder, or exactly the sweeps'),
each over which items (`evals.report.item_sets`) with its metrics over them computed from its stored
records, the filters (model, method, budget, dataset, generation, limit), and display labels, so
that a table or a figure compares only runs over the same items.

A sweep folder holds `sweep.json`, written by `evals.run -m` at the Hydra sweep directory
(`evals.sweeps`): the runs each job made and the items it covered there.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from evals.metrics import summarize
from evals.report.item_sets import SWEEP, ItemSet, folder_item_sets, sweep_item_sets, warn
from evals.report.names import (
    DEFAULT_VARIANT,
    dataset_name,
    dataset_sort_key,
    method_label,
    method_rank,
    model_name,
    verified_label,
)
from evals.report.provenance import uncommitted
from evals.report.settings import known, settings, split_labels
from evals.store import (
    BATCHES,
    FIDELITY,
    GENERATIONS,
    IDENTITY,
    METRICS,
    in_scope,
    peek_records,
    planned_items,
    stable_hash,
)
from longflow.errors import UserError

REFERENCE = "vanilla"  # the full cache: budget "-", listed first, kept by the method and budget filters
# What a row of a table (a series of a figure) is: runs that share these and an item set are one cell.
ROW_KEYS = ["model_label", "budget_label", "method_label", "generation"]


def read_metrics(path: Path) -> dict | None:
    """A run's metrics.json; None, with a warning line, when it is unreadable or names no model, method
    or dataset."""
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        warn(f"skipping {path}: unreadable ({error})")
        return None
    if not isinstance(record, dict):
        warn(f"skipping {path}: not a JSON object")
        return None
    missing = [key for key in ("model", "method", "dataset") if record.get(key) is None]
    if missing:
        warn(f"skipping {path}: no {', '.join(missing)}")
        return None
    return record


def read_identity(run: Path) -> dict | None:
    try:
        identity = json.loads((run / IDENTITY).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return identity if isinstance(identity, dict) else None


class StoredRecords:
    """A run's stored records, read once for all the item sets it is reported over; `generations` is
    None when the run has no identity or no generations.jsonl to compute metrics from."""

    def __init__(self, run: Path):
        self.identity = read_identity(run)
        self.generations = self.batches = self.fidelity = None
        if self.identity is not None and (run / GENERATIONS).exists():
            try:
                self.generations, self.batches, self.fidelity = (
                    peek_records(run / name) for name in (GENERATIONS, BATCHES, FIDELITY))
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                warn(f"{run}: a stored record is corrupt ({error}); reporting its metrics.json")
                self.generations = None
        self.run = run

    def metrics(self, items: ItemSet) -> dict | None:
        """The run's metrics over `items` (None: every record), as the run computes its metrics.json
        (`evals.metrics.summarize`; speed covers every batch of the run); None when it has no records
        or its identity lacks what the summary needs."""
        if self.generations is None:
            return None
        try:
            return summarize({**self.identity, "run_id": self.run.name}, self.scoped(items), self.batches,
                             in_scope(self.fidelity, items))
        except (KeyError, TypeError) as error:
            warn(f"{self.run}: its {IDENTITY} or records lack {error}; reporting its metrics.json")
            return None

    def scoped(self, items: ItemSet) -> list[dict] | None:
        """The generation records of `items` (every one when None); None when there are none to read."""
        return None if self.generations is None else in_scope(self.generations, items)

    def every_item(self) -> list[str]:
        return list(dict.fromkeys(record["id"] for record in self.generations or []))


def read_run(run: Path, item_sets: list[ItemSet], every_item_on_disk: bool = False) -> list[dict]:
    """One record per distinct item set of `item_sets` (None: the items of the run's last config,
    items.json): the run's metrics over those items from its stored records (`StoredRecords.metrics`),
    plus `path`, `mtime`, `n_planned` (the set's size), `item_set` (a hash of its ids), `item_ids` and
    `dirty` (whether a start that made those records ran uncommitted code: `evals.report.provenance`).
    With `every_item_on_disk`, also over every item the run holds when some lie outside all of
    `item_sets` (a later config of a smaller `limit` left them). A run without records (metrics.json
    alone) is reported from metrics.json, over its last config's items only. [] when metrics.json is
    unreadable (`read_metrics`)."""
    stored = read_metrics(run / METRICS)
    if stored is None:
        return []
    planned, records = planned_items(run), StoredRecords(run)
    wanted = [planned if items is None else items for items in item_sets]
    if every_item_on_disk and None not in wanted:
        on_disk = records.every_item()
        if set(on_disk) - {item for items in wanted for item in items}:
            wanted.append(on_disk)
    found = []
    for items in {None if items is None else frozenset(items): items for items in wanted}.values():
        metrics = records.metrics(items)
        if metrics is None:
            if items is not None and set(items) != set(planned or ()):
                warn(f"skipping {run} over {len(items)} items: it has no records to compute them from, and its "
                     f"{METRICS} covers another config's items")
                continue
            metrics = stored
        found.append({**metrics, "path": str(run), "mtime": (run / METRICS).stat().st_mtime,
                      "n_planned": None if items is None else len(items),
                      "item_set": None if items is None else stable_hash(sorted(map(str, items)), length=6),
                      "item_ids": None if items is None else tuple(items),
                      "dirty": uncommitted(run, records.scoped(items)),
                      **settings(records.identity)})
    return found


def frame_of(records: list[dict]) -> pd.DataFrame:
    """The records as one frame, nested dicts flattened with dots (`step_latency_ms.p50`), defaults for
    the keys older runs lack."""
    if not records:
        return pd.DataFrame()
    frame = pd.json_normalize(records)
    for column, default in (("variant", DEFAULT_VARIANT), ("generation", "-"), ("budget", None),
                            ("complete", True), ("n_items", None), ("dataset_size", None)):
        if column not in frame:
            frame[column] = default
    frame["variant"] = frame["variant"].fillna(DEFAULT_VARIANT)
    frame["generation"] = frame["generation"].fillna("-")
    frame["complete"] = frame["complete"].fillna(True).astype(bool)
    frame["n_planned"] = frame["n_planned"].fillna(frame["dataset_size"])  # runs from before items.json
    for column in ("budget", "n_items", "dataset_size", "n_planned"):
        frame[column] = pd.to_numeric(frame[column], errors="coerce").astype("Int64")
    return frame


def collect(runs_dir: Path | str) -> pd.DataFrame:
    """Every run under `runs_dir` (a readable `metrics.json` marks one), a row per item set it has been
    run over (`evals.report.item_sets.folder_item_sets`, and every item it holds: `read_run`).
    Unreadable or partial files are skipped with a warning line; hidden folders (Hydra's `.hydra/`)
    hold no runs. May return an empty frame."""
    runs_dir = Path(runs_dir)
    runs = [path.parent for path in sorted(runs_dir.rglob(METRICS))
            if not any(part.startswith(".") for part in path.relative_to(runs_dir).parts)]
    item_sets = folder_item_sets(runs_dir, runs)
    return frame_of([record for run, found in item_sets.items()
                     for record in read_run(run, found, every_item_on_disk=True)])


def collect_sweeps(sweep_dirs: list[Path | str]) -> pd.DataFrame:
    """The runs of the sweeps (each folder once), each over the item sets the sweeps' jobs covered
    there (`evals.report.item_sets.sweep_item_sets`), a run over the same items once; a listed run
    without metrics.json (not started, or failed before its first batch) is named in a warning line."""
    item_sets: dict[Path, list[ItemSet]] = {}
    for folder in dict.fromkeys(Path(folder).resolve() for folder in sweep_dirs):
        for run, found in sweep_item_sets(folder).items():
            item_sets.setdefault(run, []).extend(found)
    records = []
    for run, found in item_sets.items():
        if not (run / METRICS).exists():
            warn(f"{run} is in the sweep but has no {METRICS}")
            continue
        records += read_run(run, found)
    return frame_of(records)


def collect_sweep(sweep_dir: Path | str) -> pd.DataFrame:
    """The runs of one sweep (`collect_sweeps`)."""
    return collect_sweeps([sweep_dir])


def item_ids(runs: pd.DataFrame) -> list[tuple[str, ...] | None]:
    """Each row's item ids (`read_run`), None where unknown (a run without items.json, a recall row)."""
    column = runs["item_ids"] if "item_ids" in runs else pd.Series(None, index=runs.index, dtype=object)
    return [items if isinstance(items, tuple) else None for items in column]


def select(runs: pd.DataFrame, models=None, datasets=None, generation: str | None = None, methods=None,
           budgets=None, limits=None) -> pd.DataFrame:
    """The runs of the given models, datasets (run keys or display names), generation config, methods,
    budgets and item counts (`limits`: the items a run's config covers). FullKV, the reference, is
    kept whatever `methods` and `budgets` say (its budget is not one)."""
    if runs.empty:
        return runs
    keep = pd.Series(True, index=runs.index)
    reference = runs["method"] == REFERENCE
    if models:
        keep &= runs["model"].isin(models)
    if datasets:
        wanted = set(datasets) | {dataset_name(d) for d in datasets}
        keep &= runs["dataset"].isin(wanted) | runs["dataset"].map(dataset_name).isin(wanted)
    if generation:
        keep &= runs["generation"] == generation
    if methods:
        keep &= runs["method"].isin(methods) | reference
    if budgets:
        keep &= runs["budget"].isin(budgets).fillna(False).astype(bool) | reference
    if limits:
        keep &= runs["n_planned"].isin(limits).fillna(False).astype(bool)
    return runs[keep]


def label(runs: pd.DataFrame) -> pd.DataFrame:
    """`runs` plus display columns: model_label, method_label, budget_label ("-" for the full cache),
    dataset_label, `items` (the dataset and the items run, "canary (16 of 200)": a table's column, a
    figure's panel), sort keys, and `finished`: whether a run did every item its config asked for (a
    run of the first items, `limit`, is finished when it has them; a run of a whole benchmark when it
    is complete, every sample included). The labels of runs that would share a cell but differ in a
    setting carry it (`evals.report.settings.split_labels`). Shared by the table and the figures."""
    runs = runs.copy()
    done, planned, size = (runs[column].astype("Float64").fillna(float("nan")).astype(float)
                           for column in ("n_items", "n_planned", "dataset_size"))
    runs["finished"] = runs["complete"] | ((planned < size) & (done >= planned))
    runs["model_label"] = runs["model"].map(model_name)
    modes = runs["budget_mode"] if "budget_mode" in runs else pd.Series(None, index=runs.index, dtype=object)
    runs["method_label"] = [method_label(m, v, b) for m, v, b in zip(runs["method"], runs["variant"], modes,
                                                                      strict=True)]
    if "verify" in runs:  # a method drafting for a verifier (`verify=vericache`) is a row of its own
        runs["method_label"] = [verified_label(name, verify) if isinstance(verify, str) else name
                                for name, verify in zip(runs["method_label"], runs["verify"], strict=True)]
    runs["method_rank"] = runs["method"].map(method_rank)
    runs["budget_label"] = [
        "-" if method == REFERENCE or pd.isna(budget) else str(int(budget))
        for method, budget in zip(runs["method"], runs["budget"], strict=True)
    ]
    # Full cache sorts before every budget; the budget is ignored by that method anyway.
    budget = runs["budget"].astype("Float64").fillna(-1.0)
    runs["budget_rank"] = budget.where(runs["method"] != REFERENCE, -1.0)
    runs["dataset_label"] = runs["dataset"].map(dataset_name)
    if "item_set" not in runs:
        runs["item_set"] = None
    runs["items"] = items_labels(runs)
    return split_labels(runs, [key for key in ROW_KEYS if key in runs])


def items_text(dataset: str, planned, size) -> str:
    if pd.isna(planned):
        return dataset
    if pd.isna(size) or planned >= size:
        return f"{dataset} ({int(planned)})"
    return f"{dataset} ({int(planned)} of {int(size)})"


def items_labels(runs: pd.DataFrame) -> list[str]:
    """Each run's item set as text: the dataset, the items its config covers and the benchmark's size;
    where runs of one such text cover different items (another generator setting, other shards of
    ids), each set is named by the start of its hash. A run without items.json joins the set of the
    others."""
    text = [items_text(*key) for key in zip(runs["dataset_label"], runs["n_planned"], runs["dataset_size"],
                                            strict=True)]
    sets = pd.DataFrame({"text": text, "item_set": runs["item_set"].to_numpy()}, index=runs.index)
    labels = pd.Series(text, index=runs.index)
    for name, group in sets.groupby("text"):
        hashes = group["item_set"].dropna()
        if hashes.nunique() > 1:
            labels[hashes.index] = [f"{name[:-1]}, items {h})" if name.endswith(")") else f"{name} (items {h})"
                                    for h in hashes]
            most = hashes.value_counts().index[0]
            labels[group.index.difference(hashes.index)] = labels[hashes.index[hashes == most][0]]
    return labels.tolist()


def items_sort_key(runs: pd.DataFrame) -> dict[str, tuple]:
    """The order of the `items` labels: the paper's dataset order, then fewer items first."""
    first = runs.drop_duplicates("items")
    return {items: (dataset_sort_key(dataset), -1 if pd.isna(planned) else int(planned), items)
            for items, dataset, planned in zip(first["items"], first["dataset_label"], first["n_planned"],
                                               strict=True)}


def keep_newest(runs: pd.DataFrame, keys: list[str]) -> tuple[pd.DataFrame, list[str]]:
    """One run per `keys` value, the newest by metrics.json mtime; and a note for each key that had
    several, saying what they share. Runs whose settings differ have other labels (`split_labels`), so
    those left here are one configuration: copies of one run (every setting of run.json matched), or
    runs without a run.json to tell them apart."""
    runs = runs.sort_values("mtime", kind="stable")
    notes = []
    for key, group in runs.groupby(keys, sort=True):
        if len(group) > 1:
            where = " / ".join(str(k) for k in key)
            same = ("the same model, method and generation settings, every field of their run.json"
                    if known(group).all() else "no run.json to tell them apart")
            notes.append(f"{where}: {len(group)} runs with {same}, kept the newest "
                         f"({Path(group['path'].iloc[-1]).name})")
    return runs.drop_duplicates(keys, keep="last"), notes


def add_filters(parser: argparse.ArgumentParser) -> None:
    """--runs or --sweep, and the run filters, shared by `table`, `figures` and `results`."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--runs", type=Path, default=Path("results/runs"),
                        help="folder of run directories, every one under it (default results/runs)")
    source.add_argument("--sweep", type=Path, nargs="+",
                        help=f"sweep folders: exactly the runs each one's {SWEEP} lists")
    parser.add_argument("--model", nargs="+", help="only these models (run keys)")
    parser.add_argument("--method", nargs="+", help="only these methods (config names; FullKV is always kept)")
    parser.add_argument("--budget", type=int, nargs="+", help="only these KV budgets (FullKV is always kept)")
    parser.add_argument("--dataset", nargs="+", help="only these datasets (run keys or display names)")
    parser.add_argument("--limit", type=int, nargs="+", help="only runs over item sets of this many items")
    parser.add_argument("--generation", help="only this generation config (greedy, sampling, ...)")


def load(args: argparse.Namespace) -> pd.DataFrame:
    """`collect` (or `collect_sweeps`) then `select_filtered` by the parsed filter arguments."""
    if args.sweep:
        runs = collect_sweeps(args.sweep)
        source = ", ".join(str(folder) for folder in args.sweep)
    else:
        if not args.runs.is_dir():
            raise UserError(f"runs folder {args.runs} does not exist (pass --runs or --sweep)")
        runs, source = collect(args.runs), str(args.runs)
    if runs.empty:
        raise UserError(f"no {METRICS} found under {source}")
    return select_filtered(runs, args, source)


def present(values: pd.Series) -> str:
    return ", ".join(sorted({str(int(v)) if isinstance(v, float) else str(v) for v in values.dropna()}))


def select_filtered(runs: pd.DataFrame, args: argparse.Namespace, source: str) -> pd.DataFrame:
    """`select` by the parsed filter arguments. A filter value that matches nothing (a typo:
    `--method h2oo`, `--budget 97`) is a UserError naming the values there are, and so is a
    combination that leaves only FullKV, which the method and budget filters keep whatever they
    say: a table of the reference alone answers nothing that was asked. `source` names where the
    runs came from in the messages."""
    datasets = pd.concat([runs["dataset"], runs["dataset"].map(dataset_name)])
    for flag, asked, there in (("--model", args.model, runs["model"]), ("--method", args.method, runs["method"]),
                               ("--budget", args.budget, runs["budget"]), ("--dataset", args.dataset, datasets),
                               ("--limit", args.limit, runs["n_planned"]),
                               ("--generation", [args.generation] if args.generation else None, runs["generation"])):
        known = set(there.dropna().tolist())
        missing = [value for value in asked or [] if value not in known]
        if missing:
            raise UserError(f"{flag} {' '.join(map(str, missing))} matches nothing in {source}, which has "
                            f"{flag[2:]} {present(there)}")
    selected = select(runs, args.model, args.dataset, args.generation, args.method, args.budget, args.limit)
    if selected.empty or ((args.method or args.budget) and (selected["method"] == REFERENCE).all()
                          and set(args.method or []) != {REFERENCE}):
        raise UserError(f"nothing in {source} matches the filters together (FullKV aside, which they always keep)")
    return selected
