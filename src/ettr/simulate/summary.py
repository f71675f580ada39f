"""Many seeded runs of the model, summarised: means and 95% intervals of the report's own numbers."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ettr.constants import SECONDS_PER_DAY
from ettr.events import Bucket
from ettr.simulate.batch import simulate_batch
from ettr.simulate.model import RunResult, ScriptedFault, simulate_run, simulate_seeded
from ettr.simulate.params import JobParams
from ettr.simulate.streams import EventStream

Z95 = 1.959963984540054


@dataclass(frozen=True, kw_only=True)
class Summary:
    """The simulated job: means over runs, the 95% confidence interval of each mean (normal
    approximation; for ETT% a bound when too few runs saw an interruption, `ett_ci_method`), and the
    2.5-97.5 percentile band of ETT% across runs."""

    num_runs: int
    interval_s: float
    ett_pct: float
    ett_pct_ci95: tuple[float, float]
    ett_pct_p95_band: tuple[float, float]
    buckets_pct: dict[str, float]
    buckets_s: dict[str, float]
    wall_s: float
    wall_s_ci95: tuple[float, float]
    num_failures_mean: float
    num_preemptions_mean: float
    tts_s_mean: float | None
    mean_ttr_s: float | None
    gpus: int
    interrupted_runs: int = 0
    """Runs that saw at least one failure or preemption."""
    ett_ci_method: str = "normal"
    """How `ett_pct_ci95` was found: `normal` (the mean's normal approximation) or `bound` (too few runs saw
    an interruption for that: `interrupted_runs` < `MIN_INTERRUPTED_RUNS`; `_rare_interruption_ci`)."""

    def to_dict(self) -> dict[str, Any]:
        """The contract's `ettr simulate --json` keys first, then the rest."""
        return {
            "ett_pct": self.ett_pct,
            "ett_pct_ci95": list(self.ett_pct_ci95),
            "interval_s": self.interval_s,
            "buckets_pct": self.buckets_pct,
            "num_failures_mean": self.num_failures_mean,
            "ett_pct_p95_band": list(self.ett_pct_p95_band),
            "buckets_s": self.buckets_s,
            "wall_s": self.wall_s,
            "wall_s_ci95": list(self.wall_s_ci95),
            "num_preemptions_mean": self.num_preemptions_mean,
            "tts_s_mean": self.tts_s_mean,
            "mean_ttr_s": self.mean_ttr_s,
            "gpus": self.gpus,
            "num_runs": self.num_runs,
            "interrupted_runs": self.interrupted_runs,
            "ett_pct_ci95_method": self.ett_ci_method,
        }


def _mean_ci(values: np.ndarray) -> tuple[float, tuple[float, float]]:
    mean = float(values.mean())
    if len(values) < 2:
        return mean, (mean, mean)
    half = Z95 * float(values.std(ddof=1)) / math.sqrt(len(values))
    return mean, (mean - half, mean + half)


MIN_INTERRUPTED_RUNS = 10
"""Fewer runs than this that saw an interruption, and the normal interval of the mean ETT is no 95% interval:
the runs are one value (no interruption) but for a rare few, so their spread says little about how often
the rare ones come (at Llama 3's rate, 8 GPUs for a day, 200 runs: 43% of seeds saw no failure at all and
printed a zero-width interval, and the intervals held the true mean for 53% of seeds)."""


def _wilson(successes: int, n: int) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion `successes / n` (n >= 1)."""
    p = successes / n
    z2 = Z95 * Z95
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def no_interruption_chance(params: JobParams, wall_s: float) -> float:
    """The chance that a run of `params` sees no failure and no preemption in `wall_s` seconds from submission
    (each node's lifetime fresh at submission, as the streams draw them; exposure over the whole wall, so
    never more than the model's own chance)."""
    days = wall_s / SECONDS_PER_DAY
    hazard = params.preemptions_per_day * days
    if params.failures_per_node_day > 0:
        if params.weibull_shape == 1.0:
            hazard += params.failures_per_day * days
        else:
            k = params.weibull_shape
            scale_days = 1.0 / params.failures_per_node_day / math.gamma(1.0 + 1.0 / k)
            hazard += params.num_nodes * (days / scale_days) ** k
    return math.exp(-hazard)


def _rare_interruption_ci(
    ett: np.ndarray, interrupted: np.ndarray, clean_chance: float | None = None
) -> tuple[float, float]:
    """A 95% interval of the mean ETT% when fewer than `MIN_INTERRUPTED_RUNS` runs saw an interruption.

    The mean is `q * c + (1 - q) * m`: `q` the chance that a run sees no interruption (`clean_chance` when
    the model gives it, else the low end of the Wilson interval of the runs that saw none), `c` the ETT% of
    such a run (they are all alike), `m` the mean ETT% of an interrupted run, which so few runs do not
    estimate: it is only known to lie in 0..100. The interval is the range of the mean over those (a lower
    `q` widens it both ways)."""
    clean = ett[~interrupted]
    q = clean_chance if clean_chance is not None else _wilson(len(clean), len(ett))[0]
    c_lo, c_hi = float(clean.min()), float(clean.max())
    return q * c_lo, q * c_hi + (1 - q) * 100.0


BATCH_MIN_RUNS = 64
"""From this many runs `simulate` advances them together (`ettr.simulate.batch`, one round of array operations
per interruption); fewer runs go through the scalar loop one by one, which is cheaper for them. Both give the
same runs."""


def summarize(params: JobParams, results: Sequence[RunResult]) -> Summary:
    """Means and intervals of `results` (runs of `params`)."""
    ttrs = [x for r in results for x in r.ttr_s]
    return _summary(
        params,
        buckets=np.array([r.buckets_s for r in results], dtype=float),
        walls=np.array([r.wall_s for r in results], dtype=float),
        num_failures=np.array([r.num_failures for r in results], dtype=float),
        num_preemptions=np.array([r.num_preemptions for r in results], dtype=float),
        tts=np.array([np.nan if r.tts_s is None else r.tts_s for r in results], dtype=float),
        ttr_sum_s=math.fsum(ttrs),
        ttr_count=len(ttrs),
    )


def _summary(
    params: JobParams,
    *,
    buckets: np.ndarray,
    walls: np.ndarray,
    num_failures: np.ndarray,
    num_preemptions: np.ndarray,
    tts: np.ndarray,
    ttr_sum_s: float,
    ttr_count: int,
) -> Summary:
    safe_walls = np.where(walls > 0, walls, 1.0)
    shares = 100.0 * buckets / safe_walls[:, None]
    ett = shares[:, list(Bucket).index(Bucket.EFFECTIVE_TRAINING)]
    ett_mean, ett_ci = _mean_ci(ett)
    interrupted = (num_failures + num_preemptions) > 0
    num_interrupted = int(interrupted.sum())
    ci_method = "normal"
    if len(ett) >= 2 and num_interrupted < min(MIN_INTERRUPTED_RUNS, len(ett)):
        chance = no_interruption_chance(params, float(walls[~interrupted].max()))
        ett_ci = _rare_interruption_ci(ett, interrupted, chance)
        ci_method = "bound"
    # A share lies in [0, 100]: the normal interval of a mean of runs that nearly all score the same
    # (a rare failure) reached past it ("99.75-100.01").
    ett_ci = (max(0.0, ett_ci[0]), min(100.0, ett_ci[1]))
    wall_mean, wall_ci = _mean_ci(walls)
    started = tts[~np.isnan(tts)]
    return Summary(
        num_runs=len(walls),
        interval_s=params.interval_s,
        ett_pct=ett_mean,
        ett_pct_ci95=ett_ci,
        ett_pct_p95_band=(float(np.percentile(ett, 2.5)), float(np.percentile(ett, 97.5))),
        buckets_pct={b.value: float(shares[:, i].mean()) for i, b in enumerate(Bucket)},
        buckets_s={b.value: float(buckets[:, i].mean()) for i, b in enumerate(Bucket)},
        wall_s=wall_mean,
        wall_s_ci95=wall_ci,
        num_failures_mean=float(num_failures.mean()),
        num_preemptions_mean=float(num_preemptions.mean()),
        tts_s_mean=float(started.mean()) if len(started) else None,
        mean_ttr_s=ttr_sum_s / ttr_count if ttr_count else None,
        gpus=params.gpus,
        interrupted_runs=num_interrupted,
        ett_ci_method=ci_method,
    )


def simulate(params: JobParams, *, runs: int, seed: int) -> Summary:
    """`runs` seeded runs of the job (run i of seed s is the same whatever `runs` is)."""
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    if runs < BATCH_MIN_RUNS:
        return summarize(params, [simulate_seeded(params, seed=seed, run_index=i) for i in range(runs)])
    batch = simulate_batch(params, seed=seed, runs=runs)
    return _summary(
        params,
        buckets=batch.buckets_s,
        walls=batch.wall_s,
        num_failures=batch.num_failures.astype(float),
        num_preemptions=batch.num_preemptions.astype(float),
        tts=batch.tts_s,
        ttr_sum_s=float(batch.ttr_sum_s.sum()),
        ttr_count=int(batch.ttr_count.sum()),
    )


def replay(params: JobParams, script: tuple[ScriptedFault, ...]) -> Summary:
    """The job once, with exactly the interruptions of `script` (deterministic: the interval is a point)."""
    none = EventStream(None, 0.0)
    return summarize(params, [simulate_run(params, none, none, script)])
