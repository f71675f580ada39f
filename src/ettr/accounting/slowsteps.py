"""Steps slower than the job's own steady state, measured as such: a figure beside ETT, not a bucket.

A slow step still trains (its data is consumed, its progress kept), so the buckets count it as effective
training; this module says how much of that time was the steps being slower than the job's steady step,
and why, from three measurements that each have their own module or rule. Pure: no I/O, no clock.

- after a restart: each later attempt's warm-up, its leading run of kept steps slower than
  `SLOW_FACTOR` x the steady step (caches, allocator, compile of new shapes, a cold page cache), each
  counted for what it took beyond the steady step;
- slower throughout: an attempt whose settled steps (after its first `WARMUP_STEPS`) have a median above
  `SLOW_FACTOR` x the steady step, over at least `SLOW_ATTEMPT_MIN_STEPS` of them (a busier machine, a
  requeue onto slower hardware): that is no warm-up, and a warm-up that never ends was booked as one
  (run_clm.py requeued at a load of 17: "81.9 s warming up after restarts (50 steps)", every step of the
  attempt, until 2026-12-05);
- during persists: the extra step time inside checkpoint-persist windows (`ettr.accounting.slowdown`);
- waiting for slow ranks: what the job waited for stragglers at the gradient sync
  (`ettr.accounting.stragglers`).
The steady step is the persist slowdown's (the median of its quiet steps) when the job persisted, else the
median of the kept steps after each attempt's first `WARMUP_STEPS`. The parts may overlap (a straggler
during a persist), so they are given side by side, not summed.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from ettr.accounting.slowdown import WARMUP_STEPS, StepSlowdown
from ettr.accounting.stragglers import RankSpeed

SLOW_FACTOR = 1.25
"""A step is slower than the steady state when it takes more than this many steady steps."""

SLOW_ATTEMPT_MIN_STEPS = 10
"""Settled steps an attempt needs before it can be called slower throughout (fewer: a warm-up, if slow)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Warmup:
    """The slow start of one attempt after a restart."""

    attempt: int
    num_steps: int
    """Its leading kept steps slower than `SLOW_FACTOR` x steady."""
    extra_s: float
    """Their time beyond as many steady steps."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SlowAttempt:
    """An attempt slower than the steady state throughout, not only at its start."""

    attempt: int
    num_steps: int
    """Its kept step times."""
    step_s: float
    """The median of its kept steps (the attempts table's `step_s`)."""
    extra_s: float
    """Its kept steps' time beyond as many steady steps."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SlowSteps:
    """Step time beyond the job's steady step (`EttReport.slow_steps`), by cause."""

    steady_step_s: float | None
    """The steady step; None when no kept step was timed (then nothing below is known)."""
    warmups: tuple[Warmup, ...]
    """Attempts after a restart that started slow, in order (an attempt slower throughout is not here)."""
    persist_s: float | None
    """Extra step time inside checkpoint persists (`StepSlowdown.extra_s`); None without persists or when
    unknown."""
    straggler_s: float | None
    """Time waited for slow ranks (`RankSpeed.lost_s`); None when the ranks could not be compared."""
    slow_attempts: tuple[SlowAttempt, ...] = ()
    """Attempts (the first too) whose settled steps were slower than the steady step, in order."""

    @property
    def after_restart_s(self) -> float | None:
        """Extra time of the warm-ups after restarts; None when the steady step is unknown."""
        return None if self.steady_step_s is None else math.fsum(w.extra_s for w in self.warmups)


def slow_steps(
    kept_times: Sequence[tuple[int, int, Sequence[float]]],
    slowdown: StepSlowdown | None,
    rank_speed: RankSpeed | None,
) -> SlowSteps:
    """The slow steps of a job from each attempt's (index, position, kept step times in step order)."""
    steady = slowdown.steady_step_s if slowdown is not None else None
    if steady is None:
        settled = [d for _, _, times in kept_times for d in list(times)[WARMUP_STEPS:]]
        steady = statistics.median(settled) if settled else None
    warmups, slow_attempts = [], []
    if steady is not None and steady > 0:
        for index, position, times in kept_times:
            settled = list(times)[WARMUP_STEPS:]
            if len(settled) >= SLOW_ATTEMPT_MIN_STEPS and statistics.median(settled) > SLOW_FACTOR * steady:
                extra = max(0.0, math.fsum(times) - len(times) * steady)
                slow_attempts.append(
                    SlowAttempt(
                        attempt=index,
                        num_steps=len(times),
                        step_s=statistics.median(times),
                        extra_s=extra,
                    )
                )
                continue
            if position == 0:
                continue
            leading = []
            for d in times:
                if d <= SLOW_FACTOR * steady:
                    break
                leading.append(d)
            if leading:
                extra = math.fsum(leading) - len(leading) * steady
                warmups.append(Warmup(attempt=index, num_steps=len(leading), extra_s=extra))
    return SlowSteps(
        steady_step_s=steady,
        warmups=tuple(warmups),
        persist_s=None if slowdown is None else slowdown.extra_s,
        straggler_s=None if rank_speed is None else rank_speed.lost_s,
        slow_attempts=tuple(slow_attempts),
    )
