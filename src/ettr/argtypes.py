"""argparse value types shared by the command-line fronts (`ettr.cli` and the commands' own modules)."""

from __future__ import annotations

import argparse
from datetime import datetime


def parse_time(text: str) -> float:
    """TIME: a Unix timestamp in seconds or an ISO-8601 string (naive means local time)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a time (give Unix seconds or ISO-8601, e.g. 2026-11-29T20:52:00Z)"
        ) from None
