"""The hidden cost of async saves: how much slower training steps run while a checkpoint persists.

An async save takes the write off the training loop but not off the machine; the persist competes with
training for CPU, memory bandwidth and I/O. The buckets still count a slowed step as effective training (it
still consumes new data); this module measures the slowdown beside them, from what the ledger already has:
the reference rank's STEP times and its CHECKPOINT_PERSIST spans. Pure: no I/O, no clock.

Rules (docs/checkpointing.md, "Step slowdown while persisting"):
- A step's time is the interval between two consecutive STEP events of one attempt's reference rank.
- The first `WARMUP_STEPS` intervals of every attempt are left out (compilation, caches, allocator).
- Intervals that overlap a blocking phase (anything but the persist itself and data waits: checkpoint
  blocking and waiting, restore, compile, init, eval, ...) are left out: that time is in its bucket already.
- Persist windows are the CHECKPOINT_PERSIST spans; overlapping spans of one attempt are merged into one
  window.
- An interval is *busy* when at least half of it lies inside a persist window, *quiet* when none of it
  does; intervals partly inside (less than half) are left out of both.
- The steady step time is the median of the job's quiet intervals; the inflation of a window (and of the
  job) is the median of its busy intervals over the steady step time; the seconds a window cost are its
  busy intervals summed minus as many steady steps (it can come out slightly negative from noise; it is
  reported as measured).
- Unknown stays unknown: without quiet or busy intervals the inflation is None, never a guessed 1.0.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ettr.accounting.steptime import blocking_spans, overlaps_any, step_intervals, union
from ettr.events import Phase

WARMUP_STEPS = 3
"""Step intervals left out at the start of every attempt."""

BUSY_FRACTION = 0.5
"""An interval is busy when at least this share of it lies inside a persist window."""


class AttemptSteps(NamedTuple):
    """What the slowdown needs of one attempt: its index, its reference rank's STEP times (in order), its
    phase spans (begin, end, phase or None for an unknown name, raw name) and the STEP numbers beside
    `step_ts` (a step recorded twice in a row, by a hook and by the script, is one step; empty: all
    distinct)."""

    attempt: int
    step_ts: Sequence[float]
    phases: Sequence[tuple[float, float, Phase | None, str]]
    step_numbers: Sequence[int] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class PersistSlowdown:
    """One persist window (merged CHECKPOINT_PERSIST spans of one attempt) and the steps that ran in it."""

    attempt: int
    start_ts: float
    end_ts: float
    num_steps: int
    """Busy step intervals inside the window."""
    median_step_s: float | None
    """Median busy step time; None without busy steps."""
    inflation: float | None
    """`median_step_s` over the job's steady step time; None when either is unknown."""
    extra_s: float | None
    """Busy step time summed minus `num_steps` steady steps; None when the steady step time is unknown."""

    @property
    def duration_s(self) -> float:
        return self.end_ts - self.start_ts


@dataclass(frozen=True, slots=True, kw_only=True)
class StepSlowdown:
    """The job's step slowdown while persisting (`EttReport.slowdown`; None when it persisted nothing)."""

    steady_step_s: float | None
    """Median quiet step time (no persist running); None without quiet steps."""
    persist_step_s: float | None
    """Median busy step time over every window; None without busy steps."""
    inflation: float | None
    """`persist_step_s / steady_step_s`: 1.0 means no slowdown; None when either is unknown."""
    extra_s: float | None
    """The seconds the slowdown cost: the windows' `extra_s` summed; None when unknown."""
    num_quiet_steps: int
    num_busy_steps: int
    saves: tuple[PersistSlowdown, ...]
    """One per persist window, in time order."""

    @property
    def inflation_pct(self) -> float | None:
        """The slowdown in % (inflation 1.10 -> 10.0); None when unknown."""
        return None if self.inflation is None else (self.inflation - 1.0) * 100.0


def step_slowdown(attempts: Iterable[AttemptSteps]) -> StepSlowdown | None:
    """The job's step slowdown inside persist windows (rules in the module docstring); None when no
    attempt recorded a persist."""
    quiet: list[float] = []
    windows: list[tuple[int, float, float, list[float]]] = []
    for attempt in attempts:
        merged = _merged_windows(attempt.phases)
        busy_lists: list[list[float]] = [[] for _ in merged]
        blocking = blocking_spans(attempt.phases)
        for begin, end in _intervals(attempt.step_ts, attempt.step_numbers):
            if end <= begin or overlaps_any(blocking, begin, end):
                continue
            index, inside = _inside(merged, begin, end)
            if inside == 0.0:
                quiet.append(end - begin)
            elif inside >= BUSY_FRACTION * (end - begin):
                busy_lists[index].append(end - begin)
        windows += [(attempt.attempt, b, e, busy) for (b, e), busy in zip(merged, busy_lists, strict=True)]
    if not windows:
        return None
    windows.sort(key=lambda w: w[1])
    steady = statistics.median(quiet) if quiet else None
    saves = tuple(_save(attempt, b, e, busy, steady) for attempt, b, e, busy in windows)
    all_busy = [d for _, _, _, busy in windows for d in busy]
    persist_step = statistics.median(all_busy) if all_busy else None
    extras = [s.extra_s for s in saves if s.num_steps]
    return StepSlowdown(
        steady_step_s=steady,
        persist_step_s=persist_step,
        inflation=_ratio(persist_step, steady),
        extra_s=None if steady is None else math.fsum(e for e in extras if e is not None),
        num_quiet_steps=len(quiet),
        num_busy_steps=len(all_busy),
        saves=saves,
    )


def _save(attempt: int, begin: float, end: float, busy: list[float], steady: float | None) -> PersistSlowdown:
    median = statistics.median(busy) if busy else None
    return PersistSlowdown(
        attempt=attempt,
        start_ts=begin,
        end_ts=end,
        num_steps=len(busy),
        median_step_s=median,
        inflation=_ratio(median, steady),
        extra_s=None if steady is None else math.fsum(busy) - len(busy) * steady,
    )


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base <= 0:
        return None
    return value / base


def _intervals(step_ts: Sequence[float], step_numbers: Sequence[int]) -> list[tuple[float, float]]:
    """Consecutive STEP intervals of one attempt, without its first `WARMUP_STEPS`."""
    return [(begin, end) for _, begin, end in step_intervals(step_ts, step_numbers)][WARMUP_STEPS:]


def _merged_windows(phases: Sequence[tuple[float, float, Phase | None, str]]) -> list[tuple[float, float]]:
    return union((b, e) for b, e, phase, _ in phases if phase is Phase.CHECKPOINT_PERSIST)


def _inside(windows: list[tuple[float, float]], begin: float, end: float) -> tuple[int, float]:
    """(index of the window holding most of [begin, end), seconds of it inside any window)."""
    total, best, best_index = 0.0, 0.0, -1
    first = max(0, bisect.bisect_right(windows, (begin, math.inf)) - 1)
    for index in range(first, len(windows)):
        w_begin, w_end = windows[index]
        if w_begin >= end:
            break
        overlap = min(end, w_end) - max(begin, w_begin)
        if overlap > 0:
            total += overlap
            if overlap > best:
                best, best_index = overlap, index
    return best_index, total
