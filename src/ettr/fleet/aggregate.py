"""Many jobs -> one `FleetReport`: fleet ETT%, lost GPU-hours by bucket, TTS/TTR distributions, failures by
cause, per family and per day/week, the worst jobs and the costliest buckets.

Pure: no I/O, no clock. Every share is weighted by wall time x GPUs (a 64-GPU job's idle hour costs 64
GPU-hours), so fleet ETT% = sum(effective_training_s x gpus) / sum(wall_s x gpus) x 100.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from ettr.accounting import Cause, Detail
from ettr.events import Bucket
from ettr.fleet.model import JobSummary
from ettr.fleet.regress import Regression
from ettr.fleet.stepspeed import StepSpeedOutlier, step_speed_outliers

NUM_WORST_JOBS = 10


@dataclass(frozen=True, slots=True, kw_only=True)
class Distribution:
    """Summary statistics of a set of durations in seconds (all None when the set is empty)."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    max: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        ordered = sorted(values)
        if not ordered:
            return cls(count=0, mean=None, p50=None, p90=None, max=None)
        return cls(
            count=len(ordered),
            mean=math.fsum(ordered) / len(ordered),
            p50=quantile(ordered, 0.5),
            p90=quantile(ordered, 0.9),
            max=ordered[-1],
        )


def quantile(ordered: Sequence[float], q: float) -> float:
    """The q-quantile of sorted values, linear between the closest ranks."""
    pos = (len(ordered) - 1) * q
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass(frozen=True, slots=True, kw_only=True)
class Totals:
    """A group of jobs (the fleet, a family, a day): its GPU-weighted shares and counts."""

    num_jobs: int
    gpus: int
    """Sum of the jobs' GPUs (ranks)."""
    wall_gpu_s: float
    ett_pct: float
    idleness_pct: float
    failure_pct: float
    bucket_gpu_s: Mapping[Bucket, float]
    """GPU-seconds per bucket (wall seconds x GPUs), every bucket present."""
    num_failures: int
    failures_by_cause: Mapping[Cause, int]
    tts: Distribution
    ttr: Distribution
    ttr_by_cause: Mapping[Cause, Distribution]
    ttr_by_kind: Mapping[str, Distribution] = field(default_factory=dict)
    num_ett_unknown: int = 0
    """Jobs whose ETT is unknown (no training step seen): left out of the three shares above."""
    failures_by_detail: Mapping[Detail, int] = field(default_factory=dict)
    """Failures per detail (`ettr.causes.Detail`: oom_killed, startup, ...), every detail present."""
    """Headline TTR of the recoveries of each kind (in_place, warm_restart, cold_restart, requeue) seen."""

    @property
    def ett_known(self) -> bool:
        """Whether some job's ETT is known: else the three shares are 0 of nothing (every job ended without
        a training step seen), no measurement, and renderers say unknown."""
        return self.num_jobs > self.num_ett_unknown

    def shares_pct(self) -> tuple[float, float, float] | None:
        """(ETT, idleness, failure) in %, or None when no job's ETT is known (`ett_known`)."""
        return (self.ett_pct, self.idleness_pct, self.failure_pct) if self.ett_known else None

    @property
    def lost_gpu_hours(self) -> dict[Bucket, float]:
        """GPU-hours of every bucket but effective training."""
        return {b: s / 3600.0 for b, s in self.bucket_gpu_s.items() if b is not Bucket.EFFECTIVE_TRAINING}


def totals(jobs: Sequence[JobSummary]) -> Totals:
    """The GPU-weighted totals of `jobs` (all zero for none)."""
    bucket_gpu_s = {b: math.fsum(j.buckets_s[b] * j.gpus for j in jobs) for b in Bucket}
    wall_gpu_s = math.fsum(j.gpu_s for j in jobs)
    # A job whose ETT is unknown (no training step seen) is left out of the shares: its 0 % is not a figure.
    known = [j for j in jobs if j.ett_known]
    known_gpu_s = math.fsum(j.gpu_s for j in known)

    def pct(part: Callable[[JobSummary], float]) -> float:
        return math.fsum(part(j) * j.gpu_s for j in known) / known_gpu_s if known_gpu_s > 0 else 0.0

    by_cause = dict.fromkeys(Cause, 0)
    by_detail = dict.fromkeys(Detail, 0)
    ttr_cause: dict[Cause, list[float]] = {c: [] for c in Cause}
    for j in jobs:
        for f in j.failures:
            by_cause[f.cause] += 1
            by_detail[f.detail] += 1
            if f.ttr_s is not None:
                ttr_cause[f.cause].append(f.ttr_s)
    return Totals(
        num_jobs=len(jobs),
        gpus=sum(j.gpus for j in jobs),
        wall_gpu_s=wall_gpu_s,
        ett_pct=pct(lambda j: j.ett_pct),
        idleness_pct=pct(lambda j: j.idleness_pct),
        failure_pct=pct(lambda j: j.failure_pct),
        bucket_gpu_s=bucket_gpu_s,
        num_failures=sum(j.num_failures for j in jobs),
        failures_by_cause=by_cause,
        tts=Distribution.of([j.tts_s for j in jobs if j.tts_s is not None]),
        ttr=Distribution.of([t for j in jobs for t in j.ttr_s]),
        ttr_by_cause={c: Distribution.of(v) for c, v in ttr_cause.items()},
        ttr_by_kind=_by_kind(jobs),
        failures_by_detail=by_detail,
        num_ett_unknown=len(jobs) - len(known),
    )


def _by_kind(jobs: Sequence[JobSummary]) -> dict[str, Distribution]:
    found: dict[str, list[float]] = {}
    for j in jobs:
        for kind, ttr_s in j.recoveries:
            found.setdefault(kind, []).append(ttr_s)
    return {kind: Distribution.of(values) for kind, values in sorted(found.items())}


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetReport:
    """The fleet: its totals, its groups, its worst jobs and regressions."""

    jobs: tuple[JobSummary, ...]
    """In order of start."""
    fleet: Totals
    families: Mapping[str, Totals]
    days: Mapping[str, Totals]
    """By UTC day of the job's start (`2026-12-01`)."""
    weeks: Mapping[str, Totals]
    """By ISO week of the job's start (`2026-W49`)."""
    worst_jobs: tuple[JobSummary, ...]
    """Lowest ETT% first (jobs with wall time), at most `NUM_WORST_JOBS`."""
    costliest_buckets: tuple[tuple[Bucket, float], ...]
    """Lost buckets by GPU-hours, most first (zero ones left out)."""
    regressions: tuple[Regression, ...]
    step_speed: tuple[StepSpeedOutlier, ...] = ()
    """Jobs whose median step time is more than 10% off their family's (`ettr.fleet.stepspeed`)."""


def day_of(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d")


def week_of(ts: float) -> str:
    year, week, _ = datetime.fromtimestamp(ts, UTC).isocalendar()
    return f"{year}-W{week:02d}"


def _group(jobs: Sequence[JobSummary], key: Callable[[JobSummary], str]) -> dict[str, Totals]:
    groups: dict[str, list[JobSummary]] = {}
    for j in jobs:
        groups.setdefault(key(j), []).append(j)
    return {name: totals(groups[name]) for name in sorted(groups)}


def build_fleet(jobs: Sequence[JobSummary], regressions: Sequence[Regression] = ()) -> FleetReport:
    """The fleet report of `jobs` (and the regressions found in their history)."""
    ordered = tuple(sorted(jobs, key=lambda j: (j.wall_start_ts, j.job_id)))
    fleet = totals(ordered)
    worst = sorted(
        (j for j in ordered if j.wall_s > 0 and j.ett_known), key=lambda j: (j.ett_pct, -j.gpu_s, j.job_id)
    )
    costly = sorted(fleet.lost_gpu_hours.items(), key=lambda item: -item[1])
    return FleetReport(
        jobs=ordered,
        fleet=fleet,
        families=_group(ordered, lambda j: j.family),
        days=_group(ordered, lambda j: day_of(j.wall_start_ts)),
        weeks=_group(ordered, lambda j: week_of(j.wall_start_ts)),
        worst_jobs=tuple(worst[:NUM_WORST_JOBS]),
        costliest_buckets=tuple((b, h) for b, h in costly if h > 0),
        regressions=tuple(regressions),
        step_speed=step_speed_outliers(ordered),
    )
