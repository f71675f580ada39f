"""One attempt of a job, whatever runs it: the `Attempt` Protocol, how a job's attempts start (`AttemptKind`),
and the plain kind: the command as one process tree.

    kind = CommandKind()                        # or workers.WorkerGroupKind(spec, ...): ettr as torchrun's agent
    running = kind.start(plan)                  # raises OSError: the attempt could not start
    while ...:                                  # the supervisor's driver (`runner.py`)
        for event in running.events(): ...      # Exited / Exiting / RankFailed, fed to the AttemptWatch
        running.signal_tree(sig)                # what the watch decided (and the job's other processes)
    running.kill_leftovers(); running.finish(); running.stderr_tail()
    kind.prepare_next(warm_modules=...)         # the next attempt's warm standby, while this one trains

A new way to run an attempt (an in-place restart that keeps the processes and reloads their state) is one
class implementing `Attempt` and one implementing `AttemptKind`; the driver, the watch, the books and the
restart policy stay as they are. The kind owns its warm standbys: it starts them (`prepare_next`) and takes
them (`start`), so nothing outside a kind knows what a standby of that kind is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ettr.run_env import exited_path
from ettr.supervisor import standby
from ettr.supervisor.launch import AttemptLaunch
from ettr.supervisor.process import AttemptProcess
from ettr.supervisor.relaunch import Relaunch
from ettr.supervisor.restart import PeerFailureWatch
from ettr.supervisor.watch_events import Continued, Exited, Exiting, RankFailed

AttemptEvent = Exited | Exiting | RankFailed | Continued
"""What an attempt itself tells the watch (`ettr.supervisor.watch`)."""


@dataclass(frozen=True, kw_only=True)
class AttemptPlan:
    """What one attempt is to run."""

    attempt: int
    """Its index in the job."""
    launch: AttemptLaunch
    """The command line and environment (`ettr.supervisor.launch.attempt_launch`)."""
    port: int | None = None
    """The rendezvous port the nodes of a multi-node job agreed on (None: the kind picks one)."""
    restarts_done: int = 0
    """Restarts of the job before this attempt (torchrun's TORCHELASTIC_RESTART_COUNT)."""
    failure_recorded: Callable[[], bool] = lambda: False
    """Whether a training process of this attempt recorded a FAILURE (a read of the books)."""


class Attempt(Protocol):
    """A running attempt. Its methods never raise for a process that is already gone."""

    pid: int
    """The process ATTEMPT_START names (the command; ettr's agent: the first worker)."""
    relaunch: Relaunch
    """How it was started (a warm standby, a standby promoted from its warm-up, cold) and why: the
    attempt's `relaunch` MARK."""

    @property
    def pids(self) -> Sequence[int]:
        """The processes the attempt started itself: each one's exit wakes the supervisor; the end-of-attempt
        sweep leaves them to the attempt, which reaps them."""
        ...

    def start_data(self) -> Mapping[str, Any]:
        """What ATTEMPT_START records about this kind beside pid and command."""
        ...

    def describe(self) -> str:
        """What was started, for people (`pid 4242, in a warm standby`)."""
        ...

    def events(self) -> list[AttemptEvent]:
        """What happened since the last call (called every poll; it drives the attempt's own teardown, such as
        ettr's agent stopping the other workers after a failed one): `Exited` once it is over, else
        `Exiting` while only interpreter teardown is left, `RankFailed` when a rank died with a FAILURE on
        record while its launcher runs, `Continued` when a failure is recovered in place (its processes go
        on into the next attempt: `AttemptKind.continue_in_place`)."""
        ...

    def signal_tree(self, sig: int, *, include_command: bool = True) -> list[int]:
        """`sig` to every process of the attempt (unless not `include_command`: to all but the launcher),
        those whose parent died included; the pids it was sent to."""
        ...

    def alive(self) -> list[int]:
        """Its processes still running (not zombies), those whose parent died included."""
        ...

    def failed_pids(self) -> list[list[int]]:
        """Its processes seen to end before it did, one list per look that saw them gone, in the order of
        the looks (ettr's agent: the failed worker alone): the failed rank is in the first look that saw a
        rank gone (`classify`)."""
        ...

    def seen_gone(self) -> list[tuple[float, list[int]]]:
        """Each look of `failed_pids`: its time and the pids it saw gone less those that marked a clean exit
        (`run_env.exited_path`); empty where not kept (ettr's agent sees its worker's exit itself)."""
        ...

    def ranks(self) -> dict[int, int]:
        """The rank of each of its processes that its launcher knows (pid -> rank; ettr's agent: its
        workers, one of which may have gone on from an earlier attempt (in place) and so recorded no
        PROCESS_START in this one); empty where the ranks are known only from the processes' own events."""
        ...

    def remember_tree(self) -> None:
        """Note the processes it runs now, so they are reached even after their parent died (every second)."""
        ...

    def kill_leftovers(self) -> None:
        """After the end: SIGKILL whatever of it is still running."""
        ...

    def finish(self, timeout_s: float = 2.0) -> None:
        """After the end: collect the rest of its stderr."""
        ...

    def stderr_tail(self, num_lines: int = 20) -> list[str]:
        """The last lines of the stderr that tells why it ended."""
        ...


class AttemptKind(Protocol):
    """How the attempts of a job start, with the warm standbys that kind can have."""

    def start(self, plan: AttemptPlan) -> Attempt:
        """Start `plan` (in the standby `prepare_next` made, where it fits). Raises OSError."""
        ...

    def prepare_next(self, *, warm_modules: Sequence[str] = ()) -> Sequence[int]:
        """Start the next attempt's standby ahead, like the attempt started last (`warm_modules`: imported
        ahead beside torch); its pids (the sweep spares them), empty when none started."""
        ...

    def continue_in_place(self, running: Attempt, plan: AttemptPlan) -> Attempt:
        """Go on with `plan` in `running`'s processes after it said `Continued` (a restart in place: its
        dead processes replaced, the others told to join). Raises OSError. Only a kind whose attempts say
        `Continued` is asked."""
        ...

    def discard(self) -> None:
        """Discard what `prepare_next` made (the job ends); never raises."""
        ...


class CommandAttempt:
    """The command of one attempt as one process tree (`ettr.supervisor.process.AttemptProcess`).

    A rank that dies under a launcher that outlives it (the real torchrun) is seen once a process of the
    tree has exited and a training process recorded a FAILURE (`PeerFailureWatch`).
    """

    def __init__(
        self,
        process: AttemptProcess,
        *,
        failure_recorded: Callable[[], bool],
        relaunch: Relaunch | None = None,
        exited_cleanly: Callable[[int], bool] = lambda pid: False,
    ) -> None:
        self.process = process
        self.pid = process.pid
        self.relaunch = relaunch or Relaunch(path="cold", why="started cold")
        self._ranks = PeerFailureWatch(failure_recorded, exited_cleanly=exited_cleanly)

    @property
    def pids(self) -> list[int]:
        return [self.pid]

    def start_data(self) -> dict[str, Any]:
        return {}

    def describe(self) -> str:
        where = {"warm": ", in a warm standby", "promoted": ", in a standby promoted from its warm-up"}
        return f"pid {self.pid}" + where.get(self.relaunch.path, "")

    def events(self) -> list[AttemptEvent]:
        returncode = self.process.poll()
        if returncode is not None:
            return [Exited(returncode)]
        return [RankFailed()] if self._ranks.check(self.process.known_tree()) else []

    def signal_tree(self, sig: int, *, include_command: bool = True) -> list[int]:
        return self.process.signal_tree(sig, include_command=include_command)

    def alive(self) -> list[int]:
        return self.process.alive()

    def failed_pids(self) -> list[list[int]]:
        return [list(look) for look in self._ranks.died]

    def seen_gone(self) -> list[tuple[float, list[int]]]:
        return list(self._ranks.gone)

    def ranks(self) -> dict[int, int]:
        return {}

    def remember_tree(self) -> None:
        self.process.remember_tree()

    def kill_leftovers(self) -> None:
        self.process.kill_leftovers()

    def finish(self, timeout_s: float = 2.0) -> None:
        self.process.finish(timeout_s)

    def stderr_tail(self, num_lines: int = 20) -> list[str]:
        return self.process.stderr_tail(num_lines)


class CommandKind:
    """Each attempt runs the command as it is, in a warm `standby.Standby` where one fits."""

    def __init__(self, run_dir: Path | None = None) -> None:
        self._run_dir = run_dir  # where its ranks mark a clean exit (`run_env.exited_path`)
        self._standby: standby.Standby | None = None
        self._last: AttemptLaunch | None = None

    def start(self, plan: AttemptPlan) -> CommandAttempt:
        ready, self._standby = self._standby, None
        launch = plan.launch
        self._last = launch
        process, how = standby.relaunch(ready, launch.argv, launch.env, attempt=plan.attempt)
        run_dir, attempt = self._run_dir, plan.attempt
        clean = (lambda pid: exited_path(run_dir, attempt, pid).exists()) if run_dir else (lambda pid: False)
        return CommandAttempt(
            process, failure_recorded=plan.failure_recorded, relaunch=how, exited_cleanly=clean
        )

    def prepare_next(self, *, warm_modules: Sequence[str] = ()) -> list[int]:
        if self._last is None or self._standby is not None or not standby.enabled():
            return []
        self._standby = standby.Standby.start(self._last.argv, self._last.env, warm_modules=warm_modules)
        return [] if self._standby is None else self._standby.pids

    def continue_in_place(self, running: Attempt, plan: AttemptPlan) -> Attempt:
        raise OSError("a command's attempt never goes on in place")  # it never says `Continued`

    def discard(self) -> None:
        ready, self._standby = self._standby, None
        if ready is not None:
            ready.discard()
