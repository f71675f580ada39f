"""A job's books, as one supervisor keeps them: open, salvage, append, read, close.

`JobBooks` is the only supervisor code that touches the ledger. It opens the books of a new or requeued job (closing
the attempt a killed supervisor left open, after killing what that supervisor left running), salvages a damaged SQLite
ledger, appends the supervisor's events (the end events patiently: without them a completed job reads as failed),
answers the questions the rest of the supervisor asks of the books (the attempt's training events, its last activity,
whether a rank recorded a FAILURE), and closes them (delivering what a server outage spilled; `ettr.cli`'s job-end
hook then stores the fleet's summary). What it writes when it opens them is `ettr.supervisor.opening`'s.

A node of a multi-node job other than node 0 `join`s the books instead of opening them: it reads them and
writes node marks (`ettr.supervisor.peers`), never the job's own events.

A supervisor killed with SIGKILL leaves its last attempt without ATTEMPT_END. `ettr report` closes such a job in
memory at the last thing the ledger saw; a supervisor started again on the same run directory (a requeued job) first
writes the missing ATTEMPT_END, at the last event of that attempt, so the books it continues are closed on disk too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ettr.closing import completed_at, foreign_run, live_supervisor, open_attempts, recorded_job_id
from ettr.constants import SIGNALLED_MARK
from ettr.errors import UsageError, describe_os_error
from ettr.events import SUPERVISOR_RANK, Event, EventKind
from ettr.inject import FaultSpec, unfired_specs
from ettr.ledger import Ledger, LedgerError, open_ledger, rebuild_ledger
from ettr.ledger.base import attempt_events
from ettr.ledger.postgres import redact
from ettr.run_env import AGENT_DIRNAME, HEARTBEAT_DIRNAME, RUN_SUBDIRS
from ettr.steptail import tail_events
from ettr.supervisor import containment, peers, slurm
from ettr.supervisor.command_output import signal_name
from ettr.supervisor.config import RunConfig
from ettr.supervisor.messages import say
from ettr.supervisor.opening import closing_events, next_attempt, opening_events
from ettr.supervisor.policy import EndedAttempt, ended_attempts
from ettr.untrusted import symlinked_dirs

__all__ = ["JobBooks", "closing_events", "live_supervisor", "next_attempt"]

logger = logging.getLogger("ettr")

_PATIENT_KINDS = frozenset({EventKind.ATTEMPT_END, EventKind.JOB_END})
"""Retried for `RunConfig.end_retry_s` once per outage (not 60 s each): without them a completed job reads as failed."""


class JobBooks:
    """The books of one job, as its supervisor on this node keeps them (see the module docstring).

    Args:
        config: the run (ledger URL, command, times, end-event patience).
        run_dir: the run directory (absolute).
        job_id: the job's id as given or made up; `open` replaces a made-up one by the id a requeued run
            directory already holds (read `job_id` after `open`).
        family: the job family recorded in SUPERVISOR_START.
        ledger: books already open (an in-memory ledger in tests); else `open` or `join` opens them.
    """

    def __init__(
        self, config: RunConfig, *, run_dir: Path, job_id: str, family: str, ledger: Ledger | None = None
    ) -> None:
        self.config = config
        self.run_dir = run_dir
        self.job_id = job_id
        self.family = family
        self._ledger = ledger
        self._node_rank: int | None = None  # set by `join`: this node writes node marks only
        self._end_retry_s = config.end_retry_s  # the next end event's patience: 0 after one gave up

    # -- opening -----------------------------------------------------------------------------------------
    def _connect(self) -> list[Event]:
        """Open the ledger (the run directory's, or `--ledger URL`'s) and read what it holds."""
        if self._ledger is None:
            url = self.config.ledger_url
            self._ledger = self._open_url(url) if url else open_ledger(self.run_dir)
        return self._ledger.read()

    def _open_url(self, url: str) -> Ledger:
        """The shared ledger at `url` (it leaves the pointer that lets `ettr report RUN_DIR` find the books)."""
        from ettr.ledger.url import open_for_run

        try:
            return open_for_run(url, job_id=self.job_id, run_dir=self.run_dir, supervisor=True)
        except UsageError as exc:
            raise UsageError(f"ettr run: {exc}") from None

    def open(self, *, check: Callable[[Sequence[Event]], None] | None = None) -> int:
        """Open the job's books (a new job, or a requeued one: its earlier attempts closed, its leftover
        processes killed) and record the supervisor's start; the first attempt's index. Raises UsageError
        (one line) when the run directory cannot be used (one of its subdirectories a symlink included), or
        when `check` raises it for what the books hold (before anything is written)."""
        refused = symlinked_dirs(self.run_dir, RUN_SUBDIRS, inside=(HEARTBEAT_DIRNAME, AGENT_DIRNAME))
        if refused:  # heartbeats -> / had the job's heartbeats made at the file system's root
            raise UsageError(f"ettr run: cannot use run directory {self.run_dir}: {refused[0]} (remove it)")
        try:
            previous = self._connect()
        except (LedgerError, OSError) as exc:
            what = describe_os_error(exc) if isinstance(exc, OSError) else str(exc)
            raise UsageError(f"ettr run: cannot use run directory {self.run_dir}: {what}") from None
        recorded_id = recorded_job_id(previous)
        if self.config.job_id is None:  # a requeued job continues under the id it started with
            self.job_id = recorded_id or self.job_id
        elif recorded_id is not None and recorded_id != self.config.job_id:
            self.drop()
            raise UsageError(
                f"ettr run: {self.run_dir} holds job {recorded_id!r}, not {self.config.job_id!r} "
                "(give another --run-dir, or drop --job-id to continue that job)"
            )
        foreign = None if self.config.continue_job else self._foreign(previous)
        if foreign is not None:
            self.drop()
            raise UsageError(
                f"ettr run: job {self.job_id!r} in {self._where()} belongs to another run ({foreign}); "
                "give another --job-id, or --continue-job to add this run's attempts to that job"
            )
        if check is not None:
            try:
                check(previous)
            except UsageError:
                self.drop()
                raise
        live = live_supervisor(previous)
        if live is not None:
            self.drop()
            raise UsageError(
                f"ettr run: {self.run_dir} is in use by a running supervisor (pid {live}); "
                "give another --run-dir or --job-id"
            )
        done = None if self.config.continue_job or self._under_slurm() else completed_at(previous)
        if done is not None:  # a second run of a finished job is no recovery of it
            self.drop()
            raise UsageError(
                f"ettr run: job {self.job_id!r} in {self._where()} completed (exit status 0 at "
                f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(done))}): give another --run-dir for a new "
                "run, or --continue-job to add this run's attempts to that job"
            )
        if self._kill_leftovers():
            previous = self.read()  # they may have written until killed: close after their last
        for attempt in open_attempts(previous):  # its supervisor was killed: the steps its processes kept
            previous = [*previous, *self.record_unrecorded_steps(attempt, previous)]
        closing = closing_events(previous, self.run_dir)
        first_attempt = next_attempt(previous)
        note = slurm.restart_count_note(previous, os.environ)
        if note:
            say(note)
        opening = [
            *closing,
            *opening_events(
                self.config, run_dir=self.run_dir, job_id=self.job_id, family=self.family, previous=previous
            ),
        ]
        try:  # the first write: a ledger that reads but cannot be written is found here
            self._writer().append(opening)
        except sqlite3.OperationalError as exc:  # full, locked, read-only: not damage; the job goes on
            say(f"could not record the job's start in {self.run_dir} ({describe_os_error(exc)})")
        except (sqlite3.DatabaseError, LedgerError) as exc:  # malformed: damaged structure
            self._salvage(previous, opening, exc)
        except OSError as exc:
            say(f"could not record the job's start in {self.run_dir} ({describe_os_error(exc)})")
        if closing:
            say(f"closed {len(closing)} attempt(s) a killed supervisor left open in {self.run_dir}")
        if any(e.kind is EventKind.SUPERVISOR_START for e in previous):  # not just another node's marks
            say(f"continuing job {self.job_id} in {self.run_dir} (attempt {first_attempt})")
        return first_attempt

    @staticmethod
    def _under_slurm() -> bool:
        """Whether this run is inside a Slurm job: there a run directory is the job's (`runs/SLURM_JOB_ID`),
        and a finished one is continued (`scontrol requeue` of a finished job, or a batch script's second
        `ettr run`), as before."""
        return bool(os.environ.get("SLURM_JOB_ID"))

    def _foreign(self, previous: Sequence[Event]) -> str | None:
        """Why books under a shared ledger URL are another run's (None: a requeue of this one). The run
        directory's own ledger is this run's by where it is."""
        if not self.config.ledger_url:
            return None
        return foreign_run(previous, run_dir=self.run_dir, command=self.config.command)

    def _where(self) -> str:
        return redact(self.config.ledger_url or str(self.run_dir))

    def join(self, node_rank: int) -> list[Event]:
        """Join the books of a multi-node job as node `node_rank` (not 0): read them; from now on `append`
        writes this node's marks instead of the job's events. What they hold. Raises UsageError."""
        try:
            previous = self._connect()
        except (LedgerError, OSError) as exc:
            raise UsageError(f"ettr run: cannot use the ledger of job {self.job_id}: {exc}") from None
        self._node_rank = node_rank
        return previous

    def _salvage(self, previous: list[Event], opening: list[Event], exc: BaseException) -> None:
        """The ledger reads but cannot be written (damaged): keep it aside, continue in a fresh one holding
        every event that could be read. Raises UsageError if even that fails."""
        self.drop()
        try:
            self._ledger, aside = rebuild_ledger(self.run_dir, [*previous, *opening])
        except (sqlite3.DatabaseError, LedgerError, OSError) as again:
            raise UsageError(
                f"ettr run: the ledger in {self.run_dir} is damaged ({exc}) and cannot be rebuilt ({again}); "
                "move ledger.db aside to start the books afresh"
            ) from None
        say(
            f"the ledger in {self.run_dir} is damaged ({exc}); kept it as {aside.name} and continue with "
            f"the {len(previous)} event(s) that could be read"
        )

    def _kill_leftovers(self) -> bool:
        """Before a requeue continues the job: kill the processes a killed supervisor left running here (they
        would keep writing the previous attempt's events and checkpoints). Refuses (UsageError) if any
        survive. Whether there were any."""
        found = containment.leftovers(self.run_dir)
        if not found:
            return False
        pids = ", ".join(str(f.pid) for f in found)
        attempts = ", ".join(sorted({f.attempt for f in found}))
        alive = containment.kill_all((f.pid, f.start_ticks) for f in found)
        if alive:
            self.drop()
            raise UsageError(
                f"ettr run: processes {', '.join(map(str, alive))} of attempt {attempts} of this job still run "
                "and cannot be killed by this user (end them, then run again)"
            )
        say(
            f"killed {len(found)} process(es) of attempt {attempts} left running by a killed supervisor (pids {pids})"
        )
        return True

    # -- writing -----------------------------------------------------------------------------------------
    def _writer(self) -> Ledger:
        if self._ledger is None:
            raise LedgerError("the books are not open")
        return self._ledger

    @property
    def keeps_job_events(self) -> bool:
        """Whether this supervisor writes the job's own events (one node, or node 0 of several)."""
        return self._node_rank is None

    def note_signal(self, attempt: int, signum: int, *, ts: float) -> None:
        """Put on record that a signal stopping the job (`signum`) reached the supervisor during `attempt`,
        before a scheduler's SIGKILL can take the supervisor (`SIGNALLED_MARK`). Never raises."""
        self.append(EventKind.MARK, attempt=attempt, ts=ts, name=SIGNALLED_MARK, signal=signal_name(signum))

    def append(self, kind: EventKind, /, *, attempt: int = 0, ts: float | None = None, **data: Any) -> None:
        """Record one of the job's events, the end events patiently (`_PATIENT_KINDS`: a full disk, a locked ledger).
        A node that joined the books records its attempt's start and end as node marks only. Never raises."""
        event = Event(kind, time.time() if ts is None else ts, attempt, SUPERVISOR_RANK, data=data or None)
        if self._node_rank is not None:
            self._append_node_part(event)
            return
        patient = kind in _PATIENT_KINDS
        deadline, pause_s = time.monotonic() + (self._end_retry_s if patient else 0.0), 0.1
        while True:
            try:
                self._writer().append([event])
                self._end_retry_s = self.config.end_retry_s
                return
            except Exception as exc:  # the job matters more than its books
                if time.monotonic() + pause_s > deadline:
                    cause = describe_os_error(exc)
                    if patient:
                        say(
                            f"could not record {kind.value} of attempt {attempt} in {self.run_dir} "
                            f"({cause}); gave up after {self._end_retry_s:g} s"
                        )
                        self._end_retry_s = 0.0
                    else:
                        logger.warning("ettr: could not record %s (%s)", kind.value, cause)
                    return
            time.sleep(pause_s)
            pause_s = min(2.0, pause_s * 2)

    def record_unrecorded_steps(
        self, attempt: int, events: Sequence[Event], *, since: float | None = None
    ) -> list[Event]:
        """After `attempt`'s processes are gone: record the steps they took but died before writing (a SIGKILL,
        a SIGTERM without a handler; `ettr.steptail`), as their ranks' STEP events at the times they were
        taken. `events`: the attempt's events in the books; `since`: when it began (`tail_events`). Returns
        what it recorded. Never raises."""
        if not self.keeps_job_events:
            return []
        try:
            found = tail_events(self.run_dir, attempt, events, since=since)
            if not found:
                return []
            self._writer().append(found)
        except Exception as exc:  # the job matters more than its books
            logger.warning("ettr: could not record the steps of attempt %d after its end (%s)", attempt, exc)
            return []
        return found

    def _append_node_part(self, event: Event) -> None:
        assert self._node_rank is not None
        data = dict(event.data or {})
        if event.kind is EventKind.ATTEMPT_START:
            name = peers.NODE_ATTEMPT_START
            data["supervisor_pid"] = os.getpid()
        elif event.kind is EventKind.ATTEMPT_END:
            name = peers.NODE_ATTEMPT_END
        else:
            return  # the job's own events are node 0's
        self.mark(name, attempt=event.attempt, node_rank=self._node_rank, **data)

    def mark(self, name: str, *, attempt: int, node_rank: int, **data: Any) -> None:
        """Record a node mark (`ettr.supervisor.peers`); a failure is said, never raised."""
        event = peers.node_mark(name, node_rank=node_rank, attempt=attempt, ts=time.time(), **data)
        try:
            self._writer().append([event])
        except Exception as exc:  # the job matters more than its books
            say(f"could not record {name} ({exc})")

    # -- reading -----------------------------------------------------------------------------------------
    def read(self) -> list[Event]:
        """Every event of the job (raises LedgerError / OSError when the books cannot be read)."""
        return self._writer().read()

    def supervisor_events(self) -> list[Event]:
        """The supervisors' events (rank < 0) in append order (a narrow query: peers polling a long job do not
        read every training event each time). Raises like `read`."""
        return self._writer().read_supervisor()

    def attempt_events(self, attempt: int) -> list[Event]:
        """The training processes' events of `attempt`. While the books cannot be read (a ledger server
        outage), what this job's processes spilled in the run directory: the attempt's FAILURE is there."""
        try:
            return self._writer().read_attempt(attempt)  # not the whole job's millions of steps
        except Exception:
            return attempt_events(self._spilled(), attempt)

    def _spilled(self) -> list[Event]:
        """The events of this job in the run directory's spill files (`ettr.ledger.spill`)."""
        from ettr.ledger.spill import read_spill, spill_dir

        try:
            paths = sorted(p for p in spill_dir(self.run_dir).iterdir() if not p.name.startswith("."))
        except OSError:
            return []
        found: list[Event] = []
        for path in paths:
            try:
                header, records = read_spill(path)
            except (LedgerError, OSError):
                continue  # not a spill file, or gone (delivered) meanwhile
            if header.get("job_id") == self.job_id:  # another job's file says nothing of this one
                found.extend(record.event for record in records)
        return sorted(found, key=lambda e: e.ts)

    def history(self) -> list[EndedAttempt]:
        """The job's ended attempts in its books, oldest first ([] when they cannot be read): what the restart
        policy decides with after a requeue."""
        try:
            return ended_attempts(self.read())
        except Exception as exc:  # the job matters more than its books
            logger.warning("ettr: cannot read the job's earlier attempts (%s)", exc)
            return []

    def failure_recorded(self, attempt: int) -> bool:
        """Whether a training process of `attempt` recorded a FAILURE."""
        return any(e.kind is EventKind.FAILURE for e in self.attempt_events(attempt))

    def last_activity(self, attempt: int) -> float | None:
        """The newest training-process event of `attempt` (hang detection), None where unknown."""
        return None if self._ledger is None else self._ledger.last_activity(attempt)

    def unfired(self, specs: Sequence[FaultSpec]) -> list[FaultSpec]:
        """The `--inject` specs no process of the job fired ([] when the books cannot be read, and on a node
        that joined the books: node 0 says it)."""
        if not specs or not self.keeps_job_events:
            return []
        try:
            events = self.read()
        except Exception:
            return []
        return list(unfired_specs(specs, events))

    # -- closing -----------------------------------------------------------------------------------------
    def drop(self) -> None:
        """Close the ledger without waiting to deliver anything (a start refused before the job began)."""
        if self._ledger is not None:
            with contextlib.suppress(Exception):
                self._ledger.close()

    def close(self) -> None:
        """Close the books, first delivering what a server outage spilled (up to `ledger_drain_s`)."""
        ledger = self._ledger
        if ledger is None:
            return
        if ledger.health().pending:
            say(f"delivering spilled ledger events (up to {self.config.ledger_drain_s:g} s)")
        ledger.close(drain_timeout_s=self.config.ledger_drain_s)
