"""A client-side bound on each call to a database server: a call that outlives it has its socket shut down.

A server that is alive but stalled (its processes stopped, swapped out, wedged) keeps its TCP connections
up: the kernel still acknowledges what the client sends and answers keepalives, so neither
`tcp_user_timeout` nor keepalives fire, and the server's own `statement_timeout` cannot run. The bound
that is left is the client's own clock. One shared daemon thread watches the armed calls; when one is past
its deadline it shuts that call's socket down (`shutdown(2)` on a duplicate of the descriptor: the driver
keeps owning the descriptor), so the blocked read or write fails at once, as if the connection had died,
and the caller treats it as an outage.

    with WATCHDOG.bound(15.0, lambda: shutdown_socket(conn.pgconn.socket)) as call:
        conn.execute(...)          # raises (connection lost) if 15 s pass without an answer
    call.fired                     # whether the bound was what ended it
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator


class BoundedCall:
    """One armed call: its deadline, what to do when it passes, and whether that happened."""

    __slots__ = ("deadline", "expire", "fired", "seconds")

    def __init__(self, seconds: float, expire: Callable[[], None]) -> None:
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.expire = expire
        self.fired = False


class CallWatchdog:
    """Runs each armed call's `expire` once its deadline passes, unless the call ended first.

    `expire` runs on the watchdog's thread under its lock, so once `bound` has exited it can no longer run
    for that call (a connection reused by the next call is never shut down by the previous one's bound).
    It must be quick and must not raise (what it raises is ignored). Safe after `fork`: a child starts its
    own thread on first use."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._cond = threading.Condition()
        self._armed: set[BoundedCall] = set()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def bound(self, seconds: float, expire: Callable[[], None]) -> Iterator[BoundedCall]:
        """Arm a bound of `seconds` for the body of the `with`; yields the call (see `BoundedCall.fired`)."""
        if os.getpid() != self._pid:
            self._reset()  # forked: the parent's thread and lock are not ours
        call = BoundedCall(seconds, expire)
        with self._cond:
            self._armed.add(call)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ettr-call-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()
        try:
            yield call
        finally:
            with self._cond:
                self._armed.discard(call)

    def _run(self) -> None:
        with self._cond:
            while True:
                if not self._armed:
                    self._cond.wait()
                    continue
                now = time.monotonic()
                due = [call for call in self._armed if call.deadline <= now]
                for call in due:
                    self._armed.discard(call)
                    call.fired = True
                    try:
                        call.expire()
                    except Exception:
                        pass
                if not due:
                    self._cond.wait(min(call.deadline for call in self._armed) - now)


WATCHDOG = CallWatchdog()
"""The process's watchdog (one thread for every bounded call)."""


def shutdown_socket(fd: int) -> None:
    """Shut down both directions of the socket behind descriptor `fd` (owned by someone else, left open):
    a thread blocked reading or writing it returns at once with end-of-file or an error."""
    try:
        dup = os.dup(fd)
    except OSError:
        return
    try:
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()
