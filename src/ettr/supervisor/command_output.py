"""What a command's exit status and output say of how it ended: the signal a shell's 128 + N names, the
last Python traceback's exception, torchrun's failure summary (which rank, which exit code) and its word that
it was signalled itself. Pure text reading, for `ettr.supervisor.classify`.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Sequence

from ettr.causes import WORKER_KILLED_TEXT

_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*)(?::\s.*|:)?$")


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def exception_line_from_stderr(lines: Sequence[str]) -> tuple[str, str | None] | None:
    """(type, message) of the last Python traceback's exception line in `lines` (None if there is none)."""
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if not starts:
        return None
    found = None
    for line in lines[starts[-1] + 1 :]:
        if line[:1].isspace():
            continue
        text = line.strip()
        match = _EXCEPTION_LINE.match(text)
        if match:
            _, _, message = text.partition(":")
            found = (match.group(1).rsplit(".", 1)[-1], message.strip() or None)
    return found


_TORCHRUN_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\b")
_TORCHRUN_EXITCODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)\b")


def torchrun_exitcodes(lines: Sequence[str]) -> dict[int, int]:
    """rank -> exit code of the failed workers that torchrun's failure summary (ChildFailedError) lists in
    `lines` (negative: killed by that signal)."""
    found: dict[int, int] = {}
    rank: int | None = None
    for line in lines:
        if match := _TORCHRUN_RANK.match(line):
            rank = int(match.group(1))
        elif (match := _TORCHRUN_EXITCODE.match(line)) and rank is not None:
            found.setdefault(rank, int(match.group(1)))
            rank = None
    return found


_SPAWN_SIGNALLED = re.compile(
    r"ProcessExitedException: process (\d+) terminated with signal (SIG[A-Z0-9]+)\b"
)


def spawn_signals(lines: Sequence[str]) -> dict[int, int]:
    """process index -> signal of the processes `torch.multiprocessing.spawn` says were killed in `lines`
    (`ProcessExitedException: process 1 terminated with signal SIGKILL`: the first of its processes to fail,
    each the rank of its index when ettr made the spawned processes ranks)."""
    found: dict[int, int] = {}
    for line in lines:
        if (match := _SPAWN_SIGNALLED.search(line)) and match.group(2) in signal.Signals.__members__:
            found.setdefault(int(match.group(1)), int(signal.Signals[match.group(2)]))
    return found


_TORCHRUN_SIGNALLED = re.compile(r"SignalException: Process \d+ got signal: (\d+)\s*$")


def torchrun_signal(lines: Sequence[str]) -> int | None:
    """The signal torchrun's agent says it got (`SignalException: Process N got signal: 15`, after which it stops
    its workers and exits 1), from the last such line of `lines`."""
    for line in reversed(lines):
        if match := _TORCHRUN_SIGNALLED.search(line):
            return int(match.group(1))
    return None


def wrapped_signal(returncode: int) -> int | None:
    """The signal N a shell's exit status 128 + N names, if it is one."""
    if not 128 < returncode < 128 + 65:
        return None
    try:
        return int(signal.Signals(returncode - 128))
    except ValueError:
        return None


def exception_from_stderr(lines: Sequence[str]) -> str | None:
    """The exception type of the last Python traceback in `lines` (None if there is none)."""
    found = exception_line_from_stderr(lines)
    return None if found is None else found[0]


_CHILD_SIGNALLED = re.compile(r"died with <Signals\.(SIG[A-Z0-9]+): (\d+)>")


def child_signal(exception: str | None, message: str | None) -> int | None:
    """The signal a launcher's `subprocess.CalledProcessError` says its child died of (`accelerate launch`'s
    one process, any Python program that runs the training with `subprocess.run(check=True)`): `Command
    [...] died with <Signals.SIGKILL: 9>.`"""
    if not exception or not exception.endswith("CalledProcessError") or not message:
        return None
    match = _CHILD_SIGNALLED.search(message)
    return int(match.group(2)) if match else None


_SHELL_DEATH = re.compile(
    r"line \d+:\s+(\d+) (Killed|Terminated|Segmentation fault|Aborted|Bus error|Floating point exception)\b"
)
_SHELL_DEATH_SIGNALS = {
    "Killed": signal.SIGKILL,
    "Terminated": signal.SIGTERM,
    "Segmentation fault": signal.SIGSEGV,
    "Aborted": signal.SIGABRT,
    "Bus error": signal.SIGBUS,
    "Floating point exception": signal.SIGFPE,
}


def shell_reported_deaths(lines: Sequence[str]) -> dict[int, int]:
    """pid -> signal of the processes a shell script says died of a signal (bash: `./run.sh: line 3:   731
    Killed   python train.py ...`), which it prints whatever the script's own exit status is."""
    found: dict[int, int] = {}
    for line in lines:
        if match := _SHELL_DEATH.search(line):
            found.setdefault(int(match.group(1)), int(_SHELL_DEATH_SIGNALS[match.group(2)]))
    return found


OOM_EXCEPTIONS = frozenset({"OutOfMemoryError", "MemoryError"})
_OOM_TEXT = ("CUDA out of memory", "Out of memory", "OutOfMemoryError")


def oom_said(exception: str | None, returncode: int, tail_text: str) -> bool:
    """The process's own words say it ran out of memory: an OOM exception, or stderr's words on a failure."""
    return exception in OOM_EXCEPTIONS or (returncode != 0 and any(t in tail_text for t in _OOM_TEXT))


def worker_sigkill_said(message: str | None, tail_text: str) -> bool:
    """A rank's words say one of its DataLoader workers was SIGKILLed (`... is killed by signal: Killed.`)."""
    return any(WORKER_KILLED_TEXT in text for text in (message or "", tail_text))
