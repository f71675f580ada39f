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


def test_report_time_follows_a_live_requeued_supervisor_and_closes_a_dead_one():
    import os

    from ettr.report.load import report_time

    mine = {"pid": os.getppid(), "job_id": "j"}  # a live process that is not this one
    dead = {"pid": 2**22 + 12345, "job_id": "j"}  # above any pid this machine hands out
    first_run = [
        Event(EventKind.SUPERVISOR_START, 1.0, 0, SUPERVISOR_RANK, data=dead),
        Event(EventKind.JOB_END, 5.0, 0, SUPERVISOR_RANK),
    ]
    requeued = [*first_run, Event(EventKind.SUPERVISOR_START, 6.0, 1, SUPERVISOR_RANK, data=mine)]
    assert report_time(first_run, wall_clock_s=100.0) == 5.0
    assert report_time(requeued, wall_clock_s=100.0) == 100.0  # still running: now, not the last event
    killed = [*first_run, Event(EventKind.SUPERVISOR_START, 6.0, 1, SUPERVISOR_RANK, data=dead)]
    assert report_time(killed, wall_clock_s=100.0) == 6.0


def test_the_report_reads_a_live_job_as_running_and_a_dead_ones_as_supervisor_lost():
    import os
    import socket

    from ettr.accounting import JobState
    from ettr.closing import supervisor_alive
    from ettr.events import Outcome
    from ettr.report.load import compute_report

    def books(start: dict) -> list[Event]:
        return [
            Event(EventKind.SUPERVISOR_START, 1.0, 0, SUPERVISOR_RANK, data={"job_id": "j", **start}),
            Event(EventKind.ATTEMPT_START, 1.5, 0, SUPERVISOR_RANK),
            *(Event(EventKind.STEP, 2.0 + i, 0, 0, step=i + 1) for i in range(3)),
        ]

    alive = books({"pid": os.getppid()})  # a live process (the pid check of `ettr.procs.pid_alive`)
    dead = books({"pid": 2**22 + 12345})  # above any pid this machine hands out
    elsewhere = books({"pid": os.getppid(), "host": socket.gethostname() + "-not"})
    assert (supervisor_alive(alive), supervisor_alive(dead), supervisor_alive(elsewhere)) == (
        True,
        False,
        None,
    )
    assert supervisor_alive([*alive, Event(EventKind.JOB_END, 9.0, 0, SUPERVISOR_RANK)]) is None

    running = compute_report(alive, job_id="j")
    assert running.state is JobState.RUNNING and running.attempts[0].outcome is Outcome.RUNNING
    assert running.wall_end_ts > 4.0  # closed now, not at its last event
    lost = compute_report(dead, job_id="j")
    assert lost.state is JobState.SUPERVISOR_LOST and lost.attempts[0].outcome is Outcome.UNKNOWN
    assert lost.wall_end_ts == 4.0 and lost.num_failures == 0
    assert compute_report(elsewhere, job_id="j").state is JobState.IN_PROGRESS
