"""`ettr demo`'s story: technique shares, the TTS steps, recoveries and audits, read from reports and events;
the replay check and the fleet projection through the simulator; the text and HTML that show them."""

from __future__ import annotations

import pytest

from ettr.accounting import compute
from ettr.audit import MARK_NAME
from ettr.demo import story as demo_story
from ettr.demo.render import story_lines, story_sections
from ettr.events import SUPERVISOR_RANK, Bucket, Event, EventKind, Outcome, Phase

T0 = 1_700_000_000.0


def _job(
    *, init_s: float, compile_s: float, blocking_s: float, groups: int, step_s: float = 1.0
) -> list[Event]:
    """Attempt 0 starts up (init, compile), trains, saves, is preempted; attempt 1 starts up and completes."""
    rows = []
    for attempt, start in ((0, 0.0), (1, 100.0)):
        t = start
        rows.append(Event(EventKind.ATTEMPT_START, T0 + t, attempt, SUPERVISOR_RANK))
        rows.append(
            Event(
                EventKind.PHASE_END,
                T0 + t + init_s,
                attempt,
                0,
                phase=Phase.TRAIN_MODULE_CREATION,
                value=T0 + t,
            )
        )
        t += init_s
        rows.append(
            Event(EventKind.PHASE_END, T0 + t + compile_s, attempt, 0, phase=Phase.COMPILE, value=T0 + t)
        )
        t += compile_s
        data = {"name": MARK_NAME, "num_calls": 3 + groups, "num_groups_created": groups, "total_s": 0.1}
        data["stages"] = {
            "init_plugins": {"new_group": {"num_calls": groups}},
            "pre_train": {"barrier": {"num_calls": 3}},
        }
        rows.append(Event(EventKind.MARK, T0 + t, attempt, 0, data=data))
        if attempt == 1:
            rows.append(Event(EventKind.RESUMED, T0 + t, attempt, 0, step=20))
        rows.append(Event(EventKind.TRAINING_START, T0 + t, attempt, 0))
        first = 21 if attempt else 1
        for step in range(first, first + 20):
            t += step_s
            rows.append(Event(EventKind.STEP, T0 + t, attempt, 0, step=step))
            if step == 20:
                rows.append(
                    Event(
                        EventKind.PHASE_END,
                        T0 + t + blocking_s,
                        attempt,
                        0,
                        phase=Phase.CHECKPOINT_BLOCKING,
                        value=T0 + t,
                    )
                )
                t += blocking_s
                rows.append(
                    Event(EventKind.CHECKPOINT_COMMIT, T0 + t, attempt, 0, step=20, data={"path": "p"})
                )
        outcome = Outcome.PREEMPTED if attempt == 0 else Outcome.COMPLETED
        rows.append(
            Event(EventKind.ATTEMPT_END, T0 + t + 0.5, attempt, SUPERVISOR_RANK, data={"outcome": outcome})
        )
    return rows


def _report(events: list[Event]):
    return compute(events, max(e.ts for e in events), job_id="j")


BASE = _job(init_s=8.0, compile_s=30.0, blocking_s=2.0, groups=1)
OPT = _job(init_s=7.0, compile_s=3.0, blocking_s=0.2, groups=3)


def test_every_bucket_but_training_belongs_to_exactly_one_technique():
    owned = [b for t in demo_story.TECHNIQUES for b in t.buckets]
    assert len(owned) == len(set(owned))
    assert set(owned) == set(Bucket) - {Bucket.EFFECTIVE_TRAINING}


def test_technique_shares_add_up_to_the_wall_time_saved_and_the_gain():
    baseline, optimized = _report(BASE), _report(OPT)
    gains = demo_story.technique_gains(baseline, optimized)
    by_name = {g.technique.name: g for g in gains}
    compile_gain = by_name["compile store (warm)"]
    assert compile_gain.baseline_s == pytest.approx(60.0) and compile_gain.optimized_s == pytest.approx(6.0)
    saved = sum(g.saved_s for g in gains)
    assert saved == pytest.approx(baseline.wall_s - optimized.wall_s, abs=1e-6)  # same training on both
    assert sum(g.share_pct or 0 for g in gains) == pytest.approx(100.0)
    assert sum(g.points or 0 for g in gains) == pytest.approx(optimized.ett_pct - baseline.ett_pct)


def test_the_tts_steps_go_from_the_baseline_to_the_optimized_tts():
    baseline, optimized = _report(BASE), _report(OPT)
    steps = demo_story.tts_steps(baseline, optimized)
    assert steps[0].total and steps[0].seconds == pytest.approx(baseline.tts_s)
    assert steps[-1].total and steps[-1].seconds == pytest.approx(optimized.tts_s)
    assert steps[0].seconds + sum(s.seconds for s in steps[1:-1]) == pytest.approx(steps[-1].seconds)
    assert [s.label for s in steps[1:-1]] == ["compile store (warm)", "start-up not repeated"]


def test_the_gain_at_equal_step_speed_takes_out_what_slower_steps_added():
    """Both sides keep 40 steps. Baseline: 1 s a step, wall 158.5, ETT 40/158.5. Optimized: 1.6 s a step,
    wall 142.5, ETT 64/142.5; at the baseline's pace its training is 40 s and its wall 142.5 - 64 + 40."""
    baseline = _report(BASE)
    optimized = _report(_job(init_s=7.0, compile_s=3.0, blocking_s=0.2, groups=3, step_s=1.6))
    e = demo_story.equal_speed(baseline, optimized)
    assert e is not None and e.num_kept_steps == 40
    assert e.baseline_step_s == pytest.approx(1.0) and e.optimized_step_s == pytest.approx(1.6)
    assert e.baseline_median_step_s == pytest.approx(1.0) and e.optimized_median_step_s == pytest.approx(1.6)
    assert e.wall_s == pytest.approx(142.5) and e.wall_at_baseline_s == pytest.approx(118.5)
    assert e.baseline_wall_s == pytest.approx(158.5)
    assert e.ett_pct == pytest.approx(64 / 142.5 * 100)
    assert e.ett_at_baseline_pct == pytest.approx(40 / 118.5 * 100)
    assert e.baseline_ett_pct == pytest.approx(40 / 158.5 * 100)
    assert e.gain_points == pytest.approx((40 / 118.5 - 40 / 158.5) * 100)
    assert e.from_speed_points == pytest.approx((64 / 142.5 - 40 / 118.5) * 100)  # 11.2 of the 19.7 points

    from ettr.demo.render import equal_speed_lines

    text = "\n".join(equal_speed_lines(e))
    assert "the same work: wall 118.5 s instead of 142.5 s (baseline 158.5 s" in text
    assert "ETT 33.8% instead of 44.9%: +8.5 points over the baseline's 25.2%, not +19.7" in text
    assert "11.2 of the +19.7 points came from slower steps" in text
    assert e.median_step_change_pct == pytest.approx(60.0)
    assert (
        "median step time: baseline 1.00 s, optimized 1.60 s (+60.0%: NOT within 5% of the baseline's" in text
    )
    from dataclasses import replace

    from ettr.demo.render import median_step_line

    faster = median_step_line(replace(e, optimized_median_step_s=0.8))
    assert "(-20.0%: faster than the baseline's; " in faster, faster
    assert "one after the other, so a change of the machine's load between them moves it too" in faster
    beside = median_step_line(replace(e, side_by_side=True))
    assert "the sides ran side by side, each on CPUs of its own" in beside and "one after" not in beside
    # The same speed on both sides: the raw gain is the gain.
    same = demo_story.equal_speed(baseline, _report(OPT))
    assert same is not None and same.from_speed_points == pytest.approx(0.0, abs=1e-9)
    assert "none of the gain came from a step-speed difference" in "\n".join(equal_speed_lines(same))
    assert "(+0.0%: within 5% of the baseline's" in "\n".join(equal_speed_lines(same))
    # Faster optimized steps hide part of the gain instead.
    fast = demo_story.equal_speed(
        baseline, _report(_job(init_s=7.0, compile_s=3.0, blocking_s=0.2, groups=3, step_s=0.5))
    )
    assert fast is not None and fast.from_speed_points < 0
    assert "faster steps hid" in "\n".join(equal_speed_lines(fast))


def test_no_kept_step_no_equal_speed_figure():
    never = [
        Event(EventKind.ATTEMPT_START, T0, 0, SUPERVISOR_RANK),
        Event(EventKind.ATTEMPT_END, T0 + 5, 0, SUPERVISOR_RANK, data={"outcome": Outcome.FAILED}),
    ]
    from ettr.demo.render import equal_speed_lines

    assert demo_story.equal_speed(_report(never), _report(OPT)) is None
    assert equal_speed_lines(None)[-1] == "at equal step speed: unknown (a side kept no step)"


def test_recoveries_and_audits_are_read_per_failure_and_attempt():
    baseline, optimized = _report(BASE), _report(OPT)
    (pair,) = demo_story.recovery_pairs(baseline, optimized)
    assert pair.outcome == "preempted"
    assert pair.baseline[Bucket.COMPILE] == pytest.approx(30.0) and pair.optimized[
        Bucket.COMPILE
    ] == pytest.approx(3.0)
    audits = demo_story.audits("optimized", OPT)
    assert [(a.attempt, a.num_groups, a.ops["new_group"]) for a in audits] == [(0, 3, 3), (1, 3, 3)]


def _story_of(tmp_path, baseline, optimized, *, runs):
    """The story of two run directories written from these events (a fleet projection of `runs` runs)."""
    from ettr.ledger import open_ledger

    for name, events in (("baseline", baseline), ("optimized", optimized)):
        ledger = open_ledger(tmp_path / name)
        ledger.append(events)
        ledger.close()
    fleet = demo_story.FleetScale(runs=runs, days=1.0)
    return demo_story.build_story(tmp_path / "baseline", tmp_path / "optimized", fleet=fleet)


def test_the_story_replays_and_projects_both_run_directories(tmp_path):
    story = _story_of(tmp_path, BASE, OPT, runs=3)
    assert [r.side for r in story.replays] == ["baseline", "optimized"]
    for r in story.replays:
        assert 0 < r.predicted_ett_pct <= 100 and 0 < r.measured_ett_pct <= 100
    assert [p.side for p in story.projection] == ["baseline", "optimized"]
    assert story.projection[1].ett_pct > story.projection[0].ett_pct  # cheaper saves and recoveries

    text = "\n".join(story_lines(story))
    assert "what each technique bought" in text and "replay" in text and "1,024 GPUs for 1 days" in text
    assert "new_group 1 -> 3" in text  # the audit shows the optimized side's extra groups, honestly
    assert "at equal step speed" in text and "none of the gain came from a step-speed difference" in text
    (html,) = story_sections(story)
    assert 'id="story"' in html and "<svg" in html and "Projection" in html
    assert "At equal step speed" in html


def test_a_run_that_never_trained_has_no_replay_and_says_so(tmp_path):
    never = [
        Event(EventKind.ATTEMPT_START, T0, 0, SUPERVISOR_RANK),
        Event(EventKind.ATTEMPT_END, T0 + 5, 0, SUPERVISOR_RANK, data={"outcome": Outcome.FAILED}),
    ]
    story = _story_of(tmp_path, never, OPT, runs=2)
    assert [r.side for r in story.replays] == ["optimized"]
    assert any(n.startswith("baseline: no profile") for n in story.notes)


@pytest.mark.slow
def test_the_demo_page_tells_the_story_in_headless_chromium(tmp_path):
    from ettr.ledger import open_ledger
    from ettr.report.html import write_html
    from ettr.report.load import load_report
    from test_report_html import _console_errors, _Doc, _has_colour, _png_rgb, _run_chromium

    for name, events in (("baseline", BASE), ("optimized", OPT)):
        ledger = open_ledger(tmp_path / name)
        ledger.append(events)
        ledger.close()
    story = demo_story.build_story(
        tmp_path / "baseline", tmp_path / "optimized", fleet=demo_story.FleetScale(runs=2, days=1.0)
    )
    reports = [load_report(tmp_path / n) for n in ("baseline", "optimized")]
    page = tmp_path / "report.html"
    write_html(reports, page, labels=["baseline", "optimized"], extra_sections=story_sections(story))

    dom = _run_chromium(tmp_path, "--dump-dom", page.as_uri())
    assert dom.returncode == 0 and _console_errors(dom.stderr) == [], dom.stderr[-2000:]
    doc = _Doc(dom.stdout)
    assert next(a for t, a in doc.tags if t == "html").get("data-ettr-script") == "ok"
    assert any(t == "section" and a.get("id") == "story" for t, a in doc.tags)
    # The story comes right after the headline: technique table, the TTS steps, recoveries, projection.
    text = dom.stdout
    assert text.index('id="story"') < text.index('id="timeline"')
    for heading in (
        "what each technique bought",
        "baseline → each technique → optimized",
        "Time to recover, by bucket",
        "Projection",
    ):
        assert heading in text, heading

    shot = tmp_path / "shot.png"
    result = _run_chromium(
        tmp_path, f"--screenshot={shot}", "--window-size=1200,3600", "--hide-scrollbars", page.as_uri()
    )
    assert result.returncode == 0 and shot.is_file(), result.stderr[-2000:]
    rgb = _png_rgb(shot.read_bytes())
    # The technique waterfall paints its savings green and its totals slate; the TTR bars in bucket colours.
    assert _has_colour(rgb, "#2ca02c", min_pixels=200) and _has_colour(rgb, "#39424e", min_pixels=200)
    assert _has_colour(rgb, "#6b5fc7", min_pixels=100)  # compile, in the recovery bars


def test_a_replay_not_within_two_points_says_why_where_the_lost_steps_ran_at_another_speed(tmp_path):
    """The replay line of a side whose lost steps ran at another speed than its mean (the replay trains at
    one) carries the profile's line; a replay within 2 points does not need it."""
    from dataclasses import replace

    story = _story_of(tmp_path, BASE, OPT, runs=3)
    note = "its 600 lost steps ran at 67.1 ms a step"
    off = demo_story.Replay(side="baseline", measured_ett_pct=40.0, predicted_ett_pct=37.5, speed_note=note)
    close = demo_story.Replay(
        side="optimized", measured_ett_pct=60.0, predicted_ett_pct=59.5, speed_note=note
    )
    story = replace(story, replays=(off, close))
    text = "\n".join(story_lines(story))
    assert "NOT within 2" in text and text.count(note) == 1
    (html,) = story_sections(story)
    assert f"no: {note}" in html and html.count(note) == 1


def test_timed_steps_are_every_unblocked_step_kept_or_redone_in_time_order():
    """Attempt 0's steps 1-20 (1 s each; step 20's save blocks 2 s) and attempt 1's 21-40: every interval
    but each attempt's first step, none left out for being redone, none across the blocking save."""
    from ettr.accounting.compute import timed_steps

    timed = timed_steps(BASE, max(e.ts for e in BASE))
    assert len(timed) == 19 + 19
    assert [end for end, _ in timed] == sorted(end for end, _ in timed)
    assert all(seconds == pytest.approx(1.0) for _, seconds in timed)


def test_steps_together_compares_only_the_steps_both_sides_ran_at_the_same_time():
    """The optimized side trains from 0 to 50 s at 1.1 s a step; the baseline from 10 to 100 s, at 1.0 s a
    step while the other side trains and 0.5 s after it ended. Over the whole job the baseline's median is
    0.5 s (+120%); while both trained, 1.0 s against 1.1 s (+10%)."""
    optimized = [(t * 1.1, 1.1) for t in range(1, 46)]
    baseline = [(10.0 + t, 1.0) for t in range(1, 41)] + [(50.0 + 0.5 * t, 0.5) for t in range(1, 101)]
    together = demo_story.steps_together(baseline, optimized)
    assert together is not None
    assert together.begin_ts == pytest.approx(11.0) and together.end_ts == pytest.approx(45 * 1.1)
    assert together.baseline_median_step_s == pytest.approx(1.0)
    assert together.optimized_median_step_s == pytest.approx(1.1)
    assert together.change_pct == pytest.approx(10.0)
    assert together.num_baseline_steps == 39 and together.num_optimized_steps == 36
    # No overlap, or a side without steps: nothing to compare.
    assert demo_story.steps_together(baseline, [(200.0, 1.0), (201.0, 1.0)]) is None
    assert demo_story.steps_together([], optimized) is None


def test_the_step_time_line_says_how_the_sides_compared_while_both_trained():
    from dataclasses import replace

    from ettr.demo.render import equal_speed_lines, together_line

    e = demo_story.equal_speed(_report(BASE), _report(OPT))
    assert e is not None and together_line(e) is None  # one after the other: no such line
    together = demo_story.StepsTogether(
        begin_ts=T0,
        end_ts=T0 + 147.0,
        baseline_median_step_s=0.0824,
        optimized_median_step_s=0.0866,
        num_baseline_steps=1370,
        num_optimized_steps=1168,
    )
    side_by_side = replace(e, side_by_side=True, together=together)
    text = "\n".join(equal_speed_lines(side_by_side))
    assert (
        "while both trained (147 s of the same wall time; 1370 and 1168 steps): baseline 82.4 ms, optimized "
        "86.6 ms (+5.1%: NOT within 5% of the baseline's;" in text
    ), text
    faster = together_line(replace(side_by_side, together=replace(together, optimized_median_step_s=0.0850)))
    assert faster is not None and "(+3.2%: within 5% of the baseline's;" in faster


def test_a_side_by_side_story_holds_the_steps_both_sides_ran_together(tmp_path):
    """build_story from two run directories: side by side it compares the steps both ran at the same time;
    one after the other it does not."""
    from ettr.ledger import open_ledger

    dirs = []
    for name, events in (("baseline", BASE), ("optimized", OPT)):
        ledger = open_ledger(tmp_path / name)
        ledger.append(events)
        ledger.close()
        dirs.append(tmp_path / name)
    fleet = demo_story.FleetScale(runs=2, days=1.0)
    beside = demo_story.build_story(*dirs, side_by_side=True, fleet=fleet)
    assert beside.equal_speed is not None and beside.equal_speed.together is not None
    assert beside.equal_speed.together.change_pct == pytest.approx(0.0)
    after = demo_story.build_story(*dirs, side_by_side=False, fleet=fleet)
    assert after.equal_speed is not None and after.equal_speed.together is None


def test_the_demo_says_how_evenly_the_other_load_sat_beside_the_two_sides():
    """The CPU time each side's CPU gave to other processes while both trained: said, with a verdict."""
    from dataclasses import replace

    from ettr.demo.cpu_meter import CpuShare
    from ettr.demo.render import beside_line, equal_speed_lines

    e = demo_story.equal_speed(_report(BASE), _report(OPT))
    assert e is not None
    together = demo_story.StepsTogether(
        begin_ts=T0,
        end_ts=T0 + 100.0,
        baseline_median_step_s=0.030,
        optimized_median_step_s=0.040,
        num_baseline_steps=3000,
        num_optimized_steps=2500,
    )
    assert beside_line(replace(e, side_by_side=True, together=together)) is None  # not sampled
    b = CpuShare(covered_s=100.0, own_s=95.0, others_s=3.0, num_cpus=1)
    o = CpuShare(covered_s=100.0, own_s=80.0, others_s=18.0, num_cpus=1)
    uneven = replace(e, side_by_side=True, together=replace(together, beside=(b, o)))
    line = beside_line(uneven)
    assert line is not None and line in equal_speed_lines(uneven)
    assert "baseline 3.0 s (3%), optimized 18.0 s (18%)" in line
    assert "not even: the optimized side's CPU gave 15.0 points more of its time to other processes" in line
    even = beside_line(replace(uneven, together=replace(together, beside=(b, replace(o, others_s=5.0)))))
    assert even is not None and "about even, so the step times compare" in even
