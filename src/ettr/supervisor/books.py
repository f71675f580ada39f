"""Keeping the books across supervisors: find a live one, and close what a killed one left open.

A supervisor killed with SIGKILL leaves its last attempt without ATTEMPT_END (its processes die with it:
see `process.py`). `ettr report` closes such a job in memory at the last thing the ledger saw. A supervisor
started again on the same run directory (a requeued job) first writes the missing ATTEMPT_END, at the last
event of that attempt, so the books it continues are closed on disk too.
"""

from __future__ import annotations

from collections.abc import Sequence

from ettr.closing import closing_events as close_open_attempts
from ettr.closing import live_supervisor
from ettr.events import Event, EventKind

__all__ = ["closing_events", "live_supervisor", "next_attempt"]


def closing_events(events: Sequence[Event]) -> list[Event]:
    """ATTEMPT_END events for the attempts that were started and never ended, each at its last event."""
    return close_open_attempts(
        events,
        reason="its supervisor was lost (killed) while it ran; closed from the ledger",
        extra={"signal": None},
    )


def next_attempt(events: Sequence[Event]) -> int:
    """The index the next attempt of this job gets (0 for a new job)."""
    used = (e.attempt for e in events if e.kind is EventKind.ATTEMPT_START or e.rank >= 0)
    return 1 + max(used, default=-1)
