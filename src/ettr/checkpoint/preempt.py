"""Preemption: notice SIGTERM, and let the training loop act on it at its next step boundary.

A scheduler that preempts a job sends SIGTERM and, after a grace period, SIGKILL. The handler only sets a
flag (nothing else is safe inside a signal handler, and the step in progress must finish); the checkpoint
manager checks `requested` at each step boundary, saves, waits for the commit, and exits with status 143
(128 + SIGTERM), which the supervisor records as `preempted`.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

from ettr.constants import EXIT_PREEMPTED
from ettr.warn import say_raw

logger = logging.getLogger("ettr")

PREEMPTED_EXIT_STATUS = EXIT_PREEMPTED
"""128 + SIGTERM: the exit status of a process that stopped because it was told to."""


class PreemptionWatcher:
    """Sets `requested` when this process gets SIGTERM; restores the previous handler on `close`.

    Install from the main thread (Python runs signal handlers there only). A second SIGTERM while the
    save is in progress is ignored: the save is what the grace period is for.
    """

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        self._signum = signum
        self._event = threading.Event()
        self._previous: Any = None
        self._installed = False

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def request(self) -> None:
        """Ask for a preemption save without a signal (tests; a scheduler's HTTP notice)."""
        self._event.set()

    def install(self) -> PreemptionWatcher:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "install the preemption handler from the main thread (signal handlers run there)"
            )
        self._previous = signal.signal(self._signum, self._on_signal)
        self._installed = True
        return self

    def close(self) -> None:
        if self._installed:
            signal.signal(self._signum, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self._event.is_set():
            self._event.set()
            # logging from a handler can deadlock on the handler's lock; write the one line directly
            say_raw(b"ettr: SIGTERM received; saving at the next step boundary, then exiting")
