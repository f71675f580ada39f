"""A job's failure history, for the `auto` checkpoint interval: what the caller reads and hands the manager.

The interval policy is pure; the ledger read it needs is the caller's, made once at start-up:

    history = read_failure_history(ettr.get_recorder().run_dir)     # None: unknown (no ledger)
    manager = CheckpointManager.create(config, state, failure_history=history)

`FailureHistory.from_events` is the pure part (events in, counts out); `read_failure_history` opens the
run directory's ledger and never raises (an unreadable ledger is logged, and the prior alone is used).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

from ettr.checkpoint.policy import count_failures
from ettr.events import Event

logger = logging.getLogger("ettr")


@dataclass(frozen=True, kw_only=True)
class FailureHistory:
    """Failed attempts of this job before this one, and the job's age."""

    num_failures: int = 0
    """Attempts that ended other than completed."""
    job_age_s: float = 0.0
    """Seconds from the job's first event to now."""

    def __post_init__(self) -> None:
        if self.num_failures < 0:
            raise ValueError(f"num_failures must be >= 0, got {self.num_failures}")
        if self.job_age_s < 0:
            raise ValueError(f"job_age_s must be >= 0, got {self.job_age_s}")

    @classmethod
    def from_events(cls, events: Iterable[Event], *, now_ts: float) -> FailureHistory:
        """The history in a job's events as of Unix time `now_ts` (pure)."""
        num_failures, first_ts = count_failures(events)
        return cls(
            num_failures=num_failures, job_age_s=max(0.0, now_ts - first_ts) if first_ts is not None else 0.0
        )


def read_failure_history(run_dir: str | os.PathLike[str] | None) -> FailureHistory | None:
    """The failure history in the ledger of `run_dir` (None: no run directory, or an unreadable ledger)."""
    if run_dir is None:
        return None
    from ettr.ledger import read_run_events  # the job's books, wherever `ettr run --ledger` put them

    try:
        events = read_run_events(run_dir)
    except Exception as exc:  # telemetry must not stop training: fall back to the prior alone
        logger.warning("ettr: cannot read the failure history from %s (%s); using the prior", run_dir, exc)
        return None
    return FailureHistory.from_events(events, now_ts=time.time())
