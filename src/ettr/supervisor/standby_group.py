"""One warm standby per local rank of ettr's torchrun agent (`ettr.supervisor.workers`): `StandbyGroup`.

Each rank's `ettr.supervisor.standby.Standby` is started with rank r's environment less the per-attempt
names; at the next attempt each rank forked from the agent's zygote (`zygote`, `ettr.supervisor.zygote`:
path `forked`) where it has one that fits, else each rank whose standby fits takes its complete environment (`take`: at once
when warm, promoted to normal priority when still warming), the others start cold at once. An in-place
recovery takes only the dead rank's (`take_rank`), and `fill` starts the missing ones again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from ettr.run_env import trained_modules
from ettr.supervisor import warm_memo
from ettr.supervisor.process import AttemptProcess
from ettr.supervisor.relaunch import Relaunch, WarmUpNotice
from ettr.supervisor.standby import Standby
from ettr.supervisor.zygote import Zygote

logger = logging.getLogger("ettr")

WARM_MODULES = ("torch.distributed", "torch.nn.parallel", "torch._dynamo")
"""Imported ahead by a worker's standby beside torch when the attempt's first-step markers name nothing
(else what they name: the packages of torch and ettr it had imported, `ettr.bootstrap.start.imported_parts`,
and its installed packages, so that a standby promoted at a failure has no more to do than a cold start,
and a warm one only the script's own start-up): what a DDP/FSDP job imports anyway
(constructing DistributedDataParallel imports torch._dynamo, seconds of a cold restart). Imports only, no
compile-store look-up (that waits for `torch.compile`)."""


class StandbyGroup:
    """One warm standby per local rank for the next attempt (see the module docstring)."""

    def __init__(self, standbys: Sequence[Standby | None], zygote: Zygote | None = None) -> None:
        self.standbys = list(standbys)
        self.zygote = zygote
        """The agent's zygote (it outlives the group: the agent discards it), tried first for each rank."""

    def _forked(self, argv: Sequence[str], env: dict[str, str]) -> tuple[AttemptProcess | None, str]:
        """Worker `argv`, `env` forked from the zygote, or None and why not ("" without a zygote)."""
        if self.zygote is None:
            return None, ""
        process, why = self.zygote.fork(argv, env)
        return process, (why if process is not None else f"zygote not used: {why}")

    @staticmethod
    def _after(relaunch: Relaunch, zygote_why: str) -> Relaunch:
        """`relaunch`, its why prefixed by why the zygote was not used (where there is one)."""
        if not zygote_why:
            return relaunch
        return Relaunch(path=relaunch.path, why=f"{zygote_why}; {relaunch.why}")

    @classmethod
    def start(
        cls,
        argvs: Sequence[Sequence[str]],
        envs: Sequence[dict[str, str]],
        *,
        per_attempt: frozenset[str],
        warm_modules: Sequence[str] = (),
    ) -> StandbyGroup | None:
        """Standbys for workers like `argvs`/`envs` (this attempt's), importing `warm_modules` ahead (what
        the attempt had imported by its first step), `WARM_MODULES` when it is not known; None when none
        could start."""
        modules = list(dict.fromkeys(warm_modules or WARM_MODULES))
        started = [
            Standby.start(a, e, per_attempt=per_attempt, warm_modules=modules)
            for a, e in zip(argvs, envs, strict=True)
        ]
        return cls(started) if any(s is not None for s in started) else None

    @property
    def pids(self) -> list[int]:
        return [pid for s in self.standbys if s is not None for pid in s.pids]

    def take(
        self, argvs: Sequence[Sequence[str]], envs: Sequence[dict[str, str]], *, attempt: int = 0
    ) -> tuple[list[AttemptProcess | None], Relaunch, WarmUpNotice | None]:
        """Per rank, the standby's process now running worker r (None: start it cold, at once), how the
        ranks were relaunched, and the console notice of promoted standbys (started; None: none). Standbys
        of ranks beyond `argvs` are discarded."""
        out: list[AttemptProcess | None] = []
        paths: list[Relaunch] = []
        waiting: list[tuple[str, Standby]] = []
        for r, argv in enumerate(argvs):
            ready = self.standbys[r] if r < len(self.standbys) else None
            forked, zygote_why = self._forked(argv, envs[r])
            if forked is not None:
                out.append(forked)
                paths.append(Relaunch(path="forked", why=zygote_why))
                if ready is not None:
                    ready.discard()
                continue
            if ready is None:
                out.append(None)
                paths.append(self._after(Relaunch(path="cold", why="no standby for this rank"), zygote_why))
                continue
            process, relaunch = ready.take(argv, envs[r])
            out.append(process)
            paths.append(self._after(relaunch, zygote_why))
            if relaunch.path == "promoted":
                waiting.append((f"rank {r}", ready))
            else:
                ready.close()
        for extra in self.standbys[len(argvs) :]:
            if extra is not None:
                extra.discard()
        self.standbys = []
        notice = WarmUpNotice(attempt, waiting) if waiting else None
        if notice is not None:
            notice.start()
        return out, Relaunch.of_ranks(paths), notice

    def take_rank(
        self, rank: int, argv: Sequence[str], env: dict[str, str]
    ) -> tuple[AttemptProcess, Relaunch, Standby | None]:
        """Rank `rank`'s replacement in an in-place recovery: its standby where it fits, else a cold start
        (raises OSError); the other ranks keep theirs. Third: the standby when it was promoted (still
        warming: the caller's `WarmUpNotice` watches it and closes it), else None."""
        forked, zygote_why = self._forked(argv, env)
        if forked is not None:
            return forked, Relaunch(path="forked", why=zygote_why), None
        ready = self.standbys[rank] if rank < len(self.standbys) else None
        if ready is not None:
            self.standbys[rank] = None
            process, relaunch = ready.take(argv, env)
            relaunch = self._after(relaunch, zygote_why)
            if process is not None and relaunch.path == "promoted":
                return process, relaunch, ready
            ready.close()
            if process is not None:
                return process, relaunch, None
        else:
            relaunch = self._after(Relaunch(path="cold", why="no standby for this rank"), zygote_why)
        return AttemptProcess(argv, env), relaunch, None

    def fill(
        self,
        argvs: Sequence[Sequence[str]],
        envs: Sequence[dict[str, str]],
        *,
        per_attempt: frozenset[str],
        warm_modules: Sequence[str] = (),
    ) -> list[int]:
        """Start the standbys of ranks that have none (taken by an in-place recovery); their pids."""
        modules = list(dict.fromkeys(warm_modules or WARM_MODULES))
        self.standbys += [None] * (len(argvs) - len(self.standbys))
        started: list[int] = []
        for r, (argv, env) in enumerate(zip(argvs, envs, strict=True)):
            if self.standbys[r] is None:
                made = Standby.start(argv, env, per_attempt=per_attempt, warm_modules=modules)
                self.standbys[r] = made
                started += [] if made is None else made.pids
        return started

    def discard(self) -> None:
        for s in self.standbys:
            if s is not None:
                s.discard()
        self.standbys = []


def start_zygote(
    argvs: Sequence[Sequence[str]], envs: Sequence[dict[str, str]], *, run_dir: Path, attempt: int
) -> Zygote | None:
    """The agent's zygote for workers like `argvs`/`envs`, warm (`Zygote.wait_warm`: this supervisor's
    first attempt, `attempt`, has its workers forked from it), importing ahead beside torch what the attempt
    before had imported by its first step (a requeued job: `trained_modules`, as its standbys would), else
    what the same script's workers had imported when it last ran on this node (a new job: `warm_memo`), else
    `WARM_MODULES`; None where there is none (why: in the debug log, and in the relaunch MARK of a zygote
    dropped later). Its warm-up is what each worker would import anyway, once instead of once per worker."""
    learned = trained_modules(run_dir, attempt - 1) if attempt > 0 else []
    if not learned:  # a new job: what the same script had imported when it last ran on this node
        learned = warm_memo.recall(argvs, envs)
    modules = list(dict.fromkeys(learned or WARM_MODULES))
    made = Zygote.start(argvs[0], envs[0], modules=modules) if argvs else "no workers"
    if isinstance(made, str):
        logger.debug("ettr: no zygote (%s)", made)
        return None
    made.wait_warm()
    return made


def with_zygote(group: StandbyGroup | None, zygote: Zygote | None) -> StandbyGroup | None:
    """`group` (a new one without standbys where None) forking from `zygote` first, where it still serves."""
    if zygote is None or not zygote.serves:
        return group
    group = group or StandbyGroup([])
    group.zygote = zygote
    return group
