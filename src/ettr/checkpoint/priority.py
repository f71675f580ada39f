"""Run the background persist at a lower priority than training, where the OS allows it (the helpers live in
`ettr.procs`, shared with the compile store's background save; re-exported here).

Linux keeps the CPU nice value and the I/O priority per thread (task): `lower_priority(tid)` raises the
nice value of one task (or, `whole_process=True`, of every task of a process) by `NICE_STEP` and moves
its I/O to the lowest best-effort level through the `ioprio_set` system call (ctypes; skipped with a debug
log where the call or the platform is missing). Lowering one's own tasks or one's children's needs no
privilege. Best effort: never raises; training is never slowed by a failure here.
"""

from __future__ import annotations

from ettr.procs import NICE_STEP, io_priority, lower_priority, lower_this_thread

__all__ = ["NICE_STEP", "io_priority", "lower_priority", "lower_this_thread"]
