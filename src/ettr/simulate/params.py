"""What the simulator is told about a job: a frozen, validated `JobParams` (flags, a profile, or both).

All times are seconds. A job is either a fixed wall-time window (`duration_s`: it trains until then and
ends normally, the runs a scheduler gives a job of H hours) or a fixed amount of training (`work_s`: it
ends when that much progress is kept, as a job of N steps does). Pure data; no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

DEFAULT_GPUS_PER_NODE = 8
"""GPUs per node unless told otherwise (`--gpus-per-node`): the usual training node."""

MAX_GPUS = 100_000_000
"""More GPUs than any cluster: a larger job (a flag, or a world size read from a damaged ledger) is refused."""

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


RECOVERY_KIND_NAMES = ("in_place", "warm_restart", "cold_restart", "requeue")
"""How a failure can be recovered (the report's `kind` of each recovery)."""


@dataclass(frozen=True, kw_only=True)
class RecoveryKind:
    """One way failures are recovered, what one such recovery costs and how many failures it covers."""

    name: str
    """One of `RECOVERY_KIND_NAMES`."""
    cost_s: float
    """The whole cost of one recovery of this kind, lost work excluded (as `restart_s`): detection, then the
    rest split like the job's own restart (relaunch gap and start-up components in its proportions)."""
    share: float
    """The fraction of failures (not preemptions) recovered this way; failures no kind covers cost
    `restart_s`."""

    def __post_init__(self) -> None:
        if self.name not in RECOVERY_KIND_NAMES:
            raise ValueError(
                f"recovery kind must be one of {', '.join(RECOVERY_KIND_NAMES)}, got {self.name!r}"
            )
        _check(f"{self.name} cost", self.cost_s)
        if not (math.isfinite(self.share) and 0.0 <= self.share <= 1.0):
            raise ValueError(f"{self.name} share must be between 0 and 1, got {self.share}")


@dataclass(frozen=True, kw_only=True)
class JobParams:
    """One job's costs, failure rates and checkpoint policy (see docs/simulate.md for each)."""

    gpus: int = 8
    """GPUs of the job."""
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE
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
    recovery_kinds: tuple[RecoveryKind, ...] = ()
    """Ways failures are recovered that cost other than `restart_s` (a restart in place, a warm restart),
    each with its share of the failures: each failure draws its kind (a seeded stream of its own per run)."""

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
        names = [k.name for k in self.recovery_kinds]
        if len(set(names)) != len(names):
            raise ValueError(f"each recovery kind may be given once, got {', '.join(names)}")
        if math.fsum(k.share for k in self.recovery_kinds) > 1.0 + 1e-9:
            raise ValueError("the recovery kinds' shares add up to more than 1 (of all failures)")
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
    def longest_interval_s(self) -> float:
        """The longest checkpoint interval these params accept: the job's wall time, or its training when
        given as an amount of work (a profile read with `--from`)."""
        if self.duration_s is not None:
            return self.duration_s
        return math.inf if self.work_s is None else self.work_s * (1 + 1e-9)

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
    def mean_restart_s(self) -> float:
        """The mean cost of one failure's recovery, lost work excluded: `restart_s`, or with recovery kinds
        each kind's cost for its share of the failures and `restart_s` for the rest."""
        covered = math.fsum(k.share for k in self.recovery_kinds)
        return math.fsum(k.share * k.cost_s for k in self.recovery_kinds) + (1.0 - covered) * self.restart_s

    def kind_restart(self, kind: RecoveryKind) -> tuple[float, Startup]:
        """(relaunch gap, start-up) of one recovery of `kind`: its cost less the detection, split like the
        job's own restart (all of it relaunch when the job's restart has no relaunch or start-up)."""
        rest = max(0.0, kind.cost_s - self.detection_s)
        total = self.restart_gap_s + self.restart_startup.total_s
        if total <= 0:
            return rest, Startup()
        f = rest / total
        s = self.restart_startup
        return self.restart_gap_s * f, Startup(
            init_s=s.init_s * f,
            compile_s=s.compile_s * f,
            restore_s=s.restore_s * f,
            data_wait_s=s.data_wait_s * f,
        )

    @property
    def save_cost_s(self) -> float:
        """The loop's cost of one save: its blocking plus any wait for the previous persist."""
        return self.blocking_s + max(0.0, self.persist_s - self.interval_s)
