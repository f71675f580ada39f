"""A job without an end: is it running, or was its supervisor lost, and what is it doing now?

The accounting reads no clock and no /proc: whether the job's supervisor still runs is an input to
`compute` (`supervisor_alive`: `ettr.report.load` asks `ettr.closing.supervisor_alive`). From it, an open last
attempt is `running` (alive) or `unknown` (lost, or not known), never a failure: a failure is counted when
the books say one happened (an ATTEMPT_END, a FAILURE a rank recorded, or a requeue's closing of the lost
attempt). Rules: docs/buckets.md, "Jobs without an end".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from ettr.events import Bucket, Outcome

NOT_ENDED = frozenset({Outcome.RUNNING, Outcome.UNKNOWN})
"""Outcomes of an attempt that has not ended (as far as the books know): neither a success nor a failure."""


def counts_as_failure(outcome: Outcome) -> bool:
    """Whether an attempt with `outcome` is one of the job's failures (`num_failures`)."""
    return outcome is not Outcome.COMPLETED and outcome not in NOT_ENDED


class JobState(StrEnum):
    """Where a job stands when it is reported."""

    ENDED = "ended"
    """Its supervisor recorded the job's end."""
    RUNNING = "running"
    """No end yet and its supervisor is alive: the figures are so far."""
    SUPERVISOR_LOST = "supervisor_lost"
    """No end, and the supervisor its books name is gone (killed, its node lost): closed at its last event."""
    IN_PROGRESS = "in_progress"
    """No end, and whether its supervisor still runs is not known (not checked, or on another host)."""


def job_state(*, ended: bool, supervisor_alive: bool | None) -> JobState:
    if ended:
        return JobState.ENDED
    if supervisor_alive is None:
        return JobState.IN_PROGRESS
    return JobState.RUNNING if supervisor_alive else JobState.SUPERVISOR_LOST


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenJob:
    """What a job without an end was doing when it was reported (`EttReport.open_job`)."""

    state: JobState
    last_event_ts: float | None
    """The last event in its books: for a lost supervisor, its last sign of life."""
    attempt: int | None
    """The last attempt (None: none started)."""
    attempt_open: bool
    """The last attempt has no end recorded (it is running, or how it ended is unknown)."""
    bucket: Bucket | None
    """Where its time was going at the end of the report (the timeline's last piece)."""
    open_phases: tuple[str, ...]
    """Phases of the last attempt's reference rank still open at the end."""
    last_step: int | None
    last_step_ts: float | None
    last_commit_step: int | None
    """The newest committed checkpoint's step (None: none)."""
    steps_at_risk: int
    """Steps of the open attempt after the newest checkpoint: what a failure now would lose (0 when the
    attempt is not open)."""
    stop_signal: str | None = None
    """The signal that reached the supervisor during the open attempt, asking the job to stop (its
    `supervisor_signalled` MARK: a scheduler's SIGTERM, Slurm's SIGUSR1; None: none on record)."""
    stop_signal_ts: float | None = None
    """When it did."""


def steps_after(step_numbers: Sequence[int], last_commit_step: int | None) -> int:
    """Distinct steps above `last_commit_step` (all of them when nothing was committed)."""
    if last_commit_step is None:
        return len(set(step_numbers))
    return len({s for s in step_numbers if s > last_commit_step})
