"""A job's books across the processes that keep them: whose supervisor still runs, the job's recorded id,
and the ATTEMPT_END a killed supervisor (or publisher) never wrote.

The supervisor (a requeued job; after its own SIGKILL), the publisher (a dead publisher's takeover) and
`ettr report` (is this job still running?) all need the same answers, so they live here, beside none of them.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any

from ettr.events import SUPERVISOR_RANK, Event, EventKind, Outcome
from ettr.procs import pid_alive
from ettr.run_env import JOB_ID_PATTERN


def live_supervisor(events: Sequence[Event]) -> int | None:
    """The pid of a supervisor of this job still running on this host, if the ledger names one.

    Its SUPERVISOR_START names its pid, host and start ticks; liveness follows `ettr.procs.pid_alive`.
    The calling process itself never counts (a supervisor started again on the same run directory).
    """
    named = _open_supervisor(events)
    if named is None or named[0] == os.getpid():
        return None
    pid, ticks = named
    return pid if pid_alive(pid, ticks) else None


def supervisor_alive(events: Sequence[Event]) -> bool | None:
    """Whether the supervisor of a job without an end still runs, for the accounting's `supervisor_alive`:
    True or False when the ledger names one on this host (`ettr.procs.pid_alive`); None when it names none
    (or the job ended) or one on another host (it cannot be told from here)."""
    named = _open_supervisor(events)
    return None if named is None else pid_alive(*named)


def _open_supervisor(events: Sequence[Event]) -> tuple[int, int | None] | None:
    """(pid, start ticks) of the supervisor of the last run without a JOB_END, when on this host."""
    start = None
    for e in events:
        if e.kind is EventKind.SUPERVISOR_START:
            start = e
        elif e.kind is EventKind.JOB_END:
            start = None
    if start is None or not start.data:
        return None
    pid, host = start.data.get("pid"), start.data.get("host")
    if not isinstance(pid, int) or isinstance(pid, bool) or (host and host != socket.gethostname()):
        return None
    ticks = start.data.get("pid_start_ticks")
    return pid, ticks if isinstance(ticks, int) else None


def completed_at(events: Sequence[Event]) -> float | None:
    """When the job in these books completed (its last JOB_END, exit status 0, with no supervisor started
    after it); None when it did not, or was continued since."""
    last_end = max((e for e in events if e.kind is EventKind.JOB_END), key=lambda e: e.ts, default=None)
    if last_end is None or not isinstance(last_end.data, Mapping) or last_end.data.get("exit_status") != 0:
        return None
    if any(e.kind is EventKind.SUPERVISOR_START and e.ts > last_end.ts for e in events):
        return None
    return last_end.ts


def recorded_job_id(events: Sequence[Event]) -> str | None:
    """The job id the first supervisor of this run directory recorded (None: none recorded). Only an id
    `ettr run` would take (`run_env.JOB_ID_PATTERN`): a forged ledger's `../x/$(...)` or one with a newline
    was adopted by a requeued `ettr run` as the job's id (`ETTR_JOB_ID` of every process) and printed by
    `ettr report` as lines of its own."""
    for e in events:
        if e.kind is EventKind.SUPERVISOR_START and e.data:
            job_id = e.data.get("job_id")
            if isinstance(job_id, str) and JOB_ID_PATTERN.fullmatch(job_id):
                return job_id
    return None


def foreign_run(
    events: Sequence[Event],
    *,
    run_dir: str | os.PathLike[str],
    command: Sequence[str],
    environ: Mapping[str, str] | None = None,
) -> str | None:
    """Why the job in `events` is another run's, not one this run (`run_dir`, `command`) may continue; None
    when it may: a requeue is the same run directory, or the same Slurm job (`SLURM_JOB_ID`). Books from an
    ettr that recorded no run directory are continued by the same command. A job id reused by an unrelated
    run would otherwise merge two jobs' books (their attempts, their wall time) into one report."""
    environ = os.environ if environ is None else environ
    last = None
    for e in events:
        if e.kind is EventKind.SUPERVISOR_START and e.rank == SUPERVISOR_RANK and isinstance(e.data, dict):
            last = e.data
    if last is None:
        return None
    slurm_job = environ.get("SLURM_JOB_ID")
    if slurm_job and last.get("slurm_job_id") == slurm_job:
        return None
    recorded_dir = last.get("run_dir")
    if isinstance(recorded_dir, str):
        if os.path.realpath(recorded_dir) == os.path.realpath(run_dir):
            return None
        return f"run directory {recorded_dir}"
    recorded_command = last.get("command")
    if not isinstance(recorded_command, list) or list(recorded_command) == list(command):
        return None
    return "command " + " ".join(str(part) for part in recorded_command)


def closing_events(
    events: Sequence[Event],
    *,
    reason: str,
    dated_by_process_events: bool = True,
    extra: Mapping[str, Any] | None = None,
) -> list[Event]:
    """An ATTEMPT_END (outcome failed, `closed_from_ledger`) for each attempt started and never ended.

    Each is dated at the attempt's last event: its training processes' events (rank >= 0) and its start when
    `dated_by_process_events`, else any event of the attempt.
    """
    last_ts: dict[int, float] = {}
    for e in events:
        if not dated_by_process_events or e.rank >= 0 or e.kind is EventKind.ATTEMPT_START:
            last_ts[e.attempt] = max(last_ts.get(e.attempt, e.ts), e.ts)
    data = {"outcome": Outcome.FAILED.value, "exit_code": None, **(extra or {}), "reason": reason,
            "closed_from_ledger": True}  # fmt: skip
    return [
        Event(EventKind.ATTEMPT_END, last_ts[attempt], attempt, SUPERVISOR_RANK, data=dict(data))
        for attempt in open_attempts(events)
    ]


def open_attempts(events: Sequence[Event]) -> list[int]:
    """The attempts the books started and never ended (their supervisor killed while they ran), in order."""
    started, ended = set(), set()
    for e in events:
        if e.kind is EventKind.ATTEMPT_START:
            started.add(e.attempt)
        elif e.kind is EventKind.ATTEMPT_END:
            ended.add(e.attempt)
    return sorted(started - ended)
