"""Ledger rows <-> events, validated both ways: the one codec every backend and spill file goes through.

A ledger is read by tools of other versions and may hold rows a bug, a bit flip or a newer ettr wrote. So
every field is checked on the way in (`to_row`: numpy or 0-d tensor step numbers become ints; a value that
cannot be stored drops that one event, never its batch) and on the way out (`from_row`, `events_from_rows`:
a row that is not a well-formed event is skipped and counted, never raised). The accounting can then rely
on its types and ranges.

What a well-formed row is (`docs/ledger.md`, "What the books accept"):
- `kind` and `phase` known to this ettr (a newer ettr's are skipped);
- `ts` a finite time within `MIN_TS`..`MAX_TS`, and (on a read of a whole job) within `PLAUSIBLE_SPAN_S` of
  the job's median time: a flipped exponent bit moves a time by decades;
- `attempt` within 0..`MAX_ATTEMPT`, `rank` within `SUPERVISOR_RANK`..`MAX_RANK`, `step` within
  +-`MAX_STEP`, `value` a number (not NaN);
- `data` a JSON object nested at most `MAX_DATA_DEPTH` deep.
"""

from __future__ import annotations

import json
import math
import operator
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ettr.constants import MAX_STEP
from ettr.events import SUPERVISOR_RANK, Event, EventKind, Phase

_KINDS = {k.value: k for k in EventKind}
_PHASES = {p.value: p for p in Phase}

Row = tuple[float, str, int, int, str | None, int | None, float | None, str | None]
"""(ts, kind, attempt, rank, phase, step, value, data as JSON text): the stored columns of one event."""

MIN_TS = 0.0
MAX_TS = 1e10
"""Event times are Unix seconds between 1970 and 2286: anything else is damage, not a time."""
MAX_ATTEMPT = 1_000_000
"""No job restarts a million times: a larger attempt number is a flipped bit (2^63-1 read as an attempt
turned a completed job into one that was 92.9% failure)."""
MAX_RANK = 1 << 24
MAX_DATA_DEPTH = 32
"""Event data is a small, flat record; a deeper nesting is damage or a forgery (and would make later JSON
handling recurse without bound)."""
PLAUSIBLE_SPAN_S = 10 * 365.25 * 86400.0
"""On a read of a whole job, a time further than this from the job's median time is damage: no job's books
span a decade, and the smallest change a flipped exponent bit makes to a time of this century is decades."""


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


def _bounded(name: str, value: int, low: int, high: int) -> int:
    if not low <= value <= high:
        raise ValueError(f"{name} {value} is outside {low}..{high}")
    return value


def _step(value: int | None) -> int | None:
    return None if value is None else _bounded("step", value, -MAX_STEP, MAX_STEP)


def _time(value: Any) -> float:
    ts = as_number(value)
    if not MIN_TS <= ts <= MAX_TS:  # also refuses infinities
        raise ValueError(f"time {ts!r} is not a Unix time between 1970 and 2286")
    return ts


def dump_data(data: Any) -> str | None:
    """Event data as stored: compact JSON text (NaN kept: Python's JSON reads it back); TypeError unless a
    mapping."""
    if data is None:
        return None
    if not isinstance(data, Mapping):
        raise TypeError("event data must be a mapping")
    try:
        text = json.dumps(dict(data), default=str, separators=(",", ":"))
    except RecursionError:
        raise ValueError("event data nested too deep") from None
    if text.count("{") + text.count("[") > MAX_DATA_DEPTH:
        load_data(text)  # raises ValueError when nested deeper than the readers accept
    return text


def _depth_ok(payload: Any) -> bool:
    """Whether `payload` nests at most `MAX_DATA_DEPTH` containers deep (iterative: never recurses)."""
    stack = [(payload, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DATA_DEPTH:
            return False
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return True


def load_data(text: Any) -> dict[str, Any] | None:
    """The data of a stored row: None for none; raises ValueError unless a JSON object within the limits.
    `text` may be JSON text or bytes (SQLite, spill files) or already decoded (a driver's json type)."""
    if text is None:
        return None
    if isinstance(text, (str, bytes, bytearray)):
        try:
            payload = json.loads(text)
        except RecursionError:
            raise ValueError("event data nested too deep") from None
        if isinstance(text, str):
            deep = text.count("{") + text.count("[") > MAX_DATA_DEPTH
        else:
            deep = text.count(b"{") + text.count(b"[") > MAX_DATA_DEPTH
    else:
        payload, deep = text, True
    if not isinstance(payload, dict):
        raise ValueError("event data is not a JSON object")
    if deep and not _depth_ok(payload):
        raise ValueError(f"event data nested deeper than {MAX_DATA_DEPTH}")
    return payload


def to_row(event: Event) -> Row:
    """The stored form of `event`; TypeError/ValueError if one of its fields cannot be stored."""
    kind = event.kind if isinstance(event.kind, EventKind) else EventKind(event.kind)
    phase = None if event.phase is None else Phase(event.phase).value
    return (
        _time(event.ts),
        kind.value,
        _bounded("attempt", as_int(event.attempt), 0, MAX_ATTEMPT),
        _bounded("rank", as_int(event.rank), SUPERVISOR_RANK, MAX_RANK),
        phase,
        _step(as_optional_int(event.step)),
        None if event.value is None else as_number(event.value),
        dump_data(event.data),
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
        attempt_n = _stored_int(attempt)
        rank_n = _stored_int(rank)
        if attempt_n is None or rank_n is None:
            return None
        return Event(
            kind_enum,
            _time(ts),
            _bounded("attempt", attempt_n, 0, MAX_ATTEMPT),
            _bounded("rank", rank_n, SUPERVISOR_RANK, MAX_RANK),
            phase_enum,
            _step(_stored_int(step)),
            None if value is None else as_number(value),
            load_data(data),
        )
    except (TypeError, ValueError, OverflowError, RecursionError):
        return None


def events_from_rows(rows: Iterable[Sequence[Any]]) -> tuple[list[Event], int]:
    """The events of one job's rows `(ts, kind, attempt, rank, phase, step, value, data)`, in order, and how
    many rows were skipped as not well-formed (see the module docstring). The common row (typed as the
    database stores it, in range) takes a fast path: a million-row read is most of a report's time; any
    other row goes through `from_row`'s full checks."""
    kinds, phases, loads = _KINDS, _PHASES, load_data
    events: list[Event] = []
    append = events.append
    num_bad = 0
    for row in rows:
        ts, kind, attempt, rank, phase, step, value, data = row
        kind_enum = kinds.get(kind) if type(kind) is str else None
        phase_enum = None if phase is None or type(phase) is not str else phases.get(phase)
        if (
            kind_enum is not None
            and (phase is None or phase_enum is not None)
            and type(ts) is float
            and MIN_TS <= ts <= MAX_TS
            and type(attempt) is int
            and 0 <= attempt <= MAX_ATTEMPT
            and type(rank) is int
            and SUPERVISOR_RANK <= rank <= MAX_RANK
            and (step is None or (type(step) is int and -MAX_STEP <= step <= MAX_STEP))
            and (value is None or (type(value) is float and value == value))
        ):
            try:
                payload = None if data is None else loads(data)
            except ValueError:
                num_bad += 1
                continue
            append(Event(kind_enum, ts, attempt, rank, phase_enum, step, value, payload))
            continue
        event = from_row(*row)
        if event is None:
            num_bad += 1
        else:
            append(event)
    kept = plausible_times(events)
    return kept, num_bad + len(events) - len(kept)


def plausible_times(events: list[Event]) -> list[Event]:
    """`events` without those further than `PLAUSIBLE_SPAN_S` from the job's median time (judged on a
    sample of at most ~1,000 events, so a million-event read pays microseconds)."""
    if len(events) < 3:
        return events
    sample = events[:: max(1, len(events) // 1000)]
    center = statistics.median_low(e.ts for e in sample)
    low, high = center - PLAUSIBLE_SPAN_S, center + PLAUSIBLE_SPAN_S
    if all(low <= e.ts <= high for e in events):
        return events
    return [e for e in events if low <= e.ts <= high]


def storable_rows(events: Iterable[Event]) -> tuple[list[tuple[int, Row]], BaseException | None]:
    """(index, row) of each event that can be stored, in order, and the first error met (the events that
    failed are left out: one bad event never costs its batch)."""
    out: list[tuple[int, Row]] = []
    first: BaseException | None = None
    for index, event in enumerate(events):
        try:
            out.append((index, to_row(event)))
        except (TypeError, ValueError, OverflowError) as exc:
            first = first or exc
    return out, first
