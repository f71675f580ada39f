"""The signals `ettr run` acts on: caught, counted, and waking the supervisor's loop at once.

The handler only notes the signal (the first one received, and how many so far) and sets the wake event; the
loop decides what to do (`ettr.supervisor.watch`: forward it to the job, SIGKILL after the grace, at once on
a second one). SIGTERM (a scheduler, `kill`), SIGINT (Ctrl-C), SIGUSR1 (Slurm's warning before the time
limit), SIGHUP (a dropped ssh session) and SIGQUIT are handled; the job gets each as SIGTERM (its save-and-exit
signal), but SIGINT, which it gets as SIGINT. The supervisor installs them before it opens the job's books and
keeps them until it has closed them, so a signal at any moment ends the job with its books closed.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

from ettr.supervisor import slurm

HANDLED = (signal.SIGTERM, signal.SIGINT, slurm.WARNING_SIGNAL, signal.SIGHUP, signal.SIGQUIT)
_AS_SIGTERM = frozenset({signal.SIGHUP, signal.SIGQUIT})


def forwarded_signal(received: int) -> int:
    """What the job gets when the supervisor receives `received` (see the module docstring)."""
    return signal.SIGTERM if received in _AS_SIGTERM else slurm.forwarded_signal(received)


class SupervisorSignals:
    """The signals the supervisor received (see the module docstring). `install()` on the main thread, then
    `restore()`; `wait(s)` sleeps until `s` passed, a signal arrived or something else set `wake`."""

    def __init__(self) -> None:
        self.first: int | None = None
        """The first signal received (the one that decides the job's end), None before any."""
        self.count = 0
        """How many were received so far."""
        self.insisted = False
        """A signal came again after the first: the first one repeated, or a SIGINT/SIGQUIT (a person). Another
        signal after the first is no insistence: Slurm's SIGTERM of a requeue after its SIGUSR1 warning (a
        Lightning job requeued by its own handler) must not take the job's grace away."""
        self.wake = threading.Event()
        """Set by each signal (and by whoever else wants the loop to look now: `restart.ExitWaker`)."""
        self._previous: dict[int, Any] = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if self.first is None:
            self.first = signum
        elif signum == self.first or signum in (signal.SIGINT, signal.SIGQUIT):
            self.insisted = True
        self.wake.set()

    def install(self) -> None:
        """Catch the handled signals (only possible on the main thread; elsewhere nothing is caught)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in HANDLED:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def restore(self) -> None:
        """Put back the handlers `install` replaced."""
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def wait(self, timeout_s: float) -> None:
        """Sleep up to `timeout_s`, less when woken."""
        self.wake.wait(timeout_s)
        self.wake.clear()

    @staticmethod
    def from_terminal(sig: int) -> bool:
        """Whether `sig` is a Ctrl-C the terminal already sent to our whole (foreground) process group."""
        if sig != signal.SIGINT:
            return False
        try:
            return os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp()
        except OSError:
            return False
