"""The SQLite ledger: round trip, several writer processes at once, SIGKILL mid-write, torn WAL tail."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ettr.events import SUPERVISOR_RANK, Event, EventKind, Phase
from ettr.ledger import LedgerError, MemoryLedger, ledger_path, open_ledger


def test_round_trip_keeps_every_field(tmp_path):
    ledger = open_ledger(tmp_path)
    events = [
        Event(EventKind.SUPERVISOR_START, 1.5, 0, SUPERVISOR_RANK, data={"pid": 7, "job_id": "j"}),
        Event(EventKind.PHASE_END, 2.25, 1, 3, Phase.COMPILE, 10, 2.0, {"reason": "x"}),
        Event(EventKind.STEP, 3.0, 1, 3, step=11),
    ]
    ledger.append(events)
    assert ledger.read() == events
    assert open_ledger(tmp_path, create=False).read() == events


def test_memory_ledger_is_a_ledger():
    ledger = MemoryLedger()
    ledger.append([Event(EventKind.STEP, 1.0, step=1)])
    assert [e.step for e in ledger.read()] == [1]


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
def test_every_local_backend_answers_what_callers_need(tmp_path, backend):
    """The Ledger Protocol's members, the same way on each backend: callers never ask for a concrete class."""
    from ettr.ledger import Ledger, LedgerHealth

    ledger: Ledger = MemoryLedger() if backend == "memory" else open_ledger(tmp_path)
    assert isinstance(ledger, Ledger)
    events = [
        Event(EventKind.ATTEMPT_START, 1.0, 0, SUPERVISOR_RANK),
        Event(EventKind.STEP, 2.0, 0, 0, step=1),
        Event(EventKind.STEP, 3.5, 0, 1, step=1),
        Event(EventKind.ATTEMPT_END, 4.0, 0, SUPERVISOR_RANK),
        Event(EventKind.ATTEMPT_START, 5.0, 1, SUPERVISOR_RANK),
    ]
    ledger.append(events)
    assert ledger.read_supervisor() == [events[0], events[3], events[4]]
    assert ledger.read_attempt(0) == [events[1], events[2]]  # training processes only, this attempt's
    assert ledger.read_attempt(1) == [] and ledger.read_attempt(7) == []
    assert ledger.last_activity(0) == 3.5  # training processes only: not the supervisor's ATTEMPT_END
    assert ledger.last_activity(1) is None
    assert ledger.health() == LedgerHealth() and not ledger.health().pending
    ledger.close(drain_timeout_s=5.0)  # nothing held back: returns at once
    ledger.close()


def test_missing_and_foreign_files_are_ledger_errors(tmp_path):
    with pytest.raises(LedgerError):
        open_ledger(tmp_path / "nope", create=False)
    ledger_path(tmp_path).write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(LedgerError):
        open_ledger(tmp_path, create=False)


def test_newer_schema_is_refused(tmp_path):
    open_ledger(tmp_path).close()
    with sqlite3.connect(ledger_path(tmp_path)) as conn:
        conn.execute("UPDATE meta SET value = '999' WHERE key = 'schema_version'")
    with pytest.raises(LedgerError, match="schema 999"):
        open_ledger(tmp_path, create=False)


def _writer(run_dir: str, rank: int, num_batches: int) -> None:
    ledger = open_ledger(run_dir)
    for i in range(num_batches):
        ledger.append([Event(EventKind.STEP, time.time(), 0, rank, step=i * 10 + j) for j in range(10)])


def test_several_processes_append_at_once(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), r, 50)) for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    events = open_ledger(tmp_path, create=False).read()
    for rank in range(4):
        assert sorted(e.step for e in events if e.rank == rank) == list(range(500))


_KILLED_WRITER = """
import sys, time
from ettr.events import Event, EventKind
from ettr.ledger import open_ledger
ledger = open_ledger(sys.argv[1])
i = 0
print("ready", flush=True)
while True:
    ledger.append([Event(EventKind.STEP, time.time(), step=i * 100 + j, data={"pad": "x" * 200}) for j in range(100)])
    i += 1
"""


def test_sigkill_mid_write_never_corrupts(tmp_path):
    for trial in range(5):
        run_dir = tmp_path / f"t{trial}"
        proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(run_dir)], stdout=subprocess.PIPE)
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        time.sleep(0.05 + 0.05 * trial)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        steps = [e.step for e in open_ledger(run_dir, create=False).read()]
        # Whole batches only: a transaction is all or nothing.
        assert len(steps) % 100 == 0
        assert steps == list(range(len(steps)))


def test_torn_wal_tail_is_ignored(tmp_path):
    ledger = open_ledger(tmp_path)
    ledger.append([Event(EventKind.STEP, 1.0, step=1)])
    ledger.append([Event(EventKind.STEP, 2.0, step=2, data={"pad": "y" * 5000})])
    wal = tmp_path / "ledger.db-wal"
    # Simulate a crash that tore the last write: copy the files as a dead process would leave them, with
    # the WAL cut in the middle of its final frame.
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "ledger.db").write_bytes((tmp_path / "ledger.db").read_bytes())
    data = wal.read_bytes()
    (copy / "ledger.db-wal").write_bytes(data[: len(data) - 2000])
    ledger.close()
    steps = [e.step for e in open_ledger(copy, create=False).read()]
    assert steps == [1]


def _open_at_once(path: str, barrier: Any, results: Any) -> None:
    from ettr.ledger.sqlite import SqliteLedger

    barrier.wait()
    try:
        SqliteLedger(path).close()
        results.put("ok")
    except Exception as exc:  # the failure under test: one line for the assertion
        results.put(f"{type(exc).__name__}: {exc}")


def test_processes_creating_one_new_ledger_at_once_all_open_it(tmp_path: Path) -> None:
    """The ranks of a job started without a supervisor create the run directory's ledger together: SQLite
    answers "database is locked" at once (no busy wait) to the switch to WAL and the first schema writes,
    and a rank that lost that race recorded nothing. Each of 8 processes, released together, opens it."""
    ctx = mp.get_context("fork")
    for round_ in range(3):
        path = str(tmp_path / f"ledger-{round_}.db")
        barrier, results = ctx.Barrier(8), ctx.Queue()
        procs = [ctx.Process(target=_open_at_once, args=(path, barrier, results)) for _ in range(8)]
        for p in procs:
            p.start()
        said = [results.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        assert said == ["ok"] * 8, said
