"""The fast path of a restart: wake the supervisor the instant its child exits, and the back-off rule.

`ExitWaker` waits on a pidfd (Linux >= 5.3, `os.pidfd_open`) on a helper thread and sets the supervisor's
wake event when the attempt's process exits, so the loop learns of a dead attempt at once instead of on its
next polling tick (the tick stays as the fallback where pidfds are missing). `backoff_wait_s` skips the wait
before the first restart of a failure that looks transient (the attempt had trained: a crash in the middle
of training, not a script that cannot start) and doubles it for later restarts, as before.
"""

from __future__ import annotations

import logging
import os
import select
import threading
from collections.abc import Iterable

from ettr.events import Event, EventKind, Outcome

logger = logging.getLogger("ettr")


class ExitWaker:
    """Sets `wake` once process `pid` (a child of ours) has exited. `close()` when done with it."""

    def __init__(self, pid: int, wake: threading.Event) -> None:
        self._wake = wake
        self._pidfd: int | None = None
        self._cancel_r, self._cancel_w = -1, -1
        try:
            self._pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError) as exc:  # an old kernel or Python: the polling tick does it
            logger.debug("ettr: no pidfd for %s (%s); polling for its exit", pid, exc)
            return
        self._cancel_r, self._cancel_w = os.pipe()
        self._thread = threading.Thread(target=self._wait, name="ettr-exit-waker", daemon=True)
        self._thread.start()

    @property
    def active(self) -> bool:
        """Whether the exit wakes the loop (False: only the polling tick sees it)."""
        return self._pidfd is not None

    def _wait(self) -> None:
        assert self._pidfd is not None
        try:
            ready, _, _ = select.select([self._pidfd, self._cancel_r], [], [])
        except (OSError, ValueError):
            return
        if self._pidfd in ready:
            self._wake.set()

    def close(self) -> None:
        if self._pidfd is None:
            return
        try:
            os.write(self._cancel_w, b"x")
        except OSError:
            pass
        self._thread.join(1.0)
        for fd in (self._pidfd, self._cancel_r, self._cancel_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._pidfd = None


def trained(events: Iterable[Event]) -> bool:
    """Whether a training process of the attempt completed a step (its failure came after progress)."""
    return any(e.kind == EventKind.STEP and e.rank >= 0 for e in events)


def backoff_wait_s(
    restart: int, *, outcome: Outcome, made_progress: bool, backoff_s: float, max_backoff_s: float
) -> float:
    """Seconds to wait before restart number `restart` + 1 (0-based `restart`).

    No wait before the first restart of a failure that looks transient (a failed or hung attempt that had
    trained); otherwise `backoff_s` doubling per restart, at most `max_backoff_s` (a job that fails again
    and again, or cannot start at all, is not restarted in a tight loop).
    """
    transient = made_progress and outcome in (Outcome.FAILED, Outcome.HUNG)
    if restart == 0 and transient:
        return 0.0
    return min(max_backoff_s, backoff_s * 2**restart)
