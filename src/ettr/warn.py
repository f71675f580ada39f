"""Warn once: the one guard every component uses so that a recurring telemetry fault logs one line, not many."""

from __future__ import annotations

import logging
import threading

_logger = logging.getLogger("ettr")


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
