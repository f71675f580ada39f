"""The checkpoint-interval model: how often to save so that failures and saves waste the least.

One model behind `ettr interval`, the checkpoint manager's `auto` interval (`ettr.checkpoint.policy`) and the
simulator's optimum (`ettr.simulate`): `optimal_interval_s` is the one function they call.

Failures come at a constant rate `lam` (exponential times between them, as the simulator draws them) at any
moment, during saves and restarts too, and each one rolls the job back to its newest save. Saving every `T`
seconds of training, one checkpoint cycle is `x = T + b` seconds of the loop's time (`b`: what a save costs
the loop: its blocking, any wait for the previous save, and the extra step time its background persist
causes). A cycle that a failure sends back to its start takes, on average (renewal theory; Daly 2006's
"exact" model), `E(x) = (exp(lam * x) - 1) * (1 / lam + R)` of wall time, `R` the mean recovery. The share of
time wasted is `1 - T / E(T + b)`; `R` multiplies every `T` alike, so it moves the waste but not the optimum,
which minimises `(exp(lam * (T + b)) - 1) / T`. Young's `sqrt(2 b M)` (M = 1 / lam) is this model's first
order in `b / M`; Daly's higher-order formula is its next orders. Pure functions; no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ettr.constants import SECONDS_PER_DAY

__all__ = [
    "SECONDS_PER_DAY",
    "IntervalModel",
    "curve",
    "daly_interval_s",
    "optimal_interval_s",
    "recovery_s",
    "wasted_fraction",
    "young_interval_s",
]


def recovery_s(rate_per_s: float, *, detection_s: float = 0.0, relaunch_s: float = 0.0) -> float:
    """Mean wall seconds of one recovery: detection `d` (no new failure counted), then the relaunch and
    start-up `R'`, which a failure sends back to its start: `d + (exp(lam R') - 1) (1 / lam + d)`."""
    if rate_per_s <= 0:
        return detection_s + relaunch_s
    return detection_s + math.expm1(rate_per_s * relaunch_s) * (1.0 / rate_per_s + detection_s)


def cycle_wall_s(rate_per_s: float, work_s: float, recovery: float) -> float:
    """Mean wall seconds to get through `work_s` seconds that a failure sends back to their start."""
    return work_s if rate_per_s <= 0 else math.expm1(rate_per_s * work_s) * (1.0 / rate_per_s + recovery)


def wasted_fraction(
    *,
    interval_s: float,
    save_cost_s: float,
    failures_per_day: float,
    restart_s: float = 0.0,
    detection_s: float = 0.0,
) -> float:
    """Share of a long job's time not kept as progress, saving every `interval_s` seconds of training.

    `failures_per_day` is per day of the time the job runs; `restart_s` the whole cost of one restart
    (detection, relaunch and start-up to the first step); a failure during it starts the part after the
    detection (`detection_s` of it) again."""
    rate = failures_per_day / SECONDS_PER_DAY
    recovery = recovery_s(rate, detection_s=detection_s, relaunch_s=max(0.0, restart_s - detection_s))
    return 1.0 - interval_s / cycle_wall_s(rate, interval_s + save_cost_s, recovery)


def young_interval_s(*, save_cost_s: float, mtbf_s: float) -> float:
    """Young (1974): `sqrt(2 b M)`, the first-order optimum."""
    return math.sqrt(2.0 * save_cost_s * mtbf_s)


def daly_interval_s(*, save_cost_s: float, mtbf_s: float) -> float:
    """Daly (2006), higher order: `sqrt(2 b M) (1 + sqrt(b / 2M) / 3 + (b / 2M) / 9) - b` for `b < 2M`, else M."""
    b, m = save_cost_s, mtbf_s
    if b >= 2 * m:
        return m
    x = math.sqrt(b / (2 * m))
    return math.sqrt(2 * b * m) * (1 + x / 3 + x * x / 9) - b


def optimal_interval_s(
    *,
    save_cost_s: float,
    failures_per_day: float,
    restart_s: float = 0.0,
    min_interval_s: float = 0.0,
    slowdown_s_per_save: float = 0.0,
) -> float:
    """The checkpoint interval (seconds of training between saves) that wastes the least in the model.

    Args:
        save_cost_s: what one save costs the training loop (blocking plus any wait for the previous save).
        failures_per_day: the job's interruption rate, per day of the time it runs.
        restart_s: the whole cost of one restart. It scales the waste of every interval alike, so it does
            not move the optimum; accepted so that callers pass the whole model.
        min_interval_s: a floor (the time an async persist takes: a save that waits for the previous one
            blocks the loop).
        slowdown_s_per_save: training time a save's background persist costs by slowing the steps beside it
            (`EttReport.slowdown`'s extra seconds per save), part of the save's cost like its blocking.

    Raises ValueError for a save cost or failure rate that is not a finite number > 0, or a pair out of
    range (a rate so small its mean gap overflows; a save hundreds of times the mean time between failures).
    """
    if not (save_cost_s > 0 and math.isfinite(save_cost_s)):
        raise ValueError(f"save cost must be a finite number of seconds > 0, got {save_cost_s}")
    if not (failures_per_day > 0 and math.isfinite(failures_per_day)):
        raise ValueError(f"failures per day must be > 0, got {failures_per_day}")
    if not (slowdown_s_per_save >= 0 and math.isfinite(slowdown_s_per_save)):
        raise ValueError(
            f"slowdown per save must be a finite number of seconds >= 0, got {slowdown_s_per_save}"
        )
    save_cost_s += slowdown_s_per_save
    lam = failures_per_day / SECONDS_PER_DAY

    def cost(log_t: float) -> float:
        t = math.exp(log_t)
        try:
            return math.expm1(lam * (t + save_cost_s)) / t  # the recovery factor is common to every t
        except OverflowError:  # a cycle hundreds of failure times long: never the optimum
            return math.inf

    # Golden-section search on log(t); the cost is unimodal in t. Bracket: Young's optimum / 100 .. x 100.
    young = math.sqrt(2.0 * save_cost_s / lam) if lam > 0 else math.inf
    if not (0 < young < math.inf):
        raise ValueError(
            f"no checkpoint interval can be computed for a {save_cost_s:g} s save at {failures_per_day:g} "
            "failures per day (numbers out of range)"
        )
    lo, hi = math.log(young / 100.0), math.log(young * 100.0)
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = cost(a), cost(b)
    for _ in range(200):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = cost(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = cost(b)
        if hi - lo < 1e-10:
            break
    del restart_s  # documented above: a common factor of the cost
    if not math.isfinite(min(fa, fb)):
        raise ValueError(
            f"a {save_cost_s:g} s save at {failures_per_day:g} failures per day: every interval is hundreds "
            "of times the mean time between failures, so no interval makes progress"
        )
    return max(math.exp((lo + hi) / 2.0), min_interval_s)


@dataclass(frozen=True, kw_only=True)
class IntervalModel:
    """`ettr interval`'s question: the best interval and the waste around it, for a job that trains
    `train_hours` a day with `failures_per_day` failures and a save that costs the loop `blocking_s`."""

    blocking_s: float
    """Seconds one save costs the training loop: its blocking, any wait for the previous save, and the extra
    step time its background persist causes."""
    failures_per_day: float
    """Failures (interruptions that roll back to the last checkpoint) per day."""
    train_hours: float = 24.0
    """Hours of training in that day: the failures fall in them (the model's time runs only while training)."""

    def __post_init__(self) -> None:
        if not (self.blocking_s > 0 and math.isfinite(self.blocking_s)):
            raise ValueError(f"blocking must be a finite number of seconds > 0, got {self.blocking_s}")
        if not (self.failures_per_day > 0 and math.isfinite(self.failures_per_day)):
            raise ValueError(f"failures per day must be > 0, got {self.failures_per_day}")
        if not (0 < self.train_hours <= 24):
            raise ValueError(f"train hours must be in (0, 24], got {self.train_hours}")

    @property
    def train_s(self) -> float:
        return self.train_hours * 3600.0

    @property
    def mtbf_s(self) -> float:
        """Mean training time between failures."""
        return self.train_s / self.failures_per_day

    @property
    def failures_per_train_day(self) -> float:
        """The failure rate per day of training time (what the model's clock counts)."""
        return self.failures_per_day * SECONDS_PER_DAY / self.train_s

    @property
    def optimal_interval_s(self) -> float:
        """The interval that wastes the least (`optimal_interval_s`, the one model)."""
        return optimal_interval_s(save_cost_s=self.blocking_s, failures_per_day=self.failures_per_train_day)

    @property
    def young_interval_s(self) -> float:
        return young_interval_s(save_cost_s=self.blocking_s, mtbf_s=self.mtbf_s)

    @property
    def daly_interval_s(self) -> float:
        return daly_interval_s(save_cost_s=self.blocking_s, mtbf_s=self.mtbf_s)

    def wasted_pct(self, interval_s: float) -> float:
        """Expected share of the training time wasted (work lost to failures and save cost), in %; restarts
        are not counted (their cost is not given: it adds to every interval alike)."""
        if interval_s <= 0:
            raise ValueError(f"interval must be > 0 s, got {interval_s}")
        return 100.0 * wasted_fraction(
            interval_s=interval_s, save_cost_s=self.blocking_s, failures_per_day=self.failures_per_train_day
        )

    def wasted_s(self, interval_s: float) -> float:
        """Expected seconds wasted per day of `train_hours` when saving every `interval_s` seconds."""
        return self.wasted_pct(interval_s) / 100.0 * self.train_s


def curve(
    model: IntervalModel, factors: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0)
) -> list[tuple[float, float]]:
    """(interval_s, wasted_pct) at multiples of the optimum, for showing how flat the minimum is."""
    best = model.optimal_interval_s
    return [(best * f, model.wasted_pct(best * f)) for f in factors]
