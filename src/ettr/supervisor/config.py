"""`RunConfig`: everything `ettr run` was asked to do, validated once."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ettr.inject import FaultSpec


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """What to supervise and how. The CLI fills the first fields from its flags; the rest are tuning knobs
    with defaults that suit real jobs."""

    command: tuple[str, ...]
    """The command to run (`python ...` or `torchrun ...`), without the `--`."""
    run_dir: str | None = None
    """The run directory (default `runs/<job_id>` under the current directory)."""
    job_id: str | None = None
    """The job's id (default Slurm's job id, else a fresh one)."""
    max_restarts: int = 3
    """Restarts after failures before giving up (the job then exits 1)."""
    inject: tuple[FaultSpec, ...] = ()
    """Faults to inject on purpose (`--inject`)."""
    hang_timeout_s: float | None = None
    """Seconds without progress or heartbeat after which an attempt is killed as hung. None: the default,
    `default_hang_timeout_s`, armed only once the attempt shows a first sign of life."""
    submitted_at: float | None = None
    """Unix time the job was submitted (else from Slurm, else unknown)."""
    allocated_at: float | None = None
    """Unix time its resources were allocated (else from Slurm, else unknown)."""
    family: str | None = None
    """The job family for fleet views (default derived from the command: `ettr.family.derive_family`)."""
    auto: bool = True
    """Zero-code instrumentation of Python children (`--no-auto` turns it off)."""
    backoff_s: float = 0.5
    """Wait before the first restart; it doubles for each further one."""
    max_backoff_s: float = 30.0
    """The longest wait between attempts."""
    grace_s: float = 10.0
    """After forwarding a preemption signal, how long the job may take to exit before SIGKILL."""
    hang_kill_grace_s: float = 3.0
    """After SIGTERM to a hung attempt, how long before SIGKILL."""
    default_hang_timeout_s: float = 300.0
    """The hang timeout when `hang_timeout_s` is not given."""
    poll_interval_s: float = 0.1
    """How often the supervisor looks at the attempt."""

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("command must not be empty")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        for name in ("backoff_s", "max_backoff_s", "grace_s", "hang_kill_grace_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        for name in ("default_hang_timeout_s", "poll_interval_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        if self.hang_timeout_s is not None and not (
            self.hang_timeout_s > 0 and math.isfinite(self.hang_timeout_s)
        ):
            raise ValueError(f"hang_timeout_s must be a finite number > 0, got {self.hang_timeout_s}")
        if self.family is not None:
            from ettr.family import valid_family

            problem = valid_family(self.family)
            if problem:
                raise ValueError(f"family {problem}, got {self.family!r}")
        if self.job_id is not None and (not self.job_id or "/" in self.job_id):
            raise ValueError(f"job_id must be a non-empty name without '/', got {self.job_id!r}")
