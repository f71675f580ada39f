"""The result types of the accounting: an `EttReport` of a job and one `AttemptReport` per attempt.

They are plain frozen data, rich enough for every renderer (terminal, JSON, HTML timeline) to draw from
without going back to the events. Mappings inside them are read-only views.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from ettr.accounting.causes import Cause, FailureCause
from ettr.accounting.liveness import JobState, OpenJob
from ettr.accounting.slowdown import StepSlowdown
from ettr.accounting.slowsteps import SlowSteps
from ettr.accounting.steptime import NO_STEP_TIME, StepTime
from ettr.accounting.stragglers import RankSpeed
from ettr.accounting.ttr import RecoveryParts
from ettr.accounting.window import EttWindow
from ettr.events import Bucket, Outcome


class Segment(NamedTuple):
    """One piece of the timeline: wall time [start_ts, end_ts) given to `bucket`, owned by `attempt`.

    `attempt` is the attempt index that the time belongs to (time before the first attempt belongs to the
    first attempt), or None when the job has no attempt at all.
    """

    start_ts: float
    end_ts: float
    bucket: Bucket
    attempt: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Recompile:
    """A RECOMPILE event, kept for renderers: when, where and why torch recompiled."""

    ts: float
    attempt: int
    rank: int
    reason: str
    """`data["reason"]` of the event, or "" when it gave none."""
    data: Mapping[str, Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointCommit:
    """A CHECKPOINT_COMMIT event: the checkpoint of `step` became durable and visible at `ts`."""

    ts: float
    attempt: int
    rank: int
    step: int | None
    path: str | None


def distinct_saves(commits: Iterable[CheckpointCommit]) -> list[CheckpointCommit]:
    """One commit per save: the first of each (attempt, step). Every rank may record a commit of the same save
    (accelerate's `save_state` writes one random-state file per rank), and a job may write a step twice (an
    HF Trainer's checkpoint of the last step, then its `save_model`); a commit without a step is its own."""
    seen: set[tuple[int, int]] = set()
    saves = []
    for commit in sorted(commits, key=lambda c: c.ts):
        if commit.step is not None:
            if (commit.attempt, commit.step) in seen:
                continue
            seen.add((commit.attempt, commit.step))
        saves.append(commit)
    return saves


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointFailure:
    """A CHECKPOINT_ERROR event: the save of `step` failed, with its cause (`ENOSPC (No space left on
    device): ...` for a full disk)."""

    ts: float
    attempt: int
    rank: int
    step: int | None
    path: str | None
    error: str


@dataclass(frozen=True, slots=True, kw_only=True)
class FailedSave:
    """One failed save, however many ranks recorded it: every rank of a collective save records its
    CHECKPOINT_ERROR (DCP hands each rank every rank's failure), so the events of one save are as many as its
    ranks. `first` is the lowest rank's event (its cause the one shown); `ranks` all that recorded it."""

    first: CheckpointFailure
    ranks: tuple[int, ...]

    @property
    def ranks_text(self) -> str:
        """`rank 0`, `ranks 0-7`, `ranks 0, 3`, or `12 ranks` for a long list with gaps."""
        r = self.ranks
        if len(r) == 1:
            return f"rank {r[0]}"
        if list(r) == list(range(r[0], r[-1] + 1)):
            return f"ranks {r[0]}-{r[-1]}"
        return "ranks " + ", ".join(map(str, r)) if len(r) <= 8 else f"{len(r)} ranks"


def distinct_failures(errors: Iterable[CheckpointFailure]) -> list[FailedSave]:
    """One entry per failed save: the CHECKPOINT_ERRORs of each (attempt, step), in the order of their first
    event; an error without a step is its own."""
    groups: dict[tuple[int, int], list[CheckpointFailure]] = {}
    order: list[list[CheckpointFailure]] = []
    for error in sorted(errors, key=lambda c: c.ts):
        if error.step is None:
            order.append([error])
            continue
        group = groups.get((error.attempt, error.step))
        if group is None:
            group = groups[(error.attempt, error.step)] = []
            order.append(group)
        group.append(error)
    return [
        FailedSave(first=min(g, key=lambda c: (c.rank, c.ts)), ranks=tuple(sorted({c.rank for c in g})))
        for g in order
    ]


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptReport:
    """One attempt (one launch of the training command) and its share of the job's wall time."""

    index: int
    """The attempt number of its events (0 for the first launch)."""
    start_ts: float
    """Start of the attempt on the job's timeline (ATTEMPT_START, else PROCESS_START, else its first event)."""
    end_ts: float
    """End of the attempt (ATTEMPT_END, else closed by the accounting: see `closed_by_accounting`)."""
    outcome: Outcome
    exit_code: int | None
    resumed_from_step: int | None
    """Step of its RESUMED event (the last one wins); None when it recorded none (started from scratch)."""
    last_step: int | None
    """Highest STEP of its reference rank; None when it completed no step."""
    lost_steps: int
    """Number of its STEP events whose progress was rolled back (see docs/buckets.md)."""
    buckets_s: Mapping[Bucket, float]
    """Its share of the job's wall time per bucket, every bucket present; attempts sum to the job's buckets."""
    training_start_ts: float | None
    """When its training loop began (explicit TRAINING_START or inferred); None when it completed no step."""
    num_steps: int
    """Number of STEP events of its reference rank."""
    reference_rank: int | None
    """The rank whose events drew its timeline (0, else the lowest present); None when no rank reported."""
    closed_by_accounting: bool
    """True when no ATTEMPT_END was recorded: the accounting closed the attempt (killed supervisor, live
    job, or an API-only run without a supervisor)."""
    failure: Mapping[str, Any] | None
    """For an attempt that did not complete: what its ATTEMPT_END said beyond outcome and exit code (signal,
    reason, ...) and the first FAILURE a training process reported (`process_failure`); else None."""
    phases_s: Mapping[str, float]
    """Raw phase durations of its reference rank, clipped to the attempt (phases may overlap)."""
    resumed_step_unknown: str | None = None
    """Why the step it resumed from is unknown (it loaded a checkpoint the instrumentation could not place);
    `resumed_from_step` and `last_step` are then None rather than a wrong number. None when known."""
    lost_steps_estimated: bool = False
    """True when `lost_steps` (and its wasted/effective split) is an estimate: the next attempt's resume
    step is unknown, so the latest checkpoint committed before it started stands in for it."""
    step_time: StepTime = NO_STEP_TIME
    """Time per kept step of its reference rank: median, p90 (`ettr.accounting.steptime`)."""

    @property
    def duration_s(self) -> float:
        return self.end_ts - self.start_ts

    @property
    def step_time_s(self) -> float | None:
        """Median seconds per kept step (the contract's `step_time_s`); None when none was timed."""
        return self.step_time.median_s

    @property
    def num_kept_steps(self) -> int:
        """Its steps whose progress was kept."""
        return self.num_steps - self.lost_steps

    @property
    def trained(self) -> bool:
        """Whether the attempt reached a training start (completed at least one step)."""
        return self.training_start_ts is not None


@dataclass(frozen=True, slots=True, kw_only=True)
class TtsWindow:
    """The time-to-start window: from its origin (allocation, else supervisor start, else wall start) to the
    training start of the first attempt that trained. `EttReport.tts_s` is its length."""

    origin_ts: float
    training_start_ts: float
    attempt: int
    """The attempt whose training start ends the window (0 unless attempt 0 never trained)."""

    @property
    def duration_s(self) -> float:
        return self.training_start_ts - self.origin_ts


@dataclass(frozen=True, slots=True, kw_only=True)
class Recovery:
    """One recovered failure: `failed` ended (detected) at `detected_ts`; `recovered`, the next attempt that
    trained, was training again at `training_start_ts`. `EttReport.ttr_s` holds their `ttr_s`, in order."""

    failed: AttemptReport
    recovered: AttemptReport
    detected_ts: float
    training_start_ts: float

    @property
    def ttr_s(self) -> float:
        return self.training_start_ts - self.detected_ts


@dataclass(frozen=True, slots=True, kw_only=True)
class EttReport:
    """The Effective Training Time report of one job: the contract's `ettr.report/1` and more.

    Invariants: `buckets_s` has every bucket and sums to `wall_s`; `ett_pct + idleness_pct + failure_pct`
    is 100 (all 0 when `wall_s` is 0); `segments` cover [wall_start_ts, wall_end_ts] in order without gaps.
    """

    job_id: str
    wall_start_ts: float
    """Submitted, else allocated, else supervisor start, else the earliest event."""
    wall_end_ts: float
    """JOB_END, else the `now` given to `compute`."""
    wall_s: float
    in_progress: bool
    """True when the job recorded no JOB_END (running, or its supervisor was lost: `state` says which)."""
    ett_pct: float
    idleness_pct: float
    failure_pct: float
    effective_training_s: float
    idleness_s: float
    failure_s: float
    tts_s: float | None
    """Allocation (else supervisor start, else wall start) to the training start of attempt 0 (else of the
    first attempt that trained); None when no attempt trained."""
    ttr_s: tuple[float, ...]
    """One per failure followed by an attempt that trained: failure detected to that training start (the
    `ttr_s` of `recoveries`)."""
    num_failures: int
    buckets_s: Mapping[Bucket, float]
    attempts: tuple[AttemptReport, ...]
    phases_s: Mapping[str, float]
    """Raw phase durations summed over the attempts' reference ranks (phases may overlap)."""
    segments: tuple[Segment, ...]
    """The timeline: wall time in order, adjacent pieces of the same bucket and attempt merged."""
    recompiles: tuple[Recompile, ...]
    checkpoint_commits: tuple[CheckpointCommit, ...]
    submitted_ts: float | None
    allocated_ts: float | None
    supervisor_start_ts: float | None
    job_exit_status: int | None
    """`data["exit_status"]` of JOB_END; None when absent."""
    tts_window: TtsWindow | None = None
    """Where `tts_s` starts and ends on the timeline; None when no attempt trained."""
    recoveries: tuple[Recovery, ...] = ()
    """The failures behind `ttr_s`, one each, in order: which attempt failed, when it was detected, and
    which attempt trained again when."""
    failures: tuple[FailureCause, ...] = ()
    """One per failure (`num_failures`): its cause, evidence and TTR (rules in `ettr.accounting.causes`)."""
    checkpoint_errors: tuple[CheckpointFailure, ...] = ()
    """Every failed checkpoint save, in order, with its cause."""
    slowdown: StepSlowdown | None = None
    """Step-time inflation while checkpoints persisted, per save and in total (`ettr.accounting.slowdown`);
    None when the job recorded no persist. Beside the buckets, not in them."""
    ttr_parts: tuple[RecoveryParts, ...] = ()
    """Where each recovery's time went, failure to first step (`ettr.accounting.ttr`), one per recovery."""
    tts_parts: RecoveryParts | None = None
    """Where the time to start went, its origin to the first step; None when no attempt trained."""

    @property
    def num_infra_failures(self) -> int:
        """Failures from the infrastructure (Meta's NoF)."""
        return sum(1 for f in self.failures if f.cause is Cause.INFRA)

    num_fenced_events: int = 0
    """Events of training processes recorded after their attempt had ended (orphans), not counted
    (`ettr.accounting.fence`)."""
    step_time: StepTime = NO_STEP_TIME
    """Time per kept step over every attempt's kept steps: median, p90 (`ettr.accounting.steptime`)."""
    state: JobState = JobState.ENDED
    """Ended, running, supervisor lost, or in progress (not known which) (`ettr.accounting.liveness`)."""
    open_job: OpenJob | None = None
    """For a job without an end: what it was doing when reported (None when it ended)."""
    rank_speed: RankSpeed | None = None
    """Slow ranks: ranks (or nodes) persistently later than their peers at the gradient sync, and what
    waiting for them cost (`ettr.accounting.stragglers`); `checked` False when it could not be told."""
    slow_steps: SlowSteps | None = None
    """Step time beyond the job's steady step: warm-ups after restarts, persists, waiting for slow ranks
    (`ettr.accounting.slowsteps`); beside ETT, not in the buckets."""
    window: EttWindow | None = None
    """ETT over the last hour (or the window asked for) of wall time (`ettr.accounting.window`)."""
    ett_unknown: str | None = None
    """Why ETT cannot be told, None when it can: the job ran to its end (or was preempted) without a single
    training step seen, so its 0 s of effective training is not a measurement (an inference or evaluation
    job, or a loop whose steps ettr cannot see). `ett_pct` and `idleness_pct` stay numbers here (0 and the
    rest, as the buckets give, and in `ettr.report/1`, with `ett_unknown` beside them); the text, HTML and
    TensorBoard renderers show them as unknown (`measured_ett_pct`)."""

    @property
    def measured_ett_pct(self) -> float | None:
        """`ett_pct`, or None when it is no measurement (`ett_unknown`): what a renderer shows."""
        return None if self.ett_unknown is not None else self.ett_pct

    @property
    def measured_idleness_pct(self) -> float | None:
        """`idleness_pct`, or None when ETT is unknown (the rest of the wall time is then not idleness)."""
        return None if self.ett_unknown is not None else self.idleness_pct

    @property
    def step_time_s(self) -> float | None:
        """Median seconds per kept step (the contract's `step_time_s`); None when none was timed."""
        return self.step_time.median_s

    @property
    def num_kept_steps(self) -> int:
        """Steps whose progress was kept, over every attempt."""
        return sum(a.num_kept_steps for a in self.attempts)

    @property
    def training_per_kept_step_s(self) -> float | None:
        """Effective training per kept step: the mean pace, exactly what ETT counts per step (a heavy tail of
        slow steps moves it where the median does not); None without a kept step."""
        kept = self.num_kept_steps
        return self.effective_training_s / kept if kept > 0 else None

    @property
    def mean_ttr_s(self) -> float | None:
        return sum(self.ttr_s) / len(self.ttr_s) if self.ttr_s else None

    def bucket_pct(self, bucket: Bucket) -> float:
        """Share of wall time in `bucket`, in % (0 when wall time is 0)."""
        return self.buckets_s[bucket] / self.wall_s * 100.0 if self.wall_s > 0 else 0.0
