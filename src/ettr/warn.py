"""Warn once: the one guard every component uses so that a recurring telemetry fault logs one line, not many;
and `say`, the one way a line of ettr's is written from the job's side (a training process, the injector).

Under `ettr run` a process's stderr is the supervisor's pipe (its tee), and the job's progress bar may have left
a line open there (tqdm's `\rEpoch 0:  45%|####  | 27/60 [...]`): a line of ettr's written from the job was glued
to it (`... 39.53it/s]ettr: injecting kill at step 30`). Only the tee sees what every rank and every C write put
in that stream, so the job's side puts `LINE_MARK` where its line starts, and the tee writes a newline there when
a line is open, nothing otherwise (`ettr.supervisor.messages`). The mark is written only to the tee's own pipe
(`STDERR_TEE_ENV` names it: its device and inode), never to a file or a pipe of the job's own making.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

_logger = logging.getLogger("ettr")

# The supervisor's stderr pipe, `DEV:INO`, given to the job by its tee; and where a line of ettr's starts (control
# characters no program writes in a line of text, and no terminal shows).
STDERR_TEE_ENV = "ETTR_STDERR_TEE"
LINE_MARK = "\x1f\x1e\x1f"


def _to_tee(fd: int) -> bool:
    """Whether `fd` is the supervisor's stderr pipe (the one `STDERR_TEE_ENV` names)."""
    want = os.environ.get(STDERR_TEE_ENV)
    if not want:
        return False
    try:
        info = os.fstat(fd)
    except OSError:
        return False
    return want == f"{info.st_dev}:{info.st_ino}"


def line_start(stream: object = None) -> str:
    """What a line of ettr's written to `stream` (default `sys.stderr`) starts with: `LINE_MARK` where the stream
    is the supervisor's tee, which then starts the line on a line of its own after a progress bar; else ''.
    Never raises."""
    try:
        stream = sys.stderr if stream is None else stream
        fileno = getattr(stream, "fileno", None)
        return LINE_MARK if fileno is not None and _to_tee(fileno()) else ""
    except Exception:  # a StringIO (pytest's capture), a closed stream: no tee there
        return ""


def say(message: str) -> None:
    """`message` (`ettr: ...`, printable already) as one line on the process's stderr, in one write, on a line
    of its own under `ettr run` (above); never raises (a closed stderr is not the job's failure)."""
    stream = sys.stderr
    if stream is None:
        return
    try:
        stream.flush()  # what the job wrote before goes first
        stream.write(f"{line_start(stream)}{message}\n")
        stream.flush()
    except (OSError, ValueError):
        pass


def say_raw(message: bytes) -> None:
    """`say` for a signal handler: one `os.write` to fd 2 (no lock, no logging). Never raises."""
    try:
        os.write(2, (LINE_MARK.encode() if _to_tee(2) else b"") + message + b"\n")
    except OSError:
        pass


class _LineStart(logging.Filter):
    """Marks the start of a record of the `ettr` logger that Python's last-resort handler will write (no
    handler configured: `message` alone, on stderr), so that it too starts on a line of its own under the
    tee. A record that a configured handler formats (`WARNING:ettr:...`) is left alone: its line starts
    with the handler's own words."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            logger = logging.getLogger(record.name)
            if not logger.hasHandlers() and logging.lastResort is not None:
                if record.levelno >= logging.lastResort.level and isinstance(record.msg, str):
                    start = line_start()
                    if start and not record.msg.startswith(start):
                        record.msg = start + record.msg
        except Exception:
            pass
        return True


_LINE_START = _LineStart()


def mark_line_starts() -> None:
    """Have the `ettr` logger's records start on a line of their own under the tee (`_LineStart`); idempotent.
    Called where a process of the job's side starts (`ettr.bootstrap`), not at import: importing ettr
    changes no logger."""
    if _LINE_START not in _logger.filters:
        _logger.addFilter(_LINE_START)


class WarnOnce:
    """Logs `template` to the `ettr` logger at most once per key (thread-safe; never raises).

    `template` may use `{what}` (the key) and `{error}` (`ExcType: message` of the exception given):

        warn = WarnOnce("ettr: telemetry {what} failed ({error}); training continues")
        warn("ledger append", exc)   # logged
        warn("ledger append", exc)   # not again
    """

    def __init__(self, template: str, *, logger: logging.Logger | None = None) -> None:
        self._template = template
        self._logger = logger or _logger
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, what: str = "", exc: BaseException | None = None) -> bool:
        """Log the warning for `what` unless it was logged before; whether it was logged now."""
        with self._lock:
            if what in self._seen:
                return False
            self._seen.add(what)
        error = "" if exc is None else f"{type(exc).__name__}: {exc}"
        try:
            self._logger.warning(self._template.format(what=what, error=error))
        except Exception:  # a broken handler or template must not turn a warning into a crash
            pass
        return True

    def seen(self, what: str = "") -> bool:
        """Whether `what` was warned about already."""
        return what in self._seen
