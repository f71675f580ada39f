"""Keeping the books across supervisors: find a live one, and close what a killed one left open.

A supervisor killed with SIGKILL leaves its last attempt without ATTEMPT_END (its processes die with it:
see `process.py`). `ettr report` closes such a job in memory at the last thing the ledger saw. A supervisor
started again on the same run directory (a requeued job) first writes the missing ATTEMPT_END, at the last
event of that attempt, so the books it continues are closed on disk too.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from typing import Any

from ettr.closing import closing_events as close_open_attempts
from ettr.events import Event, EventKind


def process_start_ticks(pid: int) -> int | None:
    """Start time of process `pid` in clock ticks since boot (None: no such process, or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int, ticks: Any) -> bool:
    if isinstance(ticks, int):
        return process_start_ticks(pid) == ticks  # the same process, not a later one with its pid
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def live_supervisor(events: Sequence[Event]) -> int | None:
    """The pid of a supervisor of this job still running on this host, if the ledger names one."""
    start = None
    for e in events:
        if e.kind is EventKind.SUPERVISOR_START:
            start = e
        elif e.kind is EventKind.JOB_END:
            start = None
    if start is None or not start.data:
        return None
    pid, host = start.data.get("pid"), start.data.get("host")
    if not isinstance(pid, int) or pid == os.getpid() or (host and host != socket.gethostname()):
        return None
    return pid if _alive(pid, start.data.get("pid_start_ticks")) else None


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


def job_id_of(events: Sequence[Event]) -> str | None:
    """The job id the first supervisor of this run directory recorded (None for a new one)."""
    for e in events:
        if e.kind is EventKind.SUPERVISOR_START and e.data and e.data.get("job_id"):
            return str(e.data["job_id"])
    return None
