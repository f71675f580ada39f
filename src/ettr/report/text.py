"""The terminal report of an `EttReport`, and several reports side by side.

Plain ASCII in fixed-width columns, so that it survives logs, CI output and copy-paste.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ettr.accounting import EttReport, counts_as_failure
from ettr.accounting.causes import count_by_cause, ttr_by_cause
from ettr.accounting.model import distinct_failures, distinct_saves
from ettr.events import Bucket, split_failure_message
from ettr.report import slow, steptime, ttr_parts, window
from ettr.report.slowdown import text_lines as slowdown_lines
from ettr.report.status import status
from ettr.report.svg import fmt_signed
from ettr.untrusted import one_line, printable

BAR_WIDTH = 40
"""Characters of a bar that stands for 100% of wall time."""


def summary_line(report: EttReport) -> str:
    """`ETT 83.1% | idle 12.0% | failure 4.9% | wall 612.3 s | TTS 41.2 s | TTR 30.1 s, 28.7 s | failures 2`"""
    ttr = ", ".join(f"{t:.1f} s" for t in report.ttr_s) if report.ttr_s else "-"
    if report.ett_unknown is not None:  # no step seen: 0% would be a wrong number, not a measurement
        shares = f"ETT unknown (no training step seen) | idle - | failure {report.failure_pct:.1f}%"
    else:
        shares = (
            f"ETT {report.ett_pct:.1f}% | idle {report.idleness_pct:.1f}% | failure {report.failure_pct:.1f}%"
        )
    return (
        f"{shares} | "
        f"wall {report.wall_s:.1f} s | TTS {_seconds(report.tts_s)} | TTR {ttr} | failures {report.num_failures}"
    )


def causes_line(report: EttReport) -> str:
    """`failures by cause (NoF, mean TTR): infra 1 (12.3 s) | user 1 (-)`: the causes that occurred."""
    counts, ttrs = count_by_cause(report.failures), ttr_by_cause(report.failures)
    parts = [
        f"{cause.value} {n} ({_seconds(sum(ttrs[cause]) / len(ttrs[cause]) if ttrs[cause] else None)})"
        for cause, n in counts.items()
        if n
    ]
    return "failures by cause (NoF, mean TTR): " + (" | ".join(parts) if parts else "none")


def render(report: EttReport, *, per_save: bool = False) -> str:
    """The readable report of one job: summary line, buckets with bars, attempts, raw phase durations,
    and the step slowdown while persisting (per save when `per_save` or when it is large)."""
    title = (
        f"job {one_line(report.job_id)}" if report.job_id else "job"
    )  # (a directory's name, when none recorded)
    where = status(report)
    if where is not None:
        title += f"  ({where})"
    lines = [title, summary_line(report)]
    windowed = window.line(report)
    if windowed is not None:
        lines.append(windowed)
    lines += [f"step time: {steptime.summary(report.step_time)}", *slow.text_lines(report), ""]
    if report.num_fenced_events:
        lines[-1:-1] = [
            f"note: {report.num_fenced_events} event(s) recorded by training processes after their attempt "
            "had ended (orphaned processes) are not counted"
        ]

    lines.append(f"{'bucket':<22}{'seconds':>11}{'%':>8}")
    for bucket in Bucket:
        seconds, pct = report.buckets_s[bucket], report.bucket_pct(bucket)
        lines.append(f"  {bucket.value:<20}{seconds:>11.1f}{pct:>7.1f}%  {_bar(pct)}".rstrip())
    lines.append(
        f"  {'total (wall)':<20}{sum(report.buckets_s.values()):>11.1f}{100.0 if report.wall_s else 0.0:>7.1f}%"
    )

    lines += ["", "attempts (start offset from wall start)"]
    header = (
        "#",
        "outcome",
        "exit",
        "start_s",
        "duration_s",
        "resumed_from",
        "last_step",
        "lost_steps",
        "step_s",
        "step_p90_s",
    )
    rows = [
        (
            str(a.index),
            a.outcome.value + (" (open)" if a.closed_by_accounting and counts_as_failure(a.outcome) else ""),
            _dash(a.exit_code),
            f"{a.start_ts - report.wall_start_ts:.1f}",
            f"{a.duration_s:.1f}",
            "unknown" if a.resumed_step_unknown else _dash(a.resumed_from_step),
            "unknown" if a.resumed_step_unknown else _dash(a.last_step),
            f"~{a.lost_steps}" if a.lost_steps_estimated else str(a.lost_steps),
            _step_s(a.step_time.median_s),
            _step_s(a.step_time.p90_s),
        )
        for a in report.attempts
    ]
    lines += _table(header, rows, indent="  ", left=frozenset({1})) if rows else ["  (no attempt recorded)"]
    lost = {f.attempt for f in report.failures if f.detail.value == "node_lost"}
    for a in report.attempts:
        if a.failure:
            lines += _failure_lines(a.index, a.outcome.value, a.failure, after_loss=a.index in lost)
        if a.resumed_step_unknown:
            lines.append(
                f"  attempt {a.index} resumed from an unknown step: {a.resumed_step_unknown}; '~' lost steps"
                " are estimated from the latest checkpoint committed before it (a lower bound when it loaded"
                " one of the job's checkpoints)"
            )
    lines += ttr_parts.text_lines(report)
    if report.failures:
        lines += ["", causes_line(report)]
        lines += [
            f"  attempt {f.attempt}: {f.cause.value} ({f.detail.value}): {f.evidence}"
            for f in report.failures
        ]

    lines += ["", "phases (reference rank, raw seconds; they may overlap)"]
    if report.phases_s:
        lines += [f"  {name:<22}{seconds:>11.1f}" for name, seconds in report.phases_s.items()]
    else:
        lines.append("  (no phase recorded)")
    if report.recompiles or report.checkpoint_commits:
        lines.append("")
        saves = distinct_saves(report.checkpoint_commits)  # one per save, not one per rank's file
        steps = [c.step for c in saves if c.step is not None]
        last = f" (last step {max(steps)})" if steps else ""
        lines.append(f"checkpoint commits {len(saves)}{last} | recompiles {len(report.recompiles)}")
    if report.checkpoint_errors:
        failed = distinct_failures(report.checkpoint_errors)  # one per save, not one per rank that saw it
        lines.append(f"checkpoint errors {len(failed)}:")
        for f in failed[-5:]:
            c = f.first
            lines.append(f"  step {c.step} (attempt {c.attempt}, {f.ranks_text}): {c.error}")
        if len(failed) > 5:
            lines.append(f"  ... and {len(failed) - 5} earlier")
    slowdown = slowdown_lines(report.slowdown, wall_start_ts=report.wall_start_ts, per_save=per_save)
    if slowdown:
        lines += ["", *slowdown]
    return printable("\n".join(lines) + "\n")


def render_comparison(reports: Sequence[EttReport], *, labels: Sequence[str] | None = None) -> str:
    """Several reports side by side: ETT %, idleness, failure, wall, TTS, mean TTR, failures, the time per
    kept step (median, p90) and every bucket (seconds and % of wall). With exactly two reports a last column
    gives the change (second minus first; relative for step times). `labels` name the columns (default: job
    ids). A warning follows for each run whose median step time differs from the first's by more than 10%."""
    if labels is None:
        labels = [r.job_id or f"#{i}" for i, r in enumerate(reports)]
    if len(labels) != len(reports):
        raise ValueError(f"{len(labels)} labels for {len(reports)} reports")
    with_delta = len(reports) == 2

    metrics: list[tuple[str, list[float | None], str]] = [
        ("ETT %", [r.measured_ett_pct for r in reports], "{:.1f}"),
        ("idleness %", [r.measured_idleness_pct for r in reports], "{:.1f}"),
        ("failure %", [r.failure_pct for r in reports], "{:.1f}"),
        ("wall s", [r.wall_s for r in reports], "{:.1f}"),
        ("TTS s", [r.tts_s for r in reports], "{:.1f}"),
        ("mean TTR s", [r.mean_ttr_s for r in reports], "{:.1f}"),
        ("failures", [float(r.num_failures) for r in reports], "{:.0f}"),
    ]
    header = ("", *labels, *(("change",) if with_delta else ()))
    rows = []
    for name, values, fmt in metrics:
        cells = [("-" if v is None else fmt.format(v)) for v in values]
        rows.append((name, *cells, *((_delta(values, fmt),) if with_delta else ())))
    speeds = [
        ("step time median", [r.step_time.median_s for r in reports]),
        ("step time p90", [r.step_time.p90_s for r in reports]),
        ("training per kept step", [r.training_per_kept_step_s for r in reports]),
    ]
    for name, step_values in speeds:
        cells = [steptime.fmt_step(v) for v in step_values]
        change = (steptime.fmt_change(*step_values),) if with_delta else ()
        rows.append((name, *cells, *change))
    rows.append(("kept steps", *(str(r.num_kept_steps) for r in reports), *(("",) if with_delta else ())))
    rows.append(("buckets: seconds (% of wall)", *([""] * (len(header) - 1))))
    for bucket in Bucket:
        values = [r.buckets_s[bucket] for r in reports]
        cells = [f"{v:.1f} ({r.bucket_pct(bucket):.1f}%)" for v, r in zip(values, reports, strict=True)]
        rows.append((f"  {bucket.value}", *cells, *((_delta(values, "{:.1f}"),) if with_delta else ())))
    warnings = steptime.speed_warnings(list(labels), reports)
    return printable("\n".join([*_table(header, rows, indent=""), *warnings]) + "\n")


def _table(
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    indent: str,
    left: frozenset[int] = frozenset({0}),
) -> list[str]:
    """Fixed-width columns: those in `left` aligned left (text), the others right (numbers); a cell is one line
    whatever it holds (`untrusted.one_line`)."""
    header, rows = [one_line(str(c)) for c in header], [[one_line(str(c)) for c in row] for row in rows]
    widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        cells = [
            f"{cell:<{width}}" if i in left else f"{cell:>{width}}"
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        return (indent + "  ".join(cells)).rstrip()

    return [line(header), *(line(row) for row in rows)]


def _bar(pct: float) -> str:
    width = round(pct / 100.0 * BAR_WIDTH)
    return "#" * width if width > 0 else ("." if pct > 0 else "")


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def _step_s(value: float | None) -> str:
    """Seconds per step for a table column: `0.049`, `1.000`, `12.3`, `0.00012` (a step under 0.5 ms, which
    three decimals showed as `0.000`); `-` when unknown."""
    if value is None:
        return "-"
    if 0 < value < 0.0005:
        return f"{value:.2g}"
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


def _dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _delta(values: Sequence[float | None], fmt: str) -> str:
    first, second = values
    if first is None or second is None:
        return "-"
    return fmt_signed(second - first, digits=int(fmt.split(".")[1][0]) if "." in fmt else 0)


# (`hung_ranks` and `ranks_at_kill` are at the end of the reason already; `signalled_ts` and `rank_gone_ts` are
# instants the accounting uses, seen in the buckets and the TTR parts, not Unix times for people)
_SHOWN_FAILURE_KEYS = (
    "exception",
    "message",
    "stderr_tail",
    "reason",
    "process_failure",
    "injected",
    "hung_ranks",
    "ranks_at_kill",
    "signalled_ts",
    "rank_gone_ts",
)


def _failure_lines(
    index: int, outcome: str, failure: Mapping[str, Any], num_tail: int = 3, *, after_loss: bool = False
) -> list[str]:
    """`attempt 1 failed: exit status 1` / `ValueError: bad batch` / the last stderr lines / the rest.
    `after_loss`: the attempt's cause is a lost supervisor (node_lost): a rank's exception, where the attempt's
    end named none, is what the loss did to a survivor (its peer's connection gone), said so."""
    process = failure.get("process_failure")
    # The first FAILURE any rank recorded, where the supervisor named no exception: not where a signal ended
    # the attempt (a rank SIGKILLed: its peers' "Connection closed by peer" came after, the consequence).
    process = process if isinstance(process, Mapping) and not failure.get("signal") else {}
    exception = failure.get("exception") or process.get("exception")
    message = failure.get("message") or process.get("message")
    reason = failure.get("reason")
    lines = [f"  attempt {index} {outcome}: {reason}" if reason else f"  attempt {index} {outcome}"]
    if exception:
        where = f" (rank {process['rank']})" if "rank" in process else ""
        if outcome == "preempted" and "forwarded to the job" in str(reason) and not failure.get("injected"):
            # A scheduler's SIGTERM that ettr forwarded: a rank's exception is what the stop did to it (Lightning
            # behind a wrapper: `RuntimeError: ... Connection reset by peer` under the preemption, unexplained).
            rank = process.get("rank")
            where = f" ({'' if rank is None else f'rank {rank}, '}during the preemption: its consequence, not the cause)"
        elif outcome == "hung":
            # ettr stopped the hung job: what its processes raised then (torch elastic's `SignalException:
            # Process N got signal: 15` of a launcher, fabric run behind bash) read as the hang's own exception.
            rank = process.get("rank")
            where = f" ({'' if rank is None else f'rank {rank}, '}after ettr stopped the hung job: its consequence)"
        elif after_loss and not failure.get("exception") and process.get("exception"):
            # Two nodes, node 0's supervisor SIGKILLed: the report printed node 1's rank's "Connection reset
            # by peer" as the attempt's exception, with no word that it came after the loss.
            where = f" (rank {process.get('rank', '?')}, after the loss: its consequence, not the cause)"
        notes: list[str] = []
        if isinstance(message, str):
            message, notes = split_failure_message(message)  # ettr's notes: lines of their own, below
        lines.append(f"    {exception}: {message}{where}" if message else f"    {exception}{where}")
        lines.extend(f"    {note}" for note in notes)
    tail = failure.get("stderr_tail")
    if isinstance(tail, list) and tail:
        lines.append("    last stderr lines:")
        lines += [f"      {str(line)[:200]}" for line in tail[-num_tail:]]
    rest = {
        k: v for k, v in failure.items() if k not in _SHOWN_FAILURE_KEYS and v not in (None, False, [], "")
    }
    if rest:
        lines.append(f"    {_compact(rest)}")
    return lines


def _compact(data: Mapping[str, Any], limit: int = 160) -> str:
    parts = []
    for key, value in data.items():
        if value is None:
            continue
        shown = _compact(value, limit) if isinstance(value, Mapping) else str(value)
        parts.append(f"{key}={{{shown}}}" if isinstance(value, Mapping) else f"{key}={shown}")
    text = ", ".join(parts)
    return text if len(text) <= limit else text[: limit - 3] + "..."
