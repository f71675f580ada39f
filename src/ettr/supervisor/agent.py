"""ettr as the torchrun agent of a single-node static job: a torchrun command line read into a worker spec.

For `torchrun --standalone|--nnodes 1 --nproc-per-node N [...] SCRIPT ARGS` (or `python -m
torch.distributed.run ...`) the supervisor starts the N workers itself (`ettr.supervisor.workers`), with
the environment torchrun's local agent gives them (torch/distributed/elastic/agent/server/
local_elastic_agent.py): RANK = LOCAL_RANK = ROLE_RANK, GROUP_RANK 0, WORLD_SIZE = LOCAL_WORLD_SIZE =
ROLE_WORLD_SIZE = GROUP_WORLD_SIZE = N, ROLE_NAME, MASTER_ADDR, MASTER_PORT (fresh per attempt),
TORCHELASTIC_RESTART_COUNT (restarts so far), TORCHELASTIC_MAX_RESTARTS (ettr's `--max-restarts`),
TORCHELASTIC_RUN_ID, TORCHELASTIC_USE_AGENT_STORE=False (rank 0 hosts the store, as with `env://`),
TORCH_NCCL_ASYNC_ERROR_HANDLING (1 unless set), TORCHELASTIC_ERROR_FILE (per rank, in the run directory),
and OMP_NUM_THREADS=1 when unset and N > 1. The worker command is `PYTHON -u SCRIPT ARGS`, `PYTHON -u -m
MODULE ARGS` or, with `--no-python`, `SCRIPT ARGS` — as torchrun builds it (PYTHON: `PYTHON_EXEC`, else the
interpreter that would run torchrun).

Without torchrun's agent in between, a restart needs no new agent and no second `import torch` (the
workers are warm standbys, `ettr.supervisor.standby`). Anything this module does not reproduce exactly —
more than one node, an elastic `--nnodes MIN:MAX`, `--nproc-per-node gpu|auto`, log redirection (`--tee`,
`--redirects`, `--log-dir`, `--local-ranks-filter`), `--run-path`, `--virtual-local-rank`, an rdzv
endpoint on another host, an option it does not know — returns the reason, and the supervisor launches the
real torchrun (cold, as before), saying so once. `ETTR_AGENT=torchrun` always launches the real torchrun.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ettr.run_env import AGENT_ENV, Launcher
from ettr.supervisor.launch import _LOCAL_HOSTS, _launcher_args_at, _norm, _torchrun_split, detect_launcher
from ettr.untrusted import open_dir_below, open_regular

# Options whose value changes nothing the workers see (ettr does the restarts, the monitoring and the
# shutdown itself), or whose value the spec reads.
_IGNORED = frozenset(
    {
        "--max-restarts",  # ettr's --max-restarts counts the restarts
        "--monitor-interval",  # ettr wakes on the worker's exit
        "--start-method",  # a script is always a subprocess
        "--signals-to-handle",  # ettr forwards its own signals
        "--shutdown-timeout",
        "--master-port",  # a fresh port per attempt
        "--rdzv-conf",  # read below
        "--rdzv-backend",
    }
)
_READ = frozenset(
    {
        "--standalone",
        "--nnodes",
        "--nproc-per-node",
        "--node-rank",
        "--master-addr",
        "--rdzv-endpoint",
        "--rdzv-id",
        "--role",
        "-m",
        "--module",
        "--no-python",
    }
)
FORCE_TORCHRUN = "torchrun"
"""`ETTR_AGENT=torchrun`: always launch the real torchrun."""


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """What ettr's agent starts for each attempt of a single-node static torchrun command."""

    nproc: int
    """Workers on this node (`--nproc-per-node`): the world size."""
    argv: tuple[str, ...]
    """Each worker's command line (the same for every rank)."""
    master_addr: str = "127.0.0.1"
    """MASTER_ADDR (torchrun: `--master-addr`, else this host for a static rendezvous)."""
    run_id: str = "none"
    """TORCHELASTIC_RUN_ID (`--rdzv-id`; torchrun's default `none`)."""
    role: str = "default"
    """ROLE_NAME (`--role`)."""

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ValueError(f"WorkerSpec.nproc must be >= 1, got {self.nproc}")
        if not self.argv:
            raise ValueError("WorkerSpec.argv must name a program")


def forced_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    """Whether `ETTR_AGENT=torchrun` asks for the real torchrun."""
    return (os.environ if environ is None else environ).get(AGENT_ENV, "").strip().lower() == FORCE_TORCHRUN


def torchrun_python(command: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """The interpreter torchrun would start its workers with: `PYTHON_EXEC`, else the one running
    torchrun (`python -m torch.distributed.run`'s, or the `torchrun` script's `#!` line)."""
    if environ.get("PYTHON_EXEC"):
        return environ["PYTHON_EXEC"]
    path = environ.get("PATH")
    if os.path.basename(command[0]) != "torchrun":
        found = shutil.which(command[0], path=path)
        return None if found is None else os.path.abspath(found)
    script = shutil.which(command[0], path=path)
    if script is None:
        return None
    try:
        with os.fdopen(open_regular(script, follow_symlinks=True), "rb") as f:  # a FIFO: no wait
            first = f.readline(512).decode(errors="replace").strip()
    except OSError:
        return None
    interpreter = first[2:].strip() if first.startswith("#!") else ""
    if not interpreter or " " in interpreter or not os.path.isabs(interpreter):
        return None  # `#!/usr/bin/env python`, a wrapper: not known for sure
    return interpreter


def _nnodes_single(value: str) -> bool:
    low, _, high = value.partition(":")
    return low.strip() == "1" and high.strip() in ("", "1")


def parse(command: Sequence[str], environ: Mapping[str, str] | None = None) -> WorkerSpec | str:
    """The worker spec of a single-node static torchrun command, or why ettr cannot stand in for torchrun
    (then the real torchrun runs). Pure apart from finding the interpreter on PATH."""
    environ = os.environ if environ is None else environ
    if detect_launcher(command) is not Launcher.TORCHRUN:
        return "not a torchrun command"
    if os.path.basename(command[0]) != "torchrun" and not command[1].startswith("-m"):
        return "interpreter options before -m torch.distributed.run"
    if "torch.distributed.launch" in command[: _launcher_args_at(command)]:
        return "torch.distributed.launch (passes --local-rank)"
    script_at, options = _torchrun_split(command)
    seen: dict[str, str | None] = {}
    for name, value in options:
        norm = _norm(name)
        if norm not in _IGNORED and norm not in _READ:
            return f"torchrun option {name}"
        seen[norm] = value
    if script_at >= len(command):
        return "no training script"
    standalone = "--standalone" in seen
    if not _nnodes_single(seen.get("--nnodes") or "1"):
        return f"--nnodes {seen.get('--nnodes')} (more than one node, or elastic)"
    if (seen.get("--node-rank") or "0") != "0":
        return f"--node-rank {seen['--node-rank']}"
    nproc_text = seen.get("--nproc-per-node") or "1"
    if not nproc_text.isdigit() or int(nproc_text) < 1:
        return f"--nproc-per-node {nproc_text}"
    if not standalone and (seen.get("--rdzv-backend") or "static") not in ("static", "c10d"):
        return f"--rdzv-backend {seen['--rdzv-backend']}"
    if seen.get("--rdzv-conf"):
        return "--rdzv-conf"
    master = (seen.get("--master-addr") or "").strip()
    endpoint = "" if standalone else (seen.get("--rdzv-endpoint") or "")
    host = endpoint.rpartition(":")[0].strip("[]") if ":" in endpoint else endpoint
    if host and host not in _LOCAL_HOSTS:
        return f"--rdzv-endpoint {endpoint} (another host)"
    if master and master not in _LOCAL_HOSTS:
        return f"--master-addr {master} (another host)"
    module = "-m" in seen or "--module" in seen
    no_python = "--no-python" in seen
    if module and no_python:
        return "both --no-python and --module"
    target = list(command[script_at:])
    if no_python:
        argv = target
    else:
        python = torchrun_python(command, environ)
        if python is None:
            return "the interpreter of torchrun is not known"
        argv = [python, "-u", *(["-m"] if module else []), *target]
    return WorkerSpec(
        nproc=int(nproc_text),
        argv=tuple(argv),
        master_addr="127.0.0.1" if not master or master == "0.0.0.0" else master,
        run_id=seen.get("--rdzv-id") or "none",
        role=seen.get("--role") or "default",
    )


def worker_env(
    spec: WorkerSpec,
    base: Mapping[str, str],
    *,
    local_rank: int,
    port: int,
    restart_count: int,
    max_restarts: int,
    error_file: str | os.PathLike[str],
    inherited: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The complete environment of worker `local_rank` (see the module docstring). `base`: the attempt's
    environment (the supervisor's plus the `ETTR_*` names); `inherited`: the supervisor's own environment,
    which decides the OMP_NUM_THREADS default (torchrun reads its own)."""
    inherited = os.environ if inherited is None else inherited
    n = str(spec.nproc)
    env = dict(base)
    if "OMP_NUM_THREADS" not in inherited and spec.nproc > 1:
        env["OMP_NUM_THREADS"] = "1"
    env.update(
        {
            "RANK": str(local_rank),
            "LOCAL_RANK": str(local_rank),
            "GROUP_RANK": "0",
            "ROLE_RANK": str(local_rank),
            "ROLE_NAME": spec.role,
            "LOCAL_WORLD_SIZE": n,
            "WORLD_SIZE": n,
            "GROUP_WORLD_SIZE": "1",
            "ROLE_WORLD_SIZE": n,
            "MASTER_ADDR": spec.master_addr,
            "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": str(restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
            "TORCHELASTIC_RUN_ID": spec.run_id,
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": inherited.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            "TORCHELASTIC_ERROR_FILE": str(error_file),
        }
    )
    return env


PER_ATTEMPT_NAMES = frozenset({"MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_ERROR_FILE"})
"""Worker variables that change from one attempt to the next (beside `ETTR_*`): a warm standby is started
without them and receives them at the hand-over."""


def error_file(run_dir: Path, attempt: int, local_rank: int) -> Path:
    """Where worker `local_rank` of `attempt` writes its error record (`torch...errors.record`)."""
    return run_dir / "agent" / f"attempt-{attempt}" / str(local_rank) / "error.json"


def fresh_error_file(run_dir: Path, attempt: int, local_rank: int) -> Path:
    """`error_file`, its folders made (none through a symlink) and nothing left at its name: torch's
    `errors.record` writes it with `open(file, "w")`, which follows a symlink and waits in a FIFO, so a link
    planted there by whoever may write the run directory (`-> ~/.bashrc`) had a failing worker overwrite its
    target, and a FIFO held that worker at its exit for ever. Raises OSError (`SymlinkRefused`)."""
    path = error_file(run_dir, attempt, local_rank)
    fd = open_dir_below(run_dir, path.parent.relative_to(run_dir), create=True)
    try:
        os.unlink(path.name, dir_fd=fd)
    except OSError:  # nothing there (or a directory: torch's open fails on it, and says so)
        pass
    finally:
        os.close(fd)
    return path
