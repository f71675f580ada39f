"""Step speed: how long each kept training step took, per attempt and for the job (median and p90).

ETT is a share of time, so a job whose steps got slower shows *more* effective training; the time per
step, beside ETT, is what tells two jobs (or two attempts) doing the same work apart. Pure: no I/O, no clock.

Rules (docs/buckets.md, "Step time"):
- A step's time is the interval between two consecutive STEP events of one attempt's reference rank (a step
  recorded twice in a row, by a hook and by the script, is one step). The first step of an attempt has no
  interval (training start -> first step is its start-up's last part, `first_step` in the TTR parts).
- Only kept steps count (a step the next attempt resumed past, or that the job finished with): the interval
  of step k counts when step k is kept.
- Intervals that overlap a blocking phase (anything but a background checkpoint persist and data waits:
  checkpoint blocking and waiting, restore, compile, evaluation, ...) are left out: that time is in its
  own bucket, not in the step. Where that leaves an attempt none (a script that evaluates after every step,
  pytorch/examples' gat), each kept interval counts less the blocking time inside it: the step's own time.
- `median_s` is the median of the counted intervals; `p90_s` the 90th percentile by the nearest-rank rule
  (the smallest interval with at least 90% of them at or below it). Without an interval both are None.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ettr.events import Phase

NOT_BLOCKING = frozenset({Phase.CHECKPOINT_PERSIST, Phase.DATA_WAIT, Phase.GET_FIRST_BATCH_DATA})
"""Phases that run beside (or inside) training steps: an interval overlapping one of them still counts."""

Span = tuple[float, float, Phase | None, str]


@dataclass(frozen=True, slots=True, kw_only=True)
class StepTime:
    """The time per kept step of an attempt or of the job."""

    median_s: float | None
    """Median seconds per kept step; None when no kept step could be timed."""
    p90_s: float | None
    """90th percentile (nearest rank); None when no kept step could be timed."""
    num_steps: int
    """Kept steps timed (intervals counted)."""


NO_STEP_TIME = StepTime(median_s=None, p90_s=None, num_steps=0)


def step_intervals(step_ts: Sequence[float], step_numbers: Sequence[int]) -> list[tuple[int, float, float]]:
    """(step, begin, end) for each STEP after the first of one attempt: begin is the previous STEP's time.

    A STEP with the same number as the one before it (recorded twice, by a hook and by the script) is
    dropped. Without step numbers (`step_numbers` empty or of another length) every STEP counts, numbered 0.
    """
    if len(step_numbers) == len(step_ts):
        keep = [i for i in range(len(step_ts)) if i == 0 or step_numbers[i] != step_numbers[i - 1]]
        times = [step_ts[i] for i in keep]
        numbers = [step_numbers[i] for i in keep]
    else:
        times, numbers = list(step_ts), [0] * len(step_ts)
    return [(numbers[i], times[i - 1], times[i]) for i in range(1, len(times))]


def blocking_spans(phases: Iterable[Span]) -> list[tuple[float, float]]:
    """The disjoint, ordered spans of an attempt's blocking phases (everything but `NOT_BLOCKING`)."""
    return union((b, e) for b, e, phase, _ in phases if phase not in NOT_BLOCKING)


def union(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint spans in order covering the non-empty ones given (overlapping ones merged)."""
    merged: list[tuple[float, float]] = []
    for begin, end in sorted(s for s in spans if s[1] > s[0]):
        if merged and begin <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((begin, end))
    return merged


def overlaps_any(spans: list[tuple[float, float]], begin: float, end: float) -> bool:
    """Whether any of the disjoint, ordered `spans` overlaps the open interval (begin, end): O(log n)."""
    last = bisect.bisect_left(spans, (end, -math.inf)) - 1  # the last span beginning before `end`
    return last >= 0 and spans[last][1] > begin


def kept_step_times(
    step_ts: Sequence[float],
    step_numbers: Sequence[int],
    phases: Iterable[Span],
    keep_up_to_step: float,
) -> list[float]:
    """The seconds of each kept, unblocked step of one attempt, in step order (rules above); where every kept
    interval holds a blocking phase, each less the blocking time inside it."""
    blocking = blocking_spans(phases)
    kept = [
        (begin, end)
        for step, begin, end in step_intervals(step_ts, step_numbers)
        if step <= keep_up_to_step and end >= begin
    ]
    clean = [end - begin for begin, end in kept if not overlaps_any(blocking, begin, end)]
    if clean or not kept:
        return clean
    net = ((end - begin) - covered(blocking, begin, end) for begin, end in kept)
    return [seconds for seconds in net if seconds > 0]


def covered(spans: list[tuple[float, float]], begin: float, end: float) -> float:
    """Seconds of [begin, end] that the disjoint, ordered `spans` cover."""
    return sum(max(0.0, min(e, end) - max(b, begin)) for b, e in spans if b < end and e > begin)


def step_time(durations: Sequence[float]) -> StepTime:
    """Median and p90 (nearest rank) of `durations`; `NO_STEP_TIME` when empty."""
    if not durations:
        return NO_STEP_TIME
    ordered = sorted(durations)
    rank = max(1, math.ceil(0.9 * len(ordered)))
    return StepTime(median_s=statistics.median(ordered), p90_s=ordered[rank - 1], num_steps=len(ordered))


def relative_change(base: float | None, value: float | None) -> float | None:
    """`value / base - 1` (0.62: 62% slower); None when either is unknown or `base` is not positive."""
    if base is None or value is None or not base > 0:
        return None
    return value / base - 1.0
