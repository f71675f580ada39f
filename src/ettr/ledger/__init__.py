"""Durable, append-only storage of a job's events (SQLite in the run directory by default)."""

from __future__ import annotations

import os
from pathlib import Path

from ettr.events import Event
from ettr.ledger.base import Ledger, LedgerError, MemoryLedger
from ettr.ledger.sqlite import LEDGER_FILENAME, SqliteLedger

__all__ = [
    "Ledger",
    "LedgerError",
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
    """Every event so far of the job whose run directory is `run_dir`, in append order (open, read, close).

    The one read of a run's books. Raises `LedgerError` when there is no ledger or it cannot be read
    (callers decide how loud to be). (The shared-ledger work reads the `ETTR_LEDGER` URL here instead when
    this process runs inside that very run.)
    """
    ledger = open_ledger(run_dir, create=False)
    try:
        return ledger.read()
    finally:
        ledger.close()
