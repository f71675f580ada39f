"""The terminal view of a `FleetReport`: fleet line, costliest buckets, families, days, worst jobs,
failures by cause, regressions; and the preemption order. Plain ASCII columns."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ettr.accounting import Cause
from ettr.fleet.aggregate import Distribution, FleetReport, Totals
from ettr.fleet.preempt import PreemptCost
from ettr.fleet.regress import Regression
from ettr.fleet.stepspeed import StepSpeedOutlier
from ettr.report.steptime import SPEED_TOLERANCE, fmt_step
from ettr.report.text import _table
from ettr.untrusted import one_line, printable


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _shares(t: Totals, unit: str = "") -> tuple[str, str, str]:
    """ETT, idleness and failure in % (one decimal, then `unit`), or `unknown`, `-`, `-` when no job's ETT
    is known."""
    shares = t.shares_pct()
    if shares is None:
        return "unknown", "-", "-"
    ett, idle, failure = (f"{share:.1f}{unit}" for share in shares)
    return ett, idle, failure


def _dist(d: Distribution) -> str:
    if not d.count:
        return "-"
    return f"p50 {_s(d.p50)} s, p90 {_s(d.p90)} s, max {_s(d.max)} s (n={d.count})"


def _group_rows(groups: Mapping[str, Totals]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for name, t in groups.items():
        rows.append(
            (
                name,
                str(t.num_jobs),
                f"{t.wall_gpu_s / 3600:.2f}",
                *_shares(t),
                str(t.num_failures),
                _s(t.tts.p50),
                _s(t.ttr.p50),
            )
        )
    return rows


_GROUP_HEADER = ("", "jobs", "gpu_h", "ETT%", "idle%", "fail%", "NoF", "TTS p50", "TTR p50")


def regression_line(r: Regression) -> str:
    if r.metric == "step_time_s":  # milliseconds, often: as the step columns show it
        before, after = fmt_step(r.baseline), fmt_step(r.value)
    else:
        unit = "%" if r.metric == "ett_pct" else " s"
        before, after = f"{r.baseline:.2f}{unit}", f"{r.value:.2f}{unit}"
    return (
        f"{r.family}: {r.metric} {before} -> {after} from job {r.label} "
        f"({r.num_changed_jobs} job(s) since, baseline of {r.num_baseline_jobs})"
    )


def step_speed_line(o: StepSpeedOutlier) -> str:
    pace = "slower" if o.change > 0 else "faster"
    return (
        f"{o.label} ({o.family}): median step {fmt_step(o.step_time_s)}, {abs(o.change) * 100:.0f}% {pace} "
        f"than its family's {fmt_step(o.family_step_time_s)} (of {o.num_family_jobs} jobs): its ETT% is not "
        "comparable with theirs"
    )


def render(report: FleetReport, problems: Sequence[str] = ()) -> str:
    t = report.fleet
    ett, idle, failure = _shares(t, "%")
    lines = [
        f"fleet: {t.num_jobs} jobs, {t.wall_gpu_s / 3600:.2f} GPU-hours (wall x gpus) | ETT {ett} | "
        f"idle {idle} | failure {failure} | failures {t.num_failures} "
        f"(infra {t.failures_by_cause[Cause.INFRA]})"
        + (
            f" | {t.num_ett_unknown} job(s) with ETT unknown (no training step seen) left out of the shares"
            if t.num_ett_unknown
            else ""
        ),
        f"  TTS {_dist(t.tts)}",
        f"  TTR {_dist(t.ttr)}",
        *[f"    {kind:<13} {_dist(d)}" for kind, d in t.ttr_by_kind.items()],
        "",
        "lost GPU-hours by bucket (costliest first)",
    ]
    if report.costliest_buckets:
        lines += [f"  {b.value:<22}{h:>10.3f}" for b, h in report.costliest_buckets]
    else:
        lines.append("  (none)")
    lines += ["", "failures by cause (NoF, TTR p50)"]
    causes = [(c, n) for c, n in t.failures_by_cause.items() if n]
    lines += [f"  {c.value:<12}{n:>5}   {_s(t.ttr_by_cause[c].p50)} s" for c, n in causes] or ["  (none)"]
    details = [f"{d.value} {n}" for d, n in t.failures_by_detail.items() if n]
    if details:
        lines.append("  what happened: " + ", ".join(details))
    groups = (
        ("families", "family", report.families),
        ("days (UTC)", "day", report.days),
        ("weeks (ISO, UTC)", "week", report.weeks),
    )
    for title, column, group in groups:
        lines += ["", title]
        lines += _table((column, *_GROUP_HEADER[1:]), _group_rows(group), indent="  ")
    lines += ["", "worst jobs (lowest ETT%)"]
    rows = [(j.label, j.family, f"{j.ett_pct:.1f}" if j.ett_known else "unknown", f"{j.gpu_s / 3600:.2f}", str(j.gpus), str(j.num_failures),
             fmt_step(j.step_time_s)) for j in report.worst_jobs]  # fmt: skip
    lines += _table(
        ("job", "family", "ETT%", "gpu_h", "gpus", "NoF", "step"), rows, indent="  ", left=frozenset({0, 1})
    )
    lines += ["", f"regressions ({len(report.regressions)})"]
    lines += [f"  {regression_line(r)}" for r in report.regressions] or ["  (none)"]
    with_stragglers = [j for j in report.jobs if j.stragglers]
    unchecked = sum(1 for j in report.jobs if j.stragglers is None)
    lines += ["", f"jobs with stragglers ({len(with_stragglers)}; ranks not compared in {unchecked} job(s))"]
    for j in with_stragglers:
        lost = f", waited {j.straggler_lost_s:.1f} s" if j.straggler_lost_s is not None else ""
        lines.append(f"  {j.label} ({j.family}{lost}):")
        lines += [f"    {line}" for line in j.stragglers or ()]
    if not with_stragglers:
        lines.append("  (none)")
    lines += ["", f"step speed: jobs more than {SPEED_TOLERANCE:.0%} off their family's median step time"]
    lines += [f"  warning: {step_speed_line(o)}" for o in report.step_speed] or ["  (none)"]
    if problems:
        lines += ["", f"not read ({len(problems)})"] + [f"  {one_line(p)}" for p in problems]
    return printable("\n".join(lines) + "\n")


def render_preempt(
    costs: Sequence[PreemptCost], victims: Sequence[PreemptCost] | None, need: int | None
) -> str:
    if not costs:
        return "no running job to preempt\n"
    rows = [
        (
            str(i + 1),
            c.label,
            c.family,
            str(c.gpus),
            f"{c.cost_gpu_s:.1f}",
            f"{c.unsaved_s:.1f}",
            _s(c.recovery_s),
            c.recovery_source,
        )
        for i, c in enumerate(costs)
    ]
    header = ("#", "job", "family", "gpus", "cost_gpu_s", "unsaved_s", "recovery_s", "recovery_from")
    lines = ["preemption order (cheapest first; cost = (unsaved_s + recovery_s) x gpus)"]
    lines += _table(header, rows, indent="  ", left=frozenset({1, 2, 7}))
    if need is not None:
        chosen = list(victims or ())
        freed = sum(c.gpus for c in chosen)
        verdict = "enough" if freed >= need else f"NOT enough: only {freed} GPUs run in preemptible jobs"
        lines.append(f"victims for {need} GPUs: {' '.join(c.label for c in chosen) or '-'} ({verdict})")
    return printable("\n".join(lines) + "\n")
