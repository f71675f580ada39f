"""Charts of how a job started and recovered, for the HTML report: the time-to-start waterfall, the raw
phase durations and the time-to-recover bars. They draw the windows the report carries
(`EttReport.tts_window`, `EttReport.recoveries`) over its timeline; nothing is derived again here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ettr.accounting.model import EttReport, Recovery
from ettr.events import PHASE_BUCKET, Bucket, Phase
from ettr.report.svg import (
    BUCKET_COLORS,
    LABEL_W,
    RIGHT_W,
    WIDTH,
    bucket_label,
    clip_text,
    fmt_exact_s,
    fmt_num,
    fmt_s,
    rect_element,
    svg_element,
    text_element,
)


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
    plot_w = WIDTH - LABEL_W - RIGHT_W
    scale = max(total_s, 1e-9)
    body: list[str] = []
    y = 4.0
    prev_end_x: float | None = None
    for p in pieces:
        x0 = LABEL_W + (p.start_ts - origin) / scale * plot_w
        w = max(p.duration_s / scale * plot_w, 0.8)
        if p.bucket is None:
            name, color = f"{p.num_folded} short pieces", "#c8c8c8"
        else:
            name, color = bucket_label(p.bucket), BUCKET_COLORS[p.bucket]
        if prev_end_x is not None:
            body.append(
                f'<line x1="{fmt_num(prev_end_x)}" x2="{fmt_num(prev_end_x)}" y1="{fmt_num(y - gap)}" y2="{fmt_num(y)}" '
                'stroke="#888" stroke-dasharray="2 2"/>'
            )
        hover = (
            f"{name}: {fmt_exact_s(p.duration_s)} (+{p.start_ts - origin:.3f} s → +{p.end_ts - origin:.3f} s)"
        )
        body.append(text_element(0, y + 14, name))
        body.append(rect_element(x0, y, w, row_h, color, hover, bucket=p.bucket))
        body.append(
            text_element(x0 + w + 6, y + 14, fmt_s(p.duration_s), fill="#444", extra=' font-size="11"')
        )
        prev_end_x = x0 + w
        y += row_h + gap
    body.append(
        f'<line x1="0" x2="{fmt_num(WIDTH)}" y1="{fmt_num(y - gap / 2)}" y2="{fmt_num(y - gap / 2)}" stroke="#ccc"/>'
    )
    body.append(text_element(0, y + 14, total_label, extra=' font-weight="700"'))
    body.append(
        rect_element(
            LABEL_W,
            y,
            plot_w if total_s > 0 else 0.8,
            row_h,
            "#39424e",
            f"{total_label}: {fmt_exact_s(total_s)}",
        )
    )
    body.append(
        text_element(
            LABEL_W + plot_w + 6,
            y + 14,
            fmt_s(total_s),
            fill="#222",
            extra=' font-weight="700" font-size="12"',
        )
    )
    return svg_element(y + row_h + 4, body, label=title)


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
    plot_w = WIDTH - LABEL_W - RIGHT_W
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
        body.append(text_element(0, y + 12, clip_text(name.replace("_", " "), 26), extra=' font-size="11"'))
        body.append(
            rect_element(LABEL_W, y, w, row_h - 4, color, f"{name} → {maps_to}: {fmt_exact_s(seconds)}")
        )
        body.append(
            text_element(LABEL_W + w + 6, y + 12, fmt_s(seconds), fill="#444", extra=' font-size="11"')
        )
    return svg_element(4 + len(items) * row_h, body, label="raw phase durations")


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
    plot_w = WIDTH - LABEL_W - RIGHT_W
    peak = max(max(r.ttr_s for r in items), 1e-9)
    body: list[str] = []
    for i, r in enumerate(items):
        y = 4 + i * (row_h + gap)
        label = f"after #{r.failed.index} {r.failed.outcome.value}"
        body.append(text_element(0, y + 14, label))
        x = LABEL_W
        for p in pieces_between(report, r.detected_ts, r.training_start_ts):
            w = p.duration_s / peak * plot_w
            if p.bucket is None:  # pieces_between never folds; keeps the type checker honest
                continue
            hover = f"{label} · {bucket_label(p.bucket)}: {fmt_exact_s(p.duration_s)}"
            body.append(
                rect_element(x, y, max(w, 0.5), row_h, BUCKET_COLORS[p.bucket], hover, bucket=p.bucket)
            )
            x += w
        end_x = LABEL_W + r.ttr_s / peak * plot_w
        body.append(text_element(end_x + 6, y + 14, fmt_s(r.ttr_s), fill="#222", extra=' font-weight="600"'))
    return svg_element(4 + len(items) * (row_h + gap), body, label=f"time to recover of {report.job_id}")
