"""`WorkerGroupKind`: how the attempts of a single-node static torchrun command start under ettr's own agent
(an `ettr.supervisor.attempt.AttemptKind`): each attempt's `WorkerGroup` (`ettr.supervisor.workers`) forked from
the node's zygote (`ettr.supervisor.zygote`) or in warm standbys (`ettr.supervisor.standby_group`), an in-place
recovery's replacements (`continue_in_place`: a rank's spare first, `ettr.supervisor.spares`), and what it
prepares while an attempt trains (`prepare_next`: the spares, or the next attempt's standbys).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ettr.run_env import ATTEMPT_ENV, ATTEMPT_STARTED_ENV, has_trained, trained_modules
from ettr.supervisor import agent, inplace, spares, standby, warm_memo
from ettr.supervisor.inplace import InPlaceCheck
from ettr.supervisor.launch import free_port
from ettr.supervisor.process import AttemptProcess
from ettr.supervisor.relaunch import Relaunch, WarmUpNotice
from ettr.supervisor.spares import Spares
from ettr.supervisor.standby import Standby, no_standby_reason
from ettr.supervisor.standby_group import StandbyGroup, start_zygote, with_zygote
from ettr.supervisor.workers import WorkerGroup
from ettr.supervisor.zygote import Zygote

if TYPE_CHECKING:
    from ettr.supervisor.attempt import Attempt, AttemptPlan


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
        self._spares = Spares(
            run_dir
        )  # per local rank, for the next in-place recovery (`ettr.supervisor.spares`)
        self._running: tuple[WorkerGroup, AttemptPlan] | None = None  # the group and attempt that run now

    def _env(self, plan: AttemptPlan, rank: int, port: int, *, make_dirs: bool = True) -> dict[str, str]:
        if make_dirs:  # its folders made (none through a symlink), nothing planted at its name
            error_file = agent.fresh_error_file(self._run_dir, plan.attempt, rank)
        else:
            error_file = agent.error_file(self._run_dir, plan.attempt, rank)
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
        self._spares.end_all(wait=False)  # the others were for this attempt too: new ones once it trained
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
