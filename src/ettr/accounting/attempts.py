"""From raw events to resolved attempts: job boundaries, attempt spans and outcomes, the reference rank's
steps and phases, training starts, and which steps were kept.

Pure: no I/O, no clock. The rules are those of docs/buckets.md; each function says which one it applies.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from math import isfinite
from operator import attrgetter, itemgetter
from typing import Any

from ettr.accounting.liveness import NOT_ENDED
from ettr.accounting.model import CheckpointCommit, CheckpointFailure, Recompile
from ettr.accounting.ttr import launcher_failure_times, rank_failure_times
from ettr.constants import CHECKPOINT_LOAD_FAILED_MARK, FAILURE_DETECTED_MARK
from ettr.events import Event, EventKind, Outcome, Phase

_JOB_SUBMITTED = EventKind.JOB_SUBMITTED
_JOB_ALLOCATED = EventKind.JOB_ALLOCATED
_SUPERVISOR_START = EventKind.SUPERVISOR_START
_ATTEMPT_START = EventKind.ATTEMPT_START
_ATTEMPT_END = EventKind.ATTEMPT_END
_JOB_END = EventKind.JOB_END
_STEP = EventKind.STEP
_PHASE_BEGIN = EventKind.PHASE_BEGIN
_PHASE_END = EventKind.PHASE_END

_JOB_KINDS = frozenset({_JOB_SUBMITTED, _JOB_ALLOCATED, _SUPERVISOR_START, _JOB_END})
_QUEUE_KINDS = frozenset({_JOB_SUBMITTED, _JOB_ALLOCATED})
_FIRST_BATCH_PHASES = frozenset({Phase.GET_FIRST_BATCH_DATA, Phase.DATA_WAIT})
# Background phases overlap training; they never mark where the training loop began.
_BACKGROUND_PHASES = frozenset({Phase.CHECKPOINT_PERSIST})
# Start-up work that may end after a first batch was fetched and before the first step: restoring (a
# Trainer's fast-forward through the batches already trained on), evaluating (`eval_on_start`).
_START_UP_PHASES = frozenset({Phase.RESTORE, Phase.EVAL})
_END_KEYS = frozenset({"outcome", "exit_code"})


@dataclass(slots=True)
class RawAttempt:
    """What the events say about one attempt, before any rule is applied."""

    index: int
    start_ts: float | None = None  # ATTEMPT_START
    end_event: Event | None = None  # ATTEMPT_END
    process_start_ts: float | None = None  # earliest PROCESS_START of any rank
    failure_event: Event | None = None  # first FAILURE of any rank
    rank_events: dict[int, list[Event]] = field(default_factory=dict)  # in time order


@dataclass(slots=True)
class JobEvents:
    """The events of a job sorted into job-level facts and per-attempt, per-rank lists."""

    submitted_ts: float | None = None
    allocated_ts: float | None = None
    supervisor_start_ts: float | None = None
    job_end: Event | None = None
    earliest_ts: float | None = None
    latest_ts: float | None = None
    attempts: dict[int, RawAttempt] = field(default_factory=dict)
    commits: list[CheckpointCommit] = field(default_factory=list)
    checkpoint_errors: list[CheckpointFailure] = field(default_factory=list)
    recompiles: list[Recompile] = field(default_factory=list)
    runs: list[RunStart] = field(default_factory=list)  # every SUPERVISOR_START, in time order
    torn_checkpoints: list[tuple[float, str]] = field(default_factory=list)  # (ts, path) of load failures


@dataclass(frozen=True, slots=True)
class RunStart:
    """A supervisor's start, with the submission and allocation of its run when it recorded them (a requeued
    run's own: Slurm resets SubmitTime at a requeue)."""

    ts: float
    submitted_ts: float | None
    allocated_ts: float | None


@dataclass(slots=True)
class Attempt:
    """An attempt with every rule applied: its span, outcome, steps, phases and kept steps."""

    index: int
    position: int  # 0 for the first attempt of the job, whatever its index
    start_ts: float
    end_ts: float
    outcome: Outcome
    exit_code: int | None
    closed_by_accounting: bool
    failure: Mapping[str, Any] | None
    reference_rank: int | None
    step_ts: list[float]  # STEP times of the reference rank, clamped to the span, in order
    step_numbers: list[int]
    phases: list[tuple[float, float, Phase | None, str]]  # clipped spans: begin, end, phase, raw name
    training_start_ts: float | None = None
    resumed_from_step: int | None = None
    resume_recorded: bool = False  # a RESUMED event exists (its step may be None: from scratch)
    resume_inferred: bool = (
        False  # no RESUMED; resumed_from_step is its first step - 1 (numbered by the script)
    )
    resumed_step_unknown: str | None = None  # why its resume step is unknown (RESUMED's data.unknown)
    lost_steps_estimated: bool = False  # kept steps estimated: the next attempt's resume step is unknown
    keep_up_to_step: float = math.inf  # steps <= this are kept
    lost_steps: int = 0
    failure_ts: float | None = None  # the failure instant (`failure_instant`); None when not known
    # when the supervisor saw a rank gone, where nothing better says (`rank_gone`)
    rank_gone_ts: float | None = None

    @property
    def trained(self) -> bool:
        return self.training_start_ts is not None


def gather(events: Iterable[Event]) -> JobEvents:
    """Sort events by time (stable) and file them; O(n log n)."""
    # An event without a finite time cannot be placed (and NaN would scramble the sort): leave it out.
    ordered = sorted((e for e in events if isfinite(e.ts)), key=attrgetter("ts"))
    job = JobEvents()
    if ordered:
        job.earliest_ts, job.latest_ts = ordered[0].ts, ordered[-1].ts
    attempts = job.attempts
    attempts_at_end: set[int] = set()
    begun_ts = next((e.ts for e in ordered if e.kind not in _QUEUE_KINDS), None)
    for e in ordered:
        kind = e.kind
        if kind in _JOB_KINDS:
            if kind == _JOB_SUBMITTED:
                job.submitted_ts = e.ts if job.submitted_ts is None else job.submitted_ts
            elif kind == _JOB_ALLOCATED:
                job.allocated_ts = e.ts if job.allocated_ts is None else job.allocated_ts
            elif kind == _SUPERVISOR_START:
                if job.supervisor_start_ts is None:
                    job.supervisor_start_ts = e.ts
                data = data_of(e)
                job.runs.append(
                    RunStart(e.ts, _finite(data.get("submitted_at")), _finite(data.get("allocated_at")))
                )
            else:  # JOB_END: the last one wins (a resumed supervisor may end the job again)
                job.job_end = e
                attempts_at_end = set(attempts)
            continue
        raw = attempts.get(e.attempt)
        if raw is None:
            raw = attempts[e.attempt] = RawAttempt(e.attempt)
            if job.job_end is not None and e.attempt not in attempts_at_end:
                job.job_end = None  # a new attempt after the job's end: the job was resumed, not over
        if kind == _ATTEMPT_START:
            if raw.start_ts is None:
                raw.start_ts = e.ts
            continue
        if kind == _ATTEMPT_END:
            if raw.end_event is None:
                raw.end_event = e
            continue
        events_of_rank = raw.rank_events.get(e.rank)
        if events_of_rank is None:
            events_of_rank = raw.rank_events[e.rank] = []
        events_of_rank.append(e)
        if kind == _STEP or kind == _PHASE_BEGIN or kind == _PHASE_END:
            continue
        if kind == EventKind.CHECKPOINT_COMMIT:
            path = data_of(e).get("path")
            job.commits.append(
                CheckpointCommit(
                    ts=e.ts,
                    attempt=e.attempt,
                    rank=e.rank,
                    step=e.step,
                    path=None if path is None else str(path),
                )
            )
        elif kind == EventKind.CHECKPOINT_ERROR:
            data = data_of(e)
            path = data.get("path")
            job.checkpoint_errors.append(
                CheckpointFailure(
                    ts=e.ts,
                    attempt=e.attempt,
                    rank=e.rank,
                    step=e.step,
                    path=None if path is None else str(path),
                    error=str(data.get("error", ""))[:500],
                )
            )
        elif kind == EventKind.RECOMPILE:
            data = dict(data_of(e))
            job.recompiles.append(
                Recompile(
                    ts=e.ts, attempt=e.attempt, rank=e.rank, reason=str(data.get("reason", "")), data=data
                )
            )
        elif kind == EventKind.MARK:
            data = data_of(e)
            if data.get("name") == CHECKPOINT_LOAD_FAILED_MARK and data.get("path") is not None:
                job.torn_checkpoints.append((e.ts, str(data["path"])))
        elif kind == EventKind.PROCESS_START:
            if raw.process_start_ts is None and e.rank >= 0:
                raw.process_start_ts = e.ts
        elif kind == EventKind.FAILURE:
            if raw.failure_event is None:
                raw.failure_event = e
    for index in [i for i, raw in attempts.items() if not _placeable(raw)]:
        del attempts[index]  # only supervisor-side marks name this attempt: nothing to place on the timeline
    _forget_queue_times_after(job, begun_ts)
    return job


def _forget_queue_times_after(job: JobEvents, begun_ts: float | None) -> None:
    """A submission or allocation dated after the job's books begin cannot be (the supervisor runs inside
    its allocation): the scheduler's clock is ahead of this host's, or a time was given within the 5 min
    `--allocated-at` allows for that. Such a wait is unknown, not the whole job: an allocation 30 s ahead
    started the wall time after the job's end (wall 0 s, every bucket 0, ETT 0.0%). Likewise a submission
    after the allocation."""
    if begun_ts is None:
        return
    if job.allocated_ts is not None and job.allocated_ts > begun_ts:
        job.allocated_ts = None
    latest = begun_ts if job.allocated_ts is None else job.allocated_ts
    if job.submitted_ts is not None and job.submitted_ts > latest:
        job.submitted_ts = None


def _placeable(raw: RawAttempt) -> bool:
    if raw.start_ts is not None or raw.end_event is not None:
        return True
    return any(rank >= 0 and events for rank, events in raw.rank_events.items())


def wall_bounds(job: JobEvents, now: float) -> tuple[float, float]:
    """Wall start (submitted, else allocated, else supervisor start, else the earliest event, else `now`)
    and wall end (JOB_END, else `now`), with end >= start."""
    candidates = (job.submitted_ts, job.allocated_ts, job.supervisor_start_ts, job.earliest_ts)
    start = next((ts for ts in candidates if ts is not None), now)
    end = job.job_end.ts if job.job_end is not None else now
    return start, max(start, end)


def job_ended_normally(job: JobEvents) -> bool:
    """A JOB_END exists and its exit status is 0 (or not given)."""
    if job.job_end is None:
        return False
    status = _as_int(data_of(job.job_end).get("exit_status"))
    return status is None or status == 0


def resolve_attempts(
    job: JobEvents, wall_start: float, wall_end: float, *, supervisor_alive: bool | None = None
) -> list[Attempt]:
    """Apply the span, outcome, reference-rank, training-start and kept-step rules to every attempt.

    Attempts are ordered by index; their spans are made monotone and disjoint inside the wall time (an
    attempt cannot start before the previous one ended, nor end after the next one started). The last
    attempt of a job without an end, itself without one, is `running` when `supervisor_alive`, else
    `unknown`, unless a rank recorded its failure (`ettr.accounting.liveness`).
    """
    indices = sorted(job.attempts)
    raws = [job.attempts[i] for i in indices]
    raw_starts = [_raw_start(r) for r in raws]
    in_progress = job.job_end is None
    ended_normally = job_ended_normally(job)
    attempts: list[Attempt] = []
    previous_end = wall_start
    for position, raw in enumerate(raws):
        is_last = position == len(raws) - 1
        start = min(max(raw_starts[position], previous_end), wall_end)
        next_start = raw_starts[position + 1] if not is_last else math.inf
        if raw.end_event is not None:
            end = raw.end_event.ts
        elif raw.start_ts is not None:
            end = min(next_start, wall_end)  # a supervised attempt that never ended
        elif is_last and in_progress:
            end = wall_end  # an API-only run that is still going (or was closed at `now`)
        else:
            end = _last_ts(raw)
        end = max(start, min(end, next_start, wall_end))
        previous_end = end
        outcome, exit_code, failure = _outcome(raw, is_last=is_last, ended_normally=ended_normally)
        if is_last and in_progress and raw.end_event is None and raw.failure_event is None:
            outcome, failure = (Outcome.RUNNING if supervisor_alive else Outcome.UNKNOWN), None
        attempts.append(_resolve_one(raw, position, start, end, outcome, exit_code, failure))
    _mark_kept_steps(attempts, surviving_commits(job))
    return attempts


def surviving_commits(job: JobEvents) -> list[CheckpointCommit]:
    """The job's commits less those whose file was later found torn: a load of that path failed on a file
    that is none of the saves recorded for it (`CHECKPOINT_LOAD_FAILED_MARK`: a torch.save straight to the
    final name, cut off mid-write, replaced what the earlier saves of that path left). Saves of that path
    after the failed load stand."""
    if not job.torn_checkpoints:
        return job.commits
    return [
        c for c in job.commits if not any(path == c.path and ts > c.ts for ts, path in job.torn_checkpoints)
    ]


def _raw_start(raw: RawAttempt) -> float:
    if raw.start_ts is not None:
        return raw.start_ts
    if raw.process_start_ts is not None:
        return raw.process_start_ts
    firsts = [events[0].ts for rank, events in raw.rank_events.items() if rank >= 0 and events]
    if raw.end_event is not None:
        firsts.append(raw.end_event.ts)
    return min(firsts) if firsts else math.inf


def _last_ts(raw: RawAttempt) -> float:
    lasts = [events[-1].ts for rank, events in raw.rank_events.items() if rank >= 0 and events]
    return max(lasts) if lasts else -math.inf


def _outcome(
    raw: RawAttempt, *, is_last: bool, ended_normally: bool
) -> tuple[Outcome, int | None, Mapping[str, Any] | None]:
    if raw.end_event is not None:
        data = data_of(raw.end_event)
        exit_code = _as_int(data.get("exit_code"))
        try:
            outcome = Outcome(data["outcome"])
        except (KeyError, ValueError):
            outcome = Outcome.COMPLETED if exit_code == 0 else Outcome.FAILED
        extra = {k: v for k, v in data.items() if k not in _END_KEYS}
    else:
        exit_code, extra = None, {}
        # No ATTEMPT_END: the last attempt completed when the job then ended normally and no rank recorded a
        # failure. For a supervised attempt too: its supervisor writes JOB_END with status 0 only after the
        # last attempt completed, so its ATTEMPT_END row was lost (a damaged ledger's codec skips it); read as
        # a failure, a completed job's training all turned into wasted_progress (ETT 77% -> 0%).
        completed = is_last and ended_normally and raw.failure_event is None
        outcome = Outcome.COMPLETED if completed else Outcome.FAILED
    if outcome == Outcome.COMPLETED:
        return outcome, exit_code, None
    if raw.failure_event is not None:
        process_failure = dict(data_of(raw.failure_event))
        process_failure.setdefault("rank", raw.failure_event.rank)
        process_failure.setdefault("ts", raw.failure_event.ts)
        extra.setdefault("process_failure", process_failure)
    return outcome, exit_code, extra


def _resolve_one(
    raw: RawAttempt,
    position: int,
    start: float,
    end: float,
    outcome: Outcome,
    exit_code: int | None,
    failure: Mapping[str, Any] | None,
) -> Attempt:
    ranks = [r for r, events in raw.rank_events.items() if r >= 0 and events]
    # Rank 0, unless it took no step while another rank did (trainers an MPI launcher started side by side,
    # rank 0 slower to start than rank 1's crash): its books would read "no training step seen".
    stepped = [r for r in sorted(ranks) if any(e.kind == EventKind.STEP for e in raw.rank_events[r])]
    pool = stepped or ranks
    reference_rank = (0 if 0 in pool else min(pool)) if pool else None
    attempt = Attempt(
        index=raw.index,
        position=position,
        start_ts=start,
        end_ts=end,
        outcome=outcome,
        exit_code=exit_code,
        closed_by_accounting=raw.end_event is None,
        failure=failure,
        reference_rank=reference_rank,
        step_ts=[],
        step_numbers=[],
        phases=[],
    )
    explicit_start: float | None = None
    resumed: Event | None = None
    if reference_rank is not None:
        events = raw.rank_events[reference_rank]
        step_ts, step_numbers = attempt.step_ts, attempt.step_numbers
        for e in events:
            if e.kind == _STEP:
                if e.step is not None:
                    step_ts.append(min(max(e.ts, start), end))
                    step_numbers.append(e.step)
            elif e.kind == EventKind.TRAINING_START:
                explicit_start = e.ts if explicit_start is None else explicit_start
            elif e.kind == EventKind.RESUMED:
                resumed = e  # the last one wins
        attempt.phases = _pair_phases(events, start, end)
    if resumed is None:  # the reference rank did not say; any other rank may have
        for rank in sorted(r for r in raw.rank_events if r >= 0):
            found = [e for e in raw.rank_events[rank] if e.kind == EventKind.RESUMED]
            if found:
                resumed = found[-1]
                break
    if resumed is not None:
        attempt.resume_recorded = True
        attempt.resumed_from_step = resumed.step
        unknown = data_of(resumed).get("unknown") if resumed.step is None else None
        if unknown is not None:
            attempt.resumed_step_unknown = str(unknown) or "unknown"
    elif attempt.step_numbers and min(attempt.step_numbers) > 1:
        # No RESUMED, but its steps are numbered by the script (`ettr.step(n)` after restoring its own state)
        # and went on from where the job had been: its first step says where it resumed. Before, it read as
        # "from scratch" and every earlier step as lost (soak trial: ETT 0.5% for a job at ~45%).
        attempt.resumed_from_step = min(attempt.step_numbers) - 1
        attempt.resume_inferred = True
    attempt.training_start_ts = _training_start(attempt, explicit_start)
    if outcome != Outcome.COMPLETED and outcome not in NOT_ENDED:
        end_data = data_of(raw.end_event) if raw.end_event is not None else {}
        signalled = end_data.get("signalled_ts")
        if outcome is not Outcome.HUNG:  # a hang stays lost progress until the watchdog fired
            attempt.rank_gone_ts = rank_gone(raw.rank_events, end, end_data.get("rank_gone_ts"), signalled)
        attempt.failure_ts = failure_instant(
            raw.rank_events, start, end, signalled_ts=signalled, rank_gone_ts=attempt.rank_gone_ts
        )
    return attempt


def rank_gone(
    rank_events: Mapping[int, list[Event]], end: float, rank_gone_ts: object, signalled_ts: object
) -> float | None:
    """The ATTEMPT_END's `rank_gone_ts` (when the supervisor's look first saw a training rank's process gone)
    where it can be the failure instant: no rank recorded its failure (a FAILURE, an `inject` kill mark), no
    outside signal ended the job (`signalled_ts`), and it is at or after every rank's last STEP (a launcher
    that restarted its workers, torchrun's `--max-restarts` behind a wrapper, trained on after that death)
    and not after the attempt's end. None otherwise."""
    gone = _finite(rank_gone_ts)
    if gone is None or _finite(signalled_ts) is not None or rank_failure_times(rank_events):
        return None
    steps = [e.ts for r, evs in rank_events.items() if r >= 0 for e in evs if e.kind == _STEP]
    return gone if gone <= end and all(ts <= gone for ts in steps) else None


def failure_instant(
    rank_events: Mapping[int, list[Event]],
    start: float,
    end: float,
    *,
    signalled_ts: object = None,
    rank_gone_ts: float | None = None,
) -> float | None:
    """The failure-instant rule: when the books say an attempt's failure happened, the earliest of the first
    `FAILURE` a training rank recorded (its exception), the supervisor's `failure_detected` MARK (a hang:
    the watchdog's firing; a rank ettr watched: its death; else the command's exit) and the ATTEMPT_END's
    `signalled_ts` (a signal from outside that the job's own handler ended it on: a preemption's onset),
    clamped to [start, end]; an `--inject kill` (SIGKILL, no FAILURE) is its rank's `inject` MARK, written
    just before the kill. None when none was recorded (a SIGKILL no one saw, books written by other
    tools). Where none of the ranks' own instants and no `signalled_ts` is known, `rank_gone_ts` (`rank_gone`:
    a rank SIGKILLed under a launcher, seen gone by the supervisor before the launcher's teardown) counts."""
    found = rank_failure_times(rank_events)
    if isinstance(signalled_ts, (int, float)) and not isinstance(signalled_ts, bool):
        found.append(float(signalled_ts))
    if rank_gone_ts is not None:  # `rank_gone` gives one only where neither of the above is known
        found.append(rank_gone_ts)
    if not found:  # a launcher's exception, after it saw a rank die: only where nothing else dates it
        found = launcher_failure_times(rank_events)
    for e in rank_events.get(-1, ()):
        if e.kind == EventKind.MARK and data_of(e).get("name") == FAILURE_DETECTED_MARK:
            found.append(e.ts)
            break
    if not found:
        return None
    return min(max(min(found), start), end)


def _pair_phases(
    events: list[Event], start: float, end: float
) -> list[tuple[float, float, Phase | None, str]]:
    """PHASE_BEGIN/PHASE_END pairs of one rank, clipped to [start, end].

    A PHASE_END names its begin by `value`; an END whose begin is missing is a complete span by itself; an
    END without `value` closes the latest open BEGIN of its phase; a BEGIN never ended is closed at `end`.
    """
    open_begins: dict[Any, list[float]] = {}
    spans: list[tuple[float, float, Any]] = []
    for e in events:
        kind = e.kind
        if kind == _PHASE_BEGIN and e.phase is not None:
            open_begins.setdefault(e.phase, []).append(e.ts)
        elif kind == _PHASE_END and e.phase is not None:
            stack = open_begins.get(e.phase)
            if e.value is not None:
                begin = e.value
                if stack:
                    _remove_last(stack, begin)
            elif stack:
                begin = stack.pop()
            else:
                continue  # an END that names no begin and closes none: nothing to attribute
            spans.append((begin, e.ts, e.phase))
    for phase, begins in open_begins.items():
        spans.extend((begin, end, phase) for begin in begins)
    spans.sort(key=itemgetter(0))
    names = {raw: (_as_phase(raw), str(getattr(raw, "value", raw))) for raw in {span[2] for span in spans}}
    clipped = []
    for begin, finish, raw in spans:
        b = begin if begin > start else start
        f = finish if finish < end else end
        if f > b:
            phase, name = names[raw]
            clipped.append((b, f, phase, name))
    return clipped


pair_phases = _pair_phases
"""The same pairing for renderers that draw phases (the trace export), so they draw what is attributed."""


def _remove_last(stack: list[float], value: float) -> None:
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] == value:
            del stack[i]
            return


def _training_start(attempt: Attempt, explicit_start: float | None) -> float | None:
    """The training-start rule: explicit TRAINING_START; else the end of the last first-batch phase that
    ended by the first STEP, or of a later start-up phase that ended by then (a resume's fast-forward through
    the data already trained on, an evaluation before the first step: a first batch is any loader's first
    `next`, the evaluation's or one the fast-forward skips); else max(end of the last phase that ended by
    the first STEP, first STEP - the median step interval); clamped to [attempt start, first STEP]. None
    without a STEP."""
    if not attempt.step_ts:
        return None
    first_step = attempt.step_ts[0]
    if explicit_start is not None:
        guess = explicit_start
    else:
        before = [(end, phase) for _, end, phase, _ in attempt.phases if end <= first_step]
        first_batch = [end for end, phase in before if phase in _FIRST_BATCH_PHASES]
        if first_batch:
            guess = max(first_batch)
            later = [end for end, phase in before if phase in _START_UP_PHASES and end > guess]
            guess = max(later, default=guess)
        else:
            if len(attempt.step_ts) >= 2:
                intervals = [b - a for a, b in zip(attempt.step_ts, attempt.step_ts[1:], strict=False)]
                guess = first_step - statistics.median(intervals)
            else:
                guess = first_step
            phase_ends = [end for end, phase in before if phase not in _BACKGROUND_PHASES]
            if phase_ends:
                guess = max(guess, max(phase_ends))
    return min(max(guess, attempt.start_ts), first_step)


def _mark_kept_steps(attempts: list[Attempt], commits: list[CheckpointCommit]) -> None:
    """The kept-step rule. Steps <= R are kept, where R is the step that the next attempt which got as far
    as deciding (it recorded RESUMED or completed a step) resumed from (-inf: from scratch). With no such
    later attempt: all kept if the attempt is the last and completed, else R is the highest checkpoint
    committed by the end of the job's last attempt (-inf if none). A decider whose resume step is unknown
    (RESUMED with `data.unknown`) gives an estimate instead: the highest checkpoint committed before it
    started (-inf if none), and `lost_steps_estimated` says so; so does an attempt whose own resume step is
    unknown (its step numbers count from an unknown base). The open last attempt of a job without an end
    (`running` or `unknown`) keeps all its steps so far: none is known to be lost yet."""
    final_ts = attempts[-1].end_ts if attempts else -math.inf
    for position, attempt in enumerate(attempts):
        decider = next((a for a in attempts[position + 1 :] if a.resume_recorded or a.step_ts), None)
        attempt.lost_steps_estimated = attempt.resumed_step_unknown is not None
        if decider is not None and decider.resumed_step_unknown is not None:
            before = [c.step for c in commits if c.ts <= decider.start_ts and c.step is not None]
            keep = float(max(before)) if before else -math.inf
            attempt.lost_steps_estimated = True
        elif decider is not None:
            keep = -math.inf if decider.resumed_from_step is None else float(decider.resumed_from_step)
        elif position == len(attempts) - 1 and (
            attempt.outcome == Outcome.COMPLETED or attempt.outcome in NOT_ENDED
        ):
            keep = math.inf
        else:
            committed = [c.step for c in commits if c.ts <= final_ts and c.step is not None]
            keep = float(max(committed)) if committed else -math.inf
        attempt.keep_up_to_step = keep
        attempt.lost_steps = len({step for step in attempt.step_numbers if step > keep})


def data_of(event: Event) -> Mapping[str, Any]:
    """`event.data` as a mapping: {} when it is missing or, written by something else, not a mapping."""
    data = event.data
    return data if isinstance(data, Mapping) else {}


def _as_phase(value: Any) -> Phase | None:
    if isinstance(value, Phase):
        return value
    try:
        return Phase(value)
    except ValueError:
        return None


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _finite(value: Any) -> float | None:
    """`value` as a finite number, else None (a missing, damaged or foreign value)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if isfinite(value) else None
