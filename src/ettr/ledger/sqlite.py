"""SQLite ledger: the default, one file in the run directory, safe for all processes of one machine.

WAL mode lets the supervisor and every rank append at once while `ettr report` reads. Each `append` is one
transaction, so a process killed with SIGKILL leaves either the whole batch or none of it; SQLite's WAL
checksums make recovery ignore a torn final frame, so a crash mid-write never corrupts what was committed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ettr.constants import FUTURE_MARGIN_S
from ettr.events import SCHEMA_VERSION, Event
from ettr.ledger.accounted import select_rows
from ettr.ledger.base import LedgerError, LedgerHealth, LedgerMark
from ettr.ledger.rows import (
    MAX_TS,
    MIN_TS,
    Row,
    events_from_rows,
    load_data,
    storable_rows,
)
from ettr.untrusted import not_regular

logger = logging.getLogger("ettr")

LEDGER_FILENAME = "ledger.db"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    id      INTEGER PRIMARY KEY,
    ts      REAL    NOT NULL,
    kind    TEXT    NOT NULL,
    attempt INTEGER NOT NULL,
    rank    INTEGER NOT NULL,
    phase   TEXT,
    step    INTEGER,
    value   REAL,
    data    TEXT
);
CREATE INDEX IF NOT EXISTS events_by_attempt ON events (attempt, ts);
"""


def _schema_problem(conn: sqlite3.Connection) -> str | None:
    """Why a ledger file's schema is not one ettr makes, where what it holds would run on a read or a write:
    a view, trigger, virtual table or computed column. A forged `ledger.db` whose `events` was a view over an
    endless recursive query held `ettr report` (and a whole `ettr fleet`, every `ettr serve` read) for ever."""
    for kind, name in conn.execute(
        "SELECT type, name FROM sqlite_master WHERE type NOT IN ('table', 'index') "
        "OR (type = 'table' AND sql LIKE 'CREATE VIRTUAL%') LIMIT 1"
    ):
        return f"it holds a {'virtual table' if kind == 'table' else kind} named {name!r}"
    for table in ("meta", "events"):
        found = conn.execute("SELECT type FROM sqlite_master WHERE name = ?", (table,)).fetchone()
        if found is None:
            continue  # a new file (the schema is made next), or one a read then finds no table in (one line)
        if found[0] != "table":
            return f"its {table} is a {found[0]}, not a table"
        # hidden 2 and 3: generated columns, computed on every read
        if any(column[6] not in (0, 1) for column in conn.execute(f"PRAGMA table_xinfo({table})")):
            return f"its {table} table has computed columns"
    return None


def _text_or_bytes(raw: bytes) -> str | bytes:
    """A TEXT cell as text, or as its bytes when they are not UTF-8 (damage: the row checks skip it)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw


SIDE_FILE_SUFFIXES = ("-journal", "-wal", "-shm")
"""The files SQLite keeps beside a database, by the suffix of their names."""

WRITER_BUSY_TIMEOUT_S = 30.0
"""How long a writer (or a report's reader) waits for another process's lock before failing."""
READ_ONLY_BUSY_TIMEOUT_S = 1.0
"""How long a read-only open (the fleet's, `ettr serve`'s: many ledgers, one after the other, inside a
Prometheus scrape timeout of 10 s) waits for another process's lock before it reads without locking
(`immutable`). ettr's own writers keep WAL, where a writer never blocks a reader; a lock that holds readers
off is a program's exclusive lock (`PRAGMA locking_mode = EXCLUSIVE`, a rollback journal's commit). With the
writer's 30 s, one such ledger made every `ettr fleet` take 36 s and every scrape time out."""


class SqliteLedger:
    """A `Ledger` in `run_dir/ledger.db`.

    Args:
        path: the database file.
        create: create the file (and the run directory) if missing; otherwise a missing file is a
            `LedgerError`.
        busy_timeout_s: how long a writer waits for another process's transaction before failing (default
            `WRITER_BUSY_TIMEOUT_S`; `READ_ONLY_BUSY_TIMEOUT_S` with `read_only`).
        read_only: open an existing ledger for reading only (`mode=ro`, then `immutable=1`): a reader of many
            run directories (the fleet) never writes into them, not even a checkpoint of their logs.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        create: bool = True,
        busy_timeout_s: float | None = None,
        read_only: bool = False,
    ) -> None:
        self.path = Path(path)
        if read_only and create:
            raise ValueError("a read-only ledger is never created")
        kind = not_regular(self.path)
        if kind is not None:  # SQLite would open a FIFO and wait in it for ever
            raise LedgerError(f"{self.path} is {kind}, not an ettr ledger (a SQLite file); move it aside")
        self._refuse_odd_side_files()
        if not create and not self.path.is_file():
            dangling = " (a symbolic link that leads to no file)" if self.path.is_symlink() else ""
            raise LedgerError(f"no ledger at {self.path}{dangling}")
        if create:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._num_dropped = 0
        if busy_timeout_s is None:
            busy_timeout_s = READ_ONLY_BUSY_TIMEOUT_S if read_only else WRITER_BUSY_TIMEOUT_S
        self._busy_timeout_s = busy_timeout_s
        self.num_skipped = 0  # rows the last read() could not use
        self.read_only = False
        """Opened read-only (`create=False` on a file or directory this process cannot write)."""
        self.num_reopened = 0
        """How often a lost write-ahead log made this ledger reopen its connection."""
        try:
            if create:
                row = self._create()
            else:
                row = self._probe(read_only=read_only)
        except sqlite3.DatabaseError as exc:
            raise LedgerError(f"{self.path} is not a readable ettr ledger ({exc})") from None
        self._wal_inode = self._current_wal_inode()
        try:
            version = None if row is None else int(row[0])
        except (TypeError, ValueError):
            version = None
        if version is None or version > SCHEMA_VERSION:
            found = "none" if row is None else row[0]
            raise LedgerError(
                f"{self.path}: ledger schema {found} is not supported (need <= {SCHEMA_VERSION})"
            )

    def _create(self) -> Any:
        """Connect, make the file a WAL ledger with its tables, and read its schema version (the row).

        Several processes opening a new ledger at once (the ranks of a job started without a supervisor, an
        `ettr.init` job) meet where SQLite returns "database is locked" at once, without its busy handler:
        the switch to WAL and the first schema writes. Those are retried, the connection made anew, for as
        long as a writer waits otherwise (`busy_timeout_s`); before, a rank that lost the race recorded nothing
        ("recording is off")."""
        deadline = time.monotonic() + self._busy_timeout_s
        pause = 0.02
        while True:
            conn = self._connect()
            try:
                conn.execute("PRAGMA journal_mode = WAL")
                conn.executescript(_SCHEMA)
                conn.execute(
                    "INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', ?)",
                    (str(SCHEMA_VERSION),),
                )
                row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            except sqlite3.OperationalError as exc:
                conn.close()
                text = str(exc).lower()
                if ("locked" not in text and "busy" not in text) or time.monotonic() + pause > deadline:
                    raise
                time.sleep(pause)
                pause = min(pause * 2, 0.5)
                continue
            self._conn = conn
            return row

    def _connect(self, uri: str | None = None) -> sqlite3.Connection:
        conn = sqlite3.connect(
            uri or self.path,
            timeout=self._busy_timeout_s,
            isolation_level=None,
            check_same_thread=False,
            uri=uri is not None,
        )
        conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_s * 1000)}")
        # NORMAL in WAL mode: a committed transaction survives a crash of the process (not of the OS),
        # which is the durability the contract asks for, at a fraction of FULL's fsync cost.
        conn.execute("PRAGMA synchronous = NORMAL")
        try:  # before anything reads or writes a table: a view or trigger would run then
            problem = _schema_problem(conn)
        except sqlite3.OperationalError:  # locked or busy: what follows waits and says so itself
            problem = None
        if problem is not None:
            conn.close()
            raise sqlite3.DatabaseError(problem)
        return conn

    def _probe(self, *, read_only: bool) -> tuple[str] | None:
        """The schema row of an existing ledger; falls back to a read-only connection (mode=ro, then
        immutable: a read-only mount or a directory where the -shm cannot be made) when the normal one
        cannot read, or goes there at once with `read_only`. Raises sqlite3.DatabaseError."""
        query = "SELECT value FROM meta WHERE key = 'schema_version'"
        try:
            if read_only:
                raise sqlite3.OperationalError("opened read-only")
            self._conn = self._connect()
            return self._conn.execute(query).fetchone()
        except sqlite3.OperationalError as first:
            with contextlib.suppress(AttributeError, sqlite3.DatabaseError):
                self._conn.close()
            # The path's own bytes, percent-encoded: a directory name that is not UTF-8 is a name too.
            where = "file:" + urllib.parse.quote(os.fsencode(self.path.absolute()))
            # Asked for read-only, the first "error" is ours: the reason to give is what reading found (a
            # file of another program: "no such table: meta"), never "opened read-only".
            why = first
            for options in ("?mode=ro", "?mode=ro&immutable=1"):
                conn = None
                try:
                    conn = self._connect(where + options)
                    row = conn.execute(query).fetchone()
                except sqlite3.OperationalError as exc:
                    if read_only and why is first:
                        why = exc
                    if conn is not None:
                        conn.close()
                    continue
                self._conn, self.read_only = conn, True
                return row
            raise why from None  # the caller makes it one line (LedgerError)

    def _refuse_odd_side_files(self) -> None:
        """Raise LedgerError where one of SQLite's files beside the ledger (its rollback journal, write-ahead
        log or shared-memory index) is there but is not a regular file: SQLite opens them by name, and a
        FIFO named `ledger.db-journal` made a reader wait in it for ever (one such run directory stopped a
        whole `ettr fleet`)."""
        for suffix in SIDE_FILE_SUFFIXES:
            kind = not_regular(f"{self.path}{suffix}")
            if kind is not None:
                raise LedgerError(
                    f"{self.path}{suffix} is {kind}, not SQLite's {suffix[1:]} file of the ledger; move it aside"
                )

    def _current_wal_inode(self) -> int | None:
        try:
            return os.stat(f"{self.path}-wal").st_ino
        except OSError:
            return None

    def _wal_lost(self) -> bool:
        """Whether the write-ahead log this connection uses was deleted (or replaced) under it."""
        return self._wal_inode is not None and self._current_wal_inode() != self._wal_inode

    def _reopen(self, why: str) -> None:
        """Save what only this connection's (deleted) log holds into the database, then reconnect."""
        with contextlib.suppress(sqlite3.DatabaseError):
            self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        with contextlib.suppress(sqlite3.DatabaseError):
            self._conn.close()
        self._refuse_odd_side_files()  # what replaced the log is opened by name next
        self._conn = self._connect()
        self._conn.execute("SELECT count(*) FROM meta").fetchone()
        self._wal_inode = self._current_wal_inode()
        self.num_reopened += 1
        logger.warning("ettr: %s: %s; reopened the ledger", self.path, why)

    def append(self, events: Sequence[Event]) -> None:
        if not events:
            return
        kept, error = storable_rows(events)
        if error is not None:  # one bad event never costs its batch
            self._num_dropped += len(events) - len(kept)
            if self._num_dropped == len(events) - len(kept):
                logger.warning("ettr: %s: dropped an event that cannot be stored (%s)", self.path, error)
        rows = [row for _index, row in kept]
        if not rows:
            return
        with self._lock:
            if self._wal_lost():
                self._reopen("its write-ahead log was deleted")
            try:
                self._insert(rows)
            except sqlite3.OperationalError as exc:
                # A log deleted under another connection reads as an I/O error here: reconnect, retry once.
                if "disk I/O" not in str(exc) and not self._wal_lost():
                    raise
                self._reopen(f"writing failed ({exc})")
                self._insert(rows)

    def _insert(self, rows: list[Row]) -> None:
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            self._conn.executemany(
                "INSERT INTO events (ts, kind, attempt, rank, phase, step, value, data)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                rows,
            )
        except BaseException:
            with contextlib.suppress(sqlite3.DatabaseError):
                self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")
        if self._wal_inode is None:
            self._wal_inode = self._current_wal_inode()

    def _fetch_rows(self, sql: str, params: tuple[object, ...] = ()) -> list[Any]:
        """`sql`'s rows (the caller holds the lock). A TEXT cell that is not UTF-8 (a bit flip, a forged row)
        comes back as its bytes, which the row checks skip and count like any damaged row: sqlite3 raised
        "Could not decode to UTF-8" for the whole read, so one such cell made the job unreadable (`ettr
        report` exit 2, the job left out of `ettr fleet`). Decoded leniently only on a second read after
        such a failure: a text factory in Python costs the common read a call per cell."""
        try:
            return self._conn.execute(sql, params).fetchall()
        except sqlite3.OperationalError as exc:
            if "decode" not in str(exc):
                raise
        self._conn.text_factory = _text_or_bytes
        try:
            return self._conn.execute(sql, params).fetchall()
        finally:
            self._conn.text_factory = str

    def _select(self, where: str = "", params: tuple[object, ...] = ()) -> list[Event]:
        with self._lock:
            try:
                rows = self._fetch_rows(
                    f"SELECT ts, kind, attempt, rank, phase, step, value, data FROM events {where} ORDER BY id",
                    params,
                )
            except sqlite3.DatabaseError as exc:
                raise LedgerError(f"{self.path} cannot be read ({exc})") from None
        events, num_skipped = events_from_rows(rows)
        self.num_skipped = num_skipped
        if num_skipped:  # written by a newer ettr, or damaged: keep reading what we understand
            logger.warning("ettr: %s: skipped %d unreadable ledger records", self.path, num_skipped)
        return events

    def read(self) -> list[Event]:
        return self._select()

    def mark(self) -> LedgerMark:
        """Which rows the ledger holds now (one indexed count). Raises `LedgerError`."""
        with self._lock:
            try:
                count, last = self._conn.execute(
                    "SELECT count(*), coalesce(max(id), 0) FROM events"
                ).fetchone()
            except sqlite3.DatabaseError as exc:
                raise LedgerError(f"{self.path} cannot be read ({exc})") from None
        return LedgerMark(int(count), int(last))

    def read_marked(self, *, for_accounting: bool = False) -> tuple[list[Event], LedgerMark]:
        """The events and the mark of the rows they were read from (the same read); `for_accounting` leaves
        out the rows the accounting does not use (`ettr.ledger.accounted`). Raises `LedgerError`."""
        with self._lock:
            try:
                rows = self._fetch_rows(
                    "SELECT ts, kind, attempt, rank, phase, step, value, data, id FROM events ORDER BY id"
                )
            except sqlite3.DatabaseError as exc:
                raise LedgerError(f"{self.path} cannot be read ({exc})") from None
        mark = LedgerMark(len(rows), int(rows[-1][8]) if rows else 0)
        if for_accounting:
            rows = select_rows(rows)
        events, num_skipped = events_from_rows(row[:8] for row in rows)
        self.num_skipped = num_skipped
        if num_skipped:
            logger.warning("ettr: %s: skipped %d unreadable ledger records", self.path, num_skipped)
        return events, mark

    def read_supervisor(self) -> list[Event]:
        """The supervisors' own events (rank < 0), in append order: what peers of a multi-node job poll."""
        return self._select("WHERE rank < 0")

    def read_attempt(self, attempt: int) -> list[Event]:
        """The training processes' events (rank >= 0) of `attempt`, in append order (the attempt index)."""
        return self._select("WHERE attempt = ? AND rank >= 0", (attempt,))

    def last_activity(self, attempt: int) -> float | None:
        """Latest timestamp of a training-process event (rank >= 0) of `attempt`, or None (hang detection)."""
        with self._lock:
            try:
                row = self._conn.execute(
                    "SELECT max(ts) FROM events WHERE attempt = ? AND rank >= 0 AND ts BETWEEN ? AND ?",
                    (attempt, MIN_TS, min(MAX_TS, time.time() + FUTURE_MARGIN_S)),
                ).fetchone()
            except sqlite3.DatabaseError as exc:
                raise LedgerError(f"{self.path} cannot be read ({exc})") from None
        try:
            return None if row is None or row[0] is None else float(row[0])
        except (TypeError, ValueError):
            return None

    def health(self) -> LedgerHealth:
        """A local file: always in the books (a failed write raises from `append`)."""
        return LedgerHealth()

    def job_id(self) -> str | None:
        """The job id the first supervisor whose record reads recorded (None: no supervisor has written yet).
        A record that does not read (damage, or a forgery nested 100,000 levels deep: a RecursionError out of
        `ettr run --ledger`, `report`, `fleet`) is skipped, as the readers of the books skip it."""
        with self._lock:
            try:
                rows = self._fetch_rows(
                    "SELECT data FROM events WHERE kind = 'supervisor_start' ORDER BY id LIMIT 100"
                )
            except sqlite3.DatabaseError as exc:
                raise LedgerError(f"{self.path} cannot be read ({exc})") from None
        for (text,) in rows:
            try:
                data = load_data(text)
            except (ValueError, TypeError):
                continue
            held = None if data is None else data.get("job_id")
            if held is not None:
                return str(held)
        return None

    def close(self, drain_timeout_s: float = 0.0) -> None:
        """Close the connection (nothing is held back: `drain_timeout_s` is accepted for the Protocol)."""
        with self._lock:
            self._conn.close()
