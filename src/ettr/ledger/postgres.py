"""PostgreSQL ledger: many jobs, many machines, one schema (`ettr`), for a fleet's shared books.

Tables (layout version `SCHEMA_VERSION`, kept in `ettr.meta` like the SQLite ledger's):

    ettr.meta    key -> value: schema_version, event_schema_version
    ettr.jobs    job_id (primary key), created_ts, host, run_dir      -- one row per job, for the fleet
    ettr.events  id, job_id, node, writer, seq, ts, kind, attempt, rank, phase, step, value, data (JSON text)
                 unique (writer, seq): the idempotency key, so a batch delivered twice is stored once
    ettr.summaries  job_id (primary key), num_rows, last_id, body (text), written_ts -- a finished job's
                 summary for the fleet, stored by its supervisor with the mark of the rows it was computed
                 from (`ettr.fleet.stored`); created on first use, so older ledgers need no migration

Indexes serve one job's events in append order (`job_id, id`), the supervisor's hang probe (the newest
training-process event of an attempt, `job_id, attempt, ts` over rank >= 0), and the fleet (`jobs.created_ts`).
Every call is bounded in time, so a dead or stalled server fails fast: connect, statement and TCP timeouts
are added to the URL unless it sets them (a dead server, a lost link, a lock held long), and a client-side
watchdog (`ettr.ledger.watchdog`) ends any call that outlives `call_timeout_s` (a server that is alive but
not answering: stopped processes keep TCP up, so no TCP timeout fires and its statement timeout cannot run).
`ettr.ledger.spill.SpillingLedger` turns that failure into a local spill.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from ettr.events import SCHEMA_VERSION as EVENT_SCHEMA_VERSION
from ettr.events import Event, EventKind
from ettr.ledger import accounted
from ettr.ledger.base import LedgerError, LedgerHealth, LedgerMark, LedgerRejected, LedgerStalled
from ettr.ledger.rows import MAX_TS, MIN_TS, KeyedEvent, events_from_rows, storable_rows
from ettr.ledger.watchdog import WATCHDOG, BoundedCall, shutdown_socket

logger = logging.getLogger("ettr")

SCHEMA_VERSION = 1
"""Version of the table layout below; a ledger written by a newer layout is refused."""

_TIMEOUTS = {
    "connect_timeout": "3",  # seconds (libpq's minimum is 2)
    "keepalives": "1",
    "keepalives_idle": "5",
    "keepalives_interval": "2",
    "keepalives_count": "2",
    "tcp_user_timeout": "5000",  # ms: unacknowledged data on a dead link fails the call
}
_STATEMENT_TIMEOUT_MS = 10_000
_SUMMARY_CHECK_TIMEOUT_MS = 120_000
CALL_TIMEOUT_S = 15.0
"""The client-side bound of one call (a transaction, a read): the server's statement timeout plus a margin,
so that a slow statement on a live server gets the server's own error first."""
_SUMMARY_CHECK_CALL_TIMEOUT_S = _SUMMARY_CHECK_TIMEOUT_MS / 1000 + 10.0
_ADVISORY_LOCK = 0x65747472  # 'ettr': serializes concurrent schema creation

_SCHEMA = """
CREATE SCHEMA IF NOT EXISTS ettr;
CREATE TABLE IF NOT EXISTS ettr.meta (key text PRIMARY KEY, value text NOT NULL);
CREATE TABLE IF NOT EXISTS ettr.jobs (
    job_id     text PRIMARY KEY,
    created_ts double precision NOT NULL,
    host       text NOT NULL,
    run_dir    text
);
CREATE INDEX IF NOT EXISTS jobs_by_created ON ettr.jobs (created_ts);
CREATE TABLE IF NOT EXISTS ettr.events (
    id      bigserial PRIMARY KEY,
    job_id  text NOT NULL,
    node    text NOT NULL,
    writer  text NOT NULL,
    seq     bigint NOT NULL,
    ts      double precision NOT NULL,
    kind    text NOT NULL,
    attempt integer NOT NULL,
    rank    integer NOT NULL,
    phase   text,
    step    bigint,
    value   double precision,
    data    text,
    UNIQUE (writer, seq)
);
CREATE INDEX IF NOT EXISTS events_by_job ON ettr.events (job_id, id);
CREATE INDEX IF NOT EXISTS events_activity ON ettr.events (job_id, attempt, ts) WHERE rank >= 0;
"""

_SUMMARIES = """
CREATE TABLE IF NOT EXISTS ettr.summaries (
    job_id     text PRIMARY KEY,
    num_rows   bigint NOT NULL,
    last_id    bigint NOT NULL,
    body       text NOT NULL,
    written_ts double precision NOT NULL
);
"""

_COLUMNS = "job_id, node, writer, seq, ts, kind, attempt, rank, phase, step, value, data"
_INCOMING = f"""
CREATE TEMP TABLE IF NOT EXISTS ettr_incoming ON COMMIT DELETE ROWS AS
    SELECT {_COLUMNS} FROM ettr.events WITH NO DATA
"""


def redact(url: str, *, mask: str | None = "***") -> str:
    """`url` with its password (if any) replaced by `mask` (for messages), or dropped with `mask=None`."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    redacted = parts
    if parts.password is not None:
        netloc = parts.netloc.rsplit("@", 1)[1]
        user = parts.username or ""
        secret = "" if mask is None else f":{mask}"
        redacted = redacted._replace(netloc=f"{user}{secret}@{netloc}")
    if parts.query:  # libpq takes `?password=...` too (it was printed as given)
        fields = parts.query.split("&")
        kept = [
            f if f.split("=", 1)[0].lower() != "password" else (None if mask is None else f"password={mask}")
            for f in fields
        ]
        redacted = redacted._replace(query="&".join(f for f in kept if f is not None))
    # Unchanged: as given. urlunsplit drops the empty host of `sqlite:////abs/path` (`sqlite://abs/path`, a
    # relative path), so a URL is rebuilt only when there was something to take out.
    return url if redacted == parts else urlunsplit(redacted)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def new_writer_id() -> str:
    """A writer id unique across hosts, processes and ledger objects (the first half of the event key)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


class PostgresLedger:
    """The events of one job (`job_id`) in a PostgreSQL database.

    Args:
        url: a libpq URL (`postgresql://user:password@host:port/dbname?...`).
        job_id: the job whose events this object appends and reads.
        create: create the schema if missing and register the job; otherwise a missing schema or an unknown
            job is a `LedgerError`.
        run_dir: recorded with the job (where its logs and spill files are).
        node: the host name stored with each event (default this host's).
        call_timeout_s: the most one call may take, connecting aside (bounded by `connect_timeout`): past
            it the connection is cut and the call raises `LedgerError`, as for a dead server.

    Raises `LedgerError` (one line, password redacted) when the server cannot be reached, does not answer
    within the bounds, or the schema is from a newer ettr. Thread-safe; one connection, re-opened after a
    failure.
    """

    def __init__(
        self,
        url: str,
        *,
        job_id: str,
        create: bool = False,
        run_dir: str | os.PathLike[str] | None = None,
        node: str | None = None,
        call_timeout_s: float = CALL_TIMEOUT_S,
    ) -> None:
        if not job_id:
            raise LedgerError("a PostgreSQL ledger needs a job id")
        if not call_timeout_s > 0:
            raise ValueError(f"call_timeout_s must be > 0, got {call_timeout_s}")
        self.url = url
        self.call_timeout_s = call_timeout_s
        self.job_id = job_id
        self.node = node or socket.gethostname()
        self._conninfo = _conninfo(url)
        self._lock = threading.Lock()
        self._conn: Any = None
        self._writer = new_writer_id()
        self._seq = 0
        with self._connection() as conn:
            _check_schema(conn, url, create=create)
            if create:
                conn.execute(
                    "INSERT INTO ettr.jobs (job_id, created_ts, host, run_dir) VALUES (%s, %s, %s, %s)"
                    " ON CONFLICT (job_id) DO NOTHING",
                    (job_id, time.time(), self.node, None if run_dir is None else os.fspath(run_dir)),
                )
            elif conn.execute("SELECT 1 FROM ettr.jobs WHERE job_id = %s", (job_id,)).fetchone() is None:
                raise LedgerError(f"{redact(url)} holds no job {job_id!r}")

    # -- connection ----------------------------------------------------------------------------------------
    @contextmanager
    def _connection(self) -> Iterator[Any]:
        """The connection inside one transaction (committed on success), bounded by `call_timeout_s`;
        failures become `LedgerError`."""
        import psycopg

        with self._lock:
            call: BoundedCall | None = None
            try:
                if self._conn is None or self._conn.closed:
                    self._conn = psycopg.connect(self._conninfo, autocommit=True)  # bounded: connect_timeout
                with _bounded(self._conn, self.call_timeout_s) as call, self._conn.transaction():
                    yield self._conn
            except Exception as exc:
                if call is not None and call.fired:
                    self._drop()
                    raise LedgerStalled(_stalled(self.url, call)) from None
                if not isinstance(exc, psycopg.Error):
                    raise
                message = f"ledger {redact(self.url)}: {_one_line(exc)}"
                if isinstance(exc, psycopg.DataError | psycopg.IntegrityError):
                    raise LedgerRejected(message) from None
                if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
                    self._drop()
                raise LedgerError(message) from None

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:
                pass

    # -- Ledger ----------------------------------------------------------------------------------------------
    def append(self, events: Sequence[Event]) -> None:
        """Append `events` in one transaction under this object's own keys (durable on return).

        A failed call may still have committed (the connection died after COMMIT was sent): a caller that
        retries must not use `append` again but hand the same keys to `insert` (`SpillingLedger` does).
        """
        if not events:
            return
        with self._lock:
            first, self._seq = self._seq, self._seq + len(events)
        records = [KeyedEvent(self._writer, first + i, self.node, e) for i, e in enumerate(events)]
        self.insert(records, may_repeat=False)

    def insert(self, records: Sequence[KeyedEvent], *, may_repeat: bool = True) -> None:
        """Store `records` in one transaction; records whose key is already stored are skipped.

        `may_repeat=False` promises that no record was ever handed to the server before (a first try):
        they are then copied straight into the table, about twice as fast as the de-duplicating path.
        """
        if not records:
            return
        job_id = self.job_id
        kept, error = storable_rows(r.event for r in records)
        if error is not None:  # one bad event never costs its batch
            logger.warning("ettr: job %s: dropped %d event(s) that cannot be stored (%s)",
                           job_id, len(records) - len(kept), error)  # fmt: skip
        rows = [(records[index], row) for index, row in kept]
        if not rows:
            return
        with self._connection() as conn:
            target = "ettr.events"
            if may_repeat:
                conn.execute(_INCOMING)
                target = "ettr_incoming"
            with conn.cursor().copy(f"COPY {target} ({_COLUMNS}) FROM STDIN") as copy:
                write_row = copy.write_row
                for r, row in rows:
                    write_row((job_id, r.node, r.writer, r.seq, *row))
            if may_repeat:
                conn.execute(
                    f"INSERT INTO ettr.events ({_COLUMNS}) SELECT {_COLUMNS} FROM ettr_incoming"
                    " ORDER BY writer, seq ON CONFLICT (writer, seq) DO NOTHING"
                )

    def read(self) -> list[Event]:
        with self._connection() as conn:
            rows = conn.execute(
                "SELECT ts, kind, attempt, rank, phase, step, value, data FROM ettr.events"
                " WHERE job_id = %s ORDER BY id",
                (self.job_id,),
            ).fetchall()
        events, num_bad = events_from_rows(rows)
        if num_bad:
            logger.warning("ettr: job %s: skipped %d unreadable ledger records", self.job_id, num_bad)
        return events

    def read_marked(self, *, for_accounting: bool = False) -> tuple[list[Event], LedgerMark]:
        """The job's events and the mark of all its rows, from one statement; `for_accounting` leaves out, on
        the server, the rows the accounting does not use (`ettr.ledger.accounted`). Raises `LedgerError`."""
        with self._connection() as conn:
            return _read_marked(conn, self.job_id, for_accounting=for_accounting)

    def store_summary(self, mark: LedgerMark, body: str) -> None:
        """Store this job's summary `body`, computed from the rows `mark` describes (replacing an older one)."""
        with self._connection() as conn:
            if conn.execute("SELECT to_regclass('ettr.summaries')").fetchone()[0] is None:
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_ADVISORY_LOCK,))
                conn.execute(_SUMMARIES)
            conn.execute(
                "INSERT INTO ettr.summaries (job_id, num_rows, last_id, body, written_ts)"
                " VALUES (%s, %s, %s, %s, %s) ON CONFLICT (job_id) DO UPDATE SET num_rows = EXCLUDED.num_rows,"
                " last_id = EXCLUDED.last_id, body = EXCLUDED.body, written_ts = EXCLUDED.written_ts",
                (self.job_id, mark.num_rows, mark.last_id, body, time.time()),
            )

    def read_supervisor(self) -> list[Event]:
        """The supervisors' own events (rank < 0), in append order: what peers of a multi-node job poll."""
        with self._connection() as conn:
            rows = conn.execute(
                "SELECT ts, kind, attempt, rank, phase, step, value, data FROM ettr.events"
                " WHERE job_id = %s AND rank < 0 ORDER BY id",
                (self.job_id,),
            ).fetchall()
        return events_from_rows(rows)[0]

    def read_attempt(self, attempt: int) -> list[Event]:
        """The training processes' events (rank >= 0) of `attempt`, in append order."""
        with self._connection() as conn:
            rows = conn.execute(
                "SELECT ts, kind, attempt, rank, phase, step, value, data FROM ettr.events"
                " WHERE job_id = %s AND attempt = %s AND rank >= 0 ORDER BY id",
                (self.job_id, attempt),
            ).fetchall()
        return events_from_rows(rows)[0]

    def last_activity(self, attempt: int) -> float | None:
        """Latest timestamp of a training-process event (rank >= 0) of `attempt`, or None (hang detection)."""
        with self._connection() as conn:
            row = conn.execute(
                "SELECT max(ts) FROM ettr.events WHERE job_id = %s AND attempt = %s AND rank >= 0",
                (self.job_id, attempt),
            ).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def health(self) -> LedgerHealth:
        """Not held back: a failed call raises (`SpillingLedger` turns that into spilling)."""
        return LedgerHealth()

    def close(self, drain_timeout_s: float = 0.0) -> None:
        """Close the connection, after the call in flight on another thread, if any (at most its bound)."""
        with self._lock:
            self._drop()


def _bounded(conn: Any, seconds: float) -> AbstractContextManager[BoundedCall]:
    """Cut `conn`'s socket if the body takes more than `seconds` (the call then raises, as on a dead link)."""
    return WATCHDOG.bound(seconds, lambda: _cut(conn))


def _cut(conn: Any) -> None:
    """Shut down `conn`'s socket: a call blocked on it fails at once."""
    try:
        fd = conn.fileno()
    except Exception:  # closed meanwhile: nothing to cut
        return
    shutdown_socket(fd)


def _stalled(url: str, call: BoundedCall) -> str:
    return (
        f"ledger {redact(url)}: no answer within {call.seconds:g} s (the server is stalled or overloaded); "
        "the connection was cut"
    )


def _conninfo(url: str) -> str:
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    try:
        params = conninfo_to_dict(url)
    except Exception as exc:
        raise LedgerError(f"{redact(url)} is not a PostgreSQL URL ({_one_line(exc)})") from None
    for key, value in _TIMEOUTS.items():
        params.setdefault(key, value)
    options = str(params.get("options") or "")
    if "statement_timeout" not in options:
        params["options"] = f"{options} -c statement_timeout={_STATEMENT_TIMEOUT_MS}".strip()
    params.setdefault("application_name", "ettr")
    return make_conninfo("", **params)


def _check_schema(conn: Any, url: str, *, create: bool) -> None:
    """Create the schema (with `create`) and refuse one from a newer ettr."""
    if conn.execute("SELECT to_regclass('ettr.meta')").fetchone()[0] is None:
        if not create:
            raise LedgerError(f"{redact(url)} holds no ettr ledger (no schema 'ettr')")
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_ADVISORY_LOCK,))
        conn.execute(_SCHEMA)
        conn.execute(
            "INSERT INTO ettr.meta (key, value) VALUES ('schema_version', %s), ('event_schema_version', %s)"
            " ON CONFLICT (key) DO NOTHING",
            (str(SCHEMA_VERSION), str(EVENT_SCHEMA_VERSION)),
        )
    found = dict(conn.execute("SELECT key, value FROM ettr.meta").fetchall())
    for key, ours in (("schema_version", SCHEMA_VERSION), ("event_schema_version", EVENT_SCHEMA_VERSION)):
        value = found.get(key)
        try:
            newer = value is None or int(value) > ours
        except ValueError:
            newer = True
        if newer:
            why = "upgrade ettr" if value is not None and value.isdigit() else "ettr.meta was altered"
            raise LedgerError(
                f"{redact(url)}: ledger {key.replace('_', ' ')} {value or 'none'} is not supported by this "
                f"ettr (need <= {ours}; {why})"
            )
    if create:
        _probe_insert(conn, url)


def _probe_insert(conn: Any, url: str) -> None:
    """Refuse, before the job starts, a ledger whose events table does not take this ettr's rows: a column
    dropped or added NOT NULL by hand, no INSERT right, a trigger or check that refuses them. A writer takes
    a failed insert for an outage (it spills and retries), so such a ledger ran whole jobs into spill files
    that no delivery could ever store, while `ettr run` said "ledger server unreachable". One row inserted
    and rolled back (it costs a sequence number)."""
    import psycopg

    try:
        with conn.transaction(force_rollback=True):
            conn.execute(
                f"INSERT INTO ettr.events ({_COLUMNS}) VALUES ('', '', %s, 0, 0, 'step', 0, 0, NULL, 0, NULL, NULL)",
                (f"ettr-probe-{new_writer_id()}",),
            )
    except (
        psycopg.ProgrammingError,
        psycopg.IntegrityError,
        psycopg.DataError,
        psycopg.InternalError,
    ) as exc:
        # (a dead or stalled connection, the statement timeout and a full disk are OperationalError: raised)
        why = exc.diag.message_primary or _one_line(exc)  # without the statement psycopg quotes after it
        raise LedgerError(
            f"{redact(url)}: table ettr.events does not take this ettr's events ({why}); "
            "it was altered, or this user lacks INSERT on it (docs/ledger.md, 'Operating an external PostgreSQL')"
        ) from None


def unanswered(url: str) -> str | None:
    """Why no connection to the server at `url` can be made now (one line, the password hidden: down,
    stalled, refused, a wrong password), or None when one was made (bounded by `connect_timeout`). A reader
    of many run directories whose books are on one server asks once for all of them, instead of waiting out
    the connect timeout once per run directory."""
    try:
        import psycopg
    except ImportError:
        return None  # the read itself says so
    try:
        conninfo = _conninfo(url)
    except LedgerError:
        return None  # the read itself says what is wrong with the URL
    try:
        with psycopg.connect(conninfo, autocommit=True):
            return None
    except psycopg.Error as exc:
        return f"ledger {redact(url)}: {_one_line(exc)}"


def list_jobs(url: str) -> list[str]:
    """The job ids in the ledger at `url`, oldest first. Raises `LedgerError`."""
    import psycopg

    call: BoundedCall | None = None
    try:
        with psycopg.connect(_conninfo(url), autocommit=True) as conn, _bounded(conn, CALL_TIMEOUT_S) as call:
            _check_schema(conn, url, create=False)
            return [
                row[0] for row in conn.execute("SELECT job_id FROM ettr.jobs ORDER BY created_ts, job_id")
            ]
    except psycopg.Error as exc:
        if call is not None and call.fired:
            raise LedgerStalled(_stalled(url, call)) from None
        raise LedgerError(f"ledger {redact(url)}: {_one_line(exc)}") from None


def read_summaries(url: str) -> dict[str, tuple[str, LedgerMark]]:
    """Every stored summary in the ledger at `url` whose job still holds exactly the rows it was computed
    from: job id -> (body, mark). One statement counts every job's rows (on a loaded 2-core machine a
    parallel scan beat 1,000 index-only counts by about a third). Raises `LedgerError`."""
    import psycopg

    call: BoundedCall | None = None
    try:
        with (
            psycopg.connect(_conninfo(url), autocommit=True) as conn,
            _bounded(conn, _SUMMARY_CHECK_CALL_TIMEOUT_S) as call,
        ):
            _check_schema(conn, url, create=False)
            if (conn.execute("SELECT to_regclass('ettr.summaries')").fetchone() or (None,))[0] is None:
                return {}
            # One count over every job's rows (a parallel scan: a fleet's worth of rows, not one job's).
            conn.execute(f"SET statement_timeout = {_SUMMARY_CHECK_TIMEOUT_MS}")
            rows = conn.execute(
                "SELECT s.job_id, s.body, s.num_rows, s.last_id, c.num_rows, c.last_id FROM ettr.summaries s"
                " JOIN (SELECT job_id, count(*) AS num_rows, max(id) AS last_id FROM ettr.events"
                " GROUP BY job_id) c ON c.job_id = s.job_id"
            ).fetchall()
    except psycopg.Error as exc:
        if call is not None and call.fired:
            raise LedgerStalled(_stalled(url, call)) from None
        raise LedgerError(f"ledger {redact(url)}: {_one_line(exc)}") from None
    return {
        job_id: (body, LedgerMark(int(n), int(last)))
        for job_id, body, n, last, now_n, now_last in rows
        if (n, last) == (now_n, now_last)
    }


# The rows `ettr.ledger.accounted.select_rows` keeps, chosen by the server: only they leave it, with the mark
# of every row of the job from the same statement. `ok` is what the codec would read (a kind and phase this
# ettr knows, a time in range, a training process's rank).
_ACCOUNTED = """
SELECT ts, kind, attempt, rank, phase, step, value, data, num_rows, last_id FROM (
    SELECT e.*,
        count(*) OVER () AS num_rows,
        max(id) OVER () AS last_id,
        coalesce(
            min(rank) FILTER (WHERE ok AND kind = %(step_kind)s) OVER (PARTITION BY attempt),
            min(rank) FILTER (WHERE ok) OVER (PARTITION BY attempt)
        ) AS ref,
        min(ts) FILTER (WHERE ok) OVER (PARTITION BY attempt, rank) AS first_ts,
        max(ts) FILTER (WHERE ok) OVER (PARTITION BY attempt, rank) AS last_ts
    FROM (
        SELECT id, ts, kind, attempt, rank, phase, step, value, data,
            (rank >= 0 AND ts >= %(min_ts)s AND ts <= %(max_ts)s AND kind = ANY(%(kinds)s)
             AND (phase IS NULL OR phase = ANY(%(phases)s))) AS ok
        FROM ettr.events WHERE job_id = %(job_id)s
    ) e
) x
WHERE NOT (kind = ANY(%(skippable)s) AND rank >= 0 AND rank IS DISTINCT FROM ref
           AND ts IS DISTINCT FROM first_ts AND ts IS DISTINCT FROM last_ts)
ORDER BY id
"""
_WHOLE = """
SELECT ts, kind, attempt, rank, phase, step, value, data, count(*) OVER (), max(id) OVER ()
FROM ettr.events WHERE job_id = %(job_id)s ORDER BY id
"""


def _read_marked(conn: Any, job_id: str, *, for_accounting: bool) -> tuple[list[Event], LedgerMark]:
    params = {
        "kinds": list(accounted.KINDS),
        "phases": list(accounted.PHASES),
        "skippable": list(accounted.SKIPPABLE_KINDS),
        "step_kind": EventKind.STEP.value,
        "min_ts": MIN_TS,
        "max_ts": MAX_TS,
        "job_id": job_id,
    }
    rows = conn.execute(_ACCOUNTED if for_accounting else _WHOLE, params).fetchall()
    mark = LedgerMark(int(rows[0][8]), int(rows[0][9])) if rows else LedgerMark(0, 0)
    events, num_bad = events_from_rows(row[:8] for row in rows)
    if num_bad:
        logger.warning("ettr: job %s: skipped %d unreadable ledger records", job_id, num_bad)
    return events, mark


def read_jobs_marked(
    url: str, job_ids: Sequence[str], *, for_accounting: bool = True
) -> Iterator[tuple[str, tuple[list[Event], LedgerMark] | LedgerError]]:
    """Each job's events and mark (`PostgresLedger.read_marked`) over one connection, or the `LedgerError`
    that job's read met (the next job is still read). Raises `LedgerError` when the server cannot be used
    at all."""
    import psycopg

    call: BoundedCall | None = None
    try:
        with psycopg.connect(_conninfo(url), autocommit=True) as conn:
            with _bounded(conn, CALL_TIMEOUT_S) as call:
                _check_schema(conn, url, create=False)
            for job_id in job_ids:
                try:
                    with _bounded(conn, CALL_TIMEOUT_S) as call:  # each read, not the caller's time between
                        found: tuple[list[Event], LedgerMark] | LedgerError = _read_marked(
                            conn, job_id, for_accounting=for_accounting
                        )
                except psycopg.OperationalError:
                    raise
                except psycopg.Error as exc:
                    found = LedgerError(f"job {job_id}: {_one_line(exc)}")
                yield job_id, found
    except psycopg.Error as exc:
        if call is not None and call.fired:
            raise LedgerStalled(_stalled(url, call)) from None
        raise LedgerError(f"ledger {redact(url)}: {_one_line(exc)}") from None
