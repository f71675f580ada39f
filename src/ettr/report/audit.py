"""The init communication audit as text: what `ettr report` prints below the buckets (marks from `ettr.audit`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from ettr.audit import MARK_NAME
from ettr.events import Event, EventKind
from ettr.untrusted import printable


def audit_events(events: Iterable[Event]) -> list[Event]:
    """The audit marks among `events`."""
    return [
        e
        for e in events
        if e.kind is EventKind.MARK and e.data is not None and e.data.get("name") == MARK_NAME
    ]


def render(events: Iterable[Event]) -> str:
    """A text table of the init communication audit of every attempt in `events` ('' if there is none).

    Per attempt: one row per (stage, op) with the calls and seconds of the slowest rank, then per-rank
    totals. Stage durations come from the same attempt's PHASE_END events (longest over ranks).
    """
    events = list(events)
    marks = audit_events(events)
    if not marks:
        return ""
    durations: dict[tuple[int, str], float] = {}
    for e in events:
        if e.kind is EventKind.PHASE_END and e.phase is not None and e.value is not None:
            key = (e.attempt, str(e.phase))
            durations[key] = max(durations.get(key, 0.0), e.ts - e.value)
    lines: list[str] = []
    for attempt in sorted({m.attempt for m in marks}):
        lines.extend(_render_attempt(attempt, [m for m in marks if m.attempt == attempt], durations))
    return "\n".join(lines)


def _render_attempt(
    attempt: int, marks: list[Event], durations: Mapping[tuple[int, str], float]
) -> list[str]:
    ranks = sorted({m.rank for m in marks})
    rows: dict[tuple[str, str], list[float]] = {}  # (stage, op) -> [calls, total_s, max_s], max over ranks
    stage_order: list[str] = []
    for mark in sorted(marks, key=lambda m: m.rank):
        data = mark.data or {}
        stages = data.get("stages")
        for stage, ops in stages.items() if isinstance(stages, Mapping) else ():
            if not isinstance(ops, Mapping):
                continue  # a damaged or forged mark: its rows are not shown, never a traceback
            name = printable(str(stage))
            for op, s in ops.items():
                numbers = _op_numbers(s)
                if numbers is None:
                    continue
                if name not in stage_order:
                    stage_order.append(name)
                row = rows.setdefault((name, printable(str(op))), [0, 0.0, 0.0])
                row[:] = [max(old, new) for old, new in zip(row, numbers, strict=True)]
    lines = [
        f"Init communication audit — attempt {attempt}, {len(ranks)} rank(s); slowest rank per row",
        f"  {'stage':<24} {'op':<32} {'calls':>5} {'total ms':>9} {'max ms':>8}",
    ]
    for stage in stage_order:
        stage_rows = sorted(((op, r) for (s, op), r in rows.items() if s == stage), key=lambda x: -x[1][1])
        comm_s = sum(r[1] for _, r in stage_rows)
        phase_s = durations.get((attempt, stage))
        of_phase = f" of {phase_s * 1000:.0f} ms in the phase" if phase_s else ""
        lines.append(
            f"  {stage:<24} {'(all)':<32} {sum(int(r[0]) for _, r in stage_rows):>5} "
            f"{comm_s * 1000:>9.1f}{'':>9}{of_phase}"
        )
        for op, (calls, total_s, max_s) in stage_rows:
            lines.append(f"  {'':<24} {op:<32} {int(calls):>5} {total_s * 1000:>9.1f} {max_s * 1000:>8.1f}")
    for mark in sorted(marks, key=lambda m: m.rank):
        data = mark.data or {}
        num_calls, seconds, groups = (
            _number(data.get(k, 0)) for k in ("num_calls", "total_s", "num_groups_created")
        )
        lines.append(
            f"  rank {mark.rank}: {_shown(num_calls, '.0f')} calls, {_shown(seconds, '.1f', 1000)} ms, "
            f"{_shown(groups, '.0f')} process group(s) created"
        )
    return lines


def _op_numbers(s: Any) -> tuple[float, float, float] | None:
    """(calls, total_s, max_s) of one op of a mark; None when any is not a finite number >= 0."""
    if not isinstance(s, Mapping):
        return None
    calls, total_s, max_s = (_number(s.get(k, 0)) for k in ("num_calls", "total_s", "max_s"))
    if calls is None or total_s is None or max_s is None:
        return None
    return calls, total_s, max_s


def _number(value: Any) -> float | None:
    """A count or seconds of a mark; None (unknown) for anything but a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) and number >= 0 else None


def _shown(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "?" if value is None else format(value * scale, spec)
