"""What the simulator is told about a job: a frozen, validated `JobParams` (flags, a profile, or both).

All times are seconds. A job is either a fixed wall-time window (`duration_s`: it trains until then and
ends normally, the runs a scheduler gives a job of H hours) or a fixed amount of training (`work_s`: it
ends when that much progress is kept, as a job of N steps does). Pure data; no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

STARTUP_COMPONENTS = ("init", "compile", "restore", "data_wait")
"""The start-up buckets of an attempt, in the order an attempt goes through them."""


def _check(name: str, value: float, *, positive: bool = False) -> None:
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value}")


@dataclass(frozen=True, kw_only=True)
class Startup:
    """One attempt's start-up, launch to the first step: the report's start-up buckets."""

    init_s: float = 0.0
    compile_s: float = 0.0
    restore_s: float = 0.0
    data_wait_s: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            _check(f"start-up {f.name}", getattr(self, f.name))

    @property
    def total_s(self) -> float:
        return self.init_s + self.compile_s + self.restore_s + self.data_wait_s

    def components(self) -> tuple[tuple[str, float], ...]:
        """(bucket, seconds) in the order the attempt spends them."""
        return (
            ("init", self.init_s),
            ("compile", self.compile_s),
            ("restore", self.restore_s),
            ("data_wait", self.data_wait_s),
        )


@dataclass(frozen=True, kw_only=True)
class JobParams:
    """One job's costs, failure rates and checkpoint policy (see docs/simulate.md for each)."""

    gpus: int = 8
    """GPUs of the job."""
    gpus_per_node: int = 8
    """GPUs per node; failures are per node, so the job's rate grows with its node count."""
    failures_per_node_day: float = 0.0
    """Failures (interruptions that roll the job back) per node per day of wall time."""
    weibull_shape: float = 1.0
    """Shape k of each node's time to failure (1: exponential; < 1: infant mortality; > 1: wear-out)."""
    preemptions_per_day: float = 0.0
    """Scheduler preemptions of the job per day of wall time."""
    handles_preemption: bool = True
    """The job saves a checkpoint on SIGTERM and exits (save-then-exit); else a preemption is a failure."""
    step_s: float = 1.0
    """Seconds per optimizer step (progress is counted in training seconds; steps for display only)."""
    eval_s_per_train_s: float = 0.0
    """Seconds of evaluation per second of training: evaluation passes inside the loop, in proportion to the
    training (an evaluation every N steps). Booked as `evaluation`, or as `wasted_progress` with the training
    around it when a failure rolls it back."""
    interval_s: float = 1800.0
    """Training seconds between two saves (the checkpoint interval)."""
    interval_global: bool = False
    """Saves at multiples of the interval of global progress (a step interval, `step % N == 0`), instead of
    every interval after the attempt's training start (a time interval)."""
    blocking_s: float = 0.0
    """Seconds one save blocks the training loop (the whole write for a synchronous save)."""
    persist_s: float = 0.0
    """Seconds an async save keeps writing after the loop resumes; a failure before it ends loses that
    checkpoint. A save that would start before the previous persist ended waits for it (blocking)."""
    scheduling_s: float = 0.0
    """Queue wait before the first allocation."""
    hardware_setup_s: float = 0.0
    """Allocation to the supervisor's start."""
    first_startup: Startup = field(default_factory=Startup)
    """Start-up of the first attempt."""
    restart_startup: Startup = field(default_factory=Startup)
    """Start-up of every later attempt (compile store, restore...)."""
    restart_gap_s: float = 0.0
    """End of a failed attempt to the start of the next one (relaunch; the report's `restart` bucket)."""
    detection_s: float = 0.0
    """Failure to its detection (the failed attempt's end): wasted progress, e.g. a hang until the watchdog."""
    preempt_requeue_s: float | None = None
    """End of a preempted attempt to the next start (requeue); None: `restart_gap_s`."""
    shutdown_s: float = 0.0
    """Last step to the job's end (final save, teardown, and publishing when the job publishes itself)."""
    duration_s: float | None = 86_400.0
    """Wall-time window of the job (from submission); exactly one of `duration_s` and `work_s`."""
    work_s: float | None = None
    """Training seconds of progress the job must keep to finish."""

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError(f"gpus must be >= 1, got {self.gpus}")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus per node must be >= 1, got {self.gpus_per_node}")
        for name in (
            "failures_per_node_day",
            "preemptions_per_day",
            "blocking_s",
            "persist_s",
            "scheduling_s",
            "hardware_setup_s",
            "restart_gap_s",
            "detection_s",
            "shutdown_s",
            "eval_s_per_train_s",
        ):
            _check(name.replace("_", " "), getattr(self, name))
        _check("weibull shape", self.weibull_shape, positive=True)
        _check("step time", self.step_s, positive=True)
        _check("checkpoint interval", self.interval_s, positive=True)
        if self.preempt_requeue_s is not None:
            _check("preempt requeue", self.preempt_requeue_s)
        if (self.duration_s is None) == (self.work_s is None):
            raise ValueError("give exactly one of a duration (wall time) and an amount of work (steps)")
        if self.duration_s is not None:
            _check("duration", self.duration_s, positive=True)
            if self.interval_s > self.duration_s:
                raise ValueError(
                    f"checkpoint interval {self.interval_s:g} s is longer than the job "
                    f"({self.duration_s:g} s): no checkpoint would ever be taken"
                )
        if self.work_s is not None:
            _check("work", self.work_s, positive=True)
            if self.interval_s > self.work_s * (1 + 1e-9):
                raise ValueError(
                    f"checkpoint interval {self.interval_s:g} s is longer than the job's training "
                    f"({self.work_s:g} s): no checkpoint would ever be taken"
                )

    @property
    def num_nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    @property
    def failures_per_day(self) -> float:
        """The job's failure rate: per-node rate times its nodes."""
        return self.failures_per_node_day * self.num_nodes

    @property
    def restart_s(self) -> float:
        """The whole cost of one restart, lost work excluded: detection, relaunch, start-up to the first step."""
        return self.detection_s + self.restart_gap_s + self.restart_startup.total_s

    @property
    def save_cost_s(self) -> float:
        """The loop's cost of one save: its blocking plus any wait for the previous persist."""
        return self.blocking_s + max(0.0, self.persist_s - self.interval_s)
