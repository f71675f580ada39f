"""`compute`: a job's events and the time to close it at -> its `EttReport`. Pure: no I/O, no clock."""

from __future__ import annotations

import gc
import math
from collections.abc import Iterable, Mapping, Sequence
from enum import StrEnum
from types import MappingProxyType

from ettr.accounting.attempts import (
    Attempt,
    JobEvents,
    data_of,
    gather,
    resolve_attempts,
    surviving_commits,
    wall_bounds,
)
from ettr.accounting.causes import failure_causes
from ettr.accounting.fence import fence
from ettr.accounting.liveness import NOT_ENDED, JobState, OpenJob, counts_as_failure, job_state, steps_after
from ettr.accounting.model import AttemptReport, EttReport, Recovery, Segment, TtsWindow
from ettr.accounting.slowdown import AttemptSteps, step_slowdown
from ettr.accounting.slowsteps import slow_steps
from ettr.accounting.steptime import blocking_spans, kept_step_times, overlaps_any, step_intervals, step_time
from ettr.accounting.stragglers import rank_speed
from ettr.accounting.timeline import build_segments
from ettr.accounting.ttr import breakdowns, with_nothing_restored
from ettr.accounting.window import DEFAULT_WINDOW_S, check_window, ett_window
from ettr.constants import SIGNALLED_MARK, UNRECORDED_MARK
from ettr.events import SUPERVISOR_RANK, Bucket, Event, EventKind, Outcome, Phase


class Loss(StrEnum):
    """Where a bucket's time counts: effective training, idleness or failure."""

    EFFECTIVE = "effective"
    IDLENESS = "idleness"
    FAILURE = "failure"


_ALWAYS_FAILURE = frozenset({Bucket.WASTED_PROGRESS, Bucket.RESTART})
_STARTUP_BUCKETS = frozenset({Bucket.INIT, Bucket.COMPILE, Bucket.RESTORE, Bucket.DATA_WAIT})
# A requeued run's wait in the queue and its set-up: before the job's first attempt they are the job's cost of
# starting; between attempts, what a preemption cost.
_RECOVERY_BUCKETS = _STARTUP_BUCKETS | {Bucket.SCHEDULING, Bucket.HARDWARE_SETUP}
_PHASE_ORDER = {phase.value: i for i, phase in enumerate(Phase)}


def classify(bucket: Bucket, *, attempt_position: int) -> Loss:
    """Whether time in `bucket` of the attempt at `attempt_position` (0 = the job's first attempt, which
    also owns the time before it) is effective training, idleness or failure.

    Start-up buckets (init, compile, restore, data_wait) and the scheduler's (scheduling, hardware_setup: a
    requeued run's wait) are idleness in the first attempt and failure in later ones; wasted_progress and
    restart are always failure; everything else is idleness.
    """
    if bucket == Bucket.EFFECTIVE_TRAINING:
        return Loss.EFFECTIVE
    if bucket in _ALWAYS_FAILURE or (bucket in _RECOVERY_BUCKETS and attempt_position >= 1):
        return Loss.FAILURE
    return Loss.IDLENESS


def compute(
    events: Iterable[Event],
    now: float,
    *,
    job_id: str = "",
    supervisor_alive: bool | None = None,
    window_s: float = DEFAULT_WINDOW_S,
) -> EttReport:
    """The ETT report of one job from all its events (supervisor and every rank, any order).

    `now` closes what the events leave open: the job's end when there is no JOB_END (pass the last event's
    ts for a dead job, the current time for a live one; the report then says `in_progress`), and attempts
    or phases that never ended. `supervisor_alive` says, for a job without JOB_END, whether its supervisor
    still runs (True: `running`; False: `supervisor_lost`; None: not known); an open last attempt is then
    `running` or `unknown`, not a failure. `window_s` is the length of `EttReport.window` (ETT over the
    last `window_s` of wall time; ValueError unless positive). The rules are in docs/buckets.md. Never reads
    the clock or any file.
    """
    window_s = check_window(window_s)
    # A million events make a few million small objects and nothing cyclic: the cyclic collector would
    # rescan them over and over (about 40% of the time) to free nothing.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _compute(events, now, job_id, supervisor_alive, window_s)
    finally:
        if collecting:
            gc.enable()


def timed_steps(events: Iterable[Event], now: float) -> list[tuple[float, float]]:
    """(end, seconds) of every timed step of every attempt's reference rank, kept or not, in time order: the
    step-time rules (`ettr.accounting.steptime`) less the kept-step one. What ran when, to compare the steps
    of two jobs over the wall time both were training (`ettr demo`). `now` as for `compute`. Pure."""
    job = gather(fence(events)[0])
    wall_start, wall_end = wall_bounds(job, now)
    timed: list[tuple[float, float]] = []
    for attempt in resolve_attempts(job, wall_start, wall_end):
        blocking = blocking_spans(attempt.phases)
        timed += [
            (end, end - begin)
            for _, begin, end in step_intervals(attempt.step_ts, attempt.step_numbers)
            if end >= begin and not overlaps_any(blocking, begin, end)
        ]
    return sorted(timed)


def _compute(
    events: Iterable[Event], now: float, job_id: str, supervisor_alive: bool | None, window_s: float
) -> EttReport:
    kept, num_fenced = fence(events)
    job = gather(kept)
    wall_start, wall_end = wall_bounds(job, now)
    attempts = resolve_attempts(job, wall_start, wall_end, supervisor_alive=supervisor_alive)
    segments = build_segments(job, attempts, wall_start, wall_end)
    wall_s = wall_end - wall_start

    position_of: dict[int | None, int] = {a.index: a.position for a in attempts}
    loss_of = {
        (b, later): classify(b, attempt_position=int(later)) for b in Bucket for later in (False, True)
    }
    by_bucket: dict[Bucket, list[float]] = {b: [] for b in Bucket}
    by_attempt: dict[int | None, dict[Bucket, list[float]]] = {}
    by_loss: dict[Loss, list[float]] = {loss: [] for loss in Loss}
    for start, end, bucket, owner in segments:
        duration = end - start  # exact for nearby floats, so the fsums below add up to wall_s
        by_bucket[bucket].append(duration)
        per_bucket = by_attempt.get(owner)
        if per_bucket is None:
            per_bucket = by_attempt[owner] = {b: [] for b in Bucket}
        per_bucket[bucket].append(duration)
        by_loss[loss_of[bucket, position_of.get(owner, 0) > 0]].append(duration)

    effective_s, idleness_s, failure_s = (math.fsum(by_loss[loss]) for loss in Loss)

    def pct(seconds: float) -> float:
        return seconds / wall_s * 100.0 if wall_s > 0 else 0.0

    kept_times = {
        a.index: kept_step_times(a.step_ts, a.step_numbers, a.phases, a.keep_up_to_step) for a in attempts
    }
    attempt_reports = tuple(
        _attempt_report(a, by_attempt.get(a.index), kept_times[a.index]) for a in attempts
    )
    tts_window = _tts_window(job.allocated_ts, job.supervisor_start_ts, wall_start, attempt_reports)
    recoveries = _recoveries(attempt_reports)
    ttr_parts, tts_parts = breakdowns(
        {i: raw.rank_events for i, raw in job.attempts.items()},
        attempts,
        [(r.failed.index, r.recovered.index) for r in recoveries],
        None if tts_window is None else (tts_window.origin_ts, tts_window.attempt),
        job.runs,
    )
    resumes = {a.index: (a.resumed_from_step, bool(a.resumed_step_unknown)) for a in attempt_reports}
    ttr_parts = tuple(
        with_nothing_restored(p, *resumes.get(p.recovered_attempt, (0, True))) for p in ttr_parts
    )
    job_phases: dict[str, list[float]] = {}
    for report in attempt_reports:
        for name, seconds in report.phases_s.items():
            job_phases.setdefault(name, []).append(seconds)
    job_end_data = data_of(job.job_end) if job.job_end is not None else None
    slowdown = step_slowdown(AttemptSteps(a.index, a.step_ts, a.phases, a.step_numbers) for a in attempts)
    ranks = rank_speed({i: raw.rank_events for i, raw in job.attempts.items()})
    return EttReport(
        job_id=job_id,
        wall_start_ts=wall_start,
        wall_end_ts=wall_end,
        wall_s=wall_s,
        in_progress=job.job_end is None,
        ett_pct=pct(effective_s),
        idleness_pct=pct(idleness_s),
        failure_pct=pct(failure_s),
        effective_training_s=effective_s,
        idleness_s=idleness_s,
        failure_s=failure_s,
        tts_s=None if tts_window is None else tts_window.duration_s,
        ttr_s=tuple(r.ttr_s for r in recoveries),
        num_failures=sum(1 for a in attempts if counts_as_failure(a.outcome)),
        buckets_s=MappingProxyType({b: math.fsum(by_bucket[b]) for b in Bucket}),
        attempts=attempt_reports,
        phases_s=MappingProxyType({name: math.fsum(job_phases[name]) for name in _phase_order(job_phases)}),
        segments=tuple(segments),
        recompiles=tuple(job.recompiles),
        checkpoint_commits=tuple(job.commits),
        checkpoint_errors=tuple(sorted(job.checkpoint_errors, key=lambda c: c.ts)),
        submitted_ts=job.submitted_ts,
        allocated_ts=job.allocated_ts,
        supervisor_start_ts=job.supervisor_start_ts,
        job_exit_status=_exit_status(job_end_data),
        tts_window=tts_window,
        recoveries=recoveries,
        failures=failure_causes(attempt_reports),
        num_fenced_events=num_fenced,
        slowdown=slowdown,
        ttr_parts=ttr_parts,
        tts_parts=tts_parts,
        step_time=step_time([d for times in kept_times.values() for d in times]),
        rank_speed=ranks,
        slow_steps=slow_steps(
            [(a.index, a.position, kept_times[a.index]) for a in attempts], slowdown, ranks
        ),
        ett_unknown=_why_ett_unknown(
            attempt_reports, heard_from_job=any(e.rank >= 0 for e in kept), unrecorded=unrecorded_pids(kept)
        ),
        window=ett_window(
            segments,
            wall_start,
            wall_end,
            window_s,
            lambda bucket, owner: loss_of[bucket, position_of.get(owner, 0) > 0].value,
        ),
        state=job_state(ended=job.job_end is not None, supervisor_alive=supervisor_alive),
        open_job=None
        if job.job_end is not None
        else _open_job(job, attempts, segments, job_state(ended=False, supervisor_alive=supervisor_alive)),
    )


_RAN_ITS_COURSE = (Outcome.COMPLETED, Outcome.PREEMPTED, Outcome.INTERRUPTED)


_STILL_OPEN = (Outcome.RUNNING, Outcome.UNKNOWN)


def unrecorded_pids(events: Iterable[Event]) -> list[int]:
    """The processes that stepped an optimizer without being ranks (`UNRECORDED_MARK`), sorted."""
    pids = {
        pid
        for e in events
        if e.kind is EventKind.MARK and e.data is not None and e.data.get("name") == UNRECORDED_MARK
        for pid in (e.data.get("pids") or ())
        if type(pid) is int
    }
    return sorted(pids)


def _why_ett_unknown(
    attempts: Sequence[AttemptReport], *, heard_from_job: bool, unrecorded: Sequence[int] = ()
) -> str | None:
    """Why the job's ETT cannot be told: it ran to an end without any training step seen (None otherwise).

    A job that failed before any step, or one still starting, did train nothing so far: 0% is right there;
    unless no process of the job ever reported (`heard_from_job` False: not even the bootstrap's start): then
    ettr never saw the training process (a wrapper that cleared its environment), which may have trained for
    hours before it failed, and its steps are unknown however the job ended. Likewise when processes the
    script started itself stepped an optimizer without being ranks (`unrecorded`: Hogwild-style training)."""
    if not attempts or any(a.last_step is not None for a in attempts):
        return None
    if unrecorded:
        return (
            f"no training step was recorded, but process{'es' if len(unrecorded) > 1 else ''} "
            f"{', '.join(map(str, unrecorded))}, started by the script itself, stepped an optimizer without "
            "joining a process group (Hogwild-style training): they are no ranks, so their steps were not counted"
        )
    if not heard_from_job and not any(a.outcome in _STILL_OPEN for a in attempts):
        return (
            "no training step was seen, and no process of the job reported to ettr: its steps are unknown "
            "(ettr's bootstrap did not reach the training process: a wrapper that clears its environment, as "
            "env -i, sudo, ssh or a container do, or a command that runs no python)"
        )
    if not any(a.outcome in _RAN_ITS_COURSE for a in attempts):
        return None
    return (
        "no training step was seen: the job ran without an optimizer step ettr could see (an inference or "
        "evaluation job, or a loop that updates its weights without torch.optim or a backward pass)"
    )


def _attempt_report(
    attempt: Attempt, buckets: Mapping[Bucket, list[float]] | None, kept_times: list[float]
) -> AttemptReport:
    phases: dict[str, list[float]] = {}
    for begin, end, _, name in attempt.phases:
        phases.setdefault(name, []).append(end - begin)
    return AttemptReport(
        index=attempt.index,
        start_ts=attempt.start_ts,
        end_ts=attempt.end_ts,
        outcome=attempt.outcome,
        exit_code=attempt.exit_code,
        resumed_from_step=attempt.resumed_from_step,
        last_step=max(attempt.step_numbers)
        if attempt.step_numbers and not attempt.resumed_step_unknown
        else None,
        lost_steps=attempt.lost_steps,
        buckets_s=MappingProxyType({b: math.fsum(buckets[b]) if buckets else 0.0 for b in Bucket}),
        training_start_ts=attempt.training_start_ts,
        num_steps=len(set(attempt.step_numbers)),  # a step recorded twice (hook and script) is one step
        reference_rank=attempt.reference_rank,
        closed_by_accounting=attempt.closed_by_accounting,
        failure=None if attempt.failure is None else MappingProxyType(dict(attempt.failure)),
        phases_s=MappingProxyType({name: math.fsum(phases[name]) for name in _phase_order(phases)}),
        resumed_step_unknown=attempt.resumed_step_unknown,
        lost_steps_estimated=attempt.lost_steps_estimated,
        step_time=step_time(kept_times),
    )


def _phase_order(names: Iterable[str]) -> list[str]:
    """Phases in the order of `Phase` (start-up first), unknown names after them."""
    return sorted(names, key=lambda name: (_PHASE_ORDER.get(name, len(_PHASE_ORDER)), name))


def _tts_window(
    allocated_ts: float | None,
    supervisor_start_ts: float | None,
    wall_start: float,
    attempts: tuple[AttemptReport, ...],
) -> TtsWindow | None:
    """Origin (allocation, else supervisor start, else wall start) to the first training start of attempt 0,
    else of the first attempt that trained; None when none trained."""
    origin = next(ts for ts in (allocated_ts, supervisor_start_ts, wall_start) if ts is not None)
    trained = next((a for a in attempts if a.training_start_ts is not None), None)
    if trained is None or trained.training_start_ts is None:
        return None
    return TtsWindow(origin_ts=origin, training_start_ts=trained.training_start_ts, attempt=trained.index)


def _recoveries(attempts: tuple[AttemptReport, ...]) -> tuple[Recovery, ...]:
    """Each attempt that did not complete and the next attempt that trained after it: failure detected (the
    failed attempt's end) to that attempt's training start."""
    found = []
    for position, attempt in enumerate(attempts):
        if not counts_as_failure(attempt.outcome):
            continue
        recovered = next((a for a in attempts[position + 1 :] if a.training_start_ts is not None), None)
        if recovered is not None and recovered.training_start_ts is not None:
            found.append(
                Recovery(
                    failed=attempt,
                    recovered=recovered,
                    detected_ts=attempt.end_ts,
                    training_start_ts=recovered.training_start_ts,
                )
            )
    return tuple(found)


def _open_job(job: JobEvents, attempts: list[Attempt], segments: list[Segment], state: JobState) -> OpenJob:
    """What a job without an end was doing at the end of its report."""
    last = attempts[-1] if attempts else None
    commits = [c.step for c in surviving_commits(job) if c.step is not None]
    last_commit = max(commits) if commits else None
    attempt_open = last is not None and last.outcome in NOT_ENDED
    end_ts = last.end_ts if last is not None else None
    raw = job.attempts.get(last.index) if attempt_open and last is not None else None
    stop = next(
        (
            e
            for e in (raw.rank_events.get(SUPERVISOR_RANK, []) if raw is not None else [])
            if e.kind is EventKind.MARK and data_of(e).get("name") == SIGNALLED_MARK
        ),
        None,
    )
    return OpenJob(
        state=state,
        last_event_ts=job.latest_ts,
        attempt=None if last is None else last.index,
        attempt_open=attempt_open,
        bucket=segments[-1].bucket if segments else None,
        open_phases=tuple(dict.fromkeys(name for _, end, _, name in last.phases if end == end_ts))
        if attempt_open and last is not None
        else (),
        last_step=max(last.step_numbers) if last is not None and last.step_numbers else None,
        last_step_ts=last.step_ts[-1] if last is not None and last.step_ts else None,
        last_commit_step=last_commit,
        steps_at_risk=steps_after(last.step_numbers, last_commit) if attempt_open and last is not None else 0,
        stop_signal=None if stop is None else str(data_of(stop).get("signal"))[:20],
        stop_signal_ts=None if stop is None else stop.ts,
    )


def _exit_status(data: Mapping | None) -> int | None:
    value = (data or {}).get("exit_status")
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None
