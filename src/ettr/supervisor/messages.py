"""What `ettr run` tells the person watching it: one line each, on stderr, prefixed `ettr:`.

The supervisor's parts say what they do through `say`; the job's output (the command's own stdout and
stderr) passes through unchanged around these lines.
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING, BinaryIO

from ettr.errors import describe_os_error
from ettr.events import split_failure_message
from ettr.untrusted import printable
from ettr.warn import LINE_MARK

# describe_os_error is ettr.errors', named here too for the supervisor's parts
__all__ = ["MarkCarry", "Progress", "describe_os_error", "ended_line", "relay_stderr", "say"]

if TYPE_CHECKING:
    from ettr.supervisor.classify import AttemptEnd

_MESSAGE_CHARS = 240

# Whether what went to our stderr last (the job's bytes through `relay_stderr`, or a line of ours) ended a line:
# a progress bar (tqdm's `\rEpoch 4:  58%|...|`) leaves its line open, and a line of ours written then was
# glued to the bar (`...train_accuracy: 0.156]ettr: attempt 0: first training step 5.7 s after its start`).
_stderr_lock = threading.Lock()
_line_open = False


def say(message: str) -> None:
    """One line on stderr, `ettr: message`; never raises (a closed stderr is not the job's failure).

    One write, the newline with it: `print` writes the text and its newline apart, and stderr writes through,
    so a training process writing to the same file (a Slurm job's output) came between them (`... SIGKILL in
    10 sHandling auto-requeue signal: 10`, Lightning's line glued to ettr's). What is not printable is written
    as its escape (`printable`): a message quotes what the books hold (a job id, a family), which whoever
    writes the run directory or the ledger may have given a terminal escape. Where the job's stderr (relayed
    by `relay_stderr`) left a line open, a progress bar's, the line starts on a line of its own (the job's
    stdout does not pass through ettr: a bar drawn there is not seen)."""
    global _line_open
    with _stderr_lock:
        opening = "\n" if _line_open else ""
        write_stderr(f"{opening}ettr: {printable(message)}\n")
        _line_open = False


_MARK = LINE_MARK.encode()


def relay_stderr(chunk: bytes, out: BinaryIO | None) -> bytes:
    """The job's stderr bytes `chunk` to ours (`out`: `sys.stderr.buffer`; None where it has none), noting
    whether they leave a line open (a carriage return does not end one) for `say`; the bytes relayed. Where a
    line of ettr's written from the job's side starts (`ettr.warn.LINE_MARK`: the injector's `ettr: injecting
    kill ...`, a training process's warnings) a newline is written instead when a line is open (a rank's
    progress bar), nothing otherwise. Raises what `out` raises (OSError, ValueError: our stderr is gone)."""
    global _line_open
    if not chunk:
        return chunk
    with _stderr_lock:
        if _MARK in chunk:
            pieces: list[bytes] = []
            is_open = _line_open
            for index, part in enumerate(chunk.split(_MARK)):
                if index and is_open:
                    pieces.append(b"\n")
                    is_open = False
                if part:
                    pieces.append(part)
                    is_open = not part.endswith(b"\n")
            chunk = b"".join(pieces)
            if not chunk:
                return chunk
        _line_open = not chunk.endswith(b"\n")
        if out is not None:
            out.write(chunk)
            out.flush()
        else:
            write_stderr(chunk.decode(errors="replace"))
    return chunk


class MarkCarry:
    """The bytes of a stream read in chunks, a chunk's end that may begin a `LINE_MARK` held back for the next
    one (a read may end inside the mark when the pipe was full), so that `relay_stderr` sees every mark whole."""

    def __init__(self) -> None:
        self._held = b""

    def take(self, chunk: bytes) -> bytes:
        data = self._held + chunk
        for size in range(min(len(_MARK) - 1, len(data)), 0, -1):
            if _MARK.startswith(data[-size:]):
                self._held = data[-size:]
                return data[:-size]
        self._held = b""
        return data

    def rest(self) -> bytes:
        """What is held, at the end of the stream."""
        held, self._held = self._held, b""
        return held


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
