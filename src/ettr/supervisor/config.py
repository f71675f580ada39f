"""`RunConfig`: everything `ettr run` was asked to do, validated once."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from ettr.inject import FaultSpec
from ettr.run_env import JOB_ID_PATTERN as JOB_ID_PATTERN  # (where it was first defined)

CLOCK_SKEW_S = 300.0  # how far in the future a given time may be (clocks of submit hosts differ a little)
MAX_AGE_S = 5 * 365.25 * 86400.0
"""How far in the past a given time may be: half the span around a job's median time outside which the books
skip an event as damage (`ettr.ledger.rows.PLAUSIBLE_SPAN_S`). `--allocated-at 0` was recorded, then skipped on
every read (`skipped 1 unreadable ledger records`, the time given silently lost)."""


def check_job_id(job_id: str) -> str:
    """`job_id` if it is a safe id (see JOB_ID_PATTERN); ValueError saying what is allowed otherwise."""
    if not JOB_ID_PATTERN.fullmatch(job_id):
        shown = repr(job_id) if len(job_id) <= 80 else f"{job_id[:60]!r}... ({len(job_id)} characters)"
        raise ValueError(
            f"job_id {shown} is not allowed (use letters, digits and ._+- , starting with a letter or "
            "digit, at most 128 characters)"
        )
    return job_id


def check_job_times(submitted_at: float | None, allocated_at: float | None, *, now: float) -> None:
    """Refuse times that cannot be: not finite, in the future, an allocation before the submission, or years
    before now (a job waits no years in a queue: seconds since 1970 mistyped, or a small number of seconds)."""
    for name, value in (("submitted-at", submitted_at), ("allocated-at", allocated_at)):
        if value is None:
            continue
        if not math.isfinite(value):
            raise ValueError(f"--{name} {value} is not a time")
        if value > now + CLOCK_SKEW_S:
            raise ValueError(f"--{name} is {value - now:.0f} s in the future (give when it happened)")
    if submitted_at is not None and allocated_at is not None and allocated_at < submitted_at:
        raise ValueError(
            f"--allocated-at is {submitted_at - allocated_at:.0f} s before --submitted-at "
            "(a job is allocated after it is submitted)"
        )
    for name, value in (("submitted-at", submitted_at), ("allocated-at", allocated_at)):
        if value is not None and value < now - MAX_AGE_S:
            raise ValueError(
                f"--{name} {value:g} is {(now - value) / (365.25 * 86400):.0f} years before now "
                "(give when it happened, in Unix seconds or ISO-8601)"
            )


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
    """Seconds without progress or heartbeat after which an attempt is killed as hung, once its steps run
    (instead of the bound that follows the job's step time); start-up and long phases get at least this.
    None: bounds that follow the job, armed only once the attempt shows a first sign of life."""
    submitted_at: float | None = None
    """Unix time the job was submitted (else from Slurm, else unknown)."""
    allocated_at: float | None = None
    """Unix time its resources were allocated (else from Slurm, else unknown)."""
    family: str | None = None
    """The job family for fleet views (default derived from the command: `ettr.family.derive_family`)."""
    auto: bool = True
    """Zero-code instrumentation of Python children (`--no-auto` turns it off)."""
    ledger_url: str | None = None
    """Where the books go (`--ledger`: `sqlite:///PATH` or `postgresql://...`); None: the run directory's
    SQLite file. Training processes get it as `ETTR_LEDGER`."""
    continue_job: bool = False
    """Add this run's attempts to the books of `job_id` in a shared ledger even when another run directory
    (another command, for books that name none) started them (`--continue-job`). Without it such a job id is
    refused: a requeue is the same run directory, or the same Slurm job."""
    ledger_drain_s: float = 60.0
    """At the job's end, how long to keep trying to deliver events spilled during a server outage."""
    backoff_s: float = 0.5
    """Wait before the first restart; it doubles for each further one."""
    max_backoff_s: float = 30.0
    """The longest wait between attempts."""
    max_restarts_without_progress: int = 2
    """Restarts in a row that reach no step beyond the furthest one before them, after which the job stops
    with exit status 3 (restarts would not help); 0: no such limit."""
    grace_s: float = 10.0
    """After forwarding a preemption signal, how long the job may take to exit before SIGKILL."""
    hang_kill_grace_s: float = 3.0
    """After SIGTERM to a hung attempt, how long before SIGKILL."""
    default_hang_timeout_s: float = 300.0
    """The hang bound of start-up and of every long phase (compile, restore, checkpoint, evaluation), unless the
    job's books teach a longer one or `hang_timeout_s` is larger (`ettr.supervisor.watchdog`)."""
    hang_step_multiple: float = 10.0
    """Once steps run: this many median step times without a sign of life is a hang..."""
    hang_floor_s: float = 10.0
    """...but never less than this."""
    poll_interval_s: float = 0.1
    """How often the supervisor looks at the attempt."""
    end_retry_s: float = 60.0
    """How long an end event (ATTEMPT_END, JOB_END) the ledger refuses (a full disk) is retried before the
    supervisor gives up on it with a line on stderr."""
    peer_timeout_s: float = 60.0
    """Multi-node jobs: how long a node's supervisor may be silent in the ledger before its peers count it
    lost and end the attempt (`--peer-timeout`)."""
    follower_wait_s: float = 600.0
    """Multi-node jobs: how long a node other than 0 waits for an attempt to join while node 0's supervisor
    is silent, before it gives up (exit 1)."""

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("command must not be empty")
        if self.run_dir == "":
            raise ValueError("run_dir must not be empty (None: runs/<job_id>)")
        for name in ("max_restarts", "max_restarts_without_progress"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in (
            "backoff_s",
            "max_backoff_s",
            "grace_s",
            "hang_kill_grace_s",
            "ledger_drain_s",
            "end_retry_s",
        ):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        for name in (
            "default_hang_timeout_s",
            "hang_step_multiple",
            "hang_floor_s",
            "poll_interval_s",
            "peer_timeout_s",
            "follower_wait_s",
        ):
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
        if self.job_id is not None:
            check_job_id(self.job_id)
        check_job_times(self.submitted_at, self.allocated_at, now=time.time())
