"""Errors that are the user's to fix (bad config, missing file): entry points print them on one line
and exit with code 2, never with a traceback."""

import sys


class UserError(Exception):
    """A mistake in the user's input; the message alone must say what to change."""


def report(error: UserError) -> int:
    """Print `error` on one line to stderr; returns the exit code of every entry point for it, 2."""
    print(f"error: {error}", file=sys.stderr)
    return 2
