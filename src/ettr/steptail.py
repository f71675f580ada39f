"""Step tails: the last steps of a training process, kept where a SIGKILL or a SIGTERM cannot take them.

The recorder writes its events to the ledger at least every 0.5 s; a process killed outright (a scheduler's
SIGTERM to a script without a handler, a SIGKILL, the OOM killer) takes its unwritten steps with it, and its
lost steps would read short by as many. So each training process also notes every step in a memory-mapped
file of its own (one page: a ring of the last `RING_SLOTS` steps and their times), which the kernel keeps
when the process dies. After an attempt, the supervisor reads the tails of its processes and records the
steps the ledger lacks (`unrecorded_steps`), with the times they were taken.

File: `RUN_DIR/steps/rank-R-pid-P` (`tail_path`): a header (magic, attempt) and `RING_SLOTS` slots of
(step, unix time), step `s` in slot `s % RING_SLOTS`. A slot is written time first, step last, so a write
cut short leaves an older step that the reader drops. Cost on the training thread: one `time.time()` and one
`struct.pack_into` per step.
"""

from __future__ import annotations

import errno
import logging
import math
import mmap
import os
import struct
import time
from collections.abc import Iterable
from pathlib import Path

from ettr.constants import FUTURE_MARGIN_S, MAX_STEP
from ettr.events import Event, EventKind
from ettr.run_env import STEP_TAIL_DIRNAME
from ettr.untrusted import SymlinkRefused, make_dirs_below, open_regular

logger = logging.getLogger("ettr")

RING_SLOTS = 255
"""Steps a tail holds: more than a 0.5 s flush interval's worth at 500 steps per second."""
_MAGIC = 0x6574747273746570  # b"ettrstep"
_HEADER = struct.Struct("<qq")  # magic, attempt
_SLOT = struct.Struct("<dq")  # unix time, step
_TIME = struct.Struct("<d")
_STEP = struct.Struct("<q")
_SIZE = _HEADER.size + RING_SLOTS * _SLOT.size  # 4,096 bytes: one page


def tail_dir(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / STEP_TAIL_DIRNAME


def tail_path(run_dir: str | os.PathLike[str], rank: int, pid: int | None = None) -> Path:
    """The step tail of process `pid` (default: this one), of rank `rank`."""
    return tail_dir(run_dir) / f"rank-{rank}-pid-{os.getpid() if pid is None else pid}"


class StepTail:
    """The writer, in a training process: `note(attempt, step)` at every step (a recorder step listener).
    Opens its file at the first step; a tail that cannot be opened stays off (the ledger has the steps up
    to its last flush, as without it)."""

    def __init__(self, path: Path, *, run_dir: str | os.PathLike[str] | None = None) -> None:
        """`run_dir`: the run directory `path` lies below; the directories between are made without
        following a symlink (`make_dirs_below`: a swapped `steps/` turns the tail off, with one line)."""
        self._path = path
        self._run_dir = run_dir
        self._map: mmap.mmap | None = None
        self._attempt: int | None = None
        self._off = False

    def note(self, attempt: int, step: int) -> None:
        now = time.time()
        if self._attempt != attempt:
            self._begin(attempt)
        page = self._map
        if page is None:
            return
        offset = _HEADER.size + (step % RING_SLOTS) * _SLOT.size
        _TIME.pack_into(page, offset, now)
        _STEP.pack_into(page, offset + _TIME.size, step)

    def _begin(self, attempt: int) -> None:
        """Start a fresh ring for `attempt` (the first step, or a restart in place)."""
        self._attempt = attempt
        if self._off:
            return
        try:
            if self._map is None:
                if self._run_dir is not None:
                    make_dirs_below(self._run_dir, self._path.parent)
                else:
                    self._path.parent.mkdir(parents=True, exist_ok=True)
                flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
                fd = os.open(self._path, flags, 0o644)
                try:
                    _allocate(fd)
                    self._map = mmap.mmap(fd, _SIZE)
                finally:
                    os.close(fd)
            self._map[:] = bytes(_SIZE)
            _HEADER.pack_into(self._map, 0, _MAGIC, attempt)
        except SymlinkRefused as exc:
            logger.warning("ettr: this process keeps no step tail: %s", exc)
            self._off, self._map = True, None
        except (OSError, ValueError):
            self._off, self._map = True, None


def _allocate(fd: int) -> None:
    """Give the file its page of storage now, or raise `OSError` (ENOSPC). A page made by `ftruncate` alone
    is a hole that the first write through the map fills: on a full file system (a full tmpfs) that write
    is a SIGBUS, which killed the training process at its first step of every attempt (measured: a job
    whose run directory's 2 MiB tmpfs filled up ended "killed by SIGBUS (rank 0)", restarts exhausted).
    Written with `pwrite`, a full disk is an error here, and the tail stays off."""
    written = os.pwrite(fd, bytes(_SIZE), 0)
    if written != _SIZE:  # a short write: the rest had no room
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    os.ftruncate(fd, _SIZE)  # a longer file (not ours) is cut to the page


def read_tails(run_dir: str | os.PathLike[str], attempt: int) -> dict[int, list[tuple[int, float]]]:
    """rank -> the (step, unix time) pairs its processes' tails hold for `attempt`, in step order."""
    found: dict[int, list[tuple[int, float]]] = {}
    try:
        entries = list(os.scandir(tail_dir(run_dir)))
    except OSError:
        return found
    for entry in entries:
        rank = _rank_of(entry.name)
        if rank is None:
            continue
        try:
            with os.fdopen(open_regular(entry.path), "rb") as file:  # a FIFO here must not hold the books
                page = file.read(_SIZE)
        except OSError:
            continue
        if len(page) != _SIZE or _HEADER.unpack_from(page, 0) != (_MAGIC, attempt):
            continue
        slots = (_SLOT.unpack_from(page, _HEADER.size + i * _SLOT.size) for i in range(RING_SLOTS))
        found.setdefault(rank, []).extend((step, ts) for ts, step in slots if ts > 0 and step > 0)
    return {rank: sorted(set(pairs)) for rank, pairs in found.items()}


def unrecorded_steps(
    tails: dict[int, list[tuple[int, float]]], recorded: Iterable[tuple[int, int, float]]
) -> list[tuple[int, int, float]]:
    """The (rank, step, unix time) of the steps in `tails` after each rank's last recorded one, taken no
    earlier than it; `recorded`: (rank, step, unix time) of the steps the ledger has."""
    last: dict[int, tuple[int, float]] = {}
    for rank, step, ts in recorded:
        if rank not in last or step > last[rank][0]:
            last[rank] = (step, ts)
    missing = []
    for rank, pairs in tails.items():
        last_step, last_ts = last.get(rank, (0, float("-inf")))
        newest_ts = last_ts
        for step, ts in pairs:  # step order: a slot cut short (an old step) or out of time order is dropped
            if step > last_step and ts >= newest_ts:
                missing.append((rank, step, ts))
                newest_ts = ts
    return missing


def tail_events(
    run_dir: str | os.PathLike[str], attempt: int, events: Iterable[Event], *, since: float | None = None
) -> list[Event]:
    """STEP events for the steps `attempt`'s tails hold beyond what `events` (the books) record, at the times
    they were taken (`data.source` "step_tail"): what its processes took but died before writing. Read only
    once they are gone; never raises (damaged tails are skipped). `since`: when the attempt began (its
    ATTEMPT_START), where `events` may not hold it: the supervisor passes its training events only, and
    an attempt whose process died before its first flush has none (every step it took was dropped as
    "before its attempt began", the attempt read `user (startup)`: 4 of 49 fast restarts in a soak)."""
    events = [e for e in events if e.attempt == attempt]
    recorded = [(e.rank, e.step, e.ts) for e in events if e.kind is EventKind.STEP and e.step is not None]
    try:
        missing = unrecorded_steps(read_tails(run_dir, attempt), recorded)
    except Exception:
        return []
    # A tail is a file in the run directory: a step taken before its attempt began, after the reading host's
    # clock (an infinite time: the report's wall time became NaN and `ettr report` a traceback), or numbered
    # past what a float holds is damage or a forgery, never a step.
    earliest = min((e.ts for e in events), default=math.inf)
    if since is not None:
        earliest = min(earliest, since)
    latest = time.time() + FUTURE_MARGIN_S
    return [
        Event(EventKind.STEP, ts, attempt, rank, step=step, data={"source": "step_tail"})
        for rank, step, ts in missing
        if earliest <= ts <= latest and step <= MAX_STEP
    ]


def _rank_of(name: str) -> int | None:
    parts = name.split("-")
    if len(parts) != 4 or parts[0] != "rank" or parts[2] != "pid":
        return None
    try:
        return int(parts[1])
    except ValueError:
        return None
