"""Terminal tables of `ettr simulate`: one job, a sweep, a policy comparison, a replay, the fleet."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ettr.events import Bucket
from ettr.simulate.summary import Summary
from ettr.simulate.sweep import Sweep


def _dur(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds >= 86_400:
        return f"{seconds / 86_400:.2f} d"
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.2f} s"


def _ci_note(s: Summary) -> list[str]:
    if s.ett_ci_method != "bound":
        return []
    return [
        f"  (the CI is a bound: {s.interrupted_runs} of {s.num_runs} runs saw a failure, too few to estimate "
        "what one costs; more --runs narrow it)"
    ]


def render_summary(s: Summary, *, title: str) -> str:
    lo, hi = s.ett_pct_ci95
    band_lo, band_hi = s.ett_pct_p95_band
    lines = [
        title,
        f"  ETT {s.ett_pct:.2f}%  (95% CI of the mean {lo:.2f}-{hi:.2f}; 95% of runs {band_lo:.2f}-{band_hi:.2f};"
        f" {s.num_runs} run{'s' if s.num_runs != 1 else ''})",
        *_ci_note(s),
        f"  checkpoint interval {_dur(s.interval_s)}; {s.gpus} GPUs; wall {_dur(s.wall_s)}; "
        f"failures {s.num_failures_mean:.2f} (of which preemptions {s.num_preemptions_mean:.2f}); "
        f"TTS {_dur(s.tts_s_mean)}; mean TTR {_dur(s.mean_ttr_s)}",
        "  bucket                 mean s per run  mean % of wall",
    ]
    for b in Bucket:
        lines.append(f"  {b.value:24s} {s.buckets_s[b.value]:12.1f}  {s.buckets_pct[b.value]:13.2f}%")
    lines.append(
        "  (mean s: averaged over the runs; mean %: each run's share of its own wall time, averaged)"
    )
    return "\n".join(lines)


def render_sweep(sweep: Sweep) -> str:
    best = sweep.best
    head = "interval" if sweep.name == "interval" else "GPUs"
    lines = [f"  {head:>12s}   ETT %   95% CI          wasted %  failures", "  " + "-" * 62]
    for p in sweep.points:
        s = p.summary
        value = _dur(p.value) if sweep.name == "interval" else f"{int(p.value):d}"
        mark = "  <- best" if p is best else ""
        lines.append(
            f"  {value:>12s}  {s.ett_pct:6.2f}  {s.ett_pct_ci95[0]:6.2f}-{s.ett_pct_ci95[1]:6.2f}"
            f"  {100 - s.ett_pct:8.2f}  {s.num_failures_mean:8.2f}{mark}"
        )
    if sweep.name == "interval":
        lines.append(f"  best simulated interval: {_dur(best.value)} (ETT {best.summary.ett_pct:.2f}%)")
        if sweep.optimum_interval_s is not None:
            lines.append(
                f"  model optimum (closed form, exponential failures): {_dur(sweep.optimum_interval_s)}"
            )
        if sweep.fitted_optimum_interval_s is not None:
            lines.append(
                f"  minimum of the curve fitted to the sweep: {_dur(sweep.fitted_optimum_interval_s)}"
            )
    else:
        lines.append(f"  best ETT at {int(best.value)} GPUs ({best.summary.ett_pct:.2f}%)")
    return "\n".join(lines)


def render_policies(rows: Sequence[tuple[str, Summary]], skipped: Sequence[str]) -> str:
    base = rows[0][1].ett_pct
    lines = [
        "  policy                    ETT %   95% CI          vs given  interval   failures",
        "  " + "-" * 78,
    ]
    for name, s in rows:
        lines.append(
            f"  {name:24s} {s.ett_pct:6.2f}  {s.ett_pct_ci95[0]:6.2f}-{s.ett_pct_ci95[1]:6.2f}"
            f"  {s.ett_pct - base:+8.2f}  {_dur(s.interval_s):>9s}  {s.num_failures_mean:8.2f}"
        )
    lines += [f"  not compared: {line}" for line in skipped]
    return "\n".join(lines)


def render_replay(predicted: Summary, measured_ett: float, measured_pct: dict[str, float]) -> str:
    lines = [
        f"  ETT                     predicted {predicted.ett_pct:6.2f}%  measured {measured_ett:6.2f}%"
        f"  ({predicted.ett_pct - measured_ett:+.2f} points)",
        "  bucket                   predicted %  measured %   diff",
    ]
    for b in Bucket:
        p, m = predicted.buckets_pct[b.value], measured_pct[b.value]
        lines.append(f"  {b.value:24s} {p:10.2f}  {m:10.2f}  {p - m:+6.2f}")
    return "\n".join(lines)


def render_fleet(result: dict[str, Any]) -> str:
    p = result["params"]
    lines = [
        f"fleet experiment: {p['num_jobs']} jobs, {p['demands_per_day']:g} demands/day of {p['demand_gpus']} GPUs "
        f"for {_dur(p['demand_hold_s'])}, over {_dur(p['duration_s'])}; {result['runs']} runs",
        "  victims           fleet ETT %   95% CI          lost GPU-h   preemptions",
    ]
    for name, r in result["policies"].items():
        lo, hi = r["ett_pct_ci95"]
        lines.append(
            f"  {name:16s} {r['ett_pct']:11.2f}   {lo:6.2f}-{hi:6.2f}  {r['lost_gpu_hours']:11.0f}"
            f"   {r['num_preemptions_mean']:11.1f}"
        )
    return "\n".join(lines)
