"""`ettr demo`'s story (`ettr.demo.story.Story`) as terminal lines and as HTML sections for report.html.

Pure: a story in, text out. The HTML uses the report's SVG vocabulary (`ettr.report.svg`), so the bucket
colours are the same as in the rest of the page.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ettr.demo.story import STEP_SPEED_BOUND_PCT, Audit, EqualSpeed, FleetScale, Replay, Story
from ettr.events import Bucket
from ettr.report.steptime import fmt_step
from ettr.report.svg import (
    BUCKET_COLORS,
    LABEL_W,
    RIGHT_W,
    WIDTH,
    esc,
    fmt_s,
    fmt_signed,
    rect_element,
    svg_element,
    text_element,
)

_RECOVERY_BUCKETS = (
    Bucket.RESTART,
    Bucket.INIT,
    Bucket.COMPILE,
    Bucket.RESTORE,
    Bucket.DATA_WAIT,
    Bucket.EVALUATION,
    Bucket.OTHER,
)


def _fleet_title(fleet: FleetScale) -> str:
    return (
        f"{fleet.gpus:,} GPUs for {fleet.days:g} days at {fleet.failures_per_node_day:.3g} failures per "
        f"node-day ({fleet.source})"
    )


def _breakdown(spent: Mapping[Bucket, float]) -> str:
    parts = [f"{b.value} {spent[b]:.1f}" for b in _RECOVERY_BUCKETS if spent.get(b, 0.0) >= 0.05]
    return ", ".join(parts) or "-"


def equal_speed_lines(e: EqualSpeed | None) -> list[str]:
    """The gain at equal step speed: the wall time of the same work, the ETT at the baseline's pace, and how
    much of the raw gain came from the step-speed difference."""
    if e is None:
        return ["", "at equal step speed: unknown (a side kept no step)"]
    medians = f"medians {fmt_step(e.baseline_median_step_s)} vs {fmt_step(e.optimized_median_step_s)}"
    if e.from_speed_points >= 0.05:
        part = f"{e.from_speed_points:.1f} of the {e.raw_gain_points:+.1f} points came from slower steps"
    elif e.from_speed_points <= -0.05:
        part = f"faster steps hid {-e.from_speed_points:.1f} points of the gain"
    else:
        part = "none of the gain came from a step-speed difference"
    together = together_line(e)
    beside = beside_line(e)
    return [
        "",
        median_step_line(e),
        *([together] if together else []),
        *([beside] if beside else []),
        f"at equal step speed (the optimized side's {e.num_kept_steps} kept steps at the baseline's "
        f"{fmt_step(e.baseline_step_s)} of effective training a step, not its own {fmt_step(e.optimized_step_s)}; "
        f"{medians}):",
        f"  the same work: wall {e.wall_at_baseline_s:.1f} s instead of {e.wall_s:.1f} s (baseline "
        f"{e.baseline_wall_s:.1f} s; training {e.effective_at_baseline_s:.1f} s instead of {e.effective_s:.1f} s)",
        f"  ETT {e.ett_at_baseline_pct:.1f}% instead of {e.ett_pct:.1f}%: {e.gain_points:+.1f} points over the "
        f"baseline's {e.baseline_ett_pct:.1f}%, not {e.raw_gain_points:+.1f}; {part}",
    ]


def median_step_line(e: EqualSpeed) -> str:
    """Both sides' median step times and whether the optimized side's is within `STEP_SPEED_BOUND_PCT`."""
    medians = (
        f"baseline {fmt_step(e.baseline_median_step_s)}, optimized {fmt_step(e.optimized_median_step_s)}"
    )
    change = e.median_step_change_pct
    if change is None:
        return f"median step time: {medians}"
    how = (
        "the sides ran side by side, each on CPUs of its own"
        if e.side_by_side
        else "the sides ran one after the other, so a change of the machine's load between them moves it too"
    )
    return f"median step time: {medians} ({change:+.1f}%: {_bound_verdict(change)}; {how})"


def _bound_verdict(change_pct: float) -> str:
    if change_pct < -STEP_SPEED_BOUND_PCT:
        return "faster than the baseline's"  # "within 5%" would read oddly for -16%
    return ("within" if change_pct <= STEP_SPEED_BOUND_PCT else "NOT within") + (
        f" {STEP_SPEED_BOUND_PCT:g}% of the baseline's"
    )


def together_line(e: EqualSpeed) -> str | None:
    """Side by side: both sides' median step over the wall time both were training, and its verdict (None:
    the sides ran one after the other, or their training did not overlap)."""
    t = e.together
    if t is None:
        return None
    return (
        f"  while both trained ({t.end_ts - t.begin_ts:.0f} s of the same wall time; {t.num_baseline_steps} and "
        f"{t.num_optimized_steps} steps): baseline {fmt_step(t.baseline_median_step_s)}, optimized "
        f"{fmt_step(t.optimized_median_step_s)} ({t.change_pct:+.1f}%: {_bound_verdict(t.change_pct)}; "
        "the steps a side ran after the other had ended, with the other's CPUs free for the machine's other "
        "load, are left out)"
    )


UNEVEN_OTHERS_POINTS = 5.0
"""Other processes took this many points more of one side's CPU time than of the other's: the two sides'
steps did not have the same CPU to run on, and the demo says so."""


def beside_line(e: EqualSpeed) -> str | None:
    """Side by side: the CPU time each side's CPUs gave to anything else (the machine's other load, the demo
    itself) while both trained, and whether that was even (None: not sampled)."""
    t = e.together
    if t is None or t.beside is None:
        return None
    b, o = t.beside
    gap = o.others_pct - b.others_pct
    if abs(gap) < UNEVEN_OTHERS_POINTS:
        verdict = "about even, so the step times compare"
    else:
        slower, faster = ("optimized", "baseline") if gap > 0 else ("baseline", "optimized")
        verdict = (
            f"not even: the {slower} side's CPU gave {abs(gap):.1f} points more of its time to other "
            f"processes than the {faster} side's, which slows its steps for a reason that is not ettr's"
        )
    return (
        f"  on each side's CPU in that stretch, CPU time that was not the side's own (the machine's other "
        f"load, the demo itself): baseline {b.others_s:.1f} s ({b.others_pct:.0f}%), optimized "
        f"{o.others_s:.1f} s ({o.others_pct:.0f}%): {verdict}"
    )


# -- text -------------------------------------------------------------------------------------------------
def story_lines(story: Story) -> list[str]:
    """The story for the terminal: the gain at equal step speed, technique shares, TTS steps, TTRs, the
    audit, replay, projection."""
    lines = [
        *equal_speed_lines(story.equal_speed),
        "",
        "what each technique bought (seconds of its buckets, whole job; share of the wall time saved):",
    ]
    for g in story.techniques:
        if max(abs(g.baseline_s), abs(g.optimized_s)) < 0.05:
            continue
        share = (
            f"{g.share_pct:5.1f}% ({fmt_signed(g.points)} pts)"
            if g.share_pct is not None and g.points is not None
            else "   -"
        )
        lines.append(
            f"  {g.technique.name:<34}{g.baseline_s:7.1f} s -> {g.optimized_s:6.1f} s  {share:<18} "
            f"{g.technique.mechanism}"
        )
    if story.tts_steps:
        steps = " ".join(
            f"{s.label} {s.seconds:.1f} s" if s.total else f"{fmt_signed(s.seconds)} ({s.label})"
            for s in story.tts_steps
        )
        lines += ["", f"time to start, step by step: {steps}"]
    if story.recoveries:
        lines += ["", "time to recover, by bucket (seconds):"]
        for r in story.recoveries:
            b, o = sum(r.baseline.values()), sum(r.optimized.values())
            lines.append(f"  failure {r.index} ({r.outcome}): baseline {b:.1f} s [{_breakdown(r.baseline)}]")
            lines.append(
                f"  {'':<{len(str(r.index)) + len(r.outcome) + 12}}optimized {o:.1f} s [{_breakdown(r.optimized)}]"
            )
    if story.audits:
        lines += [
            "",
            "init audit, rank 0, per attempt (collectives / process groups created / seconds in them):",
        ]
        for side in ("baseline", "optimized"):
            rows = [a for a in story.audits if a.side == side]
            text = "; ".join(f"a{a.attempt} {a.num_calls} / {a.num_groups} / {a.total_s:.2f} s" for a in rows)
            lines.append(f"  {side:<10} {text}")
        lines.append("  " + _audit_delta(story))
    lines += ["", "the simulator's replay of each run's own failures (ettr simulate --from RUN --replay):"]
    for rp in story.replays:
        verdict = "within" if rp.ok else "NOT within"
        lines.append(
            f"  {rp.side:<10} measured ETT {rp.measured_ett_pct:.1f}%, predicted {rp.predicted_ett_pct:.1f}% "
            f"({fmt_signed(rp.predicted_ett_pct - rp.measured_ett_pct)} points: {verdict} 2)"
        )
        if not rp.ok and rp.speed_note:
            lines.append(f"  {'':<10} {rp.speed_note}")
    lines += ["", f"projected from the measured profiles to {_fleet_title(story.fleet)}:"]
    for p in story.projection:
        ttr = fmt_s(p.mean_ttr_s)
        lines.append(
            f"  {p.side:<10} ETT {p.ett_pct:.1f}% (95% CI {p.ett_pct_ci95[0]:.1f}-{p.ett_pct_ci95[1]:.1f}), "
            f"checkpoint every {fmt_s(p.interval_s)}, {p.num_failures_mean:.0f} failures, mean TTR {ttr}"
        )
    lines += [f"  ({n})" for n in story.notes]
    return lines


def _audit_delta(story: Story) -> str:
    """Which collective ops the optimized side's later attempts no longer call (or call more)."""
    later = {
        side: [a for a in story.audits if a.side == side and a.attempt > 0]
        for side in ("baseline", "optimized")
    }
    if not later["baseline"] or not later["optimized"]:
        return "(no later attempt to compare)"

    def mean_ops(rows: Sequence[Audit]) -> dict[str, float]:
        out: dict[str, float] = {}
        for a in rows:
            for op, n in a.ops.items():
                out[op] = out.get(op, 0.0) + n / len(rows)
        return out

    b, o = mean_ops(later["baseline"]), mean_ops(later["optimized"])
    diffs = [
        f"{op} {b.get(op, 0):g} -> {o.get(op, 0):g}"
        for op in sorted(set(b) | set(o))
        if b.get(op, 0) != o.get(op, 0)
    ]
    return "later attempts, per attempt: " + (", ".join(diffs) if diffs else "the same calls on both sides")


# -- HTML -------------------------------------------------------------------------------------------------
def _technique_waterfall_svg(story: Story) -> str:
    """Baseline TTS, each technique's change (down: saved, up: cost), optimized TTS."""
    steps = story.tts_steps
    row_h, gap = 20.0, 6.0
    plot_w = WIDTH - LABEL_W - RIGHT_W
    running, top = 0.0, 0.0
    for s in steps:
        running = s.seconds if s.total else running + s.seconds
        top = max(top, running)
    scale = max(top, 1e-9)
    body: list[str] = []
    y, running = 4.0, 0.0
    for s in steps:
        if s.total:
            start, end, color = 0.0, s.seconds, "#39424e"
            running = s.seconds
        else:
            start, end = sorted((running, running + s.seconds))
            color = "#2ca02c" if s.seconds < 0 else "#d62728"
            running += s.seconds
        x0 = LABEL_W + start / scale * plot_w
        w = max((end - start) / scale * plot_w, 0.8)
        label = f"{s.seconds:.1f} s" if s.total else f"{fmt_signed(s.seconds)} s"
        body.append(text_element(0, y + 14, s.label, extra=' font-weight="700"' if s.total else ""))
        body.append(rect_element(x0, y, w, row_h, color, f"{s.label}: {label}"))
        body.append(text_element(x0 + w + 6, y + 14, label, fill="#444", extra=' font-size="11"'))
        y += row_h + gap
    return svg_element(y + 4, body, label="time to start: baseline, each technique, optimized")


def _technique_table(story: Story) -> str:
    rows = []
    for g in story.techniques:
        share = f"{g.share_pct:.1f}%" if g.share_pct is not None else "—"
        points = fmt_signed(g.points) if g.points is not None else "—"
        buckets = ", ".join(b.value for b in g.technique.buckets)
        rows.append(
            f"<tr><td>{esc(g.technique.name)}</td><td>{esc(buckets)}</td><td class=num>{g.baseline_s:.1f}</td>"
            f"<td class=num>{g.optimized_s:.1f}</td><td class=num>{fmt_signed(g.saved_s)}</td><td class=num>{share}</td>"
            f"<td class=num>{points}</td><td>{esc(g.technique.mechanism)}</td></tr>"
        )
    head = (
        "<tr><th>technique</th><th>buckets</th><th>baseline s</th><th>optimized s</th><th>saved s</th>"
        "<th>share of the saving</th><th>ETT points</th><th>mechanism</th></tr>"
    )
    return f'<table class="story">{head}{"".join(rows)}</table>'


def _recovery_svg(story: Story) -> str:
    """Each failure's TTR on both sides as stacked bars by bucket."""
    rows = [
        (f"#{r.index} {r.outcome} · {side}", spent)
        for r in story.recoveries
        for side, spent in (("baseline", r.baseline), ("optimized", r.optimized))
    ]
    top = max((sum(s.values()) for _, s in rows), default=0.0)
    plot_w = WIDTH - LABEL_W - RIGHT_W
    body: list[str] = []
    y = 4.0
    for label, spent in rows:
        x = LABEL_W
        body.append(text_element(0, y + 14, label))
        for b in _RECOVERY_BUCKETS:
            seconds = spent.get(b, 0.0)
            if seconds <= 0:
                continue
            w = seconds / max(top, 1e-9) * plot_w
            body.append(
                rect_element(
                    x, y, max(w, 0.8), 20.0, BUCKET_COLORS[b], f"{b.value}: {seconds:.2f} s", bucket=b
                )
            )
            x += w
        body.append(
            text_element(x + 6, y + 14, fmt_s(sum(spent.values())), fill="#444", extra=' font-size="11"')
        )
        y += 26.0
    return svg_element(y + 4, body, label="time to recover by bucket, both sides")


def _replay_verdict(r: Replay) -> str:
    if r.ok:
        return "yes"
    return f"no: {esc(r.speed_note)}" if r.speed_note else "no"


def _projection_table(story: Story) -> str:
    rows = "".join(
        f"<tr><td>{esc(p.side)}</td><td class=num>{p.ett_pct:.1f}%</td>"
        f"<td class=num>{p.ett_pct_ci95[0]:.1f}–{p.ett_pct_ci95[1]:.1f}</td><td class=num>{esc(fmt_s(p.interval_s))}</td>"
        f"<td class=num>{p.num_failures_mean:.0f}</td><td class=num>{esc(fmt_s(p.mean_ttr_s))}</td></tr>"
        for p in story.projection
    )
    replays = "".join(
        f"<tr><td>{esc(r.side)}</td><td class=num>{r.measured_ett_pct:.1f}%</td><td class=num>{r.predicted_ett_pct:.1f}%</td>"
        f"<td class=num>{fmt_signed(r.predicted_ett_pct - r.measured_ett_pct)}</td><td>{_replay_verdict(r)}</td></tr>"
        for r in story.replays
    )
    return (
        "<h3>Replay: does the simulator predict this run?</h3>"
        '<table class="story"><tr><th>side</th><th>measured ETT</th><th>replayed ETT</th><th>difference</th>'
        f"<th>within 2 points</th></tr>{replays}</table>"
        f"<h3>Projection: {esc(_fleet_title(story.fleet))}</h3>"
        '<table class="story"><tr><th>side</th><th>ETT</th><th>95% CI</th><th>checkpoint interval</th>'
        f"<th>failures</th><th>mean TTR</th></tr>{rows}</table>"
        + "".join(f'<p class="note">{esc(n)}</p>' for n in story.notes)
    )


def _equal_speed_html(e: EqualSpeed | None) -> str:
    if e is None:
        return '<h3>At equal step speed</h3><p class="note">Unknown: a side kept no step.</p>'
    rows = "".join(
        f"<tr><td>{esc(name)}</td><td class=num>{esc(measured)}</td><td class=num>{esc(equal)}</td></tr>"
        for name, measured, equal in (
            ("effective training per kept step", fmt_step(e.optimized_step_s), fmt_step(e.baseline_step_s)),
            ("effective training", fmt_s(e.effective_s), fmt_s(e.effective_at_baseline_s)),
            (
                "wall time (baseline: " + fmt_s(e.baseline_wall_s) + ")",
                fmt_s(e.wall_s),
                fmt_s(e.wall_at_baseline_s),
            ),
            ("ETT", f"{e.ett_pct:.1f}%", f"{e.ett_at_baseline_pct:.1f}%"),
            ("gain over the baseline", f"{e.raw_gain_points:+.1f} points", f"{e.gain_points:+.1f} points"),
        )
    )
    lines = equal_speed_lines(e)
    return (
        "<h3>At equal step speed</h3>"
        f'<p class="note">ETT% is a share of time: slower steps raise it for the same work. The optimized side '
        f"with its {e.num_kept_steps} kept steps at the baseline's pace, every other second as measured.</p>"
        '<table class="story"><tr><th></th><th>optimized, measured</th><th>at the baseline\'s step time</th></tr>'
        f"{rows}</table><p>{esc(median_step_line(e))}</p>"
        + (f"<p>{esc(together.strip())}</p>" if (together := together_line(e)) else "")
        + (f"<p>{esc(beside.strip())}</p>" if (beside := beside_line(e)) else "")
        + f"<p>{esc(lines[-1].strip())}</p>"
    )


def story_sections(story: Story) -> list[str]:
    """The story's sections for report.html (placed after the headline)."""
    css = (
        "<style>table.story{border-collapse:collapse;margin:.5em 0;width:100%;table-layout:auto}"
        "table.story td,table.story th{border:1px solid #ddd;padding:3px 8px;font-size:13px;text-align:left;"
        "white-space:normal}table.story td.num{text-align:right;white-space:nowrap}</style>"
    )
    parts = [
        css,
        '<section id="story"><h2>The story: what each technique bought</h2>',
        '<p class="note">Seconds of each technique\'s buckets over the whole job, both sides, and its share of the '
        "wall time the optimized side saved (ETT points in proportion).</p>",
        _technique_table(story),
    ]
    if story.tts_steps:
        parts += [
            "<h3>Time to start: baseline → each technique → optimized</h3>",
            _technique_waterfall_svg(story),
        ]
    if story.recoveries:
        legend = " ".join(
            f'<span style="display:inline-block;width:10px;height:10px;background:{BUCKET_COLORS[b]}"></span> '
            f"{esc(b.value)}"
            for b in _RECOVERY_BUCKETS
        )
        parts += [
            "<h3>Time to recover, by bucket</h3>",
            _recovery_svg(story),
            f'<p class="note">{legend}</p>',
        ]
    parts += [_equal_speed_html(story.equal_speed), _projection_table(story), "</section>"]
    return ["".join(parts)]
