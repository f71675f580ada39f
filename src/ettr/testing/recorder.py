"""A synchronous in-memory recorder for tests: every event is in its ledger when the call returns.

    rec = SyncRecorder(rank=1)
    rec.step(3)
    assert [e.step for e in rec.events()] == [3]

It is a `Recorder` (the same conveniences, listeners and never-raise guarantees) without the writer thread,
the atexit hook or the at-fork hook, so a test neither waits for a flush nor leaves anything behind.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ettr.events import Event, EventKind, Phase
from ettr.ledger import Ledger, MemoryLedger
from ettr.recorder import Recorder


class SyncRecorder(Recorder):
    """Writes each event to `ledger` (default: a fresh `MemoryLedger`) before `record` returns.

    Args:
        ledger: where events go.
        run_dir, job_id, attempt, rank, world_size: as for `Recorder`.
    """

    def __init__(
        self,
        ledger: Ledger | None = None,
        *,
        run_dir: str | os.PathLike[str] | None = None,
        job_id: str = "",
        attempt: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        # No ledger for the base class: it then starts no writer thread; this class writes synchronously.
        super().__init__(
            None, run_dir=run_dir, job_id=job_id, attempt=attempt, rank=rank, world_size=world_size
        )
        self.ledger: Ledger = MemoryLedger() if ledger is None else ledger
        self._ledger = self.ledger
        self.enabled = True

    def record(
        self,
        kind: EventKind,
        *,
        phase: Phase | None = None,
        step: int | None = None,
        value: float | None = None,
        data: Mapping[str, Any] | None = None,
        ts: float | None = None,
    ) -> None:
        """Record one event and write it to the ledger at once (never raises)."""
        super().record(kind, phase=phase, step=step, value=value, data=data, ts=ts)
        self.flush()

    def install_process_hooks(self) -> None:
        """A test recorder never takes the process hooks (nothing to flush at exit; no writer to fork)."""

    def events(self) -> list[Event]:
        """Everything recorded so far, in order."""
        return self.ledger.read()
