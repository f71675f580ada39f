"""Errors that reach users: the CLI turns a `UsageError` into one line on stderr and exit status 2;
`describe_os_error` says an I/O error in a few words (the one way ettr names one)."""

from __future__ import annotations

import errno
import os


class UsageError(Exception):
    """Bad usage or bad input: the message says what was wrong and what to do."""


def describe_os_error(exc: BaseException) -> str:
    """An error in a few words, its errno named (`ENOSPC (No space left on device): /ckpt/x`); SQLite's
    "database or disk is full" is said as the ENOSPC it is; anything else as `Type: message`."""
    if isinstance(exc, OSError) and exc.errno is not None:
        name = errno.errorcode.get(exc.errno, str(exc.errno))
        standard = os.strerror(exc.errno)
        said = f": {exc.strerror}" if exc.strerror and exc.strerror != standard else ""
        where = f": {exc.filename}" if exc.filename else ""
        return f"{name} ({standard}){said}{where}"
    if "database or disk is full" in str(exc):
        return f"ENOSPC ({os.strerror(errno.ENOSPC)}): {type(exc).__name__}: {exc}"
    return f"{type(exc).__name__}: {exc}"


def unreadable(path: object, exc: BaseException) -> str:
    """`PATH could not be read (why)`, the path said once, in front (an OSError's own filename left out)."""
    if isinstance(exc, OSError) and exc.errno is not None:
        exc = OSError(exc.errno, exc.strerror)
    return f"{path} could not be read ({describe_os_error(exc)})"
