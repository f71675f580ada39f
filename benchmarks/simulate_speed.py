"""How fast `ettr simulate` is: simulated job-days per second of wall time, measured side by side.

Two workloads (issue 17): a 30-day job on 16,384 GPUs (2,048 nodes) at Llama 3's interruption rate
(466 in 54 days), 10-minute restarts, 30 s saves at the model's optimal interval, 1,000 seeded runs
(goal: under 10 s); and a sweep of 20 intervals x 200 runs of the same job. Each is timed `--repeat`
times and the median is reported. `--json` ends with one object: scale_runs, scale_s, scale_job_days_per_s,
scale_interruptions, sweep_points, sweep_runs_per_point, sweep_s, sweep_job_days_per_s, goal_met, quick.
`--quick` (what CI runs): 50 runs, a sweep of 20 x 10 runs, each timed once (goal_met then says nothing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

from ettr.constants import SECONDS_PER_DAY
from ettr.simulate.analytic import optimal_interval_for
from ettr.simulate.params import JobParams
from ettr.simulate.summary import simulate
from ettr.simulate.sweep import default_intervals, sweep_interval

DAYS = 30.0
LLAMA3_PER_NODE_DAY = 466 / 54 / 2048


def job() -> JobParams:
    params = JobParams(
        gpus=16_384, gpus_per_node=8, failures_per_node_day=LLAMA3_PER_NODE_DAY, blocking_s=30.0,
        restart_gap_s=600.0, interval_s=1800.0, duration_s=DAYS * SECONDS_PER_DAY,
    )  # fmt: skip
    return replace(params, interval_s=optimal_interval_for(params))


def timed(fn, repeat: int) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    times, result = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000, help="runs of the 30-day job (1000)")
    parser.add_argument("--sweep-runs", type=int, default=200, help="runs per sweep point (200)")
    parser.add_argument("--repeat", type=int, default=3, help="timings per workload; the median is kept (3)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a few runs, timed once (CI's check)")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.sweep_runs, args.repeat = 50, 10, 1
    params = job()
    scale_s, summary = timed(lambda: simulate(params, runs=args.runs, seed=0), args.repeat)
    values = default_intervals(params, 20)
    sweep_s, _ = timed(lambda: sweep_interval(params, values, runs=args.sweep_runs, seed=0), args.repeat)
    result = {
        "scale_runs": args.runs,
        "scale_s": scale_s,
        "scale_job_days_per_s": args.runs * DAYS / scale_s,
        "scale_interruptions": summary.num_failures_mean * args.runs,  # type: ignore[attr-defined]
        "scale_ett_pct": summary.ett_pct,  # type: ignore[attr-defined]
        "sweep_points": len(values),
        "sweep_runs_per_point": args.sweep_runs,
        "sweep_s": sweep_s,
        "sweep_job_days_per_s": len(values) * args.sweep_runs * DAYS / sweep_s,
        "goal_met": None if args.quick else scale_s < 10.0,
        "quick": args.quick,
    }
    if not args.json:
        print(
            f"30-day 16,384-GPU job, {args.runs} runs: {scale_s:.2f} s "
            f"({result['scale_job_days_per_s']:,.0f} job-days/s, goal < 10 s: {({True: 'met', False: 'missed'}).get(result['goal_met'], 'not judged in quick mode')})"
        )
        print(f"sweep {len(values)} intervals x {args.sweep_runs} runs: {sweep_s:.2f} s")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
