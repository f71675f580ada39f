"""Why an attempt ended: outcome, exit code, signal, OOM-kill, Python exception and the end of stderr.

Pure except for `oom_kill_count`, which reads the cgroup's counter so the supervisor can tell an OOM-kill from
any other SIGKILL (read it before and after the attempt).
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ettr.events import Event, EventKind, Outcome

_OOM_EXCEPTIONS = frozenset({"OutOfMemoryError", "MemoryError"})
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*)(?::\s.*|:)?$")
_OOM_TEXT = ("CUDA out of memory", "Out of memory", "OutOfMemoryError")


@dataclass(frozen=True, kw_only=True)
class AttemptEnd:
    """The failure classification of one attempt: the data of its ATTEMPT_END event."""

    outcome: Outcome
    """completed, failed, preempted or hung."""
    exit_code: int | None
    """The command's exit status; for a death by signal, 128 + the signal number (as a shell reports it)."""
    signal: str | None = None
    """Name of the signal that ended the command (SIGKILL, ...), if one did."""
    reason: str = ""
    """One line for people: what ended the attempt."""
    exception: str | None = None
    """Type name of the Python exception that ended a training process, when known."""
    message: str | None = None
    """That exception's message, when known (`Type: message` is what people look for)."""
    oom: bool = False
    """The attempt ran out of memory (an OOM exception, or the kernel's OOM killer)."""
    stderr_tail: tuple[str, ...] = field(default_factory=tuple)
    """The last lines the command wrote to stderr."""
    injected: str | None = None
    """The `--inject` fault that fired in this attempt, if any."""

    def to_data(self) -> dict[str, Any]:
        """The ATTEMPT_END event's `data`."""
        return {
            "outcome": self.outcome.value,
            "exit_code": self.exit_code,
            "signal": self.signal,
            "reason": self.reason,
            "exception": self.exception,
            "message": self.message,
            "oom": self.oom,
            "stderr_tail": list(self.stderr_tail),
            "injected": self.injected,
        }


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


def exception_from_stderr(lines: Sequence[str]) -> str | None:
    """The exception type of the last Python traceback in `lines` (None if there is none)."""
    found = exception_line_from_stderr(lines)
    return None if found is None else found[0]


def classify(
    *,
    returncode: int,
    stderr_tail: Sequence[str] = (),
    events: Iterable[Event] = (),
    preempted_by: int | None = None,
    hung_after_s: float | None = None,
    oom_killed: bool = False,
) -> AttemptEnd:
    """Classify how an attempt ended.

    Args:
        returncode: `Popen.returncode` (negative: killed by that signal).
        stderr_tail: the last lines of its stderr.
        events: the attempt's events from training processes (FAILURE and `inject` marks are used).
        preempted_by: the signal the supervisor received and forwarded (the attempt was preempted).
        hung_after_s: set when the hang watchdog killed the attempt: the silence it saw.
        oom_killed: the cgroup's OOM-kill counter rose during the attempt.
    """
    sig = -returncode if returncode < 0 else None
    exit_code = 128 + sig if sig is not None else returncode
    exception: str | None = None
    message: str | None = None
    injected = None
    for e in events:
        data = e.data or {}
        if e.kind is EventKind.FAILURE and exception is None and data.get("exception"):
            exception = str(data["exception"])
            message = str(data["message"])[:500] if data.get("message") else None
        elif e.kind is EventKind.MARK and data.get("name") == "inject" and injected is None:
            injected = str(data.get("spec"))
    if exception is None and returncode != 0:
        found = exception_line_from_stderr(stderr_tail)
        if found is not None:
            exception, message = found
    tail_text = "\n".join(stderr_tail)
    oom = (
        (sig == signal.SIGKILL and oom_killed)
        or exception in _OOM_EXCEPTIONS
        or (returncode != 0 and any(t in tail_text for t in _OOM_TEXT))
    )
    how = f"killed by {signal_name(sig)}" if sig is not None else f"exit status {returncode}"
    if hung_after_s is not None:
        outcome = Outcome.HUNG
        reason = f"no progress and no heartbeat for {hung_after_s:.1f} s; {how}"
    elif preempted_by == signal.SIGINT:
        outcome = Outcome.INTERRUPTED
        reason = f"interrupted (SIGINT forwarded to the job); {how}"
    elif preempted_by is not None:
        outcome = Outcome.PREEMPTED
        reason = f"{signal_name(preempted_by)} forwarded to the job; {how}"
    elif returncode == 0:
        outcome = Outcome.COMPLETED
        reason = "completed"
    elif sig == signal.SIGTERM:
        # Nobody asked the supervisor to stop, yet the job got SIGTERM: a scheduler or an operator
        # preempting it directly. Counted as a preemption, and restarted like a failure.
        outcome = Outcome.PREEMPTED
        reason = f"{how}, not asked of the supervisor (a scheduler or an operator)"
    else:
        outcome = Outcome.FAILED
        reason = how + (" (out of memory)" if oom else "") + (f": {exception}" if exception else "")
    if injected:
        reason += f" [injected {injected}]"
    return AttemptEnd(
        outcome=outcome,
        exit_code=exit_code,
        signal=signal_name(sig) if sig is not None else None,
        reason=reason,
        exception=exception,
        message=message,
        oom=oom,
        stderr_tail=tuple(stderr_tail),
        injected=injected,
    )


def oom_kill_count() -> int | None:
    """The `oom_kill` counter of this process's cgroup (v2), or None where it cannot be read."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        rel = next(line.split(":", 2)[2] for line in lines if line.startswith("0::"))
        text = (Path("/sys/fs/cgroup") / rel.lstrip("/") / "memory.events").read_text()
    except (OSError, StopIteration, IndexError):
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            try:
                return int(value)
            except ValueError:
                return None
    return None
