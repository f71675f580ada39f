"""Sweeps (the checkpoint interval, the job's size) and policy comparisons, all on common random numbers.

Every point of a sweep and every policy runs the same seeded runs: run i sees the same node-failure and
preemption times at every interval, so the differences between points are the policy's, not the dice's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ettr.simulate.analytic import optimal_interval_for
from ettr.simulate.params import JobParams
from ettr.simulate.summary import Summary, simulate


@dataclass(frozen=True, kw_only=True)
class SweepPoint:
    value: float
    summary: Summary

    def to_dict(self, name: str) -> dict[str, Any]:
        return {name: self.value, **self.summary.to_dict()}


@dataclass(frozen=True, kw_only=True)
class Sweep:
    """A swept parameter: its points, the best by mean ETT%, and (intervals) the model's optimum."""

    name: str
    """"interval" or "gpus"."""
    points: tuple[SweepPoint, ...]
    optimum_interval_s: float | None
    """Intervals: the closed-form optimum of the model (exponential failures); None otherwise."""
    fitted_optimum_interval_s: float | None
    """Intervals: the minimum of `a * T + c / T + d` fitted to the simulated waste (None if it does not
    fit: e.g. a curve without a minimum inside the swept range)."""

    @property
    def key(self) -> str:
        return "interval_s" if self.name == "interval" else "gpus"

    @property
    def best(self) -> SweepPoint:
        return max(self.points, key=lambda p: p.summary.ett_pct)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sweep": self.name,
            "points": [p.to_dict(self.key) for p in self.points],
            "best": self.best.to_dict(self.key),
            "optimum_interval_s": self.optimum_interval_s,
            "fitted_optimum_interval_s": self.fitted_optimum_interval_s,
        }


def default_intervals(params: JobParams, num_points: int = 21) -> list[float]:
    """`num_points` intervals from a quarter to four times the model's optimum (geometric), within the job."""
    center = _optimum_or_none(params) or params.interval_s
    values = [center * f for f in np.geomspace(0.25, 4.0, num_points)]
    limit = params.longest_interval_s
    return [v for v in values if v <= limit] or [min(center, limit)]


def default_gpus(params: JobParams) -> list[int]:
    """Powers of two of the node size, from one node to 64 times the job (at least 16,384 GPUs)."""
    top = max(params.gpus * 64, 16_384)
    values, g = [], params.gpus_per_node
    while g <= top:
        values.append(g)
        g *= 2
    return values


def _optimum_or_none(params: JobParams) -> float | None:
    if params.blocking_s <= 0 or params.failures_per_day + params.preemptions_per_day <= 0:
        return None
    try:
        return optimal_interval_for(params)
    except ValueError:
        return None


def _fit_optimum(values: Sequence[float], wastes: Sequence[float]) -> float | None:
    if len(values) < 4:
        return None
    t = np.asarray(values, dtype=float)
    design = np.column_stack([t, 1.0 / t, np.ones_like(t)])
    (a, c, _d), *_ = np.linalg.lstsq(design, np.asarray(wastes, dtype=float), rcond=None)
    if a <= 0 or c <= 0:
        return None
    best = math.sqrt(c / a)
    return best if min(values) <= best <= max(values) else None


OnPoint = Callable[[int, int], None]
"""Told (points done, points in all) after each point of a sweep or row of a comparison: progress."""


def _no_progress(done: int, total: int) -> None:
    del done, total


def sweep_interval(
    params: JobParams, values: Sequence[float], *, runs: int, seed: int, on_point: OnPoint = _no_progress
) -> Sweep:
    points = []
    for v in values:
        points.append(
            SweepPoint(value=v, summary=simulate(replace(params, interval_s=v), runs=runs, seed=seed))
        )
        on_point(len(points), len(values))
    wastes = [100.0 - p.summary.ett_pct for p in points]
    return Sweep(
        name="interval",
        points=tuple(points),
        optimum_interval_s=_optimum_or_none(params),
        fitted_optimum_interval_s=_fit_optimum([p.value for p in points], wastes),
    )


def sweep_gpus(
    params: JobParams,
    values: Sequence[int],
    *,
    runs: int,
    seed: int,
    auto_interval: bool,
    on_point: OnPoint = _no_progress,
) -> Sweep:
    """The job at each size, its per-node failure rate kept; with `auto_interval`, each at its optimum."""
    points = []
    for gpus in values:
        scaled = replace(params, gpus=int(gpus))
        if auto_interval:
            best = _optimum_or_none(scaled)
            if best is not None:
                limit = scaled.duration_s if scaled.duration_s is not None else math.inf
                scaled = replace(scaled, interval_s=min(best, limit))
        points.append(SweepPoint(value=gpus, summary=simulate(scaled, runs=runs, seed=seed)))
        on_point(len(points), len(values))
    return Sweep(name="gpus", points=tuple(points), optimum_interval_s=None, fitted_optimum_interval_s=None)


@dataclass(frozen=True, kw_only=True)
class PolicyOptions:
    """What the policy comparison needs beyond the job's parameters; None where it is unknown."""

    async_blocking_s: float | None = None
    """Blocking of an async save (the staging copy); None: unknown (then the async row needs the job to
    be async already)."""
    cached_compile_s: float | None = None
    """Compile seconds of a restart that hits the compile store; None: unknown."""
    publish_s: float = 0.0
    """Seconds the job spends publishing at its end when it publishes itself."""


def policy_variants(
    params: JobParams, options: PolicyOptions
) -> tuple[list[tuple[str, JobParams]], list[str]]:
    """(name, params) of each policy to compare, the job as given first; and lines on what was skipped."""
    skipped: list[str] = []
    rows: list[tuple[str, JobParams]] = [("as given", params)]
    write_s = params.blocking_s + params.persist_s
    rows.append(("sync saves", replace(params, blocking_s=write_s, persist_s=0.0)))
    if params.persist_s > 0:
        rows.append(("async saves", params))
    elif options.async_blocking_s is not None:
        rows.append(
            (
                "async saves",
                replace(
                    params,
                    blocking_s=options.async_blocking_s,
                    persist_s=max(0.0, write_s - options.async_blocking_s),
                ),
            )
        )
    else:
        skipped.append("async saves: the staging cost is unknown (give --async-blocking-s)")
    first, later = params.first_startup, params.restart_startup
    rows.append(
        ("compile store off", replace(params, restart_startup=replace(later, compile_s=first.compile_s)))
    )
    if options.cached_compile_s is not None:
        on = replace(later, compile_s=options.cached_compile_s)
        rows.append(("compile store on", replace(params, restart_startup=on)))
    elif later.compile_s < first.compile_s:
        rows.append(("compile store on", params))
    else:
        skipped.append("compile store on: a cached compile time is unknown (give --cached-compile-s)")
    if options.publish_s > 0:
        rows.append(("publish in the job", replace(params, shutdown_s=params.shutdown_s + options.publish_s)))
        rows.append(("standalone publishing", params))
    else:
        skipped.append("publishing: no publishing cost given (--publish-s)")
    best = _optimum_or_none(params)
    if best is not None:
        limit = params.duration_s if params.duration_s is not None else math.inf
        rows.append(("interval auto", replace(params, interval_s=min(best, limit))))
    else:
        skipped.append("interval auto: needs a save cost and a failure rate above 0")
    return rows, skipped


def compare_policies(
    params: JobParams, options: PolicyOptions, *, runs: int, seed: int, on_point: OnPoint = _no_progress
) -> tuple[list[tuple[str, Summary]], list[str]]:
    rows, skipped = policy_variants(params, options)
    done: list[tuple[str, Summary]] = []
    for name, p in rows:
        done.append((name, simulate(p, runs=runs, seed=seed)))
        on_point(len(done), len(rows))
    return done, skipped
