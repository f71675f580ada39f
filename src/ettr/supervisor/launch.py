"""What one attempt runs: the command line (torchrun given a fresh rendezvous) and its environment.

torchrun restarted in place reuses its rendezvous store, and restarted gloo workers can reach keys the dead
attempt left behind and hang. ettr restarts the whole torchrun instead, so each attempt gets a fresh port
(`--master-port` or the port of a local `--rdzv-endpoint` rewritten) and `--max-restarts=0` (restarting is
ettr's job, so that every restart is accounted).
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ettr.bootstrap import pythonpath_dir
from ettr.inject import FaultSpec, encode_specs
from ettr.run_env import LAUNCHER_CLEARS, Launcher, RunEnv, detect_launcher
from ettr.run_env import python_module as _python_module
from ettr.untrusted import open_regular

# torchrun options that take no value (everything else before the script takes one).
_TORCHRUN_FLAGS = frozenset(
    {
        "-h",
        "--help",
        "--standalone",
        "-m",
        "--module",
        "--no-python",
        "--no_python",
        "--run-path",
        "--run_path",
        "--virtual-local-rank",
        "--virtual_local_rank",
    }
)
_LOCAL_HOSTS = frozenset({"", "localhost", "127.0.0.1", "::1", "0.0.0.0"})


def _launcher_args_at(command: Sequence[str]) -> int:
    """Index of torchrun's first own argument in a torchrun command line."""
    if os.path.basename(command[0]) == "torchrun":
        return 1
    return _python_module(command)[1]


_SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "mksh", "ash", "busybox"})


def wrapper_name(command: Sequence[str]) -> str:
    """What runs the training behind `command`, for `classify`'s words: "srun", "shell wrapper"
    (`is_shell_command`), or "" (none)."""
    if not is_shell_command(command):
        return ""
    return "srun" if os.path.basename(command[0]) == "srun" else "shell wrapper"


def is_shell_command(command: Sequence[str]) -> bool:
    """Whether `command` runs a shell (`bash -c ...`, `sh run.sh`, `./run.sh` with a shell's `#!` line), or
    Slurm's `srun` (`ettr run -- srun python train.py`): its exit status 128 + N then says that what it ran
    died of signal N (srun: `task 0: Terminated`, exit 143; a SIGTERM from outside read as a plain failure
    and used a restart)."""
    if not command:
        return False
    if os.path.basename(command[0]) in (*_SHELLS, "srun"):
        return True
    try:
        with os.fdopen(open_regular(command[0], follow_symlinks=True), "rb") as f:  # a FIFO: no wait
            first = f.readline(256).decode(errors="replace")
    except OSError:
        return False
    if not first.startswith("#!"):
        return False
    words = first[2:].split()
    names = [os.path.basename(w) for w in words[:2]]  # `#!/bin/bash`, `#!/usr/bin/env bash`
    return bool(names) and (
        names[0] in _SHELLS or (names[0] == "env" and len(names) > 1 and names[1] in _SHELLS)
    )


# Where `free_port` looks first: below the kernel's ephemeral range, where no outgoing connection takes a port
# (a connection's local port, or one in TIME_WAIT for a minute after it, keeps a listener off that port: a
# port the OS handed out by bind(0) can be taken so between attempts that reuse it). The defaults of torchrun's
# --master-port and --rdzv-endpoint are never handed out, so a job started later with them cannot meet ours.
_PORTS_FROM = 20000
_PORTS_NEVER = frozenset({29400, 29500})
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


_RANDOM = random.SystemRandom()
"""Not the `random` module's generator: a script or a test that seeds it would make every process pick the
same ports."""


def _bindable(host: str, port: int) -> bool:
    """Whether `port` binds on `host` now, without SO_REUSEADDR (a port in TIME_WAIT is not free either)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing is bound to right now, on `host` nor on any address (a store listens on all): a
    random one below the kernel's ephemeral range (see `_PORTS_FROM`), or one the OS picks where that range
    starts too low to leave room or cannot be read. Another process may still take it before it is bound:
    where the binding process can be the chooser, bind port 0 instead (`ettr.testing.spawn` does)."""
    try:
        below = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        below = _PORTS_FROM
    tries = (_RANDOM.randrange(_PORTS_FROM, below) for _ in range(32 if below > _PORTS_FROM else 0))
    for port in (p for p in tries if p not in _PORTS_NEVER):
        if all(_bindable(address, port) for address in dict.fromkeys((host, "0.0.0.0"))):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _torchrun_split(command: Sequence[str]) -> tuple[int, list[tuple[str, str | None]]]:
    """Index of the first token after torchrun's options, and those options as (name, value) pairs."""
    start = _launcher_args_at(command)
    options: list[tuple[str, str | None]] = []
    i = start
    while i < len(command):
        token = command[i]
        if not token.startswith("-") or token == "-":
            break
        if token == "--":
            i += 1
            break
        name, eq, value = token.partition("=")
        if eq:
            options.append((name, value))
        elif name in _TORCHRUN_FLAGS:
            options.append((name, None))
        else:
            options.append((name, command[i + 1] if i + 1 < len(command) else ""))
            i += 1
        i += 1
    return i, options


def torchrun_options(command: Sequence[str]) -> list[tuple[str, str | None]]:
    """torchrun's own options in a torchrun command line, as (name, value) pairs ([] for other commands)."""
    if detect_launcher(command) is not Launcher.TORCHRUN:
        return []
    return _torchrun_split(command)[1]


def own_restarts(argv: Sequence[str]) -> int:
    """The restarts a torchrun process started as `argv` (`/proc/PID/cmdline`: its interpreter first, or
    `torchrun` itself) makes of its workers on its own (`--max-restarts N`, the last one given); 0 for any
    other program. ettr's own torchrun commands have `--max-restarts=0`; one a wrapper `exec`s may not."""
    argv = list(argv)
    if (
        len(argv) > 1
        and os.path.basename(argv[0]).startswith("python")
        and os.path.basename(argv[1]) == "torchrun"
    ):
        argv = argv[1:]  # the console script run by its `#!` interpreter
    values = [v for n, v in torchrun_options(argv) if _norm(n) == "--max-restarts"]
    try:
        return max(0, int(values[-1] or 0)) if values else 0
    except ValueError:
        return 0


def _norm(name: str) -> str:
    return name.replace("_", "-")


def torchrun_command(command: Sequence[str], port: int, *, any_host: bool = False) -> list[str]:
    """`command` (a torchrun command line) with a fresh rendezvous on `port` and `--max-restarts=0`.

    `--standalone` already picks a fresh port per torchrun; a `--rdzv-endpoint` on another host is left as
    is (every node would need the same new port, which one supervisor cannot arrange) unless `any_host`: the
    supervisors of a multi-node job agreed on `port` through the ledger (`multinode.py`).
    """
    script_at, options = _torchrun_split(command)
    prefix = list(command[: _launcher_args_at(command)])
    names = {_norm(n) for n, _ in options}
    backend = next((v for n, v in options if _norm(n) == "--rdzv-backend"), "static") or "static"
    out: list[tuple[str, str | None]] = []
    for name, value in options:
        norm = _norm(name)
        if norm == "--max-restarts":
            continue
        if norm == "--master-port" and "--standalone" not in names:
            master = next((v for n, v in options if _norm(n) == "--master-addr"), "") or ""
            if master in _LOCAL_HOSTS or master == socket.gethostname():
                value = str(port)
        if norm == "--rdzv-endpoint" and value is not None and "--standalone" not in names:
            host, _, _old = value.rpartition(":")
            host = host or value
            if any_host or host.strip("[]") in _LOCAL_HOSTS or host == socket.gethostname():
                value = f"{host}:{port}"
        out.append((name, value))
    out.append(("--max-restarts", "0"))
    if "--standalone" not in names and "--rdzv-endpoint" not in names and "--master-port" not in names:
        if backend == "static":
            out.append(("--master-port", str(port)))
        else:
            out.append(("--rdzv-endpoint", f"127.0.0.1:{port}"))
    rebuilt = [f"{n}={v}" if v is not None else n for n, v in out]
    return prefix + rebuilt + list(command[script_at:])


@dataclass(frozen=True, kw_only=True)
class AttemptLaunch:
    """Everything needed to start one attempt."""

    argv: tuple[str, ...]
    """The command line to execute."""
    env: Mapping[str, str]
    """Its complete environment."""


def attempt_launch(
    command: Sequence[str],
    *,
    run_dir: Path,
    job_id: str,
    attempt: int,
    started_at: float,
    inject: Sequence[FaultSpec] = (),
    auto: bool = True,
    base_env: Mapping[str, str] | None = None,
    ledger_url: str | None = None,
    family: str | None = None,
    port: int | None = None,
) -> AttemptLaunch:
    """The command line and environment of attempt `attempt` (see the module docstring); `port`: the
    rendezvous port the nodes of a multi-node job agreed on."""
    launcher = detect_launcher(command)
    argv = list(command)
    if launcher is Launcher.TORCHRUN:
        argv = torchrun_command(command, port if port is not None else free_port(), any_host=port is not None)
    run_env = RunEnv(
        run_dir=run_dir,
        job_id=job_id,
        attempt=attempt,
        supervisor_pid=os.getpid(),
        attempt_started_at=started_at,
        inject=encode_specs(inject) if inject else None,
        auto=auto,
        launcher=launcher,
        ledger_url=ledger_url,
        family=family,
    )
    inherited = os.environ if base_env is None else base_env
    env = {name: value for name, value in inherited.items() if name not in LAUNCHER_CLEARS}
    env.update(run_env.to_environ())
    existing = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(pythonpath_dir()) + (os.pathsep + existing if existing else "")
    return AttemptLaunch(argv=tuple(argv), env=env)
