"""Fault injection on purpose: `--inject KIND@WHEN[,attempt=A][,rank=R]`, parsed in the supervisor and
fired inside the supervised processes.

The supervisor parses the specs (`parse_spec`, a `UsageError` for bad ones) and hands them to its children
in `ETTR_INJECT` (JSON). There the bootstrap builds an `Injector` for the process's (attempt, rank), which
fires a matching fault right after optimizer step N (a step listener on the training thread), S seconds after
the attempt started (a timer), or while a checkpoint is being written (`checkpoint_in_progress()`, called by
the bootstrap's save hooks and by `ettr.checkpoint`).

What each kind does, after the recorder is flushed so the last step marker is durable:
  crash    the process exits with status 1 (like an uncaught exception; records a FAILURE event first)
  kill     SIGKILL to this process
  hang     the training thread blocks forever (a timer-triggered hang blocks it at its next step)
  preempt  SIGTERM to the supervisor (`ETTR_SUPERVISOR_PID`), which forwards it to the whole job
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from ettr.errors import UsageError
from ettr.events import Event, EventKind
from ettr.run_env import INJECT_ENV, RunEnv
from ettr.untrusted import loads_bounded
from ettr.warn import say

if TYPE_CHECKING:
    from ettr.recorder import RecorderProtocol

logger = logging.getLogger("ettr")


class FaultKind(StrEnum):
    """What the fault does (the contract's closed set)."""

    CRASH = "crash"
    KILL = "kill"
    HANG = "hang"
    PREEMPT = "preempt"


class Trigger(StrEnum):
    """When the fault fires."""

    STEP = "step"
    TIME = "time"
    CHECKPOINT = "checkpoint"


MAX_TIME_S = 315_360_000.0
"""The latest `time=S` (ten years): a timer of 1e10 s raised OverflowError in its thread (a traceback in
the training process; threading waits at most `threading.TIMEOUT_MAX`)."""


@dataclass(frozen=True, kw_only=True)
class FaultSpec:
    """One `--inject` spec."""

    kind: FaultKind
    """What happens."""
    trigger: Trigger
    """When: after optimizer step `step`, `time_s` after the attempt started, or during a checkpoint save."""
    step: int | None = None
    """The global optimizer step after which the fault fires (trigger `step` only)."""
    time_s: float | None = None
    """Seconds after the attempt started (trigger `time` only)."""
    attempt: int = 0
    """The attempt whose processes fire it (0: the first attempt only)."""
    rank: int = 0
    """The global rank that fires it."""

    def __post_init__(self) -> None:
        if (self.trigger is Trigger.STEP) != (self.step is not None):
            raise ValueError("step= is required for, and only for, the step trigger")
        if (self.trigger is Trigger.TIME) != (self.time_s is not None):
            raise ValueError("time= is required for, and only for, the time trigger")
        if self.step is not None and self.step < 0:
            raise ValueError(f"step must be >= 0, got {self.step}")
        if self.time_s is not None and not 0 <= self.time_s <= MAX_TIME_S:
            raise ValueError(
                f"time must be seconds from 0 to {MAX_TIME_S:,.0f} (ten years), got {self.time_s:g}"
            )
        if self.attempt < 0 or self.rank < 0:
            raise ValueError("attempt and rank must be >= 0")

    def __str__(self) -> str:
        if self.trigger is Trigger.STEP:
            when = f"step={self.step}"
        elif self.trigger is Trigger.TIME:
            when = f"time={self.time_s:g}"
        else:
            when = "checkpoint"
        return f"{self.kind}@{when},attempt={self.attempt},rank={self.rank}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "trigger": self.trigger.value,
            "step": self.step,
            "time_s": self.time_s,
            "attempt": self.attempt,
            "rank": self.rank,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FaultSpec:
        """The spec `to_dict` wrote. Raises ValueError, TypeError or KeyError for anything else (a bool or a
        float where a whole number belongs: `int(1e400)` raised OverflowError out of the bootstrap)."""

        if not isinstance(data, Mapping):
            raise TypeError(f"a fault spec is an object, got {data!r:.40}")

        def whole(name: str, default: int | None) -> int | None:
            value = data.get(name, default)
            if value is not None and type(value) is not int:
                raise TypeError(f"{name} must be a whole number, got {value!r:.40}")
            return value

        time_s = data.get("time_s")
        if time_s is not None and (isinstance(time_s, bool) or not isinstance(time_s, (int, float))):
            raise TypeError(f"time_s must be a number, got {time_s!r:.40}")
        return cls(
            kind=FaultKind(data["kind"]),
            trigger=Trigger(data["trigger"]),
            step=whole("step", None),
            time_s=None if time_s is None else float(time_s),
            attempt=whole("attempt", 0) or 0,
            rank=whole("rank", 0) or 0,
        )


_SPEC_HELP = (
    "KIND@WHEN[,attempt=A][,rank=R] with KIND crash|kill|hang|preempt and WHEN step=N|time=S|checkpoint"
)


def _whole(text: str, what: str, spec: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"--inject {spec!r}: {what} must be a whole number >= 0, got {text!r}") from None
    if value < 0:
        raise UsageError(f"--inject {spec!r}: {what} must be >= 0, got {value}")
    return value


def parse_spec(text: str) -> FaultSpec:
    """Parse one `--inject` SPEC. Raises `UsageError` saying what is wrong with it."""
    spec = text.strip()
    kind_text, at, rest = spec.partition("@")
    if not at or not rest:
        raise UsageError(f"--inject {text!r}: expected {_SPEC_HELP}")
    try:
        kind = FaultKind(kind_text.strip().lower())
    except ValueError:
        raise UsageError(
            f"--inject {text!r}: unknown kind {kind_text!r} (one of crash, kill, hang, preempt)"
        ) from None
    when, *options = (part.strip() for part in rest.split(","))
    step: int | None = None
    time_s: float | None = None
    if when == "checkpoint":
        trigger = Trigger.CHECKPOINT
    elif when.startswith("step="):
        trigger, step = Trigger.STEP, _whole(when[5:], "step", text)
    elif when.startswith("time="):
        trigger = Trigger.TIME
        try:
            time_s = float(when[5:])
        except ValueError:
            raise UsageError(f"--inject {text!r}: time must be seconds, got {when[5:]!r}") from None
        if not 0 <= time_s <= MAX_TIME_S:
            raise UsageError(
                f"--inject {text!r}: time must be seconds from 0 to {MAX_TIME_S:,.0f} (ten years)"
            )
    else:
        raise UsageError(f"--inject {text!r}: unknown WHEN {when!r} (one of step=N, time=S, checkpoint)")
    fields = {"attempt": 0, "rank": 0}
    seen: set[str] = set()
    for option in options:
        key, eq, value = option.partition("=")
        if not eq or key not in fields:
            raise UsageError(f"--inject {text!r}: unknown option {option!r} (attempt=A or rank=R)")
        if key in seen:
            raise UsageError(f"--inject {text!r}: {key}= given twice")
        seen.add(key)
        fields[key] = _whole(value, key, text)
    return FaultSpec(kind=kind, trigger=trigger, step=step, time_s=time_s, **fields)


def parse_specs(texts: Iterable[str]) -> tuple[FaultSpec, ...]:
    """Parse every `--inject` SPEC (see `parse_spec`)."""
    return tuple(parse_spec(t) for t in texts)


def encode_specs(specs: Sequence[FaultSpec]) -> str:
    """The `ETTR_INJECT` value for `specs`."""
    return json.dumps([s.to_dict() for s in specs], separators=(",", ":"))


def decode_specs(text: str | None) -> tuple[FaultSpec, ...]:
    """Specs from an `ETTR_INJECT` value; an empty or unreadable value gives none (logged, never raised)."""
    if not text:
        return ()
    try:
        return tuple(FaultSpec.from_dict(d) for d in loads_bounded(text))
    except (ValueError, TypeError, KeyError) as exc:
        logger.warning("ettr: ignoring unreadable %s (%s)", INJECT_ENV, exc)
        return ()


class FaultActions:
    """How faults are carried out; tests substitute a fake that records the calls instead."""

    def crash(self) -> None:
        sys.stderr.flush()
        os._exit(1)  # an exit the user's `except Exception` cannot swallow

    def kill(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def hang(self) -> None:
        threading.Event().wait()  # forever; signals still run their handlers on the main thread

    def preempt(self, wait_s: float) -> None:
        arrived = threading.Event()
        if wait_s > 0 and threading.current_thread() is threading.main_thread():
            _watch_sigterm(arrived)
        run_env = RunEnv.from_environ()
        supervisor = None if run_env is None else run_env.supervisor_pid
        if supervisor is not None:
            os.kill(supervisor, signal.SIGTERM)
        else:
            os.killpg(os.getpgrp(), signal.SIGTERM)
        # Wait (at most `wait_s`) until the forwarded SIGTERM has reached this process, so the loop does not
        # run on past the preemption; then go on, so a script that handles SIGTERM (a checkpoint manager that
        # saves at the next step boundary) does so well inside the supervisor's grace period. Sleep in
        # slices so the script's Python signal handlers run promptly.
        deadline = time.monotonic() + wait_s
        while not arrived.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)


def _watch_sigterm(arrived: threading.Event) -> None:
    """Set `arrived` on the next SIGTERM, then hand that signal to whatever handled it before."""
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum: int, frame: Any) -> None:
        arrived.set()
        signal.signal(signal.SIGTERM, previous)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            os.kill(os.getpid(), signal.SIGTERM)  # the default action: end the process, as without us

    signal.signal(signal.SIGTERM, on_sigterm)


class Injector:
    """Fires the faults of `specs` that target this process's (attempt, rank), each at most once.

    Args:
        specs: every spec of the job; the ones for other attempts or ranks are ignored.
        recorder: this process's recorder (its attempt and rank select the specs; faults flush it first).
        attempt_started_at: Unix time the attempt started, the origin of `time=S` (default: now).
        actions: how faults are carried out (tests pass a fake).
        preempt_wait_s: how long the training thread waits for a preemption's SIGTERM to arrive.
        stands_down: asked before a fault fires; True: this process turned out not to be a rank (a
            Python program that started torchrun, whose workers are the ranks), and fires nothing.
    """

    def __init__(
        self,
        specs: Sequence[FaultSpec],
        recorder: RecorderProtocol,
        *,
        attempt_started_at: float | None = None,
        actions: FaultActions | None = None,
        preempt_wait_s: float = 30.0,
        stands_down: Callable[[], bool] | None = None,
    ) -> None:
        self._recorder = recorder
        self._stands_down = stands_down
        self._specs = list(specs)
        self._listening = False
        self._mine = [s for s in specs if s.attempt == recorder.attempt and s.rank == recorder.rank]
        self._fired: set[FaultSpec] = set()
        self._lock = threading.Lock()
        self._pending_hang: FaultSpec | None = None
        self._actions = actions or FaultActions()
        self._origin_s = time.time() if attempt_started_at is None else attempt_started_at
        self._preempt_wait_s = preempt_wait_s
        self._timers: list[threading.Timer] = []

    @property
    def specs(self) -> tuple[FaultSpec, ...]:
        """The specs this process may fire."""
        return tuple(self._mine)

    def start(self) -> None:
        """Register the step listener and start the timers (call once, on the training thread)."""
        if not self._mine:
            return
        if not self._listening:
            self._recorder.add_step_listener(self.on_step)
            self._listening = True
        for spec in self._mine:
            if spec.trigger is Trigger.TIME:
                delay_s = max(0.0, self._origin_s + (spec.time_s or 0.0) - time.time())
                timer = threading.Timer(delay_s, self._on_timer, args=(spec,))
                timer.daemon = True
                timer.name = "ettr-inject"
                timer.start()
                self._timers.append(timer)

    def continue_attempt(self, attempt_started_at: float) -> None:
        """The process goes on in the recorder's (new) attempt, restarted in place: the faults of that
        attempt replace those of the previous one, `time=S` counted from `attempt_started_at`."""
        for timer in self._timers:
            timer.cancel()
        self._timers = []
        self._pending_hang = None
        self._mine = [
            s for s in self._specs if s.attempt == self._recorder.attempt and s.rank == self._recorder.rank
        ]
        self._origin_s = attempt_started_at
        self.start()

    def on_step(self, step: int) -> None:
        """Step listener: fire `step=N` faults once step N has completed; a pending timed hang blocks here."""
        if self._pending_hang is not None:
            self._fire(self._pending_hang, f"step {step}", on_training_thread=True, claimed=True)
        for spec in self._mine:
            if spec.trigger is Trigger.STEP and spec.step == step:
                self._fire(spec, f"step {step}", on_training_thread=True)

    def on_checkpoint(self) -> None:
        """Fire `checkpoint` faults: called while a checkpoint is being written (before it commits)."""
        for spec in self._mine:
            if spec.trigger is Trigger.CHECKPOINT:
                self._fire(spec, "checkpoint", on_training_thread=True)

    def _on_timer(self, spec: FaultSpec) -> None:
        if spec.kind is FaultKind.HANG:
            # Only the training thread can stop the training; block it at its next step.
            if self._claim(spec):
                self._pending_hang = spec
            return
        self._fire(spec, f"time {spec.time_s:g}s", on_training_thread=False)

    def _claim(self, spec: FaultSpec) -> bool:
        with self._lock:
            if spec in self._fired:
                return False
            self._fired.add(spec)
            return True

    def _fire(self, spec: FaultSpec, where: str, *, on_training_thread: bool, claimed: bool = False) -> None:
        if not claimed and not self._claim(spec):
            return
        if self._stands_down is not None and self._stands_down():
            return  # not a rank after all: its torchrun's workers are, and fire it
        self._pending_hang = None
        say(f"ettr: injecting {spec.kind} at {where} ({spec})")
        self._recorder.record(EventKind.MARK, data={"name": "inject", "spec": str(spec), "at": where})
        if spec.kind is FaultKind.CRASH:
            self._recorder.record(
                EventKind.FAILURE, data={"exception": "InjectedCrash", "message": f"{spec} at {where}"}
            )
        self._recorder.flush()
        if spec.kind is FaultKind.CRASH:
            self._actions.crash()
        elif spec.kind is FaultKind.KILL:
            self._actions.kill()
        elif spec.kind is FaultKind.HANG:
            self._actions.hang()
        else:
            self._actions.preempt(self._preempt_wait_s if on_training_thread else 0.0)


def unfired_specs(specs: Sequence[FaultSpec], events: Iterable[Event]) -> list[FaultSpec]:
    """The specs of `specs` that no process recorded firing (the `inject` MARK) in `events`."""
    fired = {
        e.data.get("spec")
        for e in events
        if e.kind is EventKind.MARK and e.data is not None and e.data.get("name") == "inject"
    }
    return [spec for spec in specs if str(spec) not in fired]


def why_unfired(spec: FaultSpec, steps: Mapping[int, tuple[int | None, int | None]]) -> str:
    """Why the step fault `spec` never fired, from the steps the attempts ran ("" when it cannot be said).

    `steps` maps each attempt this supervisor ran to (the lowest, the highest) step a training process of
    it completed (None, None: none). A job that resumed from a checkpoint past step N (an earlier run's,
    left in the same place) never passes step N, which otherwise looks like a fault that was ignored.
    """
    if spec.step is None or not steps or spec.attempt < min(steps):
        return ""  # a time or checkpoint trigger; an attempt of an earlier run of the job
    if spec.attempt not in steps:
        return f"the job ended after attempt {max(steps)}"
    first, last = steps[spec.attempt]
    if last is None:
        return (
            f"attempt {spec.attempt} completed no training step; a script that resumes from a finished "
            "run's checkpoint trains none"
        )
    if first is not None and first > spec.step:
        return (
            f"attempt {spec.attempt} began at step {first}, past step {spec.step}: it resumed from a "
            "checkpoint saved after that step (an earlier run's?)"
        )
    if last < spec.step:
        return f"attempt {spec.attempt} ended at step {last}"
    return ""


_active: Injector | None = None


def install(injector: Injector | None) -> None:
    """Make `injector` the one `checkpoint_in_progress()` reaches (the bootstrap does this)."""
    global _active
    _active = injector


def checkpoint_in_progress() -> None:
    """Hook point for checkpoint writers: call it while a checkpoint is being written, before it commits.

    Fires any `--inject KIND@checkpoint` fault of this process; does nothing otherwise (costs a global read).
    """
    injector = _active
    if injector is not None:
        injector.on_checkpoint()
