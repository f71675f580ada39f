"""What a supervisor writes when it opens a job's books: the attempts a killed supervisor left open, closed
(`closing_events`), the index of the next attempt (`next_attempt`), and the job's opening records
(`opening_events`: JOB_SUBMITTED / JOB_ALLOCATED where first known, SUPERVISOR_START). `JobBooks.open` writes
them; nothing here touches the ledger.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ettr.closing import closing_events as close_open_attempts
from ettr.constants import SIGNALLED_MARK
from ettr.events import SUPERVISOR_RANK, Event, EventKind, Outcome
from ettr.procs import start_ticks
from ettr.run_env import signals_received
from ettr.supervisor.config import RunConfig
from ettr.supervisor.hidden_ends import ended_by_signal
from ettr.supervisor.jobinfo import job_times
from ettr.supervisor.launch import detect_launcher


def closing_events(events: Sequence[Event], run_dir: str | os.PathLike[str] | None = None) -> list[Event]:
    """ATTEMPT_END events for the attempts that were started and never ended, each at its last event.

    A supervisor lost (killed) while its attempt ran is a lost node (a failure), unless the attempt was being
    stopped from outside when it went: the supervisor had received a stop signal (its `SIGNALLED_MARK`), or
    the attempt's processes handled a scheduler's signal themselves and stopped training (their notes in
    `run_dir`, `ettr.bootstrap.outside_signals`). Then Slurm's kill after `KillWait` (a requeue, a
    preemption, a time limit) only came before the job had finished ending: preempted (interrupted for
    SIGINT), as the supervisor would have recorded it, with the exit status unknown."""
    closed = close_open_attempts(events, reason=_LOST, extra={"signal": None})
    return [_stopped_from_outside(end, events, run_dir) for end in closed]


_LOST = "its supervisor was lost (killed) while it ran; closed from the ledger"


def _stopped_from_outside(
    end: Event, events: Sequence[Event], run_dir: str | os.PathLike[str] | None
) -> Event:
    """`end` (a closing ATTEMPT_END) as a preemption when the attempt was being stopped from outside."""
    attempt = end.attempt
    got = next(
        (
            str(e.data.get("signal"))
            for e in events
            if e.kind is EventKind.MARK
            and e.rank == SUPERVISOR_RANK
            and e.attempt == attempt
            and isinstance(e.data, dict)
            and e.data.get("name") == SIGNALLED_MARK
        ),
        None,
    )
    if got is not None:
        why = (
            f"its supervisor got {got} and passed it to the job, then was lost (killed) before the job ended"
        )
    else:
        noted = [] if run_dir is None else signals_received(run_dir, attempt)
        own = [e for e in events if e.attempt == attempt]
        stopped = ended_by_signal(noted, own)
        failed = [e.ts for e in own if e.kind is EventKind.FAILURE]
        if not stopped or (
            failed and min(failed) < stopped[0][0]
        ):  # a rank's failure came first: its teardown
            return end
        _, rank, got = stopped[0]
        why = (
            f"rank {rank} received {got} from outside (a scheduler or an operator) and stopped training; "
            "its supervisor was lost (killed) before the job ended"
        )
    outcome = Outcome.INTERRUPTED if got == "SIGINT" else Outcome.PREEMPTED
    data = {**(end.data or {}), "outcome": outcome.value, "reason": f"{why}; closed from the ledger"}
    return replace(end, data=data)


def next_attempt(events: Sequence[Event]) -> int:
    """The index the next attempt of this job gets (0 for a new job)."""
    used = (e.attempt for e in events if e.kind is EventKind.ATTEMPT_START or e.rank >= 0)
    return 1 + max(used, default=-1)


def opening_events(
    config: RunConfig, *, run_dir: Path, job_id: str, family: str, previous: Sequence[Event]
) -> list[Event]:
    """JOB_SUBMITTED / JOB_ALLOCATED where first known, and SUPERVISOR_START."""
    cfg = config
    times = job_times(submitted_at=cfg.submitted_at, allocated_at=cfg.allocated_at)
    known = {e.kind for e in previous}
    opening = []
    if times.submitted_at is not None and EventKind.JOB_SUBMITTED not in known:
        opening.append(Event(EventKind.JOB_SUBMITTED, times.submitted_at, 0, SUPERVISOR_RANK))
    if times.allocated_at is not None and EventKind.JOB_ALLOCATED not in known:
        opening.append(Event(EventKind.JOB_ALLOCATED, times.allocated_at, 0, SUPERVISOR_RANK))
    start: dict[str, Any] = {
        "pid": os.getpid(),
        "pid_start_ticks": start_ticks(os.getpid()),
        "host": socket.gethostname(),
        "command": list(cfg.command),
        "run_dir": str(run_dir),
        "launcher": detect_launcher(cfg.command).value,
        "max_restarts": cfg.max_restarts,
        "job_id": job_id,
        "family": family,
        "hang_timeout_s": cfg.hang_timeout_s or cfg.default_hang_timeout_s,
        "inject": [str(s) for s in cfg.inject],
        "auto": cfg.auto,
    }
    if os.environ.get("SLURM_JOB_ID"):
        start["slurm_job_id"] = os.environ["SLURM_JOB_ID"]
    if previous:  # a requeued run: its own wait in the queue (Slurm resets SubmitTime at a requeue)
        if times.submitted_at is not None:
            start["submitted_at"] = times.submitted_at
        if times.allocated_at is not None:
            start["allocated_at"] = times.allocated_at
    opening.append(Event(EventKind.SUPERVISOR_START, time.time(), 0, SUPERVISOR_RANK, data=start))
    return opening
