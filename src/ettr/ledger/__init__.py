"""Durable, append-only storage of a job's events (SQLite in the run directory by default)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from pathlib import Path

from ettr.events import Event
from ettr.ledger.base import Ledger, LedgerError, LedgerHealth, LedgerRejected, MemoryLedger
from ettr.ledger.sqlite import LEDGER_FILENAME, SqliteLedger

__all__ = [
    "Ledger",
    "LedgerError",
    "LedgerHealth",
    "LedgerRejected",
    "MemoryLedger",
    "SqliteLedger",
    "open_ledger",
    "ledger_path",
    "read_run_events",
    "rebuild_ledger",
]


def ledger_path(run_dir: str | os.PathLike[str]) -> Path:
    """Where the ledger of `run_dir` lives."""
    return Path(run_dir) / LEDGER_FILENAME


def open_ledger(run_dir: str | os.PathLike[str], *, create: bool = True) -> Ledger:
    """Open (and with `create`, make) the run directory's own ledger (`RUN_DIR/ledger.db`). Raises
    `LedgerError`."""
    return SqliteLedger(ledger_path(run_dir), create=create)


def _read_all(ledger: Ledger) -> list[Event]:
    try:
        return ledger.read()
    finally:
        ledger.close()


def read_run_events(run_dir: str | os.PathLike[str]) -> list[Event]:
    """Every event so far of the job whose run directory is `run_dir`, wherever its books are.

    Inside a job that `ettr run --ledger URL` supervises (`ETTR_LEDGER` set for this very run directory)
    they are read from that URL, else from the run directory's SQLite file. Raises `LedgerError`.
    """
    from ettr.run_env import RunEnv

    run_env = RunEnv.from_environ()
    own = run_env is not None and os.path.realpath(run_env.run_dir) == os.path.realpath(run_dir)
    if run_env is not None and own and run_env.ledger_url:
        from ettr.errors import UsageError
        from ettr.ledger.url import open_url

        try:
            ledger: Ledger = open_url(run_env.ledger_url, job_id=run_env.job_id or Path(run_dir).name)
        except UsageError as exc:
            raise LedgerError(str(exc)) from None
        return _read_all(ledger)
    return _read_all(open_ledger(run_dir, create=False))


def rebuild_ledger(run_dir: str | os.PathLike[str], events: Sequence[Event]) -> tuple[SqliteLedger, Path]:
    """Set a damaged ledger aside (`ledger.db.damaged-<time>`, with its -wal and -shm) and start a fresh one
    holding `events` (what could still be read from it). Returns (the new ledger, where the old one went).
    For a writer that can read the ledger but no longer write it (a flipped bit in its structure). Raises
    `LedgerError` / OSError."""
    path = ledger_path(run_dir)
    aside = path.with_name(f"{path.name}.damaged-{int(time.time())}")
    moved = []
    for suffix in ("-wal", "-shm", ""):
        try:
            os.replace(f"{path}{suffix}", f"{aside}{suffix}")
            moved.append(suffix)
        except FileNotFoundError:
            pass
    try:
        ledger = SqliteLedger(path, create=True)
        for start in range(0, len(events), 5000):
            ledger.append(events[start : start + 5000])
    except BaseException:  # no fresh ledger after all: put the damaged one back, as it was
        for suffix in ("-wal", "-shm", ""):
            with contextlib.suppress(OSError):
                os.remove(f"{path}{suffix}")
        for suffix in moved:
            with contextlib.suppress(OSError):
                os.replace(f"{aside}{suffix}", f"{path}{suffix}")
        raise
    return ledger, aside
