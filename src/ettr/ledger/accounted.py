"""The rows of one job that the accounting uses: what a fleet reads of each job, on either backend.

The accounting draws each attempt's timeline from one reference rank (the lowest rank that took a step in
that attempt, else the lowest that wrote anything: rank 0 when present, docs/buckets.md); of the other ranks it uses only their first
and last timestamps and their non-step events (process starts, failures, commits, recompiles, resumes). A
job of N ranks writes N STEP events per step, so leaving the rest out reads about 1/N of a large job's rows,
and the report is the same (`tests/test_fleet.py` and `tests/test_fleet_stored.py` check `compute` of this
read against `compute` of a whole read, on SQLite and PostgreSQL).

SQLite selects here, in Python (`select_rows`); PostgreSQL selects on the server with the same rule
(`ettr.ledger.postgres`), so only the kept rows leave it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ettr.events import EventKind, Phase
from ettr.ledger.rows import MAX_TS, MIN_TS

KINDS = tuple(k.value for k in EventKind)
PHASES = tuple(p.value for p in Phase)
SKIPPABLE_KINDS = (EventKind.STEP.value, EventKind.PHASE_BEGIN.value, EventKind.PHASE_END.value)
"""Of a rank other than its attempt's reference rank, only the first and last of these are used."""
_STEP = EventKind.STEP.value


def select_rows(rows: Sequence[Sequence[Any]]) -> list[Sequence[Any]]:
    """The rows `(ts, kind, attempt, rank, phase, ...)` the accounting uses, in their order."""
    kinds, phases = frozenset(KINDS), frozenset(PHASES)
    # Per attempt, the reference rank (the lowest that stepped, else the lowest that wrote anything); per
    # (attempt, rank) its first and last timestamps: the only things the accounting takes from the other
    # ranks' steps and phases. Only rows the codec would read count (a damaged row must not choose the
    # reference rank).
    lowest: dict[int, int] = {}
    lowest_stepped: dict[int, int] = {}
    first: dict[tuple[int, int], float] = {}
    last: dict[tuple[int, int], float] = {}
    for ts, kind, attempt, rank, phase, *_ in rows:
        if (
            type(rank) is not int
            or rank < 0
            or type(attempt) is not int
            or type(ts) is not float
            or not MIN_TS <= ts <= MAX_TS
            or kind not in kinds
            or (phase is not None and phase not in phases)
        ):
            continue
        if rank < lowest.get(attempt, rank + 1):
            lowest[attempt] = rank
        if kind == _STEP and rank < lowest_stepped.get(attempt, rank + 1):
            lowest_stepped[attempt] = rank
        key = (attempt, rank)
        if ts < first.get(key, math.inf):
            first[key] = ts
        if ts > last.get(key, -math.inf):
            last[key] = ts
    reference = {**lowest, **lowest_stepped}
    skippable = frozenset(SKIPPABLE_KINDS)
    return [
        row
        for row in rows
        if not (
            row[1] in skippable
            and type(row[3]) is int
            and row[3] >= 0
            and row[3] != reference.get(row[2])
            and row[0] != first.get((row[2], row[3]))
            and row[0] != last.get((row[2], row[3]))
        )
    ]
