"""The supervisor's side of a warm standby (`ettr.bootstrap.standby`): start the next attempt's Python
process ahead, hand it the attempt, or discard it.

While an attempt runs (and restarts remain), the supervisor starts `python -m ettr.bootstrap.standby FD`
with the environment the next attempt will have, less the per-attempt `ETTR_*` names; it does its
interpreter start-up and `import torch`, then waits on the pipe FD. The next attempt takes it over only
when everything is as a cold start would have it:
  * the command is `PYTHON SCRIPT.py ARGS...` (no interpreter options, no `-m`/`-c`; torchrun and other
    launchers always start cold) and PYTHON is the standby's interpreter;
  * its environment without `ETTR_*` equals the standby's (anything `import torch` may have read), and
    the working directory is the same;
  * the standby is still alive and waiting.
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
from collections.abc import Mapping, Sequence

from ettr.supervisor.process import AttemptProcess

logger = logging.getLogger("ettr")

STANDBY_AFTER_S = 2.0
"""How long after an attempt's start its standby is started (so that it does not slow the attempt's own
start-up down)."""
STANDBY_ENV = "ETTR_STANDBY"
"""`ETTR_STANDBY=0` (the supervisor's environment) turns warm standbys off."""
_PER_ATTEMPT_PREFIX = "ETTR_"


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    return (os.environ if environ is None else environ).get(STANDBY_ENV, "1") != "0"


def _stable_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith(_PER_ATTEMPT_PREFIX)}


def _interpreter(argv: Sequence[str], env: Mapping[str, str]) -> str | None:
    """The resolved Python of a `PYTHON SCRIPT.py ...` command, None for anything else."""
    if len(argv) < 2 or not os.path.basename(argv[0]).startswith("python"):
        return None
    script = argv[1]
    if script.startswith("-") or not script.endswith(".py") or not os.path.isfile(script):
        return None
    found = shutil.which(argv[0], path=env.get("PATH"))
    return None if found is None else os.path.abspath(found)  # not realpath: a venv's python is a link


class Standby:
    """One standby process for the next attempt of `argv` under `env` (the current attempt's launch)."""

    def __init__(self, process: AttemptProcess, write_fd: int, python: str, env: dict[str, str], cwd: str):
        self.process, self._write_fd, self.python, self.env, self.cwd = process, write_fd, python, env, cwd

    @classmethod
    def start(cls, argv: Sequence[str], env: Mapping[str, str]) -> Standby | None:
        """A standby for a command like `argv` (None: not a plain Python script, or it cannot start)."""
        python = _interpreter(argv, env)
        if python is None:
            return None
        stable = _stable_env(env)
        read_fd, write_fd = os.pipe()
        try:
            os.set_inheritable(read_fd, True)
            process = AttemptProcess(
                [python, "-m", "ettr.bootstrap.standby", str(read_fd)], stable, pass_fds=[read_fd]
            )
        except OSError as exc:
            os.close(write_fd)
            logger.debug("ettr: no standby (%s)", exc)
            return None
        finally:
            os.close(read_fd)
        return cls(process, write_fd, python, stable, os.getcwd())

    @property
    def pids(self) -> list[int]:
        """The standby's process ids (not the running attempt's, whatever the end-of-attempt sweep sees)."""
        return [self.process.pid]

    def fits(self, argv: Sequence[str], env: Mapping[str, str]) -> bool:
        """Whether the attempt (`argv`, `env`) may run in this standby (see the module docstring)."""
        return (
            self.process.poll() is None
            and _interpreter(argv, env) == self.python
            and _stable_env(env) == self.env
            and os.getcwd() == self.cwd
        )

    def hand_over(self, argv: Sequence[str], env: Mapping[str, str]) -> AttemptProcess | None:
        """Give the standby the attempt; its process, or None (discarded: start cold)."""
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
