"""What `ettr run` tells the person watching it: one line each, on stderr, prefixed `ettr:`.

The supervisor's parts say what they do through `say`; the job's output (the command's own stdout and
stderr) passes through unchanged around these lines.
"""

from __future__ import annotations

import errno
import sys


def say(message: str) -> None:
    """One line on stderr, `ettr: message`; never raises (a closed stderr is not the job's failure)."""
    try:
        print(f"ettr: {message}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def describe_os_error(exc: BaseException) -> str:
    """An error in a few words, a full disk said as such."""
    errno_ = getattr(exc, "errno", None)
    text = str(exc)
    if errno_ == errno.ENOSPC or "database or disk is full" in text:
        return f"no space left on the device (ENOSPC): {text}"
    return f"{type(exc).__name__}: {text}"
