"""What preempting each running job now would cost, for schedulers: cheapest victims first.

cost_gpu_s = (unsaved_s + recovery_s) x gpus, where

* unsaved_s: training time since the job's last checkpoint commit (or since its current attempt began
  training, when it committed nothing since): the work a preemption throws away;
* recovery_s: its measured recovery time: its own mean TTR, else its family's median TTR, else its own
  TTS (a restart repeats the start-up), else its family's median TTS; unknown (0, and `recovery_source`
  "unknown": the cost is then a lower bound) when nothing was measured.

A job that has just committed has almost nothing unsaved, so among alike jobs it comes first. Pure.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from ettr.fleet.model import JobSummary, job_label


@dataclass(frozen=True, slots=True, kw_only=True)
class PreemptCost:
    """The price of preempting one running job now."""

    job_id: str
    family: str
    gpus: int
    unsaved_s: float
    last_commit_ts: float | None
    recovery_s: float | None
    """None when unknown (then counted as 0 in `cost_gpu_s`)."""
    recovery_source: str
    """mean_ttr | family_ttr | tts | family_tts | unknown."""
    cost_gpu_s: float
    name: str = ""
    """The job's name (`JobSummary.name`)."""

    @property
    def label(self) -> str:
        return job_label(self.job_id, self.name)

    @property
    def since_commit_s(self) -> float:
        return self.unsaved_s


def _unsaved_s(job: JobSummary, now: float) -> float:
    if job.progress_start_ts is None:
        return 0.0  # not training yet: nothing to lose but the start-up, which recovery_s counts
    since = max(job.progress_start_ts, job.last_commit_ts if job.last_commit_ts is not None else -math.inf)
    return max(0.0, now - since)


def _family_medians(jobs: Sequence[JobSummary]) -> tuple[dict[str, float], dict[str, float]]:
    ttrs: dict[str, list[float]] = {}
    ttss: dict[str, list[float]] = {}
    for j in jobs:
        ttrs.setdefault(j.family, []).extend(j.ttr_s)
        if j.tts_s is not None:
            ttss.setdefault(j.family, []).append(j.tts_s)
    return (
        {f: statistics.median(v) for f, v in ttrs.items() if v},
        {f: statistics.median(v) for f, v in ttss.items() if v},
    )


def preemption_costs(jobs: Sequence[JobSummary], now: float) -> list[PreemptCost]:
    """The running jobs among `jobs`, cheapest to preempt first (ties: less unsaved work, then job id).
    `jobs` may include finished ones: their recoveries inform the family medians."""
    family_ttr, family_tts = _family_medians(jobs)
    out = []
    for j in jobs:
        if not j.running:
            continue
        candidates = (
            (j.mean_ttr_s, "mean_ttr"),
            (family_ttr.get(j.family), "family_ttr"),
            (j.tts_s, "tts"),
            (family_tts.get(j.family), "family_tts"),
        )
        recovery, source = next(((v, s) for v, s in candidates if v is not None), (None, "unknown"))
        unsaved = _unsaved_s(j, now)
        out.append(
            PreemptCost(
                job_id=j.job_id,
                family=j.family,
                gpus=j.gpus,
                unsaved_s=unsaved,
                last_commit_ts=j.last_commit_ts,
                recovery_s=recovery,
                recovery_source=source,
                cost_gpu_s=(unsaved + (recovery or 0.0)) * j.gpus,
                name=j.name,
            )
        )
    return sorted(out, key=lambda c: (c.cost_gpu_s, c.unsaved_s, c.job_id))


def choose_victims(costs: Sequence[PreemptCost], need_gpus: int) -> tuple[list[PreemptCost], bool]:
    """The cheapest jobs (in `costs`' order) that together free at least `need_gpus`, and whether they do."""
    victims: list[PreemptCost] = []
    freed = 0
    for c in costs:
        if freed >= need_gpus:
            break
        victims.append(c)
        freed += c.gpus
    return victims, freed >= need_gpus
