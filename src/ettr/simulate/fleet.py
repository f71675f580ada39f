"""The fleet experiment: which running jobs to preempt when high-priority demands need GPUs.

M jobs share a cluster; a Poisson stream of demands each needs some GPUs for a while. The victims are
chosen at random, or by the lowest preemption cost (the fleet issue's order): the progress they have not
saved yet (time since their last commit) plus their recovery time, times their GPUs. A victim waits until
the demand is over, recovers, and trains again. Both policies see the same jobs, checkpoint phases and
demands (common random numbers), so the difference is the victim choice. Pure: seeded, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ettr.constants import SECONDS_PER_DAY
from ettr.simulate.summary import Z95

POLICIES = ("random", "lowest_cost")


@dataclass(frozen=True, kw_only=True)
class FleetParams:
    """The cluster, its jobs, and the demands that preempt them."""

    num_jobs: int = 32
    """Jobs running on the cluster."""
    job_gpus: tuple[int, ...] = (8, 16, 32, 64, 128, 256)
    """Sizes a job is drawn from (uniformly)."""
    interval_s: tuple[float, float] = (600.0, 3600.0)
    """Each job's checkpoint interval is drawn uniformly from this range (seconds of wall time)."""
    recovery_s: tuple[float, float] = (120.0, 1200.0)
    """Each job's recovery (relaunch to training again) is drawn uniformly from this range."""
    demands_per_day: float = 24.0
    """High-priority demands per day."""
    demand_gpus: int = 256
    """GPUs each demand needs."""
    demand_hold_s: float = 3600.0
    """How long a demand keeps the GPUs."""
    duration_s: float = 7 * SECONDS_PER_DAY

    def __post_init__(self) -> None:
        if self.num_jobs < 1 or not self.job_gpus or min(self.job_gpus) < 1 or self.demand_gpus < 1:
            raise ValueError("the fleet needs >= 1 job, job sizes >= 1 GPU and demands of >= 1 GPU")
        for name in ("demands_per_day", "demand_hold_s", "duration_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"fleet {name.replace('_', ' ')} must be a finite number > 0, got {value}")
        for name in ("interval_s", "recovery_s"):
            lo, hi = getattr(self, name)
            if not (0 <= lo <= hi and math.isfinite(hi)) or (name == "interval_s" and lo <= 0):
                raise ValueError(f"fleet {name.replace('_', ' ')} must be a range 0 < low <= high")


@dataclass(frozen=True, slots=True)
class FleetRun:
    ett_pct: float
    lost_gpu_hours: float
    num_preemptions: int


def choose_victims(
    policy: str,
    *,
    running: np.ndarray,
    unsaved_s: np.ndarray,
    recovery_s: np.ndarray,
    gpus: np.ndarray,
    need_gpus: float,
    rng: np.random.Generator,
) -> list[int]:
    """The jobs (ids from `running`) to preempt until `need_gpus` are free: in random order, or by the
    lowest preemption cost, (unsaved work + recovery) x GPUs, cheapest first."""
    if policy == "random":
        order = rng.permutation(running.size)
    elif policy == "lowest_cost":
        order = np.argsort((unsaved_s + recovery_s) * gpus, kind="stable")
    else:
        raise ValueError(f"unknown victim policy {policy!r} (one of {', '.join(POLICIES)})")
    victims, freed = [], 0.0
    for i in order.tolist():
        if freed >= need_gpus:
            break
        victims.append(int(running[i]))
        freed += float(gpus[i])
    return victims


def _run(params: FleetParams, policy: str, seed: int, run_index: int) -> FleetRun:
    jobs_rng, demand_rng, pick_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence([seed, run_index]).spawn(3)
    )
    n = params.num_jobs
    gpus = jobs_rng.choice(np.asarray(params.job_gpus), n).astype(float)
    interval = jobs_rng.uniform(*params.interval_s, n)
    recovery = jobs_rng.uniform(*params.recovery_s, n)
    anchor = -jobs_rng.uniform(0.0, 1.0, n) * interval  # checkpoint phase: jobs started before the window
    train_from = np.zeros(n)  # when each job is training (again)
    trained = np.zeros(n)  # training seconds inside the window, lost work included
    unsaved_lost = np.zeros(n)  # training seconds rolled back by preemptions
    recovering = np.zeros(n)  # recovery seconds inside the window
    horizon = params.duration_s
    rate = params.demands_per_day / SECONDS_PER_DAY
    t, num_preemptions = 0.0, 0
    while rate > 0:  # a rate that underflows to 0 (5e-324 a day) is no demand at all
        t += demand_rng.exponential(1.0 / rate)
        if t >= horizon:
            break
        running = np.flatnonzero(train_from <= t)
        if running.size == 0:
            continue
        since = np.maximum(0.0, t - anchor[running])
        unsaved = since - np.floor(since / interval[running]) * interval[running]
        unsaved_of = dict(zip(running.tolist(), unsaved.tolist(), strict=True))
        victims = choose_victims(
            policy,
            running=running,
            unsaved_s=unsaved,
            recovery_s=recovery[running],
            gpus=gpus[running],
            need_gpus=params.demand_gpus,
            rng=pick_rng,
        )
        for j in victims:
            num_preemptions += 1
            trained[j] += t - train_from[j]
            unsaved_lost[j] += unsaved_of[j]
            free_at = t + params.demand_hold_s
            recovering[j] += max(0.0, min(recovery[j], horizon - free_at))
            train_from[j] = anchor[j] = free_at + recovery[j]  # the next commit: an interval later
    trained += np.maximum(0.0, horizon - train_from)
    effective = trained - unsaved_lost
    total = float(np.sum(gpus * horizon))
    return FleetRun(
        ett_pct=100.0 * float(np.sum(effective * gpus)) / total,
        lost_gpu_hours=float(np.sum((unsaved_lost + recovering) * gpus)) / 3600.0,
        num_preemptions=num_preemptions,
    )


def fleet_experiment(params: FleetParams, *, runs: int, seed: int) -> dict[str, Any]:
    """Both victim policies on the same seeded fleets: fleet ETT% and lost GPU-hours, mean and 95% CI."""
    out: dict[str, Any] = {"runs": runs, "params": _params_dict(params), "policies": {}}
    for policy in POLICIES:
        results = [_run(params, policy, seed, i) for i in range(runs)]
        ett = np.array([r.ett_pct for r in results])
        lost = np.array([r.lost_gpu_hours for r in results])
        out["policies"][policy] = {
            "ett_pct": float(ett.mean()),
            "ett_pct_ci95": _ci(ett),
            "lost_gpu_hours": float(lost.mean()),
            "lost_gpu_hours_ci95": _ci(lost),
            "num_preemptions_mean": float(np.mean([r.num_preemptions for r in results])),
        }
    return out


def _ci(values: np.ndarray) -> list[float]:
    if len(values) < 2:
        return [float(values.mean())] * 2
    half = Z95 * float(values.std(ddof=1)) / math.sqrt(len(values))
    return [float(values.mean()) - half, float(values.mean()) + half]


def _params_dict(params: FleetParams) -> dict[str, Any]:
    return {
        "num_jobs": params.num_jobs,
        "job_gpus": list(params.job_gpus),
        "interval_s": list(params.interval_s),
        "recovery_s": list(params.recovery_s),
        "demands_per_day": params.demands_per_day,
        "demand_gpus": params.demand_gpus,
        "demand_hold_s": params.demand_hold_s,
        "duration_s": params.duration_s,
    }
