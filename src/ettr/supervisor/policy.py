"""Whether, and when, a job is restarted after an attempt: the restart policy (pure: no I/O, no clock).

    decision = policy.decide(ended, restarts_used=n, history=earlier, signalled=None)
    decision.restart -> wait decision.wait_s, then the next attempt; else exit with decision.exit_status

The rules (in order):
1. a completed attempt ends the job: exit 0;
2. a signal to the supervisor (preemption, Ctrl-C) ends it: 143, or 130 for SIGINT, no restart (the
   scheduler requeues the job);
3. with the restarts used up (`max_restarts`): exit 1;
4. otherwise restart: at once for the first restart of a failure that looks transient (a failed or hung
   attempt that had trained: a crash in the middle of training, not a script that cannot start), else after
   `backoff_s` doubling per restart, at most `max_backoff_s` (a job that fails again and again is not
   restarted in a tight loop).

Each decision is taken from the ended attempt's classification (`ettr.supervisor.classify.AttemptEnd`:
outcome, exit status, signal, exception, OOM, injected fault), whether it made progress, and the attempts
before it in this supervisor (`history`): a policy that decides from the failure's cause reads them there.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Sequence
from dataclasses import dataclass

from ettr.constants import EXIT_COMPLETED, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_PREEMPTED
from ettr.events import Outcome
from ettr.supervisor.classify import AttemptEnd


@dataclass(frozen=True, kw_only=True)
class EndedAttempt:
    """One ended attempt, as the policy sees it."""

    attempt: int
    end: AttemptEnd
    """Its classification (the ATTEMPT_END data)."""
    made_progress: bool
    """A training process of the attempt completed a step (its failure came after progress)."""


@dataclass(frozen=True, kw_only=True)
class Decision:
    """What to do after an attempt."""

    restart: bool
    wait_s: float = 0.0
    """Before the next attempt (when `restart`)."""
    exit_status: int | None = None
    """The job's exit status (when not `restart`)."""
    why: str = ""
    """For people: `restarting in 0.5 s (1 of 3)`, `no restarts left`, `not restarting`."""


def stopped_status(signum: int) -> int:
    """The exit status of a job the supervisor was asked to stop by `signum`: 130 for SIGINT, else 143."""
    return EXIT_INTERRUPTED if signum == signal.SIGINT else EXIT_PREEMPTED


def backoff_wait_s(
    restart: int, *, outcome: Outcome, made_progress: bool, backoff_s: float, max_backoff_s: float
) -> float:
    """Seconds to wait before restart number `restart` + 1 (0-based `restart`): rule 4 above."""
    transient = made_progress and outcome in (Outcome.FAILED, Outcome.HUNG)
    if restart == 0 and transient:
        return 0.0
    return min(max_backoff_s, backoff_s * 2**restart)


@dataclass(frozen=True, kw_only=True)
class RestartPolicy:
    """The rules in the module docstring."""

    max_restarts: int = 3
    """Restarts after failures before the job gives up (exit 1)."""
    backoff_s: float = 0.5
    """Wait before the first restart that is not at once; it doubles for each further one."""
    max_backoff_s: float = 30.0
    """The longest wait between attempts."""

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        for name in ("backoff_s", "max_backoff_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")

    def may_start(self, restarts_used: int) -> bool:
        """Whether an attempt may start after `restarts_used` restarts (a requeued job's budget may be spent)."""
        return restarts_used <= self.max_restarts

    def decide(
        self,
        ended: EndedAttempt,
        *,
        restarts_used: int,
        history: Sequence[EndedAttempt] = (),
        signalled: int | None = None,
    ) -> Decision:
        """What follows `ended`, after `restarts_used` restarts (before it) and the earlier attempts of this
        supervisor (`history`, oldest first); `signalled`: the signal the supervisor received, if any."""
        if ended.end.outcome is Outcome.COMPLETED:
            return Decision(restart=False, exit_status=EXIT_COMPLETED, why="completed")
        if signalled is not None:
            return Decision(restart=False, exit_status=stopped_status(signalled), why="not restarting")
        if restarts_used >= self.max_restarts:
            return Decision(restart=False, exit_status=EXIT_FAILED, why="no restarts left")
        wait_s = backoff_wait_s(
            restarts_used,
            outcome=ended.end.outcome,
            made_progress=ended.made_progress,
            backoff_s=self.backoff_s,
            max_backoff_s=self.max_backoff_s,
        )
        return Decision(
            restart=True,
            wait_s=wait_s,
            why=f"restarting in {wait_s:g} s ({restarts_used + 1} of {self.max_restarts})",
        )
