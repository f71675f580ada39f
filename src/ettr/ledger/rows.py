"""Ledger rows <-> events, validated both ways: what any backend writes and reads goes through here.

A ledger is read by tools of other versions and may hold rows a bug, a bit flip or a newer ettr wrote. So
every field is checked on the way in (`to_row`: numpy or 0-d tensor step numbers become ints, a value that
cannot be stored drops that one event, never its batch) and on the way out (`from_row`: a row that is not a
well-formed event is skipped and counted, never raised). The accounting can then rely on its types.
"""

from __future__ import annotations

import json
import math
import operator
import sys
from collections.abc import Mapping
from typing import Any

from ettr.events import Event, EventKind, Phase

_KINDS = {k.value: k for k in EventKind}
_PHASES = {p.value: p for p in Phase}

Row = tuple[float, str, int, int, str | None, int | None, float | None, str | None]


def as_int(value: Any) -> int:
    """`value` as an int if it is one (numpy ints, 0-d integer tensors, bools excluded); else TypeError."""
    if type(value) is int:
        return value
    if isinstance(value, bool):
        raise TypeError("a bool is not a step number")
    return operator.index(value)


def as_optional_int(value: Any) -> int | None:
    return None if value is None else as_int(value)


def as_number(value: Any) -> float:
    """A real number as float (NaN refused); else TypeError/ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            value = float(value)  # numpy floats, 0-d tensors
        except (TypeError, ValueError):
            raise TypeError(f"{type(value).__name__} is not a number") from None
    number = float(value)
    if math.isnan(number):
        raise ValueError("NaN is not a time or value")
    return number


def to_row(event: Event) -> Row:
    """The stored form of `event`; TypeError/ValueError if one of its fields cannot be stored."""
    kind = event.kind if isinstance(event.kind, EventKind) else EventKind(event.kind)
    phase = None if event.phase is None else Phase(event.phase).value
    ts = as_number(event.ts)
    if not math.isfinite(ts):
        raise ValueError("an event time must be finite")
    value = None if event.value is None else as_number(event.value)
    data = None
    if event.data is not None:
        if not isinstance(event.data, Mapping):
            raise TypeError("event data must be a mapping")
        data = json.dumps(dict(event.data), default=str, separators=(",", ":"), allow_nan=False)
    return (
        ts,
        kind.value,
        as_int(event.attempt),
        as_int(event.rank),
        phase,
        as_optional_int(event.step),
        value,
        data,
    )


def _stored_int(value: Any) -> int | None:
    """An integer column as stored; numpy ints written by ettr <= 0.1 sit there as 8 raw bytes."""
    if value is None:
        return None
    if isinstance(value, bytes) and len(value) == 8:
        return int.from_bytes(value, sys.byteorder, signed=True)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return as_int(value)


def from_row(
    ts: Any, kind: Any, attempt: Any, rank: Any, phase: Any, step: Any, value: Any, data: Any
) -> Event | None:
    """The event a stored row holds, or None when the row is not a well-formed event (skip and count it)."""
    kind_enum = _KINDS.get(kind) if isinstance(kind, str) else None
    phase_enum = None if phase is None else (_PHASES.get(phase) if isinstance(phase, str) else None)
    if kind_enum is None or (phase is not None and phase_enum is None):
        return None  # written by a newer ettr, or damaged
    try:
        ts_s = as_number(ts)
        if not math.isfinite(ts_s):
            return None
        payload = None
        if data is not None:
            payload = json.loads(data) if isinstance(data, (str, bytes)) else None
            if not isinstance(payload, dict):
                return None
        return Event(
            kind_enum,
            ts_s,
            _stored_int(attempt) or 0,
            _stored_int(rank) or 0,
            phase_enum,
            _stored_int(step),
            None if value is None else as_number(value),
            payload,
        )
    except (TypeError, ValueError, OverflowError, RecursionError):
        return None
