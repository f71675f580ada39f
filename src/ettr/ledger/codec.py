"""One event as plain values and back: the row layout shared by the PostgreSQL ledger and its spill files."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ettr.events import Event, EventKind, Phase

_KINDS = {k.value: k for k in EventKind}
_PHASES = {p.value: p for p in Phase}

Row = tuple[float, str, int, int, "str | None", "int | None", "float | None", "str | None"]
"""(ts, kind, attempt, rank, phase, step, value, data as JSON text)."""


@dataclass(frozen=True, slots=True)
class KeyedEvent:
    """An event with its idempotency key: `(writer, seq)` is unique forever, so delivering it twice is a no-op.

    `writer` names one writing ledger object (host, pid and a random part); `seq` counts its events from 0.
    `node` is the host that wrote it (for fleet and multi-node views; not part of the key).
    """

    writer: str
    seq: int
    node: str
    event: Event


def dump_data(data: Any) -> str | None:
    return None if data is None else json.dumps(data, default=str, separators=(",", ":"))


def to_row(event: Event) -> Row:
    phase = None if event.phase is None else event.phase.value
    return (
        event.ts,
        event.kind.value,
        event.attempt,
        event.rank,
        phase,
        event.step,
        event.value,
        dump_data(event.data),
    )


def from_row(
    ts: float,
    kind: str,
    attempt: int,
    rank: int,
    phase: str | None,
    step: int | None,
    value: float | None,
    data: Any,
) -> Event | None:
    """The event of a row, or None for a row this ettr cannot read (a kind or phase from a newer one).

    `data` may be JSON text or an already decoded value (PostgreSQL's jsonb arrives decoded).
    """
    kind_enum = _KINDS.get(kind)
    phase_enum = None if phase is None else _PHASES.get(phase)
    if kind_enum is None or (phase is not None and phase_enum is None):
        return None
    if isinstance(data, str | bytes):
        try:
            data = json.loads(data)
        except ValueError:
            return None
    return Event(kind_enum, float(ts), int(attempt), int(rank), phase_enum, step, value, data)


def events_from_rows(rows: Iterable[Sequence[Any]]) -> tuple[list[Event], int]:
    """The events of rows `(ts, kind, attempt, rank, phase, step, value, data JSON text)` as a database
    returns them (typed), and how many rows could not be read. `from_row`'s loop, without its per-row checks
    of types a database already guarantees: a million-row read is most of a report's time."""
    kinds, phases, loads = _KINDS, _PHASES, json.loads
    events: list[Event] = []
    append = events.append
    num_bad = 0
    for ts, kind, attempt, rank, phase, step, value, data in rows:
        kind_enum = kinds.get(kind)
        if kind_enum is None:
            num_bad += 1
            continue
        phase_enum = None
        if phase is not None:
            phase_enum = phases.get(phase)
            if phase_enum is None:
                num_bad += 1
                continue
        if data is not None:
            try:
                data = loads(data)
            except ValueError:
                num_bad += 1
                continue
        append(Event(kind_enum, ts, attempt, rank, phase_enum, step, value, data))
    return events, num_bad
