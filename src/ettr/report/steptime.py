"""How the time per kept step (`EttReport.step_time`) shows in every report, and the warning when runs
compared side by side ran at different step speeds (their ETT% then measures different things)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ettr.accounting import EttReport
from ettr.accounting.steptime import StepTime, relative_change

SPEED_TOLERANCE = 0.10
"""Runs whose median step times differ by more than this share (10%) are warned about when compared."""


def to_json(step_time: StepTime) -> dict[str, Any]:
    """`step_time_s` (the contract's: median per kept step, null when none), `step_time_p90_s` and
    `num_timed_steps`, to merge into a report or attempt object."""
    return {
        "step_time_s": step_time.median_s,
        "step_time_p90_s": step_time.p90_s,
        "num_timed_steps": step_time.num_steps,
    }


def fmt_step(seconds: float | None) -> str:
    """`49.2 ms`, `1.23 s`, `12.3 s`; `-` when unknown."""
    if seconds is None:
        return "-"
    if seconds < 1.0:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s" if seconds < 10.0 else f"{seconds:.1f} s"


def summary(step_time: StepTime) -> str:
    """`median 49.2 ms, p90 61.0 ms over 2380 kept steps`, or why there is none."""
    if step_time.median_s is None:
        return "unknown (no kept step could be timed)"
    return (
        f"median {fmt_step(step_time.median_s)}, p90 {fmt_step(step_time.p90_s)} "
        f"over {step_time.num_steps} kept steps"
    )


def fmt_change(base: float | None, value: float | None) -> str:
    """`+62%` / `-8%`; `-` when either is unknown."""
    change = relative_change(base, value)
    return "-" if change is None else f"{change * 100:+.0f}%"


def speed_warnings(names: Sequence[str], reports: Sequence[EttReport]) -> list[str]:
    """One line per run whose steps ran at another speed than the first run's by more than
    `SPEED_TOLERANCE`, by the median step time or by the effective training per kept step (the mean: what
    ETT counts): what ETT% then means. Empty when they agree (or are unknown)."""
    base_name, base = names[0], reports[0]
    lines = []
    for name, r in zip(names[1:], reports[1:], strict=True):
        median = relative_change(base.step_time.median_s, r.step_time.median_s)
        mean = relative_change(base.training_per_kept_step_s, r.training_per_kept_step_s)
        if all(c is None or abs(c) <= SPEED_TOLERANCE for c in (median, mean)):
            continue
        figures = (
            f"median {fmt_step(r.step_time.median_s)} vs {fmt_step(base.step_time.median_s)} a step"
            f" ({fmt_change(base.step_time.median_s, r.step_time.median_s)}), effective training "
            f"{fmt_step(r.training_per_kept_step_s)} vs {fmt_step(base.training_per_kept_step_s)} per kept step"
            f" ({fmt_change(base.training_per_kept_step_s, r.training_per_kept_step_s)})"
        )
        if mean is None or abs(mean) <= SPEED_TOLERANCE:
            effect = "the time ETT counts per step is about the same, so ETT% still compares"
        elif mean > 0:
            effect = (
                "ETT% counts step time as effective training, so its slower steps raise it for the same work"
            )
        else:
            effect = (
                "ETT% counts step time as effective training, so its faster steps lower it for the same work"
            )
        lines.append(
            f"warning: {name}'s steps ran at another speed than {base_name}'s ({figures}): {effect}; "
            "compare the time per step too"
        )
    return lines
