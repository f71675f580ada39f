"""The workers of one attempt under ettr's own torchrun agent (`ettr.supervisor.agent`), and their standbys.

`WorkerGroup` stands where an `AttemptProcess` stands in the supervisor loop (same methods): N worker
processes, each an `AttemptProcess` of its own (own process group, parent-death SIGKILL, stderr tee), taken
from warm standbys where they fit. Like torchrun's agent it ends the group when a worker fails: the first
worker to exit non-zero is the failure (its exit status and stderr are the attempt's); after a short flush
window (the other ranks' recorders write their last events) the others get SIGTERM, then SIGKILL after
`teardown_grace_s`. A worker that ended on an uncaught exception marks it once its Python-level exit is done
(`ettr.run_env.failed_exit_path`, by the bootstrap's last atexit handler): the group counts the failure from
then and SIGKILLs its interpreter teardown (seconds under load); its status then reads 1. A forwarded signal
(preemption) goes to every worker and the group then sends no SIGTERM of its own (a rank saving on SIGTERM is
not interrupted by a second one). Exit status: 0 when every worker exited 0, else the failed worker's.

`StandbyGroup` (`ettr.supervisor.standby_group`) is one `Standby` per local rank. `WorkerGroupKind`
(`ettr.supervisor.worker_kind`, an `ettr.supervisor.attempt.AttemptKind`) starts each attempt's `WorkerGroup`
of the torchrun command's workers (`ettr.supervisor.agent.WorkerSpec`): forked from the agent's zygote, or in
the `StandbyGroup` it prepared while the attempt before trained.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ettr.run_env import exited_path, failed_exit_path
from ettr.supervisor import gone
from ettr.supervisor.inplace import InPlace, InPlaceCheck
from ettr.supervisor.process import AttemptProcess
from ettr.supervisor.relaunch import Relaunch, WarmUpNotice
from ettr.supervisor.standby import no_standby_reason
from ettr.supervisor.watch_events import Continued, Exited, Exiting

if TYPE_CHECKING:
    from ettr.supervisor.attempt import AttemptEvent
    from ettr.supervisor.spares import Spares
    from ettr.supervisor.standby_group import StandbyGroup

_SPARES_LOOK_EVERY_S = 1.0
"""How often a running group looks whether a spare died (`ettr.supervisor.spares`)."""
FLUSH_WINDOW_S = 0.6
"""After a worker failed, how long the others may still run: a Recorder writes its events within 0.5 s."""


class WorkerGroup:
    """The running workers of one attempt (see the module docstring)."""

    def __init__(
        self,
        procs: Sequence[AttemptProcess],
        *,
        teardown_grace_s: float = 5.0,
        flush_s: float = FLUSH_WINDOW_S,
        warm: Sequence[bool] = (),
        exit_markers: Sequence[Path] = (),
        exited_markers: Sequence[Path] = (),
    ) -> None:
        if not procs:
            raise ValueError("WorkerGroup needs at least one worker")
        self.procs = list(procs)
        self.warm = list(warm) or [False] * len(self.procs)  # per rank: started warm by this attempt
        self.pid = self.procs[0].pid
        self._teardown_grace_s = teardown_grace_s
        self._flush_s = flush_s
        self.failed_rank: int | None = None
        """The local rank whose non-zero exit ended the group (None: none failed)."""
        self.failed_at: float | None = None
        """When the group saw that worker's exit."""
        self._signalled = False
        self._stop_at = float("inf")
        self._kill_at = float("inf")
        self._returncode: int | None = None
        self._markers = list(exit_markers)
        self._exited = list(exited_markers)
        self._cut_short: int | None = None  # the rank stopped after its failed exit was marked
        self.relaunch = Relaunch(path="cold", why="started as it is")
        """How the workers were started (`StandbyGroup.take`)."""
        self.notice: WarmUpNotice | None = None
        """Says on the console when the workers wait for promoted standbys (stopped by `finish`)."""
        self.inplace: InPlaceCheck | None = None
        """Set for a job whose workers may be restarted in place (`ettr.supervisor.inplace`)."""
        self.continued: InPlace | None = None
        """A failure the attempt goes on from in place (its other workers keep running)."""
        self._continued_told = False
        self._gone: list[AttemptProcess] = []  # replaced workers, whose stderr is still collected
        self.spares: Spares | None = None
        """The agent's spares while this group runs: one that died meanwhile is forgotten (`poll`)."""
        self._spares_looked_at = 0.0

    def exiting(self) -> bool:
        """Whether every worker still running has done its Python-level exit (only the interpreter's
        teardown is left: seconds under load, and no heartbeat; not a hang)."""
        if not self._exited:
            return False
        running = [r for r, p in enumerate(self.procs) if p.poll() is None]
        return bool(running) and all(self._exited[r].exists() or self._markers[r].exists() for r in running)

    def _marked_failed(self) -> int | None:
        """A rank whose failed exit is marked (`failed_exit_path`), or stranded in place, while it runs."""
        for rank, marker in enumerate(self._markers):
            if self.procs[rank].poll() is None and marker.exists():
                return rank
        return self.inplace.stranded(self.pids, [p.poll() for p in self.procs]) if self.inplace else None

    @classmethod
    def start(
        cls,
        argvs: Sequence[Sequence[str]],
        envs: Sequence[dict[str, str]],
        *,
        standbys: StandbyGroup | None = None,
        teardown_grace_s: float = 5.0,
        run_dir: Path | None = None,
        attempt: int = 0,
    ) -> WorkerGroup:
        """Start worker r as `argvs[r]` under `envs[r]`, in its standby where it fits (`run_dir`, `attempt`:
        where the workers mark a failed exit). Raises OSError (the workers started so far are killed)."""
        if standbys is not None:
            ready, relaunch, notice = standbys.take(argvs, envs, attempt=attempt)
        else:
            ready, notice = [None] * len(argvs), None
            relaunch = Relaunch(path="cold", why=no_standby_reason(None, envs[0] if envs else {}))
        procs: list[AttemptProcess] = []
        try:
            for argv, env, warm in zip(argvs, envs, ready, strict=True):
                procs.append(warm or AttemptProcess(argv, env))
        except OSError:
            if notice is not None:
                notice.stop()
            for p in [*procs, *(w for w in ready if w is not None and w not in procs)]:
                p.signal_tree(signal.SIGKILL)
            raise
        group = cls(
            procs,
            teardown_grace_s=teardown_grace_s,
            warm=[w is not None for w in ready],
            exit_markers=[failed_exit_path(run_dir, attempt, p.pid) for p in procs] if run_dir else [],
            exited_markers=[exited_path(run_dir, attempt, p.pid) for p in procs] if run_dir else [],
        )
        group.relaunch, group.notice = relaunch, notice
        return group

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def start_data(self) -> dict[str, Any]:
        return {"agent": "ettr", "worker_pids": self.pids}

    def describe(self) -> str:
        num_warm = sum(self.warm)
        where = {"forked": "forked from the zygote", "spare": "from a parked spare"}.get(
            self.relaunch.path, "in warm standbys"
        )
        warm = f", {num_warm} {where}" if num_warm else ""
        return f"{len(self.procs)} worker(s), pids {', '.join(map(str, self.pids))}{warm}"

    def events(self) -> list[AttemptEvent]:
        """`Exited` (at the failed worker's exit) once every worker is gone, `Continued` once when a failure
        is recovered in place, else `Exiting` while only their interpreters' teardown is left (drives the
        teardown after a failure: see `poll`)."""
        returncode = self.poll()
        if returncode is not None:
            return [Exited(returncode, at=self.failed_at)]
        if self.continued is not None and not self._continued_told:
            self._continued_told = True
            return [Continued(self.continued.returncode, at=self.failed_at, survived=self.continued.survived)]
        return [Exiting()] if self.exiting() else []

    def poll(self) -> int | None:
        """The group's exit status once every worker has exited, else None; drives the teardown after a
        failure (call it often: the supervisor loop does, waking on each exit)."""
        if self._returncode is not None:
            return self._returncode
        codes = [p.poll() for p in self.procs]
        now = time.time()
        if self.spares is not None and now - self._spares_looked_at >= _SPARES_LOOK_EVERY_S:
            self._spares_looked_at = now
            self.spares.forget_dead()  # a spare that died while it waited is no failure: reaped, forgotten
        if self.continued is not None:
            return None  # the runner books it and replaces the dead (`continue_as`); nothing is torn down
        if self.failed_rank is None:
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            marked = None if failed or self._signalled else self._marked_failed()
            if marked is not None:
                # Only the interpreter's teardown is left (seconds under load): end it, status 1 as Python's.
                self.procs[marked].signal_tree(signal.SIGKILL)
                self._cut_short, failed = marked, [marked]
            if self.inplace is not None and not self._signalled:
                found = self.inplace.check(self.pids, codes, failed)
                if found is not None:
                    self.continued, self.failed_at = found, now
                    return None
            if failed:  # of ranks seen ended together, one a signal killed is the cause of the others' errors
                self.failed_rank, self.failed_at = min(failed, key=lambda r: (codes[r] or 0) >= 0), now
                self._stop_at = now + self._flush_s
        if self.failed_rank is not None and not self._signalled and now >= self._stop_at:
            self._signal_others(signal.SIGTERM)
            self._stop_at, self._kill_at = float("inf"), now + self._teardown_grace_s
        if now >= self._kill_at:
            self._signal_others(signal.SIGKILL)
            self._kill_at = float("inf")
        if any(c is None for c in codes):
            return None
        if self.spares is not None:  # no worker left to replace: they die while the attempt's end is booked
            self.spares.end_all(wait=False)
        if self.failed_rank is None:
            self._returncode = 0
        elif self.failed_rank == self._cut_short:
            self._returncode = 1  # what the interpreter exits with after an uncaught exception
        else:
            self._returncode = codes[self.failed_rank]
        return self._returncode

    def _signal_others(self, sig: int) -> None:
        for r, p in enumerate(self.procs):
            if r != self.failed_rank:
                p.signal_tree(sig)

    def remember_tree(self) -> None:
        for p in self.procs:
            p.remember_tree()

    def known_tree(self) -> dict[int, int | None]:
        tree: dict[int, int | None] = {}
        for p in self.procs:
            tree.update(p.known_tree())
        return tree

    def signal_tree(self, sig: int, *, include_command: bool = True) -> list[int]:
        """`sig` to every worker (unless not `include_command`) and their descendants; from then on the
        group sends no SIGTERM of its own. The pids it was sent to."""
        if sig != signal.SIGKILL:
            self._signalled = True
        return [pid for p in self.procs for pid in p.signal_tree(sig, include_command=include_command)]

    def alive(self) -> list[int]:
        """The workers and their descendants still running."""
        return [pid for p in self.procs for pid in p.alive()]

    def failed_pids(self) -> list[list[int]]:
        """The worker whose failure ended the group (or is recovered in place)."""
        rank = self.continued.failed_rank if self.continued is not None else self.failed_rank
        return [] if rank is None else [[self.procs[rank].pid]]

    def seen_gone(self) -> list[tuple[float, list[int]]]:  # the dead worker, when the group saw it
        return gone.worker_seen_gone(self.failed_at, self.failed_pids(), self._returncode, self.continued)

    def ranks(self) -> dict[int, int]:
        """Each worker's rank (a survivor of an in-place recovery recorded no PROCESS_START in this attempt)."""
        return {p.pid: rank for rank, p in enumerate(self.procs)}

    def continue_as(self, attempt: int, replacements: dict[int, AttemptProcess], run_dir: Path) -> None:
        """Go on as attempt `attempt` after an in-place recovery: replacements take the dead workers' ranks."""
        for rank, process in replacements.items():
            old = self.procs[rank]
            old.kill_leftovers()
            self._gone.append(old)
            self.procs[rank] = process
        self.pid = self.procs[0].pid
        self.continued, self._continued_told, self.failed_at = None, False, None
        self._markers = [failed_exit_path(run_dir, attempt, p.pid) for p in self.procs]
        self._exited = [exited_path(run_dir, attempt, p.pid) for p in self.procs]
        self.inplace = InPlaceCheck(run_dir, attempt)

    def kill_leftovers(self) -> None:
        for p in self.procs:
            p.kill_leftovers()

    def wait(self, timeout_s: float | None = None) -> int | None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
        return code

    def finish(self, timeout_s: float = 2.0) -> None:
        if self.notice is not None:
            self.notice.stop()
        for p in [*self._gone, *self.procs]:
            p.finish(timeout_s)

    def stderr_tail(self, num_lines: int = 20) -> list[str]:
        """The failed worker's last stderr lines (rank 0's when none failed)."""
        rank = self.continued.failed_rank if self.continued is not None else self.failed_rank
        return self.procs[rank or 0].stderr_tail(num_lines)
