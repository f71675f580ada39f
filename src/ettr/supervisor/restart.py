"""The fast path of a restart: wake the supervisor the instant its child exits, see a dead rank at once.

`ExitWaker` waits on a pidfd (Linux >= 5.3, `os.pidfd_open`) on a helper thread and sets the supervisor's
wake event when the attempt's process exits, so the loop learns of a dead attempt at once instead of on its
next polling tick (the tick stays as the fallback where pidfds are missing). `PeerFailureWatch` sees a
rank die under a launcher that outlives it (torchrun): once a process of the attempt's tree is gone and a
training process recorded a FAILURE, the supervisor stops the rest at once instead of waiting for the
launcher's own monitoring and teardown. The back-off before a restart is the restart policy's
(`ettr.supervisor.policy`).
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from ettr.events import Event, EventKind
from ettr.procs import running

logger = logging.getLogger("ettr")


class ExitWaker:
    """Sets `wake` each time one of `pids` (children of ours) exits. `close()` when done with it."""

    def __init__(self, pids: int | Sequence[int], wake: threading.Event) -> None:
        self._wake = wake
        self._pidfd: int | None = None
        self._pidfds: list[int] = []
        self._cancel_r, self._cancel_w = -1, -1
        try:
            for pid in [pids] if isinstance(pids, int) else pids:
                self._pidfds.append(os.pidfd_open(pid))
        except (AttributeError, OSError) as exc:  # an old kernel or Python: the polling tick does it
            logger.debug("ettr: no pidfd for %s (%s); polling for its exit", pids, exc)
            for fd in self._pidfds:
                os.close(fd)
            self._pidfds = []
            return
        self._pidfd = self._pidfds[0] if self._pidfds else None
        if self._pidfd is None:
            return
        self._cancel_r, self._cancel_w = os.pipe()
        self._thread = threading.Thread(target=self._wait, name="ettr-exit-waker", daemon=True)
        self._thread.start()

    @property
    def active(self) -> bool:
        """Whether the exit wakes the loop (False: only the polling tick sees it)."""
        return self._pidfd is not None

    def _wait(self) -> None:
        waiting = list(self._pidfds)
        while waiting:
            try:
                ready, _, _ = select.select([*waiting, self._cancel_r], [], [])
            except (OSError, ValueError):
                return
            if self._cancel_r in ready:
                return
            waiting = [fd for fd in waiting if fd not in ready]
            self._wake.set()

    def close(self) -> None:
        if self._pidfd is None:
            return
        try:
            os.write(self._cancel_w, b"x")
        except OSError:
            pass
        self._thread.join(1.0)
        for fd in (*self._pidfds, self._cancel_r, self._cancel_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._pidfd, self._pidfds = None, []


class PeerFailureWatch:
    """Whether a rank of the attempt died with a FAILURE on record, while its launcher still runs.

    `check(tree)` with the attempt's known descendants ((pid, start ticks), e.g. `AttemptProcess.known_tree`)
    notices processes that have exited since the last call; only then does it ask `failure_recorded()` (a
    ledger read), so a healthy attempt costs a few /proc reads per tick. A process that ends without a
    FAILURE (a data loader worker, a clean exit) changes nothing. Once it found one, it looks no more: what
    dies after is the supervisor's stop of the rest, which says nothing of who failed first (a rank that
    raised and was still tearing down died after its peer's SIGTERM, and was named rank 0's failure).
    """

    def __init__(
        self,
        failure_recorded: Callable[[], bool],
        clock: Callable[[], float] = time.time,
        exited_cleanly: Callable[[int], bool] = lambda pid: False,
    ) -> None:
        self._failure_recorded = failure_recorded
        self._clock, self._clean = clock, exited_cleanly
        self._seen_gone: set[tuple[int, int | None]] = set()
        self._found = False
        self.died: list[list[int]] = []
        """The pids seen gone before a FAILURE was found, one list per look that saw them gone, in the order
        of the looks."""
        self.gone: list[tuple[float, list[int]]] = []
        """Each look of `died`: when it was taken (wall clock; what it saw gone had died by then), and the pids
        it saw gone that did not mark a clean exit (`exited_cleanly`: a rank done before its peers)."""

    def check(self, tree: Mapping[int, int | None]) -> bool:
        if self._found:
            return False
        new = [(pid, t) for pid, t in tree.items() if t is not None and (pid, t) not in self._seen_gone]
        died = [key for key in new if not running(*key)]
        if not died:
            return False
        self._seen_gone.update(died)
        self.died.append([pid for pid, _ in died])
        self.gone.append((self._clock(), [pid for pid, _ in died if not self._clean(pid)]))
        try:
            self._found = self._failure_recorded()
            return self._found
        except Exception as exc:  # the books cannot tell: leave it to the launcher
            logger.debug("ettr: cannot read the ledger for a failure (%s)", exc)
            return False


def trained(events: Iterable[Event]) -> bool:
    """Whether a training process of the attempt completed a step (its failure came after progress)."""
    return any(e.kind == EventKind.STEP and e.rank >= 0 for e in events)
