"""SVG charts of `EttReport`s for the HTML report, drawn server-side so the page needs no network: the
timeline of a job and where its wall time went (the time-to-start and time-to-recover charts are
`startup_charts`, the vocabulary `svg`).

Every chart function returns one `<svg>` element as a string, sized by its viewBox so that it scales with
the page; all text in it (labels and hover titles) is escaped. Output is a pure function of the reports: no
clock, no randomness, stable iteration order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from ettr.accounting import Loss, classify, counts_as_failure
from ettr.accounting.model import AttemptReport, EttReport
from ettr.events import Bucket
from ettr.report.svg import (
    BUCKET_COLORS,
    HATCH_ID,
    LABEL_W,
    OUTCOME_COLORS,
    RIGHT_W,
    WIDTH,
    bucket_label,
    clip_text,
    esc,
    fmt_exact_s,
    fmt_num,
    fmt_pct,
    fmt_s,
    rect_element,
    svg_element,
    text_element,
    time_axis,
)


# -- timeline ------------------------------------------------------------------------------------------------
def counts_as_recovery(bucket: Bucket, attempt_position: int) -> bool:
    """Time of a bucket that is idleness in the first attempt but failure in this one (recovery: the start-up
    of a later attempt, a requeued run's wait in the queue): the accounting's `classify` decides, so the
    picture cannot disagree with the numbers."""
    return (
        classify(bucket, attempt_position=0) is Loss.IDLENESS
        and classify(bucket, attempt_position=attempt_position) is Loss.FAILURE
    )


def _attempt_label(a: AttemptReport) -> str:
    code = "" if a.exit_code is None else f" ({a.exit_code})"
    return f"#{a.index} {a.outcome.value}{code}"


def failure_summary(a: AttemptReport, *, max_chars: int = 160) -> str:
    """One line on why an attempt did not complete, in words: `exit status 1 — ValueError: bad batch (rank 1)
    — injected crash@step=50 — OOM killer` (its ATTEMPT_END details and the process failure)."""
    failure = a.failure
    if not failure:
        return ""
    process = failure.get("process_failure")
    process = process if isinstance(process, Mapping) else {}
    parts = []
    exception = failure.get("exception") or process.get("exception")
    reason = str(failure.get("reason") or "")
    if exception and reason.endswith(f": {exception}"):  # `exit status 1: ValueError`: said in full below
        reason = reason[: -len(f": {exception}")]
    if reason:
        parts.append(reason)
    message = failure.get("message") or process.get("message")
    if exception:
        where = f" (rank {process['rank']})" if "rank" in process else ""
        parts.append(f"{exception}: {message}{where}" if message else f"{exception}{where}")
    if failure.get("signal") and str(failure["signal"]) not in " ".join(parts):
        parts.append(f"signal {failure['signal']}")
    if failure.get("injected"):
        parts.append(f"injected {failure['injected']}")
    if failure.get("oom"):
        parts.append("killed by the OOM killer")
    tail = failure.get("stderr_tail")
    if not exception and isinstance(tail, list) and tail:
        parts.append(f"last stderr line: {str(tail[-1]).strip()}")
    shown = {"reason", "exception", "message", "process_failure", "signal", "injected", "oom", "stderr_tail"}
    shown |= {"outcome", "exit_code", "hung_ranks", "ranks_at_kill"}  # the table's own; these end the reason
    shown |= {"signalled_ts", "rank_gone_ts"}  # instants the accounting uses, not words for people
    for key in sorted(set(failure) - shown):
        value = failure[key]
        if value not in (None, "", {}, [], False):
            parts.append(f"{key.replace('_', ' ')}: {value}")
    return clip_text(" — ".join(parts), max_chars)


def _thin(items: Sequence, limit: int) -> Sequence:
    """At most `limit` items, evenly spaced (markers beyond that are unreadable anyway)."""
    if len(items) <= limit:
        return items
    return [items[i * len(items) // limit] for i in range(limit)]


def timeline_svg(report: EttReport, *, scale_s: float | None = None) -> str:
    """The job on a time axis, one row per attempt, coloured by bucket.

    `scale_s` is the span the axis shows (several reports drawn with the same value share a scale); the
    default is the report's own wall time. Markers: ▼ at the end of an attempt that did not complete, ticks
    under a row for checkpoint commits, a thin bar below them per persist window (its title: the step
    slowdown inside it), ◆ above it for recompiles. Hatched: start-up time of later attempts.
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
    plot_w = WIDTH - LABEL_W - 20
    height = top + len(rows) * (row_h + gap) + 4

    def x(ts: float) -> float:
        return LABEL_W + (ts - origin) / scale * plot_w

    def y(attempt: int | None) -> float:
        return top + row_of.get(attempt, 0) * (row_h + gap)

    body = time_axis(LABEL_W, plot_w, scale, 14, 20, height - 4)
    for a in report.attempts:
        body.append(
            f'<rect x="{fmt_num(x(a.start_ts))}" y="{fmt_num(y(a.index) - 2)}" width="{fmt_num(max(0.0, x(a.end_ts) - x(a.start_ts)))}" '
            f'height="{fmt_num(row_h + 4)}" fill="none" stroke="#9aa3ad" stroke-dasharray="3 2"/>'
        )
        code = "no exit code" if a.exit_code is None else f"exit code {a.exit_code}"  # not "exit code None"
        title = (
            f"attempt {a.index}: {a.outcome.value}, {code}, {fmt_exact_s(a.duration_s)} "
            f"(+{a.start_ts - origin:.3f} s → +{a.end_ts - origin:.3f} s)"
        )
        if (detail := failure_summary(a)) != "":
            title += f"; {detail}"
        color = OUTCOME_COLORS[a.outcome]
        body.append(
            f'<g><title>{esc(title)}</title><rect x="0" y="{fmt_num(y(a.index))}" width="{fmt_num(LABEL_W - 8)}" '
            f'height="{fmt_num(row_h)}" fill="#fff" fill-opacity="0"/>'
            + text_element(6, y(a.index) + 15, _attempt_label(a), fill=color, extra=' font-weight="600"')
            + "</g>"
        )
    if None in row_of:
        body.append(text_element(6, y(None) + 15, "job", fill="#555", extra=' font-weight="600"'))
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
        body.append(rect_element(x0, y0, w, row_h, BUCKET_COLORS[seg.bucket], title, bucket=seg.bucket))
        if recovery:
            body.append(
                f'<rect x="{fmt_num(x0)}" y="{fmt_num(y0)}" width="{fmt_num(w)}" height="{fmt_num(row_h)}" '
                f'fill="url(#{HATCH_ID})" pointer-events="none"/>'
            )
    body.extend(_markers(report, x, y, row_of, row_h))
    return svg_element(height, body, label=f"timeline of {report.job_id}")


def _markers(
    report: EttReport,
    x: Callable[[float], float],
    y: Callable[[int | None], float],
    row_of: Mapping[int | None, int],
    row_h: float,
) -> list[str]:
    """▼ at the end of each attempt that failed, a tick per checkpoint commit, ◆ per recompile."""
    origin = report.wall_start_ts
    body: list[str] = []
    for a in report.attempts:
        if counts_as_failure(a.outcome):
            xe, ye = x(a.end_ts), y(a.index) - 3
            body.append(
                f'<path d="M{fmt_num(xe - 5)} {fmt_num(ye - 7)}h10l-5 7z" fill="{OUTCOME_COLORS[a.outcome]}">'
                f"<title>{esc(f'attempt {a.index} {a.outcome.value} at +{a.end_ts - origin:.3f} s')}</title></path>"
            )
    for c in _thin(report.checkpoint_commits, 400):
        yc = y(c.attempt if c.attempt in row_of else None) + row_h + 1
        title = f"checkpoint of step {c.step} committed at +{c.ts - origin:.3f} s" + (
            f" ({c.path})" if c.path else ""
        )
        body.append(
            f'<line x1="{fmt_num(x(c.ts))}" x2="{fmt_num(x(c.ts))}" y1="{fmt_num(yc)}" y2="{fmt_num(yc + 6)}" stroke="#1d3f73" '
            f'stroke-width="1.5"><title>{esc(title)}</title></line>'
        )
    body.extend(_persist_markers(report, x, y, row_of, row_h))
    for r in _thin(report.recompiles, 400):
        xr, yr = x(r.ts), y(r.attempt if r.attempt in row_of else None) - 5
        title = f"recompile at +{r.ts - origin:.3f} s (rank {r.rank}): {r.reason or 'no reason given'}"
        body.append(
            f'<path d="M{fmt_num(xr)} {fmt_num(yr - 4)}l4 4l-4 4l-4-4z" fill="{BUCKET_COLORS[Bucket.COMPILE]}" '
            f'stroke="#fff" stroke-width="0.8"><title>{esc(title)}</title></path>'
        )
    return body


def _persist_markers(
    report: EttReport,
    x: Callable[[float], float],
    y: Callable[[int | None], float],
    row_of: Mapping[int | None, int],
    row_h: float,
) -> list[str]:
    """A thin bar under the row for each persist window, its title the steps' inflation inside it; red from
    a 10% slowdown on, grey when unknown."""
    if report.slowdown is None:
        return []
    origin = report.wall_start_ts
    body = []
    for save in _thin(report.slowdown.saves, 400):
        yp = y(save.attempt if save.attempt in row_of else None) + row_h + 8
        if save.inflation is None:
            what, color = "step slowdown unknown (no steps measured)", "#9aa3ad"
        else:
            extra = f", {save.extra_s:.2f} s extra" if save.extra_s is not None else ""
            what = f"steps {save.inflation:.2f}x the steady step time ({save.num_steps} steps{extra})"
            color = "#c0392b" if save.inflation >= 1.10 else "#5b7fa6"
        title = f"checkpoint persist +{save.start_ts - origin:.3f} s → +{save.end_ts - origin:.3f} s: {what}"
        x0 = x(save.start_ts)
        body.append(
            f'<rect class="persist" x="{fmt_num(x0)}" y="{fmt_num(yp)}" width="{fmt_num(max(x(save.end_ts) - x0, 1.0))}" '
            f'height="3" fill="{color}"><title>{esc(title)}</title></rect>'
        )
    return body


# -- where the wall time went -----------------------------------------------------------------------------
def share_bar_svg(buckets_s: Mapping[Bucket, float], *, width: float = WIDTH, height: float = 30.0,
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
        body.append(rect_element(x, 0, max(w, 0.5), height, BUCKET_COLORS[bucket], title, bucket=bucket))
        if labels and w >= 42:
            dark = bucket in (
                Bucket.SCHEDULING,
                Bucket.DATA_WAIT,
                Bucket.OTHER,
                Bucket.HARDWARE_SETUP,
                Bucket.EVALUATION,
            )
            body.append(
                text_element(
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
        body.append(f'<rect width="{fmt_num(width)}" height="{fmt_num(height)}" fill="#eef0f3"/>')
    return svg_element(height, body, label="share of wall time by bucket", width=width)


def bucket_bars_svg(reports: Sequence[EttReport], names: Sequence[str]) -> str:
    """Seconds and % of wall time per bucket, one bar per report in each bucket's group, on one scale."""
    sub_h, group_gap = 16.0, 10.0
    many = len(reports) > 1
    peak = max((r.buckets_s[b] for r in reports for b in Bucket), default=0.0)
    plot_w = WIDTH - LABEL_W - RIGHT_W
    body: list[str] = []
    y = 4.0
    for bucket in Bucket:
        body.append(
            text_element(0, y + 12, bucket_label(bucket), fill="#222", extra=f' data-bucket="{bucket.value}"')
        )
        body.append(
            f'<rect x="{fmt_num(LABEL_W - 18)}" y="{fmt_num(y + 2)}" width="11" height="11" fill="{BUCKET_COLORS[bucket]}"/>'
        )
        for report, name in zip(reports, names, strict=True):
            seconds = report.buckets_s[bucket]
            w = seconds / peak * plot_w if peak > 0 else 0.0
            pct = report.bucket_pct(bucket)
            title = f"{name} · {bucket_label(bucket)}: {fmt_exact_s(seconds)} ({fmt_pct(pct)} of wall time)"
            if w > 0:
                body.append(
                    rect_element(
                        LABEL_W, y, max(w, 1.0), sub_h - 3, BUCKET_COLORS[bucket], title, bucket=bucket
                    )
                )
            value = f"{fmt_s(seconds)} · {fmt_pct(pct)}"
            label = f"{clip_text(name, 18)}: {value}" if many else value
            body.append(text_element(LABEL_W + w + 6, y + 11, label, fill="#444" if seconds > 0 else "#aaa",
                              extra=' font-size="11"'))  # fmt: skip
            y += sub_h
        y += group_gap
    return svg_element(y, body, label="seconds per bucket")
