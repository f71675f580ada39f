"""Reading a run directory's SQLite ledger for the fleet: every event the accounting looks at, and only
the first and last STEP/phase events of the ranks it does not draw the timeline from.

The accounting draws each attempt's timeline from one reference rank (the lowest rank that wrote anything
in that attempt, i.e. rank 0 when present: docs/buckets.md); of the other ranks it uses only their first
and last timestamps and their non-step events (process starts, failures, commits, recompiles, resumes). A
job of N ranks writes N STEP events per step, so skipping the rest reads about 1/N of a large job's
events, and the report is the same: `tests/test_fleet.py` checks `compute` of this read equals `compute`
of `SqliteLedger.read()` on every job it builds.
"""

from __future__ import annotations

import json
import logging
import math
import sqlite3
from pathlib import Path
from typing import Any

from ettr.events import Event, EventKind, Phase
from ettr.ledger import LedgerError, ledger_path
from ettr.ledger.base import LedgerMark

logger = logging.getLogger("ettr")

_KINDS = {k.value: k for k in EventKind}
_PHASES = {p.value: p for p in Phase}
_QUERY = "SELECT ts, kind, attempt, rank, phase, step, value, data, id FROM events ORDER BY id"
_MARK = "SELECT count(*), coalesce(max(id), 0) FROM events"
_SKIPPABLE = frozenset({EventKind.STEP.value, EventKind.PHASE_BEGIN.value, EventKind.PHASE_END.value})


def read_for_accounting(run_dir: Path) -> list[Event]:
    """The events of `run_dir`'s ledger that `ettr.accounting.compute` uses, in append order (see the
    module docstring). Raises `LedgerError` when the ledger cannot be read."""
    return read_marked(run_dir)[0]


def _query(run_dir: Path, query: str) -> list[tuple]:
    """The rows of `query` on `run_dir`'s ledger (read-only, schema checked). Raises `LedgerError`."""
    path = ledger_path(run_dir)
    if not path.is_file():
        raise LedgerError(f"no ledger at {path}")
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30.0)
        try:
            version = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            from ettr.events import SCHEMA_VERSION

            if version is None or int(version[0]) > SCHEMA_VERSION:
                raise LedgerError(f"{path}: ledger schema {version and version[0]} is not supported")
            return conn.execute(query).fetchall()
        finally:
            conn.close()
    except (sqlite3.DatabaseError, ValueError) as exc:
        raise LedgerError(f"{path} is not a readable ettr ledger ({exc})") from None


def current_mark(run_dir: Path) -> LedgerMark:
    """The mark of every row `run_dir`'s ledger holds now (one indexed count). Raises `LedgerError`."""
    count, last = _query(run_dir, _MARK)[0]
    return LedgerMark(int(count), int(last))


def read_marked(run_dir: Path) -> tuple[list[Event], LedgerMark]:
    """`read_for_accounting`'s events and the mark of the rows they were read from (the same read)."""
    path = ledger_path(run_dir)
    rows = _query(run_dir, _QUERY)
    mark = LedgerMark(len(rows), int(rows[-1][8]) if rows else 0)
    # Per attempt, the reference rank (the lowest that wrote anything); per (attempt, rank) its first and
    # last finite timestamps: the only things the accounting takes from the other ranks' steps and phases.
    reference: dict[int, int] = {}
    first: dict[tuple[int, int], float] = {}
    last: dict[tuple[int, int], float] = {}
    for ts, kind, attempt, rank, phase, *_ in rows:
        if (
            rank < 0
            or not math.isfinite(ts)
            or kind not in _KINDS
            or (phase is not None and phase not in _PHASES)
        ):
            continue  # only what the ledger's own read() would return counts
        if rank < reference.get(attempt, rank + 1):
            reference[attempt] = rank
        key = (attempt, rank)
        if ts < first.get(key, math.inf):
            first[key] = ts
        if ts > last.get(key, -math.inf):
            last[key] = ts
    events: list[Event] = []
    num_skipped = 0
    kinds, phases, loads, skippable = _KINDS, _PHASES, json.loads, _SKIPPABLE
    for ts, kind, attempt, rank, phase, step, value, data, _id in rows:
        if (
            kind in skippable
            and rank >= 0
            and rank != reference.get(attempt)
            and ts != first.get((attempt, rank))
            and ts != last.get((attempt, rank))
        ):
            continue
        kind_enum = kinds.get(kind)
        phase_enum = None if phase is None else phases.get(phase)
        if kind_enum is None or (phase is not None and phase_enum is None):
            num_skipped += 1  # written by a newer ettr: keep reading what we understand
            continue
        try:
            payload = None if data is None else loads(data)
        except ValueError:
            payload, num_skipped = None, num_skipped + 1
        events.append(Event(kind_enum, ts, attempt, rank, phase_enum, step, value, payload))
    if num_skipped:
        logger.warning("ettr: %s: skipped %d unreadable ledger records", path, num_skipped)
    return events, mark


# The same choice made by the server (PostgreSQL): only the rows kept above leave it, with the mark of every
# row of the job from the same statement. `ok` is what the ledger's own read would return (a kind and phase
# this ettr knows, a finite time, a training process's rank).
_PG_QUERY = """
SELECT ts, kind, attempt, rank, phase, step, value, data, num_rows, last_id FROM (
    SELECT e.*,
        count(*) OVER () AS num_rows,
        max(id) OVER () AS last_id,
        min(rank) FILTER (WHERE ok) OVER (PARTITION BY attempt) AS ref,
        min(ts) FILTER (WHERE ok) OVER (PARTITION BY attempt, rank) AS first_ts,
        max(ts) FILTER (WHERE ok) OVER (PARTITION BY attempt, rank) AS last_ts
    FROM (
        SELECT id, ts, kind, attempt, rank, phase, step, value, data,
            (rank >= 0 AND ts > '-Infinity' AND ts < 'Infinity' AND kind = ANY(%(kinds)s)
             AND (phase IS NULL OR phase = ANY(%(phases)s))) AS ok
        FROM ettr.events WHERE job_id = %(job_id)s
    ) e
) x
WHERE NOT (kind = ANY(%(skippable)s) AND rank >= 0 AND rank IS DISTINCT FROM ref
           AND ts IS DISTINCT FROM first_ts AND ts IS DISTINCT FROM last_ts)
ORDER BY id
"""


def read_postgres_marked(conn: Any, job_id: str) -> tuple[list[Event], LedgerMark]:
    """`read_marked` for job `job_id` of a PostgreSQL ledger on `conn` (`ettr.ledger.postgres.connect`):
    the server leaves out the rows the accounting does not use. Raises `LedgerError`."""
    import psycopg

    from ettr.ledger.codec import events_from_rows

    params = {"kinds": list(_KINDS), "phases": list(_PHASES), "skippable": list(_SKIPPABLE), "job_id": job_id}
    try:
        rows = conn.execute(_PG_QUERY, params).fetchall()
    except psycopg.Error as exc:
        raise LedgerError(f"job {job_id}: {' '.join(str(exc).split())}") from None
    mark = LedgerMark(int(rows[0][8]), int(rows[0][9])) if rows else LedgerMark(0, 0)
    events, num_bad = events_from_rows(row[:8] for row in rows)
    if num_bad:
        logger.warning("ettr: job %s: skipped %d unreadable ledger records", job_id, num_bad)
    return events, mark
