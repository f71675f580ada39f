"""The parts of each recovery and of the start (`EttReport.ttr_parts`, `tts_parts`) for every renderer:
the JSON objects, the text table and the HTML table. Parts the events cannot tell are shown as unknown.

Two spans are shown, each labelled: the headline's (the report's TTS and TTR: the origin, or the failed
attempt's end, to the training start; a row of its own, equal to the summary's figure) and the whole
(failure, else its detection, or the origin, to the first step)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ettr.accounting.model import EttReport
from ettr.accounting.ttr import ALL_RECOVERY_PARTS, STARTUP_PARTS, RecoveryParts
from ettr.report.svg import esc, fmt_s

HEADLINE_ROW = "= TTS / TTR (headline)"
"""The row holding the headline's span: origin or the failed attempt's end -> training start."""
TOTAL_ROW = "total (to first step)"
KIND_ROW = "recovery kind"
"""The row saying how each failure was recovered: in_place | warm_restart | cold_restart | requeue."""
RESTORED_FROM_ROW = "  (restored from)"
"""The row saying where each recovery's ranks restored from: memory | peer | storage (`+` where they
differed; `nothing`: the attempt started over, resuming from no step; `?`: it resumed, from where unknown)."""
RELAUNCH_PATH_ROW = "  (relaunch path)"
"""The row saying how each relaunch started its process(es): warm | promoted | cold | forked | spare (why: below the text
table, in the HTML cell's title)."""
TTS_MEASURES = "allocation (else supervisor start, else wall start) -> training start of the first attempt"
TTR_MEASURES = "the failed attempt's end (failure detected, its processes gone) -> training start of the next"
"""What the headline TTS and each headline TTR measure (JSON `tts_measures`, `ttr_measures`)."""


def total_measures(parts: RecoveryParts) -> str:
    """What `total_s` of `parts` measures."""
    if parts.failed_attempt is None:
        return "allocation (else supervisor start) -> first step"
    return (
        "failure -> first step"
        if parts.failure_known
        else "failure detected -> first step (failure time unknown)"
    )


def to_json(parts: RecoveryParts | None) -> dict[str, Any] | None:
    """`{failed_attempt, recovered_attempt, start_ts, first_step_ts, total_s, total_measures, headline_s,
    headline_start_ts, training_start_ts, headline_measures, parts_s, relaunch_path, relaunch_why, kind,
    restored_from, restored_why}` (parts in order; `kind`: how the failure was recovered, `RECOVERY_KINDS`; null for the
    start; `restored_from`: memory | peer | storage, `+`-joined where ranks differed, `nothing` when the attempt resumed from no step, null when unknown; `restored_why`: why ranks that keep memory copies read storage, null
    when they did not; `restored_tier`: `a memory-only commit of step S; storage had N` when the ranks restored
    a memory-tier commit, else null). `headline_s` is the
    report's TTR (or TTS) for this recovery: the parts from backoff (or before_launch) through other_init."""
    if parts is None:
        return None
    return {
        "failed_attempt": parts.failed_attempt,
        "recovered_attempt": parts.recovered_attempt,
        "start_ts": parts.start_ts,
        "first_step_ts": parts.first_step_ts,
        "total_s": parts.total_s,
        "total_measures": total_measures(parts),
        "headline_s": parts.headline_s,
        "headline_start_ts": parts.headline_start_ts,
        "training_start_ts": parts.training_start_ts,
        "headline_measures": TTS_MEASURES if parts.failed_attempt is None else TTR_MEASURES,
        "parts_s": dict(parts.parts_s),
        "relaunch_path": parts.relaunch_path,
        "relaunch_why": parts.relaunch_why,
        "kind": parts.kind,
        "restored_from": parts.restored_from,
        "restored_why": parts.restored_why,
        "restored_tier": parts.restored_tier,
    }


_NOT_A_PART = ""
"""A cell for a part that the column does not have (back-off in the start, launch in a recovery)."""

Cell = float | None | str


def _cell(v: Cell) -> str:
    return v if isinstance(v, str) else "?" if v is None else fmt_s(v)


def _rows(report: EttReport) -> tuple[list[str], list[tuple[str, list[Cell]]]]:
    """Column titles and (part, seconds per column) rows: TTS first, then each recovery."""
    columns: list[RecoveryParts] = ([report.tts_parts] if report.tts_parts else []) + list(report.ttr_parts)
    titles = [
        "start" if c.failed_attempt is None else f"{c.failed_attempt}->{c.recovered_attempt}" for c in columns
    ]
    rows: list[tuple[str, list[Cell]]] = []
    if report.ttr_parts:
        rows.append((KIND_ROW, list[Cell]([c.kind or _NOT_A_PART for c in columns])))
    names = [
        n
        for n in dict.fromkeys((*STARTUP_PARTS[:2], *ALL_RECOVERY_PARTS))
        if any(n in c.parts_s for c in columns)
    ]
    for n in names:
        if n == "first_step":
            rows.append((HEADLINE_ROW, list[Cell]([c.headline_s for c in columns])))
        rows.append((n, [c.parts_s[n] if n in c.parts_s else _NOT_A_PART for c in columns]))
        if n == "relaunch" and any(c.relaunch_path for c in columns):
            rows.append((RELAUNCH_PATH_ROW, list[Cell]([c.relaunch_path or _NOT_A_PART for c in columns])))
        if n == "restore" and report.ttr_parts:
            sources = [_NOT_A_PART if c.failed_attempt is None else c.restored_from or "?" for c in columns]
            rows.append((RESTORED_FROM_ROW, list[Cell](sources)))
    rows.append((TOTAL_ROW, list[Cell]([c.total_s for c in columns])))
    return titles, rows


def text_lines(report: EttReport) -> list[str]:
    """A table: one column for the start, one per recovery; `?` for a part the events cannot tell."""
    if report.tts_parts is None and not report.ttr_parts:
        return []
    titles, rows = _rows(report)

    def cell(v: Cell) -> str:
        return v if isinstance(v, str) else "?" if v is None else f"{v:.2f}"

    width = max(len(n) for n, _ in rows) + 2
    lines = [
        "",
        "time to start / recover by part (s; a->b: failure of attempt a to the first step of b)",
        f"  '{HEADLINE_ROW}': the headline's span, allocation or the failed attempt's end -> training start",
    ]
    # Each column as wide as its widest cell and a space (at least 10): a kind such as `cold_restart` ran
    # into the next column's.
    widths = [
        max(10, 1 + len(t), *(1 + len(cell(vals[i])) for _, vals in rows)) for i, t in enumerate(titles)
    ]
    lines.append("  " + " " * width + "".join(f"{t:>{w}}" for t, w in zip(titles, widths, strict=True)))
    lines += [
        "  " + f"{n:<{width}}" + "".join(f"{cell(v):>{w}}" for v, w in zip(vals, widths, strict=True))
        for n, vals in rows
    ]
    lines += [
        f"  relaunch {p.failed_attempt}->{p.recovered_attempt}: {p.relaunch_path} ({p.relaunch_why})"
        for p in report.ttr_parts
        if p.relaunch_path and p.relaunch_why
    ]
    lines += [
        f"  restore {p.failed_attempt}->{p.recovered_attempt}: {p.restored_from or '?'}, not memory ({p.restored_why})"
        for p in report.ttr_parts
        if p.restored_why
    ]
    lines += [
        f"  restore {p.failed_attempt}->{p.recovered_attempt}: {p.restored_from or '?'} ({p.restored_tier})"
        for p in report.ttr_parts
        if p.restored_tier
    ]
    return lines


def html_table(reports: Sequence[EttReport], names: Sequence[str]) -> str:
    """The same table per run, as HTML (empty when no run has a start or recovery to break down)."""
    out = []
    for report, name in zip(reports, names, strict=True):
        if report.tts_parts is None and not report.ttr_parts:
            continue
        titles, rows = _rows(report)
        head = "".join(f"<th>{esc(t)}</th>" for t in titles)
        columns = ([report.tts_parts] if report.tts_parts else []) + list(report.ttr_parts)
        whys = {
            RELAUNCH_PATH_ROW: [c.relaunch_why or "" for c in columns],
            RESTORED_FROM_ROW: [c.restored_why or "" for c in columns],
        }
        body = "".join(
            f"<tr><td>{esc(n)}</td>"
            + "".join(
                f'<td title="{esc(why)}">{esc(_cell(v))}</td>' if why else f"<td>{esc(_cell(v))}</td>"
                for v, why in zip(vals, whys.get(n, [""] * len(vals)), strict=True)
            )
            + "</tr>"
            for n, vals in rows
        )
        label = f"<p><b>{esc(name)}</b></p>" if len(reports) > 1 else ""
        out.append(f'{label}<table class="parts"><tr><th>part</th>{head}</tr>{body}</table>')
    return "".join(out)
