"""Synthetic jobs for fleet tests and benchmarks: the events `ettr run` and a training script would write.

`job_events` scripts one job (supervisor start with family and command, attempts with init/compile phases,
steps, checkpoint commits, failures and a job end); `write_job` appends them to a run directory's ledger
through the ledger API, as a real job would.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ettr.events import SUPERVISOR_RANK, Event, EventKind, Phase
from ettr.fleet.stored import store_at_job_end
from ettr.ledger import Ledger, open_ledger

K = EventKind
DEAD_PID = 2**22 + 12345
"""A pid no live process has (above the usual pid_max), so the job reads as finished."""


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """One synthetic job; times in seconds."""

    job_id: str
    family: str = "train"
    start_ts: float = 1_700_000_000.0
    world_size: int = 1
    init_s: float = 5.0
    compile_s: float = 3.0
    num_steps: int = 100
    step_s: float = 0.5
    ckpt_every: int = 25
    ckpt_block_s: float = 0.5
    fail_at_steps: tuple[int, ...] = ()
    """A crash (exit 1 with an exception) right after each of these steps, then a restart."""
    failure_kind: str = "user"
    """user (RuntimeError), infra (SIGKILL), preemption (SIGTERM) or hang."""
    running: bool = False
    """Leave the job open (no JOB_END) with a live supervisor pid (this process's)."""
    host: str | None = None
    """The supervisor's host (default this one; another host's supervisor is taken to be alive)."""
    supervisor_pid: int | None = None
    """The supervisor's pid (default: one no process has, or with `running` this process's)."""
    run_dir: str | None = None
    """The run directory its supervisor records (`run_dir` of SUPERVISOR_START; default: none, as older books)."""


def _end_data(kind: str) -> dict:
    if kind == "infra":
        return {"outcome": "failed", "exit_code": 137, "signal": "SIGKILL", "reason": "killed by SIGKILL"}
    if kind == "preemption":
        return {"outcome": "preempted", "exit_code": 143, "signal": "SIGTERM", "reason": "SIGTERM forwarded"}
    if kind == "hang":
        return {"outcome": "hung", "exit_code": 137, "signal": "SIGKILL", "reason": "no progress for 60 s"}
    return {"outcome": "failed", "exit_code": 1, "signal": None, "reason": "exit status 1: RuntimeError",
            "exception": "RuntimeError"}  # fmt: skip


def job_events(spec: JobSpec) -> list[Event]:
    """The events of `spec`, in time order."""
    import socket

    t = spec.start_ts
    sup = SUPERVISOR_RANK
    pid = spec.supervisor_pid or (os.getpid() if spec.running else DEAD_PID)
    events = [
        Event(
            K.SUPERVISOR_START,
            t,
            0,
            sup,
            data={
                "pid": pid,
                "host": spec.host or socket.gethostname(),
                "command": ["python", f"{spec.family}.py"],
                "job_id": spec.job_id,
                "family": spec.family,
                **({"run_dir": spec.run_dir} if spec.run_dir else {}),
            },
        )
    ]
    attempt, step, committed = 0, 0, 0
    fails = list(spec.fail_at_steps)
    while True:
        t += 0.2
        events.append(Event(K.ATTEMPT_START, t, attempt, sup, data={"pid": 1000 + attempt}))
        for rank in range(spec.world_size):
            events.append(
                Event(K.PROCESS_START, t + 0.1, attempt, rank, data={"world_size": spec.world_size})
            )
        t += 0.1
        events.append(Event(K.PHASE_END, t + spec.init_s, attempt, 0, phase=Phase.INIT, value=t))
        t += spec.init_s
        if spec.compile_s > 0:
            events.append(Event(K.PHASE_END, t + spec.compile_s, attempt, 0, phase=Phase.COMPILE, value=t))
            t += spec.compile_s
        if attempt:
            events.append(Event(K.RESUMED, t, attempt, 0, step=committed or None))
            step = committed
        failed = False
        while step < spec.num_steps:
            step += 1
            t += spec.step_s
            for rank in range(spec.world_size):
                events.append(Event(K.STEP, t, attempt, rank, step=step))
            if step % spec.ckpt_every == 0:
                events.append(Event(K.PHASE_END, t + spec.ckpt_block_s, attempt, 0,
                                    phase=Phase.CHECKPOINT_BLOCKING, value=t))  # fmt: skip
                t += spec.ckpt_block_s
                events.append(
                    Event(K.CHECKPOINT_COMMIT, t + 0.1, attempt, 0, step=step, data={"path": f"c/{step}"})
                )
                committed = step
            if fails and step == fails[0]:
                fails.pop(0)
                failed = True
                break
        if spec.running and not failed:
            return events
        t += 0.3
        if failed:
            if spec.failure_kind == "user":
                events.append(
                    Event(K.FAILURE, t, attempt, 0, data={"exception": "RuntimeError", "message": "boom"})
                )
            events.append(Event(K.ATTEMPT_END, t + 0.1, attempt, sup, data=_end_data(spec.failure_kind)))
            t += 1.0
            attempt += 1
            continue
        events.append(Event(K.PHASE_END, t + 0.5, attempt, 0, phase=Phase.SHUTDOWN, value=t))
        t += 0.6
        events.append(Event(K.ATTEMPT_END, t, attempt, sup, data={"outcome": "completed", "exit_code": 0}))
        events.append(Event(K.JOB_END, t + 0.1, attempt, sup, data={"exit_status": 0}))
        return events


def write_job(
    run_dir: str | os.PathLike[str], spec: JobSpec, *, batch: int = 50_000, close: bool = True
) -> Path:
    """Append the events of `spec` to `run_dir`'s ledger (created), in batches, and with `close` store the
    finished job's fleet summary as its supervisor does at job end; returns the run directory."""
    _append_all(open_ledger(run_dir), job_events(spec), batch)
    if close:
        store_at_job_end(run_dir, ledger_url=None, job_id=spec.job_id)
    return Path(run_dir)


def write_job_url(url: str, spec: JobSpec, *, batch: int = 50_000, close: bool = True) -> None:
    """`write_job` into the shared ledger at `url` (job `spec.job_id`, registered), as `ettr run --ledger`."""
    from ettr.ledger.url import open_url

    _append_all(open_url(url, job_id=spec.job_id, create=True), job_events(spec), batch)
    if close:
        store_at_job_end(Path("."), ledger_url=url, job_id=spec.job_id)


def _append_all(ledger: Ledger, events: list[Event], batch: int) -> None:
    """Append `events` in batches of `batch`, then close the ledger."""
    try:
        for i in range(0, len(events), batch):
            ledger.append(events[i : i + batch])
    finally:
        ledger.close()
