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

`StandbyGroup` (`ettr.supervisor.standby_group`) is one `Standby` per local rank. `WorkerGroupKind` (an
`ettr.supervisor.attempt.AttemptKind`) starts each attempt's `WorkerGroup` of the torchrun command's workers
(`ettr.supervisor.agent.WorkerSpec`) in the `StandbyGroup` it prepared while the attempt before trained.
"""

from __future__ import annotations

import signal
import time
from dataclasses import replace
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ettr.run_env import (
    ATTEMPT_ENV,
    ATTEMPT_STARTED_ENV,
    exited_path,
    failed_exit_path,
    has_trained,
    trained_modules,
)
from ettr.supervisor import agent, gone, inplace, spares, standby, warm_memo
from ettr.supervisor.inplace import InPlace, InPlaceCheck
from ettr.supervisor.launch import free_port
from ettr.supervisor.process import AttemptProcess
from ettr.supervisor.relaunch import Relaunch, WarmUpNotice
from ettr.supervisor.spares import Spares
from ettr.supervisor.standby import Standby, no_standby_reason
from ettr.supervisor.standby_group import StandbyGroup, start_zygote, with_zygote
from ettr.supervisor.watch_events import Continued, Exited, Exiting
from ettr.supervisor.zygote import Zygote
from ettr.untrusted import make_dirs_below

if TYPE_CHECKING:
    from ettr.supervisor.attempt import Attempt, AttemptEvent, AttemptPlan

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


class WorkerGroupKind:
    """The attempts of a single-node static torchrun command, with ettr as its agent (an `AttemptKind`).

    Args:
        spec: the workers (`ettr.supervisor.agent.parse`).
        run_dir: where the workers write their error files and exit markers.
        max_restarts: the job's restarts (TORCHELASTIC_MAX_RESTARTS).
        teardown_grace_s: after SIGTERM to the other workers of a failed one, how long before SIGKILL.
    """

    def __init__(
        self, spec: agent.WorkerSpec, *, run_dir: Path, max_restarts: int, teardown_grace_s: float
    ) -> None:
        self.spec, self._run_dir, self._max_restarts = spec, run_dir, max_restarts
        self._teardown_grace_s = teardown_grace_s
        self._standbys: StandbyGroup | None = None
        self._workers: tuple[list[list[str]], list[dict[str, str]]] = ([], [])  # the last attempt's, per rank
        self._port = 0
        self._inplace_env: dict[str, str] | None = None  # the workers' in-place variables (None: off)
        self._inplace_tried = False  # made at the first start: a kind that starts nothing leaves nothing
        self._zygote: Zygote | None = None  # the node's warm process source (`ettr.supervisor.zygote`)
        self._attempt = 0  # the last attempt started
        self._spares = Spares(run_dir)  # per local rank, for the next in-place recovery (`ettr.supervisor.spares`)
        self._running: tuple[WorkerGroup, AttemptPlan] | None = None  # the group and attempt that run now

    def _env(self, plan: AttemptPlan, rank: int, port: int, *, make_dirs: bool = True) -> dict[str, str]:
        error_file = agent.error_file(self._run_dir, plan.attempt, rank)
        if make_dirs:
            make_dirs_below(self._run_dir, error_file.parent)  # never through a symlinked agent/
        env = agent.worker_env(
            self.spec,
            plan.launch.env,
            local_rank=rank,
            port=port,
            restart_count=plan.restarts_done,
            max_restarts=self._max_restarts,
            error_file=error_file,
        )
        if self._inplace_env is not None:
            env.update(self._inplace_env)
        return env

    def start(self, plan: AttemptPlan) -> WorkerGroup:
        """The attempt's workers, forked from the zygote (made at the first attempt) or in the warm standbys
        where they fit. Raises OSError."""
        self._spares.end_all()  # a process restart: the spares were for an in-place recovery that did not come
        first = not self._inplace_tried
        if first:
            self._inplace_tried = True
            if inplace.enabled():
                try:
                    self._inplace_env = inplace.store_env(self._run_dir)
                except OSError:
                    self._inplace_env = None
        self._port = port = plan.port or free_port()
        argvs = [list(self.spec.argv) for _ in range(self.spec.nproc)]
        envs = [self._env(plan, rank, port) for rank in range(self.spec.nproc)]
        self._workers, self._attempt = (argvs, envs), plan.attempt
        if first:
            self._zygote = start_zygote(argvs, envs, run_dir=self._run_dir, attempt=plan.attempt)
        ready, self._standbys = with_zygote(self._standbys, self._zygote), None
        group = WorkerGroup.start(
            argvs,
            envs,
            standbys=ready,
            teardown_grace_s=self._teardown_grace_s,
            run_dir=self._run_dir,
            attempt=plan.attempt,
        )
        if self._inplace_env is not None:
            group.inplace = InPlaceCheck(self._run_dir, plan.attempt)
        group.spares, self._running = self._spares, (group, plan)
        return group

    def continue_in_place(self, running: Attempt, plan: AttemptPlan) -> WorkerGroup:
        """Attempt `plan.attempt` goes on in `running`'s workers after a failure they survived: each dead
        worker is replaced (from its warm standby where it fits), then the survivors are told to join the
        new attempt (`ettr.supervisor.inplace.announce`). Raises OSError (no replacement could start)."""
        assert isinstance(running, WorkerGroup) and running.continued is not None
        dead = running.continued.dead
        replacements: dict[int, AttemptProcess] = {}
        paths: list[Relaunch] = []
        waiting: list[tuple[str, Standby]] = []
        (argvs, envs), self._standbys = self._workers, with_zygote(self._standbys, self._zygote)
        for rank in dead:
            envs[rank] = env = self._env(plan, rank, self._port)
            spare, spare_why = self._spares.take(rank, plan.attempt, env)
            if spare is not None:
                replacements[rank], paths = spare, [*paths, Relaunch(path="spare", why=spare_why)]
                continue
            if self._standbys is not None:
                process, how, promoted = self._standbys.take_rank(rank, argvs[rank], env)
                waiting += [(f"rank {rank}", promoted)] if promoted is not None else []
            else:
                process = AttemptProcess(argvs[rank], env)
                how = Relaunch(path="cold", why=no_standby_reason(None, env))
            if spare_why != "no spare":
                how = Relaunch(path=how.path, why=f"{how.why}; not the spare: {spare_why}")
            replacements[rank], paths = process, [*paths, how]
        if running.notice is not None:  # an earlier attempt's: its standbys run or are gone
            running.notice.stop()
        running.notice = WarmUpNotice(plan.attempt, waiting)  # survivors wait on a promoted one's warm-up
        running.notice.start()  # (says nothing without one)
        running.continue_as(plan.attempt, replacements, self._run_dir)
        warm = {rank: how.path != "cold" for rank, how in zip(replacements, paths, strict=True)}
        running.warm = [warm.get(rank, False) for rank in range(len(running.procs))]  # not the survivors'
        inplace.announce(self._run_dir, plan.attempt, sorted(replacements))
        running.relaunch = Relaunch.in_place(sorted(replacements), paths)
        self._spares.end_all()  # the others were for this attempt too: new ones come once it has trained
        self._running = (running, plan)
        return running

    def prepare_next(self, *, warm_modules: Sequence[str] = ()) -> list[int]:
        served = with_zygote(self._standbys, self._zygote)
        if served is not None and served.zygote is not None:  # a fork away: no standby warms up meanwhile
            self._standbys = served
            return self._fork_spares(served.zygote)
        argvs, envs, per_attempt = *self._workers, agent.PER_ATTEMPT_NAMES
        if argvs and self._standbys is not None and standby.enabled():
            return self._standbys.fill(argvs, envs, per_attempt=per_attempt, warm_modules=warm_modules)
        if not argvs or self._standbys is not None or not standby.enabled():
            return []
        self._standbys = StandbyGroup.start(argvs, envs, per_attempt=per_attempt, warm_modules=warm_modules)
        return [] if self._standbys is None else self._standbys.pids

    def _fork_spares(self, zygote: Zygote) -> list[int]:
        """A spare per local rank for the attempt after the one running, where its workers all joined it in
        place (they run `ettr.resilient`) and spares are on (`ettr.supervisor.spares`). Their pids."""
        if self._running is None or self._inplace_env is None or not spares.enabled():
            return []
        group, plan = self._running
        if group.inplace is None or not has_trained(self._run_dir, plan.attempt):
            return []
        if not all(group.inplace.joined(pid) for pid in group.pids):
            return []  # a worker outside `ettr.resilient`: no in-place recovery to be ready for
        nxt = replace(plan, attempt=plan.attempt + 1, restarts_done=plan.restarts_done + 1)
        envs = []
        for rank in range(self.spec.nproc):
            env = self._env(nxt, rank, self._port, make_dirs=False)  # the next attempt's, as it will be
            env[ATTEMPT_ENV] = str(nxt.attempt)
            env.pop(ATTEMPT_STARTED_ENV, None)
            envs.append(env)
        return self._spares.fork(zygote, nxt.attempt, self._workers[0], envs)

    def discard(self) -> None:
        self._spares.end_all()
        # What the last attempt had imported by its first step, for this script's next job on this node.
        warm_memo.remember(*self._workers, trained_modules(self._run_dir, self._attempt))
        ready, self._standbys = self._standbys, None
        for made in (ready, self._zygote):
            if made is not None:
                made.discard()
