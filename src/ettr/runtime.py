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
from types import TracebackType

from ettr.constants import EXIT_COMPLETED, EXIT_FAILED
from ettr.errors import UsageError
from ettr.events import SUPERVISOR_RANK, Event, EventKind, Outcome
from ettr.ledger import Ledger, LedgerError, open_ledger
from ettr.procs import process_start_time
from ettr.recorder import NullRecorder, Recorder, host_name
from ettr.run_env import SPARE_ENV, RankEnv, RunEnv

logger = logging.getLogger("ettr")

_lock = threading.Lock()
_default: Recorder | None = None


def open_process_ledger(run_env: RunEnv) -> Ledger:
    """The ledger `ETTR_LEDGER` names (spilling to the run directory when it is a server), else the run
    directory's own (`ettr.ledger.locate`'s rule for writers)."""
    from ettr.ledger.url import open_for_run

    job_id = run_env.job_id or Path(run_env.run_dir).name
    return open_for_run(run_env.ledger_url, job_id=job_id, run_dir=str(run_env.run_dir), supervisor=False)


def recorder_from_env(environ: Mapping[str, str] | None = None) -> Recorder:
    """A Recorder for this process from its run (`RunEnv`: `ETTR_RUN_DIR`, `ETTR_ATTEMPT`, `ETTR_JOB_ID`) and
    torchrun's `RANK`/`WORLD_SIZE`/`LOCAL_RANK`; a NullRecorder when `ETTR_RUN_DIR` is unset or unusable.

    The recorder has no process hooks yet: the default recorder gets them (`get_recorder`, `set_recorder`)."""
    run_env = RunEnv.from_environ(environ)
    if run_env is None:
        return NullRecorder()
    ranks = RankEnv.from_environ(environ)
    # A spare (`ettr.bootstrap.spare`) records nothing until it is promoted: a recorder without a ledger, which
    # `release_held_recorder` opens then. Its listeners hear what the script records meanwhile.
    held = bool((os.environ if environ is None else environ).get(SPARE_ENV))
    try:
        ledger = None if held else open_process_ledger(run_env)
    except (LedgerError, OSError, UsageError) as exc:
        logger.warning("ettr: cannot open the ledger of %s (%s); recording is off", run_env.run_dir, exc)
        return NullRecorder()
    rec = Recorder(
        ledger,
        run_dir=run_env.run_dir,
        job_id=run_env.job_id,
        attempt=run_env.attempt,
        rank=ranks.rank,
        world_size=ranks.world_size,
    )
    if not held:
        record_process_start(rec, ranks.local_rank, supervisor_pid=run_env.supervisor_pid)
    return rec


def record_process_start(rec: Recorder, local_rank: int, *, supervisor_pid: int | None = None) -> None:
    """This process's PROCESS_START (its start time read from the kernel), as the rank `rec` records;
    `supervisor_pid`: the `ettr run` that started it (with the host, it tells a multi-node job's nodes'
    ranks apart in their one ledger)."""
    data: dict[str, object] = {
        "pid": os.getpid(),
        "host": host_name(),
        "world_size": rec.world_size,
        "local_rank": local_rank,
    }
    if supervisor_pid is not None:
        data["supervisor_pid"] = supervisor_pid
    rec.record(EventKind.PROCESS_START, ts=process_start_time(), data=data)


def get_recorder() -> Recorder:
    """The default recorder of this process (created on first use)."""
    global _default
    rec = _default
    if rec is None:
        with _lock:
            if _default is None:
                _default = recorder_from_env()
                _default.install_process_hooks()
            rec = _default
    return rec


def release_held_recorder() -> None:
    """In a spare just promoted: the default recorder the script made while it was held (if any) records from
    now on, through a ledger of its own, as the attempt's (its PROCESS_START now: `process_start_time`). The
    script's references to it stay good. Raises what opening the ledger raises."""
    rec = _default
    run_env = RunEnv.from_environ()
    if rec is None or rec.enabled or type(rec) is not Recorder or run_env is None or rec.run_dir is None:
        return
    ranks = RankEnv.from_environ()
    rec.attempt = run_env.attempt
    rec.reopen_in_child(open_process_ledger(run_env), rank=ranks.rank, world_size=ranks.world_size)
    rec.install_process_hooks()
    record_process_start(rec, ranks.local_rank, supervisor_pid=run_env.supervisor_pid)


def set_recorder(rec: Recorder | None) -> None:
    """Replace the default recorder (tests; `init`). None forgets it, so the next use reads the env again.

    The new default gets the process hooks (closed at exit, disabled in a forked child); the one it
    replaces keeps its own until it is closed."""
    global _default
    with _lock:
        _default = rec
        if rec is not None:
            rec.install_process_hooks()


def init(run_dir: str | os.PathLike[str], *, job_id: str | None = None) -> Recorder:
    """Record this process into `run_dir` without the supervisor (API-only use).

    Under `ettr run` this is the environment's recorder and `run_dir` is ignored. Alone, rank 0 also
    writes the supervisor's side — the attempt's start now, and at exit its end (completed, or failed on an
    uncaught exception) and the job's end — so the run directory is reportable on its own. Running the
    script again into the same directory records the next attempt.
    """
    if RunEnv.from_environ() is not None:
        return get_recorder()
    run_dir = Path(run_dir).absolute()
    job_id = job_id or run_dir.name
    ledger = open_ledger(run_dir)
    rank = RankEnv.from_environ().rank
    previous = [e for e in ledger.read() if e.kind is EventKind.PROCESS_START and e.rank == rank]
    attempt = 1 + max((e.attempt for e in previous), default=-1)
    env = {**os.environ, **RunEnv(run_dir=run_dir, job_id=job_id, attempt=attempt).to_environ()}
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

    def excepthook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        failed.append(exc)
        rec.failure(exc)
        previous_hook(exc_type, exc, tb)

    def at_exit() -> None:
        rec.close()
        outcome = Outcome.FAILED if failed else Outcome.COMPLETED
        now = time.time()
        data = {"outcome": outcome.value, "exit_code": EXIT_FAILED if failed else EXIT_COMPLETED}
        if failed:
            data["exception"] = type(failed[0]).__name__
        ends = [Event(EventKind.ATTEMPT_END, now, rec.attempt, SUPERVISOR_RANK, data=data)]
        if not failed:
            ends.append(
                Event(
                    EventKind.JOB_END, now, rec.attempt, SUPERVISOR_RANK, data={"exit_status": EXIT_COMPLETED}
                )
            )
        try:
            own.append(ends)
            own.close()
        except Exception as exc:  # telemetry never turns an exit into a crash
            logger.warning("ettr: could not record the end of the attempt (%s)", exc)

    sys.excepthook = excepthook
    atexit.register(at_exit)


__all__ = ["get_recorder", "set_recorder", "recorder_from_env", "init", "SUPERVISOR_RANK"]
