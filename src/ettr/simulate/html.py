"""The HTML page of `ettr simulate --html FILE`: one self-contained page (inline SVG and CSS, no network).

It draws what the command computed: the bucket share of each simulated job or policy (the report's own
colours), the measured job beside its replay, the ETT% of a sweep with its 95% interval and the optimum,
and the fleet experiment's two policies. Written with `ettr.atomic.atomic_write`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ettr.atomic import atomic_write
from ettr.errors import UsageError
from ettr.events import Bucket
from ettr.report.charts import share_bar_svg
from ettr.report.svg import BUCKET_COLORS, bucket_label, esc, svg_defs
from ettr.simulate.summary import Summary
from ettr.simulate.sweep import Sweep

_ASSETS = Path(__file__).resolve().parent.parent / "report"  # the report's stylesheet
_W, _H, _PAD = 900.0, 320.0, 50.0


def _legend() -> str:
    items = "".join(
        f'<span style="display:inline-block;margin-right:12px"><span style="display:inline-block;width:10px;'
        f'height:10px;background:{BUCKET_COLORS[b]}"></span> {esc(bucket_label(b))}</span>'
        for b in Bucket
    )
    return f'<p class="note">{items}</p>'


def _bars(rows: Sequence[tuple[str, Mapping[str, float]]]) -> str:
    out = []
    for name, buckets_s in rows:
        by_bucket = {b: float(buckets_s.get(b.value, 0.0)) for b in Bucket}
        out.append(f"<h3>{esc(name)}</h3>{share_bar_svg(by_bucket, title_prefix=name + ': ')}")
    return "".join(out)


def _sweep_svg(sweep: Sweep) -> str:
    xs = [p.value for p in sweep.points]
    lows = [p.summary.ett_pct_ci95[0] for p in sweep.points]
    highs = [p.summary.ett_pct_ci95[1] for p in sweep.points]
    means = [p.summary.ett_pct for p in sweep.points]
    y_lo, y_hi = min(lows), max(highs)
    if y_hi - y_lo < 1e-9:
        y_lo, y_hi = y_lo - 1, y_hi + 1
    x_lo, x_hi = min(xs), max(xs)
    log = x_lo > 0 and x_hi / x_lo > 8  # geometric sweeps read best on a log axis
    scale = math.log if log else float
    span = scale(x_hi) - scale(x_lo) or 1.0

    def x(v: float) -> float:
        return _PAD + (scale(v) - scale(x_lo)) / span * (_W - 2 * _PAD)

    def y(v: float) -> float:
        return _H - _PAD - (v - y_lo) / (y_hi - y_lo) * (_H - 2 * _PAD)

    band = " ".join(f"{x(v):.1f},{y(h):.1f}" for v, h in zip(xs, highs, strict=True))
    band += " " + " ".join(
        f"{x(v):.1f},{y(lo):.1f}" for v, lo in zip(reversed(xs), reversed(lows), strict=True)
    )
    line = " ".join(f"{x(v):.1f},{y(m):.1f}" for v, m in zip(xs, means, strict=True))
    unit = "s" if sweep.name == "interval" else "GPUs"
    parts = [
        f'<svg viewBox="0 0 {_W:.0f} {_H:.0f}" width="100%" role="img" aria-label="ETT by {esc(sweep.name)}">',
        f'<polygon points="{band}" fill="#9ec5fe" opacity="0.5"><title>95% CI of the mean</title></polygon>',
        f'<polyline points="{line}" fill="none" stroke="#1d3f73" stroke-width="2"/>',
    ]
    for v, m in zip(xs, means, strict=True):
        parts.append(
            f'<circle cx="{x(v):.1f}" cy="{y(m):.1f}" r="3" fill="#1d3f73"><title>{v:.6g} {unit}: '
            f"ETT {m:.2f}%</title></circle>"
        )
    marks = [("best", sweep.best.value, "#198754")]
    if sweep.optimum_interval_s is not None:
        marks.append(("model optimum", sweep.optimum_interval_s, "#d63384"))
    for label, v, color in marks:
        if x_lo <= v <= x_hi:
            parts.append(
                f'<line x1="{x(v):.1f}" x2="{x(v):.1f}" y1="{_PAD:.0f}" y2="{_H - _PAD:.0f}" stroke="{color}" '
                f'stroke-dasharray="4 3"><title>{esc(label)}: {v:.6g} {unit}</title></line>'
            )
    parts.append(
        f'<text x="{_PAD:.0f}" y="{_H - 12:.0f}" font-size="12">{x_lo:.6g} {unit}</text>'
        f'<text x="{_W - _PAD:.0f}" y="{_H - 12:.0f}" font-size="12" text-anchor="end">{x_hi:.6g} {unit}</text>'
        f'<text x="4" y="{_PAD - 8:.0f}" font-size="12">ETT % ({y_lo:.2f} to {y_hi:.2f})'
        + ("; log scale" if log else "")
        + "</text></svg>"
    )
    return "".join(parts)


def _fleet_table(result: Mapping[str, Any]) -> str:
    rows = "".join(
        f"<tr><td>{esc(name)}</td><td>{r['ett_pct']:.2f}</td><td>{r['ett_pct_ci95'][0]:.2f}-"
        f"{r['ett_pct_ci95'][1]:.2f}</td><td>{r['lost_gpu_hours']:.0f}</td>"
        f"<td>{r['num_preemptions_mean']:.1f}</td></tr>"
        for name, r in result["policies"].items()
    )
    return (
        "<table><tr><th>victims</th><th>fleet ETT %</th><th>95% CI</th><th>lost GPU-hours</th>"
        f"<th>preemptions</th></tr>{rows}</table>"
    )


def render_simulate_html(
    *,
    title: str,
    summaries: Sequence[tuple[str, Summary]] = (),
    sweep: Sweep | None = None,
    measured: Mapping[str, float] | None = None,
    fleet: Mapping[str, Any] | None = None,
) -> str:
    """The page as a string; only the sections given are drawn."""
    body = [f"<header><h1>{esc(title)}</h1></header>"]
    if summaries:
        rows: list[tuple[str, Mapping[str, float]]] = [(n, s.buckets_s) for n, s in summaries]
        if measured is not None:
            rows.append(("measured (the run directory)", measured))
        heads = "".join(
            f"<tr><td>{esc(n)}</td><td>{s.ett_pct:.2f}</td><td>{s.ett_pct_ci95[0]:.2f}-{s.ett_pct_ci95[1]:.2f}</td>"
            f"<td>{s.num_failures_mean:.2f}</td><td>{s.interval_s:.0f}</td></tr>"
            for n, s in summaries
        )
        body.append(
            "<section><h2>ETT</h2><table><tr><th></th><th>ETT %</th><th>95% CI</th><th>failures</th>"
            f"<th>interval s</th></tr>{heads}</table></section>"
        )
        body.append(f"<section><h2>Where the wall time goes</h2>{_legend()}{_bars(rows)}</section>")
    if sweep is not None:
        body.append(
            f"<section><h2>ETT by {esc(sweep.name)}</h2>{_sweep_svg(sweep)}"
            f'<p class="note">Line: mean over runs; band: 95% CI of the mean; green: best point; pink: the '
            f"model's closed-form optimum.</p></section>"
        )
    if fleet is not None:
        body.append(f"<section><h2>Fleet experiment</h2>{_fleet_table(fleet)}</section>")
    css = (_ASSETS / "html.css").read_text(encoding="utf-8")
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en"><head><meta charset="utf-8">',
            f"<title>{esc(title)}</title><style>{css}</style></head><body>",
            svg_defs(),
            "<main>",
            *body,
            "<footer>Generated by ettr simulate (a model; see docs/simulate.md).</footer>",
            "</main></body></html>",
            "",
        ]
    )


def write_simulate_html(path: str | os.PathLike[str], **sections: Any) -> None:
    """Write the page to `path` whole or not at all. Raises `UsageError` when it cannot be written."""
    text = render_simulate_html(**sections)
    try:
        atomic_write(path, text)
    except OSError as exc:
        raise UsageError(
            f"ettr simulate: {path}: cannot write the HTML page ({exc.strerror or exc})"
        ) from None
