"""Errors that are the user's to fix (bad config, missing file): entry points print them on one line
and exit with code 2, never with a traceback."""


class UserError(Exception):
    """A mistake in the user's input; the message alone must say what to change."""
