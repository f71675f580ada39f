"""A zygote: one warm Python process per node (per ettr agent) that forks, on request, children that are
warm at birth; each child becomes one attempt's `python SCRIPT ARGS...`, as a warm standby would.

    python [-u] -m ettr.bootstrap.zygote FD [MODULE,MODULE...]
        (started by `ettr.supervisor.zygote`, at normal priority, before the first attempt's workers)

It does the standby's warm-up once (`ettr.bootstrap.standby._warm_up`: `import torch`, the given modules,
ettr's bootstrap modules; imports only, no tensor made, no random state drawn), says `w` on the socket FD
(a SOCK_SEQPACKET pair with the agent), then sleeps in `recvmsg` (no CPU). Each request is one message,
{"agent": PID, "own_session": BOOL}, with three descriptors: a pipe holding the attempt's JSON request (the
standby's: {"argv", "env", "cwd"}), the write end of the stderr pipe the agent tees, and a "hello" pipe. For
each it checks that it is single-threaded (`/proc/self/task`: forking a process with other threads copies
only the calling one, and a lock another thread held stays locked in the child forever); if not it writes
`no WHY` on the hello pipe and forks nothing. Else it forks twice: the middle process exits at once, so the
child is re-parented to the agent, a child subreaper (`ettr.supervisor.containment`): it is the agent's own
child, whose exit status the agent's `waitpid` reads and whose signals it sends, as for a process it
started. The child waits until it is adopted (its parent is the agent), takes a session of its own when the
agent's workers do (`AttemptProcess`), sets its parent-death SIGKILL (now for the agent), writes `pid PID`
on the hello pipe, puts the stderr pipe on fd 2, closes every other descriptor (a cold start has only the
standard ones), and runs the attempt as the standby does (`ettr.bootstrap.standby.run_request`; the
recorder's `zygote` MARK says so). EOF on the socket (the agent discarded the zygote or is gone) exits 0.

What a child has that a cold start would not: nothing the script can see, as far as checked. Python's `random`
reseeds itself in a forked child (CPython's `os.register_at_fork`), numpy's global RandomState (seeded from the
OS at import, and imported by torch) is reseeded here from the OS as a cold start's is, and so are torch's
default CPU generator (torch 2.13 seeds it from the OS at import: without this every rank of the node, and every
later attempt, would start from the zygote's one seed) and multiprocessing's authentication key
(`_fresh_like_a_cold_start`). Its string hash seed
is the zygote's (random per zygote unless PYTHONHASHSEED is set): the ranks of one node, and every attempt forked
from it, share it, where cold starts would each draw one; no program may depend on either. Not the same (known,
not handled): what torch and the zygote's other warm-up modules read from the environment at their import is
the zygote's, so a script that sets OMP_NUM_THREADS (or MKL_NUM_THREADS, TORCH_LOGS, ...) in `os.environ`
above its own `import torch` gets the zygote's value (measured, 2 cores: `os.environ["OMP_NUM_THREADS"] = "2"`
then `import torch`: 1 thread forked, 2 cold); `torch.set_num_threads` works as at a cold start. The script
finds `torch` in `sys.modules` at its first line, and /proc/PID/cmdline and `sys.orig_argv` are the zygote's.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from ettr.procs import close_quietly
from ettr.run_env import ZYGOTE_MESSAGE_MAX_BYTES

SPAWNED_AT = time.time()

_SIGINT_AT_START: Callable[[int, FrameType | None], Any] | int | None = signal.default_int_handler
"""SIGINT's handler as the interpreter set it (Python's own, or SIG_IGN where it was ignored at the start)."""
_ADOPTION_WAIT_S = 10.0
"""How long a child waits to be re-parented to the agent (the middle process exits at once)."""


def threads_problem() -> str | None:
    """Why this process must not fork now (it has other threads), or None."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError as exc:
        return f"its threads cannot be counted ({exc.strerror})"
    if len(tasks) <= 1:
        return None
    hint = ""
    if "numpy" in sys.modules and "1" not in (
        os.environ.get("OMP_NUM_THREADS"),
        os.environ.get("OPENBLAS_NUM_THREADS"),
    ):
        # Measured (numpy 2, torch 2.13, 2 cores): `import numpy` (torch imports it) starts OpenBLAS's pool
        # of cores-1 threads; with OMP_NUM_THREADS=1 (torchrun's and ettr's default for nproc > 1) or
        # OPENBLAS_NUM_THREADS=1 it starts none, and torch's own import starts none.
        hint = ": numpy's OpenBLAS starts a thread pool at import unless OMP_NUM_THREADS or OPENBLAS_NUM_THREADS is 1"
    return f"the zygote has {len(tasks)} threads after its warm-up{hint}"


def _write(fd: int, data: bytes) -> bool:
    try:
        os.write(fd, data)
        return True
    except OSError:
        return False


def serve(sock: socket.socket) -> tuple[dict, float] | None:
    """Fork a child per request until the agent closes the socket (None: exit). In a forked child, returns
    its attempt's request and when it was forked (the caller runs it)."""
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, 4096, 3)
        except OSError:
            return None
        if not message:
            close_quietly(*fds)
            return None
        if len(fds) != 3:
            close_quietly(*fds)
            continue
        request_fd, stderr_fd, hello_fd = fds
        try:
            header = json.loads(message)
            agent, own_session = int(header["agent"]), bool(header["own_session"])
        except (ValueError, KeyError, TypeError):
            _write(hello_fd, b"no: a request the zygote could not read")
            close_quietly(*fds)
            continue
        problem = threads_problem()
        if problem is not None:
            _write(hello_fd, b"no: " + problem.encode())
            close_quietly(*fds)
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            middle = os.fork()
        except OSError as exc:
            _write(hello_fd, f"no: fork failed ({exc.strerror})".encode())
            close_quietly(*fds)
            continue
        if middle == 0:
            try:
                child = os.fork()
            except OSError:
                os._exit(1)
            if child != 0:
                os._exit(0)  # the child is re-parented to the agent, the child subreaper
            forked_at = time.time()
            sock.close()
            request = _become_child(agent, own_session, request_fd, stderr_fd, hello_fd)
            return request, forked_at
        close_quietly(*fds)
        try:
            os.waitpid(middle, 0)
        except ChildProcessError:
            pass


def _become_child(agent: int, own_session: bool, request_fd: int, stderr_fd: int, hello_fd: int) -> dict:
    """The forked child's set-up (see the module docstring); its attempt's request. Exits on a failure."""
    deadline = time.monotonic() + _ADOPTION_WAIT_S
    while os.getppid() != agent:
        if time.monotonic() >= deadline or os.getppid() == 1:
            _write(hello_fd, b"no: the forked child was not adopted by the agent (not a child subreaper)")
            os._exit(1)
        time.sleep(0.0005)
    from ettr.procs import set_parent_death_signal

    signal.signal(signal.SIGINT, _SIGINT_AT_START)  # as a cold start's interpreter sets it
    if own_session:
        os.setsid()
    set_parent_death_signal()
    if os.getppid() != agent:  # the agent died before the line above took effect
        os._exit(1)
    try:
        with os.fdopen(request_fd, "rb") as pipe:
            request = json.loads(pipe.read())
    except (OSError, ValueError):
        _write(hello_fd, b"no: the forked child could not read its request")
        os._exit(1)
    os.dup2(stderr_fd, 2)
    if not _write(hello_fd, f"pid {os.getpid()}".encode()):
        os._exit(1)  # the agent gave up on this fork
    os.closerange(3, _max_fd())
    if "numpy.random" in sys.modules:  # a cold start's numpy seeds its global RandomState from the OS
        try:
            sys.modules["numpy.random"].seed()
        except Exception:
            pass
    _fresh_like_a_cold_start()
    return request


_TORCH_FIXED_SEED = 67280421310721
"""libtorch's fixed default seed (c10 `default_rng_seed_val`): a torch whose generator starts with it at import
gives every cold start the same seed, and a forked child keeps it as is."""


def _fresh_like_a_cold_start() -> None:
    """Draw afresh what a cold start's imports draw from the OS, where the zygote's copy would otherwise be
    shared by every child (the ranks of the node and every later attempt's): torch's default CPU generator
    when this torch seeds it at import (measured, torch 2.13: `import torch` twice gives two seeds, the
    zygote's two ranks one), and multiprocessing's authentication key (`os.urandom(32)` at its import)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.initial_seed() != _TORCH_FIXED_SEED:
                torch.default_generator.seed()
        except Exception:
            pass
    process = sys.modules.get("multiprocessing.process")
    if process is not None:
        try:
            process.current_process().authkey = os.urandom(32)
        except Exception:
            pass


def _max_fd() -> int:
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return soft if 0 < soft < (1 << 20) else (1 << 16)
    except (ImportError, OSError, ValueError):
        return 1 << 16


def main() -> None:
    # On a terminal the zygote is in the job's foreground group: a Ctrl-C is for the workers, not for it
    # (each child puts back what the interpreter had set at its start, `_become_child`).
    global _SIGINT_AT_START
    _SIGINT_AT_START = signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(sys.argv[1]))
    from ettr.bootstrap.standby import _warm_up, run_request

    # A warm-up that leaves other threads (numpy's OpenBLAS pool, started by `import torch` unless
    # OMP_NUM_THREADS is 1: a job of one local worker) makes a zygote that can fork nothing: it stops at the
    # first such import and says why at once, and the agent starts the attempt cold without waiting for the
    # rest of the warm-up (1.7 s of imports here; 2.9 s with a Lightning script's remembered imports).
    _warm_up(
        [name for name in (sys.argv[2] if len(sys.argv) > 2 else "").split(",") if name],
        stop=lambda: threads_problem() is not None,
    )
    problem = threads_problem()
    warm_at = time.time()
    try:
        sock.send(b"w" if problem is None else b"n" + problem.encode()[:ZYGOTE_MESSAGE_MAX_BYTES])
    except OSError:
        return
    if problem is not None:
        return
    handed = serve(sock)
    if handed is None:
        return
    request, forked_at = handed
    run_request(request, forked_at, "zygote", spawned_at=SPAWNED_AT, warm_at=warm_at, forked_at=forked_at)


if __name__ == "__main__":
    main()
