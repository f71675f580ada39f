"""One attempt's process tree: start it, tee its stderr (keeping a tail for the failure record), signal it.

The child stays in the supervisor's process group (so a terminal's Ctrl-C and a scheduler's group signal
reach it directly) and gets SIGKILL from the kernel if the supervisor dies (Linux `PR_SET_PDEATHSIG`), so a
SIGKILLed supervisor leaves no training running behind the books it can no longer keep. Signals go to the
whole tree of descendants, found in /proc (`ettr.procs`): torchrun puts each worker in a session of its own, out of reach of
a process-group signal.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import BinaryIO

from ettr.procs import (
    cmdline_of,
    descendants,
    libc_prctl,
    log_readers,
    running,
    set_parent_death_signal,
    signal_pids,
    start_ticks,
)
from ettr.supervisor.launch import own_restarts
from ettr.supervisor.messages import MarkCarry, relay_stderr
from ettr.warn import LINE_MARK, STDERR_TEE_ENV

logger = logging.getLogger("ettr")


def open_standard_fds() -> list[int]:
    """Open /dev/null on whichever of fds 0, 1, 2 is closed (`ettr run ... >&-`); the fds it opened.

    Otherwise the next file the supervisor opens (a pipe, the ledger itself) takes the lowest free number, and
    the job inherits it as its stdout: a print failed with EBADF (the job was booked failed), or wrote into that
    file. With /dev/null the job's output is discarded, as the closed stdout asked."""
    opened = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        null = os.open(os.devnull, os.O_RDONLY if fd == 0 else os.O_WRONLY)
        if null != fd:  # a lower fd was closed too and took it: put it where it belongs
            os.dup2(null, fd)
            os.close(null)
        os.set_inheritable(fd, True)  # the job's standard fd (os.open makes close-on-exec fds)
        opened.append(fd)
    return opened


def _stdin_is_terminal() -> bool:
    try:
        return os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp()
    except OSError:
        return False


class AttemptProcess:
    """The running command of one attempt.

    Args:
        argv: the command line.
        env: its environment.
        tail_bytes: how much of the end of its stderr to keep for the failure record.
        pass_fds: file descriptors the command inherits (a warm standby's request pipe).
    """

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        *,
        tail_bytes: int = 16384,
        pass_fds: Sequence[int] = (),
    ) -> None:
        parent = os.getpid()
        prctl = libc_prctl()  # resolved before the fork: the child only calls it

        # Without a terminal, the command gets a session (and so a process group) of its own, as torchrun
        # starts its workers: a signal to the supervisor's group (`kill -INT -PGID`, a CI runner) then
        # reaches the job once, forwarded by the supervisor, not twice; and where the kernel shares CPU time
        # between sessions first (`sched_autogroup`), the job does not share one share with whatever else was
        # started from the supervisor's session (measured: the demo's DLRM steps 2-3x slower under ettr's
        # agent than under torchrun with a CPU-bound load started from the same shell, when its workers
        # stayed there). On a terminal it stays in the foreground group, so that it may read the terminal
        # (pdb) and a Ctrl-C reaches it directly (the supervisor then does not forward it).
        own_session = not _stdin_is_terminal()

        def in_child() -> None:  # runs between fork and exec: the supervisor has no other thread then
            if own_session:
                os.setsid()  # a new session and process group, led by the child
            set_parent_death_signal(signal.SIGKILL, prctl)
            if os.getppid() != parent:  # the supervisor died before the line above took effect
                os.kill(os.getpid(), signal.SIGKILL)

        # The stderr pipe is made here, so that the job is told which it is (ettr.warn: a line of ettr's written
        # from the job's side marks its start there, and the tee starts it on a line of its own).
        read_fd, write_fd = os.pipe()
        pipe = os.fstat(write_fd)
        try:
            proc = subprocess.Popen(
                list(argv),
                env={**env, STDERR_TEE_ENV: f"{pipe.st_dev}:{pipe.st_ino}"},
                stderr=write_fd,
                preexec_fn=in_child,
                close_fds=True,
                pass_fds=tuple(pass_fds),
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        self._attach(proc, read_fd, tail_bytes)

    def _attach(self, proc: subprocess.Popen[bytes] | AdoptedChild, stderr_fd: int, tail_bytes: int) -> None:
        """Watch `proc`, its stderr the pipe `stderr_fd` (taken over: the tee closes it at its end)."""
        self.proc = proc
        self.pid = proc.pid
        self._tail = bytearray()
        self._tail_bytes = tail_bytes
        self._tail_lock = threading.Lock()
        self._known: dict[int, int | None] = {}
        self._stderr_fd = stderr_fd
        self._tee = threading.Thread(target=self._copy_stderr, name="ettr-stderr-tee", daemon=True)
        self._tee.start()

    @classmethod
    def adopt(cls, pid: int, stderr_fd: int, *, tail_bytes: int = 16384) -> AttemptProcess:
        """The process of a child this supervisor adopted (a zygote's fork, `ettr.supervisor.zygote`:
        re-parented here, the child subreaper) whose stderr is the pipe `stderr_fd` (taken over)."""
        self = cls.__new__(cls)
        self._attach(AdoptedChild(pid), stderr_fd, tail_bytes)
        return self

    def _copy_stderr(self) -> None:
        out: BinaryIO | None = getattr(sys.stderr, "buffer", None)
        fd = self._stderr_fd
        carry = MarkCarry()
        try:
            while True:
                try:
                    read = os.read(fd, 65536)
                except OSError:
                    read = b""
                chunk = carry.take(read) if read else carry.rest()
                if chunk:
                    try:
                        chunk = relay_stderr(chunk, out)
                    except (OSError, ValueError):
                        out = None  # our own stderr is gone: keep draining so the child never blocks
                        chunk = chunk.replace(LINE_MARK.encode(), b"")
                    with self._tail_lock:
                        self._tail += chunk
                        del self._tail[: max(0, len(self._tail) - self._tail_bytes)]
                if not read:
                    break
        finally:
            os.close(fd)

    def poll(self) -> int | None:
        """The return code once the command has exited (negative: killed by that signal), else None."""
        return self.proc.poll()

    def remember_tree(self) -> None:
        """Note the current descendants, so they can be reached even after their parent died."""
        for pid, ticks in descendants(self.pid):
            self._known.setdefault(pid, ticks)

    def known_tree(self) -> dict[int, int | None]:
        """The descendants noted so far (pid -> start ticks), alive or not."""
        return dict(self._known)

    def signal_tree(self, sig: int, *, include_command: bool = True) -> list[int]:
        """Send `sig` to the command (unless not `include_command`) and every descendant (known now or seen
        earlier, also after its parent died); the pids it was sent to. A signal other than SIGKILL is held
        back from the job's log readers (`procs.log_readers`: the `tee` its Python processes write to) while
        a writer lives: they end at the end of their input, and the deadline's SIGKILL still reaches them."""
        self.remember_tree()
        if not include_command and sig != signal.SIGKILL:
            # a torchrun a wrapper `exec`ed with restarts of its own would start its workers again rather
            # than end: it is asked to end with them (a wrapper's torchrun without `exec` is a descendant)
            include_command = own_restarts(cmdline_of(self.pid) or []) > 0
        targets = ([(self.pid, None)] if include_command else []) + list(self._known.items())
        ours = [
            pid
            for pid, ticks in targets
            # gone (the pid may belong to someone else now), or the command already reaped
            if not (pid != self.pid and ticks is not None and start_ticks(pid) != ticks)
            and not (pid == self.pid and self.proc.returncode is not None)
        ]
        if sig != signal.SIGKILL:
            held = log_readers(
                [self.pid, *self._known] if self.proc.returncode is None else list(self._known)
            )
            ours = [pid for pid in ours if pid not in held]
        return signal_pids(ours, sig)

    def alive(self) -> list[int]:
        """The processes of the tree still running (not zombies): the command, then its descendants known
        now or seen earlier."""
        self.remember_tree()
        found = [self.pid] if self.proc.poll() is None else []
        return found + [pid for pid, ticks in self._known.items() if pid != self.pid and running(pid, ticks)]

    def kill_leftovers(self) -> None:
        """SIGKILL descendants that outlived the command (a worker orphaned by a dead torchrun)."""
        self.signal_tree(signal.SIGKILL)

    def wait(self, timeout_s: float | None = None) -> int | None:
        """Wait for the command to exit (at most `timeout_s`); its return code, or None on timeout."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def finish(self, timeout_s: float = 2.0) -> None:
        """After exit: collect the rest of stderr (not waiting on orphans that still hold the pipe)."""
        self._tee.join(timeout_s)

    def stderr_tail(self, num_lines: int = 20) -> list[str]:
        """The last `num_lines` lines the command wrote to stderr."""
        with self._tail_lock:
            text = bytes(self._tail).decode(errors="replace")
        lines = [line.rstrip() for line in text.replace("\r", "\n").splitlines()]
        return [line for line in lines if line][-num_lines:]


class AdoptedChild:
    """What `AttemptProcess` uses of `subprocess.Popen`, for an adopted child (`AttemptProcess.adopt`): its
    exit status is read with `waitpid`, as Popen reads its own children's."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                done, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: the status is lost (Popen says 0 then too)
                logger.debug("ettr: adopted child %d was reaped elsewhere", self.pid)
                self.returncode = 0
                return 0
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired([str(self.pid)], timeout or 0.0)
            time.sleep(0.01)
        return code
