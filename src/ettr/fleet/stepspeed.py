"""Jobs of a family whose steps ran at a different speed than the family's: their ETT% is not comparable.

ETT% is a share of time, so a job whose steps got slower shows more effective training for the same work.
The fleet compares each job's median time per kept step with the median of its family's jobs and lists those
more than `SPEED_TOLERANCE` (10%) off. Pure: no I/O, no clock.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from ettr.accounting.steptime import relative_change
from ettr.fleet.model import JobSummary, job_label
from ettr.report.steptime import SPEED_TOLERANCE


@dataclass(frozen=True, slots=True, kw_only=True)
class StepSpeedOutlier:
    """A job whose median step time differs from its family's median by more than the tolerance."""

    job_id: str
    family: str
    step_time_s: float
    family_step_time_s: float
    """The median of the family's jobs' median step times (this job included)."""
    num_family_jobs: int
    """Jobs of the family with a known step time."""
    name: str = ""
    """The job's name (`JobSummary.name`)."""

    @property
    def label(self) -> str:
        return job_label(self.job_id, self.name)

    @property
    def change(self) -> float:
        """`step_time_s / family_step_time_s - 1` (0.62: 62% slower than the family)."""
        return self.step_time_s / self.family_step_time_s - 1.0


def step_speed_outliers(jobs: Sequence[JobSummary]) -> tuple[StepSpeedOutlier, ...]:
    """Jobs more than `SPEED_TOLERANCE` off their family's median step time, in the order given. A family
    needs two jobs with a known step time to be compared."""
    by_family: dict[str, list[float]] = {}
    for j in jobs:
        if j.step_time_s is not None and j.step_time_s > 0:
            by_family.setdefault(j.family, []).append(j.step_time_s)
    medians = {family: statistics.median(v) for family, v in by_family.items() if len(v) >= 2}
    out = []
    for j in jobs:
        family = medians.get(j.family)
        change = relative_change(family, j.step_time_s)
        if family is None or j.step_time_s is None or change is None or abs(change) <= SPEED_TOLERANCE:
            continue
        out.append(
            StepSpeedOutlier(
                job_id=j.job_id,
                family=j.family,
                step_time_s=j.step_time_s,
                family_step_time_s=family,
                num_family_jobs=len(by_family[j.family]),
                name=j.name,
            )
        )
    return tuple(out)
