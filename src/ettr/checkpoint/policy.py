"""When to save: a fixed interval in steps or seconds, or `auto`, the interval that wastes the least.

`auto` uses the one interval model, `ettr.interval.optimal_interval_s` (what `ettr interval` and the
simulator use too; about sqrt(2 * D * b / f) when saves are cheap) with `b` the measured cost of a save to the
training loop (blocking plus any wait for the previous save, plus the extra step time its background persist
caused, `observe_slowdown`) and `f` the
failure rate: the user's prior, updated with the failures this job's ledger has seen so far. The interval
is recomputed after every save and as the job's wall time grows, and is never shorter than the time a
persist takes (a save that has to wait for the previous one would block the loop). Pure apart from the
clock, which is a parameter.
"""

from __future__ import annotations

import logging
import math
import re
import statistics
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ettr.constants import SECONDS_PER_DAY
from ettr.events import Event, EventKind, Outcome
from ettr.interval import optimal_interval_s

logger = logging.getLogger("ettr")


_DURATION_UNITS_S = {"s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True, kw_only=True)
class IntervalConfig:
    """When `CheckpointManager.after_step` saves. Exactly one of `every_steps`, `every_s`, `auto`."""

    every_steps: int | None = None
    """Save after every N-th optimizer step (step % N == 0)."""
    every_s: float | None = None
    """Save at the first step boundary at least this many seconds after the previous save (or start)."""
    auto: bool = False
    """Choose the interval that minimises expected waste from measured save costs and the failure rate."""
    failures_per_day: float = 1.0
    """Auto: the prior failure rate of jobs like this one (failures per day of wall time)."""
    prior_days: float = 1.0
    """Auto: how many days of observation the prior is worth; the job's own failures outweigh it after
    about this long."""
    train_hours: float = 24.0
    """Auto: hours per day the job trains (the model's D)."""
    window: int = 5
    """Auto: how many recent saves the cost estimates (medians) are taken over."""

    def __post_init__(self) -> None:
        chosen = sum([self.every_steps is not None, self.every_s is not None, bool(self.auto)])
        if chosen != 1:
            raise ValueError("set exactly one of every_steps, every_s and auto for the checkpoint interval")
        if self.every_steps is not None and self.every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {self.every_steps}")
        if self.every_s is not None and not (self.every_s >= 0 and math.isfinite(self.every_s)):
            raise ValueError(f"every_s must be a finite number of seconds >= 0, got {self.every_s}")
        if not (self.failures_per_day > 0 and math.isfinite(self.failures_per_day)):
            raise ValueError(f"failures_per_day must be > 0, got {self.failures_per_day}")
        if not (self.prior_days > 0 and math.isfinite(self.prior_days)):
            raise ValueError(f"prior_days must be > 0, got {self.prior_days}")
        if not (0 < self.train_hours <= 24):
            raise ValueError(f"train_hours must be in (0, 24], got {self.train_hours}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")

    @classmethod
    def parse(cls, text: str, **auto_options: float) -> IntervalConfig:
        """`"auto"`, `"500"` or `"500steps"` (steps), `"90s"`, `"15m"`, `"2h"` (seconds).

        `auto_options` (failures_per_day, prior_days, train_hours) apply to `auto`. Raises ValueError.
        """
        spec = text.strip().lower()
        if spec == "auto":
            return cls(auto=True, **auto_options)  # type: ignore[arg-type]
        match = re.fullmatch(r"(\d+)\s*(steps?)?", spec)
        if match:
            return cls(every_steps=int(match.group(1)))
        match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smh])", spec)
        if match:
            return cls(every_s=float(match.group(1)) * _DURATION_UNITS_S[match.group(2)])
        raise ValueError(
            f"checkpoint interval {text!r}: use 'auto', a step count like '500', or a time like '90s'"
        )


def count_failures(events: Iterable[Event]) -> tuple[int, float | None]:
    """(failed attempts, first event time) from a job's ledger: ATTEMPT_END whose outcome is not completed."""
    num_failures = 0
    first_ts: float | None = None
    for event in events:
        if first_ts is None or event.ts < first_ts:
            first_ts = event.ts
        if event.kind is EventKind.ATTEMPT_END:
            outcome = (event.data or {}).get("outcome")
            if outcome != Outcome.COMPLETED:
                num_failures += 1
    return num_failures, first_ts


def failure_rate_per_day(
    *, prior_per_day: float, prior_days: float, num_failures: int, observed_s: float
) -> float:
    """Posterior mean failure rate (Gamma prior worth `prior_days` of observation, Poisson failures)."""
    observed_days = max(0.0, observed_s) / SECONDS_PER_DAY
    return (prior_per_day * prior_days + num_failures) / (prior_days + observed_days)


class IntervalPolicy:
    """Decides at each step boundary whether to save, and learns the cost of saves as they happen.

    Args:
        config: the interval.
        now_s: the current time (the policy's clock origin; seconds, any monotonic origin).
        num_failures: failed attempts of this job before this one (from the ledger; auto only).
        job_age_s: how long this job has existed at `now_s` (first ledger event to now; auto only).
    """

    def __init__(
        self, config: IntervalConfig, *, now_s: float, num_failures: int = 0, job_age_s: float = 0.0
    ):
        self.config = config
        self._last_save_s = now_s
        self._num_failures = num_failures
        self._job_start_s = now_s - max(0.0, job_age_s)
        self._costs_s: deque[float] = deque(maxlen=config.window)
        self._persists_s: deque[float] = deque(maxlen=config.window)
        self._slowdowns_s: deque[float] = deque(maxlen=config.window)

    def reset(self, now_s: float) -> None:
        """Start the interval afresh (after a restore or a save made outside the policy)."""
        self._last_save_s = now_s

    def observe_save(self, *, cost_s: float, now_s: float) -> None:
        """A save was started at a step boundary; it cost the loop `cost_s` (blocking plus waiting)."""
        self._costs_s.append(max(0.0, cost_s))
        self._last_save_s = now_s

    def add_cost(self, extra_s: float) -> None:
        """Add time the loop later spent waiting for the last save (its overlapped copy) to that save's cost."""
        if self._costs_s:
            self._costs_s[-1] += max(0.0, extra_s)

    def observe_persist(self, persist_s: float) -> None:
        """A background persist finished after `persist_s` seconds (committed or not)."""
        self._persists_s.append(max(0.0, persist_s))

    def observe_slowdown(self, extra_s: float) -> None:
        """A persist slowed the steps beside it by `extra_s` seconds in all (part of that save's cost)."""
        self._slowdowns_s.append(max(0.0, extra_s))

    def failures_per_day(self, now_s: float) -> float:
        """The failure rate the auto interval uses now."""
        return failure_rate_per_day(
            prior_per_day=self.config.failures_per_day,
            prior_days=self.config.prior_days,
            num_failures=self._num_failures,
            observed_s=now_s - self._job_start_s,
        )

    def failures_per_train_day(self, now_s: float) -> float:
        """`failures_per_day` per day of training (`train_hours` of it a day): what Young/Daly takes."""
        return self.failures_per_day(now_s) * 24.0 / self.config.train_hours

    def interval_s(self, now_s: float) -> float | None:
        """The time interval in force now (None for a step interval; 0 until auto has measured a save)."""
        cfg = self.config
        if cfg.every_steps is not None:
            return None
        if cfg.every_s is not None:
            return cfg.every_s
        if not self._costs_s:
            return 0.0  # save at the first boundary: the only way to learn what a save costs here
        # A save that costs nothing measurable still has some cost; keep the model's domain (> 0).
        cost_s = max(statistics.median(self._costs_s), 1e-6)
        per_train_day = self.failures_per_train_day(now_s)
        slowdown_s = statistics.median(self._slowdowns_s) if self._slowdowns_s else 0.0
        best_s = optimal_interval_s(
            save_cost_s=cost_s, failures_per_day=per_train_day, slowdown_s_per_save=slowdown_s
        )
        floor_s = statistics.median(self._persists_s) if self._persists_s else 0.0
        return max(best_s, floor_s)

    def should_save(self, step: int, now_s: float) -> bool:
        """Whether to save the state after optimizer step `step` at time `now_s`."""
        cfg = self.config
        if cfg.every_steps is not None:
            return step % cfg.every_steps == 0
        interval_s = self.interval_s(now_s)
        return interval_s is not None and now_s - self._last_save_s >= interval_s


def parse_memory_interval(value: float | str | None) -> float | str | None:
    """`CheckpointConfig.memory_interval` checked: None, "auto", or seconds > 0 (a number or "2s").
    Raises ValueError."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return "auto"
        try:
            value = float(text[:-1] if text.endswith("s") else text)
        except ValueError:
            raise ValueError(f"memory_interval {value!r}: use None, 'auto' or seconds like '2s'") from None
    if isinstance(value, bool) or not isinstance(value, int | float) or not (0 < value < float("inf")):
        raise ValueError(f"memory_interval must be None, 'auto' or seconds > 0, got {value!r}")
    return float(value)


class MemoryIntervalPolicy:
    """When the memory tier saves: every `spec` seconds, or `auto`: Young/Daly, sqrt(2 x cost x MTBF), with
    the memory save's own measured cost (median of the last `window`) and the failure rate the storage
    policy uses (`failures_per_day(now_s)`, per day of training). Pure apart from the clock, a parameter."""

    def __init__(
        self,
        spec: float | str,
        *,
        now_s: float,
        failures_per_day: Callable[[float], float],
        window: int = 5,
    ) -> None:
        self.spec = spec
        self._failures_per_day = failures_per_day
        self._last_s = now_s
        self._costs_s: deque[float] = deque(maxlen=window)

    def reset(self, now_s: float) -> None:
        """Start the interval afresh (a restore, a storage save)."""
        self._last_s = now_s

    def observe(self, *, cost_s: float, now_s: float) -> None:
        """A memory save at `now_s` cost the loop `cost_s`."""
        self._costs_s.append(max(0.0, cost_s))
        self._last_s = now_s

    def interval_s(self, now_s: float) -> float:
        if not isinstance(self.spec, str):
            return self.spec
        if not self._costs_s:
            return 0.0  # the first save measures what one costs here
        cost_s = max(statistics.median(self._costs_s), 1e-6)
        return optimal_interval_s(save_cost_s=cost_s, failures_per_day=self._failures_per_day(now_s))

    def should_save(self, now_s: float) -> bool:
        return now_s - self._last_s >= self.interval_s(now_s)
