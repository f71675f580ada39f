"""Randomized streams (seeded, no hypothesis): the invariants hold and every instant gets the bucket that a
naive point-by-point reading of docs/buckets.md gives it."""

from __future__ import annotations

import bisect
import math
import random

import pytest

from ettr.accounting import EttReport, compute
from ettr.accounting.fence import fence
from ettr.events import PHASE_BUCKET, SUPERVISOR_RANK, Bucket, Event, EventKind, Outcome, Phase

T0 = 1_700_000_000.0
K = EventKind
# The precedence of docs/buckets.md, highest first, written out again rather than imported.
PRECEDENCE = [
    "checkpoint_blocking",
    "compile",
    "restore",
    "evaluation",
    "data_wait",
    "shutdown",
    "other",
    "init",
]
STARTUP_AS_INIT = {"checkpoint_blocking", "shutdown", "other"}


def random_stream(rng: random.Random) -> tuple[list[Event], float]:
    events: list[Event] = []
    t = T0 + rng.uniform(0, 50)

    def later(scale: float = 1.0) -> float:
        nonlocal t
        t += rng.uniform(0.01, scale)
        return t

    def sup(kind: EventKind, attempt: int = 0, **data) -> None:
        events.append(Event(kind, later(), attempt, SUPERVISOR_RANK, data=data or None))

    for kind in (K.JOB_SUBMITTED, K.JOB_ALLOCATED, K.SUPERVISOR_START):
        if rng.random() < 0.6:
            sup(kind)
    supervised = rng.random() < 0.75
    num_attempts = rng.randint(1, 4)
    committed: list[int] = []
    step = 0
    for attempt in range(num_attempts):
        later(5)
        if supervised:
            sup(K.ATTEMPT_START, attempt)
        ranks = [0, 1] if rng.random() < 0.7 else [rng.randint(1, 3)]
        window_start = later()
        if rng.random() < 0.5:
            resumed = rng.choice(committed) if committed and rng.random() < 0.8 else None
            events.append(Event(K.RESUMED, later(), attempt, ranks[0], step=resumed))
            step = resumed or 0
        if rng.random() < 0.2:
            events.append(Event(K.TRAINING_START, later(), attempt, ranks[0]))
        num_steps = rng.choice([0, 1, 2, rng.randint(3, 25)])
        for _ in range(num_steps):
            step += 1
            for rank in ranks:
                events.append(Event(K.STEP, later(2) + rank * 0.001, attempt, rank, step=step))
            if rng.random() < 0.2:
                events.append(Event(K.CHECKPOINT_COMMIT, later(0.3), attempt, ranks[0], step=step))
                committed.append(step)
        window_end = later(3)
        for _ in range(rng.randint(0, 8)):
            rank = rng.choice(ranks)
            phase = rng.choice(list(Phase))
            begin = rng.uniform(window_start - 1, window_end + 1)
            end = begin + rng.expovariate(1 / (window_end - window_start) * 3)
            style = rng.random()
            if style < 0.15:  # open: never ended
                events.append(Event(K.PHASE_BEGIN, begin, attempt, rank, phase=phase))
            elif style < 0.3:  # a lone END: a full span
                events.append(Event(K.PHASE_END, end, attempt, rank, phase=phase, value=begin))
            else:
                events.append(Event(K.PHASE_BEGIN, begin, attempt, rank, phase=phase))
                events.append(Event(K.PHASE_END, end, attempt, rank, phase=phase, value=begin))
        if supervised and rng.random() < 0.85:
            last = attempt == num_attempts - 1
            outcome = (
                "completed" if last and rng.random() < 0.6 else rng.choice(["failed", "preempted", "hung"])
            )
            sup(K.ATTEMPT_END, attempt, outcome=outcome, exit_code=0 if outcome == "completed" else 1)
    if rng.random() < 0.7:
        sup(K.JOB_END, num_attempts - 1, exit_status=rng.choice([0, 0, 1]))
    now = max(e.ts for e in events) + rng.choice([0.0, rng.uniform(0, 5)])
    return events, now


def naive_bucket(t: float, report: EttReport, events: list[Event]) -> Bucket:
    """The bucket of instant `t`, read straight off the rules, one instant at a time (slow, obvious)."""
    attempts = report.attempts
    inside = [a for a in attempts if a.start_ts <= t < a.end_ts]
    if not inside:
        if attempts and t >= attempts[-1].end_ts:
            failed = attempts[-1].outcome not in (Outcome.COMPLETED, Outcome.RUNNING, Outcome.UNKNOWN)
            return Bucket.RESTART if report.in_progress and failed else Bucket.SHUTDOWN
        if attempts and t >= attempts[0].end_ts:
            return Bucket.RESTART
        first_start = attempts[0].start_ts if attempts else report.wall_end_ts
        setup_end = report.supervisor_start_ts if report.supervisor_start_ts is not None else first_start
        if report.submitted_ts is not None and report.allocated_ts is not None and t < report.allocated_ts:
            return Bucket.SCHEDULING
        if report.submitted_ts is not None and report.allocated_ts is None and t < setup_end:
            return Bucket.OTHER
        if report.allocated_ts is not None and t < setup_end:
            return Bucket.HARDWARE_SETUP
        return Bucket.INIT
    (a,) = inside
    position = attempts.index(a)
    own = [e for e in events if e.attempt == a.index and e.rank >= 0]
    ranks = {e.rank for e in own}
    rank = 0 if 0 in ranks else min(ranks, default=None)
    mine = [e for e in own if e.rank == rank]
    steps = sorted((min(max(e.ts, a.start_ts), a.end_ts), e.step) for e in mine if e.kind == K.STEP)
    ends = {(e.phase, e.value) for e in mine if e.kind == K.PHASE_END}
    spans = [(e.value, e.ts, e.phase) for e in mine if e.kind == K.PHASE_END]
    spans += [
        (e.ts, a.end_ts, e.phase) for e in mine if e.kind == K.PHASE_BEGIN and (e.phase, e.ts) not in ends
    ]
    active = {
        PHASE_BUCKET[p].value
        for b, f, p in spans
        if PHASE_BUCKET[p] and max(b, a.start_ts) <= t < min(f, a.end_ts)
    }
    winner = next((name for name in PRECEDENCE if name in active), None)

    if a.training_start_ts is None or t < a.training_start_ts:
        if winner is None or winner in STARTUP_AS_INIT:
            return Bucket.INIT
        return Bucket(winner)
    is_last = position == len(attempts) - 1
    completed = a.outcome == Outcome.COMPLETED
    keep = keep_up_to(position, report, events)
    # An evaluation evaluates the state after the step before it: kept -> evaluation, else rolled back.
    index = bisect.bisect_right([s for s, _ in steps], t)
    before = steps[index - 1][1] if index > 0 else None
    if winner == "evaluation":
        return Bucket.EVALUATION if before is None or before <= keep else Bucket.WASTED_PROGRESS
    if t >= steps[-1][0] and completed and is_last:
        return Bucket.SHUTDOWN
    if winner is not None:
        return Bucket(winner)
    if t >= steps[-1][0] and a.outcome in (Outcome.RUNNING, Outcome.UNKNOWN):
        return Bucket.OTHER  # a job without an end: its open attempt's books say nothing after its last step
    if t >= steps[-1][0]:
        stopped = a.outcome in (Outcome.PREEMPTED, Outcome.INTERRUPTED)
        all_kept = max(s for _, s in steps) <= keep
        return Bucket.SHUTDOWN if completed or (stopped and all_kept) else Bucket.WASTED_PROGRESS
    step = steps[index][1]
    return Bucket.EFFECTIVE_TRAINING if step <= keep else Bucket.WASTED_PROGRESS


def keep_up_to(position: int, report: EttReport, events: list[Event]) -> float:
    attempts = report.attempts
    for later in attempts[position + 1 :]:
        resumed = [e for e in events if e.attempt == later.index and e.kind == K.RESUMED]
        if resumed or later.num_steps:
            step = resumed[-1].step if resumed else None
            if not resumed:  # numbered on from step n + 1: it resumed from n (1: from scratch)
                first = min(e.step for e in events if e.attempt == later.index and e.kind == K.STEP)
                step = first - 1 if first > 1 else None
            return -math.inf if step is None else step
    if position == len(attempts) - 1 and attempts[position].outcome in (
        Outcome.COMPLETED,
        Outcome.RUNNING,
        Outcome.UNKNOWN,
    ):
        return math.inf
    steps = [e.step for e in events if e.kind == K.CHECKPOINT_COMMIT and e.ts <= attempts[-1].end_ts]
    return max(steps, default=-math.inf)


def check_invariants(report: EttReport) -> None:
    assert abs(math.fsum(report.buckets_s.values()) - report.wall_s) < 1e-6
    assert all(v >= 0 for v in report.buckets_s.values())
    if report.wall_s > 0:
        assert abs(report.ett_pct + report.idleness_pct + report.failure_pct - 100) < 1e-9
    for bucket in Bucket:  # the attempts' shares add up to the job (when there is an attempt to own them)
        share = math.fsum(a.buckets_s[bucket] for a in report.attempts)
        assert share == pytest.approx(report.buckets_s[bucket], abs=1e-6) or not report.attempts
    cursor = report.wall_start_ts
    previous = None
    for seg in report.segments:
        assert seg.start_ts == cursor < seg.end_ts
        assert (seg.bucket, seg.attempt) != previous, "adjacent pieces of one bucket and attempt are merged"
        cursor, previous = seg.end_ts, (seg.bucket, seg.attempt)
    assert cursor == report.wall_end_ts or not report.segments
    previous_end = report.wall_start_ts
    for a in report.attempts:
        assert previous_end <= a.start_ts <= a.end_ts <= report.wall_end_ts
        assert 0 <= a.lost_steps <= a.num_steps
        previous_end = a.end_ts
    assert all(ttr >= 0 for ttr in report.ttr_s)
    not_failures = (Outcome.COMPLETED, Outcome.RUNNING, Outcome.UNKNOWN)
    assert report.num_failures == sum(a.outcome not in not_failures for a in report.attempts)
    # Only the last attempt of a job without an end can be open (running or unknown).
    assert all(a.outcome not in not_failures[1:] for a in report.attempts[:-1])
    if not report.in_progress:
        assert all(a.outcome not in not_failures[1:] for a in report.attempts)
    # The TTS window and the recoveries are what tts_s and ttr_s measure (the charts draw these).
    assert (report.tts_window is None) == (report.tts_s is None)
    if report.tts_window is not None:
        assert report.tts_window.duration_s == report.tts_s
    assert tuple(r.ttr_s for r in report.recoveries) == report.ttr_s
    for r in report.recoveries:
        assert r.failed.outcome not in not_failures and r.failed.index < r.recovered.index
        assert r.detected_ts == r.failed.end_ts and r.training_start_ts == r.recovered.training_start_ts


@pytest.mark.parametrize("seed", range(8))
def test_random_streams_keep_the_invariants_and_match_the_naive_reading(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(40):
        events, now = random_stream(rng)
        alive = rng.choice([None, False, True])
        report = compute(events, now, job_id="r", supervisor_alive=alive)
        check_invariants(report)
        counted, _ = fence(events)  # docs/buckets.md: events after their attempt's end do not count
        for seg in report.segments:
            for t in (
                (seg.start_ts + seg.end_ts) / 2,
                rng.uniform(seg.start_ts, seg.end_ts),
            ):
                if seg.start_ts < t < seg.end_ts:
                    assert naive_bucket(t, report, counted) == seg.bucket, (seed, t - T0, seg)
        shuffled = list(events)
        rng.shuffle(shuffled)
        assert compute(shuffled, now, job_id="r", supervisor_alive=alive) == report


def test_large_stream_adds_up() -> None:
    """200,000 events of one long attempt with a data wait and a compile on every step."""
    events = [
        Event(K.SUPERVISOR_START, T0, 0, SUPERVISOR_RANK),
        Event(K.ATTEMPT_START, T0 + 1, 0, SUPERVISOR_RANK),
    ]
    t = T0 + 2
    for step in range(1, 40_001):
        events.append(Event(K.PHASE_BEGIN, t, 0, 0, phase=Phase.DATA_WAIT))
        events.append(Event(K.PHASE_END, t + 0.01, 0, 0, phase=Phase.DATA_WAIT, value=t))
        events.append(Event(K.STEP, t + 0.1, 0, 0, step=step))
        events.append(Event(K.STEP, t + 0.1, 0, 1, step=step))
        if step % 1000 == 0:
            events.append(Event(K.CHECKPOINT_COMMIT, t + 0.11, 0, 0, step=step))
        t += 0.1
    events.append(Event(K.ATTEMPT_END, t + 1, 0, SUPERVISOR_RANK, data={"outcome": "hung", "exit_code": -9}))
    report = compute(events, t + 1)
    check_invariants(report)
    (attempt,) = report.attempts
    assert attempt.last_step == 40_000 and attempt.lost_steps == 0
    assert report.buckets_s[Bucket.DATA_WAIT] == pytest.approx(0.01 * 40_000, rel=1e-6)
    assert report.buckets_s[Bucket.EFFECTIVE_TRAINING] == pytest.approx(
        (0.1 - 0.01) * 39_999 + 0.1 - 0.01, rel=1e-6
    )
