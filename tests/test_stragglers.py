"""Slow ranks (`ettr.accounting.stragglers`), slow steps (`slowsteps`) and windowed ETT (`window`): pure, from
hand-made events; the arrival the bootstrap records (`Recorder.note_arrival`); and a real 2-rank job."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from ettr.accounting import DEFAULT_WINDOW_S, compute
from ettr.events import SUPERVISOR_RANK, Bucket, Event, EventKind

T0 = 1_700_000_000.0
STEP_S = 0.1


def job(
    *,
    num_ranks: int = 2,
    num_steps: int = 200,
    slow: dict[int, tuple[int, int, float]] | None = None,
    hosts: dict[int, str] | None = None,
    arrivals: bool = True,
    seed: int = 0,
) -> list[Event]:
    """One attempt of `num_ranks` ranks in lockstep, `STEP_S` a step; `slow[r] = (from, to, s)`: rank r
    reaches the sync `s` late at steps from..to, and every rank's step waits for it. Arrivals jitter a little."""
    rng = random.Random(seed)
    slow = slow or {}
    events = [
        Event(EventKind.SUPERVISOR_START, T0, 0, SUPERVISOR_RANK, data={"pid": 1}),
        Event(EventKind.ATTEMPT_START, T0, 0, SUPERVISOR_RANK),
    ]
    for r in range(num_ranks):
        data = {"pid": 10 + r, "host": (hosts or {}).get(r, "h0")}
        events.append(Event(EventKind.PROCESS_START, T0 + 0.1, 0, r, data=data))
    t = T0 + 1.0
    for step in range(1, num_steps + 1):
        late = {r: s for r, (a, b, s) in slow.items() if a <= step <= b}
        wait = max(late.values(), default=0.0)
        sync = t + 0.5 * STEP_S
        for r in range(num_ranks):
            arrival = sync + late.get(r, 0.0) + rng.uniform(0, 0.004)
            done = t + STEP_S + wait
            value = arrival if arrivals else None
            events.append(Event(EventKind.STEP, done + rng.uniform(0, 0.001), 0, r, step=step, value=value))
        t += STEP_S + wait
    events.append(
        Event(
            EventKind.ATTEMPT_END, t + 0.5, 0, SUPERVISOR_RANK, data={"outcome": "completed", "exit_code": 0}
        )
    )
    events.append(Event(EventKind.JOB_END, t + 1.0, 0, SUPERVISOR_RANK, data={"exit_status": 0}))
    return events


def report(events: list[Event], **kw):
    return compute(events, max(e.ts for e in events), job_id="j", **kw)


def drifting(num_steps: int = 200) -> list[Event]:
    """Two ranks that never sync (two independent trainers under one torchrun): rank 1 takes 50% longer a
    step, so at the same step number it is further and further behind rank 0."""
    events = [
        Event(EventKind.SUPERVISOR_START, T0, 0, SUPERVISOR_RANK, data={"pid": 1}),
        Event(EventKind.ATTEMPT_START, T0, 0, SUPERVISOR_RANK),
    ]
    for r, step_s in ((0, STEP_S), (1, 1.5 * STEP_S)):
        events.append(Event(EventKind.PROCESS_START, T0 + 0.1, 0, r, data={"pid": 10 + r, "host": "h0"}))
        for step in range(1, num_steps + 1):
            done = T0 + 1.0 + step * step_s
            events.append(Event(EventKind.STEP, done, 0, r, step=step, value=done - 0.5 * step_s))
    end = T0 + 2.0 + num_steps * 1.5 * STEP_S
    events.append(
        Event(EventKind.ATTEMPT_END, end, 0, SUPERVISOR_RANK, data={"outcome": "completed", "exit_code": 0})
    )
    events.append(Event(EventKind.JOB_END, end + 0.5, 0, SUPERVISOR_RANK, data={"exit_status": 0}))
    return events


def test_ranks_that_do_not_step_together_are_not_compared_and_no_wait_exceeds_the_wall():
    # Found on examples/plain/train.py under torchrun (two trainers, no DDP): 'the job waited 19543.0 s' for
    # a rank in a 90 s job. A drift is no wait: such ranks are not compared, and the report says why.
    events = drifting()
    r = report(events)
    speed = r.rank_speed
    assert speed is not None and not speed.checked and speed.stragglers == ()
    assert "do not step together" in speed.reason
    assert speed.lost_s is None
    # ranks in lockstep are still compared, and no episode's wait is longer than the job itself
    locked = report(job(slow={1: (101, 200, 0.05)}))
    assert locked.rank_speed is not None and locked.rank_speed.checked
    assert locked.rank_speed.lost_s is not None and locked.rank_speed.lost_s <= locked.wall_s


def test_a_rank_late_at_the_sync_is_named_with_since_when_how_much_and_the_wait():
    r = report(job(slow={1: (101, 200, 0.05)}))
    speed = r.rank_speed
    assert speed is not None and speed.checked and speed.source == "arrival" and speed.num_ranks == 2
    (s,) = speed.stragglers
    assert (s.ranks, s.node, s.host, s.first_step, s.last_step, s.until_end) == (
        (1,),
        False,
        "h0",
        101,
        200,
        True,
    )
    assert s.extra_per_step_s == pytest.approx(0.05, abs=0.005)
    assert s.lost_s == pytest.approx(100 * 0.05, abs=0.5)  # the job waited ~50 ms at each of 100 steps
    assert s.step_s == pytest.approx(STEP_S + 0.05, abs=0.002)
    assert s.slower_pct == pytest.approx(50.0, abs=6.0)  # 150 ms where its peer needed ~100
    assert s.name == "rank 1 (host h0)"
    assert r.slow_steps is not None and r.slow_steps.straggler_s == pytest.approx(s.lost_s)


def test_jitter_alone_is_no_straggler_and_a_transient_one_ends():
    assert report(job()).rank_speed.stragglers == ()
    (s,) = report(job(num_ranks=4, slow={2: (50, 120, 0.03)})).rank_speed.stragglers
    assert (s.ranks, s.first_step, s.last_step, s.until_end) == ((2,), 50, 120, False)


def test_a_whole_slow_node_is_named_as_the_node():
    hosts = {0: "a", 1: "a", 2: "b", 3: "b"}
    (s,) = report(
        job(num_ranks=4, hosts=hosts, slow={2: (30, 200, 0.04), 3: (30, 200, 0.04)})
    ).rank_speed.stragglers
    assert (s.ranks, s.node, s.host, s.first_step) == ((2, 3), True, "b", 30)
    assert s.name == "node b (ranks 2-3)"
    assert s.lost_s == pytest.approx(171 * 0.04, abs=1.0)


def test_without_arrivals_the_step_times_stand_in():
    """STEP times are the same on every rank of a job that syncs: a rank late before the sync does not show
    (said by `source`), one that does not sync at all does."""
    r = report(job(arrivals=False, slow={1: (101, 200, 0.05)}))
    assert r.rank_speed.source == "step" and r.rank_speed.stragglers == ()
    assert "by the time each rank recorded each step" in r.rank_speed.reason


def test_unknown_when_the_ranks_cannot_be_compared():
    one = report(job(num_ranks=1)).rank_speed
    assert not one.checked and one.reason == "one rank: no peers to compare" and one.lost_s is None
    events = job(slow={1: (101, 200, 0.05)})
    rank1_steps = [e for e in events if e.kind is EventKind.STEP and e.rank == 1]
    fewer = (
        [e for e in events if not (e.kind is EventKind.STEP and e.rank == 1)]
        + rank1_steps[:1]
        + rank1_steps[-1:]
    )
    reduced = report(fewer)  # what the fleet reads of a running job: the other ranks' first and last step
    assert not reduced.rank_speed.checked and "not in the events read" in reduced.rank_speed.reason
    assert reduced.slow_steps.straggler_s is None


def test_the_reports_name_the_slow_rank():
    from ettr.report.html import render_html
    from ettr.report.json import to_dict
    from ettr.report.text import render

    r = report(job(slow={1: (101, 200, 0.05)}))
    text = render(r)
    assert "slow ranks (2 ranks compared over 200 steps by each rank's arrival at the gradient sync" in text
    assert "  rank 1 (host h0) slower than its peers from step 101 (+" in text and "to the end: +" in text
    assert "the job waited 5." in text
    data = json.loads(json.dumps(to_dict(r)))
    (s,) = data["rank_speed"]["stragglers"]
    assert (s["ranks"], s["first_step"], s["name"]) == ([1], 101, "rank 1 (host h0)")
    assert data["slow_steps"]["straggler_s"] == pytest.approx(s["lost_s"])
    assert "rank 1 (host h0) slower than its peers" in render_html([r])
    assert "slow ranks: none" in render(report(job()))
    assert "slow ranks" not in render(report(job(num_ranks=1)))  # one rank: nothing to compare, nothing said


# -- slow steps ------------------------------------------------------------------------------------------
def _resumed_job(interval_s, num_steps: int = 50) -> list[Event]:
    """Attempt 0 takes 50 steps of 0.1 s and fails after committing step 50; attempt 1 resumes from it and
    takes `num_steps` more, the interval before its (i+1)-th step being `interval_s(i)`."""
    ev = [Event(EventKind.SUPERVISOR_START, T0, 0, SUPERVISOR_RANK, data={"pid": 1})]
    ev.append(Event(EventKind.ATTEMPT_START, T0, 0, SUPERVISOR_RANK))
    ev += [Event(EventKind.STEP, T0 + 1 + 0.1 * i, 0, 0, step=i + 1) for i in range(50)]
    ev.append(Event(EventKind.CHECKPOINT_COMMIT, T0 + 6.0, 0, 0, step=50, data={"path": "c"}))
    ev.append(
        Event(EventKind.ATTEMPT_END, T0 + 7, 0, SUPERVISOR_RANK, data={"outcome": "failed", "exit_code": 1})
    )
    ev.append(Event(EventKind.ATTEMPT_START, T0 + 8, 1, SUPERVISOR_RANK))
    ev.append(Event(EventKind.RESUMED, T0 + 9, 1, 0, step=50))
    t, times = T0 + 10, []
    for i in range(num_steps):
        t += interval_s(i)
        times.append(t)
    ev += [Event(EventKind.STEP, ts, 1, 0, step=51 + i) for i, ts in enumerate(times)]
    ev.append(
        Event(EventKind.ATTEMPT_END, t + 1, 1, SUPERVISOR_RANK, data={"outcome": "completed", "exit_code": 0})
    )
    ev.append(Event(EventKind.JOB_END, t + 2, 1, SUPERVISOR_RANK, data={"exit_status": 0}))
    return ev


def test_a_slow_warm_up_after_a_restart_is_measured_beside_ett():
    """Attempt 1 resumes and its first 5 kept steps take 3 steady steps each: 5 x 2 x 0.1 s beyond."""
    # intervals of steps 52..56 are slow (51 is the first: no interval)
    r = report(_resumed_job(lambda i: 0.3 if 1 <= i <= 5 else 0.1))
    s = r.slow_steps
    assert s is not None and s.steady_step_s == pytest.approx(0.1)
    (w,) = s.warmups
    assert (w.attempt, w.num_steps) == (1, 5) and w.extra_s == pytest.approx(1.0)
    assert s.after_restart_s == pytest.approx(1.0) and s.persist_s is None
    from ettr.report.text import render

    assert (
        "slow steps beyond the steady 100.0 ms a step (counted as training, beside ETT): 1.0 s warming up"
        in render(r)
    )
    assert s.slow_attempts == ()


def test_an_attempt_slower_throughout_is_not_a_warm_up():
    """Attempt 1 (requeued onto a busier machine) takes 0.4 s for each of its 30 steps where attempt 0 took
    0.1 s: not 8.7 s "warming up after restarts" (29 timed steps, the whole attempt) but an attempt slower
    throughout, measured as such; attempt 0 is the steady state."""
    r = report(_resumed_job(lambda i: 0.4, num_steps=30))
    s = r.slow_steps
    assert s is not None and s.steady_step_s == pytest.approx(0.1, rel=1e-4)
    assert s.warmups == () and s.after_restart_s == 0.0
    (a,) = s.slow_attempts
    assert (a.attempt, a.num_steps) == (1, 29) and a.step_s == pytest.approx(0.4, rel=1e-4)
    assert a.extra_s == pytest.approx(29 * 0.3, rel=1e-4)
    from ettr.report.json import to_dict
    from ettr.report.text import render

    line = next(x for x in render(r).splitlines() if x.startswith("slow steps"))
    assert "warming up" not in line and "no slow warm-up" not in line
    assert "8.7 s in attempt 1, slower throughout (400.0 ms a step over 29 steps" in line
    (j,) = to_dict(r)["slow_steps"]["slow_attempts"]
    assert (j["attempt"], j["num_steps"]) == (1, 29) and j["extra_s"] == pytest.approx(8.7, rel=1e-4)
    # steps a little faster beside checkpoint persists than steady: no slowdown there, never "-0.0 s"
    from dataclasses import replace

    from ettr.report.slow import text_lines

    faster = replace(r, slow_steps=replace(s, persist_s=-0.02))
    (line,) = [x for x in text_lines(faster) if x.startswith("slow steps")]
    assert "; 0.0 s beside checkpoint persists" in line and "-0.0" not in line
    # a short slow stretch at the start is still a warm-up: a few slow steps, then steady
    r = report(_resumed_job(lambda i: 0.4 if i < 8 else 0.1, num_steps=30))
    assert r.slow_steps is not None and r.slow_steps.slow_attempts == ()
    assert r.slow_steps.warmups[0].num_steps == 7


# -- windowed ETT ----------------------------------------------------------------------------------------
def _two_hours() -> list[Event]:
    """Trains from 0 to 3600 s; then fails at 5400 s (1800 s of steps lost after the last commit at 3600),
    restarts and trains again from 5600 s to 7200 s."""
    ev = [Event(EventKind.SUPERVISOR_START, T0, 0, SUPERVISOR_RANK, data={"pid": 1})]
    ev.append(Event(EventKind.ATTEMPT_START, T0, 0, SUPERVISOR_RANK))
    ev += [Event(EventKind.STEP, T0 + 10.0 * i, 0, 0, step=i) for i in range(1, 541)]  # 10 .. 5400
    ev.append(Event(EventKind.CHECKPOINT_COMMIT, T0 + 3600.5, 0, 0, step=360, data={"path": "c"}))
    ev.append(
        Event(
            EventKind.ATTEMPT_END, T0 + 5400, 0, SUPERVISOR_RANK, data={"outcome": "failed", "exit_code": 1}
        )
    )
    ev.append(Event(EventKind.ATTEMPT_START, T0 + 5500, 1, SUPERVISOR_RANK))
    ev.append(Event(EventKind.RESUMED, T0 + 5590, 1, 0, step=360))
    ev.append(Event(EventKind.TRAINING_START, T0 + 5600, 1, 0))
    ev += [Event(EventKind.STEP, T0 + 5600 + 10.0 * i, 1, 0, step=360 + i) for i in range(1, 161)]  # .. 7200
    ev.append(
        Event(
            EventKind.ATTEMPT_END,
            T0 + 7200,
            1,
            SUPERVISOR_RANK,
            data={"outcome": "completed", "exit_code": 0},
        )
    )
    ev.append(Event(EventKind.JOB_END, T0 + 7200, 1, SUPERVISOR_RANK, data={"exit_status": 0}))
    return ev


def test_the_last_hour_is_reported_beside_the_whole_job():
    r = report(_two_hours())
    w = r.window
    assert w is not None and w.window_s == DEFAULT_WINDOW_S and w.covered_s == 3600.0
    # The last hour (3600 -> 7200): 1800 s of lost steps, 200 s of restart and start-up, 1600 s trained.
    assert w.ett_pct == pytest.approx(1600 / 3600 * 100)
    assert w.failure_pct == pytest.approx(2000 / 3600 * 100)
    assert w.buckets_s[Bucket.WASTED_PROGRESS] == pytest.approx(1800)
    assert r.ett_pct == pytest.approx((3600 - 10 + 1600) / 7200 * 100, abs=0.2)  # diluted by the good hour
    last_10_min = report(_two_hours(), window_s=600).window
    assert last_10_min.window_s == 600 and last_10_min.ett_pct == pytest.approx(100.0)
    whole = report(job())  # 27 s long: the window covers all of it
    short = whole.window
    assert short.covered_s == pytest.approx(whole.wall_s) and short.covered_s < short.window_s
    assert short.ett_pct == pytest.approx(whole.ett_pct)
    with pytest.raises(ValueError):
        report(job(), window_s=0)


def test_the_reports_show_the_window():
    from ettr.report.json import to_dict
    from ettr.report.text import render

    r = report(_two_hours())
    assert "ETT over the last 1 h: 44.4% (idle 0.0%, failure 55.6%) | cumulative 72.2%" in render(r)
    data = to_dict(r)["ett_window"]
    assert data["window_s"] == 3600 and data["ett_pct"] == pytest.approx(44.444, abs=0.01)
    assert "ETT over the last" not in render(report(job()))  # 27 s: the window is the whole job, said above
    assert "ETT over the last 10 min: 100.0%" in render(report(_two_hours(), window_s=600))


def test_ettr_report_takes_the_window(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    from ettr.cli import main
    from ettr.ledger import open_ledger

    ledger = open_ledger(tmp_path / "run")
    ledger.append(_two_hours())
    ledger.close()
    assert main(["report", str(tmp_path / "run"), "--json", "--window", "600"]) == 0
    assert json.loads(capsys.readouterr().out)["ett_window"]["window_s"] == 600
    assert main(["report", str(tmp_path / "run"), "--window", "-5"]) == 2


# -- what the training process records --------------------------------------------------------------------
def test_the_arrival_rides_on_the_next_step_and_the_backward_hook_notes_it(tmp_path: Path):
    import torch

    from ettr.bootstrap.hooks import AutoHooks
    from ettr.ledger import open_ledger
    from ettr.recorder import Recorder

    ledger = open_ledger(tmp_path / "run")
    rec = Recorder(ledger, run_dir=tmp_path / "run", attempt=0, rank=0)
    hooks = AutoHooks(rec)
    hooks.on_torch(torch)
    try:
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()  # Tensor.backward -> torch.autograd.backward
            optimizer.step()
        optimizer.step()  # a step without a backward carries no arrival
        rec.flush()
        steps = [e for e in ledger.read() if e.kind is EventKind.STEP]
        assert [e.step for e in steps] == [1, 2, 3]
        assert all(e.value is not None and e.ts - 5 < e.value <= e.ts for e in steps[:2])
        assert steps[2].value is None
    finally:
        hooks.uninstall()
        rec.close()
    assert not hasattr(torch.autograd.backward, "__ettr_original__")


@pytest.mark.slow
def test_a_real_two_rank_job_with_a_slowed_rank(tmp_path: Path):
    """torchrun, 2 gloo ranks in DDP; rank 1 sleeps 0.25 s before its forward from step 31 on (the other waits
    for it in the gradient sync): the report names rank 1 from step 31 to the end, and what it cost."""
    import subprocess

    script = tmp_path / "slow_rank.py"
    script.write_text(SLOW_RANK_SCRIPT)
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "ettr.cli", "run", "--run-dir", str(run_dir), "--", sys.executable, "-m",
         "torch.distributed.run", "--nproc-per-node=2", "--master-port=0", str(script)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    from ettr.report.load import read_run

    _events, r = read_run(run_dir)
    speed = r.rank_speed
    assert speed is not None and speed.checked and speed.source == "arrival", speed
    (s,) = speed.stragglers
    assert s.ranks == (1,) and 31 <= s.first_step <= 34 and s.until_end, s
    assert s.extra_per_step_s > 0.1 and s.lost_s is not None and s.lost_s > 0.1 * 25, s


SLOW_RANK_SCRIPT = """
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(1, 61):
    if rank == 1 and step >= 31:
        time.sleep(0.25)
    loss = model(torch.randn(8, 16)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
dist.destroy_process_group()
"""


def test_a_rank_without_arrivals_for_a_while_is_not_read_as_late():
    """Rank 1's first 80 steps carry no arrival (say its backward was not hooked yet): those steps are not
    compared, rather than its STEP time (after the sync) read against its peer's arrival (before it)."""
    events = [
        Event(e.kind, e.ts, e.attempt, e.rank, e.phase, e.step, None, e.data)
        if e.kind is EventKind.STEP and e.rank == 1 and e.step <= 80
        else e
        for e in job()
    ]
    speed = report(events).rank_speed
    assert speed.source == "arrival" and speed.stragglers == () and speed.num_compared_steps == 120


def test_many_short_episodes_are_the_costliest_few_and_a_count():
    """Slurm trial: a 2-rank CPU job under load listed 16 straggler lines, one rank or the other late for a
    while: the text lists the episodes the job waited for longest, then how many more and their cost."""
    from dataclasses import replace

    from ettr.report.slow import MAX_STRAGGLER_LINES, text_lines

    r = report(job(slow={1: (101, 200, 0.05)}))
    (one,) = r.rank_speed.stragglers
    many = tuple(replace(one, first_step=10 * i, lost_s=float(i)) for i in range(1, 17))
    lines = text_lines(replace(r, rank_speed=replace(r.rank_speed, stragglers=many)))
    listed = [line for line in lines if "slower than its peers" in line]
    assert len(listed) == MAX_STRAGGLER_LINES
    assert all(f"from step {10 * i} " in line for i, line in zip(range(12, 17), listed, strict=True))
    assert "  and 11 more episode(s), the job waited 66.0 s for them in all" in "\n".join(lines)
