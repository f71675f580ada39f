"""One writing job per checkpoint root: rank 0 holds an `flock` on `ROOT/.ettr-writer.lock` while its manager
is open.

Two jobs pointed at one root by mistake overwrote and resumed each other's checkpoints without a word: the
second job restored the first one's newest step (from its memory copy, even), moved the first one's next
commit aside as "left by an earlier run", and the first job's memory copies failed under it. The job id
cannot tell a mistake from a requeue (a rerun of `ettr run` gets a new one), but a running holder can: the
lock is the kernel's, so it goes with the process that held it — a SIGKILLed rank 0 leaves nothing to clean
up, and its restart takes the lock at once.

The lock file is there while a job writes (a few hundred bytes naming its holder) and removed when it lets
go; a process that locked a file since unlinked tries again on the new one. A SIGKILLed holder leaves the
file, unlocked. Local roots only: object stores have no locks. A root where
the file cannot be made (read-only: a restore-only job) is used without one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
from dataclasses import dataclass

from ettr.procs import running
from ettr.untrusted import loads_bounded

LOCK_NAME = ".ettr-writer.lock"
_MAX_HOLDER_BYTES = 4096

_lock = threading.Lock()
_held: dict[tuple[int, int], list[int]] = {}
"""(st_dev, st_ino) of a lock file this process holds -> [fd, number of managers holding it]: two managers
of one process on one root (an in-place restart's new manager before the old one closed) share it."""


@dataclass(frozen=True, slots=True)
class Held:
    """A lock this process holds on a root (release it once)."""

    key: tuple[int, int]


def acquire(root: str, *, job_id: str, run_dir: object = None) -> Held | str | None:
    """Take the root's writer lock. Returns the lock held, None when no lock could be taken for a reason
    that is no other job's (read-only root, no flock on this file system), or the one line that says which
    running job holds it (the caller refuses the root)."""
    try:
        os.makedirs(root, exist_ok=True)
        fd = os.open(
            os.path.join(root, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600
        )
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        with _lock:
            if key in _held:  # this process holds it already
                _held[key][1] += 1
                os.close(fd)
                return Held(key)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                return _in_use_line(root, holder, job_id)
            except OSError:  # no flock here
                os.close(fd)
                return None
            if not _still_linked(root, key):  # its holder removed it on release: lock the new file
                os.close(fd)
                return acquire(root, job_id=job_id, run_dir=run_dir)
            _held[key] = [fd, 1]
        _write_holder(fd, job_id=job_id, run_dir=run_dir)
        return Held(key)
    except OSError:
        with contextlib.suppress(OSError):
            os.close(fd)
        return None


def release(held: Held, root: str) -> None:
    """Let go of a lock `acquire` returned, removing its file (while still held: a process that opened it
    meanwhile finds it unlinked once it has the lock, and takes a new one)."""
    with _lock:
        entry = _held.get(held.key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _held[held.key]
        if _still_linked(root, held.key):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(root, LOCK_NAME))
    with contextlib.suppress(OSError):
        os.close(entry[0])  # the flock goes with its last descriptor


def _still_linked(root: str, key: tuple[int, int]) -> bool:
    try:
        st = os.stat(os.path.join(root, LOCK_NAME), follow_symlinks=False)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == key


def _write_holder(fd: int, *, job_id: str, run_dir: object) -> None:
    holder = {
        "job_id": job_id,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.time(),
        "run_dir": run_dir,
    }
    with contextlib.suppress(OSError):
        data = json.dumps(holder, default=str).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)


def _read_holder(fd: int) -> dict[str, object]:
    try:
        holder = loads_bounded(os.pread(fd, _MAX_HOLDER_BYTES, 0))  # 1,000 brackets: RecursionError
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _in_use_line(root: str, holder: dict[str, object], job_id: str) -> str | None:
    """The refusal, or None when the lock is held by no running writer of another job: a process this job
    forked (a data loader worker outlives its SIGKILLed rank 0 by a few seconds) or one of this job's own."""
    pid, host, other = holder.get("pid"), holder.get("host"), holder.get("job_id")
    if other == job_id:
        return None
    if host == socket.gethostname() and isinstance(pid, int) and not running(pid, None):
        return None  # the writer is gone; what holds its lock is a child it forked
    who = f"job {other}" if isinstance(other, str) else "another job"
    where = f" (pid {pid} on {host})" if isinstance(pid, int) and isinstance(host, str) else ""
    return (
        f"checkpoint root {root} is in use by {who}{where}: two jobs writing one root overwrite and resume "
        "each other's checkpoints; give this job its own root, or stop the other job first"
    )
