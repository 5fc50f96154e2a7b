"""Are two folders of runs token-identical? Item by item, the outputs of the runs both folders hold.

    python -m evals.report.identity --runs results/canary/runs --against /tmp/new_runs [--out diff.csv]

A refactor that must change no token, a kernel swapped for another, a second machine: each is
checked by running the same sweep into a second folder and comparing it with the first. Runs are
paired by their directory name, which ends in the hash of the run's identity (`evals.store`: model,
method and its parameters, budget, generation, dataset, verification), so a pair made the same
run's outputs with whatever code each folder's provenance records; a run whose identity differs (a
method parameter, a calibration file's path) has no counterpart and is listed as such, not compared.
Within a pair, records are matched by (item id, sample) and their output texts compared; a
difference is reported with the character where the two outputs part.

Writes every pair's counts to `--out` (CSV), then prints one line per pair with a difference, the
runs without a counterpart, and the total. Exits 1 when an output differs, an item of one run is
missing from its counterpart, or no run is in both folders (nothing was compared: two sweeps of other
configs, or the wrong folder), 2 on a bad folder, 0 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from evals.report.console import show
from evals.store import GENERATIONS, IDENTITY, peek_records
from longflow.errors import UserError, report

SHOWN = 3  # differing items named per pair


@dataclass(frozen=True)
class Difference:
    """One item whose outputs differ: its key, where they part (a character index), both lengths."""

    item: str
    sample: int
    parts_at: int
    lengths: tuple[int, int]


@dataclass(frozen=True)
class Pair:
    """The comparison of one run present in both folders."""

    name: str
    compared: int  # records present in both
    identical: int
    missing: int  # records present in one of the two only
    differences: tuple[Difference, ...]


def outputs(run: Path) -> dict[tuple[str, int], str]:
    """`{(item id, sample): output text}` of a run's complete records (`peek_records`: a torn last
    line is skipped and the file left as it is, since the run may still be writing)."""
    return {(str(record["id"]), int(record.get("sample", 0))): record.get("output", "")
            for record in peek_records(run / GENERATIONS)}


def runs_of(folder: Path) -> dict[str, Path]:
    """The run directories directly under `folder` (those with a run.json), by name."""
    if not folder.is_dir():
        raise UserError(f"{folder} is not a folder of runs")
    return {path.name: path for path in sorted(folder.iterdir()) if (path / IDENTITY).is_file()}


def parting(first: str, second: str) -> int:
    """The first character index where the two texts differ (the shorter's length if one extends the other)."""
    for index, (a, b) in enumerate(zip(first, second, strict=False)):
        if a != b:
            return index
    return min(len(first), len(second))


def compare_run(name: str, first: Path, second: Path) -> Pair:
    mine, theirs = outputs(first), outputs(second)
    shared = sorted(mine.keys() & theirs.keys())
    differences = tuple(Difference(item, sample, parting(mine[key], theirs[key]), (len(mine[key]), len(theirs[key])))
                        for key in shared if mine[key] != theirs[key] for item, sample in [key])
    return Pair(name=name, compared=len(shared), identical=len(shared) - len(differences),
                missing=len(mine.keys() ^ theirs.keys()), differences=differences)


def compare(first: Path, second: Path) -> tuple[list[Pair], list[str], list[str]]:
    """(the pairs, the runs only in `first`, the runs only in `second`)."""
    mine, theirs = runs_of(first), runs_of(second)
    pairs = [compare_run(name, mine[name], theirs[name]) for name in sorted(mine.keys() & theirs.keys())]
    return pairs, sorted(mine.keys() - theirs.keys()), sorted(theirs.keys() - mine.keys())


def summary(pairs: list[Pair], only_first: list[str], only_second: list[str], first: Path, second: Path) -> str:
    lines = []
    for pair in pairs:
        if pair.differences or pair.missing:
            shown = ", ".join(f"{d.item}#{d.sample} at character {d.parts_at} of {d.lengths[0]} / {d.lengths[1]}"
                              for d in pair.differences[:SHOWN])
            more = len(pair.differences) - SHOWN
            lines.append(f"{pair.name}: {pair.identical} of {pair.compared} identical"
                         + (f"; {shown}" if shown else "") + (f" and {more} more" if more > 0 else "")
                         + (f"; items in one run only: {pair.missing}" if pair.missing else ""))
    for name in only_first:
        lines.append(f"{name}: only in {first}")
    for name in only_second:
        lines.append(f"{name}: only in {second}")
    identical = sum(pair.identical for pair in pairs)
    compared = sum(pair.compared for pair in pairs)
    others = f"{len(only_first)} only in the first, {len(only_second)} only in the second"
    if not pairs:
        lines.append(f"no run is in both folders ({others}): nothing was compared")
    else:
        lines.append(f"{identical} of {compared} outputs identical, over {len(pairs)} runs in both folders ({others})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals.report.identity", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, required=True, help="a folder of run directories")
    parser.add_argument("--against", type=Path, required=True, help="the folder to compare it with")
    parser.add_argument("--out", type=Path, default=None, help="CSV of every pair's counts")
    args = parser.parse_args(argv)
    try:
        pairs, only_first, only_second = compare(args.runs, args.against)
    except UserError as error:
        return report(error)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        counts = [{"run": pair.name, "compared": pair.compared, "identical": pair.identical, "missing": pair.missing}
                  for pair in pairs]
        pd.DataFrame(counts, columns=["run", "compared", "identical", "missing"]).to_csv(args.out, index=False)
    show(summary(pairs, only_first, only_second, args.runs, args.against))
    return int(not pairs or any(pair.differences or pair.missing for pair in pairs))


if __name__ == "__main__":
    sys.exit(main())
