"""Events a ledger outage left in a run directory: how many wait there, and their delivery on request.

A PostgreSQL stall longer than the supervisor's drain time (`RunConfig.ledger_drain_s`) leaves spill files in
`RUN_DIR/ledger-spill/` (docs/ledger.md). Nothing is lost, but the fleet's and the report's view of the job is
short until they reach the server. `count_undelivered` says how many wait (for `ettr fleet` / `ettr report`
to say so); `deliver_undelivered` (`ettr deliver RUN_DIR`) delivers them now, through the supervisor's own
adopter (`SpillingLedger` with `adopt_orphans`): each event keyed `(writer, seq)` and stored with
`ON CONFLICT DO NOTHING`, each file taken under its `flock` and removed once stored, so a delivery that
races a supervisor, another `ettr deliver` or a crash stores every event exactly once. A file whose writer
still runs (its lock is held) is left to that writer.
"""

from __future__ import annotations

import fcntl
import os
import shlex
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ettr.ledger.base import LedgerError
from ettr.ledger.locate import read_pointer
from ettr.ledger.spill import ServerLedger, SpillingLedger, spill_dir
from ettr.ledger.spill_file import SpillUnreadable, read_spill

_SUFFIX = ".jsonl"


@dataclass(frozen=True, slots=True)
class Undelivered:
    """Spilled events of a run directory not on the server yet."""

    num_events: int
    """Events in spill files whose writer has ended (a running writer delivers its own)."""
    num_files: int
    """Those files."""
    num_live_files: int = 0
    """Spill files a running writer still holds (not counted above)."""
    unreadable: tuple[str, ...] = ()
    """One line for each spill file of the job that cannot be read (larger than `MAX_SPILL_BYTES`, or an
    I/O error): its events, if any, are counted nowhere."""


def _spill_files(run_dir: str | os.PathLike[str]) -> list[Path]:
    try:
        names = sorted(os.listdir(spill_dir(run_dir)))
    except OSError:
        return []
    return [spill_dir(run_dir) / n for n in names if n.endswith(_SUFFIX) and not n.startswith(".")]


def _held_by_writer(path: Path) -> bool | None:
    """Whether a running writer holds `path` (its flock is taken); None when it cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def count_undelivered(run_dir: str | os.PathLike[str]) -> Undelivered:
    """How many spilled events of the run directory's job wait for the server (no server is asked)."""
    pointer = read_pointer(run_dir)
    job_id = pointer[1] if pointer is not None else None
    num_events = num_files = num_live = 0
    unreadable: list[str] = []
    for path in _spill_files(run_dir):
        held = _held_by_writer(path)
        if held is None:
            continue
        try:
            header, records = read_spill(path)
        except SpillUnreadable as exc:  # too large to read (a sparse forgery): said, never loaded
            if job_id is None or exc.header.get("job_id") == job_id:
                unreadable.append(str(exc))
            continue
        except LedgerError:
            continue  # not a spill file, or damaged: its adopter sets it aside
        if job_id is not None and header.get("job_id") != job_id:
            continue  # another job's: not this run's to report
        if held:
            num_live += 1
        elif records:
            num_events += len(records)
            num_files += 1
    return Undelivered(
        num_events=num_events, num_files=num_files, num_live_files=num_live, unreadable=tuple(unreadable)
    )


@dataclass(frozen=True, slots=True)
class Delivery:
    """What `deliver_undelivered` did."""

    num_delivered: int
    """Spilled events now on the server (some may have been there already: they are stored once)."""
    complete: bool
    """Whether every file it could take was delivered (False: the server did not answer, or stopped)."""
    left: Undelivered
    """What still waits afterwards (live writers' files, or all of it when the server is away)."""
    why: str = ""
    """Why the server took nothing more, when it did not (its error: refused, timed out, no password)."""


def deliver_undelivered(
    run_dir: str | os.PathLike[str], *, connect: Callable[[], ServerLedger] | None = None
) -> Delivery:
    """Deliver the run directory's spilled events to its job's ledger (the URL of its pointer), exactly
    once. `connect` makes the server ledger (default: the pointer's PostgreSQL URL, credentials from
    PGPASSWORD or ~/.pgpass). Nothing waiting: nothing is tried. Raises LedgerError when events wait but
    the run directory names no ledger server to deliver them to."""
    before = count_undelivered(run_dir)
    if before.num_files == 0:
        return Delivery(num_delivered=0, complete=True, left=before)
    pointer = read_pointer(run_dir)
    if pointer is None:
        raise LedgerError(
            f"{run_dir}: its books are not on a ledger server (no ledger-url.json): nothing spills"
        )
    url, job_id = pointer
    if connect is None:
        if not url.startswith(("postgresql://", "postgres://")):
            raise LedgerError(f"{run_dir}: its books are in {url}, which never spills")
        from ettr.ledger.postgres import PostgresLedger

        def connect() -> ServerLedger:
            return PostgresLedger(
                url, job_id=job_id, create=False, run_dir=run_dir, node=socket.gethostname()
            )

    # It spills nothing of its own: the caller's one line says the server did not answer and what stays.
    adopter = SpillingLedger(
        connect,
        job_id=job_id,
        spill_dir=spill_dir(run_dir),
        node=socket.gethostname(),
        adopt_orphans=True,
        announce_outage=False,
    )
    try:
        complete = adopter.deliver()
    finally:
        adopter.close()
    left = count_undelivered(run_dir)
    delivered = max(0, before.num_events - left.num_events)
    return Delivery(
        num_delivered=delivered, complete=complete, left=left, why="" if complete else adopter.last_failure
    )


def undelivered_note(run_dir: str | os.PathLike[str]) -> str | None:
    """One line for a reader of the run (`ettr report`, `ettr fleet`) when spilled events of its job wait for
    the server (the figures it shows lack them), saying how to deliver them, or when a spill file of it cannot
    be read (too large), saying which; None when neither."""
    waiting = count_undelivered(run_dir)
    said = []
    if waiting.num_events:
        said.append(
            f"{waiting.num_events} event(s) spilled in {run_dir} during a ledger outage are not in the ledger "
            f"yet (the figures lack them); deliver them with: ettr deliver {shlex.quote(os.fspath(run_dir))}"
        )
    if waiting.unreadable:
        said.append(
            f"{len(waiting.unreadable)} spill file(s) not read, so any events in them are counted nowhere: "
            + waiting.unreadable[0]
            + (f" (and {len(waiting.unreadable) - 1} more)" if len(waiting.unreadable) > 1 else "")
        )
    return "; ".join(said) or None
