"""The model's expectations in closed form, where exponential failures allow one (renewal theory).

To keep `x` seconds of progress when failures come at rate `lam` and each one costs a recovery of mean
`rec`, the expected wall time is `(exp(lam * x) - 1) * (1 / lam + rec)`; a checkpoint cycle is `x =
interval + save cost` (Daly's "exact" model). A recovery is the detection `d` (no new failure counted)
and then the relaunch and start-up `R'`, which a failure sends back to the start: `rec = d + (exp(lam *
R') - 1) * (1 / lam + d)`. This is the mean of exactly what `ettr.simulate.model` simulates with
exponential failures, no preemptions and synchronous saves (persist 0), so the Monte Carlo is tested
against it, and `optimal_interval_s` (the interval `checkpoint`'s `auto` uses) minimises it. Pure.
"""

from __future__ import annotations

import math

from ettr.constants import SECONDS_PER_DAY
from ettr.simulate.params import JobParams


def _recovery_s(lam: float, detection_s: float, relaunch_s: float) -> float:
    return detection_s + math.expm1(lam * relaunch_s) * (1.0 / lam + detection_s)


def _keep_s(lam: float, x: float, recovery_s: float) -> float:
    """Expected wall seconds to get through `x` seconds that a failure sends back to their start."""
    return x if lam <= 0 else math.expm1(lam * x) * (1.0 / lam + recovery_s)


def expected_wall_s(params: JobParams) -> float:
    """Mean wall time of a job with a fixed amount of work (`work_s`), exponential failures, no preemption,
    a time interval (saves every interval after each training start) and persist 0."""
    if params.work_s is None:
        raise ValueError("expected_wall_s needs a job with a fixed amount of work (work_s)")
    if params.weibull_shape != 1.0 or params.preemptions_per_day > 0 or params.persist_s > 0:
        raise ValueError("the closed form holds for exponential failures, no preemption and persist 0")
    if params.interval_global:
        raise ValueError("the closed form holds for a time interval (interval_global=False)")
    lam = params.failures_per_day / SECONDS_PER_DAY
    rec = _recovery_s(lam, params.detection_s, params.restart_gap_s + params.restart_startup.total_s)
    interval, work = params.interval_s, params.work_s
    num_saves = max(0, math.ceil(work / interval - 1e-12) - 1)
    last_s = work - num_saves * interval
    startup = _keep_s(lam, params.first_startup.total_s, rec)
    cycles = num_saves * _keep_s(lam, interval + params.blocking_s, rec) + _keep_s(lam, last_s, rec)
    return params.scheduling_s + params.hardware_setup_s + startup + cycles + params.shutdown_s


def steady_state_waste_fraction(
    *,
    interval_s: float,
    save_cost_s: float,
    failures_per_day: float,
    restart_s: float,
    detection_s: float = 0.0,
) -> float:
    """Share of wall time not kept as progress in a long job: `1 - interval / E[cycle wall time]`."""
    lam = failures_per_day / SECONDS_PER_DAY
    rec = _recovery_s(lam, detection_s, max(0.0, restart_s - detection_s)) if lam > 0 else 0.0
    return 1.0 - interval_s / _keep_s(lam, interval_s + save_cost_s, rec)


def optimal_interval_s(
    *,
    save_cost_s: float,
    failures_per_day: float,
    restart_s: float = 0.0,
    min_interval_s: float = 0.0,
    slowdown_s_per_save: float = 0.0,
) -> float:
    """The checkpoint interval (training seconds between saves) that wastes the least in the model.

    `slowdown_s_per_save` is the training time a save's background persist costs by slowing the steps
    beside it (`EttReport.slowdown`'s extra seconds per save): part of the save's cost like its blocking.

    `save_cost_s` is what one save costs the loop (blocking plus waiting), `failures_per_day` the job's
    interruption rate, `restart_s` the whole cost of one restart; the result is never below
    `min_interval_s` (e.g. the time an async persist takes). The restart cost scales the waste of every
    interval alike, so it moves the optimum little; it is accepted so callers pass the whole model.
    """
    if not (save_cost_s > 0 and math.isfinite(save_cost_s)):
        raise ValueError(f"save cost must be a finite number of seconds > 0, got {save_cost_s}")
    if not (failures_per_day > 0 and math.isfinite(failures_per_day)):
        raise ValueError(f"failures per day must be > 0, got {failures_per_day}")
    if not (slowdown_s_per_save >= 0 and math.isfinite(slowdown_s_per_save)):
        raise ValueError(
            f"slowdown per save must be a finite number of seconds >= 0, got {slowdown_s_per_save}"
        )
    save_cost_s += slowdown_s_per_save
    lam = failures_per_day / SECONDS_PER_DAY

    def cost(log_t: float) -> float:
        t = math.exp(log_t)
        return math.expm1(lam * (t + save_cost_s)) / t  # the recovery factor is common to every t

    # Golden-section search on log(t); the cost is unimodal in t. Bracket: Young's optimum / 100 .. x 100.
    young = math.sqrt(2.0 * save_cost_s / lam)
    lo, hi = math.log(young / 100.0), math.log(young * 100.0)
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = cost(a), cost(b)
    for _ in range(200):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = cost(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = cost(b)
        if hi - lo < 1e-10:
            break
    del restart_s  # documented above: a common factor of the cost
    return max(math.exp((lo + hi) / 2.0), min_interval_s)


def optimal_interval_for(params: JobParams) -> float:
    """`optimal_interval_s` of a job's parameters (its save cost, failure rate, restart cost, persist)."""
    rate = params.failures_per_day + params.preemptions_per_day * (not params.handles_preemption)
    return optimal_interval_s(
        save_cost_s=max(params.blocking_s, 1e-6),
        failures_per_day=rate,
        restart_s=params.restart_s,
        min_interval_s=params.persist_s,
    )
