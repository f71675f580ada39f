"""Spares, the agent's side: one replacement per local rank of a resilient job, forked from the node's zygote
while the attempt trains and parked before `ettr.resilient`'s first rendezvous, so that an in-place recovery
promotes a process whose script has started already (its loader workers up) instead of forking one at the
failure. The process side is `ettr.bootstrap.spare`; docs/inplace.md, "Spares", says what it costs and gains.

Once attempt A has trained and every worker has joined it in place (`ettr.supervisor.inplace`), ettr's agent
(`ettr.supervisor.workers`) forks, per local rank, a spare from its zygote with attempt A+1's environment
(`ETTR_ATTEMPT`=A+1, that rank's names, `ETTR_SPARE`: a FIFO the agent holds open for writing), nicer by
`SPARE_NICE` (not SCHED_IDLE: a recovery may wait on what it has not finished). It records nothing until
promoted. At an in-place recovery (`take`) the spare of each dead rank is promoted: its environment must equal
the attempt's but for `SPARE_LATE_NAMES` (sent with the promotion), every task of it and of its descendants
goes back to nice 0, and one JSON line on the FIFO lets it go on (relaunch path `spare`). One not parked yet is
promoted all the same: it ran the same start-up as a fresh fork would, only earlier, and now at normal
priority (the why says so). Every other spare is ended then (`end_all`: its environment is A+1's), and at a
process restart and the job's end: SIGKILL to it and its descendants (its loader workers), reaped here. A
spare that dies while parked is forgotten: it was no process of any attempt (`forget_dead`). The agent's
death ends them by their parent-death signal (their loader workers follow when they see their parent gone).
`ETTR_SPARES=0` in the supervisor's environment turns them off.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ettr.procs import close_quietly, nicer_scheduling, normal_priority
from ettr.run_env import (
    SPARE_ENV,
    SPARE_LATE_NAMES,
    SPARES_ENV,
    spare_fifo_path,
    spare_parked_path,
    spares_dir,
)
from ettr.supervisor import containment
from ettr.supervisor.process import AttemptProcess
from ettr.supervisor.zygote import Zygote
from ettr.untrusted import make_dirs_below, read_json_file

logger = logging.getLogger("ettr")

SPARE_NICE = 10
"""How much nicer than training a spare runs the script's start-up (it overlaps the attempt's training)."""


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ettr's agent forks spares (`ETTR_SPARES=0` in the supervisor's environment: it does not)."""
    return (os.environ if environ is None else environ).get(SPARES_ENV, "").strip() != "0"


@dataclass(kw_only=True)
class Spare:
    """One parked (or parking) spare of local rank `rank` for attempt `attempt`."""

    rank: int
    attempt: int
    process: AttemptProcess
    env: dict[str, str]
    """The environment it was forked with (without the zygote's stderr name)."""
    fifo: Path
    write_fd: int
    """The agent's end of the FIFO (opened read-write: never blocks; closed, it ends a spare still waiting)."""
    forked_at: float = field(default_factory=time.time)
    nicer: bool = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def parked_at(self) -> float | None:
        """When it parked (it says so beside the FIFO), or None."""
        try:
            data = read_json_file(spare_parked_path(self.fifo), max_bytes=4096)
        except (OSError, ValueError):
            return None
        at = data.get("parked_at") if isinstance(data, dict) else None
        return float(at) if isinstance(at, (int, float)) and not isinstance(at, bool) else None

    def promote(self, late: Mapping[str, str]) -> str | None:
        """Raise it to normal priority and tell it to go on; None, or why it could not be told."""
        self.process.remember_tree()
        normal_priority(self.pid, list(self.process.known_tree()))
        line = json.dumps({"env": dict(late), "promoted_at": time.time()}).encode() + b"\n"
        try:
            os.write(self.write_fd, line)  # far below a pipe's buffer: never blocks
        except OSError as exc:
            return f"its FIFO could not be written ({exc.strerror})"
        finally:
            close_quietly(self.write_fd)
            self.write_fd = -1
        normal_priority(self.pid, list(self.process.known_tree()))  # a loader worker it forked meanwhile
        return None

    def kill(self) -> None:
        """SIGKILL it and its descendants (`end` reaps them); never raises."""
        if self.write_fd >= 0:
            close_quietly(self.write_fd)
            self.write_fd = -1
        try:
            self.process.signal_tree(signal.SIGKILL)
        except Exception as exc:  # noqa: BLE001 - ending a spare never fails the job
            logger.debug("ettr: killing spare %d: %s", self.pid, exc)

    def end(self) -> None:
        """SIGKILL it and its descendants, reap them, remove its files; never raises."""
        self.kill()
        try:
            self.process.wait(5.0)
            tree = [(pid, ticks) for pid, ticks in self.process.known_tree().items() if pid != self.pid]
            containment.kill_all(tree)  # its loader workers, re-parented here as it died: reaped
            self.process.finish(1.0)
        except Exception as exc:  # noqa: BLE001 - ending a spare never fails the job
            logger.debug("ettr: ending spare %d: %s", self.pid, exc)
        containment.keep(self.pid, False)
        self.remove_files()

    def remove_files(self) -> None:
        """Remove its FIFO and parked marker (it has ended, or has been promoted and read its message)."""
        for path in (self.fifo, spare_parked_path(self.fifo)):
            try:
                path.unlink()
            except OSError:
                pass


class Spares:
    """The agent's spares, at most one per local rank (see the module docstring)."""

    def __init__(self, run_dir: Path) -> None:
        self._run_dir = run_dir
        self._by_rank: dict[int, Spare] = {}
        self._serial = 0
        self._ending: list[Spare] = []  # SIGKILLed, not reaped yet (`end_all(wait=False)`)

    @property
    def pids(self) -> list[int]:
        return [s.pid for s in self._by_rank.values()]

    def of_rank(self, rank: int) -> Spare | None:
        return self._by_rank.get(rank)

    def fork(
        self, zygote: Zygote, attempt: int, argvs: Sequence[Sequence[str]], envs: Sequence[dict[str, str]]
    ) -> list[int]:
        """A spare of attempt `attempt` for each local rank `envs` names (its environment: that attempt's as it
        will be, but `SPARE_LATE_NAMES`), forked from `zygote`; those it already has are ended first. The pids
        of those forked (none where the zygote cannot fork them)."""
        forked = []
        for rank, (argv, env) in enumerate(zip(argvs, envs, strict=True)):
            old = self._by_rank.pop(rank, None)
            if old is not None:
                old.end()
            spare = self._fork_one(zygote, attempt, rank, argv, env)
            if spare is not None:
                self._by_rank[rank] = spare
                forked.append(spare.pid)
        return forked

    def _fork_one(
        self, zygote: Zygote, attempt: int, rank: int, argv: Sequence[str], env: dict[str, str]
    ) -> Spare | None:
        self._serial += 1
        fifo = spare_fifo_path(self._run_dir, attempt, rank, self._serial)
        try:
            make_dirs_below(self._run_dir, spares_dir(self._run_dir), mode=0o700)  # never through a symlink
            os.mkfifo(fifo, 0o600)
            write_fd = os.open(fifo, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            logger.debug("ettr: no spare for rank %d (%s)", rank, exc)
            return None
        env = {k: v for k, v in env.items() if k not in SPARE_LATE_NAMES}
        env[SPARE_ENV] = str(fifo)
        process, why = zygote.fork(argv, env)
        if process is None:
            logger.debug("ettr: no spare for rank %d (%s)", rank, why)
            close_quietly(write_fd)
            fifo.unlink(missing_ok=True)
            return None
        containment.keep(process.pid)  # no attempt's sweep takes it: it is the next attempt's, if any
        nicer = nicer_scheduling(process.pid, SPARE_NICE)
        return Spare(
            rank=rank, attempt=attempt, process=process, env=env, fifo=fifo, write_fd=write_fd, nicer=nicer
        )

    def take(self, rank: int, attempt: int, env: Mapping[str, str]) -> tuple[AttemptProcess | None, str]:
        """The spare of `rank` promoted into attempt `attempt` (worker environment `env`), and why; or None
        and why not (the caller forks a replacement: the spare, if any, is ended)."""
        spare = self._by_rank.pop(rank, None)
        if spare is None:
            return None, "no spare"
        why = self._misfit(spare, attempt, env)
        if why is not None:
            spare.end()
            return None, why
        parked_at = spare.parked_at()
        failed = spare.promote({k: v for k, v in env.items() if k in SPARE_LATE_NAMES})
        if failed is not None:
            spare.end()
            return None, f"the spare {failed}"
        containment.keep(spare.pid, False)  # a worker of the attempt from now on (it removes its files)
        now = time.time()
        if parked_at is not None:
            return (
                spare.process,
                f"spare parked {now - parked_at:.1f} s (forked {now - spare.forked_at:.1f} s before)",
            )
        return spare.process, (
            f"spare not parked yet (forked {now - spare.forked_at:.1f} s before): promoted to normal priority, "
            "it finishes the script's start-up"
        )

    @staticmethod
    def _misfit(spare: Spare, attempt: int, env: Mapping[str, str]) -> str | None:
        code = spare.process.poll()
        if code is not None:
            return f"its spare had exited (status {code})"
        if spare.attempt != attempt:
            return f"its spare was for attempt {spare.attempt}"
        ours = {k: v for k, v in spare.env.items() if k != SPARE_ENV}
        theirs = {k: v for k, v in env.items() if k not in SPARE_LATE_NAMES}
        differ = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
        if differ:
            return f"its spare's environment differs from the attempt's ({', '.join(differ[:3])})"
        return None

    def forget_dead(self) -> None:
        """Forget (and reap) spares that died while they waited: no failure of the job; never raises. Those
        ended without waiting are reaped once gone."""
        for spare in [s for s in self._ending if s.process.poll() is not None]:
            self._ending.remove(spare)
            spare.end()
        for rank, spare in list(self._by_rank.items()):
            code = spare.process.poll()
            if code is not None:
                del self._by_rank[rank]
                logger.debug("ettr: spare %d of rank %d ended (status %s): forgotten", spare.pid, rank, code)
                spare.end()

    def end_all(self, *, wait: bool = True) -> None:
        """End every spare (a process restart, the job's end, or the attempt they were for started without
        them); never raises. `wait=False` (an in-place recovery, which the supervisor goes on to watch): each is
        SIGKILLed now and reaped at the next look (`forget_dead`) or end."""
        spares, self._by_rank = [*self._ending, *self._by_rank.values()], {}
        self._ending = []
        for spare in spares:  # all at once: a SIGKILLed spare takes 0.1-0.4 s to die (its address space)
            spare.kill()
        for spare in spares:
            if wait:
                spare.end()
            else:
                self._ending.append(spare)
