"""What the benchmark scripts share: random prompts for random-weight models, and the printed table
with its CSV."""

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
