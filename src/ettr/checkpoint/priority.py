"""Run the background persist at a lower priority than training, where the OS allows it.

Linux keeps the CPU nice value and the I/O priority per thread (task): `lower_priority(tid)` raises the
nice value of one task (or, `whole_process=True`, of every task of a process) by `NICE_STEP` and moves
its I/O to the lowest best-effort level through the `ioprio_set` system call (ctypes; skipped with a debug
log where the call or the platform is missing). Lowering one's own tasks or one's children's needs no
privilege. Best effort: never raises; training is never slowed by a failure here.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading

from ettr.procs import tasks

logger = logging.getLogger("ettr")

NICE_STEP = 10
"""How much nicer than training the persist runs (nice values go up to 19)."""

_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "ppc64le": 273, "s390x": 282}
_IOPRIO_WHO_PROCESS = 1
_IOPRIO_CLASS_BE = 2
_IOPRIO_CLASS_SHIFT = 13
_LOWEST_BE_LEVEL = 7


def lower_priority(pid: int, *, whole_process: bool = False) -> bool:
    """Lower the CPU and I/O priority of task `pid` (every task of process `pid` with `whole_process`).
    Returns whether the CPU priority was lowered for at least one task."""
    tids = tasks(pid) if whole_process else [pid]
    lowered = False
    for tid in tids:
        lowered = _nice(tid) or lowered
        _ioprio_lowest(tid)
    return lowered


def lower_this_thread() -> bool:
    """Lower the priority of the calling thread only (Linux: nice and ioprio are per thread)."""
    return lower_priority(threading.get_native_id())


def _nice(tid: int) -> bool:
    if not hasattr(os, "setpriority"):
        logger.debug("ettr: no os.setpriority here; the persist keeps training's CPU priority")
        return False
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + NICE_STEP))
        return True
    except OSError as exc:
        logger.debug("ettr: cannot lower the CPU priority of task %d (%s)", tid, exc)
        return False


def _ioprio_lowest(tid: int) -> bool:
    number = _IOPRIO_SET.get(platform.machine()) if os.name == "posix" else None
    if number is None or platform.system() != "Linux":
        logger.debug("ettr: no ioprio_set on this platform; the persist keeps training's I/O priority")
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        value = (_IOPRIO_CLASS_BE << _IOPRIO_CLASS_SHIFT) | _LOWEST_BE_LEVEL
        if libc.syscall(number, _IOPRIO_WHO_PROCESS, tid, value) != 0:
            logger.debug("ettr: ioprio_set for task %d failed (errno %d)", tid, ctypes.get_errno())
            return False
        return True
    except (OSError, AttributeError) as exc:
        logger.debug("ettr: ioprio_set unavailable (%s)", exc)
        return False


def io_priority(tid: int) -> int | None:
    """The raw I/O priority of task `tid` (ioprio_get), for tests; None where unavailable."""
    number = {"x86_64": 252, "aarch64": 31, "ppc64le": 274, "s390x": 283}.get(platform.machine())
    if number is None or platform.system() != "Linux":
        return None
    try:
        value = int(ctypes.CDLL(None, use_errno=True).syscall(number, _IOPRIO_WHO_PROCESS, tid))
    except (OSError, AttributeError):
        return None
    return None if value < 0 else value
