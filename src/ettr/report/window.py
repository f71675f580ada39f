"""ETT over the last hour (or the window asked for), beside the cumulative figure, in every report."""

from __future__ import annotations

from typing import Any

from ettr.accounting import EttReport, EttWindow
from ettr.events import Bucket


def to_json(w: EttWindow | None) -> dict[str, Any] | None:
    """The `ett_window` object: window_s, start_ts, end_ts, covered_s, ett_pct, idleness_pct, failure_pct,
    buckets_s."""
    if w is None:
        return None
    return {
        "window_s": w.window_s,
        "start_ts": w.start_ts,
        "end_ts": w.end_ts,
        "covered_s": w.covered_s,
        "ett_pct": w.ett_pct,
        "idleness_pct": w.idleness_pct,
        "failure_pct": w.failure_pct,
        "buckets_s": {b.value: w.buckets_s[b] for b in Bucket},
    }


def fmt_window(seconds: float) -> str:
    """`1 h`, `30 min`, `90 s`."""
    if seconds % 3600 == 0:
        return f"{seconds / 3600:g} h"
    if seconds % 60 == 0:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"


def line(report: EttReport) -> str | None:
    """`ETT over the last 1 h: 71.2% (idle 9.0%, failure 19.8%) | cumulative 83.1%`; None when the job is no
    longer than the window (the window is then the whole job: the summary line already says it)."""
    w = report.window
    if w is None or w.covered_s < w.window_s or report.wall_s <= w.window_s or report.ett_unknown is not None:
        return None
    return (
        f"ETT over the last {fmt_window(w.window_s)}: {w.ett_pct:.1f}% (idle {w.idleness_pct:.1f}%, "
        f"failure {w.failure_pct:.1f}%) | cumulative {report.ett_pct:.1f}%"
    )
