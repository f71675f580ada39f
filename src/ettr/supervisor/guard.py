"""The job's guard: a small process that outlives a SIGKILLed supervisor just long enough to end the job.

A supervisor killed with SIGKILL takes its direct child along (`PR_SET_PDEATHSIG`), but not what that child
started: `python train.py` under `bash -c "...; ..."` kept training, unrecorded, until a requeue on the same
host killed it. So each supervisor starts a guard (`python -m ettr.supervisor.guard`) in a session of its own,
holding the read end of a pipe whose write end only the supervisor holds. The supervisor writes the pid of each
process it starts for an attempt (each leads a process group of its own) and, once the attempt is over and
swept, forgets them again (a pid, and so a group id, may be reused later). When the pipe reaches EOF — the
supervisor is gone, whatever ended it — the guard SIGKILLs

- every process group the supervisor named (what the job started inside them, whatever its environment), and
- every process carrying this supervisor's marker (`ETTR_RUN_DIR` and `ETTR_SUPERVISOR_PID`, in
  `/proc/PID/environ`: what left those groups),

then exits. After a normal end nothing is left to kill (each attempt was swept). What escapes both (a
process that cleared its environment and left its group while the supervisor was dead) is left to the
requeue's kill of leftovers (`containment.leftovers`) and to the accounting's fence.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from ettr.procs import processes_with_env
from ettr.run_env import RUN_DIR_ENV, SUPERVISOR_PID_ENV

logger = logging.getLogger("ettr")


class JobGuard:
    """The supervisor's side: start the guard, tell it the attempts' processes. Never raises."""

    def __init__(self, process: subprocess.Popen[bytes], write_fd: int) -> None:
        self._process = process
        self._write_fd = write_fd

    @classmethod
    def start(cls, run_dir: str | os.PathLike[str]) -> JobGuard | None:
        """The guard of this supervisor's job in `run_dir` (None where it cannot start: no guard)."""
        read_fd, write_fd = os.pipe()  # not inheritable: no process of the job holds the write end
        try:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "ettr.supervisor.guard",
                    str(read_fd),
                    str(Path(run_dir)),
                    str(os.getpid()),
                ],
                pass_fds=[read_fd],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,  # not in the job's group, nor the terminal's: a group kill spares it
                env={k: v for k, v in os.environ.items() if k not in (RUN_DIR_ENV, SUPERVISOR_PID_ENV)},
            )
        except OSError as exc:
            os.close(write_fd)
            logger.warning("ettr: no guard for the job (%s): a SIGKILLed supervisor may leave processes", exc)
            return None
        finally:
            os.close(read_fd)
        return cls(process, write_fd)

    @property
    def pid(self) -> int:
        return self._process.pid

    def watch(self, pids: Iterable[int]) -> None:
        """Processes (each leading a group of its own) the guard ends if the supervisor dies."""
        self._send("".join(f"+{pid}\n" for pid in pids))

    def forget(self, pids: Iterable[int]) -> None:
        """Processes that ended (their attempt was swept): their ids may be someone else's later."""
        self._send("".join(f"-{pid}\n" for pid in pids))

    def _send(self, text: str) -> None:
        if self._write_fd < 0 or not text:
            return
        lines = text.encode()
        try:
            os.write(self._write_fd, lines)
        except OSError as exc:  # the guard is gone: the requeue's kill of leftovers remains
            logger.info("ettr: the job's guard is gone (%s)", exc)

    def close(self) -> None:
        """The supervisor ends: EOF to the guard, which finds nothing left and exits (not waited for: the
        job's end does not wait on its look at /proc; an exited guard is reaped at the next poll, or by
        whoever adopts it once the supervisor has exited)."""
        if self._write_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._write_fd)
            self._write_fd = -1
        self._process.poll()


def _read_pids(fd: int) -> list[int]:
    """The pids the supervisor named and did not forget, once it is gone (EOF)."""
    pids: set[int] = set()
    pending = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except InterruptedError:
            continue
        except OSError:
            break
        if not chunk:
            break
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            sign, digits = line[:1], line[1:]
            if digits.isdigit():
                (pids.add if sign == b"+" else pids.discard)(int(digits))
    return sorted(pids)


def end_job(run_dir: str, supervisor_pid: int, group_leaders: Sequence[int]) -> list[int]:
    """SIGKILL the job of the supervisor `supervisor_pid` on `run_dir` (see the module docstring); the pids
    and groups it was sent to."""
    hit = []
    for leader in sorted(set(group_leaders)):
        if leader > 1 and leader != os.getpid():
            try:
                os.killpg(leader, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue  # that group is gone (or is not a group: a command that stayed in the terminal's)
            hit.append(leader)
    marker = {RUN_DIR_ENV: run_dir, SUPERVISOR_PID_ENV: str(supervisor_pid)}
    for pid, _, _ in processes_with_env(marker):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
            hit.append(pid)
    return hit


def main(argv: Sequence[str]) -> int:
    """`python -m ettr.supervisor.guard READ_FD RUN_DIR SUPERVISOR_PID`."""
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGUSR1, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_IGN)  # the guard outlives what stops the supervisor, by design
    fd, run_dir, supervisor = int(argv[0]), argv[1], int(argv[2])
    leaders = _read_pids(fd)
    end_job(run_dir, supervisor, leaders)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
