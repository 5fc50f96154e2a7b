"""Shards: the items of each dataset split among processes that write the same run (`shard=i/n`).

    python -m evals.run -m dataset=gsm8k method=longflow shard=0/4,1/4,2/4,3/4 hydra/launcher=local_gpus

A shard changes which items a process generates, never what an item's output is (each row's seed
depends only on its item and sample), so every shard of a config writes the one run directory of
that config (`evals.store.RunDir` with a shard): its metrics cover every shard's items, and it is
complete when the last shard is. A killed shard resumes like a run: start the same command again.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from longflow.errors import UserError

T = TypeVar("T")


@dataclass(frozen=True)
class Shard:
    """Shard `index` of `count`: the items at positions index, index + count, index + 2 count, ...

    Interleaved rather than contiguous: datasets are often ordered by difficulty or length, and
    every shard should get its share of the long items.
    """

    index: int
    count: int

    @classmethod
    def parse(cls, value: object) -> Shard | None:
        """`shard` from the config: null, or "i/n" with 0 <= i < n; "0/1" (the whole dataset) is null."""
        if value is None:
            return None
        match = re.fullmatch(r"(\d+)/(\d+)", value.strip()) if isinstance(value, str) else None
        if match is None or not int(match[1]) < int(match[2]):
            raise UserError(f"shard must be i/n with 0 <= i < n (shard=0/4 is the first of four), got {value!r}")
        index, count = int(match[1]), int(match[2])
        return None if count == 1 else cls(index, count)

    def select(self, items: Sequence[T]) -> list[T]:
        return list(items[self.index::self.count])

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"
