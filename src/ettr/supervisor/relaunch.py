"""How an attempt's process was started, and what the console says while it waits: `Relaunch` (path warm |
promoted | cold | forked | spare and why, recorded in the supervisor's `relaunch` MARK; the TTR's relaunch part shows it) and
`WarmUpNotice` (an attempt waiting more than a second for a promoted standby says so). The standbys
themselves are `ettr.supervisor.standby`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from ettr.supervisor.standby import Standby

RelaunchPath = Literal["warm", "promoted", "cold", "forked", "spare"]


@dataclass(frozen=True, kw_only=True)
class Relaunch:
    """How an attempt's process was started, and why (the supervisor's `relaunch` MARK; the TTR's relaunch
    part shows it)."""

    path: RelaunchPath
    """`warm`: a standby that had done its warm-up took the attempt; `promoted`: a standby still warming,
    promoted to normal priority, took it; `cold`: a new process; `forked`: forked, warm, from the agent's
    zygote (`ettr.supervisor.zygote`); `spare`: an in-place replacement that had run the script's start-up
    ahead, parked, and was promoted (`ettr.supervisor.spares`)."""
    why: str
    """In a few words: why this path."""
    ranks: tuple[tuple[int, RelaunchPath, str], ...] = ()
    """Per local rank of ettr's torchrun agent: (rank, path, why); empty for one process."""

    def to_data(self) -> dict[str, Any]:
        data: dict[str, Any] = {"path": self.path, "why": self.why}
        if self.ranks:
            data["ranks"] = [{"rank": r, "path": p, "why": w} for r, p, w in self.ranks]
        return data

    @classmethod
    def of_ranks(cls, ranks: Sequence[Relaunch]) -> Relaunch:
        """One relaunch of several ranks: the slowest path among them (a job trains once all ranks do), why
        as the first such rank says it, with the ranks that took it (each rank's own in `ranks`)."""
        order: tuple[RelaunchPath, ...] = ("cold", "promoted", "warm", "forked", "spare")
        path = next(p for p in order if any(r.path == p for r in ranks))
        took = [i for i, r in enumerate(ranks) if r.path == path]
        why = ranks[took[0]].why
        if len(ranks) > 1:
            why += f" (rank{'s' if len(took) > 1 else ''} {', '.join(map(str, took))})"
        return cls(path=path, why=why, ranks=tuple((i, r.path, r.why) for i, r in enumerate(ranks)))

    @classmethod
    def in_place(cls, replaced: Sequence[int], paths: Sequence[Relaunch]) -> Relaunch:
        """An in-place recovery's relaunch: the local ranks `replaced`, each started as `paths` says."""
        if not paths:
            return cls(path="warm", why="in place: every worker went on, none replaced")
        slowest = cls.of_ranks(paths)
        return cls(
            path=slowest.path,
            why=f"in place: rank {', '.join(map(str, replaced))} replaced ({slowest.why}), the others went on",
            ranks=tuple((r, p.path, p.why) for r, p in zip(replaced, paths, strict=True)),
        )


class WarmUpNotice:
    """Says on the console what an attempt waits for while promoted standbys finish their warm-up: once a
    wait passes `after_s` (`ettr: attempt N: waiting for ...`), and again when they are ready. A daemon
    thread; `stop()` ends it (the attempt ended). Each standby is read by this thread only."""

    def __init__(
        self,
        attempt: int,
        waiting: Sequence[tuple[str, Standby]],
        *,
        after_s: float = 1.0,
        limit_s: float = 3600,
    ) -> None:
        self._attempt, self._waiting, self._after_s, self._limit_s = attempt, list(waiting), after_s, limit_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if not self._waiting:
            return
        self._thread = threading.Thread(target=self._run, name="ettr-warm-up-notice", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
        for _, standby in self._waiting:
            standby.close()

    def _run(self) -> None:
        began = time.monotonic()
        said = False
        pending = list(self._waiting)
        while pending and not self._stop.is_set() and time.monotonic() - began < self._limit_s:
            for who, standby in list(pending):
                standby.poll_status(timeout_s=0.1 / len(pending))
                if standby.handed_at is not None or standby.process.poll() is not None:
                    pending.remove((who, standby))
                    standby.close()
            waited_s = time.monotonic() - began
            if pending and not said and waited_s >= self._after_s:
                names = ", ".join(who for who, _ in pending)
                _say(
                    f"attempt {self._attempt}: waiting for the standby of {names} to finish its warm-up "
                    "(interpreter, import torch; promoted to normal priority at the restart)"
                )
                said = True
        if said and not pending:
            _say(f"attempt {self._attempt}: standby ready after {time.monotonic() - began:.1f} s")


def _say(message: str) -> None:
    from ettr.supervisor.messages import say

    say(message)
