"""Durable, append-only storage of a job's events (SQLite in the run directory by default)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
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
    "read_ledger",
    "rebuild_ledger",
]


def ledger_path(run_dir: str | os.PathLike[str]) -> Path:
    """Where the ledger of `run_dir` lives."""
    return Path(run_dir) / LEDGER_FILENAME


def open_ledger(run_dir: str | os.PathLike[str], *, create: bool = True) -> SqliteLedger:
    """Open (and with `create`, make) the ledger of a run directory. Raises `LedgerError`."""
    return SqliteLedger(ledger_path(run_dir), create=create)


def read_ledger(run_dir: str | os.PathLike[str]) -> list[Event]:
    """Every event of an existing run directory's ledger, in append order (open, read, close).

    Raises `LedgerError` when there is no ledger or it cannot be read (callers decide how loud to be).
    """
    ledger = open_ledger(run_dir, create=False)
    try:
        return ledger.read()
    finally:
        ledger.close()


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
