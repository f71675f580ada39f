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
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
from collections.abc import Callable, Mapping, Sequence

from ettr.supervisor.process import AttemptProcess

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


_OPTIONS = frozenset({"-u"})
"""Interpreter options a standby reproduces (it is started with them): torchrun's workers run `python -u`."""


_LAUNCHER_MODULES = frozenset({"torch.distributed.run", "torch.distributed.launch"})


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
        if argv[at + 1] in _LAUNCHER_MODULES:
            return None  # the real torchrun: its workers are not this process
    elif target.startswith("-") or not target.endswith(".py") or not os.path.isfile(target):
        return None
    found = shutil.which(argv[0], path=env.get("PATH"))
    if found is None:
        return None
    return (os.path.abspath(found), *argv[1:at])  # not realpath: a venv's python is a link


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
    ):
        self.process, self._write_fd, self.python, self.env, self.cwd = process, write_fd, python, env, cwd
        self.per_attempt = per_attempt

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
        try:
            os.set_inheritable(read_fd, True)
            process = AttemptProcess(
                [*python, "-m", "ettr.bootstrap.standby", str(read_fd), ",".join(warm_modules)],
                stable,
                pass_fds=[read_fd],
            )
        except OSError as exc:
            os.close(write_fd)
            logger.debug("ettr: no standby (%s)", exc)
            return None
        finally:
            os.close(read_fd)
        return cls(process, write_fd, python, stable, os.getcwd(), per_attempt)

    @property
    def pids(self) -> list[int]:
        """The standby's process ids (not the running attempt's, whatever the end-of-attempt sweep sees)."""
        return [self.process.pid]

    def fits(self, argv: Sequence[str], env: Mapping[str, str]) -> bool:
        """Whether the attempt (`argv`, `env`) may run in this standby (see the module docstring)."""
        return (
            self.process.poll() is None
            and _interpreter(argv, env) == self.python
            and self._write_fd >= 0
            and _stable_env(env, self.per_attempt) == self.env
            and os.getcwd() == self.cwd
        )

    def hand_over(self, argv: Sequence[str], env: Mapping[str, str]) -> AttemptProcess | None:
        """Give the standby the attempt; its process, or None (discarded: start cold)."""
        if self._write_fd < 0:
            return None  # handed over already: it runs (or ran) another attempt
        if not self.fits(argv, env):
            self.discard()
            return None
        request = json.dumps({"argv": list(argv), "env": dict(env), "cwd": self.cwd}).encode()
        try:
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

    def discard(self) -> None:
        """EOF to the standby (it exits), then SIGKILL; never raises."""
        try:
            self._close_pipe()
        except OSError:
            pass
        if self.process.poll() is None:
            self.process.signal_tree(signal.SIGKILL)
        self.process.wait(5.0)
        self.process.finish(1.0)
