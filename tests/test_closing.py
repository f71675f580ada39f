"""Closing attempts a dead supervisor or publisher left open (`ettr.closing`)."""

from __future__ import annotations

from ettr.closing import closing_events
from ettr.events import SUPERVISOR_RANK, Event, EventKind


def test_dating_by_process_events_or_by_any_event():
    events = [
        Event(EventKind.ATTEMPT_START, 1.0, 0, SUPERVISOR_RANK),
        Event(EventKind.STEP, 2.0, 0, 0, step=1),
        Event(EventKind.MARK, 3.0, 0, SUPERVISOR_RANK, data={"name": "claim renewed"}),
    ]
    (by_process,) = closing_events(events, reason="r", extra={"signal": None})
    (by_any,) = closing_events(events, reason="r", dated_by_process_events=False)
    assert (by_process.ts, by_any.ts) == (2.0, 3.0)
    assert by_process.data == {"outcome": "failed", "exit_code": None, "signal": None, "reason": "r",
                               "closed_from_ledger": True}  # fmt: skip
    assert "signal" not in by_any.data
    assert closing_events([*events, by_any], reason="r") == []
