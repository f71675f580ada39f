"""`ettr simulate`: what-if ETT of a job from flags or from its own ledger (`--from RUN_DIR`).

The argparse front is `add_arguments`; `main` builds the job's `JobParams` (a measured profile, then the
flags over it), runs the model and prints a table, or one JSON object with `--json`. Bad parameters are
one line on stderr and exit status 2 (a `UsageError`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from typing import Any

from ettr.argtypes import path_arg
from ettr.constants import SECONDS_PER_DAY
from ettr.errors import UsageError
from ettr.simulate.analytic import optimal_interval_for
from ettr.simulate.params import DEFAULT_GPUS_PER_NODE, MAX_GPUS, JobParams, RecoveryKind, Startup

LLAMA3_FAILURES_PER_NODE_DAY = 466 / 54 / (16_384 / 8)
"""The default failure rate: Llama 3's 466 interruptions in 54 days on 16,384 GPUs (8 per node)."""

EPILOG = """examples:
  ettr simulate --failures-per-node-day 3 --checkpoint-blocking-s 15 --interval auto
  ettr simulate --mtbf-hours 6 --checkpoint-blocking-s 300 --restart-s 600 --sweep interval
  ettr simulate --gpus 16384 --duration-hours 720 --restart-s 600 --checkpoint-blocking-s 30 --json
  ettr simulate --gpus 10000 --restart-s 600 --recovery in_place=2:0.8 --json   # what restart in place is worth
  ettr simulate --from runs/job1 --gpus 2048 --duration-hours 336 --compare
  ettr simulate --from runs/job1 --replay          # the job's own failures: predicted vs measured
  ettr simulate --fleet-experiment --json          # preemption victims: random vs lowest cost
"""


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def _recovery(text: str) -> RecoveryKind:
    name, _, rest = text.partition("=")
    cost, _, share = rest.partition(":")
    try:
        return RecoveryKind(name=name.strip(), cost_s=float(cost), share=float(share))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc} (expected KIND=SECONDS:SHARE)") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    p.add_argument(
        "--from",
        dest="from_dir",
        type=path_arg,
        metavar="RUN_DIR",
        help="measure the job's profile from its ledger",
    )
    p.add_argument("--replay", action="store_true", help="with --from: re-create the job's own failures")
    p.add_argument("--gpus", type=_int, metavar="N", help="GPUs of the job (8; --from: the job's)")
    p.add_argument("--gpus-per-node", type=_int, metavar="G", help="GPUs per node (8)")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument(
        "--failures-per-node-day", type=_float, metavar="F", help="failures per node per day (Llama 3's rate)"
    )
    rate.add_argument("--mtbf-hours", type=_float, metavar="H", help="the job's mean time between failures")
    p.add_argument(
        "--restart-s", type=_float, metavar="S", help="whole cost of one restart, lost work excluded (0)"
    )
    p.add_argument(
        "--recovery",
        action="append",
        type=_recovery,
        metavar="KIND=S:SHARE",
        help="a way failures are recovered (in_place, warm_restart, cold_restart, requeue) at S s each, for "
        "SHARE of the failures (0..1; repeatable); the others cost --restart-s",
    )
    p.add_argument(
        "--checkpoint-blocking-s", type=_float, metavar="S", help="seconds a save blocks training (15)"
    )
    interval = p.add_mutually_exclusive_group()
    interval.add_argument("--interval-s", type=_float, metavar="S", help="training seconds between saves")
    interval.add_argument("--interval", choices=["auto"], help="auto: the model's optimum (the default)")
    p.add_argument(
        "--duration-hours", type=_float, metavar="H", help="wall time of the job (24; --from: its steps)"
    )
    p.add_argument("--step-s", type=_float, metavar="S", help="seconds per step (1; --from: measured)")
    p.add_argument("--runs", type=_int, default=200, metavar="N", help="seeded runs (200)")
    p.add_argument("--seed", type=_int, default=0, metavar="N", help="seed of the runs (0)")
    p.add_argument("--sweep", choices=["interval", "gpus"], help="sweep a parameter; print the optimum")
    p.add_argument("--sweep-values", metavar="V,V,...", help="the swept values (default: around the optimum)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    extra = p.add_argument_group("more options")
    extra.add_argument("--persist-s", type=_float, metavar="S", help="async persist after the blocking (0)")
    extra.add_argument(
        "--weibull-shape", type=_float, metavar="K", help="per-node Weibull shape (1: exponential)"
    )
    extra.add_argument(
        "--preemptions-per-day", type=_float, metavar="P", help="scheduler preemptions per day (0)"
    )
    extra.add_argument("--no-save-on-preempt", action="store_true", help="a preemption loses unsaved work")
    extra.add_argument("--startup-s", type=_float, metavar="S", help="first attempt's start-up (init; 0)")
    extra.add_argument("--shutdown-s", type=_float, metavar="S", help="last step to the job's end (0)")
    extra.add_argument("--compare", action="store_true", help="policies side by side (sync/async, ...)")
    extra.add_argument(
        "--async-blocking-s", type=_float, metavar="S", help="--compare: async save's blocking"
    )
    extra.add_argument(
        "--cached-compile-s", type=_float, metavar="S", help="--compare: compile on a cache hit"
    )
    extra.add_argument("--publish-s", type=_float, metavar="S", help="--compare: in-job publishing cost")
    extra.add_argument(
        "--html", type=path_arg, metavar="FILE", help="also write a self-contained HTML page of the charts"
    )
    extra.add_argument(
        "--fleet-experiment", action="store_true", help="preemption victims: random vs lowest cost"
    )
    extra.add_argument("--fleet-jobs", type=_int, metavar="M", help="--fleet-experiment: jobs (32)")
    extra.add_argument(
        "--demands-per-day", type=_float, metavar="D", help="--fleet-experiment: demands/day (24)"
    )
    extra.add_argument(
        "--demand-gpus", type=_int, metavar="N", help="--fleet-experiment: GPUs per demand (256)"
    )


def _fail(message: str) -> UsageError:
    return UsageError(f"ettr simulate: {message}")


MAX_RUNS = 10_000
"""Seeded runs per simulated job: 1,000 give a 95% interval of a few hundredths of a point."""
MAX_RUN_POINTS = 50_000
"""Runs times the points of a sweep or rows of a comparison (each run costs about a millisecond)."""
MAX_SECONDS = 10 * 365 * SECONDS_PER_DAY
"""Any time flag (seconds) and the window (`--duration-hours`) at most ten years."""
MAX_PER_DAY = 1_000_000.0
"""Any rate flag (per day) at most a million: an event every 86 ms."""
WEIBULL_SHAPES = (0.25, 20.0)
"""Shapes outside these make a node's mean life a sum of absurdly many (or almost equal) lifetimes."""
MAX_SWEEP_POINTS = 100
MAX_FLEET_JOBS = 100_000

_SECONDS_FLAGS = (
    "restart_s", "checkpoint_blocking_s", "interval_s", "step_s", "persist_s", "startup_s", "shutdown_s",
    "async_blocking_s", "cached_compile_s", "publish_s",
)  # fmt: skip
_PER_DAY_FLAGS = ("failures_per_node_day", "preemptions_per_day", "demands_per_day")
_COUNT_FLAGS = {
    "gpus": MAX_GPUS,
    "gpus_per_node": MAX_GPUS,
    "runs": MAX_RUNS,
    "fleet_jobs": MAX_FLEET_JOBS,
    "demand_gpus": MAX_GPUS,
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_ranges(args: argparse.Namespace) -> None:
    """Every number in its range, before any work: one line naming the flag (UsageError)."""
    for name, value in vars(args).items():
        if isinstance(value, float) and not (math.isfinite(value) and value >= 0):
            raise _fail(f"{_flag(name)} must be a finite number >= 0, got {value} (see --help)")
    for name, most in _COUNT_FLAGS.items():
        value = getattr(args, name)
        if value is not None and not 1 <= value <= most:
            raise _fail(f"{_flag(name)} must be between 1 and {most:,}, got {_short(value)}")
    if args.seed < 0:
        raise _fail(f"--seed must be >= 0, got {_short(args.seed)}")
    for name in ("mtbf_hours", "duration_hours", "step_s", "interval_s", "weibull_shape"):
        if getattr(args, name) == 0:
            raise _fail(f"{_flag(name)} must be > 0")
    for name in _SECONDS_FLAGS:
        value = getattr(args, name)
        if value is not None and value > MAX_SECONDS:
            raise _fail(f"{_flag(name)} must be at most {MAX_SECONDS:,.0f} s (ten years), got {value:g}")
    for name in ("duration_hours", "mtbf_hours"):
        value = getattr(args, name)
        if value is not None and value * 3600 > MAX_SECONDS:
            raise _fail(f"{_flag(name)} must be at most {MAX_SECONDS / 3600:,.0f} (ten years), got {value:g}")
    if args.mtbf_hours is not None and args.mtbf_hours * 3600 < 1.0:
        raise _fail(f"--mtbf-hours must be at least one second ({1 / 3600:.2g} h), got {args.mtbf_hours:g}")
    for name in _PER_DAY_FLAGS:
        value = getattr(args, name)
        if value is not None and value > MAX_PER_DAY:
            raise _fail(f"{_flag(name)} must be at most {MAX_PER_DAY:,.0f} a day, got {value:g}")
    low, high = WEIBULL_SHAPES
    if args.weibull_shape is not None and not low <= args.weibull_shape <= high:
        raise _fail(f"--weibull-shape must be between {low:g} and {high:g}, got {args.weibull_shape:g}")


def _short(value: int) -> str:
    text = str(value)
    return text if len(text) <= 24 else f"{text[:12]}...({len(text)} digits)"


def _scaled_restart(params: JobParams, restart_s: float) -> dict[str, Any]:
    """Split a whole restart cost like the profile splits its own (all relaunch gap when it has none)."""
    total = params.restart_s
    if total <= 0:
        return {"restart_gap_s": restart_s, "detection_s": 0.0, "restart_startup": Startup()}
    f = restart_s / total
    s = params.restart_startup
    return {
        "restart_gap_s": params.restart_gap_s * f,
        "detection_s": params.detection_s * f,
        "restart_startup": Startup(
            init_s=s.init_s * f,
            compile_s=s.compile_s * f,
            restore_s=s.restore_s * f,
            data_wait_s=s.data_wait_s * f,
        ),
    }


def build_params(args: argparse.Namespace, base: JobParams | None) -> tuple[JobParams, bool]:
    """The job's parameters (the profile `base`, else defaults, then the flags); and whether the interval
    is `auto`. Raises UsageError."""
    changes: dict[str, Any] = {}
    if base is None:
        base = JobParams(
            failures_per_node_day=LLAMA3_FAILURES_PER_NODE_DAY, blocking_s=15.0, duration_s=SECONDS_PER_DAY
        )
    if args.gpus is not None:
        changes["gpus"] = args.gpus
    if args.gpus_per_node is not None:
        changes["gpus_per_node"] = args.gpus_per_node
    gpus = changes.get("gpus", base.gpus)
    per_node = changes.get("gpus_per_node", base.gpus_per_node)
    num_nodes = -(-gpus // per_node)
    if args.failures_per_node_day is not None:
        changes["failures_per_node_day"] = args.failures_per_node_day
    if args.mtbf_hours is not None:
        changes["failures_per_node_day"] = 24.0 / args.mtbf_hours / num_nodes
    if args.restart_s is not None:
        changes.update(_scaled_restart(base, args.restart_s))
    if args.recovery:
        changes["recovery_kinds"] = tuple(args.recovery)
    simple = {
        "checkpoint_blocking_s": "blocking_s",
        "persist_s": "persist_s",
        "step_s": "step_s",
        "weibull_shape": "weibull_shape",
        "preemptions_per_day": "preemptions_per_day",
        "shutdown_s": "shutdown_s",
        "interval_s": "interval_s",
    }
    for flag, field in simple.items():
        if getattr(args, flag) is not None:
            changes[field] = getattr(args, flag)
    if args.interval_s is not None:
        changes["interval_global"] = False
    if args.no_save_on_preempt:
        changes["handles_preemption"] = False
    if args.startup_s is not None:
        changes["first_startup"] = Startup(init_s=args.startup_s)
    if args.duration_hours is not None:
        changes.update(duration_s=args.duration_hours * 3600.0, work_s=None)
    explicit_auto = args.interval == "auto"
    auto = explicit_auto or (args.interval_s is None and args.from_dir is None)
    if auto:
        changes["interval_s"] = 1.0  # placeholder inside the job until the optimum is known below
    try:
        params = replace(base, **changes)
        job_rate = params.failures_per_day + params.preemptions_per_day
        if job_rate > MAX_PER_DAY:
            raise ValueError(
                f"{job_rate:,.3g} interruptions a day for {params.gpus:,} GPUs ({params.num_nodes:,} nodes) is "
                f"more than {MAX_PER_DAY:,.0f} (one every 86 ms): no job trains at that rate"
            )
        if auto:
            try:
                params = replace(params, interval_s=_auto_interval(params))
            except ValueError:
                if explicit_auto:
                    raise
                # No optimum (no failures, or saves that cost nothing): the default interval, 30 min.
                limit = params.duration_s if params.duration_s is not None else params.work_s or 1800.0
                params, auto = replace(params, interval_s=min(DEFAULT_INTERVAL_S, limit)), False
    except ValueError as exc:
        raise _fail(f"{exc} (see --help)") from None
    return params, auto


def _auto_interval(params: JobParams) -> float:
    if params.blocking_s <= 0:
        raise ValueError("--interval auto needs a save cost: give --checkpoint-blocking-s above 0")
    if params.failures_per_day <= 0 and (params.preemptions_per_day <= 0 or params.handles_preemption):
        raise ValueError(
            "--interval auto needs failures: give --failures-per-node-day or --mtbf-hours above 0"
        )
    best = optimal_interval_for(params)
    if params.duration_s is not None:
        best = min(best, params.duration_s)
    return best


MAX_INTERRUPTIONS_PER_COMMAND = 4_000_000
"""About 15 s of simulation on one busy core (1.6 million took 6 s at a load average of 19); more is refused
with a line saying why."""
MAX_FLEET_WORK = 10_000_000
"""The fleet experiment's demands x (jobs + 10) x runs x 2 policies: about 10 s on one core (its default
is 2.8 million)."""
MAX_WEIBULL_NODES = 1_000_000
DEFAULT_INTERVAL_S = 1800.0
"""The interval when none is given and the model has no optimum (no failures, or free saves)."""


def check_cost(params: JobParams, *, runs: int, points: int = 1) -> None:
    """Refuse (ValueError) a simulation that could not finish: a job that would almost never keep progress,
    or so many runs or interruptions in all that it would run for minutes. `params` is the costliest point
    (the largest job of a sweep)."""
    if runs * points > MAX_RUN_POINTS:
        raise ValueError(
            f"{runs:,} runs x {points} points is more than {MAX_RUN_POINTS:,} simulated runs in all: lower --runs"
        )
    if params.weibull_shape != 1.0 and params.num_nodes > MAX_WEIBULL_NODES:
        raise ValueError(
            f"Weibull failures are drawn per node: {params.num_nodes:,} nodes is more than "
            f"{MAX_WEIBULL_NODES:,} (use --weibull-shape 1, or fewer GPUs)"
        )
    rate = (params.failures_per_day + params.preemptions_per_day) / SECONDS_PER_DAY
    exposure = params.interval_s + params.save_cost_s + params.restart_s
    if params.work_s is not None and rate * exposure > 30:
        raise ValueError(
            f"at {rate * SECONDS_PER_DAY:.3g} interruptions/day a {exposure:.3g} s checkpoint cycle and restart "
            "almost never completes: the job would not finish (lower the rate, the interval or the restart)"
        )
    wall = (
        params.duration_s if params.duration_s is not None else (params.work_s or 0.0) * 2 + params.restart_s
    )
    # Nodes fresh at submission with a shape below 1 fail early and often (about k^-1.5 times the mean rate).
    early = params.weibull_shape**-1.5 if params.weibull_shape < 1 else 1.0
    total = rate * early * wall * runs * points
    if total > MAX_INTERRUPTIONS_PER_COMMAND:
        raise ValueError(
            f"that is about {total:,.0f} simulated interruptions ({rate * SECONDS_PER_DAY:.3g}/day over "
            f"{wall / SECONDS_PER_DAY:.3g} days, {runs} runs x {points} points); lower --runs, "
            "--duration-hours or the failure rate (--failures-per-node-day)"
        )


def _sweep_values(args: argparse.Namespace, integer: bool) -> list[float] | None:
    if args.sweep_values is None:
        return None
    try:
        values = [float(v) for v in args.sweep_values.split(",") if v.strip()]
    except ValueError:
        raise _fail(f"--sweep-values {args.sweep_values!r}: give numbers separated by commas") from None
    if not values or any(not (math.isfinite(v) and v > 0) for v in values):
        raise _fail("--sweep-values must be finite numbers > 0")
    if len(values) > MAX_SWEEP_POINTS:
        raise _fail(f"--sweep-values: at most {MAX_SWEEP_POINTS} values, got {len(values)}")
    if not integer and max(values) > MAX_SECONDS:
        raise _fail(f"--sweep-values: an interval of at most {MAX_SECONDS:,.0f} s (ten years)")
    if integer and any(v != int(v) for v in values):
        raise _fail("--sweep-values for gpus must be whole numbers")
    return values


def _check_work(args: argparse.Namespace, params: JobParams) -> None:
    """Refuse (UsageError) what could not finish in a minute or so, before any of it runs."""
    worst, points = params, 6 if args.compare else 1
    if args.sweep == "interval":
        values = _sweep_values(args, integer=False)
        points = len(values) if values else 21
    elif args.sweep == "gpus":
        from ettr.simulate.sweep import default_gpus

        gpu_values = [int(v) for v in (_sweep_values(args, integer=True) or default_gpus(params))]
        points = len(gpu_values)
        if max(gpu_values) > MAX_GPUS:
            raise _fail(f"--sweep-values: at most {MAX_GPUS:,} GPUs, got {max(gpu_values):g}")
        # Every point at the largest size bounds the whole sweep's interruptions.
        worst = replace(params, gpus=max(max(gpu_values), params.gpus))
    try:
        check_cost(worst, runs=args.runs, points=points)
    except ValueError as exc:
        raise _fail(str(exc)) from None


def _check_combinations(args: argparse.Namespace) -> None:
    if args.replay and args.from_dir is None:
        raise _fail("--replay needs --from RUN_DIR (the job whose failures to replay)")
    if args.replay and (args.sweep or args.compare):
        raise _fail("--replay replays one job; it does not go with --sweep or --compare")
    if args.replay:
        # The replay's interruptions are the run's own, at its own size: these flags would be ignored (and the
        # run's measured rate scaled by --gpus was refused as "1.5e+06 interruptions a day").
        unused = [
            flag
            for flag, value in (
                ("--gpus", args.gpus),
                ("--gpus-per-node", args.gpus_per_node),
                ("--failures-per-node-day", args.failures_per_node_day),
                ("--mtbf-hours", args.mtbf_hours),
                ("--preemptions-per-day", args.preemptions_per_day),
                ("--weibull-shape", args.weibull_shape),
                ("--recovery", args.recovery),
            )
            if value is not None
        ]
        if unused:
            raise _fail(
                f"--replay replays the run's own interruptions at its own size: {', '.join(unused)} "
                "would change nothing (leave them out, or simulate without --replay)"
            )
    if args.sweep and args.compare:
        raise _fail("give either --sweep or --compare, not both")
    if args.sweep_values is not None and not args.sweep:
        raise _fail("--sweep-values needs --sweep interval|gpus")
    if args.sweep == "interval" and args.interval_s is not None:
        raise _fail("--sweep interval sweeps the interval; leave out --interval-s")


def main(args: argparse.Namespace) -> int:
    _check_ranges(args)
    if args.fleet_experiment:
        return _fleet(args)
    _check_combinations(args)
    profile = None
    if args.from_dir is not None:
        from ettr.simulate.profile import load_profile

        try:
            profile = load_profile(args.from_dir)
        except (ValueError, UsageError) as exc:
            raise _fail(f"{exc}" if isinstance(exc, UsageError) else f"{args.from_dir}: {exc}") from None
    base, assumed = _assumed(args, profile) if profile is not None else (None, None)
    params, auto = build_params(args, base)
    if not args.replay:
        _check_work(args, params)
    payload: dict[str, Any]
    html_parts: dict[str, Any] = {}
    if args.replay:
        assert profile is not None
        payload, text, html_parts = _replay(params, profile)
    elif args.sweep:
        payload, text, html_parts = _sweep(args, params, auto)
    elif args.compare:
        payload, text, html_parts = _compare(args, params)
    else:
        from ettr.simulate.render import render_summary
        from ettr.simulate.summary import simulate

        summary = simulate(params, runs=args.runs, seed=args.seed)
        payload = summary.to_dict()
        text = render_summary(summary, title=_title(params, args))
        html_parts = {"summaries": [("simulated", summary)]}
    if profile is not None:
        payload["profile"] = profile.to_dict()
    if assumed is not None:
        payload["assumed"] = assumed
    if params.recovery_kinds:
        payload["recovery_kinds"] = [
            {"kind": k.name, "cost_s": k.cost_s, "share": k.share} for k in params.recovery_kinds
        ]
        payload["restart_s"], payload["mean_restart_s"] = params.restart_s, params.mean_restart_s
    if args.html:
        from ettr.simulate.html import write_simulate_html

        write_simulate_html(args.html, title=_title(params, args), **html_parts)
    if args.json:
        print(json.dumps(payload, indent=2))
    else:
        if assumed is not None:  # under the title: what the numbers rest on
            title, _, rest = text.partition("\n")
            text = f"{title}\n  assumed: {assumed['note']}" + (f"\n{rest}" if rest else "")
        print(text)
        if profile is not None and profile.notes:
            print("\n".join(f"  note: {n}" for n in profile.notes))
    return 0


def _duration(seconds: float) -> str:
    if seconds >= 2 * SECONDS_PER_DAY:
        return f"{seconds / SECONDS_PER_DAY:.1f} days"
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 120:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.0f} s"


def _assumed(args: argparse.Namespace, profile: Any) -> tuple[JobParams, dict[str, Any] | None]:
    """The profile's parameters with what a run cannot tell replaced by defaults, and what was assumed
    (None: nothing): a failure rate from a run shorter than a day or without a failure (a 3-minute run with
    one crash would mean ~500 failures a day), a preemption rate from a run shorter than a day, and the
    node size (a profiled host is no node of the simulated cluster). Flags always win; a replay replays
    the run's own interruptions and assumes nothing."""
    params = profile.params
    if args.replay:
        return params, None
    changes: dict[str, Any] = {}
    said: list[str] = []
    flags: list[str] = []
    if args.failures_per_node_day is None and args.mtbf_hours is None and not profile.failure_rate_measured:
        changes["failures_per_node_day"] = LLAMA3_FAILURES_PER_NODE_DAY
        said.append(
            f"Llama 3's failure rate ({LLAMA3_FAILURES_PER_NODE_DAY:.2g} per node-day: 466 in 54 days on "
            "16,384 GPUs)"
        )
        flags.append("--failures-per-node-day")
    if args.preemptions_per_day is None and profile.num_preempted and not profile.preemption_rate_measured:
        changes["preemptions_per_day"] = 0.0
        said.append("no preemptions")
        flags.append("--preemptions-per-day")
    if args.gpus_per_node is None and (said or (args.gpus or params.gpus) > DEFAULT_GPUS_PER_NODE):
        said.append(f"{DEFAULT_GPUS_PER_NODE} GPUs per node")
        flags.append("--gpus-per-node")
    if not said:
        return params, None
    run, ran = args.from_dir, _duration(profile.measured_wall_s)
    if not changes:
        why = f"the node size of {run} is not known"
    elif profile.num_failed == 0 and not profile.num_preempted:
        why = f"{run} ran {ran} without a failure: no rate to extrapolate"
    else:
        seen = f"{profile.num_failed} failure{'s' if profile.num_failed != 1 else ''}"
        if profile.num_preempted:
            seen += f" and {profile.num_preempted} preemption{'s' if profile.num_preempted != 1 else ''}"
        why = f"{run} ran {ran} with {seen}: no rate to extrapolate"
    listed = ", ".join(said[:-1]) + (" and " if len(said) > 1 else "") + said[-1]
    assumed: dict[str, Any] = dict(changes)
    if "--gpus-per-node" in flags:
        assumed["gpus_per_node"] = DEFAULT_GPUS_PER_NODE
    assumed["note"] = f"{listed} ({why}; give {', '.join(flags)} for your cluster's)"
    return replace(params, **changes), assumed


def _title(params: JobParams, args: argparse.Namespace) -> str:
    source = f"profile of {args.from_dir}" if args.from_dir else "flags"
    size = f"{params.gpus} GPUs ({params.num_nodes} nodes)"
    span = (
        f"{params.duration_s / 3600:g} h of wall time"
        if params.duration_s is not None
        else f"{(params.work_s or 0) / params.step_s:.0f} steps"
    )
    preempt = f", {params.preemptions_per_day:.3g} preemptions/day" if params.preemptions_per_day else ""
    kinds = "".join(
        f"; {k.share:.0%} of failures {k.name} at {k.cost_s:.3g} s" for k in params.recovery_kinds
    )
    restart = f", restart {params.restart_s:.3g} s{kinds}" if kinds else ""
    return (
        f"ettr simulate ({source}): {size}, {span}, {params.failures_per_day:.3g} failures/day{preempt}, "
        f"save blocks {params.blocking_s:.3g} s{restart}"
    )


class _Progress:
    """A line on stderr after a point of a sweep or comparison once it has run for a second, then at most
    every few seconds: a long sweep is never silent, a quick one says nothing."""

    QUIET_S = 1.0
    EVERY_S = 3.0

    def __init__(self, what: str) -> None:
        self._what = what
        self._start = time.monotonic()
        self._last = -math.inf

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        elapsed = now - self._start
        if elapsed >= self.QUIET_S and now - self._last >= self.EVERY_S and done < total:
            self._last = now
            print(
                f"ettr simulate: {done} of {total} {self._what} done ({elapsed:.0f} s)",
                file=sys.stderr,
                flush=True,
            )


def _replay(params: JobParams, profile: Any) -> tuple[dict[str, Any], str, dict[str, Any]]:
    from ettr.simulate.render import render_replay
    from ettr.simulate.summary import replay

    predicted = replay(params, profile.script)
    payload = predicted.to_dict()
    payload["replay"] = True
    payload["measured"] = {
        "ett_pct": profile.measured_ett_pct,
        "buckets_pct": profile.measured_buckets_pct,
        "wall_s": profile.measured_wall_s,
        "lost_step_s": profile.lost_step_s,
        "num_lost_steps": profile.num_lost_steps,
    }
    text = "replay of the job's own failures\n" + render_replay(
        predicted, profile.measured_ett_pct, profile.measured_buckets_pct
    )
    note = profile.speed_note()
    if note is not None:
        text += f"\n  ({note})"
    return payload, text, {"summaries": [("replayed", predicted)], "measured": profile.measured_buckets_pct}


def _sweep(
    args: argparse.Namespace, params: JobParams, auto: bool
) -> tuple[dict[str, Any], str, dict[str, Any]]:
    from ettr.simulate.render import render_sweep
    from ettr.simulate.sweep import default_gpus, default_intervals, sweep_gpus, sweep_interval

    if args.sweep == "interval":
        values = _sweep_values(args, integer=False) or default_intervals(params)
        if max(values) > params.longest_interval_s:
            raise _fail(
                f"--sweep-values: an interval of {max(values):g} s is longer than the job "
                f"({params.longest_interval_s:g} s{'' if params.duration_s is not None else ' of training'})"
            )
        sweep = sweep_interval(
            params, values, runs=args.runs, seed=args.seed, on_point=_Progress("intervals")
        )
    else:
        gpu_values = [int(v) for v in (_sweep_values(args, integer=True) or default_gpus(params))]
        sweep = sweep_gpus(
            params,
            gpu_values,
            runs=args.runs,
            seed=args.seed,
            auto_interval=auto,
            on_point=_Progress("sizes"),
        )
    text = (
        _title(params, args) + f"\nsweep of the {args.sweep} ({args.runs} runs each)\n" + render_sweep(sweep)
    )
    return sweep.to_dict(), text, {"sweep": sweep}


def _compare(args: argparse.Namespace, params: JobParams) -> tuple[dict[str, Any], str, dict[str, Any]]:
    from ettr.simulate.render import render_policies
    from ettr.simulate.sweep import PolicyOptions, compare_policies

    try:
        options = PolicyOptions(
            async_blocking_s=args.async_blocking_s,
            cached_compile_s=args.cached_compile_s,
            publish_s=args.publish_s or 0.0,
        )
        rows, skipped = compare_policies(
            params, options, runs=args.runs, seed=args.seed, on_point=_Progress("policies")
        )
    except ValueError as exc:
        raise _fail(str(exc)) from None
    payload = {
        "policies": [{"policy": name, **s.to_dict()} for name, s in rows],
        "not_compared": skipped,
    }
    text = _title(params, args) + f"\npolicies side by side ({args.runs} runs each)\n"
    return payload, text + render_policies(rows, skipped), {"summaries": rows}


def _fleet(args: argparse.Namespace) -> int:
    from ettr.simulate.fleet import FleetParams, fleet_experiment
    from ettr.simulate.render import render_fleet

    changes: dict[str, Any] = {}
    if args.fleet_jobs is not None:
        changes["num_jobs"] = args.fleet_jobs
    if args.demands_per_day is not None:
        changes["demands_per_day"] = args.demands_per_day
    if args.demand_gpus is not None:
        changes["demand_gpus"] = args.demand_gpus
    if args.duration_hours is not None:
        changes["duration_s"] = args.duration_hours * 3600.0
    try:
        params = FleetParams(**changes)
    except ValueError as exc:
        raise _fail(str(exc)) from None
    demands = params.demands_per_day * params.duration_s / SECONDS_PER_DAY
    work = demands * (params.num_jobs + 10) * args.runs * 2
    if work > MAX_FLEET_WORK:
        raise _fail(
            f"{demands:,.0f} demands x {params.num_jobs:,} jobs x {args.runs} runs is too much to simulate here "
            "(lower --runs, --fleet-jobs, --demands-per-day or --duration-hours)"
        )
    result = fleet_experiment(params, runs=args.runs, seed=args.seed)
    if args.html:
        from ettr.simulate.html import write_simulate_html

        write_simulate_html(args.html, title="ettr simulate --fleet-experiment", fleet=result)
    print(json.dumps(result, indent=2) if args.json else render_fleet(result))
    return 0
