"""The model's expectations in closed form, where exponential failures allow one (renewal theory).

To keep `x` seconds of progress when failures come at rate `lam` and each one costs a recovery of mean
`rec`, the expected wall time is `(exp(lam * x) - 1) * (1 / lam + rec)`; a checkpoint cycle is `x =
interval + save cost` (Daly's "exact" model). A recovery is the detection `d` (no new failure counted)
and then the relaunch and start-up `R'`, which a failure sends back to the start: `rec = d + (exp(lam *
R') - 1) * (1 / lam + d)`. This is the mean of exactly what `ettr.simulate.model` simulates with
exponential failures, no preemptions and synchronous saves (persist 0), so the Monte Carlo is tested
against it. The model and its optimum (`optimal_interval_s`, which `ettr interval` and the checkpoint
manager's `auto` interval use too) live in `ettr.interval`. Pure.
"""

from __future__ import annotations

import math

from ettr.constants import SECONDS_PER_DAY
from ettr.interval import cycle_wall_s, optimal_interval_s, recovery_s, wasted_fraction
from ettr.simulate.params import JobParams

__all__ = ["expected_wall_s", "optimal_interval_for", "optimal_interval_s", "steady_state_waste_fraction"]


def expected_wall_s(params: JobParams) -> float:
    """Mean wall time of a job with a fixed amount of work (`work_s`), exponential failures, no preemption,
    a time interval (saves every interval after each training start) and persist 0."""
    if params.work_s is None:
        raise ValueError("expected_wall_s needs a job with a fixed amount of work (work_s)")
    if params.weibull_shape != 1.0 or params.preemptions_per_day > 0 or params.persist_s > 0:
        raise ValueError("the closed form holds for exponential failures, no preemption and persist 0")
    if params.interval_global:
        raise ValueError("the closed form holds for a time interval (interval_global=False)")
    if params.recovery_kinds:
        raise ValueError("the closed form holds for one restart cost (no recovery kinds)")
    lam = params.failures_per_day / SECONDS_PER_DAY
    rec = recovery_s(
        lam, detection_s=params.detection_s, relaunch_s=params.restart_gap_s + params.restart_startup.total_s
    )
    interval, work = params.interval_s, params.work_s
    num_saves = max(0, math.ceil(work / interval - 1e-12) - 1)
    last_s = work - num_saves * interval
    startup = cycle_wall_s(lam, params.first_startup.total_s, rec)
    cycles = num_saves * cycle_wall_s(lam, interval + params.blocking_s, rec) + cycle_wall_s(lam, last_s, rec)
    return params.scheduling_s + params.hardware_setup_s + startup + cycles + params.shutdown_s


def steady_state_waste_fraction(
    *,
    interval_s: float,
    save_cost_s: float,
    failures_per_day: float,
    restart_s: float,
    detection_s: float = 0.0,
) -> float:
    """Share of wall time not kept as progress in a long job: `1 - interval / E[cycle wall time]`
    (`ettr.interval.wasted_fraction`; `detection_s` is the part of `restart_s` no new failure restarts)."""
    return wasted_fraction(
        interval_s=interval_s,
        save_cost_s=save_cost_s,
        failures_per_day=failures_per_day,
        restart_s=restart_s,
        detection_s=detection_s,
    )


def optimal_interval_for(params: JobParams) -> float:
    """`optimal_interval_s` of a job's parameters (its save cost, failure rate, restart cost, persist)."""
    rate = params.failures_per_day + params.preemptions_per_day * (not params.handles_preemption)
    return optimal_interval_s(
        save_cost_s=max(params.blocking_s, 1e-6),
        failures_per_day=rate,
        restart_s=params.mean_restart_s,
        min_interval_s=params.persist_s,
    )
