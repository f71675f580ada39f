"""The step slowdown while persisting: synthetic jobs with a known inflation, and its renderings."""

from __future__ import annotations

import json

import pytest

from ettr.accounting import compute
from ettr.accounting.slowdown import WARMUP_STEPS, AttemptSteps, step_slowdown
from ettr.events import Event, EventKind, Phase
from ettr.report import html, text
from ettr.report.json import to_dict

T0 = 1_700_000_000.0


def approx(value: float) -> object:
    """Unix-time stamps keep about a microsecond: compare to that."""
    return pytest.approx(value, rel=1e-4, abs=1e-4)


def _job(
    *, steady: float, busy: float, windows: list[tuple[int, int]], num_steps: int = 200, attempt: int = 0
) -> list[Event]:
    """Steps of `steady` seconds, `busy` seconds while a persist runs; a window (a, b) covers steps a..b."""
    events = [Event(EventKind.PROCESS_START, T0, attempt, 0)]
    ts = T0 + 1.0
    starts: dict[int, float] = {}
    ends: dict[int, float] = {}
    for step in range(1, num_steps + 1):
        for a, _ in windows:
            if step == a:
                starts[a] = ts
        inside = any(a <= step <= b for a, b in windows)
        ts += busy if inside else steady
        events.append(Event(EventKind.STEP, ts, attempt, 0, step=step))
        for a, b in windows:
            if step == b:
                ends[a] = ts
    for a, _ in windows:
        events.append(
            Event(EventKind.PHASE_END, ends[a], attempt, 0, phase=Phase.CHECKPOINT_PERSIST, value=starts[a])
        )
    events.append(Event(EventKind.JOB_END, ts + 1.0, attempt, -1, data={"exit_status": 0}))
    return events


def test_known_inflation_per_save_and_in_total() -> None:
    report = compute(_job(steady=0.1, busy=0.15, windows=[(50, 59), (120, 139)]), now=T0 + 100)
    s = report.slowdown
    assert s is not None
    assert s.steady_step_s == approx(0.1)
    assert s.persist_step_s == approx(0.15)
    assert s.inflation == approx(1.5)
    assert s.inflation_pct == approx(50.0)
    assert [save.num_steps for save in s.saves] == [10, 20]
    assert [save.extra_s for save in s.saves] == [approx(0.5), approx(1.0)]
    assert s.extra_s == approx(1.5)
    assert s.num_busy_steps == 30
    # the buckets are unchanged: a slow step is still effective training
    plain = compute(_job(steady=0.1, busy=0.15, windows=[]), now=T0 + 100)
    assert plain.slowdown is None
    assert report.buckets_s.keys() == plain.buckets_s.keys()


def test_no_slowdown_is_one() -> None:
    s = compute(_job(steady=0.2, busy=0.2, windows=[(30, 40)]), now=T0).slowdown
    assert s is not None and s.inflation == approx(1.0) and s.extra_s == approx(0.0)


def test_no_persist_no_steps_and_no_busy_steps() -> None:
    assert step_slowdown([]) is None
    assert step_slowdown([AttemptSteps(0, [T0, T0 + 1], [])]) is None
    # a persist but no steps: known to exist, unknown slowdown
    s = step_slowdown([AttemptSteps(0, [], [(T0, T0 + 5, Phase.CHECKPOINT_PERSIST, "checkpoint_persist")])])
    assert s is not None and s.inflation is None and s.extra_s is None and len(s.saves) == 1
    assert s.saves[0].num_steps == 0 and s.saves[0].inflation is None
    # a persist after the last step: steady step time known, no busy step
    steps = [T0 + i for i in range(20)]
    s = step_slowdown([AttemptSteps(0, steps, [(T0 + 30, T0 + 35, Phase.CHECKPOINT_PERSIST, "p")])])
    assert s is not None and s.steady_step_s == approx(1.0) and s.inflation is None
    assert s.extra_s == 0.0  # no busy step cost nothing


def test_overlapping_windows_are_merged() -> None:
    steps = (
        [T0 + i for i in range(20)]
        + [T0 + 19 + 2 * i for i in range(1, 11)]
        + [T0 + 40 + i for i in range(10)]
    )
    persist = [
        (T0 + 19, T0 + 33, Phase.CHECKPOINT_PERSIST, "p"),
        (T0 + 30, T0 + 39, Phase.CHECKPOINT_PERSIST, "p"),
    ]
    s = step_slowdown([AttemptSteps(0, steps, persist)])
    assert s is not None and len(s.saves) == 1
    assert s.saves[0].start_ts == T0 + 19 and s.saves[0].end_ts == T0 + 39
    assert s.saves[0].num_steps == 10 and s.inflation == approx(2.0)


def test_warmup_and_blocking_steps_are_left_out() -> None:
    # slow first steps of every attempt and a checkpoint-blocking step must not move the steady time
    steps = [T0, T0 + 5, T0 + 10, T0 + 15] + [T0 + 15 + i for i in range(1, 30)]
    assert len(steps) - 1 > WARMUP_STEPS
    blocking = (T0 + 20.2, T0 + 20.9, Phase.CHECKPOINT_BLOCKING, "checkpoint_blocking")
    persist = (T0 + 21, T0 + 26, Phase.CHECKPOINT_PERSIST, "checkpoint_persist")
    steps_slow = [t if t <= T0 + 21 else t + min(t - (T0 + 21), 5.0) for t in steps]  # 2x inside the window
    s = step_slowdown([AttemptSteps(0, steps_slow, [blocking, persist])])
    assert s is not None and s.steady_step_s == approx(1.0) and s.inflation == approx(2.0)
    # a data wait inside every step does not hide the steps
    waits = [(t - 0.3, t - 0.1, Phase.DATA_WAIT, "data_wait") for t in steps_slow[1:]]
    s2 = step_slowdown([AttemptSteps(0, steps_slow, [blocking, persist, *waits])])
    assert s2 is not None and s2.inflation == approx(2.0)


def test_steps_recorded_twice_count_once() -> None:
    ts = [T0 + i for i in range(30)]
    doubled = [t for t in ts for _ in (0, 1)]
    numbers = [n for n in range(30) for _ in (0, 1)]
    persist = [(T0 + 40, T0 + 41, Phase.CHECKPOINT_PERSIST, "p")]
    s = step_slowdown([AttemptSteps(0, doubled, persist, numbers)])
    assert s is not None and s.steady_step_s == approx(1.0)


def test_attempts_each_skip_their_warmup() -> None:
    events = _job(steady=0.1, busy=0.3, windows=[(40, 49)], num_steps=80)
    events += [
        e for e in _job(steady=0.1, busy=0.3, windows=[], num_steps=80, attempt=1) if e.kind is EventKind.STEP
    ]
    later = [Event(e.kind, e.ts + 1000, e.attempt, e.rank, step=e.step) for e in events if e.attempt == 1]
    events = [e for e in events if e.attempt == 0] + later
    s = compute(events, now=T0 + 3000).slowdown
    assert s is not None and s.inflation == approx(3.0) and s.saves[0].attempt == 0


def test_renderings_carry_it() -> None:
    report = compute(_job(steady=0.1, busy=0.15, windows=[(50, 59)]), now=T0)
    out = json.loads(json.dumps(to_dict(report)))
    assert out["step_slowdown"]["inflation"] == approx(1.5)
    assert out["step_slowdown"]["saves"][0]["num_steps"] == 10
    assert out["schema"] == "ettr.report/1"
    rendered = text.render(report)
    assert "step slowdown while persisting: 1.50x" in rendered
    assert "persist at +" in rendered  # large: per save shown
    small = compute(_job(steady=0.1, busy=0.102, windows=[(50, 59)]), now=T0)
    assert "persist at +" not in text.render(small)
    assert "persist at +" in text.render(small, per_save=True)
    page = html.render_html([report])
    assert 'class="persist"' in page and "1.50x the steady step time" in page
    no_persist = compute(_job(steady=0.1, busy=0.1, windows=[]), now=T0)
    assert to_dict(no_persist)["step_slowdown"] is None
    assert "step slowdown" not in text.render(no_persist)


def test_auto_interval_counts_the_slowdown_as_save_cost() -> None:
    from ettr.checkpoint.policy import IntervalConfig, IntervalPolicy
    from ettr.simulate import optimal_interval_s

    config = IntervalConfig(auto=True, failures_per_day=4.0)
    plain, slowed = IntervalPolicy(config, now_s=0.0), IntervalPolicy(config, now_s=0.0)
    for policy in (plain, slowed):
        policy.observe_save(cost_s=0.5, now_s=0.0)
    slowed.observe_slowdown(30.0)  # a persist that made the steps beside it 30 s slower in all
    rate = plain.failures_per_day(0.0)
    assert plain.interval_s(0.0) == approx(optimal_interval_s(save_cost_s=0.5, failures_per_day=rate))
    assert slowed.interval_s(0.0) == approx(optimal_interval_s(save_cost_s=30.5, failures_per_day=rate))
    assert slowed.interval_s(0.0) > 5 * plain.interval_s(0.0)  # sqrt(61): the interval auto chooses moves
    small = IntervalPolicy(config, now_s=0.0)
    small.observe_save(cost_s=0.5, now_s=0.0)
    small.observe_slowdown(0.0)
    assert small.interval_s(0.0) == plain.interval_s(0.0)
    with pytest.raises(ValueError, match="slowdown"):
        optimal_interval_s(save_cost_s=1.0, failures_per_day=1.0, slowdown_s_per_save=-1.0)


def test_meter_measures_a_persists_extra_step_time() -> None:
    from ettr.checkpoint.slowdown_meter import SlowdownMeter

    meter = SlowdownMeter(warmup_steps=3)
    now, results = 0.0, []
    for i in range(60):
        persisting = 30 <= i < 40
        now += 0.3 if persisting else 0.1
        results.append(meter.on_step(now, persisting=persisting))
    finished = [r for r in results if r is not None]
    assert finished == [approx(10 * 0.2)]
    meter.reset()  # the next interval is not a step's: no sample from it
    assert meter.on_step(now + 100.0, persisting=False) is None


@pytest.mark.slow
def test_process_mode_job_report_matches_its_own_measurement(tmp_path) -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    from ettr.report.load import read_run

    script = Path(__file__).parent / "scripts" / "train_persist_slowdown.py"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parents[1] / "src"), os.environ.get("PYTHONPATH", "")]
        ),
    }
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path), "4"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    own = json.loads(done.stdout.strip().splitlines()[-1])
    events, report = read_run(tmp_path)
    s = report.slowdown
    assert s is not None and s.inflation is not None and len(s.saves) == 5  # warm-up save + 4 rounds
    assert own["num_busy"] > 0 and s.num_busy_steps > 0
    # What the two agree on whatever the load (the ratio itself is a figure of benchmarks/checkpoint_stall.py):
    # every step the job timed with no persist running lies outside every persist window of the ledger, so the
    # report counts it quiet; every step the report counts busy is one the job took while a persist ran (or the
    # one right after save(), which the job leaves out of both).
    step_ts = {e.step: e.ts for e in events if e.kind is EventKind.STEP and e.rank == 0 and e.attempt == 0}
    windows = [(save.start_ts, save.end_ts) for save in s.saves]
    quiet_steps = [number for number, kind in own["kinds"] if kind == "quiet"]
    for number in quiet_steps:
        begin, end = step_ts[number - 1], step_ts[number]
        assert all(end <= w_begin or begin >= w_end for w_begin, w_end in windows), number
    assert s.num_quiet_steps >= len(quiet_steps)
    num_busy_turns = len(s.saves) - 1
    assert s.num_busy_steps <= own["num_busy"] + num_busy_turns
    # the checkpoint process runs nicer than the training process
    assert own["children_nice"] and all(n > own["own_nice"] for n in own["children_nice"])


def test_lower_this_thread_leaves_the_caller_alone() -> None:
    import os
    import threading

    from ettr.checkpoint.priority import io_priority, lower_this_thread

    own = os.getpriority(os.PRIO_PROCESS, 0)
    seen: dict[str, int | None] = {}

    def worker() -> None:
        tid = threading.get_native_id()
        seen["lowered"] = int(lower_this_thread())
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, tid)
        seen["io"] = io_priority(tid)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    if own >= 19:
        pytest.skip("already at the lowest CPU priority")
    assert seen["lowered"] == 1 and seen["nice"] == min(19, own + 10)
    assert os.getpriority(os.PRIO_PROCESS, 0) == own  # training's thread keeps its priority
    if seen["io"] is not None:
        assert seen["io"] == (2 << 13) | 7
