"""The Ledger seam: durable, append-only storage of events, and its in-memory fake."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ettr.events import Event


class LedgerError(Exception):
    """The ledger cannot be opened or read (missing, not a ledger, newer schema)."""


class LedgerRejected(LedgerError):
    """The server is there but refused these rows (data it cannot store): retrying them will not help."""


@dataclass(frozen=True, slots=True)
class LedgerMark:
    """Which rows of one job's books a read saw: how many, and the id of the last (ids only grow). Two reads
    with equal marks saw the same rows of an append-only ledger; the count also catches a row committed
    late with a lower id (PostgreSQL hands out ids before commit)."""

    num_rows: int
    last_id: int


@runtime_checkable
class Ledger(Protocol):
    """Append-only event storage shared by every process of one job.

    `append` writes all given events in one transaction and returns once they are durable against a crash of
    the calling process. `read` returns every event in append order. Both may be called from several
    processes at once.
    """

    def append(self, events: Sequence[Event]) -> None: ...

    def read(self) -> list[Event]: ...

    def close(self) -> None: ...


class MemoryLedger:
    """A Ledger in memory, for tests and for computing reports of synthetic streams."""

    def __init__(self, events: Sequence[Event] = ()) -> None:
        self._events = list(events)
        self._lock = threading.Lock()

    def append(self, events: Sequence[Event]) -> None:
        with self._lock:
            self._events.extend(events)

    def read(self) -> list[Event]:
        with self._lock:
            return list(self._events)

    def close(self) -> None:
        pass
