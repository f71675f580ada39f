"""Closing the books of attempts whose writer died: the ATTEMPT_END a killed supervisor (or publisher) never wrote.

Both the supervisor (after its own SIGKILL) and the publisher (after a dead publisher's takeover) need the same
thing, so it lives here, beside neither.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ettr.events import SUPERVISOR_RANK, Event, EventKind, Outcome


def closing_events(
    events: Sequence[Event],
    *,
    reason: str,
    dated_by_process_events: bool = True,
    extra: Mapping[str, Any] | None = None,
) -> list[Event]:
    """An ATTEMPT_END (outcome failed, `closed_from_ledger`) for each attempt started and never ended.

    Each is dated at the attempt's last event: its training processes' events (rank >= 0) and its start when
    `dated_by_process_events`, else any event of the attempt.
    """
    started: set[int] = set()
    ended: set[int] = set()
    last_ts: dict[int, float] = {}
    for e in events:
        if e.kind is EventKind.ATTEMPT_START:
            started.add(e.attempt)
        elif e.kind is EventKind.ATTEMPT_END:
            ended.add(e.attempt)
        if not dated_by_process_events or e.rank >= 0 or e.kind is EventKind.ATTEMPT_START:
            last_ts[e.attempt] = max(last_ts.get(e.attempt, e.ts), e.ts)
    data = {"outcome": Outcome.FAILED.value, "exit_code": None, **(extra or {}), "reason": reason,
            "closed_from_ledger": True}  # fmt: skip
    return [
        Event(EventKind.ATTEMPT_END, last_ts[attempt], attempt, SUPERVISOR_RANK, data=dict(data))
        for attempt in sorted(started - ended)
    ]
