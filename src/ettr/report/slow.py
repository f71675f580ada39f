"""Slow ranks (`EttReport.rank_speed`) and slow steps (`EttReport.slow_steps`) in the JSON, text and HTML
reports: who the job waited for, since when, by how much, and the step time beyond the steady state."""

from __future__ import annotations

from typing import Any

from ettr.accounting import EttReport, RankSpeed, SlowSteps, Straggler
from ettr.report.steptime import fmt_step
from ettr.report.svg import esc


def rank_speed_json(r: RankSpeed | None) -> dict[str, Any] | None:
    """The `rank_speed` object: checked, reason, source, num_ranks, num_compared_steps, lost_s, stragglers."""
    if r is None:
        return None
    return {
        "checked": r.checked,
        "reason": r.reason,
        "source": r.source,
        "num_ranks": r.num_ranks,
        "num_compared_steps": r.num_compared_steps,
        "lost_s": r.lost_s,
        "stragglers": [_straggler_json(s) for s in r.stragglers],
    }


def _straggler_json(s: Straggler) -> dict[str, Any]:
    return {
        "name": s.name,
        "attempt": s.attempt,
        "ranks": list(s.ranks),
        "host": s.host,
        "node": s.node,
        "first_step": s.first_step,
        "last_step": s.last_step,
        "start_ts": s.start_ts,
        "end_ts": s.end_ts,
        "until_end": s.until_end,
        "num_steps": s.num_steps,
        "num_late_steps": s.num_late_steps,
        "extra_per_step_s": s.extra_per_step_s,
        "step_s": s.step_s,
        "slower_pct": s.slower_pct,
        "lost_s": s.lost_s,
    }


def slow_steps_json(s: SlowSteps | None) -> dict[str, Any] | None:
    """The `slow_steps` object: steady_step_s, after_restart_s, warmups, persist_s, straggler_s,
    slow_attempts."""
    if s is None:
        return None
    return {
        "steady_step_s": s.steady_step_s,
        "after_restart_s": s.after_restart_s,
        "warmups": [
            {"attempt": w.attempt, "num_steps": w.num_steps, "extra_s": w.extra_s} for w in s.warmups
        ],
        "persist_s": s.persist_s,
        "straggler_s": s.straggler_s,
        "slow_attempts": [
            {"attempt": a.attempt, "num_steps": a.num_steps, "step_s": a.step_s, "extra_s": a.extra_s}
            for a in s.slow_attempts
        ],
    }


MAX_STRAGGLER_LINES = 5
"""Straggler episodes the text report lists one by one (the ones the job waited for longest); a 2-rank job on
a loaded machine had 16, one rank or the other late for a while."""


def straggler_line(s: Straggler, wall_start_ts: float) -> str:
    """`rank 1 (host h) slower than its peers from step 101 (+40.2 s, attempt 0) to the end: +53.9 ms a step
    (+141%); the job waited 5.6 s for it`."""
    until = "to the end" if s.until_end else f"to step {s.last_step}"
    pct = f" ({s.slower_pct:+.0f}%)" if s.slower_pct is not None else ""
    lost = f"; the job waited {s.lost_s:.1f} s for it" if s.lost_s is not None else ""
    return (
        f"{s.name} slower than its peers from step {s.first_step} (+{s.start_ts - wall_start_ts:.1f} s, "
        f"attempt {s.attempt}) {until}: +{fmt_step(s.extra_per_step_s)} a step{pct}{lost} "
        f"(late at {s.num_late_steps} of {s.num_steps} steps)"
    )


def text_lines(report: EttReport) -> list[str]:
    """The slow-ranks and slow-steps lines of the text report."""
    lines = []
    r = report.rank_speed
    if r is not None and (r.checked or r.num_ranks >= 2):  # one rank: nothing to say
        if not r.checked:
            lines.append(f"slow ranks: not checked ({r.reason})")
        elif not r.stragglers:
            lines.append(f"slow ranks: none ({r.reason})")
        else:
            lines.append(f"slow ranks ({r.reason}):")
            shown = r.stragglers
            if len(shown) > MAX_STRAGGLER_LINES:  # a loaded machine: many short episodes, the costliest shown
                costliest = sorted(shown, key=lambda s: -(s.lost_s or 0.0))[:MAX_STRAGGLER_LINES]
                shown = tuple(s for s in r.stragglers if s in costliest)
            lines += [f"  {straggler_line(s, report.wall_start_ts)}" for s in shown]
            if rest := [s for s in r.stragglers if s not in shown]:
                waited = sum(s.lost_s or 0.0 for s in rest)
                lines.append(
                    f"  and {len(rest)} more episode(s), the job waited {waited:.1f} s for them in all "
                    "(each in `ettr report --json`: rank_speed.stragglers)"
                )
    s = report.slow_steps
    if s is not None and s.steady_step_s is not None:
        parts = []
        if s.warmups:
            steps = sum(w.num_steps for w in s.warmups)
            parts.append(f"{s.after_restart_s or 0.0:.1f} s warming up after restarts ({steps} steps)")
        elif not s.slow_attempts:
            parts.append("no slow warm-up after a restart")
        parts += [
            f"{a.extra_s:.1f} s in attempt {a.attempt}, slower throughout ({fmt_step(a.step_s)} a step over "
            f"{a.num_steps} steps: not a warm-up; a busier machine, slower hardware or heavier steps)"
            for a in s.slow_attempts
        ]
        if (
            s.persist_s is not None
        ):  # steps faster beside the persists than steady: none (the JSON keeps the sign)
            parts.append(f"{max(0.0, s.persist_s):.1f} s beside checkpoint persists")
        if s.straggler_s is not None:
            parts.append(f"{s.straggler_s:.1f} s waiting for slow ranks")
        lines.append(
            f"slow steps beyond the steady {fmt_step(s.steady_step_s)} a step (counted as training, beside ETT): "
            + "; ".join(parts)
        )
    return lines


def html(report: EttReport) -> str:
    """The same as a few paragraphs of HTML (empty when there is nothing to say)."""
    return "".join(f'<p class="slow">{esc(line.strip())}</p>' for line in text_lines(report))
