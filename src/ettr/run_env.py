"""The supervisor <-> training-process contract: every `ETTR_*` name, `RunEnv`, and the heartbeat files.

`ettr run` (the launcher side) builds a `RunEnv` per attempt and puts `to_environ()` into the child's
environment; the training process (the bootstrap, `ettr.get_recorder()`) reads it back with
`RunEnv.from_environ()`. Nothing else in ettr spells an `ETTR_*` name (the bootstrap's `sitecustomize`
repeats three of them so that processes it leaves alone never import ettr; a test keeps them equal).

The heartbeat layout lives here too, because both sides rely on it: each training process touches
`RUN_DIR/heartbeats/attempt-A/rank-R-pid-P` (see `ettr.heartbeat`), and the supervisor reads the newest
mtime of the attempt's directory. Imports nothing of ettr.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

ENV_PREFIX = "ETTR_"
"""Every name of the contract starts so (a launcher that must not leak an enclosing run's drops them all)."""

# -- names set by `ettr run` for every attempt -------------------------------------------------------------
RUN_DIR_ENV = "ETTR_RUN_DIR"
"""Absolute path of the run directory (the contract); its presence is what makes a process part of a run."""
JOB_ID_ENV = "ETTR_JOB_ID"
"""The job's id (the contract)."""
JOB_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")
"""A job id: a letter or digit, then letters, digits and `._+-` (128 at most): safe as a directory name and
in a shell command, never `.` or `..`. `ettr run` refuses another (`supervisor.config.check_job_id`), and a
reader takes no other from a ledger (`closing.recorded_job_id`): a forged one is not a recorded id."""
ATTEMPT_ENV = "ETTR_ATTEMPT"
"""The attempt index, 0 for the first attempt (the contract)."""
SUPERVISOR_PID_ENV = "ETTR_SUPERVISOR_PID"
"""The supervisor's pid (where an injected preemption is delivered)."""
ATTEMPT_STARTED_ENV = "ETTR_ATTEMPT_STARTED_AT"
"""Unix time the attempt started (the origin of `--inject KIND@time=S`)."""
INJECT_ENV = "ETTR_INJECT"
"""The JSON list of fault specs (`ettr.inject.encode_specs`); absent when nothing is injected."""
AUTO_ENV = "ETTR_AUTO"
"""'1' when the bootstrap should install the zero-code hooks, '0' for `--no-auto`."""
LAUNCHER_ENV = "ETTR_LAUNCHER"
"""The kind of command (`Launcher`), so the bootstrap knows which processes are the training ranks. A
torchrun started inside the job (by a shell script, a Makefile, a Python program) sets it to `torchrun` in
its own environment, so that its workers are the ranks (`runs_torchrun`, `ettr.bootstrap.start`)."""
LEDGER_ENV = "ETTR_LEDGER"
"""A ledger URL (`sqlite:///PATH`, `postgresql://...`) given to `ettr run --ledger`; absent: the run dir's."""
FAMILY_ENV = "ETTR_FAMILY"
"""The job family for fleet views (`ettr run --family`)."""

# -- set by the bootstrap inside the process it instruments ------------------------------------------------
INSTRUMENTED_ENV = "ETTR_INSTRUMENTED_PID"
"""Set by the bootstrap in the process it instruments, so that its own children (data loader workers,
compile workers) are not taken for training processes; cleared by the launcher for every new attempt."""
OWN_RANK_ENV, OWN_WORLD_SIZE_ENV = "ETTR_RANK", "ETTR_WORLD_SIZE"
"""Set by the bootstrap in a process whose rank it assigned (one `torch.multiprocessing.spawn` started:
`ettr.bootstrap.spawned`), in place of `RANK`/`WORLD_SIZE`, which the script may read: they win over those
in `RankEnv`. A launcher clears them for its own workers."""
RANK_BASE_ENV = "ETTR_RANK_BASE"
"""Set by the bootstrap of a process that starts its node's other ranks as scripts of their own with only
`LOCAL_RANK` to tell them apart (Lightning's subprocess launcher: `ettr.bootstrap.spawned`): the global rank
of local rank 0. Such a process's `RankEnv` rank is this plus `LOCAL_RANK` where `RANK` is not set."""

# -- user settings read by training processes (never set by the launcher) ----------------------------------
COMPILE_ENV = "ETTR_COMPILE"
"""`0`/`off` turns the compile store and recompile recording off."""
COMPILE_STORE_ENV = "ETTR_COMPILE_STORE"
"""Compile-artifact store directory or fsspec URL; `off` for none."""
COMPILE_KEY_ENV = "ETTR_COMPILE_KEY"
"""The workload's part of the store key (default: the main script's path)."""
COMPILE_STORE_MAX_BYTES_ENV = "ETTR_COMPILE_STORE_MAX_BYTES"
"""Size bound of the compile store."""
COMPILE_STORE_SECRET_ENV = "ETTR_COMPILE_STORE_SECRET"
"""HMAC key for compile-store manifests."""
COMPILE_SETTLE_S_ENV = "ETTR_COMPILE_SETTLE_S"
"""Seconds without compilation before the artifacts are stored."""
COMPILE_RESTORE_ENV = "ETTR_COMPILE_RESTORE"
"""`0`: save artifacts to the store but never restore from it (the job compiles cold, as without a
store, and leaves its artifacts for the jobs after it)."""
COMPILE_PCH_MEMO_ENV = "ETTR_COMPILE_PCH_MEMO"
"""`0`: inductor preprocesses its precompiled header in every process (`ettr.compile.pch_memo` off)."""
COMPILE_PRIVATE_CACHE_ENV = "ETTR_COMPILE_PRIVATE_CACHE"
"""`0` keeps inductor's shared cache directory instead of a per-workload one."""

AGENT_ENV = "ETTR_AGENT"
"""The supervisor's setting: `torchrun` makes a single-node torchrun command run under the real torchrun
instead of ettr's own agent (`ettr.supervisor.agent`)."""

INSTRUMENTED_WORLD_ENV = "ETTR_INSTRUMENTED_WORLD"
"""Set beside `INSTRUMENTED_ENV`: the instrumented process's world size. A Python process it starts whose
environment names a rank of a larger world (`RANK`/`WORLD_SIZE`, MPI's names) while it is alone (1) was
started as a rank by a launcher program of the user's own (`ettr.bootstrap.spawned.launched_rank`)."""
GROUP_FORM_TIMEOUT_ENV = "ETTR_GROUP_FORM_TIMEOUT_S"
"""Set by `ettr.resilient` in its own process while a generation runs (`group_form_timeout_s`): how long a
process group made in the generation may take to form, the generation's rendezvous bound; the checkpoint
manager's groups form under it (`ettr.checkpoint.coordination`), not under gloo's default 30 minutes."""
RANK_CLEARS = (OWN_RANK_ENV, OWN_WORLD_SIZE_ENV, RANK_BASE_ENV, INSTRUMENTED_WORLD_ENV)
"""The ranks ettr assigned: a launcher (torchrun, accelerate, torchrun's agent in a program) started inside
the job removes them for its workers, which have ranks of their own."""
LAUNCHER_CLEARS = (INJECT_ENV, INSTRUMENTED_ENV, LEDGER_ENV, FAMILY_ENV, *RANK_CLEARS)
"""Names the launcher removes from the environment it inherits before adding an attempt's own: a nested
or re-run `ettr run` must not pass its parent's faults, instrumentation marker, ledger, family or assigned
ranks on (the attempt's own come from its `RunEnv`)."""

# -- torchrun's names (set by torchrun, read here only) ----------------------------------------------------
RANK_ENV, WORLD_SIZE_ENV, LOCAL_RANK_ENV = "RANK", "WORLD_SIZE", "LOCAL_RANK"
SLURM_PROCID_ENV, SLURM_LOCALID_ENV, SLURM_STEP_TASKS_ENV = (
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_STEP_NUM_TASKS",
)
"""A task of an srun step: its rank, its rank on the node, the step's tasks (set by srun, not in a batch script)."""
MPI_RANK_NAMES = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),  # Open MPI's mpirun
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),  # MPICH's and Intel MPI's Hydra (mpiexec)
)
"""A process an MPI launcher started (`mpirun -np 2 python train.py`): its rank, the world's size, its rank on
the node, as each launcher names them (set by the launcher, read here only)."""
TORCHELASTIC_RUN_ID_ENV = "TORCHELASTIC_RUN_ID"
"""Present in torchrun's workers, absent in the torchrun agent itself."""


class Launcher(StrEnum):
    """What kind of command an attempt runs."""

    PYTHON = "python"
    TORCHRUN = "torchrun"
    OTHER = "other"


def python_module(command: Sequence[str]) -> tuple[str | None, int]:
    """For `python [options] -m MODULE ...`: MODULE and the index after it; else (None, 0)."""
    i = 1
    while i < len(command):
        token = command[i]
        if token == "-m":
            return (command[i + 1], i + 2) if i + 1 < len(command) else (None, 0)
        if token.startswith("-m"):
            return token[2:], i + 1
        if token in ("-X", "-W"):
            i += 2
            continue
        if not token.startswith("-") or token in ("-", "-c") or token.startswith("-c"):
            return None, 0  # a script, stdin or -c: not a module
        i += 1
    return None, 0


TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")


def detect_launcher(command: Sequence[str]) -> Launcher:
    """`torchrun ...` / `python -m torch.distributed.run ...` is TORCHRUN; `python ...` is PYTHON."""
    if not command:
        return Launcher.OTHER
    program = os.path.basename(command[0])
    if program == "torchrun":
        return Launcher.TORCHRUN
    if program.startswith("python"):
        module, _ = python_module(command)
        return Launcher.TORCHRUN if module in TORCHRUN_MODULES else Launcher.PYTHON
    return Launcher.OTHER


def runs_torchrun(orig_argv: Sequence[str]) -> bool:
    """Whether a Python process started as `orig_argv` (`sys.orig_argv`: the interpreter first) is a
    torchrun launcher: `torchrun ...` (the console script, run by its `#!` interpreter) or `python [options]
    -m torch.distributed.run|launch ...`. Its workers are the training ranks, never the launcher itself."""
    if len(orig_argv) > 1 and os.path.basename(orig_argv[1]) == "torchrun":
        return True
    return detect_launcher(orig_argv) is Launcher.TORCHRUN


def torchrun_nodes(orig_argv: Sequence[str]) -> int | None:
    """The most nodes a torchrun command line asks for (`--nnodes N`, `--nnodes=N`, elastic `MIN:MAX`: MAX);
    None when it names none or no readable number."""
    for i, arg in enumerate(orig_argv):
        if arg == "--nnodes" and i + 1 < len(orig_argv):
            text = orig_argv[i + 1]
        elif arg.startswith("--nnodes="):
            text = arg.partition("=")[2]
        else:
            continue
        try:
            return max(int(part) for part in text.split(":"))
        except ValueError:
            return None
    return None


def runs_accelerate_launch(orig_argv: Sequence[str]) -> bool:
    """Whether a Python process started as `orig_argv` is Hugging Face's `accelerate launch` (the `accelerate
    launch` / `accelerate-launch` console scripts, `python -m accelerate.commands.launch`, or the CLI module
    with `launch`): a launcher that runs the training script as a process of its own (one, or torch elastic's
    workers in its own process), never a rank itself."""
    if len(orig_argv) < 2:
        return False
    first = os.path.basename(orig_argv[1])
    if first == "accelerate-launch" or (first == "accelerate" and orig_argv[2:3] == ["launch"]):
        return True
    module, at = python_module(orig_argv)
    if module == "accelerate.commands.launch":
        return True
    return module == "accelerate.commands.accelerate_cli" and list(orig_argv[at : at + 1]) == ["launch"]


DEEPSPEED_LAUNCHER_MODULES = (
    "deepspeed.launcher.runner",
    "deepspeed.launcher.launch",
    "deepspeed.launcher.launcher_helper",
)
"""DeepSpeed's launchers: the `deepspeed` command's runner, the per-node launcher it starts (`python -u -m
deepspeed.launcher.launch`, which starts the ranks with `RANK`, `LOCAL_RANK`, `WORLD_SIZE` set), and the
helper an MPI launcher runs per rank (which starts the script as its child)."""


def runs_deepspeed_launcher(orig_argv: Sequence[str]) -> bool:
    """Whether a Python process started as `orig_argv` is one of DeepSpeed's launchers (the `deepspeed` / `ds`
    console scripts, `python -m` one of `DEEPSPEED_LAUNCHER_MODULES`): it runs the training script as
    processes of their own, never a rank itself. (A script's own `--deepspeed ds_config.json` flag is not.)"""
    if len(orig_argv) < 2:
        return False
    if os.path.basename(orig_argv[1]) in ("deepspeed", "ds"):
        return True
    return python_module(orig_argv)[0] in DEEPSPEED_LAUNCHER_MODULES


def runs_rank_launcher(orig_argv: Sequence[str]) -> bool:
    """Whether a Python process started as `orig_argv` is a launcher that starts the ranks as processes of
    their own and is left alone like a shell wrapper (`accelerate launch`, DeepSpeed's launchers): its
    children, the attempt's first Python processes below it, are the ranks (torchrun is recognised apart,
    `runs_torchrun`: its workers are told by `ETTR_LAUNCHER`)."""
    return runs_accelerate_launch(orig_argv) or runs_deepspeed_launcher(orig_argv)


def _int(environ: Mapping[str, str], name: str, default: int, *, least: int = 0) -> int:
    """`environ[name]` as a whole number >= `least` (ASCII digits), else `default`: a rank, a size or an attempt
    is never negative (`RANK=-1` made a training process's events read as the supervisor's, `SUPERVISOR_RANK`:
    a job with no training step, and nothing said why)."""
    found = _whole_number(environ.get(name, "").strip())
    return found if found is not None and found >= least else default


def _optional_int(environ: Mapping[str, str], name: str) -> int | None:
    return _whole_number(environ.get(name, "").strip())


def _whole_number(text: str) -> int | None:
    # `ettr.untrusted.whole_number`, which this leaf may not import: '²'.isdigit() is True, int('²') raises
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 300 else None


def _optional_float(environ: Mapping[str, str], name: str) -> float | None:
    try:
        value = float(environ.get(name, ""))
    except ValueError:
        return None
    return value if value - value == 0 else None  # NaN and infinities (1e400) are no time


def group_form_timeout_s(environ: Mapping[str, str] = os.environ) -> float | None:
    """`GROUP_FORM_TIMEOUT_ENV`: seconds > 0, else None (outside a generation of `ettr.resilient`)."""
    found = _optional_float(environ, GROUP_FORM_TIMEOUT_ENV)
    return found if found is not None and 0 < found < float("inf") else None


@dataclass(frozen=True, kw_only=True)
class RunEnv:
    """What `ettr run` tells one attempt's processes (the `ETTR_*` names set by the launcher)."""

    run_dir: Path
    """The run directory (absolute)."""
    job_id: str = ""
    """The job's id."""
    attempt: int = 0
    """The attempt index (0: the first)."""
    supervisor_pid: int | None = None
    """The supervisor's pid; None outside `ettr run` (`ettr.init`)."""
    attempt_started_at: float | None = None
    """Unix time the attempt started; None: unknown (the injector then uses its own start)."""
    inject: str | None = None
    """The encoded fault specs (`ettr.inject.decode_specs` reads them); None: no faults."""
    auto: bool = True
    """Whether the bootstrap installs the zero-code torch hooks (False for `--no-auto`)."""
    launcher: Launcher | None = None
    """The kind of command; None when no launcher said (`ettr.init`, an older supervisor)."""
    instrumented_pid: int | None = None
    """The pid the bootstrap instrumented (inherited by that process's own children)."""
    ledger_url: str | None = None
    """A shared ledger's URL; None: the SQLite ledger in `run_dir`."""
    family: str | None = None
    """The job family for fleet views; None: not given."""

    def __post_init__(self) -> None:
        if self.attempt < 0:
            raise ValueError(f"RunEnv.attempt must be >= 0, got {self.attempt}")
        if not str(self.run_dir):
            raise ValueError("RunEnv.run_dir must be a directory path")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> RunEnv | None:
        """The run this process belongs to (None when `ETTR_RUN_DIR` is unset). Never raises: a malformed
        number reads as its default, an unknown launcher as None."""
        environ = os.environ if environ is None else environ
        run_dir = environ.get(RUN_DIR_ENV)
        if not run_dir:
            return None
        try:
            launcher: Launcher | None = Launcher(environ.get(LAUNCHER_ENV, ""))
        except ValueError:
            launcher = None
        return cls(
            run_dir=Path(run_dir),
            job_id=environ.get(JOB_ID_ENV, ""),
            attempt=max(0, _int(environ, ATTEMPT_ENV, 0)),
            supervisor_pid=_optional_int(environ, SUPERVISOR_PID_ENV),
            attempt_started_at=_optional_float(environ, ATTEMPT_STARTED_ENV),
            inject=environ.get(INJECT_ENV) or None,
            auto=environ.get(AUTO_ENV, "1") != "0",
            launcher=launcher,
            instrumented_pid=_optional_int(environ, INSTRUMENTED_ENV),
            ledger_url=environ.get(LEDGER_ENV) or None,
            family=environ.get(FAMILY_ENV) or None,
        )

    def to_environ(self) -> dict[str, str]:
        """The `ETTR_*` variables of this run (the fields that are set; `from_environ` reads them back)."""
        env = {RUN_DIR_ENV: str(self.run_dir), JOB_ID_ENV: self.job_id, ATTEMPT_ENV: str(self.attempt)}
        if self.supervisor_pid is not None:
            env[SUPERVISOR_PID_ENV] = str(self.supervisor_pid)
        if self.attempt_started_at is not None:
            env[ATTEMPT_STARTED_ENV] = repr(self.attempt_started_at)
        if self.inject:
            env[INJECT_ENV] = self.inject
        env[AUTO_ENV] = "1" if self.auto else "0"
        if self.launcher is not None:
            env[LAUNCHER_ENV] = self.launcher.value
        if self.instrumented_pid is not None:
            env[INSTRUMENTED_ENV] = str(self.instrumented_pid)
        if self.ledger_url:
            env[LEDGER_ENV] = self.ledger_url
        if self.family:
            env[FAMILY_ENV] = self.family
        return env

    def is_training_process(self, environ: Mapping[str, str], pid: int) -> bool:
        """Whether process `pid` (with `environ`) is one of the run's training processes: not a child of a
        process already instrumented, and for a torchrun command only torchrun's workers (never the agent)."""
        if self.instrumented_pid is not None and self.instrumented_pid != pid:
            return False
        return not (self.launcher is Launcher.TORCHRUN and not environ.get(TORCHELASTIC_RUN_ID_ENV))


@dataclass(frozen=True, kw_only=True)
class RankEnv:
    """This process's place in a torchrun job (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`; one process alone)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> RankEnv:
        """`ETTR_RANK`/`ETTR_WORLD_SIZE` (a rank ettr numbered), else torchrun's `RANK`/`WORLD_SIZE`/
        `LOCAL_RANK`, else, in a task of an srun step (`SLURM_STEP_NUM_TASKS`: a batch script has none),
        Slurm's `SLURM_PROCID`/`SLURM_STEP_NUM_TASKS`/`SLURM_LOCALID` (scripts that take their rank from
        Slurm, started as `srun python train.py`), else an MPI launcher's (`MPI_RANK_NAMES`: scripts started
        as `mpirun -np N python train.py`), else one process alone."""
        environ = os.environ if environ is None else environ
        rank, world_size, local_rank = 0, 1, 0  # one process alone
        if SLURM_STEP_TASKS_ENV in environ:  # a task of an srun step
            rank = _int(environ, SLURM_PROCID_ENV, 0)
            world_size = _int(environ, SLURM_STEP_TASKS_ENV, 1, least=1)
            local_rank = _int(environ, SLURM_LOCALID_ENV, 0)
        else:
            for rank_name, size_name, local_name in MPI_RANK_NAMES:
                if rank_name in environ and size_name in environ:  # a process an MPI launcher started
                    rank = _int(environ, rank_name, 0)
                    world_size = _int(environ, size_name, 1, least=1)
                    local_rank = _int(environ, local_name, 0)
                    break
        local_rank = _int(environ, LOCAL_RANK_ENV, local_rank)
        base = _int(environ, RANK_BASE_ENV, -1)  # started by a launcher that sets LOCAL_RANK only
        if base >= 0:
            rank = base + local_rank
        rank = _int(environ, RANK_ENV, rank)
        world_size = _int(
            environ, OWN_WORLD_SIZE_ENV, _int(environ, WORLD_SIZE_ENV, world_size, least=1), least=1
        )
        own = _int(environ, OWN_RANK_ENV, -1)
        if own >= 0:  # `torch.multiprocessing.spawn`'s process index: its place on this node too
            rank, local_rank = own, _int(environ, LOCAL_RANK_ENV, own)
        return cls(rank=rank, world_size=world_size, local_rank=local_rank)


# -- heartbeat files ---------------------------------------------------------------------------------------
HEARTBEAT_DIRNAME = "heartbeats"
STEP_TAIL_DIRNAME = "steps"
"""Where training processes keep their last steps (`ettr.steptail`: `RUN_DIR/steps/rank-R-pid-P`)."""
AGENT_DIRNAME = "agent"
RUN_SUBDIRS = (HEARTBEAT_DIRNAME, AGENT_DIRNAME, STEP_TAIL_DIRNAME, "ledger-spill", "compile")
"""The subdirectories of a run directory that ettr's processes write into (heartbeats, marker files, step
tails, `ettr.ledger.spill`'s spill files, compile support's job files). Each is made, and reached, without
following a symlink (`ettr.untrusted.make_dirs_below`); `ettr run` refuses a run directory where one of
them, or a directory directly inside `heartbeats/` or `agent/`, is a symlink."""


def heartbeat_dir(run_dir: str | os.PathLike[str], attempt: int) -> Path:
    """The directory holding attempt `attempt`'s heartbeat files."""
    return Path(run_dir) / HEARTBEAT_DIRNAME / f"attempt-{attempt}"


def agent_dir(run_dir: str | os.PathLike[str], attempt: int) -> Path:
    """Where the processes of `attempt` leave their marker files for the supervisor (`RUN_DIR/agent/attempt-N`)."""
    return Path(run_dir) / AGENT_DIRNAME / f"attempt-{attempt}"


def failed_exit_path(run_dir: str | os.PathLike[str], attempt: int, pid: int) -> Path:
    """Written by a torchrun worker `pid` that ends on an uncaught exception once its Python-level exit is
    done (atexit handlers ran, its failure is in the ledger); ettr's agent then need not wait for the
    interpreter's teardown (`ettr.supervisor.workers`)."""
    return agent_dir(run_dir, attempt) / f"failed-pid-{pid}"


def exited_path(run_dir: str | os.PathLike[str], attempt: int, pid: int) -> Path:
    """Written, like `failed_exit_path`, by a torchrun worker whose Python-level exit is done without an
    uncaught exception: what it still does is the interpreter's teardown, not training (no hang)."""
    return agent_dir(run_dir, attempt) / f"exited-pid-{pid}"


def launcher_parent_path(run_dir: str | os.PathLike[str], attempt: int, pid: int) -> Path:
    """Written by a torchrun launcher started inside the job (`runs_torchrun`) whose parent chain holds the
    instrumented Python process `pid` (a Python program that started torchrun): that process is a launcher
    too, not a rank; it fires no fault and stops beating once this exists (`ettr.bootstrap.start`)."""
    return agent_dir(run_dir, attempt) / f"launcher-parent-pid-{pid}"


ZYGOTE_MESSAGE_MAX_BYTES = 1024
"""The zygote's one message after its warm-up (`ettr.bootstrap.zygote` to `ettr.supervisor.zygote`): `w`
(warm), or `n` and why it cannot fork, this many bytes at most."""
TRAINED_PREFIX = "trained-pid-"
WARM_MEMO_ENV = "ETTR_WARM_MEMO"
"""`0`: a new job's zygote does not import what the same script's workers imported in an earlier job on this
node (`ettr.supervisor.warm_memo`), and the agent does not remember it."""


def trained_path(run_dir: str | os.PathLike[str], attempt: int, pid: int) -> Path:
    """Written by training process `pid` once it recorded its first step: its start-up is over. The
    supervisor starts the next attempt's warm standbys only then (`has_trained`), so that they never compete
    with a start-up for the CPU."""
    return agent_dir(run_dir, attempt) / f"{TRAINED_PREFIX}{pid}"


UNRECORDED_PREFIX = "unrecorded-steps-pid-"


def unrecorded_steps_path(run_dir: str | os.PathLike[str], attempt: int, pid: int) -> Path:
    """Written by process `pid`, started by the job's instrumented process through multiprocessing, when it
    stepped an optimizer without having become a rank (it joined no process group: Hogwild-style training,
    `ettr.bootstrap.unrecorded`): steps are taken that nobody records."""
    return agent_dir(run_dir, attempt) / f"{UNRECORDED_PREFIX}{pid}"


def unrecorded_trainers(run_dir: str | os.PathLike[str], attempt: int) -> list[int]:
    """The pids that wrote their `unrecorded_steps_path` in `attempt`, sorted (one directory listing)."""
    try:
        with os.scandir(agent_dir(run_dir, attempt)) as entries:
            names = [entry.name for entry in entries if entry.name.startswith(UNRECORDED_PREFIX)]
    except OSError:
        return []
    pids = (_whole_number(name[len(UNRECORDED_PREFIX) :]) for name in names)
    return sorted(pid for pid in pids if pid is not None)


SIGNALLED_PREFIX = "signalled-pid-"

LAUNCHER_SIGNAL_RANK = -2
"""The rank a launcher inside the job (torchrun behind a wrapper, `accelerate launch`, DeepSpeed's) notes in its
`signalled_path`: it is no rank of the job, and it never steps (`ettr.bootstrap.start`)."""


def signalled_path(run_dir: str | os.PathLike[str], attempt: int, pid: int, signame: str) -> Path:
    """Written by training process `pid` when a signal it handles itself (`signame`, e.g. SIGTERM) reached it
    (`ettr.bootstrap.outside_signals`); it holds the process's rank and the time."""
    return agent_dir(run_dir, attempt) / f"{SIGNALLED_PREFIX}{pid}-{signame}"


def signals_received(
    run_dir: str | os.PathLike[str], attempt: int, *, before: float | None = None
) -> list[tuple[float, int, str]]:
    """(time, rank, signal name) of each `signalled_path` of `attempt` noted before `before` (all without),
    oldest first; unreadable or malformed files are skipped."""
    found: list[tuple[float, int, str]] = []
    try:
        with os.scandir(agent_dir(run_dir, attempt)) as entries:
            names = [e.name for e in entries if e.name.startswith(SIGNALLED_PREFIX)]
    except OSError:
        return []
    for name in names:
        signame = name.rsplit("-", 1)[-1]
        try:  # never through a symlink, never a FIFO (it would block)
            rank_text, ts_text = _read_regular(agent_dir(run_dir, attempt) / name, 256).decode().split()
            rank, ts = int(rank_text), float(ts_text)
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        if signame.startswith("SIG") and signame[3:].isalnum() and (before is None or ts < before):
            found.append((ts, rank, signame))
    return sorted(found)


def has_trained(run_dir: str | os.PathLike[str], attempt: int) -> bool:
    """Whether any process of `attempt` wrote its `trained_path` (one directory listing)."""
    try:
        with os.scandir(agent_dir(run_dir, attempt)) as entries:
            return any(entry.name.startswith(TRAINED_PREFIX) for entry in entries)
    except OSError:
        return False


WARM_PRIVATE_PARTS = frozenset({"torch._dynamo", "torch._inductor.compile_fx", "torch._inductor.cpu_vec_isa"})
"""The private parts of torch a standby may import ahead (`ettr.bootstrap.start.TORCH_PARTS`, `VEC_ISA_PROBE`)."""


def trained_modules(run_dir: str | os.PathLike[str], attempt: int) -> list[str]:
    """The installed packages (and slow parts of torch, dotted) the processes of `attempt` had imported by
    their first step (what their `trained_path` files list), sorted; [] when none is known. The files are
    read as anyone who can write the run directory may have written them (never through a symlink, never a
    FIFO, at most 64 KiB), and only `warmable` names are kept: the standby imports them (`listed_warm_modules`)."""
    names: set[str] = set()
    try:
        with os.scandir(agent_dir(run_dir, attempt)) as entries:
            found_files = [e.name for e in entries if e.name.startswith(TRAINED_PREFIX)]
    except OSError:
        return []
    for name in found_files:
        names.update(listed_warm_modules(agent_dir(run_dir, attempt) / name))
    return sorted(names)


def listed_warm_modules(path: str | os.PathLike[str]) -> list[str]:
    """The `warmable` names a `{"modules": [...]}` file at `path` lists (a `trained_path` file, or what the
    node remembers of a script's earlier runs, `ettr.supervisor.warm_memo`), in its order; [] when it is
    missing or malformed. Read as anyone who can write there may have written it (never through a symlink,
    never a FIFO, at most 64 KiB): a warm process imports these, so a name that is not `warmable` is dropped."""
    import json

    try:
        found = json.loads(_read_regular(Path(path), 65536) or b"{}")["modules"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return []
    if not isinstance(found, list):
        return []
    return [n for n in found if isinstance(n, str) and warmable(n)]


def warmable(name: str) -> bool:
    """Whether a standby may import `name` ahead: a public package of torch or ettr (or one of
    `WARM_PRIVATE_PARTS`), or a top-level package installed in a site-packages directory of this
    interpreter; never a `__main__`, never a module of the working directory or the standard library (a
    forged `trained_path` file named `evilmod`, `this`, `unittest.__main__`: the standby ran them)."""
    parts = name.split(".")
    if not all(part.isidentifier() for part in parts) or "__main__" in parts:
        return False
    if parts[0] in ("torch", "ettr"):
        return len(parts) > 1 and (name in WARM_PRIVATE_PARTS or not any(p.startswith("_") for p in parts))
    if len(parts) != 1 or name.startswith("_"):
        return False
    import importlib.machinery
    import site

    roots = [*site.getsitepackages(), site.getusersitepackages()]
    try:
        return importlib.machinery.PathFinder.find_spec(name, roots) is not None
    except (ImportError, ValueError, OSError):
        return False


def user_cache_home(env: Mapping[str, str] | None = None) -> str:
    """`$XDG_CACHE_HOME` when it is an absolute path, else `~/.cache` (expanded)."""
    xdg = (os.environ if env is None else env).get("XDG_CACHE_HOME", "")
    return xdg if os.path.isabs(xdg) else os.path.expanduser("~/.cache")


def _read_regular(path: Path, max_bytes: int) -> bytes:
    """The bytes of the regular file `path`, at most `max_bytes` (never through a symlink, never blocking on
    a FIFO: ELOOP / EINVAL as OSError)."""
    import errno
    import stat

    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        return os.read(fd, max_bytes)
    finally:
        os.close(fd)


def heartbeat_path(run_dir: str | os.PathLike[str], attempt: int, rank: int, pid: int | None = None) -> Path:
    """The heartbeat file of process `pid` (default: this one) of `rank` in attempt `attempt`."""
    return heartbeat_dir(run_dir, attempt) / f"rank-{rank}-pid-{os.getpid() if pid is None else pid}"


# -- memory copies of checkpoints (`ettr.checkpoint.memory`) -------------------------------------------------
MEMORY_DIR_ENV = "ETTR_MEMORY_DIR"
"""Where memory copies of checkpoints live (default: `/dev/shm/ettr-<uid>`: host memory that outlives the
processes). Each checkpoint root's copies are in a directory of their own below it; its `owner` file names
the run directory of the job that wrote them, and `ettr run` removes them when that job ends."""
SHM_ROOT = Path("/dev/shm")
MEMORY_OWNER_NAME = "owner"


def memory_root(environ: Mapping[str, str] | None = None) -> Path | None:
    """The directory memory copies go under: `ETTR_MEMORY_DIR`, else `/dev/shm/ettr-<uid>`; None where there
    is no shared-memory file system (then nothing is kept in memory)."""
    environ = os.environ if environ is None else environ
    explicit = environ.get(MEMORY_DIR_ENV, "").strip()
    if explicit:
        return Path(explicit)
    if not SHM_ROOT.is_dir():
        return None
    uid = os.geteuid() if hasattr(os, "geteuid") else 0
    return SHM_ROOT / f"ettr-{uid}"


def private_dir_problem(path: str | os.PathLike[str]) -> str | None:
    """Why `path` is not a private directory of this user (a symlink, not a directory, another user's, writable
    by others: anyone else could have planted what is in it), or None when it is one. Never follows a link."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}"
    return private_stat_problem(path, st)


def private_stat_problem(path: str | os.PathLike[str], st: os.stat_result) -> str | None:
    """`private_dir_problem` of what `os.lstat(path)` (or an fstat of its descriptor) gave: the one check of
    a private directory (memory copies, the in-place store, the compile store and inductor's cache). The
    folders above it count too (`swappable_above`): whoever may write one of them can rename this directory
    away and put theirs in its place between a check and a use."""
    import stat

    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory (a symlink?)"
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        return f"{path} is owned by uid {st.st_uid}, not this user"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):o}); chmod go-w it"
    return swappable_above(path)


def swappable_above(path: str | os.PathLike[str]) -> str | None:
    """Why someone else could replace `path` by renaming it (a folder above it that group or others may write,
    without the sticky bit that lets only an entry's owner rename it, as `/tmp` and `/dev/shm` have; or one
    that another user owns, who may make it writable whenever they like: OpenSSH's StrictModes check), or
    None. The folders of its real path are read (a link above it is the user's choice of place)."""
    import stat

    try:
        current = os.path.realpath(os.path.dirname(os.path.abspath(os.fspath(path))))
    except (OSError, ValueError):
        return None
    trusted_owners = {0, os.geteuid()} if hasattr(os, "geteuid") else None
    home = os.path.realpath(os.path.expanduser("~"))
    while True:
        try:
            st = os.stat(current)
        except OSError:
            return None  # (unreadable: whoever opens it says so)
        mode = st.st_mode
        # (a folder above the user's home is trusted whoever owns it, a cluster's /home/<group> owned by its
        # admin: its owner could swap the home itself, ~/.bashrc and all; refusing ~/.cache there adds nothing)
        above_home = home == current or home.startswith(current.rstrip(os.sep) + os.sep)
        if trusted_owners is not None and st.st_uid not in trusted_owners and not above_home:
            # `/tmp/x` made first by another user, then ETTR_MEMORY_DIR=/tmp/x/mine: `mine` is this user's and
            # private, yet the owner of `x` may rename it away between a check and a use and put theirs there.
            return (
                f"{current} (above {path}) is owned by uid {st.st_uid}, neither this user nor root: they can "
                "put a folder of theirs in place of this one; choose a folder of your own"
            )
        if mode & (stat.S_IWGRP | stat.S_IWOTH) and not mode & stat.S_ISVTX:
            return (
                f"{current} (above {path}) is writable by others (mode {stat.S_IMODE(mode):o}) without the "
                "sticky bit: anyone who may write it can put a folder of theirs in place of this one; chmod go-w it"
            )
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current = parent


def memory_dirs_of_run(
    run_dir: str | os.PathLike[str], environ: Mapping[str, str] | None = None
) -> list[Path]:
    """The memory-copy directories whose `owner` file names `run_dir` (what `ettr run` removes at the job's
    end), in a root that is this user's own (`private_dir_problem`); `owner` files read never through a link,
    never blocking (a FIFO there hung `ettr run` at the job's end). Unreadable entries are skipped."""
    root = memory_root(environ)
    if root is None or private_dir_problem(root) is not None:
        return []
    want = os.path.abspath(os.fspath(run_dir))  # the owner file holds the path's bytes (not always UTF-8)
    found = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False) and (
                os.fsdecode(_read_regular(Path(entry.path) / MEMORY_OWNER_NAME, 4096)).strip() == want
            ):
                found.append(Path(entry.path))
        except (OSError, UnicodeDecodeError):
            continue
    return found


def remove_memory_dirs_of_run(
    run_dir: str | os.PathLike[str], environ: Mapping[str, str] | None = None
) -> list[Path]:
    """Remove the memory copies (and the in-place store, `ettr.supervisor.inplace`) of the job of `run_dir` from
    shared memory: what `ettr run` does when the job ends, whatever its outcome, so nothing stays in
    /dev/shm. Returns what was removed; never raises (an entry it cannot remove is left)."""
    removed = []
    for path in memory_dirs_of_run(run_dir, environ):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            removed.append(path)
    return removed


# -- restart in place (`ettr.inplace`): what ettr's agent and the workers of a resilient job tell each other ----
INPLACE_ENV = "ETTR_INPLACE"
"""`1` in the workers of an agent that restarts a resilient job in place: on a rank's failure it keeps the other
workers running, books the next attempt and starts a replacement for a rank that died."""
INPLACE_STORE_ENV = "ETTR_INPLACE_STORE"
"""The rendezvous store every generation of a resilient job re-forms its process group over, one that
outlives any rank: `file:///PATH` (a FileStore: one host) or `tcp://HOST:PORT` (a TCPStore server)."""


def inplace_dir(run_dir: str | os.PathLike[str]) -> Path:
    """Where ettr's agent and the workers of a resilient job leave their in-place files."""
    return Path(run_dir) / AGENT_DIRNAME / "inplace"


def inplace_next_path(run_dir: str | os.PathLike[str]) -> Path:
    """Written (atomically) by the agent when it restarts the job in place: JSON {"attempt": A, "replaced":
    [ranks it started anew]}; the surviving workers wait for an attempt above theirs and join it."""
    return inplace_dir(run_dir) / "next-attempt"


def inplace_ready_path(run_dir: str | os.PathLike[str], attempt: int, pid: int) -> Path:
    """Written by worker `pid` once it runs inside `ettr.resilient` in `attempt`: the agent restarts an
    attempt in place only while every worker has one."""
    return agent_dir(run_dir, attempt) / f"inplace-ready-pid-{pid}"


def inplace_failed_path(run_dir: str | os.PathLike[str], attempt: int, pid: int) -> Path:
    """Written by worker `pid` whose training failed in `attempt` while the process lives on (an exception
    the wrapper caught): JSON {"rank", "error"}; the agent restarts the job in place as after a death."""
    return agent_dir(run_dir, attempt) / f"inplace-failed-pid-{pid}"


# -- spares (`ettr.supervisor.spares`): a replacement per local rank, parked before the in-place wrapper -----------
SPARES_ENV = "ETTR_SPARES"
"""`0` in the supervisor's environment: ettr's agent forks no spares (an in-place recovery forks its
replacement from the zygote at the failure, as before)."""
SPARE_ENV = "ETTR_SPARE"
"""In a spare's environment only: the FIFO it is promoted through (`spare_fifo_path`). A process that has it
records nothing (no events, heartbeat, markers or faults) until it is promoted (`ettr.bootstrap.spare`)."""
SPARE_MESSAGE_MAX_BYTES = 1 << 16
"""The most a spare reads of its promotion message."""


def spares_dir(run_dir: str | os.PathLike[str]) -> Path:
    """Where ettr's agent and its spares leave their files (not in an attempt's `agent_dir`: a spare is no
    process of an attempt until it is promoted)."""
    return Path(run_dir) / AGENT_DIRNAME / "spares"


def spare_fifo_path(run_dir: str | os.PathLike[str], attempt: int, local_rank: int, serial: int) -> Path:
    """The FIFO the spare of `local_rank` for `attempt` waits on (the agent's `serial`-th spare of the run): the
    agent writes one JSON line to promote it ({"env": {the attempt's late names}, "promoted_at": TS}); EOF
    without it (the agent is gone) ends it."""
    return spares_dir(run_dir) / f"attempt-{attempt}-rank-{local_rank}-{serial}.fifo"


def spare_parked_path(fifo: str | os.PathLike[str]) -> Path:
    """Written by the spare of `fifo` once it parked (it ran the script up to `ettr.resilient`'s first
    rendezvous): its pid and when it parked, JSON."""
    return Path(os.fspath(fifo)[: -len(".fifo")] + ".parked")


SPARE_LATE_NAMES = frozenset({ATTEMPT_STARTED_ENV})
"""The names of a spare's attempt known only when the attempt starts: the agent sends them at the promotion
(every other name of its environment must equal the attempt's, or the spare is not used)."""
