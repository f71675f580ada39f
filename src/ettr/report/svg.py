"""The SVG vocabulary of the HTML report's charts: the fixed palette, formatting, primitives and the time axis.

Each bucket has one fixed colour (`BUCKET_COLORS`) in every chart and every report, so that a reader learns
the legend once. All text is escaped (`esc`); everything is a pure function of its arguments.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Mapping
from types import MappingProxyType

from ettr.constants import SECONDS_PER_DAY
from ettr.events import Bucket, Outcome
from ettr.untrusted import printable

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
        # Evaluation: idleness too, but work the job asked for (olive, apart from the start-up blues).
        Bucket.EVALUATION: "#bcbd22",
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
        Outcome.RUNNING: "#1f77b4",
        Outcome.UNKNOWN: "#8a5a00",
    }
)

HATCH_ID = "ettr-hatch"
"""Id of the hatch pattern (defined once per page by `svg_defs`) that marks start-up time of later
attempts, which counts to failure rather than idleness."""

WIDTH = 1000.0
LABEL_W = 170.0
RIGHT_W = 150.0
FONT = 'font-family="system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif"'
_NICE_STEPS_S = (
    *(m * 10.0**e for e in range(-3, 1) for m in (1, 2, 5)),
    10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400,
)  # fmt: skip


# -- formatting --------------------------------------------------------------------------------------------
def esc(value: object) -> str:
    """`value` as text safe inside HTML/SVG elements and double- or single-quoted attributes. Characters that
    are not printable are written as their escapes (`printable`, as the text report does): a job's words (an
    exception message, a family name, a forged ledger's) may hold a terminal escape, which `cat report.html`
    would play and which is not a character XML allows (an SVG cut out of the page would not parse)."""
    return html.escape(printable(str(value)), quote=True)


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


def fmt_signed(change: float, digits: int = 1) -> str:
    """A change with its sign, never `-0.0`: what rounds to zero reads `+0.0` (`-0.04` is no loss)."""
    rounded = round(change, digits)
    return f"{rounded + 0.0 if rounded else 0.0:+.{digits}f}"


def bucket_label(bucket: Bucket) -> str:
    return bucket.value.replace("_", " ")


def fmt_num(x: float) -> str:
    """A coordinate: two decimals, trailing zeros dropped (short and deterministic)."""
    text = f"{x:.2f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def clip_text(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[: max_chars - 1] + "…"


def svg_element(height: float, body: Iterable[str], *, label: str, width: float = WIDTH) -> str:
    return (
        f'<svg class="chart" viewBox="0 0 {fmt_num(width)} {fmt_num(height)}" role="img" aria-label="{esc(label)}" '
        f'xmlns="http://www.w3.org/2000/svg" {FONT} font-size="12">' + "".join(body) + "</svg>"
    )


def rect_element(
    x: float, y: float, w: float, h: float, fill: str, title: str, *, bucket: Bucket | None = None
) -> str:
    data = f' class="seg" data-bucket="{bucket.value}"' if bucket is not None else ""
    return (
        f'<rect x="{fmt_num(x)}" y="{fmt_num(y)}" width="{fmt_num(w)}" height="{fmt_num(h)}" fill="{fill}"{data}>'
        f"<title>{esc(title)}</title></rect>"
    )


def text_element(
    x: float, y: float, text: str, *, anchor: str = "start", fill: str = "#222", extra: str = ""
) -> str:
    return f'<text x="{fmt_num(x)}" y="{fmt_num(y)}" text-anchor="{anchor}" fill="{fill}"{extra}>{esc(text)}</text>'


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


def time_axis(
    x0: float, plot_w: float, scale_s: float, y_label: float, y_top: float, y_bottom: float
) -> list[str]:
    step = nice_step_s(scale_s)
    out = []
    num_ticks = int(scale_s / step + 1e-9)
    for i in range(num_ticks + 1):
        t = i * step
        x = x0 + t / scale_s * plot_w
        out.append(
            f'<line x1="{fmt_num(x)}" x2="{fmt_num(x)}" y1="{fmt_num(y_top)}" y2="{fmt_num(y_bottom)}" stroke="#e3e6ea"/>'
        )
        out.append(
            text_element(x, y_label, fmt_tick(t, step), anchor="middle", fill="#666", extra=' font-size="11"')
        )
    return out
