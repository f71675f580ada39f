"""SVG charts of `EttReport`s for the HTML report, drawn server-side so the page needs no network.

Every chart function returns one `<svg>` element as a string, sized by its viewBox so that it scales with
the page; all text in it (labels and hover titles) is escaped. Each bucket has one fixed colour
(`BUCKET_COLORS`) in every chart and every report, so that a reader learns the legend once. Output is a
pure function of the reports: no clock, no randomness, stable iteration order.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from ettr.accounting import Loss, classify
from ettr.accounting.model import AttemptReport, EttReport, Recovery
from ettr.constants import SECONDS_PER_DAY
from ettr.events import PHASE_BUCKET, Bucket, Outcome, Phase

BUCKET_COLORS: Mapping[Bucket, str] = MappingProxyType(
    {
        # Idleness: greys before the job runs, blues for start-up and checkpoints, slate/grey after.
        Bucket.SCHEDULING: "#c9d3df",
        Bucket.HARDWARE_SETUP: "#97a8bf",
        Bucket.INIT: "#3b6fb6",
        Bucket.COMPILE: "#6b5fc7",
        Bucket.RESTORE: "#2aa3c4",
        Bucket.DATA_WAIT: "#8fc1e8",
        Bucket.CHECKPOINT_BLOCKING: "#1d3f73",
        Bucket.SHUTDOWN: "#6f7c8c",
        Bucket.OTHER: "#b5b5b5",
        # The time that counts.
        Bucket.EFFECTIVE_TRAINING: "#2ca02c",
        # Failure: warm colours.
        Bucket.WASTED_PROGRESS: "#d62728",
        Bucket.RESTART: "#f07f19",
    }
)
"""The fixed colour of each bucket (green: effective training; reds/oranges: failure; blues/greys: idleness)."""

FAILURE_BUCKETS = frozenset({Bucket.WASTED_PROGRESS, Bucket.RESTART})
"""Buckets that always count to failure."""
STARTUP_BUCKETS = frozenset({Bucket.INIT, Bucket.COMPILE, Bucket.RESTORE, Bucket.DATA_WAIT})
"""Start-up buckets: idleness in the first attempt, failure (recovery) in later ones."""

OUTCOME_COLORS: Mapping[Outcome, str] = MappingProxyType(
    {
        Outcome.COMPLETED: "#2ca02c",
        Outcome.FAILED: "#d62728",
        Outcome.PREEMPTED: "#f07f19",
        Outcome.HUNG: "#9c2f8a",
        Outcome.INTERRUPTED: "#7f7f7f",
    }
)

HATCH_ID = "ettr-hatch"
"""Id of the hatch pattern (defined once per page by `svg_defs`) that marks start-up time of later
attempts, which counts to failure rather than idleness."""

_WIDTH = 1000.0
_LABEL_W = 170.0
_RIGHT_W = 150.0
_FONT = 'font-family="system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif"'
_NICE_STEPS_S = (
    *(m * 10.0**e for e in range(-3, 1) for m in (1, 2, 5)),
    10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400,
)  # fmt: skip


# -- formatting --------------------------------------------------------------------------------------------
def esc(value: object) -> str:
    """`value` as text safe inside HTML/SVG elements and double- or single-quoted attributes."""
    return html.escape(str(value), quote=True)


def fmt_s(seconds: float | None) -> str:
    """A duration for people: `3.21 s`, `42.1 s`, `12m 05s`, `3h 02m`; `—` for None."""
    if seconds is None or not math.isfinite(seconds):
        return "—"
    sign, s = ("-", -seconds) if seconds < 0 else ("", seconds)
    if s < 9.995:
        text = f"{s:.2f} s"
    elif s < 59.95:
        text = f"{s:.1f} s"
    elif s < 3599.5:
        whole = round(s)  # round, not truncate: 139.9996 s is 2m 20s
        text = f"{whole // 60}m {whole % 60:02d}s"
    else:
        minutes = round(s / 60)
        text = f"{minutes // 60}h {minutes % 60:02d}m"
    return sign + text


def fmt_exact_s(seconds: float) -> str:
    """A duration for hover titles: to the millisecond."""
    return f"{seconds:.3f} s"


def fmt_pct(pct: float) -> str:
    return f"{pct:.1f}%"


def bucket_label(bucket: Bucket) -> str:
    return bucket.value.replace("_", " ")


def _n(x: float) -> str:
    """A coordinate: two decimals, trailing zeros dropped (short and deterministic)."""
    text = f"{x:.2f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def _clip_text(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[: max_chars - 1] + "…"


def _svg(height: float, body: Iterable[str], *, label: str, width: float = _WIDTH) -> str:
    return (
        f'<svg class="chart" viewBox="0 0 {_n(width)} {_n(height)}" role="img" aria-label="{esc(label)}" '
        f'xmlns="http://www.w3.org/2000/svg" {_FONT} font-size="12">' + "".join(body) + "</svg>"
    )


def _rect(
    x: float, y: float, w: float, h: float, fill: str, title: str, *, bucket: Bucket | None = None
) -> str:
    data = f' class="seg" data-bucket="{bucket.value}"' if bucket is not None else ""
    return (
        f'<rect x="{_n(x)}" y="{_n(y)}" width="{_n(w)}" height="{_n(h)}" fill="{fill}"{data}>'
        f"<title>{esc(title)}</title></rect>"
    )


def _text(
    x: float, y: float, text: str, *, anchor: str = "start", fill: str = "#222", extra: str = ""
) -> str:
    return f'<text x="{_n(x)}" y="{_n(y)}" text-anchor="{anchor}" fill="{fill}"{extra}>{esc(text)}</text>'


def svg_defs() -> str:
    """Definitions shared by every chart of a page (the hatch pattern); place once, before the charts."""
    return (
        '<svg width="0" height="0" style="position:absolute" aria-hidden="true" '
        'xmlns="http://www.w3.org/2000/svg"><defs>'
        f'<pattern id="{HATCH_ID}" width="6" height="6" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)"><rect width="2.5" height="6" fill="#d62728" fill-opacity="0.75"/>'
        "</pattern></defs></svg>"
    )


# -- time axis ----------------------------------------------------------------------------------------------
def nice_step_s(span_s: float, *, max_ticks: int = 8) -> float:
    """The smallest friendly tick step (1-2-5 below 10 s, then clock-like) giving at most `max_ticks`."""
    for step in _NICE_STEPS_S:
        if span_s / step <= max_ticks:
            return float(step)
    return SECONDS_PER_DAY * math.ceil(span_s / SECONDS_PER_DAY / max_ticks)


def fmt_tick(t_s: float, step_s: float) -> str:
    """An axis label at `t_s` for ticks `step_s` apart: `0`, `2.5s`, `30s`, `1m30s`, `2h`."""
    if t_s == 0:
        return "0"
    if step_s < 1:
        return f"{t_s:.{max(0, -math.floor(math.log10(step_s)))}f}s"
    if step_s < 60:
        return f"{t_s:.0f}s"
    if step_s < 3600:
        return f"{int(t_s // 60)}m" if t_s % 60 == 0 else f"{int(t_s // 60)}m{int(t_s % 60):02d}s"
    return f"{int(t_s // 3600)}h" if t_s % 3600 == 0 else f"{int(t_s // 3600)}h{int(t_s % 3600 // 60):02d}m"


def _axis(
    x0: float, plot_w: float, scale_s: float, y_label: float, y_top: float, y_bottom: float
) -> list[str]:
    step = nice_step_s(scale_s)
    out = []
    num_ticks = int(scale_s / step + 1e-9)
    for i in range(num_ticks + 1):
        t = i * step
        x = x0 + t / scale_s * plot_w
        out.append(f'<line x1="{_n(x)}" x2="{_n(x)}" y1="{_n(y_top)}" y2="{_n(y_bottom)}" stroke="#e3e6ea"/>')
        out.append(
            _text(x, y_label, fmt_tick(t, step), anchor="middle", fill="#666", extra=' font-size="11"')
        )
    return out


# -- timeline ------------------------------------------------------------------------------------------------
def counts_as_recovery(bucket: Bucket, attempt_position: int) -> bool:
    """Start-up time of an attempt after the first counts to failure (recovery), not idleness: the
    accounting's `classify` decides, so the picture cannot disagree with the numbers."""
    return bucket in STARTUP_BUCKETS and classify(bucket, attempt_position=attempt_position) is Loss.FAILURE


def _attempt_label(a: AttemptReport) -> str:
    code = "" if a.exit_code is None else f" ({a.exit_code})"
    return f"#{a.index} {a.outcome.value}{code}"


def failure_summary(a: AttemptReport, *, max_chars: int = 160) -> str:
    """One line on why an attempt did not complete: its ATTEMPT_END details and the process failure."""
    if not a.failure:
        return ""
    parts = []
    for key in sorted(a.failure):
        value = a.failure[key]
        if key == "process_failure" and isinstance(value, Mapping):
            detail = ": ".join(str(value[k]) for k in ("exception", "message") if value.get(k))
            if detail:
                parts.append(detail)
        elif value not in (None, "", {}):
            parts.append(f"{key}={value}")
    return _clip_text("; ".join(parts), max_chars)


def _thin(items: Sequence, limit: int) -> Sequence:
    """At most `limit` items, evenly spaced (markers beyond that are unreadable anyway)."""
    if len(items) <= limit:
        return items
    return [items[i * len(items) // limit] for i in range(limit)]


def timeline_svg(report: EttReport, *, scale_s: float | None = None) -> str:
    """The job on a time axis, one row per attempt, coloured by bucket.

    `scale_s` is the span the axis shows (several reports drawn with the same value share a scale); the
    default is the report's own wall time. Markers: ▼ at the end of an attempt that did not complete, ticks
    under a row for checkpoint commits, ◆ above it for recompiles. Hatched: start-up time of later attempts.
    """
    scale = max(scale_s if scale_s is not None else report.wall_s, report.wall_s, 1e-9)
    origin = report.wall_start_ts
    row_h, gap, top = 22.0, 14.0, 30.0
    indices = [a.index for a in report.attempts]
    position_of: dict[int | None, int] = {index: position for position, index in enumerate(indices)}
    rows: list[int | None] = list(indices)
    if not rows or any(s.attempt not in indices for s in report.segments):
        rows.insert(0, None)  # time owned by no attempt
    row_of = {index: i for i, index in enumerate(rows)}
    plot_w = _WIDTH - _LABEL_W - 20
    height = top + len(rows) * (row_h + gap) + 4

    def x(ts: float) -> float:
        return _LABEL_W + (ts - origin) / scale * plot_w

    def y(attempt: int | None) -> float:
        return top + row_of.get(attempt, 0) * (row_h + gap)

    body = _axis(_LABEL_W, plot_w, scale, 14, 20, height - 4)
    for a in report.attempts:
        body.append(
            f'<rect x="{_n(x(a.start_ts))}" y="{_n(y(a.index) - 2)}" width="{_n(max(0.0, x(a.end_ts) - x(a.start_ts)))}" '
            f'height="{_n(row_h + 4)}" fill="none" stroke="#9aa3ad" stroke-dasharray="3 2"/>'
        )
        title = (
            f"attempt {a.index}: {a.outcome.value}, exit code {a.exit_code}, {fmt_exact_s(a.duration_s)} "
            f"(+{a.start_ts - origin:.3f} s → +{a.end_ts - origin:.3f} s)"
        )
        if (detail := failure_summary(a)) != "":
            title += f"; {detail}"
        color = OUTCOME_COLORS[a.outcome]
        body.append(
            f'<g><title>{esc(title)}</title><rect x="0" y="{_n(y(a.index))}" width="{_n(_LABEL_W - 8)}" '
            f'height="{_n(row_h)}" fill="#fff" fill-opacity="0"/>'
            + _text(6, y(a.index) + 15, _attempt_label(a), fill=color, extra=' font-weight="600"')
            + "</g>"
        )
    if None in row_of:
        body.append(_text(6, y(None) + 15, "job", fill="#555", extra=' font-weight="600"'))
    for seg in report.segments:
        if seg.end_ts <= seg.start_ts:
            continue
        x0, x1, y0 = x(seg.start_ts), x(seg.end_ts), y(seg.attempt if seg.attempt in row_of else None)
        w = max(x1 - x0, 0.6)
        recovery = counts_as_recovery(seg.bucket, position_of.get(seg.attempt, 0))
        owner = "job" if seg.attempt is None else f"attempt {seg.attempt}"
        title = (
            f"{owner} · {bucket_label(seg.bucket)}: {fmt_exact_s(seg.end_ts - seg.start_ts)} "
            f"(+{seg.start_ts - origin:.3f} s → +{seg.end_ts - origin:.3f} s)"
            + (" · counted as failure (recovery)" if recovery else "")
        )
        body.append(_rect(x0, y0, w, row_h, BUCKET_COLORS[seg.bucket], title, bucket=seg.bucket))
        if recovery:
            body.append(
                f'<rect x="{_n(x0)}" y="{_n(y0)}" width="{_n(w)}" height="{_n(row_h)}" '
                f'fill="url(#{HATCH_ID})" pointer-events="none"/>'
            )
    for a in report.attempts:
        if a.outcome is not Outcome.COMPLETED:
            xe, ye = x(a.end_ts), y(a.index) - 3
            body.append(
                f'<path d="M{_n(xe - 5)} {_n(ye - 7)}h10l-5 7z" fill="{OUTCOME_COLORS[a.outcome]}">'
                f"<title>{esc(f'attempt {a.index} {a.outcome.value} at +{a.end_ts - origin:.3f} s')}</title></path>"
            )
    for c in _thin(report.checkpoint_commits, 400):
        yc = y(c.attempt if c.attempt in row_of else None) + row_h + 1
        title = f"checkpoint of step {c.step} committed at +{c.ts - origin:.3f} s" + (
            f" ({c.path})" if c.path else ""
        )
        body.append(
            f'<line x1="{_n(x(c.ts))}" x2="{_n(x(c.ts))}" y1="{_n(yc)}" y2="{_n(yc + 6)}" stroke="#1d3f73" '
            f'stroke-width="1.5"><title>{esc(title)}</title></line>'
        )
    for r in _thin(report.recompiles, 400):
        xr, yr = x(r.ts), y(r.attempt if r.attempt in row_of else None) - 5
        title = f"recompile at +{r.ts - origin:.3f} s (rank {r.rank}): {r.reason or 'no reason given'}"
        body.append(
            f'<path d="M{_n(xr)} {_n(yr - 4)}l4 4l-4 4l-4-4z" fill="{BUCKET_COLORS[Bucket.COMPILE]}" '
            f'stroke="#fff" stroke-width="0.8"><title>{esc(title)}</title></path>'
        )
    return _svg(height, body, label=f"timeline of {report.job_id}")


# -- where the wall time went -----------------------------------------------------------------------------
def share_bar_svg(buckets_s: Mapping[Bucket, float], *, width: float = _WIDTH, height: float = 30.0,
                  labels: bool = True, title_prefix: str = "") -> str:  # fmt: skip
    """One bar split by bucket in proportion to `buckets_s` (a 100% stacked bar); `%` written inside
    pieces wide enough when `labels`."""
    total = sum(max(0.0, v) for v in buckets_s.values())
    body: list[str] = []
    x = 0.0
    for bucket in Bucket:
        seconds = max(0.0, buckets_s.get(bucket, 0.0))
        if seconds <= 0 or total <= 0:
            continue
        w = seconds / total * width
        pct = seconds / total * 100
        title = f"{title_prefix}{bucket_label(bucket)}: {fmt_exact_s(seconds)} ({fmt_pct(pct)})"
        body.append(_rect(x, 0, max(w, 0.5), height, BUCKET_COLORS[bucket], title, bucket=bucket))
        if labels and w >= 42:
            dark = bucket in (Bucket.SCHEDULING, Bucket.DATA_WAIT, Bucket.OTHER, Bucket.HARDWARE_SETUP)
            body.append(
                _text(
                    x + w / 2,
                    height / 2 + 4,
                    fmt_pct(pct),
                    anchor="middle",
                    fill="#111" if dark else "#fff",
                    extra=' font-weight="600" pointer-events="none"',
                )  # fmt: skip
            )
        x += w
    if total <= 0:
        body.append(f'<rect width="{_n(width)}" height="{_n(height)}" fill="#eef0f3"/>')
    return _svg(height, body, label="share of wall time by bucket", width=width)


def bucket_bars_svg(reports: Sequence[EttReport], names: Sequence[str]) -> str:
    """Seconds and % of wall time per bucket, one bar per report in each bucket's group, on one scale."""
    sub_h, group_gap = 16.0, 10.0
    many = len(reports) > 1
    peak = max((r.buckets_s[b] for r in reports for b in Bucket), default=0.0)
    plot_w = _WIDTH - _LABEL_W - _RIGHT_W
    body: list[str] = []
    y = 4.0
    for bucket in Bucket:
        body.append(
            _text(0, y + 12, bucket_label(bucket), fill="#222", extra=f' data-bucket="{bucket.value}"')
        )
        body.append(
            f'<rect x="{_n(_LABEL_W - 18)}" y="{_n(y + 2)}" width="11" height="11" fill="{BUCKET_COLORS[bucket]}"/>'
        )
        for report, name in zip(reports, names, strict=True):
            seconds = report.buckets_s[bucket]
            w = seconds / peak * plot_w if peak > 0 else 0.0
            pct = report.bucket_pct(bucket)
            title = f"{name} · {bucket_label(bucket)}: {fmt_exact_s(seconds)} ({fmt_pct(pct)} of wall time)"
            if w > 0:
                body.append(
                    _rect(_LABEL_W, y, max(w, 1.0), sub_h - 3, BUCKET_COLORS[bucket], title, bucket=bucket)
                )
            value = f"{fmt_s(seconds)} · {fmt_pct(pct)}"
            label = f"{_clip_text(name, 18)}: {value}" if many else value
            body.append(_text(_LABEL_W + w + 6, y + 11, label, fill="#444" if seconds > 0 else "#aaa",
                              extra=' font-size="11"'))  # fmt: skip
            y += sub_h
        y += group_gap
    return _svg(y, body, label="seconds per bucket")


# -- time to start ----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Piece:
    """A contiguous piece of a waterfall: `bucket` (None: several short pieces folded together)."""

    bucket: Bucket | None
    start_ts: float
    end_ts: float
    num_folded: int = 1

    @property
    def duration_s(self) -> float:
        return self.end_ts - self.start_ts


def tts_window(report: EttReport) -> tuple[float, float] | None:
    """[origin, training start) of the TTS, as the report gives it (`EttReport.tts_window`); None when no
    attempt trained."""
    window = report.tts_window
    if window is None:
        return None
    return window.origin_ts, max(window.origin_ts, window.training_start_ts)


def pieces_between(report: EttReport, start_ts: float, end_ts: float) -> list[Piece]:
    """The timeline's segments clipped to [start_ts, end_ts), in order, adjacent same buckets merged."""
    out: list[Piece] = []
    for seg in report.segments:
        b, e = max(seg.start_ts, start_ts), min(seg.end_ts, end_ts)
        if e <= b:
            continue
        if out and out[-1].bucket is seg.bucket and abs(out[-1].end_ts - b) < 1e-9:
            out[-1] = Piece(seg.bucket, out[-1].start_ts, e)
        else:
            out.append(Piece(seg.bucket, b, e))
    return out


def fold_short(pieces: list[Piece], *, max_rows: int = 14) -> list[Piece]:
    """When there are more than `max_rows` pieces, fold runs of pieces shorter than 2% of the whole into one
    piece each (keeping the order, so the waterfall still adds up)."""
    if len(pieces) <= max_rows:
        return pieces
    total = pieces[-1].end_ts - pieces[0].start_ts
    out: list[Piece] = []
    for p in pieces:
        short = p.duration_s < 0.02 * total
        if short and out and out[-1].bucket is None:
            last = out[-1]
            out[-1] = Piece(None, last.start_ts, p.end_ts, last.num_folded + 1)
        elif short:
            out.append(Piece(None, p.start_ts, p.end_ts, 1))
        else:
            out.append(p)
    return out


def _waterfall(pieces: Sequence[Piece], origin: float, total_s: float, total_label: str, title: str) -> str:
    row_h, gap = 20.0, 6.0
    plot_w = _WIDTH - _LABEL_W - _RIGHT_W
    scale = max(total_s, 1e-9)
    body: list[str] = []
    y = 4.0
    prev_end_x: float | None = None
    for p in pieces:
        x0 = _LABEL_W + (p.start_ts - origin) / scale * plot_w
        w = max(p.duration_s / scale * plot_w, 0.8)
        if p.bucket is None:
            name, color = f"{p.num_folded} short pieces", "#c8c8c8"
        else:
            name, color = bucket_label(p.bucket), BUCKET_COLORS[p.bucket]
        if prev_end_x is not None:
            body.append(
                f'<line x1="{_n(prev_end_x)}" x2="{_n(prev_end_x)}" y1="{_n(y - gap)}" y2="{_n(y)}" '
                'stroke="#888" stroke-dasharray="2 2"/>'
            )
        hover = (
            f"{name}: {fmt_exact_s(p.duration_s)} (+{p.start_ts - origin:.3f} s → +{p.end_ts - origin:.3f} s)"
        )
        body.append(_text(0, y + 14, name))
        body.append(_rect(x0, y, w, row_h, color, hover, bucket=p.bucket))
        body.append(_text(x0 + w + 6, y + 14, fmt_s(p.duration_s), fill="#444", extra=' font-size="11"'))
        prev_end_x = x0 + w
        y += row_h + gap
    body.append(
        f'<line x1="0" x2="{_n(_WIDTH)}" y1="{_n(y - gap / 2)}" y2="{_n(y - gap / 2)}" stroke="#ccc"/>'
    )
    body.append(_text(0, y + 14, total_label, extra=' font-weight="700"'))
    body.append(
        _rect(
            _LABEL_W,
            y,
            plot_w if total_s > 0 else 0.8,
            row_h,
            "#39424e",
            f"{total_label}: {fmt_exact_s(total_s)}",
        )
    )
    body.append(
        _text(
            _LABEL_W + plot_w + 6,
            y + 14,
            fmt_s(total_s),
            fill="#222",
            extra=' font-weight="700" font-size="12"',
        )
    )
    return _svg(y + row_h + 4, body, label=title)


def tts_waterfall_svg(report: EttReport) -> str | None:
    """The TTS as a waterfall: the timeline's pieces from its origin to the first training start, in
    order, then the total. None when no attempt trained."""
    window = tts_window(report)
    if window is None:
        return None
    origin, end = window
    pieces = fold_short(pieces_between(report, origin, end))
    return _waterfall(pieces, origin, end - origin, "time to start", f"time to start of {report.job_id}")


def phase_bars_svg(phases_s: Mapping[str, float]) -> str | None:
    """Raw phase durations (they may overlap), longest first, coloured by the bucket their phase maps to."""
    items = sorted(((name, s) for name, s in phases_s.items() if s > 0), key=lambda kv: (-kv[1], kv[0]))
    if not items:
        return None
    row_h = 18.0
    peak = items[0][1]
    plot_w = _WIDTH - _LABEL_W - _RIGHT_W
    body: list[str] = []
    for i, (name, seconds) in enumerate(items):
        y = 4 + i * row_h
        try:
            bucket = PHASE_BUCKET[Phase(name)]
        except ValueError:
            bucket = Bucket.OTHER
        color = "#b9c7d8" if bucket is None else BUCKET_COLORS[bucket]
        maps_to = "overlaps training (no bucket)" if bucket is None else bucket_label(bucket)
        w = max(seconds / peak * plot_w, 0.8)
        body.append(_text(0, y + 12, _clip_text(name.replace("_", " "), 26), extra=' font-size="11"'))
        body.append(_rect(_LABEL_W, y, w, row_h - 4, color, f"{name} → {maps_to}: {fmt_exact_s(seconds)}"))
        body.append(_text(_LABEL_W + w + 6, y + 12, fmt_s(seconds), fill="#444", extra=' font-size="11"'))
    return _svg(4 + len(items) * row_h, body, label="raw phase durations")


# -- time to recover --------------------------------------------------------------------------------------
def recoveries(report: EttReport) -> list[Recovery]:
    """The recovered failures behind `ttr_s`, as the report gives them (`EttReport.recoveries`)."""
    return list(report.recoveries)


def ttr_svg(report: EttReport) -> str | None:
    """One bar per recovered failure, split by bucket (restart, init, compile, restore, data wait...), on
    one scale. None when the job had nothing to recover from."""
    items = recoveries(report)
    if not items:
        return None
    row_h, gap = 20.0, 8.0
    plot_w = _WIDTH - _LABEL_W - _RIGHT_W
    peak = max(max(r.ttr_s for r in items), 1e-9)
    body: list[str] = []
    for i, r in enumerate(items):
        y = 4 + i * (row_h + gap)
        label = f"after #{r.failed.index} {r.failed.outcome.value}"
        body.append(_text(0, y + 14, label))
        x = _LABEL_W
        for p in pieces_between(report, r.detected_ts, r.training_start_ts):
            w = p.duration_s / peak * plot_w
            if p.bucket is None:  # pieces_between never folds; keeps the type checker honest
                continue
            hover = f"{label} · {bucket_label(p.bucket)}: {fmt_exact_s(p.duration_s)}"
            body.append(_rect(x, y, max(w, 0.5), row_h, BUCKET_COLORS[p.bucket], hover, bucket=p.bucket))
            x += w
        end_x = _LABEL_W + r.ttr_s / peak * plot_w
        body.append(_text(end_x + 6, y + 14, fmt_s(r.ttr_s), fill="#222", extra=' font-weight="600"'))
    return _svg(4 + len(items) * (row_h + gap), body, label=f"time to recover of {report.job_id}")
