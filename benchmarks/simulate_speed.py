"""How fast `ettr simulate` is: seconds and simulated job-days per second of wall time, measured side by side.

Workloads at Llama 3's interruption rate (466 in 54 days on 16,384 GPUs, per node), 10-minute restarts, 30 s
saves at the model's optimal interval, 30-day jobs of 1,000 seeded runs: on 16,384 GPUs (2,048 nodes, ~258
interruptions a run) and on 100,000 GPUs (12,500 nodes, ~1,580 a run; goal: under 10 s); and a sweep of 20
intervals x 200 runs of the 16,384-GPU job. `ettr simulate` runs many seeded runs together
(`ettr.simulate.batch`); the same runs one by one through the scalar loop (`model.simulate_seeded`, what
`ettr simulate` did before) are timed beside it, interleaved, and must give the same ETT (checked).
Each is timed `--repeat` times and the median kept.

`--json` ends with one object: scale_runs, scale_s, scale_job_days_per_s, scale_interruptions, scale_ett_pct,
scalar_scale_s, scale_speedup, big_gpus, big_runs, big_s, big_job_days_per_s, big_interruptions,
big_ett_pct, scalar_big_s, big_speedup, sweep_points, sweep_runs_per_point, sweep_s, sweep_job_days_per_s,
goal_met (big_s < 10; null in quick mode), quick. `--quick` (what CI runs): 50 runs of each job, a sweep of
20 x 10 runs, each timed once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ettr.constants import SECONDS_PER_DAY
from ettr.simulate.analytic import optimal_interval_for
from ettr.simulate.model import simulate_seeded
from ettr.simulate.params import JobParams
from ettr.simulate.summary import Summary, simulate, summarize
from ettr.simulate.sweep import default_intervals, sweep_interval

DAYS = 30.0
LLAMA3_PER_NODE_DAY = 466 / 54 / 2048


def job(gpus: int) -> JobParams:
    params = JobParams(
        gpus=gpus, gpus_per_node=8, failures_per_node_day=LLAMA3_PER_NODE_DAY, blocking_s=30.0,
        restart_gap_s=600.0, interval_s=1800.0, duration_s=DAYS * SECONDS_PER_DAY,
    )  # fmt: skip
    return replace(params, interval_s=optimal_interval_for(params))


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def one_by_one(params: JobParams, runs: int) -> Summary:
    """The same runs through the scalar loop, one at a time."""
    return summarize(params, [simulate_seeded(params, seed=0, run_index=i) for i in range(runs)])


def side_by_side(params: JobParams, runs: int, repeat: int) -> dict[str, Any]:
    """Batched and scalar timings of the same runs, interleaved; their ETT must agree."""
    batched_times, scalar_times = [], []
    batched: Summary | None = None
    scalar: Summary | None = None
    for _ in range(repeat):
        seconds, batched = timed(lambda: simulate(params, runs=runs, seed=0), 1)
        batched_times.append(seconds)
        seconds, scalar = timed(lambda: one_by_one(params, runs), 1)
        scalar_times.append(seconds)
    assert batched is not None and scalar is not None
    if abs(batched.ett_pct - scalar.ett_pct) > 1e-9 * max(1.0, scalar.ett_pct):
        raise SystemExit(f"the engines disagree: ETT {batched.ett_pct} batched vs {scalar.ett_pct} scalar")
    batched_s, scalar_s = statistics.median(batched_times), statistics.median(scalar_times)
    return {
        "s": batched_s,
        "job_days_per_s": runs * DAYS / batched_s,
        "interruptions": batched.num_failures_mean * runs,
        "ett_pct": batched.ett_pct,
        "scalar_s": scalar_s,
        "speedup": scalar_s / batched_s,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000, help="runs of each 30-day job (1000)")
    parser.add_argument("--big-gpus", type=int, default=100_000, help="GPUs of the large job (100000)")
    parser.add_argument("--sweep-runs", type=int, default=200, help="runs per sweep point (200)")
    parser.add_argument("--repeat", type=int, default=3, help="timings per workload; the median is kept (3)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a few runs, timed once (CI's check)")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.sweep_runs, args.repeat = 50, 10, 1
    if min(args.runs, args.sweep_runs, args.repeat) < 1 or args.big_gpus < 8:
        parser.error("--runs, --sweep-runs and --repeat must be >= 1, --big-gpus >= 8")
    scale = side_by_side(job(16_384), args.runs, args.repeat)
    print(
        f"30-day 16,384-GPU job, {args.runs} runs: {scale['s']:.2f} s ({scale['job_days_per_s']:,.0f} "
        f"job-days/s, {scale['interruptions']:,.0f} interruptions); one by one {scale['scalar_s']:.2f} s "
        f"({scale['speedup']:.1f}x)",
        file=sys.stderr,
    )
    big = side_by_side(job(args.big_gpus), args.runs, args.repeat)
    goal_met = None if args.quick else big["s"] < 10.0
    verdict = {True: "met", False: "missed", None: "not judged in quick mode"}[goal_met]
    print(
        f"30-day {args.big_gpus:,}-GPU job, {args.runs} runs: {big['s']:.2f} s ({big['job_days_per_s']:,.0f} "
        f"job-days/s, {big['interruptions']:,.0f} interruptions; goal < 10 s: {verdict}); one by one "
        f"{big['scalar_s']:.2f} s ({big['speedup']:.1f}x)",
        file=sys.stderr,
    )
    params = job(16_384)
    values = default_intervals(params, 20)
    sweep_s, _ = timed(lambda: sweep_interval(params, values, runs=args.sweep_runs, seed=0), args.repeat)
    print(f"sweep {len(values)} intervals x {args.sweep_runs} runs: {sweep_s:.2f} s", file=sys.stderr)
    result = {
        "scale_runs": args.runs,
        "scale_s": scale["s"],
        "scale_job_days_per_s": scale["job_days_per_s"],
        "scale_interruptions": scale["interruptions"],
        "scale_ett_pct": scale["ett_pct"],
        "scalar_scale_s": scale["scalar_s"],
        "scale_speedup": scale["speedup"],
        "big_gpus": args.big_gpus,
        "big_runs": args.runs,
        "big_s": big["s"],
        "big_job_days_per_s": big["job_days_per_s"],
        "big_interruptions": big["interruptions"],
        "big_ett_pct": big["ett_pct"],
        "scalar_big_s": big["scalar_s"],
        "big_speedup": big["speedup"],
        "sweep_points": len(values),
        "sweep_runs_per_point": args.sweep_runs,
        "sweep_s": sweep_s,
        "sweep_job_days_per_s": len(values) * args.sweep_runs * DAYS / sweep_s,
        "goal_met": goal_met,
        "quick": args.quick,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
