"""The job family: the name that groups runs of the same training job for fleet views (`ettr run --family`).

Without `--family`, the family is derived from the command so that every run of the same job gets the same
one: the script's file name without `.py` (`python train.py ...`), the module of `python -m MODULE`, else the
program's name. A launcher is looked through to the command it runs, its own options skipped: `torchrun`
(and `python -m torch.distributed.run`), `accelerate launch`, `deepspeed` / `ds`, `srun`, `mpirun` /
`mpiexec`, nested too (`srun torchrun train.py` is `train`); so `accelerate launch --num_processes 2
train.py` is `train`, never `accelerate` (which would put every accelerate script in one family). A
launcher with nothing after its options is its own family. So are a shell and `env` looked through: `bash
run.sh` is `run.sh`, as `./run.sh` is; `bash -c 'torchrun train.py'` and `env OUT=x python train.py` are
`train` (before, every shell-wrapped job of a fleet was one family `bash`, and every job started through `env`
one family `env`). Arguments never enter it (they change from run
to run: seeds, output paths). Pure, never raises; imports nothing of ettr.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass

UNKNOWN_FAMILY = "unknown"

# python options that take a value.
_PYTHON_VALUE_OPTIONS = frozenset({"-X", "-W", "--check-hash-based-pycs"})
_PYTHON = re.compile(r"python[0-9.]*")


@dataclass(frozen=True, kw_only=True)
class _Launcher:
    """How a launcher's options are read; names without their dashes, `-` as `_` (`--num-gpus`: num_gpus)."""

    flags: frozenset[str]
    """Options that take no value (or one only as `--x=v`). Any other takes one: `--x v` or `--x=v`."""
    pairs: frozenset[str] = frozenset()
    """Options that take two values (`mpirun -mca btl tcp`)."""
    module: frozenset[str] = frozenset()
    """Flags that make the command a module name (`torchrun -m pkg.train`)."""
    program: frozenset[str] = frozenset()
    """Flags that make the command a program rather than a Python script (`--no_python`)."""
    runs_program: bool = False
    """The command is a program of its own (`srun python train.py`), not a Python script."""
    bundles: bool = False
    """Single-dash options are letters that bundle, getopt style (`srun -lN2`)."""


def _names(*groups: str) -> frozenset[str]:
    return frozenset(" ".join(groups).split())


_TORCHRUN = _Launcher(
    flags=_names("h help standalone run_path virtual_local_rank"),
    module=_names("m module"),
    program=_names("no_python"),
)
# `accelerate launch --help` (accelerate 1.x): every other option takes a value.
_ACCELERATE = _Launcher(
    flags=_names(
        "h help q quiet debug cpu multi_gpu tpu tpu_cluster no_tpu_cluster tpu_use_sudo same_network",
        "enable_cpu_affinity downcast_bf16 dynamo_use_dynamic dynamo_use_fullgraph",
        "dynamo_use_regional_compilation fp8_use_autocast_during_eval use_deepspeed use_fsdp",
        "use_megatron_lm use_parallelism_config",
    ),
    module=_names("m module"),
    program=_names("no_python"),
)
# deepspeed/launcher/runner.py (DeepSpeed 0.19).
_DEEPSPEED = _Launcher(
    flags=_names("h help q quiet no_local_rank no_ssh no_ssh_check force_multi save_pid bind_cores_to_rank"),
    module=_names("module"),
    program=_names("no_python"),
)
# srun(1) of Slurm 22.05: the options without a value or with an optional one (`--exclusive[=user]`).
_SRUN = _Launcher(
    flags=_names(
        "E H I K O Q V X Z h k l s u v bcast compress contiguous disable_status exact exclusive help hold",
        "immediate kill_on_bad_exit label multi_prog nice no_allocate no_kill overcommit overlap",
        "oversubscribe preserve_env propagate pty quiet quit_on_interrupt reboot resv_ports send_libs",
        "spread_job test_only unbuffered usage use_min_nodes verbose version whole x11",
    ),
    runs_program=True,
    bundles=True,
)
# `mpirun --help all` of Open MPI 4.1 (`-np` and `--np` alike), and MPICH / Intel MPI's hydra `mpiexec`.
_MPIRUN = _Launcher(
    flags=_names(
        "V allow_run_as_root bind_to_core bind_to_socket bycore bynode byslot continuous d debug",
        "debug_daemons debug_daemons_file debug_devel disable_recovery display_allocation",
        "display_devel_allocation display_devel_map display_diffable_map display_map display_topo",
        "do_not_launch do_not_resolve dvm enable_instant_on_support enable_recovery fwd_mpirun_port",
        "get_stack_traces h help index_argv_by_rank leave_session_attached merge_stderr_to_stdout nolocal",
        "nooversubscribe noprefix novm output_proctable oversubscribe pernode preload_binary q quiet",
        "report_bindings report_child_jobs_separately report_state_on_timeout s set_cwd_to_session_dir",
        "show_progress tag_output timestamp_output tv use_hwthread_cpus use_regexp v verbose version xml",
        "genvall genvnone envall envnone l prepend_rank print_all_exitcodes ordered_output info",
    ),
    pairs=_names("mca gmca prtemca pmixmca genv env"),
    runs_program=True,
)
_PROGRAMS = {"torchrun": _TORCHRUN, "accelerate-launch": _ACCELERATE, "deepspeed": _DEEPSPEED}
_PROGRAMS.update({"ds": _DEEPSPEED, "srun": _SRUN, "orterun": _MPIRUN})
_MODULES = {
    "torch.distributed.run": _TORCHRUN,
    "torch.distributed.launch": _TORCHRUN,
    "accelerate.commands.launch": _ACCELERATE,
    "deepspeed.launcher.runner": _DEEPSPEED,
}
_ACCELERATE_CLIS = ("accelerate", "accelerate.commands.accelerate_cli")  # `... launch` is _ACCELERATE
_SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh"})
_SHELL_VALUE_OPTIONS = frozenset({"-o", "+o", "-O", "+O", "--rcfile", "--init-file"})
_ENV_VALUE_OPTIONS = frozenset({"-u", "--unset", "-C", "--chdir"})


def _script_name(path: str) -> str:
    name = os.path.basename(path.rstrip("/")) or path
    return name[:-3] if name.endswith(".py") else name


def _launcher_of(program: str) -> _Launcher | None:
    if program.startswith(("mpirun", "mpiexec")):  # mpirun.openmpi, mpiexec.hydra
        return _MPIRUN
    return _PROGRAMS.get(program)


def _starts_a_command(token: str) -> bool:
    """Whether `token` reads as the start of the launched command rather than an option's value."""
    name = os.path.basename(token)
    return name.endswith(".py") or bool(_PYTHON.fullmatch(name)) or _launcher_of(name) is not None


def _after_python(command: Sequence[str], i: int) -> tuple[str, str | None, int]:
    """('module', M, at) / ('script', S, at) / ('other', None, at) for the python options starting at `i`;
    `at` is where the module's or script's own arguments start."""
    while i < len(command):
        token = command[i]
        if token == "-m":
            return ("module", command[i + 1], i + 2) if i + 1 < len(command) else ("other", None, i)
        if token.startswith("-m"):
            return "module", token[2:], i + 1
        if token in ("-c", "-") or token.startswith("-c"):
            return "other", None, i
        if token in _PYTHON_VALUE_OPTIONS:
            i += 2
            continue
        if not token.startswith("-"):
            return "script", token, i + 1
        i += 1
    return "other", None, i


def _option_width(command: Sequence[str], i: int, launcher: _Launcher, name: str) -> int:
    """How many tokens the option `command[i]` (called `name`) spans with its values."""
    token = command[i]
    if launcher.bundles and not token.startswith("--"):
        for k, letter in enumerate(token[1:]):  # `-lN2`, `-lN 2`: letters up to the first that takes a value
            if letter not in launcher.flags:
                return 1 if k + 2 < len(token) else 2
        return 1
    if "=" in token or name in launcher.flags or name in launcher.module or name in launcher.program:
        return 1
    if name in launcher.pairs:
        return 3
    # An option that takes a value, or one this table does not know: not when the command comes next.
    return 1 if i + 1 < len(command) and _starts_a_command(command[i + 1]) else 2


def _after_launcher(command: Sequence[str], i: int, launcher: _Launcher) -> str | None:
    """The family of what `launcher` runs, its options starting at `i`; None when nothing follows them."""
    module = program = False
    start = i
    while i < len(command):
        token = command[i]
        if token == "--":
            i += 1
            break
        if not token.startswith("-") or token == "-":
            break
        name = token.split("=", 1)[0].lstrip("-").replace("-", "_")
        module = module or name in launcher.module
        program = program or name in launcher.program
        i += _option_width(command, i, launcher, name)
    if i >= len(command):
        # The options read wrong (an option of a newer version): the first token that looks like a command.
        i = next((k for k in range(start, len(command)) if _starts_a_command(command[k])), len(command))
        if i >= len(command):
            return None
    if module:
        return command[i]
    if program or launcher.runs_program:
        return _family(command[i:])
    return _script_name(command[i])


def _options_end(
    command: Sequence[str], value_options: frozenset[str], is_flag: Callable[[str], bool]
) -> tuple[int, list[str]]:
    """Where the options of a wrapper (`command[0]`: a shell, `env`) end, and the one-word flags among them:
    `--` ends them, one of `value_options` takes the word after it, a word `is_flag` accepts is one."""
    i, flags = 1, list[str]()
    while i < len(command):
        token = command[i]
        if token == "--":
            return i + 1, flags
        if token in value_options:
            i += 2
        elif is_flag(token):
            flags.append(token)
            i += 1
        else:
            break
    return i, flags


def _after_shell(command: Sequence[str]) -> str | None:
    """The family of what a shell (`command[0]`) runs: its script, or its `-c` string's command."""
    i, flags = _options_end(
        command, _SHELL_VALUE_OPTIONS, lambda t: t.startswith(("-", "+")) and t not in ("-", "+")
    )
    if i >= len(command):
        return None
    if any(not f.startswith("--") and "c" in f[1:] for f in flags):
        try:
            return _family(shlex.split(command[i])) or None
        except ValueError:  # unbalanced quotes: no command can be read from it
            return None
    return _family(command[i:])


def _after_env(command: Sequence[str]) -> str | None:
    """The family of what `env [OPTION]... [NAME=VALUE]... COMMAND` runs."""
    i, _ = _options_end(
        command, _ENV_VALUE_OPTIONS, lambda t: t.startswith("-") or ("=" in t and not t.startswith("="))
    )
    return _family(command[i:]) or None


def derive_family(command: Sequence[str]) -> str:
    """The default family of a job that runs `command` (see the module docstring); never empty."""
    return _family(command) or UNKNOWN_FAMILY


def _family(command: Sequence[str]) -> str:
    if not command:
        return ""
    program = os.path.basename(command[0])
    if program in _ACCELERATE_CLIS and len(command) > 1 and command[1] == "launch":
        return _after_launcher(command, 2, _ACCELERATE) or program
    launcher = _launcher_of(program)
    if launcher is not None:
        return _after_launcher(command, 1, launcher) or program
    if program in _SHELLS:
        return _after_shell(command) or program
    if program == "env":
        return _after_env(command) or program
    if program.startswith("python"):
        kind, value, at = _after_python(command, 1)
        if kind == "module" and value in _ACCELERATE_CLIS and at < len(command) and command[at] == "launch":
            return _after_launcher(command, at + 1, _ACCELERATE) or value or program
        if kind == "module" and value in _MODULES:
            return _after_launcher(command, at, _MODULES[value]) or value or program
        if kind == "module" and value:
            return value
        if kind == "script" and value:
            if _launcher_of(os.path.basename(value)) or os.path.basename(value) in _ACCELERATE_CLIS:
                return _family(command[at - 1 :])  # `python .../bin/deepspeed ...`
            return _script_name(value)
        return program
    return _script_name(program)


def valid_family(name: str) -> str | None:
    """What is wrong with `name` as a family, or None when it is fine."""
    if not name or not name.strip():
        return "must not be empty"
    if len(name) > 200:
        return "must be at most 200 characters"
    if any(ch in name for ch in "\n\r\t"):
        return "must be one line"
    if not name.isprintable():  # an escape sequence would reach every terminal `ettr fleet` prints to
        return "must not hold control characters"
    return None
