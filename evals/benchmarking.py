"""What the benchmark scripts share: random prompts for random-weight models, the printed table with
its CSV, and the `--compile` settings."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch


def random_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of `length` ids from the lower half of the vocabulary, away from the special
    ids at its top; the first rows are the same whatever `count`."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab // 2, (count, length), generator=generator).tolist()


def write_table(table: pd.DataFrame, out: str | Path, heading: str, setting: dict, decimals: int = 3) -> None:
    """Prints `heading` and `table`, and writes the table with the `setting` columns to `out` (CSV)."""
    print(f"\n{heading}")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.{decimals}f}"))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    table.assign(**setting).to_csv(out, index=False)
    print(f"wrote {out}")


# `--compile` values: the decode forward eager; compiled as the engine does by default (Inductor's
# kernel tuning at a batch of one only); compiled with or without that tuning whatever the batch.
COMPILE_SETTINGS = {"off": {"compile": False}, "on": {"compile": True},
                    "tuned": {"compile": True, "compile_tuning": True},
                    "untuned": {"compile": True, "compile_tuning": False}}


def compile_settings(value: str) -> list[str]:
    """A `--compile` argument (`on`, or several as `off,on,tuned`) as its list of settings."""
    settings = value.split(",")
    unknown = set(settings) - set(COMPILE_SETTINGS)
    if unknown:
        raise ValueError(f"--compile takes {', '.join(COMPILE_SETTINGS)} or a comma-separated list of them, "
                         f"got {value!r}")
    return settings
