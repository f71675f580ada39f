"""How the step slowdown while persisting (`EttReport.slowdown`) shows in the text and JSON reports."""

from __future__ import annotations

from typing import Any

from ettr.accounting.slowdown import PersistSlowdown, StepSlowdown

LARGE_INFLATION = 1.10
"""From this inflation on the text report lists every save (below it, only when asked)."""


def to_json(slowdown: StepSlowdown | None) -> dict[str, Any] | None:
    """The `step_slowdown` object of the JSON report (null when the job persisted nothing)."""
    if slowdown is None:
        return None
    return {
        "steady_step_s": slowdown.steady_step_s,
        "persist_step_s": slowdown.persist_step_s,
        "inflation": slowdown.inflation,
        "extra_s": slowdown.extra_s,
        "num_quiet_steps": slowdown.num_quiet_steps,
        "num_busy_steps": slowdown.num_busy_steps,
        "saves": [_save_json(s) for s in slowdown.saves],
    }


def _save_json(save: PersistSlowdown) -> dict[str, Any]:
    return {
        "attempt": save.attempt,
        "start_ts": save.start_ts,
        "end_ts": save.end_ts,
        "num_steps": save.num_steps,
        "median_step_s": save.median_step_s,
        "inflation": save.inflation,
        "extra_s": save.extra_s,
    }


def text_lines(slowdown: StepSlowdown | None, *, wall_start_ts: float, per_save: bool = False) -> list[str]:
    """One line (and one per save when `per_save` or when the slowdown is large); [] without persists."""
    if slowdown is None:
        return []
    if slowdown.inflation is None:
        why = "no quiet steps" if slowdown.steady_step_s is None else "no steps ran during a persist"
        line = f"step slowdown while persisting: unknown ({why}; {len(slowdown.saves)} persists)"
    else:
        line = (
            f"step slowdown while persisting: {slowdown.inflation:.2f}x "
            f"({_ms(slowdown.steady_step_s)} -> {_ms(slowdown.persist_step_s)} ms per step, "
            f"{slowdown.num_busy_steps} steps in {len(slowdown.saves)} persists) "
            f"cost {slowdown.extra_s or 0.0:.1f} s of extra step time (counted as training in the buckets)"
        )
    lines = [line]
    large = slowdown.inflation is not None and slowdown.inflation >= LARGE_INFLATION
    if per_save or large:
        for save in slowdown.saves:
            ratio = "-" if save.inflation is None else f"{save.inflation:.2f}x"
            extra = "-" if save.extra_s is None else f"{save.extra_s:.2f} s"
            lines.append(
                f"  persist at +{save.start_ts - wall_start_ts:.1f} s (attempt {save.attempt}, "
                f"{save.duration_s:.1f} s): {save.num_steps} steps, {ratio}, extra {extra}"
            )
    return lines


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"
