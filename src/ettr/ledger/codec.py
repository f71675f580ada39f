"""One event as plain values and back: the row layout shared by the PostgreSQL ledger and its spill files."""

from __future__ import annotations

import json
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
