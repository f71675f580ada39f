"""The timeline sweep: gives every instant of a job's wall time to exactly one bucket.

Each attempt is swept once over its sorted boundary points (region changes, step boundaries, phase begins
and ends), keeping a count of open phases per precedence class: O(n log n) in the number of events.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import itemgetter

from ettr.accounting.attempts import Attempt, JobEvents, RunStart
from ettr.accounting.liveness import NOT_ENDED, counts_as_failure
from ettr.accounting.model import Segment
from ettr.accounting.ttr import queue_wait
from ettr.events import PHASE_BUCKET, Bucket, Outcome

PRECEDENCE: tuple[Bucket, ...] = (
    Bucket.CHECKPOINT_BLOCKING,
    Bucket.COMPILE,
    Bucket.RESTORE,
    Bucket.EVALUATION,
    Bucket.DATA_WAIT,
    Bucket.SHUTDOWN,
    Bucket.OTHER,
    Bucket.INIT,
)
"""Buckets that phases map to, highest precedence first: where phases overlap, the first one wins."""

_CLASS = {bucket: i for i, bucket in enumerate(PRECEDENCE)}
_EVAL_CLASS = _CLASS[Bucket.EVALUATION]
# Before the training loop starts, checkpointing, shutdown and "other" phases are part of start-up.
_STARTUP_BUCKET = tuple(
    Bucket.INIT if b in (Bucket.CHECKPOINT_BLOCKING, Bucket.SHUTDOWN, Bucket.OTHER) else b for b in PRECEDENCE
)

# Kinds of region inside an attempt: what phases may override there.
_STARTUP = 0  # [attempt start, training start): default init; phases map through _STARTUP_BUCKET
_TRAINING = 1  # step intervals and the tail after the last step: phases override by PRECEDENCE
_LOCKED = 2  # shutdown tail of a completed last attempt: shutdown whatever phases say, but evaluation
_TORN_DOWN = 3  # failure instant -> attempt end of a failed attempt: `restart`, whatever phases say


def build_segments(
    job: JobEvents, attempts: Sequence[Attempt], wall_start: float, wall_end: float
) -> list[Segment]:
    """The job's timeline: consecutive segments from `wall_start` to `wall_end`, adjacent pieces of the same
    bucket and attempt merged. Zero-length pieces are dropped."""
    segments: list[list] = []
    first_start = attempts[0].start_ts if attempts else wall_end
    owner = attempts[0].index if attempts else None
    cursor = wall_start

    def until(ts: float | None, bucket: Bucket) -> None:
        nonlocal cursor
        stop = first_start if ts is None else min(max(ts, cursor), first_start)
        _add(segments, cursor, stop, bucket, owner)
        cursor = stop

    # Before the first attempt: scheduling, hardware set-up, then the supervisor's own start-up (init).
    if job.submitted_ts is not None:
        if job.allocated_ts is not None:
            until(job.allocated_ts, Bucket.SCHEDULING)
        else:  # allocation unknown: the wait cannot be called scheduling or set-up
            until(job.supervisor_start_ts, Bucket.OTHER)
    if job.allocated_ts is not None:
        until(job.supervisor_start_ts, Bucket.HARDWARE_SETUP)
    until(None, Bucket.INIT)

    for position, attempt in enumerate(attempts):
        if position > 0:
            before = attempts[position - 1]
            again = before.outcome is Outcome.COMPLETED  # the job run again after it ended: nothing failed
            _add_gap(segments, before.end_ts, attempt.start_ts, attempt.index, job.runs, again=again)
        _sweep_attempt(
            segments, attempt, is_last=position == len(attempts) - 1, job_restarting=job.job_end is None
        )
    if attempts:
        # After the last attempt: the job's shutdown, unless the job has no end yet and that attempt failed:
        # then the supervisor is restarting it (or was lost while it did).
        last = attempts[-1]
        restarting = job.job_end is None and counts_as_failure(last.outcome)
        _add(segments, last.end_ts, wall_end, Bucket.RESTART if restarting else Bucket.SHUTDOWN, last.index)
    return [Segment(*s) for s in segments]


def _add_gap(
    segments: list[list], start: float, end: float, attempt: int, runs: Sequence[RunStart], *, again: bool
) -> None:
    """The gap between two attempts: `restart`, except a requeued run's own wait in the scheduler's queue
    (`scheduling`, submitted -> allocated, both known) and its hardware set-up (allocated -> supervisor
    start), when a supervisor started in the gap with its run's times. After an attempt that completed
    (`again`: the job run again once it had ended), what would be `restart` is `other`: nothing failed."""
    between = Bucket.OTHER if again else Bucket.RESTART
    run = next((r for r in runs if start < r.ts <= end), None)
    wait = None if run is None else queue_wait(run, start)
    if run is None or wait is None:
        _add(segments, start, end, between, attempt)
        return
    queued, allocated = wait
    _add(segments, start, queued, between, attempt)  # teardown until the requeue
    _add(segments, queued, allocated, Bucket.SCHEDULING, attempt)
    _add(segments, allocated, run.ts, Bucket.HARDWARE_SETUP, attempt)
    _add(segments, run.ts, end, between, attempt)  # the supervisor's relaunch


def _add(segments: list[list], start: float, end: float, bucket: Bucket, attempt: int | None) -> None:
    if end <= start:
        return
    if segments:
        last = segments[-1]
        if last[2] is bucket and last[3] == attempt and last[1] == start:
            last[1] = end
            return
    segments.append([start, end, bucket, attempt])


def _base_regions(
    attempt: Attempt, *, is_last: bool, job_restarting: bool = False
) -> tuple[list[float], list[Bucket], list[int], list[Bucket]]:
    """The region defaults of an attempt as consecutive pieces (end, default bucket, region kind, bucket of an
    evaluation there). An evaluation evaluates the state after the step before it: `evaluation` if that
    step was kept (or it is the state the attempt started from), else `wasted_progress`, rolled back with
    the steps around it."""
    end = attempt.end_ts
    evaluation, wasted = Bucket.EVALUATION, Bucket.WASTED_PROGRESS
    if attempt.training_start_ts is None:
        return [end], [Bucket.INIT], [_STARTUP], [evaluation]
    ends, buckets, regions, evals = [attempt.training_start_ts], [Bucket.INIT], [_STARTUP], [evaluation]
    keep = attempt.keep_up_to_step
    effective = Bucket.EFFECTIVE_TRAINING
    previous: int | None = None  # the step before this interval (None: the state the attempt started from)
    for ts, step in zip(attempt.step_ts, attempt.step_numbers, strict=True):
        bucket = effective if step <= keep else wasted
        evaluated = evaluation if previous is None or previous <= keep else wasted
        previous = step
        if buckets[-1] is bucket and regions[-1] == _TRAINING and evals[-1] is evaluated:
            ends[-1] = ts
        else:
            ends.append(ts)
            buckets.append(bucket)
            regions.append(_TRAINING)
            evals.append(evaluated)
    ends.append(end)
    evals.append(evaluation if previous is None or previous <= keep else wasted)
    if attempt.outcome == Outcome.COMPLETED:
        buckets.append(Bucket.SHUTDOWN)
        regions.append(_LOCKED if is_last else _TRAINING)
    elif attempt.outcome in NOT_ENDED:
        # Still running (or how it ends is unknown): after its last step the books say nothing yet (a step in
        # flight, or a hang not yet detected), unless a phase does.
        buckets.append(Bucket.OTHER)
        regions.append(_TRAINING)
    elif _stopped_with_everything_kept(attempt):
        # A clean preemption (or Ctrl-C) whose every step was kept: nothing after its last step was lost,
        # the time to the end is its save and teardown.
        buckets.append(Bucket.SHUTDOWN)
        regions.append(_TRAINING)
    else:  # from the last step to the failure: progress that was lost
        failure = _teardown_from(attempt, is_last=is_last, job_restarting=job_restarting)
        buckets.append(wasted)
        regions.append(_TRAINING)
        if failure is not None and failure < end:
            # After the failure, the teardown (the other processes dying, the launcher exiting): `restart`.
            ends[-1] = max(failure, ends[-2])  # a failure before the last recorded step: from that step
            ends.append(end)
            evals.append(evals[-1])
            buckets.append(Bucket.RESTART)
            regions.append(_TORN_DOWN)
    return ends, buckets, regions, evals


def _teardown_from(attempt: Attempt, *, is_last: bool, job_restarting: bool) -> float | None:
    """Where a failed attempt's teardown starts (its failure instant), or None: unknown, or a preemption that
    no attempt followed (its time to the end stays as before)."""
    if attempt.failure_ts is None:
        return None
    if attempt.outcome in (Outcome.PREEMPTED, Outcome.INTERRUPTED) and is_last and not job_restarting:
        return None
    return attempt.failure_ts


def _stopped_with_everything_kept(attempt: Attempt) -> bool:
    return (
        attempt.outcome in (Outcome.PREEMPTED, Outcome.INTERRUPTED)
        and bool(attempt.step_numbers)
        and max(attempt.step_numbers) <= attempt.keep_up_to_step
    )


def _sweep_attempt(
    segments: list[list], attempt: Attempt, *, is_last: bool, job_restarting: bool = False
) -> None:
    ends, buckets, regions, evals = _base_regions(attempt, is_last=is_last, job_restarting=job_restarting)
    edges: list[tuple[float, int, int]] = []
    for begin, end, phase, _ in attempt.phases:
        bucket = PHASE_BUCKET.get(phase) if phase is not None else None
        if bucket is None:
            continue  # background phases (checkpoint persist) and unknown ones: raw durations only
        cls = _CLASS[bucket]
        edges.append((begin, 1, cls))
        edges.append((end, -1, cls))
    edges.sort(key=itemgetter(0))

    counts = [0] * len(PRECEDENCE)
    num_classes = len(PRECEDENCE)
    index = attempt.index
    cursor, stop = attempt.start_ts, attempt.end_ts
    i, j = 0, 0
    last_piece, num_edges = len(ends) - 1, len(edges)
    while cursor < stop:
        while j < num_edges and edges[j][0] <= cursor:
            counts[edges[j][2]] += edges[j][1]
            j += 1
        while i < last_piece and ends[i] <= cursor:
            i += 1
        upto = ends[i]
        if j < num_edges and edges[j][0] < upto:
            upto = edges[j][0]
        bucket, region = buckets[i], regions[i]
        for cls in range(num_classes if region != _TORN_DOWN else 0):
            if counts[cls] > 0:
                if cls == _EVAL_CLASS:
                    bucket = evals[i]
                elif region != _LOCKED:
                    bucket = _STARTUP_BUCKET[cls] if region == _STARTUP else PRECEDENCE[cls]
                break
        _add(segments, cursor, upto, bucket, index)
        cursor = upto
