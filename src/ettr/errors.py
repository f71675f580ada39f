"""Errors that reach users: the CLI turns a `UsageError` into one line on stderr and exit status 2."""


class UsageError(Exception):
    """Bad usage or bad input: the message says what was wrong and what to do."""
