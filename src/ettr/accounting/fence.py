"""Fencing: events a training process recorded after its attempt was closed do not count.

An attempt is closed by its ATTEMPT_END (written by its supervisor when the processes exited, or by a
requeued supervisor or a report for an attempt whose supervisor was killed, at its last event). A process of
that attempt that is still running afterwards (an orphan that escaped the supervisor) is not part of the job
any more: its steps, phases and commits would be counted twice (beside the next attempt's) or would stretch
a closed attempt. They are dropped here, and counted, so the report can say how many. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable

from ettr.events import Event, EventKind

FENCE_GRACE_S = 2.0
"""Events up to this long after their attempt's end still count: a recorder's last flush and clock skew
between the hosts of one job (every supervisor writes its node's ATTEMPT_END; the latest one closes)."""


def fence(events: Iterable[Event], *, grace_s: float = FENCE_GRACE_S) -> tuple[list[Event], int]:
    """(events without those of training ranks recorded after their attempt's end + `grace_s`, how many
    were dropped). Supervisor events (rank < 0) are never dropped."""
    events = list(events)
    closed_at: dict[int, float] = {}
    for event in events:
        if event.kind is EventKind.ATTEMPT_END:
            closed_at[event.attempt] = max(event.ts, closed_at.get(event.attempt, event.ts))
    if not closed_at:
        return events, 0
    kept = [
        e
        for e in events
        if e.rank < 0 or e.attempt not in closed_at or e.ts <= closed_at[e.attempt] + grace_s
    ]
    return kept, len(events) - len(kept)
