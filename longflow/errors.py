"""Errors that are the user's to fix (bad config, missing file): entry points print them on one line
and exit with code 2, never with a traceback. And the one device error the entry points recover
from: running out of GPU memory."""

import sys


class UserError(Exception):
    """A mistake in the user's input; the message alone must say what to change."""


def report(error: UserError) -> int:
    """Print `error` on one line to stderr; returns the exit code of every entry point for it, 2."""
    print(f"error: {error}", file=sys.stderr)
    return 2


def out_of_memory(error: BaseException | None) -> bool:
    """CUDA's out-of-memory error, or a RuntimeError that says so (raised by some kernels and older
    torch), or an error raised while handling one: one raised inside `torch.cuda.graph` can come out
    as the error of ending the aborted capture."""
    # Imported here: the entry points check their configs through this module before anything
    # needs torch, and `import evals.run` stays free of it.
    import torch

    while error is not None:
        if isinstance(error, torch.OutOfMemoryError) or (
                isinstance(error, RuntimeError) and "out of memory" in str(error).lower()):
            return True
        error = error.__cause__ or error.__context__
    return False
