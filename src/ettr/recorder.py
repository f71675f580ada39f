"""The Recorder: how a training process writes events, at the cost of an in-memory append.

Calls on the training thread build a tuple and append it to a deque; a daemon writer thread moves the
queue to the ledger at least every `flush_interval_s`, at once for urgent kinds (attempt ends, failures,
checkpoint commits) and at `close()`. Nothing here raises into the caller: a telemetry error is logged once
and the training goes on.

Observers register with `add_listener(fn)`: `fn(event)` runs synchronously on the recording thread for
every event recorded (also on a recorder that writes nothing), and its errors are logged once, never raised.
Only the process's default recorder (`ettr.runtime`) takes the process hooks (`install_process_hooks`: close
at interpreter exit, record nothing in a forked child); `close()` takes them off again.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ettr.constants import TRAINING_ENDED_MARK
from ettr.events import URGENT_KINDS, Event, EventKind, Phase, failure_message, reraised_message
from ettr.ledger import Ledger
from ettr.ledger.rows import as_int
from ettr.tracing import dynamo_is_tracing
from ettr.warn import WarnOnce

logger = logging.getLogger("ettr")

_MAX_QUEUED = 2_000_000  # beyond this (a ledger that cannot be written for long) the oldest are dropped
MAX_BATCH = 2000
CLOSE_RETRY_S = 2.0
"""How long `close` keeps retrying a failing ledger before the rest of the queue is given up."""
"""Most events one ledger transaction of the writer holds (a few hundred KB)."""

EventListener = Callable[[Event], None]
"""Called with each recorded event, synchronously, on the thread that recorded it."""

# Recorders with process hooks, disabled in a forked child by one at-fork hook registered once per process
# (os.register_at_fork cannot be undone, so closed recorders leave this set instead).
_hooked: weakref.WeakSet[Recorder] = weakref.WeakSet()
_fork_hook_lock = threading.Lock()
_fork_hook_registered = False


def _disable_hooked_in_child() -> None:
    for rec in list(_hooked):
        rec._disable_in_child()


def _as_phase(phase: Phase | str) -> tuple[Phase, dict[str, Any] | None]:
    if isinstance(phase, Phase):
        return phase, None
    try:
        return Phase(phase), None
    except ValueError:
        return Phase.OTHER, {"name": str(phase)}


class _PhaseSpan:
    """Context manager returned by `Recorder.phase`: PHASE_BEGIN on enter, PHASE_END on exit."""

    __slots__ = ("_recorder", "_phase", "_step", "_data", "_begin")

    def __init__(self, recorder: Recorder, phase: Phase, step: int | None, data: dict[str, Any] | None):
        self._recorder, self._phase, self._step, self._data = recorder, phase, step, data
        self._begin = 0.0

    def __enter__(self) -> _PhaseSpan:
        open_phases = self._recorder._open_phases
        open_phases[self._phase] = open_phases.get(self._phase, 0) + 1
        self._begin = time.time()
        self._recorder.record(
            EventKind.PHASE_BEGIN, phase=self._phase, step=self._step, data=self._data, ts=self._begin
        )
        return self

    def add(self, **data: Any) -> None:
        """More data for the PHASE_END (what the phase found out: how it did its work, why it fell back)."""
        self._data = {**(self._data or {}), **data}

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        open_phases = self._recorder._open_phases
        open_phases[self._phase] = open_phases.get(self._phase, 1) - 1
        data = self._data
        if exc_type is not None:
            data = {**(data or {}), "error": exc_type.__name__}
        self._recorder.record(
            EventKind.PHASE_END, phase=self._phase, step=self._step, value=self._begin, data=data
        )


class EventSink(Protocol):
    """The narrow seam most components need of a recorder: write events (`record`, `phase`, `span`, `mark`),
    `flush`, and who writes them (`attempt`, `rank`, `run_dir`, `job_id`). Every `RecorderProtocol` is
    one; a component that needs more (checkpoint commits, step listeners, the step counter) takes the
    whole `RecorderProtocol`. Every method must be cheap and must never raise.
    """

    attempt: int
    rank: int
    run_dir: Path | None
    job_id: str

    def record(
        self,
        kind: EventKind,
        *,
        phase: Phase | None = None,
        step: int | None = None,
        value: float | None = None,
        data: Mapping[str, Any] | None = None,
        ts: float | None = None,
    ) -> None: ...

    def phase(self, phase: Phase | str, *, step: int | None = None, **data: Any) -> Any: ...

    def span(
        self,
        phase: Phase | str,
        begin_ts: float,
        end_ts: float | None = None,
        *,
        step: int | None = None,
        **data: Any,
    ) -> None: ...

    def mark(self, name: str, **data: Any) -> None: ...

    def flush(self, timeout_s: float = 5.0) -> None: ...


@runtime_checkable
class RecorderProtocol(EventSink, Protocol):
    """What the training side needs of a recorder: the `EventSink`, and the step counter, checkpoint and
    failure events, listeners, the lifecycle. The type of every `rec` parameter that needs more than
    the sink.

    `Recorder` (queue + writer thread) is the real one; `NullRecorder` records nothing; tests use the
    synchronous recorder in `ettr.testing`. Every method must be cheap and must never raise.
    """

    enabled: bool
    world_size: int
    last_step: int | None
    explicit_steps: bool

    def is_open(self, phase: Phase) -> bool: ...

    def step(self, step: int, *, auto: bool = False) -> None: ...

    def note_arrival(self) -> None: ...

    def training_started(self) -> None: ...

    def training_ended(self, step: int | None = None) -> None: ...

    def resumed_from(self, step: int | None) -> None: ...

    def checkpoint_committed(self, step: int, path: str | os.PathLike[str]) -> None: ...

    def checkpoint_error(
        self, step: int | None, path: str | os.PathLike[str], error: BaseException | str
    ) -> None: ...

    def recompile(self, reason: str, **data: Any) -> None: ...

    def failure(self, exc: BaseException, *, launcher: bool = False) -> None: ...

    def add_step_listener(self, listener: Callable[[int], None]) -> None: ...

    def add_listener(self, listener: EventListener) -> None: ...

    def remove_listener(self, listener: EventListener) -> None: ...

    def close(self) -> None: ...


class Recorder:
    """Rank-aware event recorder of one training process (thread-safe, never raises).

    Args:
        ledger: where events go; None makes a recorder that records nothing.
        run_dir: the run directory (for components that keep files beside the ledger).
        job_id: the job's id.
        attempt: the attempt index (`ETTR_ATTEMPT`).
        rank: this process's global rank; `world_size` the number of ranks.
        flush_interval_s: the longest an event waits in memory before it is written.
    """

    def __init__(
        self,
        ledger: Ledger | None,
        *,
        run_dir: str | os.PathLike[str] | None = None,
        job_id: str = "",
        attempt: int = 0,
        rank: int = 0,
        world_size: int = 1,
        flush_interval_s: float = 0.5,
    ) -> None:
        self._ledger = ledger
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.job_id = job_id
        self.attempt = attempt
        self.rank = rank
        self.world_size = world_size
        self.flush_interval_s = flush_interval_s
        self.enabled = ledger is not None
        self.last_step: int | None = None
        self.explicit_steps = False
        self._arrival_ts: float | None = None  # see note_arrival
        self._queue: collections.deque[tuple[Any, ...]] = collections.deque()
        self._wake = threading.Event()
        self._drain_lock = threading.Lock()
        self._closed = False
        self._warn = WarnOnce("ettr: telemetry {what} failed ({error}); training continues")
        self._step_listeners: list[Callable[[int], None]] = []
        self._listeners: tuple[EventListener, ...] = ()  # replaced, never mutated: safe to iterate
        self._listeners_lock = threading.Lock()
        self._open_phases: dict[Phase, int] = {}
        self._has_process_hooks = False
        self._thread: threading.Thread | None = None
        if self.enabled:
            self._thread = threading.Thread(target=self._writer, name="ettr-recorder", daemon=True)
            self._thread.start()

    def install_process_hooks(self) -> None:
        """Close at interpreter exit and record nothing in a forked child (a DataLoader worker must not
        write through the parent's connection). For the process's default recorder (`ettr.runtime` calls
        it); `close()` removes them. Idempotent."""
        global _fork_hook_registered
        if not self.enabled or self._closed or self._has_process_hooks:
            return
        self._has_process_hooks = True
        atexit.register(self.close)
        _hooked.add(self)
        with _fork_hook_lock:
            if not _fork_hook_registered and hasattr(os, "register_at_fork"):
                os.register_at_fork(after_in_child=_disable_hooked_in_child)
                _fork_hook_registered = True

    @property
    def has_process_hooks(self) -> bool:
        """Whether this recorder is closed at interpreter exit and disabled in forked children."""
        return self._has_process_hooks

    # -- the one primitive -------------------------------------------------------------------------------
    def record(
        self,
        kind: EventKind,
        *,
        phase: Phase | None = None,
        step: int | None = None,
        value: float | None = None,
        data: Mapping[str, Any] | None = None,
        ts: float | None = None,
    ) -> None:
        """Queue one event (timestamp now unless `ts` is given) and tell the listeners. Costs an append;
        never raises."""
        if self.enabled:
            try:
                if dynamo_is_tracing():  # a record while Dynamo traces would break the user's graph
                    return
                if step is not None and type(step) is not int:
                    step = self._step_number(step)
                    if step is None:
                        return
                if ts is None:
                    ts = time.time()
                self._queue.append((kind, ts, phase, step, value, data))
                if kind in URGENT_KINDS:
                    self._wake.set()
            except Exception as exc:  # pragma: no cover - defensive
                self._warn_once("record", exc)
                return
        elif not self._listeners or dynamo_is_tracing():
            return
        listeners = self._listeners
        if listeners:
            event_ts = time.time() if ts is None else ts
            self._notify(listeners, Event(kind, event_ts, self.attempt, self.rank, phase, step, value, data))

    def _notify(self, listeners: tuple[EventListener, ...], event: Event) -> None:
        for listener in listeners:
            try:
                listener(event)
            except Exception as exc:
                self._warn_once("listener", exc)

    # -- conveniences for training code ------------------------------------------------------------------
    def phase(self, phase: Phase | str, *, step: int | None = None, **data: Any) -> _PhaseSpan:
        """Context manager recording a phase from enter to exit (also on an exception)."""
        phase_enum, extra = _as_phase(phase)
        payload = {**extra, **data} if extra else (data or None)
        return _PhaseSpan(self, phase_enum, step, payload)

    def span(
        self,
        phase: Phase | str,
        begin_ts: float,
        end_ts: float | None = None,
        *,
        step: int | None = None,
        **data: Any,
    ) -> None:
        """Record a phase timed after the fact: one PHASE_END whose value is the begin timestamp."""
        phase_enum, extra = _as_phase(phase)
        payload = {**extra, **data} if extra else (data or None)
        self.record(EventKind.PHASE_END, phase=phase_enum, step=step, value=begin_ts, data=payload, ts=end_ts)

    def is_open(self, phase: Phase) -> bool:
        """Whether user code is inside `with phase(phase)` now (automatic hooks then record nothing)."""
        return self._open_phases.get(phase, 0) > 0

    def step(self, step: int, *, auto: bool = False) -> None:
        """Global optimizer step `step` has just completed.

        `auto=True` is for the zero-code bootstrap: its guesses stop once user code calls `step` itself.
        """
        if type(step) is not int:
            coerced = self._step_number(step)
            if coerced is None:
                return
            step = coerced
        if auto:
            if self.explicit_steps:
                return
        else:
            self.explicit_steps = True
        self.last_step = step
        arrival, self._arrival_ts = self._arrival_ts, None
        self.record(EventKind.STEP, step=step, value=arrival)
        for listener in self._step_listeners:
            try:
                listener(step)
            except Exception as exc:
                self._warn_once("step listener", exc)

    def note_arrival(self) -> None:
        """This rank is ready for its step's gradient sync now (the bootstrap calls it as a backward pass
        starts): the next STEP carries the time as its `value`, so the accounting can tell which rank its
        peers waited for (`ettr.accounting.stragglers`). The last call before a STEP wins (gradient
        accumulation: the micro-batch whose backward syncs). A time read and an attribute set; never raises."""
        self._arrival_ts = time.time()

    def _step_number(self, step: Any) -> int | None:
        # numpy ints and 0-d integer tensors (Adam's state['step']) are step numbers; anything else is dropped.
        try:
            return as_int(step)
        except (TypeError, ValueError, RuntimeError):
            self._warn_once("step number", TypeError(f"{type(step).__name__} {step!r:.40} is not an integer"))
            return None

    def training_started(self) -> None:
        """The training loop begins now (ends the start-up region of this attempt)."""
        self.record(EventKind.TRAINING_START)

    def training_ended(self, step: int | None = None) -> None:
        """The training loop has ended after `step` (default: the last step this process completed or resumed
        from): a `TRAINING_ENDED_MARK` MARK with that step, written at once (a rank killed during the
        teardown that follows still leaves it in the books). Not recorded while an exception is being handled (a `finally:` or `except:` on the way out of
        a failed loop is no end of training)."""
        if sys.exc_info()[0] is not None:
            return
        if step is None:
            step = self.last_step
        self.record(EventKind.MARK, step=step, data={"name": TRAINING_ENDED_MARK})
        self._wake.set()

    def resumed_from(self, step: int | None) -> None:
        """This attempt restored the state as of after `step` (None: it starts from scratch)."""
        self.record(EventKind.RESUMED, step=step)
        if step is not None:
            self.last_step = step

    def checkpoint_committed(self, step: int, path: str | os.PathLike[str]) -> None:
        """The checkpoint of `step` at `path` is durable and visible (flushed at once)."""
        self.record(EventKind.CHECKPOINT_COMMIT, step=step, data={"path": os.fspath(path)})

    def checkpoint_error(
        self, step: int | None, path: str | os.PathLike[str], error: BaseException | str
    ) -> None:
        """A checkpoint save failed; training goes on from the previous committed one."""
        self.record(
            EventKind.CHECKPOINT_ERROR, step=step, data={"path": os.fspath(path), "error": str(error)}
        )

    def recompile(self, reason: str, **data: Any) -> None:
        """torch.compile recompiled (the guard-failure `reason`)."""
        self.record(EventKind.RECOMPILE, data={"reason": reason, **data})

    def failure(self, exc: BaseException, *, launcher: bool = False) -> None:
        """An exception is about to end this process (flushed at once). Notes ettr's hooks added to the
        exception (`FAILURE_NOTE_PREFIX`: what they know of the failure, e.g. a torn checkpoint) follow the
        message, each on a line of its own (`failure_message`). `launcher`: this process became the launcher
        of the ranks (`data.launcher`): its exception reports theirs (torch elastic's `ChildFailedError`
        once it has stopped the others), never the failure's own instant."""
        message = failure_message(reraised_message(str(exc))[:500], getattr(exc, "__notes__", None) or ())
        data: dict[str, Any] = {"exception": type(exc).__name__, "message": message}
        if launcher:
            data["launcher"] = True
        self.record(EventKind.FAILURE, data=data)

    def mark(self, name: str, **data: Any) -> None:
        """Anything else worth keeping, by name."""
        self.record(EventKind.MARK, data={"name": name, **data})

    def add_step_listener(self, listener: Callable[[int], None]) -> None:
        """Call `listener(step)` on the training thread after each STEP (fault injection, policies)."""
        self._step_listeners.append(listener)

    def add_listener(self, listener: EventListener) -> None:
        """Call `listener(event)` for every event recorded from now on, synchronously on the thread that
        records it (keep it cheap). Its exceptions are logged once and never reach the recording code."""
        with self._listeners_lock:
            self._listeners = (*self._listeners, listener)

    def remove_listener(self, listener: EventListener) -> None:
        """Stop calling `listener` (no-op if it is not registered)."""
        with self._listeners_lock:
            kept = list(self._listeners)
            if listener in kept:
                kept.remove(listener)
            self._listeners = tuple(kept)

    # -- writing -----------------------------------------------------------------------------------------
    def flush(self, timeout_s: float = 5.0) -> None:
        """Write everything queued so far before returning (waits at most about `timeout_s`).

        Safe in a signal handler (a save in a SIGTERM handler flushes its commit): `record` holds no lock,
        and the one lock taken here is taken with the timeout, so a handler that interrupted this thread
        inside a flush gives up after `timeout_s` instead of waiting for itself."""
        if not self.enabled:
            return
        if self._drain_lock.acquire(timeout=timeout_s):
            try:
                self._drain()
            finally:
                self._drain_lock.release()

    def set_attempt(self, attempt: int) -> None:
        """This process goes on in attempt `attempt` (restarted in place: `ettr.inplace`). What was recorded
        before is written first, as the previous attempt's; events from now on are the new one's."""
        if self.enabled and self._drain_lock.acquire(timeout=5.0):
            try:
                self._drain()
                self.attempt = attempt
            finally:
                self._drain_lock.release()
        else:
            self.attempt = attempt

    def close(self) -> None:
        """Flush, stop the writer thread and remove the process hooks. Idempotent."""
        if self._closed or not self.enabled:
            return
        self._closed = True
        if self._has_process_hooks:
            self._has_process_hooks = False
            atexit.unregister(self.close)
            _hooked.discard(self)
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        self.flush()
        # The ledger failed (a full disk, a lock held long): try again a little before giving up, in
        # bounded batches, so that what the disk can take still lands.
        deadline = time.monotonic() + CLOSE_RETRY_S
        while self._queue and time.monotonic() < deadline:
            time.sleep(0.1)
            self.flush()
        if self._queue:
            logger.warning("ettr: %d events could not be written to the ledger at exit", len(self._queue))

    def _writer(self) -> None:
        while not self._closed:
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            if self._drain_lock.acquire(timeout=self.flush_interval_s):
                try:
                    self._drain()
                finally:
                    self._drain_lock.release()

    def _drain(self) -> None:
        """Append what is queued, oldest first, in transactions of at most `MAX_BATCH` events; stop at the
        first failure and keep the rest for the next try. A backlog (the ledger was full or locked for a
        while) thus goes in as the ledger takes it, never as one huge transaction that fails whole."""
        if self._ledger is None:
            return
        popleft = self._queue.popleft
        attempt, rank = self.attempt, self.rank
        while self._queue:
            batch: list[tuple[Any, ...]] = []
            try:
                while len(batch) < MAX_BATCH:
                    batch.append(popleft())
            except IndexError:
                pass
            events = [Event(k, t, attempt, rank, p, s, v, d) for (k, t, p, s, v, d) in batch]
            try:
                self._ledger.append(events)
            except Exception as exc:
                self._warn_once("ledger append", exc)
                # Keep them for the next try, oldest first; a ledger that stays broken must not eat memory.
                self._queue.extendleft(reversed(batch))
                while len(self._queue) > _MAX_QUEUED:
                    self._queue.popleft()
                return

    def _disable_in_child(self) -> None:
        self.enabled = False
        self._queue = collections.deque()

    def reopen_in_child(self, ledger: Ledger, *, rank: int, world_size: int) -> None:
        """In a forked child that becomes a rank of its own (`ettr.bootstrap.spawned.watch_forks`): record
        again, through `ledger` (the parent's connection and writer thread are not this process's), as `rank`
        of `world_size`. Its listeners and counters stay: the hooks the child inherited hold this recorder.
        Its locks are made anew (the parent's writer may have held one at the fork)."""
        self._ledger = ledger
        self.rank, self.world_size = rank, world_size
        self._queue = collections.deque()
        self._wake = threading.Event()
        self._drain_lock = threading.Lock()
        self._listeners_lock = threading.Lock()
        self._closed = False
        self.enabled = True
        self._thread = threading.Thread(target=self._writer, name="ettr-recorder", daemon=True)
        self._thread.start()

    def remove_step_listener(self, listener: Callable[[int], None]) -> None:
        """Take `listener` off (no error when it is not on)."""
        try:
            self._step_listeners.remove(listener)
        except ValueError:
            pass

    def _warn_once(self, what: str, exc: BaseException) -> None:
        self._warn(what, exc)


class NullRecorder(Recorder):
    """A recorder that records nothing: what training code gets outside an ettr run."""

    def __init__(self) -> None:
        super().__init__(None)


def host_name() -> str:
    """This host's name, as recorded with a process's start."""
    return socket.gethostname()
