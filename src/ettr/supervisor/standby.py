"""The supervisor's side of a warm standby (`ettr.bootstrap.standby`): start the next attempt's Python
process ahead, hand it the attempt, or discard it.

While an attempt runs (and restarts remain), the supervisor starts `python -m ettr.bootstrap.standby FD`
with the environment the next attempt will have, less the per-attempt `ETTR_*` names; it does its
interpreter start-up and `import torch`, then waits on the pipe FD. The next attempt takes it over only
when everything is as a cold start would have it:
  * the command is `PYTHON [-u] SCRIPT.py ARGS...` or `PYTHON [-u] -m MODULE ARGS...` (no other
    interpreter options, no `-c`; launchers such as the real torchrun always start cold) and PYTHON and
    its options are the standby's;
  * its environment without `ETTR_*` (and the `per_attempt` names given at the start: a torchrun
    worker's MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_ERROR_FILE) equals the standby's
    (anything `import torch` may have read), and the working directory is the same;
  * the standby is still alive, waiting, and was never handed an attempt (one standby, one attempt).
ettr's own torchrun agent (`ettr.supervisor.workers`) keeps one standby per local rank.
Otherwise the standby is discarded (EOF on its pipe, then SIGKILL) and the attempt starts cold. The
hand-over sends the complete environment, so the attempt never sees a stale one. `ETTR_STANDBY=0` in the
supervisor's environment turns standbys off.

A restart never waits on a standby at idle priority (`Standby.take`). The standby says on a status pipe when
its warm-up is done; at the next attempt a *warm* one takes the attempt at once (path `warm`); one *still
warming* (it warms up at SCHED_IDLE, which gets no CPU while the cores are busy) is first promoted to normal
priority, every thread, and then takes it (path `promoted`): what it has left to do is part of what a cold
start would do from the beginning at that same priority, so it is ready no later than a cold start begun at
that moment, and racing the two on the same cores would only slow both. A standby that cannot be promoted
is dropped and the attempt starts cold at once (path `cold`, as for no standby, one that does not fit or
one that died), and each path says why (`ettr.supervisor.relaunch.Relaunch`, recorded in the supervisor's
`relaunch` MARK). While an attempt waits more than a second for a promoted standby, the console says so
(`ettr.supervisor.relaunch.WarmUpNotice`).
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import time
from collections.abc import Callable, Mapping, Sequence

from ettr.procs import cpu_seconds, idle_scheduling, normal_scheduling
from ettr.run_env import runs_rank_launcher, runs_torchrun
from ettr.supervisor.process import AttemptProcess
from ettr.supervisor.relaunch import Relaunch, WarmUpNotice

logger = logging.getLogger("ettr")

STANDBY_AFTER_S = 2.0
"""The earliest an attempt's standby is started, after the attempt's start."""
STANDBY_FALLBACK_S = 60.0
"""The standby is started once the attempt has trained (its first step: `ettr.run_env.has_trained`), so
that its interpreter start-up and `import torch` never compete with the attempt's own start-up for the
CPU; for an attempt that records no step, this long after its start."""


def due(elapsed_s: float, trained: Callable[[], bool]) -> bool:
    """Whether an attempt `elapsed_s` into its run should have its standby started now; `trained` tells
    whether it has trained yet (asked only once `STANDBY_AFTER_S` have passed)."""
    return elapsed_s >= STANDBY_AFTER_S and (elapsed_s >= STANDBY_FALLBACK_S or trained())


STANDBY_ENV = "ETTR_STANDBY"
"""`ETTR_STANDBY=0` (the supervisor's environment) turns warm standbys off."""
_PER_ATTEMPT_PREFIX = "ETTR_"


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    return (os.environ if environ is None else environ).get(STANDBY_ENV, "1") != "0"


def _stable_env(env: Mapping[str, str], per_attempt: frozenset[str] = frozenset()) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith(_PER_ATTEMPT_PREFIX) and k not in per_attempt}


def not_as_started(
    whose: str,
    interpreters: tuple[object, object],
    envs: tuple[Mapping[str, str], Mapping[str, str]],
    cwd: str,
) -> str | None:
    """Why an attempt differs from what a warm process (`whose`: "standby", "zygote") was started with: its
    interpreter and options, its environment (the names that may differ left out), the working directory
    (`cwd`, the warm process's); None when it does not."""
    if interpreters[0] != interpreters[1]:
        return f"another interpreter or command than the {whose}'s"
    stable, started = envs
    if stable != started:
        changed = sorted(k for k in stable.keys() | started.keys() if stable.get(k) != started.get(k))
        return f"the environment changed ({', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''})"
    if os.getcwd() != cwd:
        return "the working directory changed"
    return None


_OPTIONS = frozenset({"-u"})
"""Interpreter options a standby reproduces (it is started with them): torchrun's workers run `python -u`."""


def _interpreter(argv: Sequence[str], env: Mapping[str, str]) -> tuple[str, ...] | None:
    """The resolved Python and its options of a `PYTHON [-u] SCRIPT.py ...` or `PYTHON [-u] -m MODULE ...`
    command, None for anything else."""
    if len(argv) < 2 or not os.path.basename(argv[0]).startswith("python"):
        return None
    at = 1
    while at < len(argv) and argv[at] in _OPTIONS:
        at += 1
    if at >= len(argv):
        return None
    target = argv[at]
    if target == "-m":
        if at + 1 >= len(argv) or not argv[at + 1] or argv[at + 1].startswith("-"):
            return None
        if runs_torchrun(argv) or runs_rank_launcher(argv):
            return None  # a launcher (torchrun, accelerate launch, DeepSpeed's): its workers are not this process
    elif target.startswith("-") or not target.endswith(".py") or not os.path.isfile(target):
        return None
    found = shutil.which(argv[0], path=env.get("PATH"))
    if found is None:
        return None
    return (os.path.abspath(found), *argv[1:at])  # not realpath: a venv's python is a link


def no_standby_reason(argv: Sequence[str] | None, env: Mapping[str, str]) -> str:
    """Why an attempt (`argv`; None: the workers of ettr's agent) that found no standby starts cold."""
    if not enabled():
        return f"standbys are off ({STANDBY_ENV}=0)"
    if argv is not None and _interpreter(argv, env) is None:
        return "not a plain `python SCRIPT` / `python -m MODULE` command: it always starts cold"
    return "no standby: the previous attempt ended before its standby was due (its first step)"


class Standby:
    """One standby process for the next attempt of `argv` under `env` (the current attempt's launch)."""

    def __init__(
        self,
        process: AttemptProcess,
        write_fd: int,
        python: tuple[str, ...],
        env: dict[str, str],
        cwd: str,
        per_attempt: frozenset[str] = frozenset(),
        status_fd: int = -1,
    ):
        self.process, self._write_fd, self.python, self.env, self.cwd = process, write_fd, python, env, cwd
        self.per_attempt = per_attempt
        self._status_fd = status_fd
        self.spawned_at = time.time()
        self.idle = False
        """Whether it warms up at SCHED_IDLE (set by `start` where the process may be promoted back)."""
        self.warm_at: float | None = None
        """When the standby said its warm-up was done (None: not yet, as far as the supervisor read)."""
        self.handed_at: float | None = None
        """When the standby said it had the attempt's request and started running it."""

    @classmethod
    def start(
        cls,
        argv: Sequence[str],
        env: Mapping[str, str],
        *,
        per_attempt: frozenset[str] = frozenset(),
        warm_modules: Sequence[str] = (),
    ) -> Standby | None:
        """A standby for a command like `argv` (None: not a plain Python script or module, or it cannot
        start). `per_attempt`: names beside `ETTR_*` that the next attempt sets anew (a torchrun worker's
        MASTER_PORT): left out of the standby's environment, received at the hand-over. `warm_modules`:
        imported ahead beside torch (what the attempt will import anyway)."""
        python = _interpreter(argv, env)
        if python is None:
            return None
        stable = _stable_env(env, per_attempt)
        read_fd, write_fd = os.pipe()
        status_read, status_write = os.pipe()
        try:
            os.set_inheritable(read_fd, True)
            os.set_inheritable(status_write, True)
            os.set_blocking(status_read, False)
            process = AttemptProcess(
                [
                    *python,
                    "-m",
                    "ettr.bootstrap.standby",
                    str(read_fd),
                    ",".join(warm_modules),
                    str(status_write),
                ],
                stable,
                pass_fds=[read_fd, status_write],
            )
        except OSError as exc:
            os.close(write_fd)
            os.close(status_read)
            logger.debug("ettr: no standby (%s)", exc)
            return None
        finally:
            os.close(read_fd)
            os.close(status_write)
        standby = cls(process, write_fd, python, stable, os.getcwd(), per_attempt, status_read)
        # Its warm-up must not slow the training attempt it waits behind: idle priority, where it may be
        # promoted back (`take`); set here, before its interpreter starts a second thread.
        standby.idle = idle_scheduling(process.pid)
        return standby

    @property
    def pids(self) -> list[int]:
        """The standby's process ids (not the running attempt's, whatever the end-of-attempt sweep sees)."""
        return [self.process.pid]

    def misfit(self, argv: Sequence[str], env: Mapping[str, str]) -> str | None:
        """Why the attempt (`argv`, `env`) may not run in this standby, None when it may (see the module
        docstring)."""
        if self._write_fd < 0:
            return "the standby was handed an attempt already"
        if self.process.poll() is not None:
            return f"the standby had exited (status {self.process.poll()})"
        return not_as_started(
            "standby",
            (_interpreter(argv, env), self.python),
            (_stable_env(env, self.per_attempt), self.env),
            self.cwd,
        )

    def fits(self, argv: Sequence[str], env: Mapping[str, str]) -> bool:
        """Whether the attempt (`argv`, `env`) may run in this standby (see the module docstring)."""
        return self.misfit(argv, env) is None

    def poll_status(self, timeout_s: float = 0.0) -> None:
        """Read what the standby said on its status pipe (`warm_at`, `handed_at`), waiting up to `timeout_s`."""
        if self._status_fd < 0:
            return
        try:
            if timeout_s > 0:
                select.select([self._status_fd], [], [], timeout_s)
            said = os.read(self._status_fd, 64)
        except BlockingIOError:
            return
        except OSError:
            said = b""
        now = time.time()
        if b"w" in said and self.warm_at is None:
            self.warm_at = now
        if b"h" in said and self.handed_at is None:
            self.handed_at = now
        if not said:  # EOF: the standby closed it (running the attempt) or is gone
            self._close_status()

    @property
    def warm(self) -> bool:
        """Whether the standby has said that its warm-up is done."""
        self.poll_status()
        return self.warm_at is not None

    def take(self, argv: Sequence[str], env: Mapping[str, str]) -> tuple[AttemptProcess | None, Relaunch]:
        """Start the attempt (`argv`, `env`) in this standby if it fits: at once if it is warm, else once
        promoted to normal priority (see the module docstring). Its process and the path (None: the standby
        is discarded and the caller starts the attempt cold, at once)."""
        misfit = self.misfit(argv, env)
        if misfit is not None:
            if self._write_fd >= 0:  # not the running attempt's process: end it
                self.discard()
            return None, Relaunch(path="cold", why=f"standby dropped: {misfit}")
        if self.warm:
            ready_s = time.time() - (self.warm_at or time.time())
            relaunch = Relaunch(path="warm", why=f"standby ready (warm {ready_s:.1f} s before)")
        else:
            age_s, cpu_s = time.time() - self.spawned_at, cpu_seconds(self.process.pid)
            used = "" if cpu_s is None else f"{cpu_s:.1f} s of CPU in "
            if not normal_scheduling(self.process.pid):
                self.discard()
                return None, Relaunch(
                    path="cold",
                    why=f"standby still warming ({used}{age_s:.1f} s), could not be promoted: dropped",
                )
            done = "promoted to normal priority" if self.idle else "at normal priority already"
            where = "at idle priority" if self.idle else "at normal priority"
            relaunch = Relaunch(
                path="promoted", why=f"standby still warming ({used}{age_s:.1f} s {where}): {done}"
            )
        process = self.hand_over(argv, env)
        if process is None:
            return None, Relaunch(path="cold", why="standby gone at the hand-over: dropped")
        return process, relaunch

    def hand_over(self, argv: Sequence[str], env: Mapping[str, str]) -> AttemptProcess | None:
        """Give the standby the attempt, every thread at normal priority first (one still warming finishes
        its warm-up so, then runs it: `take` says which); its process, or None (discarded: start cold)."""
        if self._write_fd < 0:
            return None  # handed over already: it runs (or ran) another attempt
        if not self.fits(argv, env) or not normal_scheduling(self.process.pid):
            self.discard()
            return None
        request = json.dumps({"argv": list(argv), "env": dict(env), "cwd": self.cwd}).encode()
        try:
            _make_room(self._write_fd, len(request))  # a standby still warming reads it only later
            view = memoryview(request)
            while view:
                view = view[os.write(self._write_fd, view) :]
            self._close_pipe()
        except OSError as exc:
            logger.debug("ettr: standby gone (%s); starting cold", exc)
            self.discard()
            return None
        return self.process

    def _close_pipe(self) -> None:
        fd, self._write_fd = self._write_fd, -1
        if fd >= 0:
            os.close(fd)

    def _close_status(self) -> None:
        fd, self._status_fd = self._status_fd, -1
        if fd >= 0:
            os.close(fd)

    def close(self) -> None:
        """Forget the status pipe (the standby runs an attempt now, or is gone); never raises."""
        try:
            self._close_status()
        except OSError:
            pass

    def discard(self) -> None:
        """EOF to the standby (it exits), then SIGKILL; never raises."""
        try:
            self._close_pipe()
            self._close_status()
        except OSError:
            pass
        if self.process.poll() is None:
            # A process at idle priority gets no CPU on a busy machine, not even to run its own exit after
            # a SIGKILL: back to normal first, so that discarding it never holds up the restart.
            normal_scheduling(self.process.pid)
            self.process.signal_tree(signal.SIGKILL)
        self.process.wait(5.0)
        self.process.finish(1.0)


def relaunch(
    ready: Standby | None, argv: Sequence[str], env: Mapping[str, str], *, attempt: int
) -> tuple[AttemptProcess, Relaunch]:
    """Attempt `attempt`'s process for `argv`, `env`: in the standby `ready` when it fits (`Standby.take`;
    a promoted one gets a `WarmUpNotice`), else started cold at once. Raises OSError (a cold start that
    cannot start)."""
    process, how = (
        (None, Relaunch(path="cold", why=no_standby_reason(argv, env)))
        if ready is None
        else ready.take(argv, env)
    )
    if process is None:
        return AttemptProcess(argv, env), how
    assert ready is not None
    if how.path == "promoted":
        WarmUpNotice(attempt, [("the attempt", ready)]).start()  # ends once the standby runs the attempt
    else:
        ready.close()
    return process, how


_F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ (Linux; Python 3.10+ names it)


def _make_room(fd: int, size: int) -> None:
    """A pipe that holds `size` bytes, so that writing a request to a standby still warming never blocks the
    supervisor (a pipe holds 64 KiB by default; an environment is rarely larger). Raises OSError."""
    if size <= 60_000:
        return
    import fcntl

    fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", _F_SETPIPE_SZ), size + 4096)
