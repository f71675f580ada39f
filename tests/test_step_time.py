"""Step time (`ettr.accounting.steptime`): the time per kept step, median and p90, per attempt and job."""

from __future__ import annotations

import re

import pytest

from ettr.accounting.steptime import kept_step_times, step_intervals, step_time
from ettr.events import EventKind, Phase
from test_accounting import T0, Stream, crash_hang_complete_job


def test_median_and_p90_by_nearest_rank() -> None:
    t = step_time([0.1 * i for i in range(1, 11)])  # 0.1 .. 1.0
    assert t.median_s == pytest.approx(0.55)
    assert t.p90_s == pytest.approx(0.9)  # 9 of 10 at or below it
    assert t.num_steps == 10
    one = step_time([2.0])
    assert (one.median_s, one.p90_s, one.num_steps) == (2.0, 2.0, 1)
    none = step_time([])
    assert (none.median_s, none.p90_s, none.num_steps) == (None, None, 0)


def test_a_step_recorded_twice_is_one_interval() -> None:
    assert step_intervals([1.0, 1.0, 2.0, 3.5], [1, 1, 2, 3]) == [(2, 1.0, 2.0), (3, 2.0, 3.5)]


def test_only_kept_unblocked_steps_count() -> None:
    ts = [float(t) for t in range(10)]  # steps 1..10 one second apart
    numbers = list(range(1, 11))
    blocking = [(4.5, 5.0, Phase.CHECKPOINT_BLOCKING, "checkpoint_blocking")]
    persist = [(6.0, 8.0, Phase.CHECKPOINT_PERSIST, "checkpoint_persist")]
    # Step 6's interval (4 -> 5) holds a blocking save: left out. Steps after 7 are lost (keep up to 7).
    assert kept_step_times(ts, numbers, blocking + persist, 7) == [1.0] * 5  # steps 2, 3, 4, 5, 7


def test_steps_that_each_hold_an_evaluation_are_timed_less_it() -> None:
    # pytorch/examples' gat evaluates after every step (two passes in eval mode, no_grad): no interval is
    # free of it. Before 2026-12-05 its report read `step time: unknown` over 30 kept steps.
    ts = [0.0, 3.0, 6.5, 9.0]  # steps 1..4
    evaluations = [(t + 0.1, t + 1.1, Phase.EVAL, "eval") for t in ts]
    assert kept_step_times(ts, [1, 2, 3, 4], evaluations, 4) == pytest.approx([2.0, 2.5, 1.5])
    # One clean interval among them: the blocked ones are left out, as before.
    partly = evaluations[:2] + evaluations[3:]
    assert kept_step_times(ts, [1, 2, 3, 4], partly, 4) == pytest.approx([2.5])
    assert kept_step_times(ts, [1, 2, 3, 4], evaluations, 1) == []  # nothing kept after the first


def test_the_crash_hang_completion_job_times_its_kept_steps_only() -> None:
    """Attempt 0 kept steps 1..10 (9 intervals of 1 s); attempt 1 kept 11..12 (1 interval: step 11 is its
    first); attempt 2 kept 13..32 (19 intervals)."""
    r = crash_hang_complete_job().report(job_id="b")
    assert [a.step_time.num_steps for a in r.attempts] == [9, 1, 19]
    assert [a.step_time_s for a in r.attempts] == [1.0, 1.0, 1.0]
    assert r.step_time.num_steps == 29
    assert r.step_time_s == 1.0 and r.step_time.p90_s == 1.0
    assert r.num_kept_steps == 10 + 2 + 20


def test_an_attempt_of_slower_steps_shows_in_its_own_step_time() -> None:
    s = Stream()
    s.sup(EventKind.SUPERVISOR_START, 0)
    s.attempt(0, 0, 12, "failed", 1)
    s.steps(0, 1, 10, t_first=1, dt=1.0)  # 1..10
    s.add(EventKind.CHECKPOINT_COMMIT, 10.2, step=10, data={"path": "c"})
    s.attempt(1, 13, 40, "completed", 0)
    s.add(EventKind.RESUMED, 14, 1, step=10)
    s.steps(1, 11, 20, t_first=15, dt=2.0)  # 15..33: twice as slow
    s.sup(EventKind.JOB_END, 41, 1, exit_status=0)
    r = s.report()
    assert [a.step_time_s for a in r.attempts] == [1.0, 2.0]
    assert r.step_time.num_steps == 9 + 9
    assert r.step_time_s == pytest.approx(1.5)  # the median of nine 1 s and nine 2 s steps
    assert r.step_time.p90_s == 2.0


def test_no_step_no_step_time() -> None:
    s = Stream()
    s.sup(EventKind.SUPERVISOR_START, 0).attempt(0, 1, 5, "failed", 1)
    r = s.report()
    assert r.step_time_s is None and r.attempts[0].step_time_s is None
    assert r.step_time.p90_s is None and r.step_time.num_steps == 0


def test_times_are_exact_at_unix_magnitude() -> None:
    ts = [T0 + 0.05 * i for i in range(5)]
    times = kept_step_times(ts, [1, 2, 3, 4, 5], [], float("inf"))
    assert times == pytest.approx([0.05] * 4, abs=1e-6)


def _job(dt: float, job_id: str = "j"):
    s = Stream()
    s.sup(EventKind.SUPERVISOR_START, 0)
    s.attempt(0, 1, 3 + 20 * dt, "completed", 0)
    s.steps(0, 1, 20, t_first=2, dt=dt)
    s.sup(EventKind.JOB_END, 4 + 20 * dt, 0, exit_status=0)
    return s.report(job_id=job_id)


def test_every_report_shows_the_step_time() -> None:
    from ettr.report.html import render_html
    from ettr.report.json import to_dict
    from ettr.report.text import render

    r = _job(0.05)
    data = to_dict(r, include_segments=False)
    assert data["step_time_s"] == pytest.approx(0.05, abs=1e-6)
    assert data["step_time_p90_s"] == pytest.approx(0.05, abs=1e-6)
    assert data["num_timed_steps"] == 19 and data["num_kept_steps"] == 20
    assert data["attempts"][0]["step_time_s"] == pytest.approx(0.05, abs=1e-6)
    assert "step time: median 50.0 ms, p90 50.0 ms over 19 kept steps" in render(r)
    page = render_html([r])
    assert "time per step" in page and "50.0 ms" in page


def test_unknown_step_time_is_null_not_zero() -> None:
    from ettr.report.json import to_dict
    from ettr.report.text import render

    s = Stream()
    s.sup(EventKind.SUPERVISOR_START, 0).attempt(0, 1, 5, "failed", 1)
    r = s.report()
    data = to_dict(r, include_segments=False)
    assert data["step_time_s"] is None and data["attempts"][0]["step_time_s"] is None
    assert "step time: unknown" in render(r)


def test_a_comparison_warns_when_step_speed_differs_by_more_than_10_percent() -> None:
    from ettr.report.html import render_html
    from ettr.report.text import render_comparison

    base, slow, close = _job(1.0, "a"), _job(1.62, "b"), _job(1.08, "c")
    text = render_comparison([base, slow])
    assert (
        "warning: b's steps ran at another speed than a's (median 1.62 s vs 1.00 s a step (+62%), effective "
        "training 1.59 s vs 1.00 s per kept step (+59%)): ETT% counts step time as effective training, so its "
        "slower steps raise it for the same work; compare the time per step too"
    ) in text
    assert re.search(r"^step time median +1\.00 s +1\.62 s +\+62%$", text, re.M), text
    assert re.search(r"^training per kept step +1\.00 s +1\.59 s +\+59%$", text, re.M), text
    assert "warning" not in render_comparison([base, close])  # 8%: within the tolerance
    assert "so its faster steps lower it" in render_comparison([slow, base])
    page = render_html([base, slow])
    assert 'class="warn"' in page and "(+62%)" in page
    assert 'class="warn"' not in render_html([base, close])


def test_a_heavy_tail_is_warned_about_even_when_the_medians_agree() -> None:
    """Same median, but a tenth of b's steps take ten times as long (say, beside persists): its effective
    training per kept step is 1.9x, which is what its ETT counts."""
    from ettr.report.text import render_comparison

    def tailed(job_id: str, tail: bool):
        s = Stream()
        s.sup(EventKind.SUPERVISOR_START, 0)
        t = 2.0
        s.add(EventKind.TRAINING_START, 1, 0)
        for step in range(1, 101):
            t += 1.0 if not tail or step % 10 else 10.0
            s.add(EventKind.STEP, t, 0, step=step)
        s.attempt(0, 1, t + 1, "completed", 0)
        s.sup(EventKind.JOB_END, t + 2, 0, exit_status=0)
        return s.report(job_id=job_id)

    a, b = tailed("a", False), tailed("b", True)
    assert a.step_time_s == b.step_time_s == 1.0
    assert b.training_per_kept_step_s == pytest.approx(1.91)  # (2 s to the first step + 99 others) / 100
    text = render_comparison([a, b])
    assert "a step (+0%), effective training 1.91 s vs 1.01 s per kept step (+89%)" in text
    assert "so its slower steps raise it for the same work" in text
