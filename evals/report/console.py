"""A report's text on a standard output that its reader may close first (`evals.report.table ... |
head`): the report writes its files before it prints, and once the reader has gone it prints
nothing more, without a traceback."""

from __future__ import annotations

import os
import sys


def show(text: str) -> None:
    """Print `text`; when the reader has closed standard output, drop it and whatever follows."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Python flushes standard output again as it exits, and would fail there: point it at nothing.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
