"""Every process a job starts stays in the supervisor's reach, and none outlives its attempt.

Three nets, each catching what the one before misses:

1. the attempt's own tree (`AttemptProcess`: its process group, PDEATHSIG on the child, descendants
   remembered every second and signalled at the end);
2. the supervisor is a child subreaper (`PR_SET_CHILD_SUBREAPER`): a process whose parent exits — a shell's
   child, a `setsid` double fork — is re-parented to the supervisor instead of to init, so it is still found
   (and reaped) here;
3. the environment marker: every process of an attempt inherits `ETTR_RUN_DIR`, `ETTR_ATTEMPT` and
   `ETTR_SUPERVISOR_PID` (`ettr.run_env`), which `/proc/<pid>/environ` keeps whatever the process does to
   its own environment later. `sweep` kills every process carrying this attempt's marker at the attempt's
   end; `leftovers` finds those of a supervisor that died (SIGKILL) before a requeue continues the job.

A process that clears its environment and escapes the tree while the supervisor is dead is beyond all
three (a cgroup would catch it; that is the scheduler's job): its events are fenced by the accounting
(`ettr.accounting.fence`) once its attempt is closed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ettr.procs import (
    ancestors,
    children,
    pid_alive,
    processes_with_env,
    running,
    set_child_subreaper,
    start_ticks,
)
from ettr.run_env import ATTEMPT_ENV, RUN_DIR_ENV, SUPERVISOR_PID_ENV
from ettr.untrusted import whole_number

logger = logging.getLogger("ettr")

KILL_WAIT_S = 3.0
"""How long `kill_all` waits for SIGKILLed processes to be gone."""


_KEPT: set[int] = set()
"""Children that serve the whole run (the agent's zygote, `ettr.supervisor.zygote`): no sweep takes them."""


def keep(pid: int, kept: bool = True) -> None:
    """Spare child `pid` from every attempt's sweep (`kept`), or no longer."""
    if kept:
        _KEPT.add(pid)
    else:
        _KEPT.discard(pid)


def become_subreaper() -> bool:
    """Adopt this supervisor's orphaned descendants (see the module docstring); whether the OS allowed it."""
    return set_child_subreaper()


@dataclass(frozen=True)
class Leftover:
    """A process of this run directory whose supervisor is gone."""

    pid: int
    start_ticks: int | None
    attempt: str
    """Its `ETTR_ATTEMPT` (as recorded; a string, it is the process's own environment)."""


def leftovers(run_dir: str | os.PathLike[str]) -> list[Leftover]:
    """Processes on this host started for `run_dir` by a supervisor that no longer runs (it was killed and
    the processes escaped its parent-death signal)."""
    found = []
    mine = set(ancestors(os.getpid()))
    for pid, ticks, env in processes_with_env({RUN_DIR_ENV: str(Path(run_dir))}):
        supervisor_pid = whole_number(env.get(SUPERVISOR_PID_ENV, ""))
        if supervisor_pid is None or pid in mine:
            continue  # not started by a supervisor (a shell that exported ETTR_RUN_DIR), or our own caller
        if supervisor_pid == os.getpid() or pid_alive(supervisor_pid, None):
            continue  # ours, or a live supervisor's (it keeps its own books)
        found.append(Leftover(pid, ticks, env.get(ATTEMPT_ENV, "?")))
    return found


def kill_all(targets: Iterable[tuple[int, int | None]], *, wait_s: float = KILL_WAIT_S) -> list[int]:
    """SIGKILL each (pid, start ticks) that is still that process; the pids still alive after `wait_s`."""
    targets = [(pid, ticks) for pid, ticks in targets if pid > 0 and pid != os.getpid()]
    for pid, ticks in targets:
        if ticks is not None and start_ticks(pid) != ticks:
            continue  # gone; the pid may be someone else's now
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while True:
        reap(pid for pid, _ in targets)
        alive = [pid for pid, ticks in targets if running(pid, ticks)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


def reap(pids: Iterable[int]) -> None:
    """Collect the exit status of those of `pids` that are this process's exited children (adopted orphans:
    no `subprocess.Popen` waits for them)."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


class Sweep(Protocol):
    """The attempt's processes outside its own tree (`AttemptSweep`; a fake in tests)."""

    def spare(self, pids: Iterable[int]) -> None: ...

    def alive(self, exclude: Collection[int] = ()) -> list[int]: ...

    def signal(self, sig: int, exclude: Collection[int] = ()) -> list[int]: ...

    def reap_adopted(self, exclude: int | None = None) -> None: ...

    def run(self, exclude: int | None = None) -> list[int]: ...


class AttemptSweep:
    """The end-of-attempt sweep of one attempt: what carries its marker, and the orphans adopted meanwhile.

    Create it before the attempt starts (it notes the supervisor's children then, so that only children
    adopted during the attempt count as the attempt's)."""

    def __init__(self, run_dir: str | os.PathLike[str], attempt: int) -> None:
        self._marker = {
            RUN_DIR_ENV: str(Path(run_dir)),
            ATTEMPT_ENV: str(attempt),
            SUPERVISOR_PID_ENV: str(os.getpid()),
        }
        self._children_before = set(children(os.getpid()))

    def spare(self, pids: Iterable[int]) -> None:
        """Children started during the attempt that are not the attempt's (warm standbys of the next one)."""
        self._children_before.update(pids)

    def _spared(self) -> set[int]:
        return self._children_before | _KEPT

    def targets(self, exclude: int | None = None) -> list[tuple[int, int | None]]:
        """(pid, start ticks) of the attempt's processes still present (`exclude`: the attempt's own pid,
        which its Popen reaps)."""
        found = {pid: ticks for pid, ticks, _ in processes_with_env(self._marker)}
        for pid in children(os.getpid()):
            if pid not in self._spared() and pid != exclude:
                found.setdefault(pid, start_ticks(pid))
        found.pop(exclude or -1, None)
        return sorted(found.items())

    def alive(self, exclude: Collection[int] = ()) -> list[int]:
        """The attempt's processes still running (not zombies), but `exclude`."""
        return [pid for pid, ticks in self.targets() if pid not in exclude and running(pid, ticks)]

    def signal(self, sig: int, exclude: Collection[int] = ()) -> list[int]:
        """Send `sig` to the attempt's processes still running but `exclude` (those reached already): orphans
        adopted by the supervisor, processes that carry the marker out of the attempt's tree. The pids
        it was sent to."""
        sent = []
        for pid in self.alive(exclude):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
                sent.append(pid)
        return sent

    def reap_adopted(self, exclude: int | None = None) -> None:
        """Reap orphans adopted during the attempt that have exited already (no zombies pile up)."""
        reap(
            pid
            for pid in children(os.getpid())
            if pid not in self._spared() and pid != exclude and not running(pid, None)
        )

    def run(self, exclude: int | None = None) -> list[int]:
        """Kill every process of the attempt still running (adopted orphans that exited are only reaped); the
        pids it killed."""
        self.reap_adopted(exclude)
        targets = [(pid, ticks) for pid, ticks in self.targets(exclude) if running(pid, ticks)]
        if targets:
            alive = kill_all(targets)
            if alive:
                logger.warning("ettr: processes %s of the attempt survived SIGKILL", alive)
        return [pid for pid, _ in targets]
