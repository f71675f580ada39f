"""The process's default Recorder: found from the environment `ettr run` sets, or set up by `ettr.init`."""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from ettr.errors import UsageError
from ettr.events import SUPERVISOR_RANK, Event, EventKind, Outcome
from ettr.ledger import Ledger, LedgerError, open_ledger
from ettr.recorder import NullRecorder, Recorder, host_name, process_start_time
from ettr.supervisor.launch import LEDGER_ENV

logger = logging.getLogger("ettr")

_lock = threading.Lock()
_default: Recorder | None = None


def _int_env(environ: Mapping[str, str], name: str, default: int) -> int:
    try:
        return int(environ.get(name, default))
    except ValueError:
        return default


def _open_process_ledger(environ: Mapping[str, str], run_dir: str) -> Ledger:
    """The ledger `ETTR_LEDGER` names (spilling to the run directory when it is a server), else the run
    directory's own."""
    url = environ.get(LEDGER_ENV)
    if not url:
        return open_ledger(run_dir)
    from ettr.ledger.url import open_for_run

    job_id = environ.get("ETTR_JOB_ID") or Path(run_dir).name
    return open_for_run(url, job_id=job_id, run_dir=run_dir, supervisor=False)


def recorder_from_env(environ: Mapping[str, str] | None = None) -> Recorder:
    """A Recorder for this process from `ETTR_RUN_DIR`, `ETTR_LEDGER`, `ETTR_ATTEMPT`, `ETTR_JOB_ID`, torchrun's
    `RANK`/`WORLD_SIZE`/`LOCAL_RANK`; a NullRecorder when `ETTR_RUN_DIR` is unset or unusable."""
    environ = os.environ if environ is None else environ
    run_dir = environ.get("ETTR_RUN_DIR")
    if not run_dir:
        return NullRecorder()
    try:
        ledger = _open_process_ledger(environ, run_dir)
    except (LedgerError, OSError, UsageError) as exc:
        logger.warning("ettr: cannot open the ledger of %s (%s); recording is off", run_dir, exc)
        return NullRecorder()
    rec = Recorder(
        ledger,
        run_dir=run_dir,
        job_id=environ.get("ETTR_JOB_ID", ""),
        attempt=_int_env(environ, "ETTR_ATTEMPT", 0),
        rank=_int_env(environ, "RANK", 0),
        world_size=_int_env(environ, "WORLD_SIZE", 1),
    )
    rec.record(
        EventKind.PROCESS_START,
        ts=process_start_time(),
        data={
            "pid": os.getpid(),
            "host": host_name(),
            "world_size": rec.world_size,
            "local_rank": _int_env(environ, "LOCAL_RANK", 0),
        },
    )
    return rec


def get_recorder() -> Recorder:
    """The default recorder of this process (created on first use)."""
    global _default
    rec = _default
    if rec is None:
        with _lock:
            if _default is None:
                _default = recorder_from_env()
            rec = _default
    return rec


def set_recorder(rec: Recorder | None) -> None:
    """Replace the default recorder (tests; `init`). None forgets it, so the next use reads the env again."""
    global _default
    with _lock:
        _default = rec


def init(run_dir: str | os.PathLike[str], *, job_id: str | None = None) -> Recorder:
    """Record this process into `run_dir` without the supervisor (API-only use).

    Under `ettr run` this is the environment's recorder and `run_dir` is ignored. Alone, rank 0 also
    writes the supervisor's side — the attempt's start now, and at exit its end (completed, or failed on an
    uncaught exception) and the job's end — so the run directory is reportable on its own. Running the
    script again into the same directory records the next attempt.
    """
    if os.environ.get("ETTR_RUN_DIR"):
        return get_recorder()
    run_dir = Path(run_dir).absolute()
    job_id = job_id or run_dir.name
    ledger = open_ledger(run_dir)
    rank = _int_env(os.environ, "RANK", 0)
    previous = [e for e in ledger.read() if e.kind is EventKind.PROCESS_START and e.rank == rank]
    attempt = 1 + max((e.attempt for e in previous), default=-1)
    env = {**os.environ, "ETTR_RUN_DIR": str(run_dir), "ETTR_ATTEMPT": str(attempt), "ETTR_JOB_ID": job_id}
    ledger.close()
    rec = recorder_from_env(env)
    set_recorder(rec)
    if rank == 0 and rec.enabled:
        # The supervisor's side, written straight to the ledger (durable at once) as rank SUPERVISOR_RANK.
        own = open_ledger(run_dir)
        start_s = process_start_time()
        pid = os.getpid()
        first = [
            Event(
                EventKind.SUPERVISOR_START, start_s, 0, SUPERVISOR_RANK, data={"pid": pid, "job_id": job_id}
            )
        ]
        own.append(
            (first if attempt == 0 else [])
            + [
                Event(
                    EventKind.ATTEMPT_START,
                    start_s,
                    attempt,
                    SUPERVISOR_RANK,
                    data={"pid": pid, "standalone": True},
                )
            ]
        )
        _watch_exit(rec, own)
    return rec


def _watch_exit(rec: Recorder, own: Ledger) -> None:
    failed: list[BaseException] = []
    previous_hook = sys.excepthook

    def excepthook(exc_type, exc, tb):  # type: ignore[no-untyped-def]
        failed.append(exc)
        rec.failure(exc)
        previous_hook(exc_type, exc, tb)

    def at_exit() -> None:
        rec.close()
        outcome = Outcome.FAILED if failed else Outcome.COMPLETED
        now = time.time()
        data = {"outcome": outcome.value, "exit_code": 1 if failed else 0}
        if failed:
            data["exception"] = type(failed[0]).__name__
        ends = [Event(EventKind.ATTEMPT_END, now, rec.attempt, SUPERVISOR_RANK, data=data)]
        if not failed:
            ends.append(Event(EventKind.JOB_END, now, rec.attempt, SUPERVISOR_RANK, data={"exit_status": 0}))
        try:
            own.append(ends)
            own.close()
        except Exception as exc:  # telemetry never turns an exit into a crash
            logger.warning("ettr: could not record the end of the attempt (%s)", exc)

    sys.excepthook = excepthook
    atexit.register(at_exit)


__all__ = ["get_recorder", "set_recorder", "recorder_from_env", "init", "SUPERVISOR_RANK"]
