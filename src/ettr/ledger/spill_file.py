"""Reading a spill file (`ettr.ledger.spill`) as anyone who can write the run directory may have left it:
bounded in size and per line, never through a symlink, never blocking on a FIFO.

A spill file is line 1 a header `{"spill": 1, "job_id", "writer", "node"}`, then one JSON array per event:
`[seq, ts, kind, attempt, rank, phase, step, value, data]`. A torn last line (a crash mid-write) is skipped;
a file over `MAX_SPILL_BYTES` is not read at all (`SpillUnreadable`): a sparse file of a few GB, planted
beside a good one, once took `ettr report` and `ettr fleet` down with a MemoryError.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import BinaryIO

from ettr.events import Event
from ettr.ledger.base import LedgerError
from ettr.ledger.rows import KeyedEvent, from_row
from ettr.untrusted import loads_bounded, open_regular

logger = logging.getLogger("ettr")

MAX_SPILL_BYTES = 1 << 30
"""A spill file larger than this is not read: about 2.5 hours of 2,000 events/s from one writer (60 bytes an
event), far past any outage a drain or `ettr deliver` leaves behind."""
MAX_LINE_BYTES = 16 << 20
"""A spill line (one event) longer than this is damage: skipped to its end, never held in memory."""
MAX_HEADER_BYTES = 65536


class SpillUnreadable(LedgerError):
    """A spill file with a readable header whose records cannot be read (larger than `MAX_SPILL_BYTES`, or
    an OSError). `header` is its header, so a caller can tell whose it is."""

    def __init__(self, message: str, header: dict[str, object]) -> None:
        super().__init__(message)
        self.header = header


def read_header(path: Path) -> dict[str, object] | None:
    """The header of a spill file, or None when it is not one (no writer or job named, damaged, not a file)."""
    try:
        fd = open_regular(path)
        with os.fdopen(fd, "rb") as f:
            header = loads_bounded(f.readline(MAX_HEADER_BYTES))
    except (OSError, ValueError):
        return None
    if not isinstance(header, dict) or header.get("spill") != 1:
        return None
    if not isinstance(header.get("writer"), str) or not isinstance(header.get("job_id"), str):
        return None
    return header


def read_spill(path: Path) -> tuple[dict[str, object], list[KeyedEvent]]:
    """The header and the records of a spill file (torn, overlong or unreadable lines skipped), read line by
    line. Raises LedgerError when it is not a spill file, `SpillUnreadable` (one line) when it is larger
    than `MAX_SPILL_BYTES` or cannot be read."""
    header = read_header(path)
    if header is None:
        raise LedgerError(f"{path} is not an ettr spill file")
    try:
        with os.fdopen(open_regular(path), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_SPILL_BYTES:
                raise SpillUnreadable(
                    f"{path} holds {size} bytes, more than the {MAX_SPILL_BYTES} a spill file may; not read",
                    header,
                )
            f.readline(MAX_HEADER_BYTES)  # the header, read above
            records, num_bad, torn_last = _records(f, header)
    except OSError as exc:
        raise SpillUnreadable(f"{path} cannot be read ({exc})", header) from None
    if num_bad > 1 or (num_bad == 1 and not torn_last):  # one torn last line is a crash mid-write: expected
        logger.warning("ettr: %s: skipped %d unreadable spill records", path, num_bad)
    return header, records


def _records(f: BinaryIO, header: dict[str, object]) -> tuple[list[KeyedEvent], int, bool]:
    """The records after the header; how many lines were skipped; whether the last skipped one was the
    file's torn end (no newline). Reads at most `MAX_SPILL_BYTES` (the file may grow while read)."""
    writer, node = str(header["writer"]), str(header.get("node", ""))
    records: list[KeyedEvent] = []
    num_bad, torn_last, budget = 0, False, MAX_SPILL_BYTES
    while budget > 0:
        line = f.readline(min(MAX_LINE_BYTES + 1, budget))
        if not line:
            break
        budget -= len(line)
        complete = line.endswith(b"\n")
        if not complete and len(line) > MAX_LINE_BYTES:
            budget -= _skip_line(f, budget)
            num_bad += 1
            continue
        if not line.strip(b"\n"):
            continue
        event = _event(line)
        if event is None:
            num_bad += 1
            torn_last = not complete
            continue
        records.append(KeyedEvent(writer, event[0], node, event[1]))
    return records, num_bad, torn_last


def _skip_line(f: BinaryIO, budget: int) -> int:
    """Read past the rest of an overlong line, at most `budget` bytes, a MiB at a time; the bytes read."""
    used = 0
    while used < budget:
        chunk = f.readline(min(1 << 20, budget - used))
        used += len(chunk)
        if not chunk or chunk.endswith(b"\n"):
            break
    return used


def _event(line: bytes) -> tuple[int, Event] | None:
    """(seq, Event) of one spill line, or None when it is not one."""
    try:
        seq, *row = loads_bounded(line)
        if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq < 2**63:
            raise ValueError("not a sequence number")
        event = from_row(*row)
    except (ValueError, TypeError):
        return None
    return None if event is None else (seq, event)
