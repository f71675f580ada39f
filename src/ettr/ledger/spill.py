"""Spill to the run directory: a Ledger over a shared server that never makes its caller wait for an outage.

    append(events) -> each event gets a key (writer id, seq)
        server up, nothing spilled:  one transaction on the server (a first try: bounded by its timeouts)
        otherwise:                   one fsync'd append to RUN_DIR/ledger-spill/<writer>.jsonl
    a delivery thread (started at the first failure) pings the server every `retry_interval_s`; once it
    answers, the spill file is delivered with ON CONFLICT DO NOTHING and cut back to its header

So an outage costs the caller one failed call (seconds at most, on the Recorder's writer thread, never the
training thread); afterwards appends are local until the server is back. Every event keeps its key from its
first try to its delivery, so one that reached the server before a connection died is not stored twice, and
none is lost: it is on the server or in an fsync'd spill file. A file whose writer died (its flock is free)
is an orphan; a SpillingLedger made with `adopt_orphans` (the supervisor's) delivers orphans of its job.

Spill file: line 1 a header `{"spill": 1, "job_id", "writer", "node"}`, then one JSON array per event:
`[seq, ts, kind, attempt, rank, phase, step, value, data]`, read back, bounded, by `ettr.ledger.spill_file`.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from ettr.events import Event
from ettr.ledger.base import LedgerError, LedgerHealth, LedgerRejected, LedgerStalled
from ettr.ledger.postgres import new_writer_id
from ettr.ledger.rows import MAX_TS, MIN_TS, KeyedEvent, storable_rows
from ettr.ledger.spill_file import (
    MAX_HEADER_BYTES,
    MAX_LINE_BYTES,
    MAX_SPILL_BYTES,
    read_header,
    read_spill,
)
from ettr.untrusted import loads_bounded, open_dir_below, open_regular

logger = logging.getLogger("ettr")

SPILL_DIRNAME = "ledger-spill"
_SUFFIX = ".jsonl"
_DELIVERY_CHUNK = 10_000  # about a second on a loaded server: far inside one call's bound
_MAX_REJECTED_SHOWN = 8192  # refused events a warning carries when they cannot be kept in a file
MAX_HELD_EVENTS = 200_000
"""Events a writer keeps in memory while neither the server nor its spill file takes them (an outage on a
full disk): about 100 MB at most, 100 s of a busy writer's 2,000 events/s."""


class ServerLedger(Protocol):
    """What SpillingLedger needs of the shared server (`PostgresLedger` is one; tests use fakes)."""

    job_id: str

    def insert(self, records: Sequence[KeyedEvent], *, may_repeat: bool = True) -> None: ...

    def read(self) -> list[Event]: ...

    def read_supervisor(self) -> list[Event]: ...

    def read_attempt(self, attempt: int) -> list[Event]: ...

    def last_activity(self, attempt: int) -> float | None: ...

    def close(self) -> None: ...


def spill_dir(run_dir: str | os.PathLike[str]) -> Path:
    """Where the spill files of a run directory live."""
    return Path(run_dir) / SPILL_DIRNAME


def _encode(records: Sequence[KeyedEvent]) -> bytes:
    """Spill lines of the records that can be stored (the rest are left out, as every backend leaves them)."""
    kept, error = storable_rows(r.event for r in records)
    if error is not None:
        logger.warning(
            "ettr: dropped %d event(s) that cannot be stored (%s)", len(records) - len(kept), error
        )
    lines = [json.dumps([records[i].seq, *row], separators=(",", ":")) for i, row in kept]
    return ("\n".join(lines) + "\n").encode() if lines else b""


class _SpillFile:
    """This writer's own spill file: created exclusively, flock'd for life, appended and fsync'd."""

    def __init__(self, directory: Path, *, job_id: str, writer: str, node: str) -> None:
        self.path = directory / f"{writer}{_SUFFIX}"
        temp = f".{writer}.tmp"
        # RUN_DIR/ledger-spill, no symlink on the way, held open: every name below is resolved in it
        dir_fd = open_dir_below(directory.parent, directory.name, create=True)
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC
            self._fd = os.open(temp, flags, 0o644, dir_fd=dir_fd)  # O_EXCL: never through a link
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                header = {"spill": 1, "job_id": job_id, "writer": writer, "node": node}
                self._header_len = os.write(self._fd, (json.dumps(header) + "\n").encode())
                os.fsync(self._fd)
                # visible to adopters only once locked and headed
                os.rename(temp, self.path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                os.fsync(dir_fd)
            except BaseException:
                os.close(self._fd)
                with contextlib.suppress(OSError):
                    os.unlink(temp, dir_fd=dir_fd)
                raise
        finally:
            os.close(dir_fd)
        self.has_records = False

    def append(self, records: Sequence[KeyedEvent]) -> None:
        data = _encode(records)
        if not data:
            return
        size = os.fstat(self._fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
            os.fsync(self._fd)
        except OSError:
            os.ftruncate(self._fd, size)  # no half batch: the caller retries the whole of it
            raise
        self.has_records = True

    def records(self) -> list[KeyedEvent]:
        return read_spill(self.path)[1]

    def cut(self) -> None:
        """Everything in the file is delivered: keep only the header."""
        os.ftruncate(self._fd, self._header_len)
        os.fsync(self._fd)
        self.has_records = False

    def close(self, *, remove: bool) -> None:
        if remove:
            self.path.unlink(missing_ok=True)
        os.close(self._fd)  # releases the flock: what is left is an orphan for the supervisor


class SpillingLedger:
    """A `Ledger` that writes to a shared server and spills to `spill_dir` while the server is away.

    Args:
        connect: makes the server ledger (called again after a failure; may raise).
        job_id: the job (spill files name it; orphans of other jobs are left alone).
        spill_dir: this run directory's spill directory (`spill_dir(run_dir)`).
        node: the host written with each event.
        adopt_orphans: also deliver spill files whose writer died (the supervisor's ledger).
        retry_interval_s: how often the delivery thread tries the server during an outage.
        background_connect: connect on the delivery thread, so that making the ledger never waits for the
            server (a training process builds it at start-up, on its training thread); the first `append`
            (on the Recorder's writer thread) waits for that connection, at most `connect_wait_s`.
        announce_outage: log one warning when the server goes away ("events spill to ..."); False for a
            ledger that writes no events of its own (`ettr deliver`'s adopter: its caller says what happened).
        max_held_events: how many events are kept in memory while the spill file cannot be written either.
    """

    def __init__(
        self,
        connect: Callable[[], ServerLedger],
        *,
        job_id: str,
        spill_dir: str | os.PathLike[str],
        node: str,
        adopt_orphans: bool = False,
        retry_interval_s: float = 2.0,
        background_connect: bool = False,
        connect_wait_s: float = 15.0,
        announce_outage: bool = True,
        max_held_events: int = MAX_HELD_EVENTS,
    ) -> None:
        if not retry_interval_s > 0:
            raise ValueError(f"retry_interval_s must be > 0, got {retry_interval_s}")
        self.job_id = job_id
        self.spill_dir = Path(spill_dir)
        self.node = node
        self.writer = new_writer_id()
        self._connect = connect
        self._adopt = adopt_orphans
        self._retry_interval_s = retry_interval_s
        self._lock = threading.RLock()
        self._server: ServerLedger | None = None
        self._down = False
        self.last_failure = ""
        """Why the server last failed a call (its error's one line): what `ettr deliver` says."""
        self._file: _SpillFile | None = None
        # Events neither the server nor the spill file took (a full disk during an outage): kept here and
        # delivered with the backlog; a full disk used to drop them, and the report lacked those steps.
        self._held: list[KeyedEvent] = []
        self._max_held = max_held_events
        self._seq = 0
        self._closed = False
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._scan: dict[Path, tuple[int, dict[int, float]]] = {}
        self._orphans_lock = threading.Lock()
        self._connected = threading.Event()
        self._connect_wait_s = connect_wait_s
        self._announce_outage = announce_outage
        if background_connect:
            self._start_delivery()  # its first act is to connect
        else:
            self._first_connect()
        if adopt_orphans:
            self._start_delivery()
        atexit.register(self.close)
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forget_in_child)

    # -- state -------------------------------------------------------------------------------------------
    @property
    def backlog(self) -> bool:
        """Whether this writer has spilled (or held) events not yet delivered."""
        return bool(self._held) or (self._file is not None and self._file.has_records)

    @property
    def server_down(self) -> bool:
        return self._down

    def health(self) -> LedgerHealth:
        """The outage and the backlog as the Ledger Protocol reports them (no I/O)."""
        return LedgerHealth(server_down=self._down, backlog=self.backlog)

    def _mark_down(self, exc: BaseException) -> None:
        self.last_failure = str(exc)
        if not self._down and self._announce_outage:
            logger.warning(
                "ettr: ledger server unreachable (%s); events spill to %s until it is back",
                exc,
                self.spill_dir,
            )
        self._down = True
        self._start_delivery()

    def _start_delivery(self) -> None:
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._deliver_loop, name="ettr-ledger-spill", daemon=True)
            self._thread.start()

    def _first_connect(self) -> None:
        try:
            self._server = self._connect()
        except Exception as exc:
            self._mark_down(exc)
        finally:
            self._connected.set()

    def _forget_in_child(self) -> None:
        self._closed, self._thread, self._file, self._server = True, None, None, None
        self._held = []

    # -- Ledger --------------------------------------------------------------------------------------------
    def append(self, events: Sequence[Event]) -> None:
        """Durable on return: on the server, or in the fsync'd spill file; when neither can be written (an
        outage on a full disk), held in memory and delivered (or spilled) once either takes them again.
        Raises `LedgerError` only when even that is full (the caller may retry the same events)."""
        if not events:
            return
        if not self._connected.is_set():
            self._connected.wait(self._connect_wait_s)
        with self._lock:
            first = self._seq
            records = [KeyedEvent(self.writer, first + i, self.node, e) for i, e in enumerate(events)]
            if not self._down and not self.backlog and self._server is not None:
                try:
                    self._keep_rejected(_store(self._server, records, may_repeat=False))
                    self._seq += len(records)
                    return
                except Exception as exc:
                    self._mark_down(exc)
            try:
                self._spill(records)
            except OSError as exc:
                if len(self._held) + len(records) > self._max_held:
                    raise LedgerError(f"cannot spill ledger events to {self.spill_dir} ({exc})") from None
                if not self._held:
                    logger.warning(
                        "ettr: cannot spill ledger events to %s (%s); keeping them in memory (at most %d) "
                        "until the server or the disk takes them",
                        self.spill_dir,
                        exc,
                        self._max_held,
                    )
                self._held.extend(records)
            self._seq += len(records)
            self._start_delivery()

    def _spill(self, records: Sequence[KeyedEvent]) -> None:
        """Append `records` to this writer's spill file (made on first use). Raises OSError."""
        with self._lock:
            if self._file is None:
                self._file = _SpillFile(
                    self.spill_dir, job_id=self.job_id, writer=self.writer, node=self.node
                )
            self._file.append(records)

    def _spill_held(self) -> bool:
        """Move the events held in memory into the spill file, where they are durable. Whether none is held."""
        with self._lock:
            if self._held and not self._closed:
                try:
                    self._spill(self._held)
                except OSError:
                    return False
                self._held = []
            return not self._held

    def read(self) -> list[Event]:
        """The job's events from the server (delivering what this node spilled first). Raises `LedgerError`
        while the server is away: a partial history would be taken for the whole."""
        if self._down or self._server is None:
            raise LedgerError(
                f"the ledger server is unreachable; {self.spill_dir} holds the events meanwhile"
            )
        self.deliver()
        return self._server.read()

    def read_supervisor(self) -> list[Event]:
        """The supervisors' own events (rank < 0) from the server; raises `LedgerError` like `read`."""
        if self._down or self._server is None:
            raise LedgerError(
                f"the ledger server is unreachable; {self.spill_dir} holds the events meanwhile"
            )
        self.deliver()
        return self._server.read_supervisor()

    def read_attempt(self, attempt: int) -> list[Event]:
        """The training processes' events of `attempt` from the server; raises `LedgerError` like `read`."""
        if self._down or self._server is None:
            raise LedgerError(
                f"the ledger server is unreachable; {self.spill_dir} holds the events meanwhile"
            )
        self.deliver()
        return self._server.read_attempt(attempt)

    def last_activity(self, attempt: int) -> float | None:
        """Newest training-process event of `attempt` on the server or in this node's spill files."""
        latest = self._spilled_activity(attempt)
        server = self._server
        if not self._down and server is not None:
            try:
                found = server.last_activity(attempt)
            except Exception as exc:
                self._mark_down(exc)
            else:
                if found is not None and (latest is None or found > latest):
                    latest = found
        return latest

    def close(self, drain_timeout_s: float = 0.0) -> None:
        """Deliver what is pending (trying for up to `drain_timeout_s`), then stop. With no drain time and the
        server known to be away, nothing is tried: a training process exits at once and what is pending stays
        in the spill file for the supervisor or the next run. Idempotent."""
        if self._closed:
            return
        if drain_timeout_s > 0 or not self._down:
            deadline = time.monotonic() + drain_timeout_s
            while not self.deliver() and time.monotonic() < deadline:
                time.sleep(min(self._retry_interval_s, max(0.0, deadline - time.monotonic())))
        with self._lock:
            if self._held and not self._spill_held():
                logger.warning(
                    "ettr: %d ledger event(s) are lost: neither the ledger server nor %s took them",
                    len(self._held),
                    self.spill_dir,
                )
                self._held = []
            self._closed = True
            self._wake.set()
            if self._file is not None:
                pending = self._file.has_records
                self._file.close(remove=not pending)
                if pending:
                    logger.warning(
                        "ettr: %s keeps undelivered ledger events; once the server is back, `ettr deliver %s` "
                        "delivers them (as does the next ettr supervisor of this job in that run directory)",
                        self._file.path,
                        self.spill_dir.parent,
                    )
                self._file = None
            if self._server is not None:
                self._server.close()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    # -- delivery ------------------------------------------------------------------------------------------
    def deliver(self) -> bool:
        """Try once to deliver this writer's backlog (and orphans, with `adopt_orphans`). True when nothing
        is left to deliver."""
        if self._closed:
            return True
        if self._down or self._server is None:
            if not self._ping():
                self._spill_held()  # the disk may be back before the server
                return False
        with self._lock:
            if self._held and self._server is not None:
                try:
                    self._keep_rejected(_store_chunked(self._server, self._held))
                except Exception as exc:
                    self._mark_down(exc)
                    self._spill_held()
                    return False
                self._held = []
            if self._file is not None and self._file.has_records and self._server is not None:
                try:
                    self._keep_rejected(_store_chunked(self._server, self._file.records()))
                except Exception as exc:
                    self._mark_down(exc)
                    return False
                self._file.cut()
        if not self._adopt:
            return True
        # One pass at a time: a file this object's delivery thread holds is not another writer's, and
        # `close` must wait for that pass instead of taking the file for a live writer's.
        with self._orphans_lock:
            return self._deliver_orphans()

    def _ping(self) -> bool:
        """Whether the server answers now (reconnecting if needed); clears the outage when it does."""
        try:
            server = self._server
            if server is None:
                server = self._connect()
                server.last_activity(-1)
            else:
                try:
                    server.last_activity(-1)
                except LedgerStalled:  # no answer within the bound: still stalled, no second wait
                    raise
                except Exception:  # the first call after a restart finds the old connection dead: once more
                    server.last_activity(-1)
        except Exception as exc:
            self.last_failure = str(exc)
            return False
        with self._lock:
            self._server = server
            if self._down:
                logger.warning("ettr: ledger server is back; delivering spilled events")
            self._down = False
        return True

    def _deliver_orphans(self) -> bool:
        server = self._server
        if server is None:
            return False
        all_done = True
        for path in self._spill_files():
            if self._file is not None and path == self._file.path:
                continue
            header = read_header(path)
            if header is None:
                if _is_ours_but_damaged(path, self.job_id):
                    _set_aside(path, LedgerError("its header is not an ettr spill file's"))
                continue
            if header.get("job_id") != self.job_id:
                continue  # another job's: left to it
            try:
                fd = open_regular(path)
            except OSError:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # its writer is alive and delivers it itself
                if not path.exists():
                    continue  # delivered by another adopter between our listing and our lock
                try:
                    records = read_spill(path)[1]
                except LedgerError as exc:  # damage, not an outage: set aside once, never retried
                    _set_aside(path, exc)
                    continue
                try:
                    self._keep_rejected(_store_chunked(server, records))
                except Exception as exc:
                    self._mark_down(exc)
                    all_done = False
                    break
                path.unlink(missing_ok=True)
                self._scan.pop(path, None)
            finally:
                os.close(fd)
        return all_done

    def _keep_rejected(self, records: Sequence[KeyedEvent]) -> None:
        """Events the server refused: kept beside the spill files (`<writer>.rejected`, same line format) for
        a person to look at, never retried, never dropped silently. Appended only to a regular file reached
        through no symlink (anyone who can write the run directory could plant `<writer>.rejected ->
        ~/.bashrc`); where it cannot be kept, the warning says so and carries the refused lines."""
        if not records:
            return
        path = self.spill_dir / f"{self.writer}.rejected"
        data = _encode(records)
        try:
            _append_below(self.spill_dir, path.name, data)
        except (OSError, ValueError) as exc:
            shown = data[:_MAX_REJECTED_SHOWN].decode(errors="replace").strip().replace("\n", " ")
            more = (
                f" (and {len(data) - _MAX_REJECTED_SHOWN} more bytes)"
                if len(data) > _MAX_REJECTED_SHOWN
                else ""
            )
            logger.warning(
                "ettr: the ledger server refused %d event(s); they could not be kept in %s (%s), so here: %s%s",
                len(records),
                path,
                exc,
                shown,
                more,
            )
            return
        logger.warning("ettr: the ledger server refused %d event(s); kept in %s", len(records), path)

    def _deliver_loop(self) -> None:
        if not self._connected.is_set():
            self._first_connect()
        while not self._closed:
            self._wake.wait(self._retry_interval_s)
            self._wake.clear()
            if self._closed:
                break
            try:
                self.deliver()
            except Exception as exc:  # never let the thread die: the next round tries again
                logger.warning("ettr: ledger spill delivery failed (%s)", exc)

    # -- reading the spill files (hang detection during an outage) -----------------------------------------
    def _spill_files(self) -> Iterator[Path]:
        try:
            names = sorted(os.listdir(self.spill_dir))
        except OSError:
            return
        for name in names:
            if name.endswith(_SUFFIX) and not name.startswith("."):
                yield self.spill_dir / name

    def _spilled_activity(self, attempt: int) -> float | None:
        """Newest ts of a rank >= 0 event of `attempt` in this directory's spill files (read incrementally)."""
        latest: float | None = None
        for path in self._spill_files():
            if path not in self._scan:
                header = read_header(path)
                if header is None or header.get("job_id") != self.job_id:
                    continue  # another job's times say nothing of this one (nor do a damaged file's)
            offset, newest = self._scan.get(path, (0, {}))
            try:
                with os.fdopen(open_regular(path), "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    if size > MAX_SPILL_BYTES:
                        continue  # not a spill file ettr wrote (a sparse forgery of GBs): never read
                    if size < offset:
                        offset = 0  # cut after a delivery: what it said stays true
                    f.seek(offset)
                    chunk = f.read(MAX_LINE_BYTES)  # a bounded piece: the next call reads on from it
            except OSError:
                continue
            end = chunk.rfind(b"\n") + 1
            if end == 0 and len(chunk) == MAX_LINE_BYTES:
                end = len(chunk)  # a line longer than a piece is damage: passed over, not read for ever
            for line in chunk[:end].split(b"\n"):
                try:
                    item: Any = loads_bounded(line) if line else None
                except ValueError:
                    continue
                if _is_activity(item):
                    a, ts = item[3], float(item[1])
                    newest[a] = max(ts, newest.get(a, ts))
            self._scan[path] = (offset + end, newest)
            found = newest.get(attempt)
            if found is not None and (latest is None or found > latest):
                latest = found
        return latest


def _is_activity(item: object) -> bool:
    """Whether a spill line is a training process's event with a time that can be one (a rank >= 0, an
    attempt number, a finite time of this era)."""
    if not isinstance(item, list) or len(item) != 9:
        return False
    _seq, ts, _kind, attempt, rank = item[:5]
    return (
        isinstance(rank, int)
        and rank >= 0
        and isinstance(attempt, int)
        and isinstance(ts, int | float)
        and not isinstance(ts, bool)
        and math.isfinite(ts)
        and MIN_TS <= ts <= MAX_TS
    )


def _is_ours_but_damaged(path: Path, job_id: str) -> bool:
    """Whether an unreadable spill file names this job (then this job's adopter sets it aside; a file that
    names no job, or another, is left alone)."""
    try:
        with os.fdopen(open_regular(path), "rb") as f:
            first = f.readline(MAX_HEADER_BYTES)
    except OSError:
        return False
    return json.dumps(job_id).encode() in first


def _set_aside(path: Path, why: BaseException) -> None:
    """Rename a damaged spill file of this job to `<name>.bad` (kept for a person; never read again)."""
    try:
        os.replace(path, path.with_name(path.name + ".bad"))
    except OSError as exc:
        logger.warning("ettr: %s is damaged (%s) and cannot be set aside (%s)", path, why, exc)
        return
    logger.warning("ettr: %s is damaged (%s); set aside as %s.bad, not delivered", path, why, path.name)


def _append_below(directory: Path, name: str, data: bytes) -> None:
    """Append `data` to `directory/name` and fsync it: the directory made below its parent with no symlink
    on the way and opened as a descriptor (no swap between the check and the write), the file opened with
    O_NOFOLLOW and refused unless regular (never a write through a planted link, never a FIFO that blocks).
    Raises OSError (`SymlinkRefused` for a planted directory link)."""
    dir_fd = open_dir_below(directory.parent, directory.name, create=True)
    try:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
        fd = open_regular(name, flags, 0o644, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    try:
        if os.fstat(fd).st_nlink != 1:  # a hard link planted there is another file's name too
            raise OSError(errno.EMLINK, "has other names (a hard link); ettr does not append to it", name)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _store(server: ServerLedger, records: Sequence[KeyedEvent], *, may_repeat: bool) -> list[KeyedEvent]:
    """Insert `records`; the ones the server refuses as data (found by halving) are returned, not raised,
    so that one unstorable event never holds back the rest. An outage still raises `LedgerError`."""
    try:
        server.insert(records, may_repeat=may_repeat)
        return []
    except LedgerRejected:
        if len(records) == 1:
            return list(records)
    middle = len(records) // 2
    return _store(server, records[:middle], may_repeat=True) + _store(
        server, records[middle:], may_repeat=True
    )


def _store_chunked(server: ServerLedger, records: Sequence[KeyedEvent]) -> list[KeyedEvent]:
    rejected: list[KeyedEvent] = []
    for start in range(0, len(records), _DELIVERY_CHUNK):
        rejected += _store(server, records[start : start + _DELIVERY_CHUNK], may_repeat=True)
    return rejected
