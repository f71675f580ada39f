"""Where a job stands, in words, for every renderer: ended, running (what it is doing now), supervisor lost
(since when, and what is at risk), or in progress (not known which). From `EttReport.state` and `open_job`."""

from __future__ import annotations

from datetime import UTC, datetime

from ettr.accounting import EttReport, JobState, OpenJob
from ettr.events import Bucket

_DOING = {
    Bucket.EFFECTIVE_TRAINING: "training",
    Bucket.WASTED_PROGRESS: "training",
    Bucket.CHECKPOINT_BLOCKING: "saving a checkpoint (the loop waits)",
    Bucket.EVALUATION: "evaluating",
    Bucket.INIT: "starting up",
    Bucket.COMPILE: "compiling",
    Bucket.RESTORE: "loading a checkpoint",
    Bucket.DATA_WAIT: "waiting for its first batch",
    Bucket.RESTART: "restarting after a failure",
    Bucket.SHUTDOWN: "shutting down",
    Bucket.OTHER: "no step or phase recorded since its last step",
    Bucket.SCHEDULING: "waiting in the scheduler's queue",
    Bucket.HARDWARE_SETUP: "setting up its hardware",
}

BADGES = {
    JobState.RUNNING: "running",
    JobState.SUPERVISOR_LOST: "supervisor lost",
    JobState.IN_PROGRESS: "in progress",
}
"""The short label of each state but `ended` (the HTML header's badge)."""


def utc(ts: float) -> str:
    """`2026-01-02 03:04:05 UTC`; a nonsense timestamp as itself, never an exception."""
    try:
        return datetime.fromtimestamp(ts, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, OSError, ValueError):
        return f"at {ts!r}"


def doing(o: OpenJob, as_of_ts: float) -> str:
    """What the job was doing at `as_of_ts` (the report's end): `attempt 2: training; last step 1234,
    0.1 s before`."""
    if o.attempt is None:
        return "no attempt started yet"
    if o.attempt_open and o.last_step is not None and o.bucket in (Bucket.OTHER, Bucket.EFFECTIVE_TRAINING):
        what = "training"  # after its last step, with no phase open: the next step, as far as the books say
    else:
        what = _DOING.get(o.bucket, "-") if o.bucket is not None else "-"
    if o.open_phases:
        what += f" (open: {', '.join(o.open_phases)})"
    if o.last_step is not None and o.last_step_ts is not None:
        what += f"; last step {o.last_step}, {max(0.0, as_of_ts - o.last_step_ts):.1f} s before"
    return f"attempt {o.attempt}: {what}"


def _risk(o: OpenJob, verb: str) -> str:
    if not o.attempt_open or o.last_step is None:
        return ""
    since = (
        "nothing committed yet"
        if o.last_commit_step is None
        else f"the last checkpoint (step {o.last_commit_step})"
    )
    return f"; {o.steps_at_risk} step(s) after {since} {verb}"


def status(report: EttReport) -> str | None:
    """One sentence on where the job stands; None when it ended."""
    o = report.open_job
    if report.state is JobState.ENDED or o is None:
        return None
    if report.state is JobState.RUNNING:
        return (
            f"running: {doing(o, report.wall_end_ts)}; the figures are so far, no failure counted for the attempt that runs"
            + _risk(o, "would be lost if it failed now")
        )
    if report.state is JobState.SUPERVISOR_LOST:
        last = o.last_event_ts if o.last_event_ts is not None else report.wall_end_ts
        stopping = ""
        if o.stop_signal is not None and o.stop_signal_ts is not None:  # Slurm's kill after KillWait
            stopping = (
                f", after it got {o.stop_signal} at +{o.stop_signal_ts - report.wall_start_ts:.1f} s: the job was "
                "being stopped from outside (a time limit, a preemption, a requeue), a requeue closes it as preempted"
            )
        # An attempt still open at the loss is not counted until a requeue says what happened; one that had
        # ended (a failure recorded, no next attempt and no job end) is counted as it ended.
        counted = (
            "no failure is counted until a requeue says what happened"
            if o.attempt_open
            else f"attempt {o.attempt} is counted as it ended, and no next attempt or job end was recorded"
        )
        return (
            f"supervisor lost at +{last - report.wall_start_ts:.1f} s ({utc(last)}, the last event in its "
            f"books; then {doing(o, report.wall_end_ts)}{stopping}): the report ends there, and {counted}"
            + _risk(o, "are at risk")
        )
    return (
        f"in progress: no job end recorded, and whether its supervisor still runs cannot be told from here; "
        f"{doing(o, report.wall_end_ts)}; closed at the report time, no failure counted for its open attempt"
        + _risk(o, "are at risk")
    )
