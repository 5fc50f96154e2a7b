"""Dependency recall (`evals.canary.recall`) as runs for the table: each row of its CSV (one family,
method and budget) becomes a run-like record of dataset `canary_<family>`, with the per-item numbers
of its JSON (every read of every item) for the paired bootstrap.

A summary's `recall_layers` and `recall_layer0` are means over reads, pooled over items; so an item's
share of the score is its sum of read shares over its reads (`ItemScores` numerator and denominator),
and `complete_items` is a mean over items of whether every read was held by every layer's KV heads.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from evals.report.runs import frame_of
from evals.report.stats import ItemScores
from longflow.errors import UserError

RECALL_METRICS = ("recall_layers", "recall_layer0", "complete_items")
RECALL_MODEL = "canary_suite"  # `evals.canary.recall --model`'s default: the model of a CSV that names none
HELDOUT_SIZE = 200  # items of each family's held-out split (`evals.canary.families.HELDOUT_SIZE`)
READ_SHARES = {"recall_layers": "layers", "recall_layer0": "layer0"}  # recall.json's per-read lists


def item_scores(reads: list[dict], metric: str, family: str) -> ItemScores:
    """Per-item numbers of one (family, method, budget) of recall.json: `reads`, one entry per item in
    the held-out order (`{"layer0": [...], "layers": [...]}`, a share per read); items are named
    `<family>-<position>`, the same for every method, so runs pair by position."""
    ids = tuple(f"{family}-{position}" for position in range(len(reads)))
    if metric == "complete_items":
        return ItemScores.means({i: float(all(share == 1.0 for share in r["layers"])) for i, r in zip(ids, reads,
                                                                                                       strict=True)})
    shares = [r[READ_SHARES[metric]] for r in reads]
    return ItemScores(ids, np.array([sum(s) for s in shares], dtype=float), np.array([len(s) for s in shares],
                                                                                      dtype=float))


def recall_frame(csv_paths: list[Path | str] | Path | str, metric: str) -> pd.DataFrame:
    """Recall CSVs (one, or several: a sweep run a family at a time) as `evals.report.runs.collect`'s
    frame: model (the CSV's, else `RECALL_MODEL`), method, budget, dataset `canary_<family>`,
    `n_items` and `n_planned` its item count, `metric`, and `item_scores` from the JSON beside each
    (`<stem>.json`, None per row when absent)."""
    if metric not in RECALL_METRICS:
        raise UserError(f"--recall tabulates {', '.join(RECALL_METRICS)}, not {metric!r}")
    paths = [csv_paths] if isinstance(csv_paths, (str, Path)) else csv_paths
    frames = [recall_file(Path(path), metric) for path in paths]
    return pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]


def recall_file(csv_path: Path, metric: str) -> pd.DataFrame:
    """One recall CSV as `recall_frame` reads it."""
    try:
        table = pd.read_csv(csv_path)
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError) as error:
        raise UserError(f"cannot read the recall file {csv_path} ({error})") from None
    wanted = {"family", "method", "budget", "items", metric}
    if lost := wanted - set(table.columns):
        raise UserError(f"{csv_path} lacks the columns {', '.join(sorted(lost))} (is it evals.canary.recall's CSV?)")
    json_path = csv_path.with_suffix(".json")
    every = json.loads(json_path.read_text()) if json_path.exists() else {}
    records, scores = [], []
    for row in table.to_dict("records"):
        budget = None if pd.isna(row["budget"]) else int(row["budget"])
        model = row.get("model") if isinstance(row.get("model"), str) else RECALL_MODEL
        records.append({"model": model, "method": row["method"], "variant": "paper", "budget": budget,
                        "generation": "greedy", "dataset": f"canary_{row['family']}", "dataset_size": HELDOUT_SIZE,
                        "n_items": int(row["items"]), "complete": int(row["items"]) >= HELDOUT_SIZE,
                        metric: float(row[metric]), "path": str(csv_path), "mtime": 0.0,
                        "n_planned": int(row["items"]), "item_set": None, "dirty": False})
        reads = every.get(f"{row['family']}/{row['method']}/{budget}")
        scores.append(None if reads is None else item_scores(reads, metric, row["family"]))
    frame = frame_of(records)
    frame["item_scores"] = pd.Series(scores, index=frame.index, dtype=object)
    return frame
