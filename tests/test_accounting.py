"""Scripted event streams with ground truth worked out by hand (the examples of docs/buckets.md)."""

from __future__ import annotations

import math

import pytest

from ettr.accounting import EttReport, JobState, Loss, classify, compute
from ettr.events import SUPERVISOR_RANK, Bucket, Event, EventKind, Outcome, Phase

T0 = 1_700_000_000.0  # realistic Unix times: the math must stay exact at this magnitude
TOL = 1e-3  # 1 ms


class Stream:
    """Builds a job's events with times given as offsets from T0."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def add(self, kind: EventKind, t: float, attempt: int = 0, rank: int = 0, **fields) -> Stream:
        self.events.append(Event(kind, T0 + t, attempt, rank, **fields))
        return self

    def sup(self, kind: EventKind, t: float, attempt: int = 0, **data) -> Stream:
        return self.add(kind, t, attempt, SUPERVISOR_RANK, data=data or None)

    def attempt(
        self, a: int, start: float, end: float | None = None, outcome: str = "", exit_code=None, **extra
    ):
        self.sup(EventKind.ATTEMPT_START, start, a, pid=1000 + a)
        if end is not None:
            self.sup(EventKind.ATTEMPT_END, end, a, outcome=outcome, exit_code=exit_code, **extra)
        return self

    def steps(self, a: int, first_step: int, last_step: int, t_first: float, dt: float = 1.0, rank: int = 0):
        for i, n in enumerate(range(first_step, last_step + 1)):
            self.add(EventKind.STEP, t_first + i * dt, a, rank, step=n)
        return self

    def phase(self, a: int, phase: Phase, begin: float, end: float | None, rank: int = 0) -> Stream:
        self.add(EventKind.PHASE_BEGIN, begin, a, rank, phase=phase)
        if end is not None:
            self.add(EventKind.PHASE_END, end, a, rank, phase=phase, value=T0 + begin)
        return self

    def lone_end(self, a: int, phase: Phase, begin: float | None, end: float, rank: int = 0) -> Stream:
        return self.add(
            EventKind.PHASE_END, end, a, rank, phase=phase, value=None if begin is None else T0 + begin
        )

    def report(self, now: float | None = None, **kw) -> EttReport:
        last = max(e.ts for e in self.events) - T0
        return compute(list(self.events), T0 + (last if now is None else now), **kw)


def assert_buckets(report: EttReport, expected: dict[Bucket, float]) -> None:
    got = {b: round(report.buckets_s[b], 6) for b in Bucket}
    want = {b: float(expected.get(b, 0.0)) for b in Bucket}
    for bucket in Bucket:
        assert got[bucket] == pytest.approx(want[bucket], abs=TOL), f"{bucket}: {got} != {want}"
    assert_invariants(report)


def assert_invariants(report: EttReport) -> None:
    assert abs(math.fsum(report.buckets_s.values()) - report.wall_s) < 1e-6
    if report.wall_s > 0:
        assert report.ett_pct + report.idleness_pct + report.failure_pct == pytest.approx(100.0, abs=1e-9)
    for bucket in Bucket:
        share = math.fsum(a.buckets_s[bucket] for a in report.attempts)
        if report.attempts:
            assert share == pytest.approx(report.buckets_s[bucket], abs=1e-6)
    cursor = report.wall_start_ts
    for seg in report.segments:
        assert seg.start_ts == cursor and seg.end_ts > seg.start_ts
        cursor = seg.end_ts
    assert cursor == report.wall_end_ts or not report.segments


def overlapping_phases_job() -> Stream:
    s = Stream()
    s.sup(EventKind.JOB_SUBMITTED, 0).sup(EventKind.JOB_ALLOCATED, 10).sup(EventKind.SUPERVISOR_START, 12)
    s.attempt(0, 13, 45, "completed", 0)
    s.add(EventKind.PROCESS_START, 13.5)
    s.phase(0, Phase.INIT, 14, 20)
    s.phase(0, Phase.COMPILE, 18, 30)
    s.phase(0, Phase.DATA_WAIT, 25, 32)
    s.steps(0, 1, 10, t_first=33)  # steps 1..10 at 33..42
    s.phase(0, Phase.CHECKPOINT_BLOCKING, 36.5, 37.5)
    s.phase(0, Phase.CHECKPOINT_PERSIST, 37.5, 41)
    s.add(EventKind.CHECKPOINT_COMMIT, 41, step=4, data={"path": "/ckpt/4"})
    s.phase(0, Phase.SHUTDOWN, 43, 44)
    s.sup(EventKind.JOB_END, 47, exit_status=0)
    return s


def test_overlapping_phases_go_to_the_highest_precedence() -> None:
    r = overlapping_phases_job().report(job_id="a")
    assert r.wall_s == pytest.approx(47)
    # compile [18,30] beats init [14,20] and data_wait [25,32]; checkpoint blocking cuts into step 5.
    assert_buckets(
        r,
        {
            Bucket.SCHEDULING: 10,
            Bucket.HARDWARE_SETUP: 2,
            Bucket.INIT: 1 + 1 + 4,
            Bucket.COMPILE: 12,
            Bucket.DATA_WAIT: 2,
            Bucket.EFFECTIVE_TRAINING: 9,
            Bucket.CHECKPOINT_BLOCKING: 1,
            Bucket.SHUTDOWN: 5,  # last step 42 -> job end 47, whatever the SHUTDOWN phase says
        },
    )
    (a,) = r.attempts
    assert a.training_start_ts == pytest.approx(T0 + 32)  # end of the data wait before the first step
    assert r.tts_s == pytest.approx(22)  # allocated 10 -> training start 32
    assert r.ttr_s == () and r.num_failures == 0 and not r.in_progress
    assert (a.outcome, a.exit_code, a.last_step, a.lost_steps, a.num_steps) == (
        Outcome.COMPLETED,
        0,
        10,
        0,
        10,
    )
    assert r.ett_pct == pytest.approx(9 / 47 * 100) and r.failure_pct == 0
    assert dict(r.phases_s) == pytest.approx(
        {
            "init": 6,
            "compile": 12,
            "data_wait": 7,
            "checkpoint_blocking": 1,
            "checkpoint_persist": 3.5,
            "shutdown": 1,
        }
    )
    assert [c.step for c in r.checkpoint_commits] == [4]
    # The checkpoint persist (background) never shows on the timeline.
    assert [(s.start_ts - T0, s.bucket) for s in r.segments][-4:] == [
        (32, Bucket.EFFECTIVE_TRAINING),
        (36.5, Bucket.CHECKPOINT_BLOCKING),
        (37.5, Bucket.EFFECTIVE_TRAINING),
        (42, Bucket.SHUTDOWN),
    ]


def crash_hang_complete_job() -> Stream:
    s = Stream()
    s.sup(EventKind.SUPERVISOR_START, 0)
    # Attempt 0 crashes at 26 after step 20; step 10 was committed.
    s.attempt(0, 1, 26, "failed", 1, reason="exit status 1")
    s.phase(0, Phase.INIT, 1.5, 4)
    s.steps(0, 1, 20, t_first=5)  # 5..24
    s.add(EventKind.CHECKPOINT_COMMIT, 15.5, step=10, data={"path": "c10"})
    s.add(EventKind.FAILURE, 25, data={"exception": "RuntimeError", "message": "boom"})
    # Rank 1 says very different things; only rank 0 draws the timeline.
    s.phase(0, Phase.COMPILE, 1, 20, rank=1).steps(0, 1, 20, t_first=5.5, rank=1)
    # Attempt 1 restores step 10, then hangs after step 15 until the watchdog at 60.
    s.attempt(1, 30, 60, "hung", -9, reason="no progress for 20 s")
    s.phase(1, Phase.RESTORE, 31, 33).add(EventKind.RESUMED, 33, 1, step=10)
    s.steps(1, 11, 15, t_first=35)  # 35..39
    s.add(EventKind.CHECKPOINT_COMMIT, 37.5, 1, step=12, data={"path": "c12"})
    s.phase(1, Phase.CHECKPOINT_BLOCKING, 0, None, rank=1)  # rank 1: ignored, though open
    # Attempt 2 resumes step 12 and completes.
    s.attempt(2, 62, 95, "completed", 0)
    s.phase(2, Phase.COMPILE, 63, 70).phase(2, Phase.GET_FIRST_BATCH_DATA, 65, 71)
    s.add(EventKind.RESUMED, 64, 2, step=12)
    s.steps(2, 13, 32, t_first=72)  # 72..91
    s.add(EventKind.RECOMPILE, 80, 2, data={"reason": "dynamic shape"})
    s.sup(EventKind.JOB_END, 96, 2, exit_status=0)
    return s


def test_crash_then_hang_then_completion() -> None:
    r = crash_hang_complete_job().report(job_id="b")
    assert_buckets(
        r,
        {
            Bucket.INIT: 1 + 3 + 2 + 1,
            Bucket.COMPILE: 7,
            Bucket.RESTORE: 2,
            Bucket.DATA_WAIT: 1,
            Bucket.EFFECTIVE_TRAINING: 10 + 2 + 20,
            # attempt 0: steps 11-20 + 24 -> its FAILURE at 25; 25 -> its end 26 is teardown (restart)
            Bucket.WASTED_PROGRESS: (10 + 1) + (3 + 21),
            Bucket.RESTART: 1 + 4 + 2,
            Bucket.SHUTDOWN: 5,
        },
    )
    a0, a1, a2 = r.attempts
    assert [a.outcome for a in r.attempts] == [Outcome.FAILED, Outcome.HUNG, Outcome.COMPLETED]
    assert [a.exit_code for a in r.attempts] == [1, -9, 0]
    assert [a.resumed_from_step for a in r.attempts] == [None, 10, 12]
    assert [a.last_step for a in r.attempts] == [20, 15, 32]
    assert [a.lost_steps for a in r.attempts] == [10, 3, 0]
    assert [a.training_start_ts - T0 for a in r.attempts] == pytest.approx([4, 34, 71])
    assert r.tts_s == pytest.approx(4)  # supervisor start 0 -> training start 4
    assert r.ttr_s == pytest.approx((34 - 26, 71 - 60))
    assert r.num_failures == 2
    assert r.effective_training_s == pytest.approx(32)
    assert r.idleness_s == pytest.approx(4 + 5)  # attempt 0's start-up (with the supervisor's) + shutdown
    assert r.failure_s == pytest.approx(35 + 7 + (2 + 2) + (1 + 7 + 1))
    assert a0.failure == {
        "reason": "exit status 1",
        "process_failure": {"exception": "RuntimeError", "message": "boom", "rank": 0, "ts": T0 + 25},
    }
    assert a1.failure == {"reason": "no progress for 20 s"} and a2.failure is None
    assert dict(a0.buckets_s) == pytest.approx(
        {
            **{b: 0.0 for b in Bucket},
            Bucket.INIT: 4,
            Bucket.EFFECTIVE_TRAINING: 10,
            Bucket.WASTED_PROGRESS: 11,
            Bucket.RESTART: 1,
        }
    )
    assert a1.buckets_s[Bucket.RESTART] == pytest.approx(4) and a2.buckets_s[Bucket.RESTART] == pytest.approx(
        2
    )
    assert [(x.attempt, x.reason) for x in r.recompiles] == [(2, "dynamic shape")]
    assert all(a.reference_rank == 0 for a in r.attempts)
    assert "compile" not in a0.phases_s  # rank 1's compile is not in the raw phases either


def _two_rank_crash(*, failure: bool, detected: float | None, **end: object) -> Stream:
    """A 2-rank attempt 0 (1 -> 30) with steps 1..10 at 5..14, commit of step 4; attempt 1 resumes step 4.
    `end`: more of attempt 0's ATTEMPT_END data."""
    s = Stream().sup(EventKind.SUPERVISOR_START, 0)
    s.attempt(0, 1, 30, "failed", 1, **end)
    for rank in (0, 1):
        s.steps(0, 1, 10, t_first=5, rank=rank)
    s.add(EventKind.CHECKPOINT_COMMIT, 8.5, step=4, data={"path": "c4"})
    if failure:  # rank 1 raised at 20; torchrun and rank 0 took 10 s to die
        s.add(EventKind.FAILURE, 20, rank=1, data={"exception": "RuntimeError"})
    if detected is not None:
        s.sup(EventKind.MARK, detected, name="failure_detected", returncode=1)
    s.attempt(1, 32, 40, "completed", 0).add(EventKind.RESUMED, 33, 1, step=4)
    s.steps(1, 5, 10, t_first=34)  # 34..39
    return s.sup(EventKind.JOB_END, 41, 1, exit_status=0)


def test_the_teardown_after_a_ranks_failure_is_restart() -> None:
    r = _two_rank_crash(failure=True, detected=29.5).report()
    # Attempt 0: init 1 (0 -> 1) + 3 (1 -> training start 4), effective 4 (steps 1-4), wasted 6 (steps 5-10,
    # 8 -> 14) + 6 (14 -> rank 1's FAILURE at 20), restart 10 (20 -> its end 30) + 2 (30 -> 32).
    assert_buckets(
        r,
        {
            Bucket.INIT: 1 + 3 + 1,
            Bucket.EFFECTIVE_TRAINING: 4 + 6,
            Bucket.WASTED_PROGRESS: 6 + 6,
            Bucket.RESTART: 10 + 2,
            Bucket.SHUTDOWN: 1 + 1,  # last step 39 -> 40, 40 -> job end 41
        },
    )
    assert r.attempts[0].buckets_s[Bucket.RESTART] == pytest.approx(10)
    assert r.ttr_s == pytest.approx((33 - 30,))  # the headline still starts at the attempt's end


def test_without_a_failure_the_detection_starts_the_teardown_and_unknown_keeps_it_wasted() -> None:
    # SIGKILL: no rank recorded it; the supervisor saw the death at 25 (its failure_detected MARK).
    r = _two_rank_crash(failure=False, detected=25).report()
    assert r.buckets_s[Bucket.WASTED_PROGRESS] == pytest.approx(6 + 11)
    assert r.buckets_s[Bucket.RESTART] == pytest.approx(5 + 2)
    # Nothing says when it failed (books without the supervisor's MARK): to the end, as before.
    r = _two_rank_crash(failure=False, detected=None).report()
    assert r.buckets_s[Bucket.WASTED_PROGRESS] == pytest.approx(6 + 16)
    assert r.buckets_s[Bucket.RESTART] == pytest.approx(2)


def test_an_injected_kill_is_its_own_failure_instant() -> None:
    # `--inject kill` under a launcher inside the job (`accelerate launch`): the rank marks the fault and
    # SIGKILLs itself at 15; the launcher noticed and exited at 25. Its 10 s reaction is restart, not lost
    # progress (it was: the inject MARK was written, flushed, and not read).
    s = _two_rank_crash(failure=False, detected=25)
    s.add(EventKind.MARK, 15, rank=1, data={"name": "inject", "spec": "kill@step=10,attempt=0,rank=1"})
    r = s.report()
    assert r.buckets_s[Bucket.WASTED_PROGRESS] == pytest.approx(6 + 1)  # steps 5-10, then 14 -> 15
    assert r.buckets_s[Bucket.RESTART] == pytest.approx(15 + 2)  # 15 -> its end 30, 30 -> 32
    # An injected hang stays lost progress until the watchdog's detection, as every hang.
    s = _two_rank_crash(failure=False, detected=25)
    s.add(EventKind.MARK, 15, rank=1, data={"name": "inject", "spec": "hang@step=10,attempt=0,rank=1"})
    assert s.report().buckets_s[Bucket.WASTED_PROGRESS] == pytest.approx(6 + 11)


def test_a_rank_the_supervisor_saw_gone_is_the_failure_instant_where_nothing_better_says() -> None:
    # `bash -c 'exec torchrun ...'`, rank 1 SIGKILLed at ~15: no FAILURE, no inject mark; the supervisor's look
    # saw its pid gone at 15.5 (ATTEMPT_END's rank_gone_ts); torchrun noticed, stopped rank 0 and exited at 25.
    # Its 9.5 s reaction was wasted_progress, and the TTR's detection unknown.
    r = _two_rank_crash(failure=False, detected=25, rank_gone_ts=T0 + 15.5).report()
    assert r.buckets_s[Bucket.WASTED_PROGRESS] == pytest.approx(6 + 1.5)  # steps 5-10, then 14 -> 15.5
    assert r.buckets_s[Bucket.RESTART] == pytest.approx(14.5 + 2)  # 15.5 -> its end 30, 30 -> 32
    (parts,) = r.ttr_parts
    assert parts.failure_known and parts.parts_s["detection"] == pytest.approx(25 - 15.5)
    # Before the attempt's last STEP (a launcher that restarted its workers trained on after it): not used.
    r = _two_rank_crash(failure=False, detected=25, rank_gone_ts=T0 + 12).report()
    assert r.buckets_s[Bucket.WASTED_PROGRESS] == pytest.approx(6 + 11)
    assert r.ttr_parts[0].parts_s["detection"] is None
    # A rank's own FAILURE (at 20) is the better instant, as is an outside signal's time.
    r = _two_rank_crash(failure=True, detected=25, rank_gone_ts=T0 + 15.5).report()
    assert r.buckets_s[Bucket.WASTED_PROGRESS] == pytest.approx(6 + 6)
    r = _two_rank_crash(failure=False, detected=25, rank_gone_ts=T0 + 15.5, signalled_ts=T0 + 18).report()
    assert r.buckets_s[Bucket.WASTED_PROGRESS] == pytest.approx(6 + 4)
    # A hang stays lost progress until the watchdog fired, whatever died before.
    s = _two_rank_crash(failure=False, detected=25, rank_gone_ts=T0 + 15.5)
    s.events = [e if e.kind is not EventKind.ATTEMPT_END or e.attempt else _hung(e) for e in s.events]
    assert s.report().buckets_s[Bucket.WASTED_PROGRESS] == pytest.approx(6 + 11)
    # A damaged value is no instant.
    r = _two_rank_crash(failure=False, detected=25, rank_gone_ts=str(T0 + 15.5)).report()
    assert r.buckets_s[Bucket.WASTED_PROGRESS] == pytest.approx(6 + 11)


def test_a_launchers_exception_dates_the_failure_only_where_nothing_else_does() -> None:
    # `fabric run` (torchrun's agent in its own process, instrumented as rank 0 before it launched the ranks)
    # behind `bash run.sh`; rank 1 SIGKILLed at ~15, seen gone at 15.5; the agent stopped rank 0 and raised
    # ChildFailedError at 19 (FAILURE under rank 0, `launcher: true`). Before 2026-12-05 that FAILURE was the
    # failure instant: the agent's teardown (15.5 -> 19) read as lost progress.
    s = _two_rank_crash(failure=False, detected=25, rank_gone_ts=T0 + 15.5)
    s.add(EventKind.FAILURE, 19, rank=0, data={"exception": "ChildFailedError", "launcher": True})
    r = s.report()
    assert r.buckets_s[Bucket.WASTED_PROGRESS] == pytest.approx(6 + 1.5)  # steps 5-10, then 14 -> 15.5
    assert r.ttr_parts[0].parts_s["detection"] == pytest.approx(25 - 15.5)
    # Nothing else known (no look saw the rank gone): the launcher's exception is still before the detection.
    s = _two_rank_crash(failure=False, detected=25)
    s.add(EventKind.FAILURE, 19, rank=0, data={"exception": "ChildFailedError", "launcher": True})
    r = s.report()
    assert r.buckets_s[Bucket.WASTED_PROGRESS] == pytest.approx(6 + 5)  # 14 -> 19
    assert r.ttr_parts[0].parts_s["detection"] == pytest.approx(25 - 19)


def _hung(end: Event) -> Event:
    return Event(end.kind, end.ts, end.attempt, end.rank, data={**(end.data or {}), "outcome": "hung"})


def test_preemption_keeps_only_committed_progress() -> None:
    s = Stream().sup(EventKind.SUPERVISOR_START, 0)
    s.attempt(0, 0.5, 12, "preempted", 143, signal="SIGTERM")
    s.steps(0, 1, 10, t_first=2)  # 2..11
    s.phase(0, Phase.CHECKPOINT_BLOCKING, 7.2, 7.8)  # inside step 7, which is lost
    s.add(EventKind.CHECKPOINT_COMMIT, 8.2, step=6)
    s.sup(EventKind.JOB_END, 12.5, exit_status=143)
    r = s.report()
    assert_buckets(
        r,
        {
            Bucket.INIT: 1,
            Bucket.EFFECTIVE_TRAINING: 6,
            Bucket.CHECKPOINT_BLOCKING: 0.6,
            Bucket.WASTED_PROGRESS: 3.4 + 1,
            Bucket.SHUTDOWN: 0.5,
        },
    )
    (a,) = r.attempts
    assert (a.outcome, a.exit_code, a.lost_steps, a.last_step) == (Outcome.PREEMPTED, 143, 4, 10)
    assert a.training_start_ts == pytest.approx(T0 + 1)  # first step 2 - median interval 1
    assert r.num_failures == 1 and r.ttr_s == () and r.job_exit_status == 143
    assert r.failure_pct == pytest.approx(4.4 / 12.5 * 100)


def test_a_checkpoint_torn_by_a_later_save_keeps_nothing() -> None:
    """nanoGPT saves with torch.save straight to out/ckpt.pt; a Slurm requeue during the save at step 10
    leaves it truncated, and every attempt after it dies loading it (exit 3, the job over). The step-6 save
    that file held is gone: its steps were counted as kept (effective training, 4 steps lost) though the
    job has nothing to resume from. A load-failure mark on the path takes back the saves before it; a save
    of that path after the mark stands."""

    def job(*, saved_again: bool) -> EttReport:
        s = Stream().sup(EventKind.SUPERVISOR_START, 0)
        s.attempt(0, 0.5, 12, "preempted", 143, signal="SIGTERM")
        s.steps(0, 1, 10, t_first=2)  # 2..11
        s.add(EventKind.CHECKPOINT_COMMIT, 7.5, step=6, data={"path": "/ckpt/out/ckpt.pt"})
        s.sup(EventKind.JOB_END, 12.5, exit_status=143)
        s.sup(EventKind.SUPERVISOR_START, 20)  # the requeued run
        s.attempt(1, 21, 23, "failed", 1)
        s.add(EventKind.MARK, 22, 1, data={"name": "checkpoint_load_failed", "path": "/ckpt/out/ckpt.pt"})
        s.add(EventKind.MARK, 22, 1, 1, data={"name": "checkpoint_load_failed", "path": "/ckpt/other.pt"})
        if saved_again:  # the user removed it; a save of that path after the failed load stands
            s.add(EventKind.CHECKPOINT_COMMIT, 22.5, 1, step=6, data={"path": "/ckpt/out/ckpt.pt"})
        s.sup(EventKind.JOB_END, 23.5, 1, exit_status=3)
        return s.report()

    r = job(saved_again=False)
    assert [a.lost_steps for a in r.attempts] == [10, 0]
    assert r.buckets_s[Bucket.EFFECTIVE_TRAINING] == 0
    assert_invariants(r)
    r = job(saved_again=True)
    assert [a.lost_steps for a in r.attempts] == [4, 0]
    assert r.buckets_s[Bucket.EFFECTIVE_TRAINING] == pytest.approx(6, abs=TOL)


def test_evaluation_of_kept_work_is_evaluation_and_of_lost_work_wasted() -> None:
    """docs/buckets.md, "Evaluation": an evaluation evaluates the state after the step before it."""
    s = Stream().sup(EventKind.SUPERVISOR_START, 0)
    s.attempt(0, 1, 15, "failed", 1)
    s.phase(0, Phase.EVAL, 2, 3)  # before the first step (start-up region): evaluation
    s.steps(0, 1, 4, t_first=4)  # 4..7; training start max(3, 4 - 1) = 3
    s.phase(0, Phase.EVAL, 7, 8)  # of the state after step 4, which is kept: evaluation
    s.phase(0, Phase.CHECKPOINT_BLOCKING, 8, 8.5)
    s.add(EventKind.CHECKPOINT_COMMIT, 8.5, step=4)
    s.steps(0, 5, 8, t_first=9.5)  # 9.5..12.5: lost
    s.phase(0, Phase.EVAL, 12.5, 13.5)  # of the state after step 8, which was rolled back: wasted
    s.steps(0, 9, 9, t_first=14.5)
    s.attempt(1, 17, 25, "completed", 0)
    s.add(EventKind.RESUMED, 17.5, 1, step=4)
    s.phase(1, Phase.EVAL, 18, 19)  # the evaluation a resume repeats: evaluation (idleness) in any attempt
    s.steps(1, 5, 8, t_first=20)  # 20..23
    s.phase(1, Phase.EVAL, 23.5, 24.5)  # the final evaluation, in the completed job's tail
    s.sup(EventKind.JOB_END, 25.5, exit_status=0)
    r = s.report()
    assert_buckets(
        r,
        {
            Bucket.INIT: 1 + 1 + 1,
            Bucket.EVALUATION: 1 + 1 + 1 + 1,
            Bucket.EFFECTIVE_TRAINING: 4 + 4,
            Bucket.CHECKPOINT_BLOCKING: 0.5,
            Bucket.WASTED_PROGRESS: 1 + 3 + 2 + 0.5,
            Bucket.RESTART: 2,
            Bucket.SHUTDOWN: 1 + 0.5,
        },
    )
    a0, a1 = r.attempts
    assert (a0.lost_steps, a1.resumed_from_step, a1.lost_steps) == (5, 4, 0)
    assert a0.buckets_s[Bucket.EVALUATION] == pytest.approx(2)
    assert a1.buckets_s[Bucket.EVALUATION] == pytest.approx(2)
    assert a1.training_start_ts == pytest.approx(T0 + 19)  # after the repeated evaluation
    assert r.idleness_s == pytest.approx(2 + 4 + 0.5 + 1.5)  # attempt 1's evaluation is idleness too
    assert r.failure_s == pytest.approx(6.5 + 2 + 1)


def test_job_without_steps_is_all_start_up_and_has_no_tts() -> None:
    s = Stream().sup(EventKind.SUPERVISOR_START, 0)
    s.attempt(0, 1, 10, "failed", 1)
    s.phase(0, Phase.INIT, 2, 5).phase(0, Phase.COMPILE, 4, 8)
    s.phase(0, Phase.CHECKPOINT_BLOCKING, 8.5, 9)  # before training: counts as init
    s.attempt(1, 12, 15, "failed", 1)
    s.sup(EventKind.JOB_END, 16, 1, exit_status=1)
    r = s.report()
    assert_buckets(r, {Bucket.INIT: 1 + 3 + 2 + 3, Bucket.COMPILE: 4, Bucket.RESTART: 2, Bucket.SHUTDOWN: 1})
    assert r.tts_s is None and r.ttr_s == () and r.num_failures == 2
    assert all(a.training_start_ts is None and a.last_step is None for a in r.attempts)
    assert r.idleness_s == pytest.approx(6 + 4 + 1) and r.failure_s == pytest.approx(2 + 3)
    assert r.ett_pct == 0
    assert r.ett_unknown is None  # it failed before any step: it trained nothing, 0% is the measurement


def test_a_job_that_ends_without_a_step_seen_has_an_unknown_ett() -> None:
    """An inference job (or a loop ettr cannot see steps in) that completes reads ETT unknown, never 0.0%."""
    from ettr.report.json import to_dict
    from ettr.report.text import render, render_comparison

    s = Stream().sup(EventKind.SUPERVISOR_START, 0)
    s.attempt(0, 1, 30, "completed", 0).phase(0, Phase.EVAL, 5, 25)
    s.sup(EventKind.JOB_END, 31, 0, exit_status=0)
    r = s.report()
    assert r.ett_unknown is not None and "no training step" in r.ett_unknown
    out = to_dict(r)
    # The contract's numbers stay numbers (summing to 100); ett_unknown says they are no measurement.
    assert out["ett_pct"] == 0.0 and out["idleness_pct"] + out["failure_pct"] == 100.0
    assert out["ett_unknown"] == r.ett_unknown
    assert out["failure_pct"] == 0 and math.isclose(sum(out["buckets_s"].values()), out["wall_s"])
    text = render(r)
    assert "ETT unknown" in text and "ETT 0.0%" not in text
    assert "ETT %" in render_comparison([r, r]) and " 0.0 " not in render_comparison([r, r]).splitlines()[1]
    # one step seen: a number again
    s.steps(0, 1, 1, 26)
    assert s.report().ett_unknown is None


def test_a_job_no_process_of_which_reported_has_unknown_steps_however_it_ended() -> None:
    """`ettr run -- bash train.sh` where train.sh runs `env -i python train.py` (or a container): ettr's
    bootstrap never reaches the trainer, which may train for hours and then crash. Nothing but the supervisor's
    events: ETT unknown, never "ETT 0.0%" (it read 0.0% with a failed attempt). A process that reported its
    start and then failed before any step trained nothing: 0% stays the measurement there."""
    from ettr.report.text import render

    for outcome, exit_code in (("failed", 1), ("completed", 0), ("hung", 137)):
        s = Stream().sup(EventKind.SUPERVISOR_START, 0)
        s.attempt(0, 1, 3600, outcome, exit_code)
        s.sup(EventKind.JOB_END, 3601, 0, exit_status=exit_code)
        r = s.report()
        assert r.ett_unknown is not None and "no process of the job reported" in r.ett_unknown, outcome
        assert "ETT unknown" in render(r) and "ETT 0.0%" not in render(r)
    s = Stream().sup(EventKind.SUPERVISOR_START, 0)
    s.attempt(0, 1, 30, "failed", 1).add(EventKind.PROCESS_START, 2, 0, 0)
    s.sup(EventKind.JOB_END, 31, 0, exit_status=1)
    assert s.report().ett_unknown is None
    running = Stream().sup(EventKind.SUPERVISOR_START, 0).attempt(0, 1)  # still starting: not yet unknown
    assert running.events and running.report().ett_unknown is None


def _killed_mid_write() -> Stream:
    s = Stream().sup(EventKind.JOB_ALLOCATED, 0).sup(EventKind.SUPERVISOR_START, 2)
    s.sup(EventKind.ATTEMPT_START, 3)
    s.steps(0, 1, 5, t_first=5)  # 5..9
    s.add(EventKind.CHECKPOINT_COMMIT, 8.5, step=4)
    s.phase(0, Phase.CHECKPOINT_BLOCKING, 9.5, None)  # the save that was being written
    return s


@pytest.mark.parametrize("alive", [None, False, True])
def test_run_killed_mid_write_is_closed_at_now(alive: bool | None) -> None:
    """No end recorded: whether the supervisor is alive (running), lost, or not known, the open attempt is
    not a failure, keeps its steps so far (step 5 is at risk: after the last commit) and the time after its
    last step that no phase explains is `other`."""
    r = _killed_mid_write().report(now=11, supervisor_alive=alive)
    assert r.in_progress and r.wall_end_ts == T0 + 11
    assert (
        r.state
        == {None: JobState.IN_PROGRESS, False: JobState.SUPERVISOR_LOST, True: JobState.RUNNING}[alive]
    )
    assert_buckets(
        r,
        {
            Bucket.HARDWARE_SETUP: 2,
            Bucket.INIT: 2,
            Bucket.EFFECTIVE_TRAINING: 5,
            Bucket.OTHER: 0.5,
            Bucket.CHECKPOINT_BLOCKING: 1.5,
        },
    )
    (a,) = r.attempts
    outcome = Outcome.RUNNING if alive else Outcome.UNKNOWN
    assert (a.outcome, a.exit_code, a.closed_by_accounting, a.failure) == (outcome, None, True, None)
    assert a.end_ts == T0 + 11 and a.lost_steps == 0
    assert r.num_failures == 0 and r.failures == () and r.failure_pct == 0
    assert r.phases_s["checkpoint_blocking"] == pytest.approx(1.5)
    assert r.tts_s == pytest.approx(4)  # allocated 0 -> training start 4
    o = r.open_job
    assert o is not None and (o.attempt, o.attempt_open, o.bucket) == (0, True, Bucket.CHECKPOINT_BLOCKING)
    assert o.open_phases == ("checkpoint_blocking",) and o.last_event_ts == T0 + 9.5
    assert (o.last_step, o.last_step_ts, o.last_commit_step, o.steps_at_risk) == (5, T0 + 9, 4, 1)


def test_a_requeue_says_what_happened_to_the_lost_attempt() -> None:
    """The requeue closes the lost attempt (failed, from the ledger) and resumes from step 4: now it is a
    failure and step 5 is lost."""
    s = _killed_mid_write()
    s.sup(EventKind.ATTEMPT_END, 9.5, 0, outcome="failed", exit_code=None, closed_from_ledger=True)
    s.sup(EventKind.SUPERVISOR_START, 20).attempt(1, 21, 30, "completed", 0)
    s.add(EventKind.RESUMED, 22, 1, step=4).steps(1, 5, 8, t_first=24)
    s.sup(EventKind.JOB_END, 31, 1, exit_status=0)
    r = s.report(supervisor_alive=False)
    assert r.state == JobState.ENDED and r.open_job is None
    assert [a.outcome for a in r.attempts] == [Outcome.FAILED, Outcome.COMPLETED]
    assert r.num_failures == 1 and r.attempts[0].lost_steps == 1
    assert r.failures[0].cause.value == "infra"


def test_a_running_job_between_attempts_is_restarting() -> None:
    """Supervisor alive, attempt 0 failed, attempt 1 not started yet: the failure counts and the time since
    is `restart`."""
    s = Stream().sup(EventKind.SUPERVISOR_START, 0).attempt(0, 1, 6, "failed", 1).steps(0, 1, 3, t_first=2)
    r = s.report(now=10, supervisor_alive=True)
    assert r.state == JobState.RUNNING and r.num_failures == 1
    assert r.buckets_s[Bucket.RESTART] == pytest.approx(4)
    assert r.open_job is not None and not r.open_job.attempt_open and r.open_job.bucket == Bucket.RESTART


def test_a_failure_recorded_by_a_rank_of_the_open_attempt_counts() -> None:
    s = _killed_mid_write().add(EventKind.FAILURE, 9.8, data={"exception": "RuntimeError"})
    r = s.report(now=11, supervisor_alive=True)
    assert r.attempts[0].outcome == Outcome.FAILED and r.num_failures == 1 and r.attempts[0].lost_steps == 1


def test_open_attempt_is_closed_at_the_next_attempt_start() -> None:
    s = Stream().sup(EventKind.SUPERVISOR_START, 0)
    s.sup(EventKind.ATTEMPT_START, 1)
    s.steps(0, 1, 3, t_first=3)  # 3..5
    s.attempt(1, 8, 12, "completed", 0).add(EventKind.RESUMED, 9, 1, step=2).steps(1, 3, 4, t_first=10)
    s.sup(EventKind.JOB_END, 12, 1, exit_status=0)
    r = s.report()
    a0, a1 = r.attempts
    assert (a0.end_ts, a0.outcome, a0.lost_steps) == (T0 + 8, Outcome.FAILED, 1)
    assert_buckets(
        r,
        {
            Bucket.INIT: 1 + 1 + 1,
            Bucket.EFFECTIVE_TRAINING: 2 + 2,
            Bucket.WASTED_PROGRESS: 1 + 3,
            Bucket.SHUTDOWN: 1,
        },
    )
    assert r.ttr_s == pytest.approx((1,))  # attempt 1 trains from 9 (first step 10 - interval 1)


def test_lone_phase_end_is_a_full_span_and_open_begin_closes_at_attempt_end() -> None:
    s = Stream().sup(EventKind.SUPERVISOR_START, 0)
    s.attempt(0, 0, 20, "completed", 0)
    s.lone_end(0, Phase.COMPILE, 1, 4)  # timed after the fact
    s.add(EventKind.PHASE_BEGIN, 4, phase=Phase.RESTORE)
    s.lone_end(0, Phase.RESTORE, None, 6)  # no value: closes the open restore begun at 4
    s.lone_end(0, Phase.EVAL, None, 7)  # no value and nothing open: nothing to attribute
    s.add(EventKind.TRAINING_START, 7)
    s.steps(0, 1, 5, t_first=8)  # 8..12
    s.phase(0, Phase.OTHER, 12.5, None)  # open: closed at the attempt end, but the tail is shutdown
    s.phase(0, Phase.EVAL, 9.5, 10)
    s.sup(EventKind.JOB_END, 20, exit_status=0)
    r = s.report()
    assert_buckets(
        r,
        {
            Bucket.INIT: 1 + 1,
            Bucket.COMPILE: 3,
            Bucket.RESTORE: 2,
            Bucket.EFFECTIVE_TRAINING: 4.5,
            Bucket.EVALUATION: 0.5,
            Bucket.SHUTDOWN: 8,
        },
    )
    assert r.attempts[0].training_start_ts == T0 + 7  # the explicit TRAINING_START
    assert r.phases_s["other"] == pytest.approx(7.5)  # raw: the open phase runs to the attempt end


def test_reference_rank_is_the_lowest_when_rank_0_is_silent() -> None:
    s = Stream().sup(EventKind.SUPERVISOR_START, 0).attempt(0, 0, 10, "completed", 0)
    s.phase(0, Phase.COMPILE, 0, 4, rank=3).steps(0, 1, 4, t_first=5, rank=3)
    s.phase(0, Phase.RESTORE, 0, 2, rank=2).steps(0, 1, 4, t_first=4, rank=2)
    s.sup(EventKind.JOB_END, 10, exit_status=0)
    r = s.report()
    assert r.attempts[0].reference_rank == 2
    assert_buckets(r, {Bucket.RESTORE: 2, Bucket.INIT: 1, Bucket.EFFECTIVE_TRAINING: 4, Bucket.SHUTDOWN: 3})


def test_reference_rank_is_one_that_stepped_when_rank_0_took_no_step() -> None:
    """`ettr run -- mpirun -np 2 python train.py` with two independent trainers: rank 1 crashed at its step 4
    before rank 0 (slower to start) took one. Rank 0 as the reference read "ETT unknown (no training step
    seen)" and no last step, although rank 1's steps were in the books."""
    s = Stream().sup(EventKind.SUPERVISOR_START, 0).attempt(0, 0, 10, "failed", 1)
    s.add(EventKind.PROCESS_START, 0.5, rank=0).add(EventKind.PROCESS_START, 0.5, rank=1)
    s.steps(0, 1, 4, t_first=5, rank=1)
    s.sup(EventKind.JOB_END, 10, exit_status=1)
    r = s.report()
    assert r.attempts[0].reference_rank == 1
    assert r.attempts[0].last_step == 4
    assert r.ett_unknown is None
    # rank 0 that stepped stays the reference, whatever the others did
    s = Stream().sup(EventKind.SUPERVISOR_START, 0).attempt(0, 0, 10, "completed", 0)
    s.steps(0, 1, 2, t_first=6, rank=0).steps(0, 1, 4, t_first=4, rank=1)
    s.sup(EventKind.JOB_END, 10, exit_status=0)
    assert s.report().attempts[0].reference_rank == 0


def test_api_only_stream_without_supervisor() -> None:
    def stream() -> Stream:
        s = Stream().add(EventKind.PROCESS_START, 1, data={"pid": 7})
        s.phase(0, Phase.INIT, 1, 3)
        return s.steps(0, 1, 5, t_first=4)  # 4..8

    ended = stream().sup(EventKind.JOB_END, 9, exit_status=0).report()
    assert not ended.in_progress and ended.wall_start_ts == T0 + 1
    assert_buckets(ended, {Bucket.INIT: 2, Bucket.EFFECTIVE_TRAINING: 5, Bucket.SHUTDOWN: 1})
    (a,) = ended.attempts
    assert (a.outcome, a.closed_by_accounting, a.exit_code, a.start_ts, a.end_ts) == (
        Outcome.COMPLETED,
        True,
        None,
        T0 + 1,
        T0 + 8,
    )
    assert ended.tts_s == pytest.approx(2)  # no allocation, no supervisor: from the wall start

    # Without a job end, the run is open at `now`: not known to have failed, its steps kept so far, all five
    # at risk (nothing committed); after its last step the books say nothing yet.
    live = stream().report(now=10)
    assert live.in_progress and live.attempts[0].end_ts == T0 + 10
    assert live.attempts[0].outcome == Outcome.UNKNOWN and live.num_failures == 0
    assert_buckets(live, {Bucket.INIT: 2, Bucket.EFFECTIVE_TRAINING: 5, Bucket.OTHER: 2})
    assert live.open_job is not None and live.open_job.steps_at_risk == 5


def test_api_only_attempts_without_attempt_events() -> None:
    s = Stream().add(EventKind.PROCESS_START, 0).steps(0, 1, 4, t_first=2)  # 2..5
    s.add(EventKind.CHECKPOINT_COMMIT, 3.5, step=2)
    s.add(EventKind.PROCESS_START, 8, 1).add(EventKind.RESUMED, 9, 1, step=2).steps(1, 3, 6, t_first=10)
    s.sup(EventKind.JOB_END, 14, 1, exit_status=0)
    r = s.report()
    a0, a1 = r.attempts
    assert (a0.start_ts, a0.end_ts, a0.outcome, a0.lost_steps) == (T0, T0 + 5, Outcome.FAILED, 2)
    assert (a1.start_ts, a1.end_ts, a1.outcome) == (T0 + 8, T0 + 13, Outcome.COMPLETED)
    assert_buckets(
        r,
        {
            Bucket.INIT: 1 + 1,
            Bucket.EFFECTIVE_TRAINING: 2 + 4,
            Bucket.WASTED_PROGRESS: 2,
            Bucket.RESTART: 3,
            Bucket.SHUTDOWN: 1,
        },
    )


def test_steps_are_kept_by_the_next_attempt_that_resumed_not_one_that_died_first() -> None:
    s = Stream().sup(EventKind.SUPERVISOR_START, 0)
    s.attempt(0, 0, 12, "failed", 1).steps(0, 1, 10, t_first=2)  # 2..11
    s.attempt(1, 13, 15, "failed", 1)  # dies during init, before it could resume anything
    s.attempt(2, 16, 22, "completed", 0).add(EventKind.RESUMED, 17, 2, step=6).steps(2, 7, 10, t_first=18)
    s.sup(EventKind.JOB_END, 22, 2, exit_status=0)
    r = s.report()
    assert [a.lost_steps for a in r.attempts] == [4, 0, 0]
    assert r.buckets_s[Bucket.EFFECTIVE_TRAINING] == pytest.approx(6 + 4)
    assert r.ttr_s == pytest.approx((17 - 12, 17 - 15))  # both failures recover at attempt 2's start


def test_resuming_from_scratch_loses_every_step() -> None:
    s = Stream().sup(EventKind.SUPERVISOR_START, 0)
    s.attempt(0, 0, 6, "failed", 1).steps(0, 1, 4, t_first=2)
    s.attempt(1, 6, 12, "completed", 0).add(EventKind.RESUMED, 6.5, 1, step=None).steps(1, 1, 4, t_first=8)
    s.sup(EventKind.JOB_END, 12, 1, exit_status=0)
    r = s.report()
    assert r.attempts[0].lost_steps == 4 and r.attempts[1].resumed_from_step is None
    assert r.buckets_s[Bucket.WASTED_PROGRESS] == pytest.approx(4 + 1)


def test_single_step_attempt_starts_training_at_its_step() -> None:
    s = Stream().sup(EventKind.SUPERVISOR_START, 0).attempt(0, 0, 5, "completed", 0)
    s.phase(0, Phase.COMPILE, 0, 2).steps(0, 1, 1, t_first=3).sup(EventKind.JOB_END, 5, exit_status=0)
    r = s.report()
    assert r.attempts[0].training_start_ts == T0 + 3
    assert_buckets(r, {Bucket.COMPILE: 2, Bucket.INIT: 1, Bucket.SHUTDOWN: 2})


def test_submitted_without_allocation_is_other() -> None:
    s = Stream().sup(EventKind.JOB_SUBMITTED, 0).sup(EventKind.SUPERVISOR_START, 5)
    s.attempt(0, 6, 9, "completed", 0).steps(0, 1, 2, t_first=7).sup(EventKind.JOB_END, 9, exit_status=0)
    r = s.report()
    assert_buckets(r, {Bucket.OTHER: 5, Bucket.INIT: 1, Bucket.EFFECTIVE_TRAINING: 2, Bucket.SHUTDOWN: 1})
    assert r.tts_s == pytest.approx(1)  # from the supervisor start (allocation unknown)


def _requeued_job(submitted_at: float | None, allocated_at: float | None) -> Stream:
    """Submitted 0, allocated 2, supervisor 3; attempt 0 [4, 10] preempted after committing step 4; a
    requeued run's supervisor starts at 20 (with its run's own times), attempt 1 [21, 25] completes."""
    s = (
        Stream()
        .sup(EventKind.JOB_SUBMITTED, 0)
        .sup(EventKind.JOB_ALLOCATED, 2)
        .sup(EventKind.SUPERVISOR_START, 3)
    )
    s.attempt(0, 4, 10, "preempted", 143).steps(0, 1, 4, t_first=6)
    s.add(EventKind.CHECKPOINT_COMMIT, 9.5, 0, step=4)
    run = {
        k: T0 + v
        for k, v in (("submitted_at", submitted_at), ("allocated_at", allocated_at))
        if v is not None
    }
    s.sup(EventKind.SUPERVISOR_START, 20, **run)
    s.attempt(1, 21, 25, "completed", 0).add(EventKind.RESUMED, 21.5, 1, step=4).steps(1, 5, 6, t_first=23)
    return s.sup(EventKind.JOB_END, 25, 1, exit_status=0)


def test_a_requeued_runs_wait_is_scheduling() -> None:
    r = _requeued_job(submitted_at=11, allocated_at=17).report()
    assert_invariants(r)
    later = r.attempts[1].buckets_s
    assert later[Bucket.SCHEDULING] == pytest.approx(6)  # 11 -> 17: in the queue
    assert later[Bucket.HARDWARE_SETUP] == pytest.approx(3)  # 17 -> 20: allocated, the supervisor not yet up
    assert later[Bucket.RESTART] == pytest.approx(1 + 1)  # 10 -> 11 (until the requeue), 20 -> 21 (relaunch)
    assert r.attempts[0].buckets_s[Bucket.SCHEDULING] == pytest.approx(2)  # the first submission's
    assert r.buckets_s[Bucket.SCHEDULING] == pytest.approx(2 + 6)
    # What the preemption cost stays failure, as it was when the whole gap was `restart`.
    assert classify(Bucket.SCHEDULING, attempt_position=1) is Loss.FAILURE
    assert classify(Bucket.SCHEDULING, attempt_position=0) is Loss.IDLENESS
    as_restart = _requeued_job(submitted_at=None, allocated_at=None).report()
    assert as_restart.attempts[1].buckets_s[Bucket.RESTART] == pytest.approx(11)
    assert r.failure_pct == pytest.approx(as_restart.failure_pct)
    assert r.ett_pct == pytest.approx(as_restart.ett_pct)


def test_a_requeued_runs_times_are_clamped_to_the_gap() -> None:
    # Slurm's times are whole seconds: a submission "before" the attempt's end, an allocation after the
    # supervisor's start, are clamped; an allocation alone is set-up, its wait before it restart.
    early = _requeued_job(submitted_at=9, allocated_at=22).report()
    assert early.attempts[1].buckets_s[Bucket.SCHEDULING] == pytest.approx(10)  # 10 -> 20
    assert early.attempts[1].buckets_s[Bucket.HARDWARE_SETUP] == 0.0
    assert_invariants(early)
    alone = _requeued_job(submitted_at=None, allocated_at=17).report()
    assert alone.attempts[1].buckets_s[Bucket.SCHEDULING] == 0.0
    assert alone.attempts[1].buckets_s[Bucket.HARDWARE_SETUP] == pytest.approx(3)
    assert alone.attempts[1].buckets_s[Bucket.RESTART] == pytest.approx(7 + 1)
    assert_invariants(alone)


def test_a_new_attempt_after_job_end_reopens_the_job() -> None:
    s = Stream().sup(EventKind.SUPERVISOR_START, 0)
    s.attempt(0, 0, 4, "completed", 0).steps(0, 1, 2, t_first=2).sup(EventKind.JOB_END, 4, exit_status=0)
    s.sup(EventKind.ATTEMPT_START, 10, 1).add(EventKind.RESUMED, 11, 1, step=2).steps(1, 3, 4, t_first=12)
    r = s.report(now=15)
    assert r.in_progress and r.wall_end_ts == T0 + 15
    assert r.attempts[0].lost_steps == 0 and r.attempts[1].end_ts == T0 + 15
    assert_invariants(r)


def test_event_order_does_not_matter() -> None:
    events = crash_hang_complete_job().events
    forward = compute(events, T0 + 100, job_id="x")
    backward = compute(list(reversed(events)), T0 + 100, job_id="x")
    assert forward == backward


def test_empty_and_zero_wall() -> None:
    r = compute([], T0)
    assert (r.wall_s, r.ett_pct, r.idleness_pct, r.failure_pct, r.attempts, r.segments) == (
        0,
        0,
        0,
        0,
        (),
        (),
    )
    assert r.in_progress and r.tts_s is None


def test_idleness_and_failure_split_of_start_up_buckets() -> None:
    # scheduling and hardware_setup of a later attempt: a requeued run's wait (what a preemption cost).
    recovery = (Bucket.INIT, Bucket.COMPILE, Bucket.RESTORE, Bucket.DATA_WAIT, Bucket.SCHEDULING)
    for bucket in (*recovery, Bucket.HARDWARE_SETUP):
        assert classify(bucket, attempt_position=0) is Loss.IDLENESS
        assert classify(bucket, attempt_position=1) is Loss.FAILURE
    for bucket in (Bucket.WASTED_PROGRESS, Bucket.RESTART):
        assert classify(bucket, attempt_position=0) is Loss.FAILURE
    for bucket in (Bucket.CHECKPOINT_BLOCKING, Bucket.SHUTDOWN, Bucket.OTHER, Bucket.EVALUATION):
        assert classify(bucket, attempt_position=0) is Loss.IDLENESS
        assert classify(bucket, attempt_position=3) is Loss.IDLENESS
    assert classify(Bucket.EFFECTIVE_TRAINING, attempt_position=2) is Loss.EFFECTIVE


def test_malformed_events_are_tolerated() -> None:
    s = Stream().sup(EventKind.SUPERVISOR_START, 0).attempt(0, 1, 6, "completed", 0).steps(0, 1, 3, t_first=3)
    s.events.append(Event(EventKind.STEP, math.nan, 0, 0, step=99))  # no time: cannot be placed
    s.events.append(Event(EventKind.CHECKPOINT_COMMIT, T0 + 4, 0, 0, step=2, data=["not", "a", "mapping"]))
    s.events.append(Event(EventKind.STEP, T0 + 4.5, 0, 0, step=None))  # a step without a number
    s.events.append(Event(EventKind.JOB_END, T0 + 7, 0, SUPERVISOR_RANK, data="odd"))
    r = s.report(now=7)
    assert r.attempts[0].last_step == 3 and r.checkpoint_commits[0].path is None and r.job_exit_status is None
    assert_buckets(r, {Bucket.INIT: 2, Bucket.EFFECTIVE_TRAINING: 3, Bucket.SHUTDOWN: 2})


def test_events_of_an_attempt_after_its_end_are_fenced_and_counted() -> None:
    """An orphan of attempt 0 keeps stepping after attempt 0 was closed and attempt 1 started: its steps
    count neither as attempt 0's progress nor stretch it; within the grace they still count."""

    def stream(orphan: bool) -> Stream:
        s = Stream().sup(EventKind.SUPERVISOR_START, 0).attempt(0, 0, 10, "failed", -9)
        s.steps(0, 1, 5, t_first=3)  # 3..7
        s.add(EventKind.STEP, 11, 0, step=6)  # within the grace (end 10 + 2 s): recorded before the exit
        s.attempt(1, 12, 30, "completed", 0).steps(1, 6, 20, t_first=14)
        if orphan:
            s.steps(0, 7, 26, t_first=13)  # the orphan of attempt 0, 20 steps while attempt 1 runs
        return s.sup(EventKind.JOB_END, 30, exit_status=0)

    clean, fenced = stream(False).report(), stream(True).report()
    assert clean.num_fenced_events == 0 and fenced.num_fenced_events == 20
    assert fenced.buckets_s == clean.buckets_s and fenced.attempts == clean.attempts
    assert fenced.attempts[0].last_step == 6


def test_a_restore_or_evaluation_after_the_first_batch_is_still_start_up() -> None:
    # HF Trainer resuming a streamed dataset: the first `next` of a loader (get_first_batch_data) comes
    # first, then its fast-forward through the batches already trained on (restore), then the first step;
    # with `eval_on_start` an evaluation runs after the evaluation loader's first batch. Both are the TTR's.
    s = Stream()
    s.sup(EventKind.SUPERVISOR_START, 0)
    s.attempt(0, 1, 20, "failed", 1, reason="exit status 1")
    s.phase(0, Phase.GET_FIRST_BATCH_DATA, 2, 3)
    s.steps(0, 1, 10, t_first=4)  # 4..13
    s.attempt(1, 22, 60, "completed", 0)
    s.phase(1, Phase.GET_FIRST_BATCH_DATA, 24, 25).phase(1, Phase.RESTORE, 25, 30)
    s.phase(1, Phase.EVAL, 30, 33)
    s.add(EventKind.RESUMED, 30, 1, step=5)
    s.steps(1, 6, 20, t_first=34)  # 34..48
    s.sup(EventKind.JOB_END, 61, 1, exit_status=0)
    r = s.report(job_id="ff")
    assert [a.training_start_ts - T0 for a in r.attempts] == pytest.approx([3, 33])
    assert r.ttr_s == pytest.approx((33 - 20,))


def test_a_save_that_every_rank_committed_counts_once() -> None:
    from ettr.accounting.model import CheckpointCommit, distinct_saves
    from ettr.report.text import render

    def commit(ts: float, rank: int, step: int | None, attempt: int = 0) -> CheckpointCommit:
        return CheckpointCommit(ts=ts, attempt=attempt, rank=rank, step=step, path=f"p{rank}")

    commits = [
        commit(1.0, 0, 15), commit(1.1, 1, 15),  # accelerate's save_state: one random-state file per rank
        commit(2.0, 0, 30), commit(2.2, 1, 30),
        commit(3.0, 0, 60), commit(3.5, 0, 60),  # an HF Trainer's checkpoint-60, then its save_model
        commit(4.0, 0, 60, attempt=1),  # the same step saved again after a restart: another save
        commit(5.0, 0, None), commit(5.1, 1, None),  # steps unknown: each its own
    ]  # fmt: skip
    saves = distinct_saves(reversed(commits))
    assert [(c.attempt, c.step, c.rank) for c in saves] == [
        (0, 15, 0), (0, 30, 0), (0, 60, 0), (1, 60, 0), (0, None, 0), (0, None, 1),
    ]  # fmt: skip
    s = Stream()
    s.sup(EventKind.SUPERVISOR_START, 0)
    s.attempt(0, 1, 20, "completed", 0)
    s.steps(0, 1, 10, t_first=4)
    for rank in (0, 1):
        s.add(EventKind.CHECKPOINT_COMMIT, 8.0 + rank / 10, step=5, rank=rank, data={"path": f"r{rank}"})
    s.sup(EventKind.JOB_END, 21, 0, exit_status=0)
    assert "checkpoint commits 1 (last step 5)" in render(s.report(job_id="c"))


def test_an_attempt_without_resumed_that_numbers_on_resumed_where_its_first_step_says() -> None:
    # A script that restores its own state and numbers its steps (`ettr.step(n)`), with no RESUMED event:
    # attempt 1's first step is 31, so it went on from 30. Read as "from scratch", steps 1..30 were lost
    # (soak trial: ETT 0.5% for a job at ~45%).
    s = Stream().sup(EventKind.SUPERVISOR_START, 0)
    s.attempt(0, 0, 12, "failed", 1).steps(0, 1, 10, t_first=2)  # 2..11
    s.attempt(1, 13, 22, "completed", 0).steps(1, 11, 18, t_first=14)
    s.sup(EventKind.JOB_END, 22, 1, exit_status=0)
    r = s.report()
    assert [a.lost_steps for a in r.attempts] == [0, 0]
    assert r.attempts[1].resumed_from_step == 10
    assert_invariants(r)
    # Numbered from 1 again: from scratch, as before.
    s = Stream().sup(EventKind.SUPERVISOR_START, 0)
    s.attempt(0, 0, 12, "failed", 1).steps(0, 1, 10, t_first=2)
    s.attempt(1, 13, 22, "completed", 0).steps(1, 1, 8, t_first=14)
    s.sup(EventKind.JOB_END, 22, 1, exit_status=0)
    r = s.report()
    assert [a.lost_steps for a in r.attempts] == [10, 0] and r.attempts[1].resumed_from_step is None


def test_a_job_run_again_after_it_completed_books_no_failure_for_the_gap():
    """Slurm trial: `scontrol requeue` of a job that had completed (as `ettr run` on its run directory to
    train on does) read `failure 74.1%` with `failures 0`: the 89 s between the first run's end and the
    second's start was `restart` (failure detected -> next start, the contract says: none was). It is
    `other`. The second run's start-up stays failure, as the contract books every later attempt's."""
    s, t = SUPERVISOR_RANK, T0
    events = [Event(EventKind.SUPERVISOR_START, t, 0, s), Event(EventKind.ATTEMPT_START, t, 0, s),
              Event(EventKind.PROCESS_START, t, 0, 0)]  # fmt: skip
    events += [Event(EventKind.STEP, t + 1 + i, 0, 0, step=i + 1) for i in range(10)]
    events += [
        Event(EventKind.CHECKPOINT_COMMIT, t + 10.5, 0, 0, step=10),
        Event(EventKind.ATTEMPT_END, t + 11, 0, s, data={"outcome": "completed", "exit_code": 0}),
        Event(EventKind.JOB_END, t + 11.5, 0, s, data={"exit_status": 0}),
    ]
    again = t + 100
    events += [
        Event(EventKind.SUPERVISOR_START, again, 1, s),
        Event(EventKind.ATTEMPT_START, again, 1, s),
        Event(EventKind.PROCESS_START, again, 1, 0),
        Event(EventKind.RESUMED, again + 2, 1, 0, step=10),
        Event(EventKind.ATTEMPT_END, again + 3, 1, s, data={"outcome": "completed", "exit_code": 0}),
        Event(EventKind.JOB_END, again + 3.5, 1, s, data={"exit_status": 0}),
    ]
    report = compute(events, again + 4)
    assert report.num_failures == 0 and report.buckets_s[Bucket.RESTART] == 0.0
    assert report.buckets_s[Bucket.OTHER] == pytest.approx(100 - 11)  # attempt 0's end -> attempt 1's start
    assert report.failure_pct < 5.0  # attempt 1's start-up alone (was 74%+)
    # After a failure the gap stays `restart`.
    failed = [e if e.kind is not EventKind.ATTEMPT_END or e.attempt else
              Event(e.kind, e.ts, 0, s, data={"outcome": "failed", "exit_code": 1}) for e in events]  # fmt: skip
    failed = [e for e in failed if not (e.kind is EventKind.JOB_END and e.attempt == 0)]
    assert compute(failed, again + 4).buckets_s[Bucket.RESTART] > 80


def test_a_supervised_last_attempt_whose_end_row_was_lost_completed_when_the_job_ended_with_status_0() -> (
    None
):
    """A damaged ATTEMPT_END row (skipped by the codec) of a job whose supervisor then wrote JOB_END with
    status 0: the attempt completed. It was read as a failure of unknown cause, every kept step lost (a real
    mnist job: ETT 77.3% -> 0.0%, wasted_progress 140.7 s of 166.3 s)."""
    s = Stream().sup(EventKind.SUPERVISOR_START, 0).sup(EventKind.ATTEMPT_START, 1)
    s.steps(0, 1, 10, t_first=3)  # 3..12
    s.sup(EventKind.JOB_END, 13, exit_status=0)
    r = s.report()
    assert r.attempts[0].outcome == Outcome.COMPLETED and r.num_failures == 0
    assert r.buckets_s[Bucket.WASTED_PROGRESS] == 0 and r.buckets_s[Bucket.EFFECTIVE_TRAINING] > 0
    failed = Stream().sup(EventKind.SUPERVISOR_START, 0).sup(EventKind.ATTEMPT_START, 1)
    failed.steps(0, 1, 10, t_first=3).sup(EventKind.JOB_END, 13, exit_status=1)
    assert failed.report().attempts[0].outcome == Outcome.FAILED  # a job that did not end well: as before


@pytest.mark.parametrize(
    "allocated, submitted", [(5.5, None), (30.0, None), (30.0, 0.0), (2.0, 40.0), (None, 30.0)]
)
def test_queue_times_after_the_books_begin_are_unknown_not_the_whole_job(allocated, submitted) -> None:
    # The scheduler's clock ahead of the node's (Slurm's SLURM_JOB_START_TIME 30 s later than the supervisor's
    # start, or an --allocated-at within the 5 min it allows for that): the wall time started at the allocation,
    # after the job's end: wall 0 s, every bucket 0, ETT 0.0%. Such a time is unknown; what is known stays.
    s = Stream()
    if submitted is not None:
        s.sup(EventKind.JOB_SUBMITTED, submitted)
    if allocated is not None:
        s.sup(EventKind.JOB_ALLOCATED, allocated)
    s.sup(EventKind.SUPERVISOR_START, 5)
    s.attempt(0, 6, 9, "completed", 0).steps(0, 1, 2, t_first=7).sup(EventKind.JOB_END, 9, exit_status=0)
    r = s.report()
    assert r.buckets_s[Bucket.EFFECTIVE_TRAINING] == pytest.approx(2)
    assert sum(r.buckets_s.values()) == pytest.approx(r.wall_s)
    if (
        submitted == 0.0
    ):  # the submission stands; the allocation is unknown: the wait until the start is other
        assert_buckets(r, {Bucket.OTHER: 5, Bucket.INIT: 1, Bucket.EFFECTIVE_TRAINING: 2, Bucket.SHUTDOWN: 1})
    elif allocated == 2.0:  # a submission after the allocation: the allocation stands, the queue wait unknown
        assert_buckets(
            r, {Bucket.HARDWARE_SETUP: 3, Bucket.INIT: 1, Bucket.EFFECTIVE_TRAINING: 2, Bucket.SHUTDOWN: 1}
        )
    else:
        assert_buckets(r, {Bucket.INIT: 1, Bucket.EFFECTIVE_TRAINING: 2, Bucket.SHUTDOWN: 1})
        assert r.tts_s == pytest.approx(1)  # from the supervisor start (the allocation unknown)
