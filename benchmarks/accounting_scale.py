"""How `accounting.compute` scales: report time at 250k, 500k and 1M events, side by side in one run.

The stream is a long two-rank job with 4 attempts (3 failures), a data wait and a step on every
iteration, a blocking checkpoint every 100 steps and a commit after it. Prints the median of `--runs`
timings per size, the 1M/250k ratio (about 4 for O(n log n); 16 would be quadratic), and the cost of the
renderers at 1M events. `--json` ends with one object: report_250k_s, report_500k_s, report_1m_s,
ratio_1m_over_250k, to_dict_1m_s, render_1m_s, num_segments_1m, runs, quick, num_events (the sizes run, by
label). `--quick` (what CI runs): one timing per size, each size a tenth (25k, 50k and 100k events under the
same labels; `num_events` says so): seconds where the full sizes take minutes on a loaded machine, and the
ratio still shows whether compute scales linearly.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from ettr.accounting import compute
from ettr.events import SUPERVISOR_RANK, Event, EventKind, Phase
from ettr.report.json import to_dict
from ettr.report.text import render

K = EventKind


def synthetic_job(num_events: int) -> list[Event]:
    events = [Event(K.SUPERVISOR_START, 1_700_000_000.0, 0, SUPERVISOR_RANK)]
    t = events[0].ts + 5.0
    num_attempts, step, committed = 4, 0, 0
    per_attempt = num_events // num_attempts
    for attempt in range(num_attempts):
        events.append(Event(K.ATTEMPT_START, t, attempt, SUPERVISOR_RANK))
        events.append(Event(K.PHASE_BEGIN, t + 1, attempt, 0, phase=Phase.INIT))
        events.append(Event(K.PHASE_END, t + 20, attempt, 0, phase=Phase.INIT, value=t + 1))
        if attempt:
            events.append(Event(K.RESUMED, t + 21, attempt, 0, step=committed))
            step = committed
        t += 25.0
        start = len(events)
        while len(events) - start < per_attempt - 8:
            step += 1
            events.append(Event(K.PHASE_BEGIN, t, attempt, 0, phase=Phase.DATA_WAIT))
            events.append(Event(K.PHASE_END, t + 0.02, attempt, 0, phase=Phase.DATA_WAIT, value=t))
            events.append(Event(K.STEP, t + 0.2, attempt, 0, step=step))
            events.append(Event(K.STEP, t + 0.21, attempt, 1, step=step))
            t += 0.2
            if step % 100 == 0:
                events.append(Event(K.PHASE_BEGIN, t, attempt, 0, phase=Phase.CHECKPOINT_BLOCKING))
                events.append(
                    Event(K.PHASE_END, t + 1.0, attempt, 0, phase=Phase.CHECKPOINT_BLOCKING, value=t)
                )
                events.append(Event(K.CHECKPOINT_COMMIT, t + 3.0, attempt, 0, step=step))
                committed = step
                t += 1.0
        last = attempt == num_attempts - 1
        outcome = {"outcome": "completed", "exit_code": 0} if last else {"outcome": "failed", "exit_code": 1}
        events.append(Event(K.ATTEMPT_END, t + 2, attempt, SUPERVISOR_RANK, data=outcome))
        t += 10.0
    events.append(Event(K.JOB_END, t, num_attempts - 1, SUPERVISOR_RANK, data={"exit_status": 0}))
    return events


def median_time(fn, num_runs: int):  # type: ignore[no-untyped-def]
    """(median seconds of `num_runs` calls of fn, the last call's result)."""
    timings, result = [], None
    for _ in range(num_runs):
        t0 = time.perf_counter()
        result = fn()
        timings.append(time.perf_counter() - t0)
    return statistics.median(timings), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="timings per size (median is printed)")
    parser.add_argument("--json", action="store_true", help="end with one JSON object of the figures")
    parser.add_argument("--quick", action="store_true", help="one timing per size (CI's check that it runs)")
    args = parser.parse_args()
    if args.quick:
        args.runs = 1
    if args.runs < 1:
        parser.error("--runs must be >= 1")

    figures: dict[str, float | int | bool | dict[str, int]] = {}
    reports = {}
    scale = 10 if args.quick else 1
    num_events: dict[str, int] = {}
    timings: dict[str, float] = {}
    for label, n in (("250k", 250_000), ("500k", 500_000), ("1m", 1_000_000)):
        events = synthetic_job(n // scale)
        num_events[label] = len(events)
        now = events[-1].ts
        seconds, reports[label] = median_time(lambda events=events, now=now: compute(events, now), args.runs)
        figures[f"report_{label}_s"] = timings[label] = seconds
        print(
            f"compute  {len(events):>9,} events  {seconds:7.3f} s  ({seconds / len(events) * 1e6:.2f} us/event)"
        )
    figures["ratio_1m_over_250k"] = timings["1m"] / timings["250k"]
    print(
        f"ratio {num_events['1m']:,} / {num_events['250k']:,} events: {figures['ratio_1m_over_250k']:.2f} (4.0 = linear)"
    )
    big = reports["1m"]
    figures["to_dict_1m_s"] = median_time(lambda: to_dict(big, include_segments=False), args.runs)[0]
    figures["render_1m_s"] = median_time(lambda: render(big), args.runs)[0]
    figures["num_segments_1m"] = len(big.segments)
    figures["runs"], figures["quick"], figures["num_events"] = args.runs, args.quick, num_events
    print(f"to_dict (no segments) {figures['to_dict_1m_s']:.4f} s | render {figures['render_1m_s']:.4f} s")
    print(
        f"{num_events['1m']:,}-event job: {len(big.segments):,} timeline segments | {big.ett_pct:.1f}% ETT | wall {big.wall_s:.0f} s"
    )
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
