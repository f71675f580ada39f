"""Windowed ETT: the shares of the last `window_s` of a job's wall time, beside the cumulative figures, so a
dashboard sees a job go bad now, not diluted by its history. Pure: no I/O, no clock.

The window is [wall end - window_s, wall end] cut from the report's own timeline (its segments), each
second classified as the cumulative figures classify it (`classify`: start-up of a later attempt is failure,
and so on); a job shorter than the window is covered whole (`covered_s` < `window_s`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from ettr.events import Bucket

DEFAULT_WINDOW_S = 3600.0
"""The window of `EttReport.window` unless given: the last hour."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EttWindow:
    """ETT over the last `window_s` of wall time (`EttReport.window`)."""

    window_s: float
    """The window asked for."""
    start_ts: float
    """max(wall start, wall end - window_s)."""
    end_ts: float
    ett_pct: float
    idleness_pct: float
    failure_pct: float
    buckets_s: Mapping[Bucket, float]

    @property
    def covered_s(self) -> float:
        """The wall time inside the window (less than `window_s` when the job is shorter)."""
        return self.end_ts - self.start_ts


def check_window(window_s: float) -> float:
    """`window_s` if it is a usable window (finite, > 0); else ValueError saying why."""
    if not (isinstance(window_s, int | float) and math.isfinite(window_s) and window_s > 0):
        raise ValueError(f"the ETT window must be a positive number of seconds, got {window_s!r}")
    return float(window_s)


def ett_window(
    segments: Sequence[tuple[float, float, Bucket, int | None]],
    wall_start: float,
    wall_end: float,
    window_s: float,
    loss_of: Callable[[Bucket, int | None], str],
) -> EttWindow:
    """The window's shares; `loss_of(bucket, attempt)` is "effective", "idleness" or "failure"."""
    start = max(wall_start, wall_end - window_s)
    buckets: dict[Bucket, list[float]] = {b: [] for b in Bucket}
    by_loss: dict[str, list[float]] = {"effective": [], "idleness": [], "failure": []}
    for seg_start, seg_end, bucket, attempt in segments:
        if seg_end <= start:
            continue
        piece = seg_end - max(seg_start, start)
        buckets[bucket].append(piece)
        by_loss[loss_of(bucket, attempt)].append(piece)
    covered = wall_end - start

    def pct(part: str) -> float:
        return math.fsum(by_loss[part]) / covered * 100.0 if covered > 0 else 0.0

    return EttWindow(
        window_s=window_s,
        start_ts=start,
        end_ts=wall_end,
        ett_pct=pct("effective"),
        idleness_pct=pct("idleness"),
        failure_pct=pct("failure"),
        buckets_s=MappingProxyType({b: math.fsum(v) for b, v in buckets.items()}),
    )
