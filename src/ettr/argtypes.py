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
