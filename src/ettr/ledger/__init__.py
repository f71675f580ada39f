"""Durable, append-only storage of a job's events (SQLite in the run directory by default)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from pathlib import Path

from ettr.events import Event
from ettr.ledger.base import Ledger, LedgerError, LedgerHealth, LedgerRejected, MemoryLedger
from ettr.ledger.locate import Books, is_run_dir, ledger_path, locate
from ettr.ledger.sqlite import SqliteLedger

__all__ = [
    "Books",
    "is_run_dir",
    "locate",
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


def open_ledger(run_dir: str | os.PathLike[str], *, create: bool = True) -> Ledger:
    """Open (and with `create`, make) the run directory's own ledger (`RUN_DIR/ledger.db`). Raises
    `LedgerError`."""
    return SqliteLedger(ledger_path(run_dir), create=create)


def read_run_events(run_dir: str | os.PathLike[str]) -> list[Event]:
    """Every event so far of the job whose run directory is `run_dir`, wherever its books are
    (`ettr.ledger.locate`: inside the job the URL of `ETTR_LEDGER`, else the run directory's own file,
    else the URL its pointer names). Raises `LedgerError`."""
    return locate(run_dir).read()


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
