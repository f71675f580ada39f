"""A job's profile, measured from its ledger: the costs the simulator needs, and its own interruptions.

`profile_from_events(events, report)` is pure (the report is `ettr.accounting.compute` of the events);
`load_profile(run_dir)` reads a run directory the way `ettr report` does. What it measures:
step time (training region less blocking and evaluation, per step), evaluation per second of training,
each start-up bucket of the first and of later
attempts, blocking and persist per save, the interval (steps between commits), the failure and preemption
rates, the relaunch gap, detection (last step to attempt end) and shutdown; and, for replay, where each
attempt was interrupted.
"""

from __future__ import annotations

import math
import os
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ettr.accounting import AttemptReport, EttReport, counts_as_failure
from ettr.constants import SECONDS_PER_DAY
from ettr.events import Bucket, Event, EventKind, Outcome, Phase
from ettr.simulate.model import ScriptedFault
from ettr.simulate.params import DEFAULT_GPUS_PER_NODE, MAX_GPUS, JobParams, Startup

RATE_MIN_WALL_S = SECONDS_PER_DAY
"""A run shorter than this measures no failure or preemption rate worth extrapolating: a few minutes with one
crash would mean thousands of failures a day. `ettr simulate --from` assumes its default rates then."""


@dataclass(frozen=True, kw_only=True)
class Profile:
    """What a run directory says about its job, as simulator parameters plus its own interruptions."""

    params: JobParams
    script: tuple[ScriptedFault, ...]
    measured_ett_pct: float
    measured_buckets_pct: dict[str, float]
    measured_wall_s: float
    num_steps: int
    interval_steps: int | None
    notes: tuple[str, ...]
    """What could not be measured and what was assumed instead."""
    num_failed: int = 0
    """Attempts that failed (not preempted): what the failure rate was measured from."""
    num_preempted: int = 0
    """Attempts preempted: what the preemption rate was measured from."""
    lost_step_s: float | None = None
    """Seconds a lost step took in the run (the interrupted attempts' steps after their newest commit, less
    blocking and evaluation phases, per step); None: no step was lost. A replay trains every step at
    `params.step_s`, the job's mean: where load or warm-up made the lost steps faster or slower than that,
    the replay's `wasted_progress` differs from the measured by the difference (`speed_note`)."""
    num_lost_steps: int = 0

    def speed_note(self, *, tolerance: float = 0.10, share: float = 0.01) -> str | None:
        """One line where the run's lost steps ran at another speed than the job's mean (by more than
        `tolerance`) and that moves the replay's wasted_progress by at least `share` of the wall time: what a
        replay at one speed cannot reproduce; None otherwise (a nanoGPT run's 20 lost steps at 27 ms against
        20 ms: 0.1 s of 173 s, no reason for a replay's difference)."""
        mean_s, lost_s = self.params.step_s, self.lost_step_s
        if lost_s is None or mean_s <= 0 or abs(lost_s / mean_s - 1.0) <= tolerance:
            return None
        gap_s = self.num_lost_steps * (mean_s - lost_s)
        if abs(gap_s) < share * self.measured_wall_s:
            return None
        return (
            f"the replay trains every step at the job's mean {mean_s * 1e3:.1f} ms; its {self.num_lost_steps} "
            f"lost steps ran at {lost_s * 1e3:.1f} ms a step (the machine's load, warm-up after restarts), so "
            f"the replay books {abs(gap_s):.1f} s {'more' if gap_s > 0 else 'less'} wasted_progress for them "
            "than the run did"
        )

    @property
    def failure_rate_measured(self) -> bool:
        """Whether the run measured a failure rate to extrapolate: a day or more of wall time with failures."""
        return self.measured_wall_s >= RATE_MIN_WALL_S and self.num_failed > 0

    @property
    def preemption_rate_measured(self) -> bool:
        """Whether the run's preemptions (if any) are a rate: a day or more of wall time."""
        return self.measured_wall_s >= RATE_MIN_WALL_S

    def to_dict(self) -> dict[str, Any]:
        p = self.params
        return {
            "step_s": p.step_s,
            "eval_s_per_train_s": p.eval_s_per_train_s,
            "gpus": p.gpus,
            "gpus_per_node": p.gpus_per_node,
            "interval_s": p.interval_s,
            "interval_steps": self.interval_steps,
            "blocking_s": p.blocking_s,
            "persist_s": p.persist_s,
            "failures_per_node_day": p.failures_per_node_day,
            "preemptions_per_day": p.preemptions_per_day,
            "first_startup_s": _startup_dict(p.first_startup),
            "restart_startup_s": _startup_dict(p.restart_startup),
            "restart_gap_s": p.restart_gap_s,
            "detection_s": p.detection_s,
            "shutdown_s": p.shutdown_s,
            "num_steps": self.num_steps,
            "wall_s": self.measured_wall_s,
            "num_failed": self.num_failed,
            "num_preempted": self.num_preempted,
            "notes": list(self.notes),
        }


def _startup_dict(s: Startup) -> dict[str, float]:
    return {"init": s.init_s, "compile": s.compile_s, "restore": s.restore_s, "data_wait": s.data_wait_s}


def _mean_startup(attempts: Sequence[AttemptReport]) -> Startup | None:
    if not attempts:
        return None

    def mean(bucket: Bucket) -> float:
        return statistics.fmean(a.buckets_s[bucket] for a in attempts)

    return Startup(
        init_s=mean(Bucket.INIT),
        compile_s=mean(Bucket.COMPILE),
        restore_s=mean(Bucket.RESTORE),
        data_wait_s=mean(Bucket.DATA_WAIT),
    )


def _per_attempt_rank_events(events: Sequence[Event], report: EttReport) -> dict[int, list[Event]]:
    ref = {a.index: a.reference_rank for a in report.attempts}
    out: dict[int, list[Event]] = defaultdict(list)
    for e in events:
        if e.rank >= 0 and ref.get(e.attempt) == e.rank:
            out[e.attempt].append(e)
    return out


def _phase_spans(events: Sequence[Event], phase: Phase, start_ts: float, end_ts: float) -> list[float]:
    """Durations of the `phase` spans of one rank's events (PHASE_END carries its begin ts as `value`),
    clipped to its attempt [start_ts, end_ts]: a damaged begin (-1e300) made a save block for 1e300 s and
    the whole simulation 0% ETT."""
    spans = []
    for e in events:
        if e.kind is EventKind.PHASE_END and e.phase is phase and e.value is not None:
            if not (math.isfinite(e.value) and math.isfinite(e.ts)):
                continue
            spans.append(max(0.0, min(e.ts, end_ts) - max(e.value, start_ts)))
    return spans


def _step_time(
    trained: Sequence[AttemptReport], by_attempt: dict[int, list[Event]]
) -> tuple[float, dict[int, float]]:
    """Seconds per step (each attempt's training region less its blocking and eval phases, per global
    step of progress) and each attempt's last STEP time."""
    train_s = 0.0
    num_steps = 0
    last_step_ts: dict[int, float] = {}
    for a in trained:
        steps = [e.ts for e in by_attempt[a.index] if e.kind is EventKind.STEP]
        if not steps or a.training_start_ts is None:
            continue
        last_step_ts[a.index] = max(steps)
        region = max(steps) - a.training_start_ts
        train_s += max(0.0, region - _blocked_in(by_attempt[a.index], a.training_start_ts, max(steps)))
        # Progress in global steps (the step counter), not the number of markers.
        num_steps += max(1, (a.last_step or 0) - (a.resumed_from_step or 0))
    return (train_s / num_steps if num_steps and train_s > 0 else 1e-3), last_step_ts


def _save_costs(trained: Sequence[AttemptReport], by_attempt: dict[int, list[Event]]) -> tuple[float, float]:
    """(blocking plus waiting per save, persist per save) of the reference ranks."""
    blocking: list[float] = []
    persists: list[float] = []
    waits = 0.0
    for a in trained:
        rank_events = by_attempt[a.index]
        window = (a.start_ts, a.end_ts)
        blocking += _phase_spans(rank_events, Phase.CHECKPOINT_BLOCKING, *window)
        persists += _phase_spans(rank_events, Phase.CHECKPOINT_PERSIST, *window)
        waits += sum(_phase_spans(rank_events, Phase.CHECKPOINT_WAIT, *window))
    blocking_s = (sum(blocking) + waits) / len(blocking) if blocking else 0.0
    return blocking_s, (statistics.fmean(persists) if persists else 0.0)


def _teardowns(report: EttReport) -> dict[int, float]:
    """Each failed attempt followed by another: its teardown, from the failure instant to its end, which
    the report books as `restart` (docs/buckets.md): the `restart` time booked to the attempt less the
    relaunch gap before it (booked to it too)."""
    out: dict[int, float] = {}
    attempts = report.attempts
    for i, a in enumerate(attempts):
        if i + 1 == len(attempts) or not counts_as_failure(a.outcome) or a.outcome is Outcome.PREEMPTED:
            continue
        gap_before = 0.0 if i == 0 else max(0.0, a.start_ts - attempts[i - 1].end_ts)
        out[a.index] = max(0.0, a.buckets_s[Bucket.RESTART] - gap_before)
    return out


def _script(
    report: EttReport, last_step_ts: dict[int, float], step_s: float, teardowns: dict[int, float]
) -> tuple[list[ScriptedFault], list[float]]:
    """The job's interruptions as a replay script, and the detection tail of each failure (last step to the
    failure; its teardown goes with the relaunch gap, `restart`, as the report books it)."""
    script: list[ScriptedFault] = []
    tails: list[float] = []
    for a in report.attempts:
        # A completed attempt is no interruption, and neither is one that has not ended (a job still running,
        # or its supervisor lost): the report counts no failure for it, and its steps so far are kept.
        if not counts_as_failure(a.outcome):
            continue
        preempted = a.outcome is Outcome.PREEMPTED
        if a.index not in last_step_ts:
            after_s = a.duration_s - min(teardowns.get(a.index, 0.0), a.duration_s)
            script.append(ScriptedFault(preemption=preempted, in_startup=True, after_s=after_s))
            continue
        tail = max(0.0, a.end_ts - last_step_ts[a.index])
        tail -= min(teardowns.get(a.index, 0.0), tail)
        done_steps = (a.last_step or 0) - (a.resumed_from_step or 0)
        saved = preempted and any(
            c.attempt == a.index and c.step == a.last_step for c in report.checkpoint_commits
        )
        if not preempted:
            tails.append(tail)
        # What the attempt's own newest commit held: a fixed interval's phase in the model would differ
        # from the measured saves (an `auto` interval's above all) by up to an interval of lost work.
        kept_steps = max(0, _newest_commit(report, a) - (a.resumed_from_step or 0))
        script.append(
            ScriptedFault(
                preemption=preempted,
                in_startup=False,
                after_s=max(0, done_steps) * step_s,
                tail_s=tail,
                saved_on_exit=saved,
                kept_s=min(kept_steps, max(0, done_steps)) * step_s,
            )
        )
    if script and counts_as_failure(report.attempts[-1].outcome):
        script[-1] = replace(script[-1], ends_job=True)
    return script, tails


def _newest_commit(report: EttReport, a: AttemptReport) -> int:
    """The step the attempt's own newest commit held by its last step (its resume step without one)."""
    committed = [
        c.step
        for c in report.checkpoint_commits
        if c.attempt == a.index and c.step is not None and c.step <= (a.last_step or 0)
    ]
    return max(committed, default=a.resumed_from_step or 0)


def _lost_steps(report: EttReport, by_attempt: dict[int, list[Event]]) -> tuple[float, int]:
    """(seconds, steps) of the interrupted attempts' steps after their newest commit, as the reference rank
    ran them: the span of their STEP events less blocking and evaluation phases in it."""
    seconds, steps = 0.0, 0
    for a in report.attempts:
        if not counts_as_failure(a.outcome) or a.last_step is None:
            continue
        kept = _newest_commit(report, a)
        rank_events = by_attempt.get(a.index, [])
        marks = sorted((e.ts, e.step) for e in rank_events if e.kind is EventKind.STEP and e.step is not None)
        start = next((ts for ts, step in reversed(marks) if step <= kept), None)
        lost = [(ts, step) for ts, step in marks if step > kept]
        if start is None and a.training_start_ts is not None and kept == (a.resumed_from_step or 0):
            start = a.training_start_ts  # nothing kept: lost from the training start
        if start is None or not lost:
            continue
        end = lost[-1][0]
        spent = end - start - _blocked_in(rank_events, start, end)
        if spent > 0 and math.isfinite(spent):
            seconds += spent
            steps += a.last_step - kept
    return seconds, steps


def _gaps(report: EttReport, teardowns: dict[int, float]) -> tuple[list[float], list[float]]:
    """End of an attempt to the start of the next: after failures (with the failed attempt's teardown), and
    after preemptions (requeues)."""
    after_failure: list[float] = []
    after_preemption: list[float] = []
    for prev, nxt in zip(report.attempts, report.attempts[1:], strict=False):
        gap = max(0.0, nxt.start_ts - prev.end_ts)
        if prev.outcome is Outcome.PREEMPTED:
            after_preemption.append(gap)
        else:
            after_failure.append(gap + teardowns.get(prev.index, 0.0))
    return after_failure, after_preemption


def profile_from_events(events: Sequence[Event], report: EttReport) -> Profile:
    """The profile of one job. Raises ValueError when the job never trained (nothing to measure)."""
    notes: list[str] = []
    by_attempt = _per_attempt_rank_events(events, report)
    trained = [a for a in report.attempts if a.trained]
    if not trained:
        raise ValueError("the job never completed a step: there is no step time to measure")
    step_s, last_step_ts = _step_time(trained, by_attempt)
    blocking_s, persist_s = _save_costs(trained, by_attempt)
    final_step = max((a.last_step or 0) for a in report.attempts)
    interval_steps, interval_global = _interval_steps(report, final_step)
    if interval_steps is None:
        notes.append("no checkpoint was committed during training: the interval is the whole job")
    first_startup = _mean_startup([report.attempts[0]]) or Startup()
    restart_startup = _mean_startup([a for a in report.attempts[1:] if a.trained])
    if restart_startup is None:
        restart_startup = first_startup
        notes.append("no later attempt trained: restarts assumed to start up like the first attempt")
    teardowns = _teardowns(report)
    gaps_fail, gaps_preempt = _gaps(report, teardowns)
    script, tails = _script(report, last_step_ts, step_s, teardowns)
    lost_s, num_lost = _lost_steps(report, by_attempt)
    wall_days = report.wall_s / SECONDS_PER_DAY if report.wall_s > 0 else 0.0
    num_preempted = sum(1 for a in report.attempts if a.outcome is Outcome.PREEMPTED)
    num_failed = report.num_failures - num_preempted
    gpus = _world_size(events)
    # A node of the usual 8 GPUs, not the profiled host: a 1-process test run is no 1-GPU node.
    num_nodes = -(-gpus // DEFAULT_GPUS_PER_NODE)
    params = JobParams(
        gpus=gpus,
        gpus_per_node=DEFAULT_GPUS_PER_NODE,
        failures_per_node_day=num_failed / wall_days / num_nodes if wall_days else 0.0,
        preemptions_per_day=num_preempted / wall_days if wall_days else 0.0,
        handles_preemption=any(f.saved_on_exit for f in script if f.preemption) or not num_preempted,
        step_s=step_s,
        eval_s_per_train_s=_eval_ratio(report),
        interval_s=(interval_steps or final_step or 1) * step_s,
        interval_global=interval_global,
        blocking_s=blocking_s,
        persist_s=persist_s,
        # The first submission's (a requeued run's wait is in the preemption's gap, preempt_requeue_s).
        scheduling_s=report.attempts[0].buckets_s[Bucket.SCHEDULING],
        hardware_setup_s=report.attempts[0].buckets_s[Bucket.HARDWARE_SETUP],
        first_startup=first_startup,
        restart_startup=restart_startup,
        restart_gap_s=statistics.fmean(gaps_fail) if gaps_fail else 0.0,
        preempt_requeue_s=statistics.fmean(gaps_preempt) if gaps_preempt else None,
        detection_s=statistics.fmean(tails) if tails else 0.0,
        shutdown_s=report.buckets_s[Bucket.SHUTDOWN],
        duration_s=None,
        work_s=max(final_step, 1) * step_s,
    )
    notes += _caveats(report)
    return Profile(
        params=params,
        script=tuple(script),
        measured_ett_pct=report.ett_pct,
        measured_buckets_pct={b.value: report.bucket_pct(b) for b in Bucket},
        measured_wall_s=report.wall_s,
        num_steps=final_step,
        interval_steps=interval_steps,
        notes=tuple(notes),
        num_failed=num_failed,
        num_preempted=num_preempted,
        lost_step_s=lost_s / num_lost if num_lost and lost_s > 0 else None,
        num_lost_steps=num_lost,
    )


def _caveats(report: EttReport) -> list[str]:
    notes = []
    if report.buckets_s[Bucket.OTHER] > 0:
        notes.append(f"{report.buckets_s[Bucket.OTHER]:.1f} s of 'other' is not modelled")
    if report.in_progress:
        notes.append("the job is still running (or its supervisor was killed): profiled so far")
    return notes


def _eval_ratio(report: EttReport) -> float:
    """Evaluation seconds per second of training, both of kept work (the evaluation a resume repeats before
    its first step counts too: it comes with the training)."""
    effective = report.buckets_s[Bucket.EFFECTIVE_TRAINING]
    return report.buckets_s[Bucket.EVALUATION] / effective if effective > 0 else 0.0


def _interval_steps(report: EttReport, final_step: int) -> tuple[int | None, bool]:
    """(steps between saves, whether saves fall on multiples of it). Commits of the job's final step (the
    save at the end) and of a preempted attempt's last step (save-then-exit) are not the interval's."""
    exits = {(a.index, a.last_step) for a in report.attempts if a.outcome is Outcome.PREEMPTED}
    steps = sorted(
        {
            c.step
            for c in report.checkpoint_commits
            if c.step is not None and c.step > 0 and c.step != final_step and (c.attempt, c.step) not in exits
        }
    )
    if not steps:
        return None, False
    gcd = math.gcd(*steps)
    diffs = [b - a for a, b in zip(steps, steps[1:], strict=False)]
    if not diffs or gcd * 2 > statistics.median(diffs):
        return gcd, True  # every save on a multiple of one step interval (`step % N == 0`)
    return int(statistics.median(diffs)), False


def _blocked_in(rank_events: Sequence[Event], start_ts: float, end_ts: float) -> float:
    """Seconds of checkpoint blocking/waiting and eval/other phases inside [start_ts, end_ts]."""
    total = 0.0
    for e in rank_events:
        if e.kind is EventKind.PHASE_END and e.value is not None and e.phase in _NOT_STEPS:
            total += max(0.0, min(e.ts, end_ts) - max(e.value, start_ts))
    return total


_NOT_STEPS = frozenset(
    {Phase.CHECKPOINT_BLOCKING, Phase.CHECKPOINT_WAIT, Phase.EVAL, Phase.OTHER, Phase.PUBLISH}
)


def _world_size(events: Sequence[Event]) -> int:
    sizes = [
        int(e.data["world_size"])
        for e in events
        if e.kind is EventKind.PROCESS_START
        and e.data
        and isinstance(e.data.get("world_size"), int)
        and 1 <= e.data["world_size"] <= MAX_GPUS  # a damaged row's 10**26 is no job's size
    ]
    ranks = {e.rank for e in events if e.rank >= 0}
    return max(sizes + [len(ranks), 1])


def load_profile(run_dir: str | os.PathLike[str]) -> Profile:
    """The profile of a run directory (raises `UsageError` for a directory `ettr report` cannot read)."""
    from ettr.report.load import load

    events, report = load(run_dir)
    return profile_from_events(events, report)


def with_duration(params: JobParams, duration_s: float) -> JobParams:
    """The job run for a wall-time window instead of its own number of steps."""
    return replace(params, duration_s=duration_s, work_s=None)
