"""Regression detection per job family: each job's TTS, mean TTR, ETT%, median step time and start-up/overhead
buckets against the family's own history, robust to noise.

Method (docs/fleet.md says why this and not a change-point library): jobs of a family in order of start;
for each candidate first-changed job k (with at least `min_baseline` jobs before it), the baseline is the
median of the jobs before k and the noise is their median absolute deviation (MAD, x1.4826 and a small-sample
factor ~ one standard deviation for normal noise: `noise_sigma`). Job k and the median of jobs k..newest must both be worse than the baseline by

* at least `z_threshold` x (1 + 1/m) robust standard deviations, m the number of jobs k..newest (beyond the
  family's own noise; a lone newest job is weaker evidence and must clear twice the threshold),
* at least `min_rel_change` of the baseline, and
* at least `min_abs_s` seconds (`min_abs_pct` points for ETT%; for the step time, `min_rel_step_change` of
  the baseline and no floor in seconds: a step takes milliseconds, and its median over a job is steady),

and at least half of jobs k..newest must be. The earliest such k is the first changed job. Jobs without a
JOB_END (running, or their supervisor was lost) are left out: their figures are not final. A lone spike
followed by normal jobs is not a regression (the median after it is normal); a change that was fixed
since is not reported either (the jobs after the fix pull the median back). Pure: no I/O, no clock.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ettr.events import Bucket
from ettr.fleet.model import JobSummary, job_label
from ettr.report.steptime import SPEED_TOLERANCE

MAD_TO_SIGMA = 1.4826
"""MAD x this estimates the standard deviation of normally distributed noise (of many samples)."""

_SMALL_SAMPLE = {2: 1.196, 3: 1.495, 4: 1.363, 5: 1.206, 6: 1.200, 7: 1.140, 8: 1.129, 9: 1.107}
"""Croux & Rousseeuw (1992)'s finite-sample factors b_n for the MAD (b_n = n / (n - 0.8) beyond 9): of 3
normal samples, 1.4826 x MAD averages 0.68 standard deviations (simulated in a field trial: 0.68 for 3,
0.73 for 4), so 4 such "deviations" were fewer than 3 true ones and identical jobs on a loaded node were
reported (shutdown 4.49 -> 6.94 s)."""


def noise_sigma(values: Sequence[float], center: float) -> float:
    """The standard deviation of normal noise estimated from `values` around `center`: 1.4826 x their MAD,
    corrected for a small number of values."""
    n = len(values)
    factor = _SMALL_SAMPLE.get(n, n / (n - 0.8) if n > 9 else 1.0)
    return factor * MAD_TO_SIGMA * statistics.median(abs(v - center) for v in values)


# Buckets that move only because a failure happened: failures are counted and classified, and what each
# recovery costs is checked as mean_ttr_s; effective training grows with the job's length, not a regression.
_NOT_CHECKED = frozenset({Bucket.EFFECTIVE_TRAINING, Bucket.WASTED_PROGRESS, Bucket.RESTART})
CHECKED_BUCKETS = tuple(b for b in Bucket if b not in _NOT_CHECKED)


@dataclass(frozen=True, slots=True, kw_only=True)
class RegressionConfig:
    """How big and how sure a change must be to be reported."""

    min_baseline: int = 3
    """Jobs of the family before the first changed one, at least."""
    z_threshold: float = 4.0
    """Robust z-score (change / (1.4826 x MAD of the baseline)) a change must reach."""
    min_rel_change: float = 0.25
    """Smallest change relative to the baseline (0.25 = 25%) for seconds metrics."""
    min_abs_s: float = 1.0
    """Smallest change in seconds for seconds metrics (timing jitter of short phases stays below it)."""
    min_abs_pct: float = 10.0
    """Smallest drop of ETT%, in percentage points. Large, because ETT% of short jobs swings with start-up
    jitter that no single bucket shows; a real cause usually shows as a bucket, TTS or TTR regression too."""
    min_rel_step_change: float = SPEED_TOLERANCE
    """Smallest slow-down of the median step time relative to the baseline (0.10: 10% slower; the step speed
    warning's tolerance). A slower step shows as *more* effective training, a higher ETT%: only this metric
    catches it."""

    def __post_init__(self) -> None:
        if self.min_baseline < 2:
            raise ValueError(f"min_baseline must be >= 2 (a MAD needs jobs), got {self.min_baseline}")
        for name in ("z_threshold", "min_rel_change", "min_abs_s", "min_abs_pct", "min_rel_step_change"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Regression:
    """A sustained change for the worse of one metric in one family."""

    family: str
    metric: str
    """`tts_s`, `mean_ttr_s`, `ett_pct`, `step_time_s` (the median time per kept step) or a bucket name (its
    seconds)."""
    job_id: str
    """The first job where it changed."""
    first_job_start_ts: float
    baseline: float
    """Median of the jobs before `job_id`."""
    value: float
    """Median of `job_id` and the jobs after it."""
    first_value: float
    """The value of `job_id` itself."""
    robust_z: float | None
    """(value - baseline) / (1.4826 x MAD), signed so that worse is positive; None when the MAD is 0."""
    num_baseline_jobs: int
    num_changed_jobs: int
    """Jobs from `job_id` to the newest."""
    name: str = ""
    """The first job's name (`JobSummary.name`)."""

    @property
    def label(self) -> str:
        return job_label(self.job_id, self.name)

    @property
    def change(self) -> float:
        return self.value - self.baseline


@dataclass(frozen=True, slots=True)
class _Metric:
    name: str
    value: Callable[[JobSummary], float | None]
    worse_when_higher: bool
    percent: bool
    step: bool = False
    """The median step time: a relative change only (`min_rel_step_change`)."""


def _bucket_metric(bucket: Bucket) -> _Metric:
    return _Metric(bucket.value, lambda j: j.buckets_s[bucket], True, False)


METRICS: tuple[_Metric, ...] = (
    _Metric("tts_s", lambda j: j.tts_s, True, False),
    _Metric("mean_ttr_s", lambda j: j.mean_ttr_s, True, False),
    _Metric("ett_pct", lambda j: j.ett_pct if j.ett_known else None, False, True),
    # A job whose steps got slower shows more effective training for the same work: a higher ETT%, never
    # a drop. The step time itself is the metric that shows it.
    _Metric("step_time_s", lambda j: j.step_time_s if j.step_time_s else None, True, False, step=True),
    *(_bucket_metric(b) for b in CHECKED_BUCKETS),
)


def _worse_by(
    config: RegressionConfig, metric: _Metric, baseline: float, sigma: float, value: float, num_after: int
) -> bool:
    if not _big_enough(config, metric, baseline, value):
        return False
    delta = (value - baseline) if metric.worse_when_higher else (baseline - value)
    # Fewer changed jobs are weaker evidence: a lone newest job must clear twice the z threshold.
    return delta >= config.z_threshold * (1 + 1 / num_after) * sigma


def _big_enough(config: RegressionConfig, metric: _Metric, baseline: float, value: float) -> bool:
    """The change is worse and large enough to matter, whatever the noise."""
    delta = (value - baseline) if metric.worse_when_higher else (baseline - value)
    if delta <= 0:
        return False
    if metric.percent:
        return delta >= config.min_abs_pct
    if metric.step:
        return delta >= config.min_rel_step_change * abs(baseline)
    return delta >= config.min_abs_s and delta >= config.min_rel_change * abs(baseline)


def _median_of_sorted(ordered: Sequence[float]) -> float:
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _series_regression(
    family: str, metric: _Metric, series: Sequence[tuple[JobSummary, float]], config: RegressionConfig
) -> Regression | None:
    values = [v for _, v in series]
    base = sorted(values[: config.min_baseline])
    for k in range(config.min_baseline, len(values)):
        if k > config.min_baseline:
            bisect.insort(base, values[k - 1])
        baseline = _median_of_sorted(base)
        if not _big_enough(config, metric, baseline, values[k]):
            continue  # most jobs: no need for the MAD
        sigma = noise_sigma(base, baseline)
        tail = values[k:]
        n = len(tail)
        if not _worse_by(config, metric, baseline, sigma, values[k], n):
            continue
        value = statistics.median(tail)
        if not _worse_by(config, metric, baseline, sigma, value, n):
            continue
        if 2 * sum(_worse_by(config, metric, baseline, sigma, v, n) for v in tail) < n:
            continue
        sign = 1.0 if metric.worse_when_higher else -1.0
        return Regression(
            family=family,
            metric=metric.name,
            job_id=series[k][0].job_id,
            first_job_start_ts=series[k][0].wall_start_ts,
            baseline=baseline,
            value=value,
            first_value=values[k],
            robust_z=sign * (value - baseline) / sigma if sigma > 0 else None,
            num_baseline_jobs=k,
            num_changed_jobs=n,
            name=series[k][0].name,
        )
    return None


def find_regressions(jobs: Sequence[JobSummary], config: RegressionConfig | None = None) -> list[Regression]:
    """Every metric of every family that changed for the worse (see the module docstring), by family and
    then by how large the change is relative to the baseline."""
    config = config or RegressionConfig()
    families: dict[str, list[JobSummary]] = {}
    for j in sorted(jobs, key=lambda j: (j.wall_start_ts, j.job_id)):
        if not j.in_progress:  # a running job's figures are not final; a lost one's books are not whole
            families.setdefault(j.family, []).append(j)
    found: list[Regression] = []
    for family in sorted(families):
        for metric in METRICS:
            series = [(j, v) for j in families[family] if (v := metric.value(j)) is not None]
            regression = _series_regression(family, metric, series, config)
            if regression is not None:
                found.append(regression)

    def severity(r: Regression) -> float:
        return abs(r.change) / abs(r.baseline) if r.baseline else math.inf

    return sorted(found, key=lambda r: (r.family, -severity(r), r.metric))
