"""Recorder overhead on the training thread, and the cost of a report from 1,000,000 events.

Prints the per-event cost of `Recorder.step` / `Recorder.phase` with the writer thread running against
the real SQLite ledger (median of several runs), and how long `accounting.compute` takes on a 1M-event
stream with restarts, phases and checkpoints (`--events`), and what the slow-rank check adds on the training
thread: the bootstrap's backward hook (noting the rank's arrival at the gradient sync; its own cost, around a
no-op) and a step that carries an arrival. `--json` ends with one object: event_cost_us, phase_cost_us,
backward_hook_cost_us, step_with_arrival_cost_us, report_1m_events_s, ledger_write_1m_events_s, ledger_read_1m_events_s (each for `num_events`
events), num_events, quick. `--quick` (what CI runs): 200,000 events, one run of 20,000 recorder calls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from ettr.accounting import compute
from ettr.events import SUPERVISOR_RANK, Event, EventKind, Phase
from ettr.ledger import open_ledger
from ettr.recorder import Recorder


def event_cost_us(num_events: int, num_runs: int) -> tuple[float, float]:
    step_costs, phase_costs = [], []
    with tempfile.TemporaryDirectory() as run_dir:
        rec = Recorder(open_ledger(run_dir), run_dir=run_dir, flush_interval_s=0.5)
        for _ in range(num_runs):
            t0 = time.perf_counter()
            for i in range(num_events):
                rec.step(i)
            step_costs.append((time.perf_counter() - t0) / num_events * 1e6)
            t0 = time.perf_counter()
            for _ in range(num_events // 2):
                with rec.phase(Phase.DATA_WAIT):
                    pass
            phase_costs.append((time.perf_counter() - t0) / (num_events // 2) * 1e6)
            rec.flush()
        rec.close()
    return statistics.median(step_costs), statistics.median(phase_costs)


def arrival_cost_us(num_calls: int, num_runs: int) -> tuple[float, float]:
    """(the backward hook's own cost per backward, the cost of note_arrival + step per step), in us."""
    import types

    from ettr.bootstrap.hooks import AutoHooks

    hook_costs, step_costs = [], []
    with tempfile.TemporaryDirectory() as run_dir:
        rec = Recorder(open_ledger(run_dir), run_dir=run_dir, flush_interval_s=0.5)
        fake = types.SimpleNamespace(backward=lambda *args, **kwargs: None)
        direct = fake.backward
        hooks = AutoHooks(rec)
        hooks._install_backward_hook(types.SimpleNamespace(autograd=fake))  # noqa: SLF001 - the hook alone
        wrapped = fake.backward
        assert wrapped is not direct
        for _ in range(num_runs):
            t0 = time.perf_counter()
            for _ in range(num_calls):
                direct()
            base = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(num_calls):
                wrapped()
            hook_costs.append((time.perf_counter() - t0 - base) / num_calls * 1e6)
            t0 = time.perf_counter()
            for i in range(num_calls):
                rec.note_arrival()
                rec.step(i)
            step_costs.append((time.perf_counter() - t0) / num_calls * 1e6)
            rec.flush()
        hooks.uninstall()
        rec.close()
    return statistics.median(hook_costs), statistics.median(step_costs)


def synthetic_job(num_events: int) -> list[Event]:
    """A long job: 4 attempts (3 failures), start-up phases, steps, a checkpoint every 500 steps."""
    events: list[Event] = []
    t = 1_000_000.0
    events.append(Event(EventKind.SUPERVISOR_START, t, 0, SUPERVISOR_RANK, data={"pid": 1}))
    num_attempts = 4
    per_attempt = num_events // num_attempts
    step = 0
    for attempt in range(num_attempts):
        t += 1.0
        events.append(Event(EventKind.ATTEMPT_START, t, attempt, SUPERVISOR_RANK))
        events.append(Event(EventKind.PROCESS_START, t + 0.1, attempt, 0))
        events.append(Event(EventKind.PHASE_END, t + 5, attempt, 0, Phase.INIT, value=t + 0.2))
        events.append(Event(EventKind.PHASE_END, t + 9, attempt, 0, Phase.COMPILE, value=t + 5))
        t += 10
        if attempt:
            step -= 300  # resume from the last checkpoint
            events.append(Event(EventKind.RESUMED, t, attempt, 0, step=step))
        n = 0
        while n < per_attempt - 10:
            t += 0.01
            step += 1
            events.append(Event(EventKind.STEP, t, attempt, 0, step=step))
            n += 1
            if step % 500 == 0:
                events.append(
                    Event(EventKind.PHASE_END, t + 0.05, attempt, 0, Phase.CHECKPOINT_BLOCKING, value=t)
                )
                events.append(Event(EventKind.CHECKPOINT_COMMIT, t + 0.5, attempt, 0, step=step))
                t += 0.05
                n += 2
        outcome = "completed" if attempt == num_attempts - 1 else "failed"
        events.append(
            Event(EventKind.ATTEMPT_END, t + 0.5, attempt, SUPERVISOR_RANK, data={"outcome": outcome})
        )
    events.append(Event(EventKind.JOB_END, t + 1, num_attempts - 1, SUPERVISOR_RANK))
    return events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a small run (CI's check that it runs)")
    args = parser.parse_args()
    num_calls = 100_000
    if args.quick:
        args.events, args.runs, num_calls = 200_000, 1, 20_000
    if args.events < 1000 or args.runs < 1:
        parser.error("--events must be >= 1000 and --runs >= 1")

    step_us, phase_us = event_cost_us(num_calls, args.runs)
    hook_us, arrival_step_us = arrival_cost_us(num_calls, args.runs)
    events = synthetic_job(args.events)
    report_costs = []
    for _ in range(3):
        t0 = time.perf_counter()
        report = compute(events, events[-1].ts, job_id="bench")
        report_costs.append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as run_dir:
        ledger = open_ledger(run_dir)
        t0 = time.perf_counter()
        for i in range(0, len(events), 10_000):
            ledger.append(events[i : i + 10_000])
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        read_back = ledger.read()
        read_s = time.perf_counter() - t0
        assert len(read_back) == len(events)

    print(
        f"per-event cost on the training thread: step() {step_us:.2f} us, phase() {phase_us:.2f} us (2 events)"
    )
    print(
        f"report from {len(events):,} events: {statistics.median(report_costs):.2f} s "
        f"(ETT {report.ett_pct:.1f}%, {report.num_failures} failures)"
    )
    print(
        f"slow-rank check: backward hook {hook_us:.2f} us per backward, step() with an arrival "
        f"{arrival_step_us:.2f} us"
    )
    print(f"ledger: write {write_s:.2f} s, read {read_s:.2f} s for {len(events):,} events")
    if args.json:
        print(
            json.dumps(
                {
                    "event_cost_us": round(step_us, 3),
                    "phase_cost_us": round(phase_us, 3),
                    "backward_hook_cost_us": round(hook_us, 3),
                    "step_with_arrival_cost_us": round(arrival_step_us, 3),
                    "report_1m_events_s": round(statistics.median(report_costs), 3),
                    "ledger_write_1m_events_s": round(write_s, 3),
                    "ledger_read_1m_events_s": round(read_s, 3),
                    "num_events": len(events),
                    "quick": args.quick,
                }
            )
        )


if __name__ == "__main__":
    main()
