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


class LedgerStalled(LedgerError):
    """The server did not answer within the call's bound (`ettr.ledger.watchdog`): it is stalled or overloaded,
    and trying again at once will not help."""


@dataclass(frozen=True, slots=True)
class LedgerMark:
    """Which rows of one job's books a read saw: how many, and the id of the last (ids only grow). Two reads
    with equal marks saw the same rows of an append-only ledger; the count also catches a row committed
    late with a lower id (PostgreSQL hands out ids before commit)."""

    num_rows: int
    last_id: int


@dataclass(frozen=True, slots=True)
class LedgerHealth:
    """Whether a ledger's writes are in its books now. A local ledger (SQLite, memory) is always healthy; a
    ledger over a shared server reports an outage and what it holds back meanwhile (`SpillingLedger`)."""

    server_down: bool = False
    """The shared server does not answer (down, unreachable or stalled): appends go to local spill files."""
    backlog: bool = False
    """Events written through this ledger (or adopted from a dead writer of its job) are not on the server yet."""

    @property
    def pending(self) -> bool:
        """Something is waiting for the server: `close(drain_timeout_s=...)` would try to deliver it."""
        return self.server_down or self.backlog


@runtime_checkable
class Ledger(Protocol):
    """Append-only event storage shared by every process of one job: what every caller may use, whatever
    the backend (SQLite in the run directory, PostgreSQL through its spill files, memory in tests).

    `append` writes all given events in one transaction and returns once they are durable against a crash of
    the calling process. `read` returns every event in append order. Both may be called from several
    processes at once. Every method raises `LedgerError` (never a backend's own exception) when the books
    cannot be used.
    """

    def append(self, events: Sequence[Event]) -> None: ...

    def read(self) -> list[Event]: ...

    def read_supervisor(self) -> list[Event]:
        """The supervisors' own events (rank < 0) in append order: what the peers of a multi-node job poll
        (a narrow query where the backend has one)."""
        ...

    def read_attempt(self, attempt: int) -> list[Event]:
        """The training processes' events (rank >= 0) of `attempt`, in append order: what the supervisor
        reads at each attempt's end (a narrow query where the backend has one: a long job's books hold
        millions of steps, read whole at every restart before)."""
        ...

    def last_activity(self, attempt: int) -> float | None:
        """The newest timestamp of a training-process event (rank >= 0) of `attempt` of this job, or None:
        the supervisor's hang probe. Never waits on an unavailable server (a shared ledger answers from what
        it spilled); ignores what other jobs wrote."""
        ...

    def health(self) -> LedgerHealth:
        """Whether writes reach the books now, and whether events wait for a server (cheap; no I/O)."""
        ...

    def close(self, drain_timeout_s: float = 0.0) -> None:
        """Release the ledger. With `drain_timeout_s` > 0 a ledger holding events back for a server tries to
        deliver them for up to that long first (the supervisor at job end); what is left stays durable
        where it was spilled. Idempotent; a local ledger has nothing to drain."""
        ...


def supervisor_events(events: Sequence[Event]) -> list[Event]:
    """The supervisors' events (rank < 0) of `events`, in order: `read_supervisor` of a backend with no
    narrower query."""
    return [e for e in events if e.rank < 0]


def attempt_events(events: Sequence[Event], attempt: int) -> list[Event]:
    """The training processes' events (rank >= 0) of `attempt` in `events`: `read_attempt` over events in
    memory."""
    return [e for e in events if e.attempt == attempt and e.rank >= 0]


def latest_activity(events: Sequence[Event], attempt: int) -> float | None:
    """`last_activity` over events in memory."""
    found = [e.ts for e in events if e.attempt == attempt and e.rank >= 0]
    return max(found) if found else None


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

    def read_supervisor(self) -> list[Event]:
        return supervisor_events(self.read())

    def read_attempt(self, attempt: int) -> list[Event]:
        return attempt_events(self.read(), attempt)

    def last_activity(self, attempt: int) -> float | None:
        return latest_activity(self.read(), attempt)

    def health(self) -> LedgerHealth:
        return LedgerHealth()

    def close(self, drain_timeout_s: float = 0.0) -> None:
        pass
