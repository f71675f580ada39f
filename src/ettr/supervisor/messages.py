"""What `ettr run` tells the person watching it: one line each, on stderr, prefixed `ettr:`.

The supervisor's parts say what they do through `say`; the job's output (the command's own stdout and
stderr) passes through unchanged around these lines.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from ettr.errors import describe_os_error
from ettr.events import split_failure_message
from ettr.untrusted import printable

# describe_os_error is ettr.errors', named here too for the supervisor's parts
__all__ = ["Progress", "describe_os_error", "ended_line", "say"]

if TYPE_CHECKING:
    from ettr.supervisor.classify import AttemptEnd

_MESSAGE_CHARS = 240


def say(message: str) -> None:
    """One line on stderr, `ettr: message`; never raises (a closed stderr is not the job's failure).

    One write, the newline with it: `print` writes the text and its newline apart, and stderr writes through,
    so a training process writing to the same file (a Slurm job's output) came between them (`... SIGKILL in
    10 sHandling auto-requeue signal: 10`, Lightning's line glued to ettr's). What is not printable is written
    as its escape (`printable`): a message quotes what the books hold (a job id, a family), which whoever
    writes the run directory or the ledger may have given a terminal escape."""
    write_stderr(f"ettr: {printable(message)}\n")


def write_stderr(text: str) -> None:
    """`text` to stderr in one write, flushed; never raises: a closed stderr (`ettr run ... 2>&-`: then
    `sys.stderr` is None) is not the job's failure."""
    stream = sys.stderr
    if stream is None:
        return
    try:
        stream.write(text)
        stream.flush()
    except (OSError, ValueError):
        pass


def ended_line(attempt: int, end: AttemptEnd, then: str) -> str:
    """`attempt 3 failed: exit status 1: ValueError: bad batch [injected ...]; restarting in 0 s (1 of 3)`:
    the attempt's recorded reason with the exception's message after its name (first line, shortened)."""
    reason = end.reason
    if end.exception and end.message:
        message, notes = split_failure_message(end.message)
        text = message.strip().splitlines()[0] if message.strip() else ""
        if len(text) > _MESSAGE_CHARS:
            text = text[: _MESSAGE_CHARS - 3] + "..."
        text = " ".join(part for part in (text, *notes) if part)  # what ettr's hooks knew: kept whole
        named = f": {end.exception}"
        if text and named in reason:
            at = reason.index(named) + len(named)
            reason = f"{reason[:at]}: {text}{reason[at:]}"
    line = f"attempt {attempt} {end.outcome}: {reason}; {then}"
    return printable(line)  # a training process's words reach the operator's terminal: no escape of theirs


class Progress:
    """When a wait worth telling about has lasted `after_s`, and every `every_s` after: `due(now)` is True.

    `ettr run` is never silent for long: a restart's back-off, a job given its grace to exit, node 0 waiting
    for its peers each say where they stand while they last."""

    def __init__(self, started_at: float, *, after_s: float = 5.0, every_s: float = 10.0) -> None:
        self.started_at = started_at
        self._next = started_at + after_s
        self._every_s = every_s

    def due(self, now: float) -> bool:
        if now < self._next:
            return False
        self._next = now + self._every_s
        return True
