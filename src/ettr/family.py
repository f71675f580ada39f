"""The job family: the name that groups runs of the same training job for fleet views (`ettr run --family`).

Without `--family`, the family is derived from the command so that every run of the same job gets the same
one: the script's file name without `.py` (`python train.py ...`, `torchrun ... train.py`), the module of
`python -m MODULE` / `torchrun -m MODULE`, else the program's name. Arguments never enter it (they change
from run to run: seeds, output paths). Pure; imports nothing of ettr.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

UNKNOWN_FAMILY = "unknown"

# torchrun options that take no value; every other option before the script takes one (`--x v` or `--x=v`).
_TORCHRUN_FLAGS = frozenset(
    {"-h", "--help", "--standalone", "--no-python", "--no_python", "--run-path", "--run_path"}
    | {"--virtual-local-rank", "--virtual_local_rank"}
)
_TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")
# python options that take a value.
_PYTHON_VALUE_OPTIONS = frozenset({"-X", "-W", "--check-hash-based-pycs"})


def _script_name(path: str) -> str:
    name = os.path.basename(path.rstrip("/")) or path
    return name[:-3] if name.endswith(".py") else name


def _after_python(command: Sequence[str], i: int) -> tuple[str, str | None]:
    """('module', M) / ('script', S) / ('other', None) for the python options starting at `i`."""
    while i < len(command):
        token = command[i]
        if token == "-m":
            return ("module", command[i + 1]) if i + 1 < len(command) else ("other", None)
        if token.startswith("-m"):
            return "module", token[2:]
        if token in ("-c", "-") or token.startswith("-c"):
            return "other", None
        if token in _PYTHON_VALUE_OPTIONS:
            i += 2
            continue
        if not token.startswith("-"):
            return "script", token
        i += 1
    return "other", None


def _after_torchrun(command: Sequence[str], i: int) -> str | None:
    module = False
    while i < len(command):
        token = command[i]
        if token in ("-m", "--module"):
            module = True
        elif token == "--":
            i += 1
            break
        elif not token.startswith("-"):
            break
        elif "=" not in token and token not in _TORCHRUN_FLAGS:
            i += 1  # its value
        i += 1
    if i >= len(command):
        return None
    return command[i] if module else _script_name(command[i])


def derive_family(command: Sequence[str]) -> str:
    """The default family of a job that runs `command` (see the module docstring)."""
    if not command:
        return UNKNOWN_FAMILY
    program = os.path.basename(command[0])
    if program == "torchrun":
        return _after_torchrun(command, 1) or program
    if program.startswith("python"):
        kind, value = _after_python(command, 1)
        if kind == "module" and value in _TORCHRUN_MODULES:
            at = list(command).index(value) + 1 if value in command else len(command)
            return _after_torchrun(command, at) or value or program
        if kind == "module" and value:
            return value
        if kind == "script" and value:
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
    return None
