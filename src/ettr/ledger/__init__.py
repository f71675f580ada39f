"""Durable, append-only storage of a job's events (SQLite in the run directory by default)."""

from __future__ import annotations

import os
from pathlib import Path

from ettr.events import Event
from ettr.ledger.base import Ledger, LedgerError, LedgerRejected, MemoryLedger
from ettr.ledger.sqlite import LEDGER_FILENAME, SqliteLedger

__all__ = [
    "Ledger",
    "LedgerError",
    "LedgerRejected",
    "MemoryLedger",
    "SqliteLedger",
    "open_ledger",
    "ledger_path",
    "read_run_events",
]


def ledger_path(run_dir: str | os.PathLike[str]) -> Path:
    """Where the ledger of `run_dir` lives."""
    return Path(run_dir) / LEDGER_FILENAME


def open_ledger(run_dir: str | os.PathLike[str], *, create: bool = True) -> SqliteLedger:
    """Open (and with `create`, make) the ledger of a run directory. Raises `LedgerError`."""
    return SqliteLedger(ledger_path(run_dir), create=create)


def read_run_events(run_dir: str | os.PathLike[str]) -> list[Event]:
    """Every event so far of the job whose run directory is `run_dir`, wherever its books are.

    Inside a job that `ettr run --ledger URL` supervises (`ETTR_LEDGER` set for this very run directory)
    they are read from that URL, else from the run directory's SQLite file. Raises `LedgerError`.
    """
    url = os.environ.get("ETTR_LEDGER")
    own_dir = os.environ.get("ETTR_RUN_DIR")
    if url and own_dir and os.path.realpath(own_dir) == os.path.realpath(run_dir):
        from ettr.errors import UsageError
        from ettr.ledger.url import open_url

        job_id = os.environ.get("ETTR_JOB_ID") or Path(run_dir).name
        try:
            ledger: Ledger = open_url(url, job_id=job_id)
        except UsageError as exc:
            raise LedgerError(str(exc)) from None
    else:
        ledger = open_ledger(run_dir, create=False)
    try:
        return ledger.read()
    finally:
        ledger.close()
