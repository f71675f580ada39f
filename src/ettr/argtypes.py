"""argparse value types shared by the command-line fronts (`ettr.cli` and the commands' own modules)."""

from __future__ import annotations

import argparse
import math
from datetime import datetime


def parse_time(text: str) -> float:
    """TIME: a Unix timestamp in seconds or an ISO-8601 string (naive means local time)."""
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds) or seconds < 0:
            raise argparse.ArgumentTypeError(f"{text!r} is not a time (give Unix seconds >= 0 or ISO-8601)")
        return seconds
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a time (give Unix seconds or ISO-8601, e.g. 2026-11-29T20:52:00Z)"
        ) from None


def path_arg(text: str) -> str:
    """A file or directory argument: any path but the empty one (which the system would read as the current
    directory, or refuse only later, far from the flag that gave it)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path (give a file or directory name)")
    return text


def ledger_url_arg(text: str) -> str:
    """A ledger URL argument: anything but the empty string (which would silently mean "no URL")."""
    if not text:
        raise argparse.ArgumentTypeError("an empty URL (give sqlite:///PATH or postgresql://USER@HOST/DB)")
    return text
