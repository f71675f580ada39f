"""The publish job's own ledger: a separate job, in its own run directory, linked to the training job.

A publisher acts as the supervisor of the publish job: it writes JOB_SUBMITTED (when the training job
enqueued the request), JOB_ALLOCATED (when a publisher first claimed it), SUPERVISOR_START (with
`job_id` and `linked_job`, the training job's id), ATTEMPT_START/ATTEMPT_END around each try, the stages
of the build as phases (`restore` for loading the anchor, `publish` with a `stage` for export, verify,
write, commit) and JOB_END. A publisher that takes over the request of a dead one first closes the dead
attempt at the last event it wrote, so `ettr report` shows the failure and the retry. Every event is
appended at once (one transaction each): a publisher killed at any point leaves books a report can read.
Nothing here raises: a ledger that cannot be written is logged once and publishing goes on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ettr.closing import closing_events
from ettr.events import SUPERVISOR_RANK, Event, EventKind, Outcome, Phase
from ettr.procs import start_ticks
from ettr.publish.queue import Claim
from ettr.publish.request import PublishRequest
from ettr.warn import WarnOnce

logger = logging.getLogger("ettr")

PUBLISH_RANK = 0
"""Rank of the publisher's own phase events (it is the publish job's only process)."""


def _closing_events(events: Sequence[Event], reason: str) -> list[Event]:
    """ATTEMPT_END for every attempt that was started and never ended, at the last event of that attempt."""
    return closing_events(events, reason=reason, dated_by_process_events=False)


class PublishBooks:
    """Events of one publish job, written to `request.run_dir`'s ledger.

    Args:
        request: the request being published (run directory, ids, submission time).
        command: what this publisher runs as (for the record).
        clock: Unix seconds.
    """

    def __init__(
        self, request: PublishRequest, *, command: Sequence[str] = (), clock: Callable[[], float] = time.time
    ) -> None:
        self.request = request
        self.command = list(command)
        self._clock = clock
        self.attempt = 0
        self._ledger: Any = None
        self._warn_once = WarnOnce(
            "ettr: cannot write the publish job's ledger ({error}); publishing goes on"
        )
        if request.run_dir is not None:
            try:
                from ettr.ledger import open_ledger

                self._ledger = open_ledger(request.run_dir)
            except Exception as exc:  # noqa: BLE001 - telemetry never stops publishing
                self._warn(exc)

    def _warn(self, exc: BaseException) -> None:
        self._warn_once("ledger", exc)

    def _append(self, events: Sequence[Event]) -> None:
        if self._ledger is None or not events:
            return
        try:
            self._ledger.append(list(events))
        except Exception as exc:  # noqa: BLE001
            self._warn(exc)

    def _read(self) -> list[Event]:
        if self._ledger is None:
            return []
        try:
            return self._ledger.read()
        except Exception as exc:  # noqa: BLE001
            self._warn(exc)
            return []

    def begin(self, claim: Claim) -> int:
        """Open this publisher's attempt (closing one a dead publisher left open); returns its index."""
        events = self._read()
        now = self._clock()
        reason = "the publisher died or stopped renewing its claim; another publisher took the request over"
        closing = _closing_events(events, reason)
        known = {e.kind for e in events}
        pid = os.getpid()
        out: list[Event] = list(closing)
        if EventKind.JOB_SUBMITTED not in known and self.request.created_ts > 0:
            out.append(Event(EventKind.JOB_SUBMITTED, min(self.request.created_ts, now), 0, SUPERVISOR_RANK))
        if EventKind.JOB_ALLOCATED not in known:
            out.append(Event(EventKind.JOB_ALLOCATED, min(claim.first_claimed_ts, now), 0, SUPERVISOR_RANK))
        self.attempt = 1 + max((e.attempt for e in events if e.kind is EventKind.ATTEMPT_START), default=-1)
        out.append(
            Event(
                EventKind.SUPERVISOR_START,
                now,
                self.attempt,
                SUPERVISOR_RANK,
                data={
                    "job_id": self.request.publish_job_id,
                    "linked_job": self.request.job_id,
                    "linked_run_dir": self.request.train_run_dir,
                    "kind": "publish",
                    "request_id": self.request.request_id,
                    "pid": pid,
                    "pid_start_ticks": start_ticks(pid),
                    "host": socket.gethostname(),
                    "command": self.command,
                    "max_restarts": None,
                },
            )
        )
        out.append(
            Event(
                EventKind.ATTEMPT_START,
                now,
                self.attempt,
                SUPERVISOR_RANK,
                data={
                    "pid": pid,
                    "command": self.command,
                    "claim_attempt": claim.attempt,
                    "took_over": claim.previous,
                },
            )
        )
        self._append(out)
        return self.attempt

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Record one stage of the build as a phase (`load` as RESTORE, the rest as PUBLISH)."""
        phase = Phase.RESTORE if name == "load" else Phase.PUBLISH
        begin = self._clock()
        self._append(
            [Event(EventKind.PHASE_BEGIN, begin, self.attempt, PUBLISH_RANK, phase, data={"stage": name})]
        )
        error: str | None = None
        try:
            yield
        except BaseException as exc:
            error = type(exc).__name__
            raise
        finally:
            data = {"stage": name} if error is None else {"stage": name, "error": error}
            self._append(
                [
                    Event(
                        EventKind.PHASE_END,
                        self._clock(),
                        self.attempt,
                        PUBLISH_RANK,
                        phase,
                        value=begin,
                        data=data,
                    )
                ]
            )

    def end(
        self, *, ok: bool, reason: str | None = None, artifact_dir: str | None = None, final: bool = True
    ) -> None:
        """Close this attempt (and with `final`, the job): completed if `ok`, else failed with `reason`."""
        now = self._clock()
        outcome = Outcome.COMPLETED if ok else Outcome.FAILED
        events = [
            Event(
                EventKind.ATTEMPT_END,
                now,
                self.attempt,
                SUPERVISOR_RANK,
                data={"outcome": outcome.value, "exit_code": 0 if ok else 1, "reason": reason},
            )
        ]
        if final:
            events.append(
                Event(
                    EventKind.JOB_END,
                    now,
                    self.attempt,
                    SUPERVISOR_RANK,
                    data={"exit_status": 0 if ok else 1, "artifact_dir": artifact_dir},
                )
            )
        self._append(events)

    def close_abandoned(self, reason: str) -> None:
        """Close attempts a dead publisher left open and end the job as failed (attempts used up)."""
        events = self._read()
        closing = _closing_events(events, reason)
        now = self._clock()
        last = max((e.attempt for e in events), default=0)
        self._append(
            [
                *closing,
                Event(
                    EventKind.JOB_END, now, last, SUPERVISOR_RANK, data={"exit_status": 1, "reason": reason}
                ),
            ]
        )

    def close(self) -> None:
        if self._ledger is not None:
            with contextlib.suppress(Exception):
                self._ledger.close()
