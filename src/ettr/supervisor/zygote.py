"""The agent's side of a zygote (`ettr.bootstrap.zygote`): one warm process per node that forks each worker
warm at birth, for ettr's torchrun agent (`ettr.supervisor.workers`).

At its first attempt the agent starts `python [-u] -m ettr.bootstrap.zygote FD MODULES` at normal priority
with the workers' environment less the per-rank and per-attempt names (`stable_env`), waits for its warm-up
(one `import torch` per node, where N cold workers would import it N times on the same cores), then asks it
for each worker (`Zygote.fork`): path `forked` in the relaunch MARK. It sleeps (no CPU) between requests and
stays for the job's whole run, so an in-place recovery's replacement, or a process restart's workers, are a
fork away (tens of ms) rather than a standby that had to warm up behind training. Its memory: one process
with torch imported (326 MiB RSS here with torch, torch.distributed, torch.nn.parallel and torch._dynamo;
its children share those pages copy-on-write). `ETTR_ZYGOTE=0` (or `ETTR_STANDBY=0`, which turns every
warm process off) in the supervisor's environment turns it off; the agent then uses warm standbys
(`ettr.supervisor.standby_group`).

A worker is forked only when everything is as a cold start would have it, as for a standby:
  * the worker's command is the zygote's `PYTHON [-u] SCRIPT.py | -m MODULE` (same resolved Python and
    options) and the working directory is the zygote's;
  * the worker's environment without `ETTR_*`, `TORCHELASTIC_*` and the per-rank names `PER_RANK_NAMES`
    equals the zygote's. Those names are left out because `import torch` does not read them: traced on
    `os.environ` during the warm-up's imports (torch 2.13: torch, torch.distributed, torch.nn.parallel,
    torch._dynamo and ettr's bootstrap modules read 366 names, none of these; libtorch reads RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT only when a process group is made, after the fork). The child gets
    its complete environment at the fork;
  * the zygote is single-threaded when it forks (checked on /proc/self/task before each fork; numpy's OpenBLAS
    pool is the one thread seen, and only without OMP_NUM_THREADS=1, which the agent sets for nproc > 1);
  * the supervisor is a child subreaper (`ettr.supervisor.containment`), so that the child, forked twice, is
    re-parented to it: the supervisor's own child, whose exit status its `waitpid` reads (`AttemptProcess.adopt`)
    and whose signals it sends, with its stderr teed as any worker's.
Otherwise the worker starts from its standby or cold, and the relaunch MARK says why; a zygote that refused
(threads) or died is dropped for the rest of the run.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import time
from collections.abc import Mapping, Sequence

from ettr.procs import close_quietly, is_child_subreaper
from ettr.run_env import ZYGOTE_MESSAGE_MAX_BYTES
from ettr.supervisor import containment, standby
from ettr.supervisor.process import AttemptProcess, _stdin_is_terminal
from ettr.warn import STDERR_TEE_ENV

logger = logging.getLogger("ettr")

ZYGOTE_ENV = "ETTR_ZYGOTE"
"""`ETTR_ZYGOTE=0` (the supervisor's environment) turns the zygote off."""
PER_RANK_NAMES = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "LOCAL_WORLD_SIZE",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
)
"""Worker variables the zygote's environment leaves out besides `ETTR_*` and `TORCHELASTIC_*` (see above)."""
WARM_WAIT_S = 600.0
"""The longest the first attempt waits for the zygote's warm-up (a cold start would import as much, N times)."""
FORK_WAIT_S = 30.0
"""The longest a fork request waits for the child's pid."""


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    environ = os.environ if environ is None else environ
    return standby.enabled(environ) and environ.get(ZYGOTE_ENV, "1").strip() != "0"


def stable_env(env: Mapping[str, str]) -> dict[str, str]:
    return {
        k: v
        for k, v in env.items()
        if not k.startswith(("ETTR_", "TORCHELASTIC_")) and k not in PER_RANK_NAMES
    }


class Zygote:
    """One zygote process of the agent (see the module docstring)."""

    def __init__(
        self, process: AttemptProcess, sock: socket.socket, python: tuple[str, ...], env: dict[str, str]
    ):
        self.process, self._sock, self.python, self.env, self.cwd = process, sock, python, env, os.getcwd()
        self.spawned_at = time.time()
        self.warm_at: float | None = None
        self.broken: str | None = None
        """Why the zygote is no longer used (None: it serves)."""

    @classmethod
    def start(
        cls, argv: Sequence[str], env: Mapping[str, str], *, modules: Sequence[str] = ()
    ) -> Zygote | str:
        """A zygote for workers like `argv` under `env` (a worker's), or why there is none."""
        if not enabled():
            return f"the zygote is off ({ZYGOTE_ENV}=0 or {standby.STANDBY_ENV}=0)"
        python = standby._interpreter(argv, env)
        if python is None:
            return "not a plain `python SCRIPT` / `python -m MODULE` worker"
        if not is_child_subreaper():
            return "the supervisor is not a child subreaper: a forked worker would not be its child"
        stable = stable_env(env)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            theirs.set_inheritable(True)
            process = AttemptProcess(
                [*python, "-m", "ettr.bootstrap.zygote", str(theirs.fileno()), ",".join(modules)],
                stable,
                pass_fds=[theirs.fileno()],
            )
        except OSError as exc:
            ours.close()
            return f"the zygote could not start ({exc})"
        finally:
            theirs.close()
        containment.keep(process.pid)
        return cls(process, ours, python, stable)

    @property
    def serves(self) -> bool:
        """Whether the zygote is still used (a dead one is dropped here)."""
        if self.broken is None and self.process.poll() is not None:
            self.drop(f"the zygote had exited (status {self.process.poll()})")
        return self.broken is None

    def wait_warm(self, timeout_s: float = WARM_WAIT_S) -> bool:
        """Wait for the zygote's warm-up (at most `timeout_s`); whether it is warm (else `broken` says why)."""
        deadline = time.monotonic() + timeout_s
        while self.warm_at is None and self.broken is None:
            left = deadline - time.monotonic()
            if left <= 0:
                self.drop(f"the zygote's warm-up took over {timeout_s:.0f} s")
                break
            ready, _, _ = select.select([self._sock], [], [], min(left, 0.5))
            if ready:
                try:
                    said = self._sock.recv(ZYGOTE_MESSAGE_MAX_BYTES + 1)
                except OSError:
                    said = b""
                if said == b"w":
                    self.warm_at = time.time()
                elif said.startswith(b"n"):  # it cannot fork (threads): no use waiting for the rest
                    self.drop(said[1:].decode(errors="replace") or "the zygote cannot fork")
                else:
                    self.drop(f"the zygote ended during its warm-up (status {self.process.poll()})")
            elif self.process.poll() is not None:
                self.drop(f"the zygote ended during its warm-up (status {self.process.poll()})")
        return self.warm_at is not None

    def misfit(self, argv: Sequence[str], env: Mapping[str, str]) -> str | None:
        """Why worker `argv`, `env` may not be forked from this zygote, None when it may."""
        if not self.serves:
            return self.broken
        return standby.not_as_started(
            "zygote", (standby._interpreter(argv, env), self.python), (stable_env(env), self.env), self.cwd
        )

    def fork(self, argv: Sequence[str], env: Mapping[str, str]) -> tuple[AttemptProcess | None, str]:
        """Worker `argv`, `env` forked from the zygote (the supervisor's child), or None and why not (the
        caller starts it another way). A zygote that refused or failed is dropped (`broken`)."""
        misfit = self.misfit(argv, env) or (None if self.wait_warm() else self.broken)
        if misfit is not None:
            return None, misfit
        fds = [*os.pipe(), *os.pipe(), *os.pipe()]  # request r/w, stderr r/w, hello r/w
        request_r, request_w, stderr_r, stderr_w, hello_r, hello_w = fds
        pipe = os.fstat(stderr_w)  # the child's stderr, named as `AttemptProcess` names a started one's
        env = {**env, STDERR_TEE_ENV: f"{pipe.st_dev}:{pipe.st_ino}"}
        request = json.dumps({"argv": list(argv), "env": dict(env), "cwd": self.cwd}).encode()
        try:
            standby._make_room(request_w, len(request))
            view = memoryview(request)
            while view:
                view = view[os.write(request_w, view) :]
            os.close(request_w)
            header = json.dumps({"agent": os.getpid(), "own_session": not _stdin_is_terminal()}).encode()
            socket.send_fds(self._sock, [header], [request_r, stderr_w, hello_w])
        except OSError as exc:
            close_quietly(request_r, request_w, stderr_r, stderr_w, hello_r, hello_w)
            self.drop(f"the zygote could not be asked ({exc})")
            return None, self.broken or ""
        close_quietly(request_r, stderr_w, hello_w)
        said = _read_until_eof_or_pid(hello_r, FORK_WAIT_S)
        os.close(hello_r)
        if said.startswith(b"pid "):
            pid = int(said[4:])
            return AttemptProcess.adopt(pid, stderr_r), f"forked from the zygote (warm {self._age():.1f} s)"
        os.close(stderr_r)
        why = said[4:].decode(errors="replace") if said.startswith(b"no: ") else "the zygote did not answer"
        self.drop(why)
        return None, why

    def _age(self) -> float:
        return time.time() - (self.warm_at or time.time())

    def drop(self, why: str) -> None:
        """Stop using the zygote (`broken` says why) and end it; never raises."""
        if self.broken is None:
            self.broken = why
            logger.debug("ettr: zygote dropped: %s", why)
        self.discard()

    def discard(self) -> None:
        """EOF to the zygote (it exits), then SIGKILL; never raises. Its forked children live on."""
        try:
            self._sock.close()
        except OSError:
            pass
        if self.process.poll() is None:
            _kill(self.process)
        self.process.wait(5.0)
        self.process.finish(1.0)
        containment.keep(self.process.pid, False)


def _kill(process: AttemptProcess) -> None:
    """SIGKILL the zygote only: its tree holds the forked workers (adopted by the supervisor, not its
    descendants any more, but a middle process may be caught between its two forks)."""
    try:
        os.kill(process.pid, signal.SIGKILL)
    except OSError:
        pass


def _read_until_eof_or_pid(fd: int, timeout_s: float) -> bytes:
    """What the hello pipe said: `pid N` from the child, `no: WHY` from the zygote, b"" (EOF or no answer)."""
    deadline = time.monotonic() + timeout_s
    said = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return said
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            return said
        chunk = os.read(fd, 4096)
        if not chunk:
            return said
        said += chunk
        if said.startswith(b"pid ") and said[4:].isdigit():
            return said
