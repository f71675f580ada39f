"""The checkpoint-interval model: how often to save so that failures and save blocking waste the least.

Over one day of training with `f` failures and a save that blocks the loop for `b` seconds, saving every
`T` seconds wastes `f * T / 2` (on average half an interval of progress is lost per failure) plus
`(D / T) * b` (the blocking of every save), where `D` is the training time in that day. The minimum is at
`T* = sqrt(2 * D * b / f)` — Young's first-order optimum with mean time between failures `M = D / f` — where
both terms are equal. Pure functions; no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ettr.constants import SECONDS_PER_DAY

__all__ = ["SECONDS_PER_DAY", "IntervalModel", "curve", "optimal_interval_s"]


@dataclass(frozen=True, kw_only=True)
class IntervalModel:
    """Expected waste of a checkpoint interval."""

    blocking_s: float
    """Seconds the training loop is blocked by one save."""
    failures_per_day: float
    """Failures (interruptions that roll back to the last checkpoint) per day of wall time."""
    train_hours: float = 24.0
    """Hours of training in that day (the job's share of the day that saves are taken in)."""

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

    def wasted_s(self, interval_s: float) -> float:
        """Expected seconds wasted per day when saving every `interval_s` seconds."""
        if interval_s <= 0:
            raise ValueError(f"interval must be > 0 s, got {interval_s}")
        return self.failures_per_day * interval_s / 2.0 + (self.train_s / interval_s) * self.blocking_s

    def wasted_pct(self, interval_s: float) -> float:
        """Expected waste as a share of the day's training time, in %."""
        return 100.0 * self.wasted_s(interval_s) / self.train_s

    @property
    def optimal_interval_s(self) -> float:
        """The interval that minimises `wasted_s` (Young's optimum, sqrt(2 * b * M))."""
        return math.sqrt(2.0 * self.train_s * self.blocking_s / self.failures_per_day)

    @property
    def daly_interval_s(self) -> float:
        """Daly's higher-order optimum (for b < 2M), which corrects Young's for the saves' own cost."""
        b, m = self.blocking_s, self.mtbf_s
        if b >= 2 * m:
            return m
        x = math.sqrt(b / (2 * m))
        return math.sqrt(2 * b * m) * (1 + x / 3 + x * x / 9) - b


def optimal_interval_s(blocking_s: float, failures_per_day: float, train_hours: float = 24.0) -> float:
    """The checkpoint interval (seconds) that minimises expected waste; see `IntervalModel`."""
    return IntervalModel(
        blocking_s=blocking_s, failures_per_day=failures_per_day, train_hours=train_hours
    ).optimal_interval_s


def curve(
    model: IntervalModel, factors: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0)
) -> list[tuple[float, float]]:
    """(interval_s, wasted_pct) at multiples of the optimum, for showing how flat the minimum is."""
    best = model.optimal_interval_s
    return [(best * f, model.wasted_pct(best * f)) for f in factors]
