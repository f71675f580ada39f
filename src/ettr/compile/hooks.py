"""Recording what torch.compile does: a COMPILE span per Dynamo compilation, a RECOMPILE per recompile.

Dynamo calls `torch._dynamo.callback_handler`'s start and end callbacks around every compilation
(frame tracing, lazily compiled backward graphs, ...); at the start of a recompilation its metrics
context already holds the guard-failure reason. The callbacks only append to a list: the Recorder
drops events while `torch.compiler.is_compiling()` (which torch 2.13 holds True process-wide for a
whole compile session, not only inside traced code), so the records are emitted with their true
timestamps once no compilation runs — from the training thread after each step, from the owner's
background thread, or at exit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ettr import torch_compat
from ettr.events import EventKind, Phase
from ettr.tracing import dynamo_is_tracing
from ettr.warn import WarnOnce

if TYPE_CHECKING:
    from ettr.recorder import EventSink

logger = logging.getLogger("ettr")


@dataclass(frozen=True, slots=True, kw_only=True)
class CompileRecord:
    """One Dynamo compilation, timed by its start and end callbacks."""

    begin_ts: float
    end_ts: float
    compile_id: str
    trigger: str
    """`dynamo` (a frame), `lazy_backward` (a backward graph compiled at first use), ..."""
    recompile_reason: str | None
    """The first guard-failure reason when this compilation is a recompile, else None."""

    @property
    def duration_s(self) -> float:
        return self.end_ts - self.begin_ts


def _recompile_reason() -> str | None:
    return torch_compat.dynamo_recompile_reason()


class CompileHooks:
    """Dynamo compile callbacks that record into a Recorder (never raise into compilation).

    Args:
        rec: the Recorder (anything with `span` and `record`).
        before_first_compile: called once, at the start of the first compilation, before Dynamo traces
            (restoring artifacts, applying dynamic sources); its time counts inside that compile span.
        after_compile: called with each `CompileRecord` as its compilation ends (still inside it).
    """

    def __init__(
        self,
        rec: EventSink,
        *,
        before_first_compile: Callable[[], None] | None = None,
        after_compile: Callable[[CompileRecord], None] | None = None,
    ) -> None:
        self._rec = rec
        self._before_first = before_first_compile
        self._after = after_compile
        self._lock = threading.Lock()
        self._open: list[tuple[float, str, str, str | None]] = []
        self._pending: list[CompileRecord] = []
        self._started_first = False
        self._installed = False
        self._warn_once = WarnOnce("ettr: compile hook ({what}) failed ({error}); compiling goes on")
        self.records: list[CompileRecord] = []
        """Every compilation seen so far, in end order."""
        self.last_end_ts: float | None = None

    # -- installation ------------------------------------------------------------------------------------
    def install(self) -> None:
        """Register the callbacks with Dynamo (imports `torch._dynamo`). Idempotent."""
        if self._installed:
            return
        callback_handler = torch_compat.dynamo_callback_handler()
        callback_handler.register_start_callback(self._on_start)
        callback_handler.register_end_callback(self._on_end)
        self._installed = True

    def uninstall(self) -> None:
        """Unregister the callbacks (pending records stay until `emit_pending`)."""
        if not self._installed:
            return
        callback_handler = torch_compat.dynamo_callback_handler()
        for remove, fn in (
            (callback_handler.remove_start_callback, self._on_start),
            (callback_handler.remove_end_callback, self._on_end),
        ):
            try:
                remove(fn)
            except ValueError:
                pass
        self._installed = False

    # -- state -------------------------------------------------------------------------------------------
    @property
    def in_flight(self) -> bool:
        """True while a compilation this hook saw start has not ended."""
        return bool(self._open)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def recompile_reasons(self) -> list[str]:
        return [r.recompile_reason for r in self.records if r.recompile_reason]

    # -- the callbacks (inside compilation: append only) -------------------------------------------------
    def _on_start(self, args: Any) -> None:
        try:
            begin = time.time()
            if not self._started_first:
                self._started_first = True
                if self._before_first is not None:
                    self._before_first()
            trigger = getattr(getattr(args, "callback_trigger", None), "name", "unknown").lower()
            reason = _recompile_reason() if trigger == "dynamo" else None
            with self._lock:
                self._open.append((begin, str(getattr(args, "compile_id", "")), trigger, reason))
        except Exception as exc:
            self._warn_once("start", exc)

    def _on_end(self, args: Any) -> None:
        try:
            end = time.time()
            with self._lock:
                if not self._open:
                    return
                begin, compile_id, trigger, reason = self._open.pop()
                record = CompileRecord(
                    begin_ts=begin,
                    end_ts=end,
                    compile_id=compile_id,
                    trigger=trigger,
                    recompile_reason=reason,
                )
                self._pending.append(record)
                self.records.append(record)
                self.last_end_ts = end
            if self._after is not None:
                self._after(record)
        except Exception as exc:
            self._warn_once("end", exc)

    # -- emission (outside compilation) ------------------------------------------------------------------
    def quiet(self) -> bool:
        """True when no compilation runs, so the Recorder would not drop an event recorded now."""
        return not self._open and not dynamo_is_tracing()  # the Recorder drops events only then

    def emit_pending(self) -> int:
        """Record the pending compilations if none is running now. Returns how many were recorded."""
        if not self._pending or not self.quiet():
            return 0
        with self._lock:
            batch, self._pending = self._pending, []
        for record in batch:
            try:
                self._rec.span(
                    Phase.COMPILE,
                    record.begin_ts,
                    record.end_ts,
                    source="dynamo",
                    compile_id=record.compile_id,
                    trigger=record.trigger,
                )
                if record.recompile_reason is not None:
                    # Recorder.recompile stamps "now"; the record keeps the compilation's own start time.
                    self._rec.record(
                        EventKind.RECOMPILE,
                        ts=record.begin_ts,
                        data={"reason": record.recompile_reason, "compile_id": record.compile_id},
                    )
            except Exception as exc:
                self._warn_once("emit", exc)
        return len(batch)
