"""The fleet dashboard: one self-contained HTML page (inline SVG, CSS and a tiny script; no network).

Shows the fleet headline, ETT% per job over time (regressions' first changed jobs ringed in red), ETT% per
day, stacked buckets of the fleet and of each family (GPU-weighted), lost GPU-hours by bucket, TTS and TTR
distributions, failures by cause, the regressions and the worst jobs.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

from ettr.atomic import atomic_write
from ettr.errors import UsageError
from ettr.events import Bucket
from ettr.fleet.aggregate import Distribution, FleetReport
from ettr.fleet.text import regression_line, step_speed_line
from ettr.report.charts import BUCKET_COLORS, esc, fmt_pct, fmt_s, share_bar_svg
from ettr.report.steptime import fmt_step

_W = 1000.0
_FONT = 'font-family="system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif"'
FAMILY_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22")
_CSS = """
body{margin:0;background:#f6f7f9;color:#222;font:14px/1.45 system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif}
main{max-width:1060px;margin:0 auto;padding:20px}
section{background:#fff;border:1px solid #e3e6ea;border-radius:6px;padding:14px 18px;margin:14px 0}
h1{font-size:22px;margin:4px 0 2px}h2{font-size:16px;margin:0 0 10px}
.headline{font-size:18px}.big{font-size:28px;font-weight:700;color:#2ca02c}
table{border-collapse:collapse;width:100%}td,th{padding:3px 8px;border-bottom:1px solid #eef0f3;text-align:right}
td:first-child,th:first-child,td.l{text-align:left}.bad{color:#d62728;font-weight:600}
svg.chart{width:100%;height:auto;display:block}.muted{color:#777}
.legend span{display:inline-block;margin:2px 10px 2px 0}.legend i{display:inline-block;width:11px;height:11px;margin-right:4px;vertical-align:-1px}
"""
_SCRIPT = """(function(){var root=document.documentElement;
var charts=document.querySelectorAll('svg.chart').length;root.setAttribute('data-ettr-charts',String(charts));
document.querySelectorAll('[data-ts]').forEach(function(el){var d=new Date(parseFloat(el.getAttribute('data-ts'))*1000);
el.setAttribute('title',d.toISOString());});root.setAttribute('data-ettr-script','ok');})();"""


def _regression_value(metric: str, value: float) -> str:
    """A regression's baseline or value: a step time as the step columns show it (often milliseconds)."""
    return fmt_step(value) if metric == "step_time_s" else f"{value:.2f}"


def _n(x: float) -> str:
    text = f"{x:.2f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def _svg(height: float, body: Sequence[str], label: str) -> str:
    return (
        f'<svg class="chart" viewBox="0 0 {_n(_W)} {_n(height)}" role="img" aria-label="{esc(label)}" '
        f'xmlns="http://www.w3.org/2000/svg" {_FONT} font-size="12">' + "".join(body) + "</svg>"
    )


def _family_colors(report: FleetReport) -> dict[str, str]:
    return {f: FAMILY_COLORS[i % len(FAMILY_COLORS)] for i, f in enumerate(report.families)}


def trend_svg(report: FleetReport) -> str:
    """ETT% of each job in order of start, one colour per family; regressions' first jobs ringed red."""
    jobs = report.jobs
    left, top, plot_w, plot_h = 50.0, 12.0, _W - 70.0, 220.0
    colors = _family_colors(report)
    flagged = {r.job_id for r in report.regressions}
    body = []
    for pct in (0, 25, 50, 75, 100):
        y = top + plot_h * (1 - pct / 100)
        body.append(
            f'<line x1="{_n(left)}" x2="{_n(left + plot_w)}" y1="{_n(y)}" y2="{_n(y)}" stroke="#e3e6ea"/>'
        )
        body.append(f'<text x="{_n(left - 6)}" y="{_n(y + 4)}" text-anchor="end" fill="#666">{pct}%</text>')
    step = plot_w / max(1, len(jobs) - 1) if len(jobs) > 1 else 0.0
    by_family: dict[str, list[tuple[float, float]]] = {}
    points = []
    for i, j in enumerate(jobs):
        x = left + (i * step if len(jobs) > 1 else plot_w / 2)
        if not j.ett_known:
            continue  # no training step seen: no point on an ETT chart
        y = top + plot_h * (1 - max(0.0, min(100.0, j.ett_pct)) / 100)
        by_family.setdefault(j.family, []).append((x, y))
        title = f"{j.label} ({j.family}): ETT {fmt_pct(j.ett_pct)}, wall {fmt_s(j.wall_s)}, {j.gpus} GPU(s)"
        ring = (
            f'<circle cx="{_n(x)}" cy="{_n(y)}" r="8" fill="none" stroke="#d62728" stroke-width="2" '
            'class="regression-mark"/>'
            if j.job_id in flagged
            else ""
        )
        points.append(
            f'{ring}<circle cx="{_n(x)}" cy="{_n(y)}" r="4" fill="{colors[j.family]}" class="job-point" '
            f'data-job="{esc(j.job_id)}"><title>{esc(title)}</title></circle>'
        )
    for family, pts in by_family.items():
        if len(pts) > 1:
            path = " ".join(f"{_n(x)},{_n(y)}" for x, y in pts)
            body.append(
                f'<polyline points="{path}" fill="none" stroke="{colors[family]}" stroke-opacity="0.5"/>'
            )
    body += points
    body.append(
        f'<text x="{_n(left)}" y="{_n(top + plot_h + 18)}" fill="#666">jobs in order of start →</text>'
    )
    return _svg(top + plot_h + 26, body, "ETT% per job over time")


def _share(pct: float, known: bool, unknown: str = "-") -> str:
    """A fleet share in %, or `unknown` when no job's ETT is known (0 of nothing is no measurement)."""
    return fmt_pct(pct) if known else unknown


def days_svg(report: FleetReport) -> str:
    """ETT% per UTC day (GPU-weighted), one bar per day."""
    days = list(report.days.items())
    left, top, plot_h = 50.0, 18.0, 140.0
    width = (_W - left - 10) / max(1, len(days))
    body = []
    for i, (day, t) in enumerate(days):
        ett = _share(t.ett_pct, t.ett_known, "unknown")  # and no bar for a day of jobs without a step
        h = plot_h * max(0.0, min(100.0, t.ett_pct)) / 100 if t.ett_known else 0.0
        x = left + i * width
        body.append(
            f'<rect x="{_n(x + 2)}" y="{_n(top + plot_h - h)}" width="{_n(max(1.0, width - 4))}" height="{_n(h)}" '
            f'fill="{BUCKET_COLORS[Bucket.EFFECTIVE_TRAINING]}"><title>{esc(f"{day}: ETT {ett}, {t.num_jobs} jobs")}'
            "</title></rect>"
        )
        if width >= 36:
            body.append(
                f'<text x="{_n(x + width / 2)}" y="{_n(top + plot_h - h - 4)}" text-anchor="middle" fill="#222" '
                f'font-size="11">{esc(ett)}</text>'
            )
        if width >= 60 or i % max(1, int(60 // max(width, 1))) == 0:
            body.append(
                f'<text x="{_n(x + width / 2)}" y="{_n(top + plot_h + 14)}" text-anchor="middle" fill="#666" '
                f'font-size="11">{esc(day)}</text>'
            )
    return _svg(top + plot_h + 20, body, "ETT% per day")


def histogram_svg(values: Sequence[float], label: str, color: str) -> str | None:
    """A histogram of durations (10 equal bins from 0 to the largest)."""
    if not values:
        return None
    peak = max(values)
    num_bins = 10
    width = peak / num_bins if peak > 0 else 1.0
    counts = [0] * num_bins
    for v in values:
        counts[min(num_bins - 1, int(v / width)) if width > 0 else 0] += 1
    left, top, plot_w, plot_h = 50.0, 10.0, _W - 70.0, 120.0
    most = max(counts)
    body = []
    for i, c in enumerate(counts):
        h = plot_h * c / most if most else 0.0
        x = left + i * plot_w / num_bins
        title = f"{fmt_s(i * width)} – {fmt_s((i + 1) * width)}: {c}"
        body.append(
            f'<rect x="{_n(x + 1)}" y="{_n(top + plot_h - h)}" width="{_n(plot_w / num_bins - 2)}" '
            f'height="{_n(h)}" fill="{color}"><title>{esc(title)}</title></rect>'
        )
        body.append(
            f'<text x="{_n(x + plot_w / num_bins / 2)}" y="{_n(top + plot_h + 14)}" text-anchor="middle" '
            f'fill="#666" font-size="11">{esc(fmt_s(i * width))}</text>'
        )
    return _svg(top + plot_h + 20, body, label)


def _dist(d: Distribution) -> str:
    return f"p50 {fmt_s(d.p50)} · p90 {fmt_s(d.p90)} · max {fmt_s(d.max)} · n={d.count}"


def _legend() -> str:
    return (
        '<div class="legend">'
        + "".join(
            f'<span><i style="background:{c}"></i>{esc(b.value)}</span>' for b, c in BUCKET_COLORS.items()
        )
        + "</div>"
    )


def render_html(report: FleetReport) -> str:
    """The whole dashboard as a string."""
    t = report.fleet
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>ettr fleet — {t.num_jobs} jobs</title><style>{_CSS}</style></head><body><main>",
        "<h1>ettr fleet</h1>",
        f'<section class="headline"><span class="big">ETT {_share(t.ett_pct, t.ett_known, "unknown")}</span> '
        f"&nbsp; idle {_share(t.idleness_pct, t.ett_known)} · failure {_share(t.failure_pct, t.ett_known)} · "
        f"{t.num_jobs} jobs · "
        f"{t.wall_gpu_s / 3600:.2f} GPU-hours (wall × GPUs) · {t.num_failures} failures · "
        f'<span class="{"bad" if report.regressions else ""}">{len(report.regressions)} regression(s)</span>'
        "</section>",
        "<section><h2>Where the GPU-hours went (fleet)</h2>",
        share_bar_svg(t.bucket_gpu_s, title_prefix="fleet · "),
        _legend(),
        "</section>",
        "<section><h2>ETT% per job over time</h2>",
        trend_svg(report),
        '<div class="legend">'
        + "".join(
            f'<span><i style="background:{c}"></i>{esc(f)}</span>' for f, c in _family_colors(report).items()
        )
        + '<span><i style="border:2px solid #d62728;border-radius:50%;background:none"></i>first job of a regression'
        "</span></div></section>",
        "<section><h2>ETT% per day (UTC)</h2>",
        days_svg(report),
        "</section>",
        "<section><h2>Buckets by family (share of wall time × GPUs)</h2><table>",
    ]
    for name, fam in report.families.items():
        parts.append(
            f'<tr><td class="l" style="width:180px">{esc(name)}<br><span class="muted">{fam.num_jobs} jobs, ETT '
            f"{_share(fam.ett_pct, fam.ett_known, 'unknown')}</span></td><td>"
            + share_bar_svg(fam.bucket_gpu_s, height=22, title_prefix=f"{name} · ")
            + "</td></tr>"
        )
    parts.append("</table></section>")
    parts.append("<section><h2>Lost GPU-hours by bucket (costliest first)</h2><table>")
    parts.append("<tr><th>bucket</th><th>GPU-hours</th></tr>")
    parts += [f"<tr><td>{esc(b.value)}</td><td>{h:.3f}</td></tr>" for b, h in report.costliest_buckets]
    parts.append("</table></section>")
    tts = histogram_svg([j.tts_s for j in report.jobs if j.tts_s is not None], "TTS distribution", "#3b6fb6")
    ttr = histogram_svg([x for j in report.jobs for x in j.ttr_s], "TTR distribution", "#f07f19")
    parts.append(f"<section><h2>Time to start</h2><p>{esc(_dist(t.tts))}</p>{tts or ''}</section>")
    kinds = "".join(
        f"<tr><td>{esc(kind)}</td><td>{d.count}</td><td>{esc(fmt_s(d.p50))}</td><td>{esc(fmt_s(d.max))}</td></tr>"
        for kind, d in t.ttr_by_kind.items()
    )
    by_kind = (
        f"<table><tr><th>recovery kind</th><th>recoveries</th><th>TTR p50</th><th>TTR max</th></tr>{kinds}</table>"
        if kinds
        else ""
    )
    parts.append(f"<section><h2>Time to recover</h2><p>{esc(_dist(t.ttr))}</p>{by_kind}{ttr or ''}</section>")
    parts.append(
        "<section><h2>Failures by cause</h2><table><tr><th>cause</th><th>NoF</th><th>TTR p50</th></tr>"
    )
    parts += [
        f"<tr><td>{esc(c.value)}</td><td>{n}</td><td>{esc(fmt_s(t.ttr_by_cause[c].p50))}</td></tr>"
        for c, n in t.failures_by_cause.items()
    ]
    parts.append("</table>")
    details = ", ".join(f"{d.value} {n}" for d, n in t.failures_by_detail.items() if n)
    if details:
        parts.append(f"<p>What happened: {esc(details)}</p>")
    parts.append("</section>")
    parts.append(f'<section id="regressions"><h2>Regressions ({len(report.regressions)})</h2>')
    if report.regressions:
        parts.append(
            "<table><tr><th>family</th><th>metric</th><th>baseline</th><th>value</th><th>first job</th></tr>"
        )
        parts += [
            f'<tr class="regression"><td>{esc(r.family)}</td><td class="l">{esc(r.metric)}</td>'
            f'<td>{_regression_value(r.metric, r.baseline)}</td><td class="bad">{_regression_value(r.metric, r.value)}</td>'
            f'<td class="l" data-ts="{r.first_job_start_ts!r}">{esc(r.label)}</td></tr>'
            for r in report.regressions
        ]
        parts.append("</table>")
        parts.append(
            '<p class="muted">' + "<br>".join(esc(regression_line(r)) for r in report.regressions) + "</p>"
        )
    else:
        parts.append("<p>None: every family is within its own noise.</p>")
    parts.append("</section>")
    with_stragglers = [j for j in report.jobs if j.stragglers]
    parts.append(f'<section id="stragglers"><h2>Jobs with stragglers ({len(with_stragglers)})</h2>')
    if with_stragglers:
        parts += [
            f"<p><b>{esc(j.label)}</b> ({esc(j.family)}): "
            + "<br>".join(esc(s) for s in j.stragglers or ())
            + "</p>"
            for j in with_stragglers
        ]
    else:
        unchecked = sum(1 for j in report.jobs if j.stragglers is None)
        parts.append(
            f"<p>None found (ranks not compared in {unchecked} job(s): one rank, or still running).</p>"
        )
    parts.append("</section>")
    parts.append(
        f'<section id="step-speed"><h2>Step speed ({len(report.step_speed)} job(s) off their family)</h2>'
    )
    if report.step_speed:
        parts.append(
            '<p class="muted">ETT% is a share of time: a job whose steps ran slower shows more effective '
            "training for the same work. These jobs' median step time is more than 10% off their family's.</p>"
        )
        parts.append("<p>" + "<br>".join(esc(step_speed_line(o)) for o in report.step_speed) + "</p>")
    else:
        parts.append("<p>None: every job's median step time is within 10% of its family's.</p>")
    parts.append("</section>")
    parts.append("<section><h2>Worst jobs (lowest ETT%)</h2><table>")
    parts.append(
        "<tr><th>job</th><th>family</th><th>ETT%</th><th>GPU-hours</th><th>failures</th><th>step</th></tr>"
    )
    parts += [
        f'<tr><td data-ts="{j.wall_start_ts!r}">{esc(j.label)}</td><td>{esc(j.family)}</td>'
        f"<td>{f'{j.ett_pct:.1f}' if j.ett_known else 'unknown'}</td><td>{j.gpu_s / 3600:.3f}</td><td>{j.num_failures}</td>"
        f"<td>{esc(fmt_step(j.step_time_s))}</td></tr>"
        for j in report.worst_jobs
    ]
    parts.append("</table></section>")
    parts.append(
        '<footer class="muted">Generated by ettr fleet from the run ledgers; hover for exact values.</footer>'
    )
    parts.append(f"</main><script>{_SCRIPT}</script></body></html>\n")
    return "\n".join(parts)


def write_html(report: FleetReport, path: str | os.PathLike[str]) -> None:
    """Write the dashboard to `path` (commit-last). Raises `UsageError` when it cannot be written."""
    if not math.isfinite(report.fleet.ett_pct):
        raise ValueError("the fleet report has no finite ETT")
    try:
        atomic_write(Path(path), render_html(report))
    except OSError as exc:
        raise UsageError(f"{path}: cannot write the fleet dashboard ({exc.strerror or exc})") from None
