"""Init communication audit: count and time every collective and process-group creation during start-up.

Start-up of a distributed job is full of small collectives (rendezvous, plan broadcasts, parameter
checks, group creation) that each wait for the slowest rank. `CommAudit` wraps the `torch.distributed`
functions that make them, attributes each call to the init phase open at that moment, and when training
starts puts the originals back (zero cost in the loop) and records one `init_comm_audit` mark:

    audit = ettr.audit.start()            # before init_process_group
    with ettr.phase(ettr.Phase.PROCESS_GROUP_INIT):
        dist.init_process_group("gloo")
    ...
    ettr.training_started()               # the audit ends itself here (or at the first step)

The open phase is learned from the recorder's events (a listener, `Recorder.add_listener`), so training
code keeps using `ettr.phase` unchanged. Everything is guarded: a fault in the audit is logged once and the
wrapped call still runs exactly once; an error of the call itself reaches the caller unchanged. The text
table of the marks is `ettr.report.audit.render`.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ettr.events import Event, EventKind
from ettr.patcher import Patcher
from ettr.recorder import RecorderProtocol
from ettr.tracing import dynamo_is_tracing
from ettr.warn import WarnOnce

logger = logging.getLogger("ettr")

MARK_NAME = "init_comm_audit"
"""`data["name"]` of the MARK event that carries an audit summary."""

UNPHASED = "unphased"
"""Stage name of calls made while no phase was open."""

COLLECTIVE_OPS = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_coalesced",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "monitored_barrier",
    "all_to_all",
    "all_to_all_single",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "send",
    "recv",
    "batch_isend_irecv",
    # DistributedDataParallel's start-up checks and parameter broadcast (C++ bindings, looked up through
    # `torch.distributed` at call time).
    "_verify_params_across_processes",
    "_broadcast_coalesced",
)
"""Collectives the audit wraps (those a torch version lacks are skipped)."""

GROUP_OPS = (
    "init_process_group",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "split_group",
)
"""Process-group creation the audit wraps (timed like the collectives)."""

_GROUP_CREATORS = frozenset({"init_process_group", "new_group", "split_group"})
# The calls that make one group each, also when nested (new_subgroups makes its groups with new_group).


@dataclass(frozen=True, kw_only=True)
class AuditConfig:
    """How much the audit keeps."""

    max_calls_kept: int = 500
    """Individual calls (stage, op, begin ts, seconds) kept in the mark; the counts always cover all calls."""
    ops: tuple[str, ...] = COLLECTIVE_OPS + GROUP_OPS
    """Names of the functions to wrap in each target module."""

    def __post_init__(self) -> None:
        if self.max_calls_kept < 0:
            raise ValueError(f"max_calls_kept must be >= 0, got {self.max_calls_kept}")
        if not self.ops:
            raise ValueError("ops must name at least one function to audit")


class _OpStats:
    __slots__ = ("num_calls", "total_s", "max_s", "num_errors")

    def __init__(self) -> None:
        self.num_calls = 0
        self.total_s = 0.0
        self.max_s = 0.0
        self.num_errors = 0


def _default_targets() -> list[ModuleType]:
    # Both namespaces: user code calls `dist.all_reduce`, c10d's own helpers (all_gather_object ->
    # all_gather) resolve names in `distributed_c10d`; the calls nested inside an audited call are not
    # counted again.
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    return [dist, c10d]


class CommAudit:
    """Counts and times `torch.distributed` calls per open phase until training starts.

    Args:
        recorder: the Recorder whose phases give the stage and which receives the summary mark; None
            audits without recording (the summary is still available from `summary()`).
        config: what to wrap and how much to keep.
        targets: modules whose functions are wrapped (default: `torch.distributed` and its
            `distributed_c10d`); tests pass a fake namespace.
        clock: monotonic seconds for durations; `wall_clock`: Unix seconds for call begin times.
    """

    def __init__(
        self,
        recorder: RecorderProtocol | None = None,
        *,
        config: AuditConfig | None = None,
        targets: Sequence[Any] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.recorder = recorder
        self.config = config or AuditConfig()
        self._targets = targets
        self._clock = clock
        self._wall_clock = wall_clock
        self._lock = threading.Lock()
        self._local = threading.local()
        self._stack: list[str] = []
        self._stats: dict[str, dict[str, _OpStats]] = {}
        self._calls: list[list[Any]] = []
        self._num_calls = 0
        self._num_groups_created = 0
        self._patcher = Patcher()  # the wrapped functions, put back at `finish` (unless wrapped again since)
        self._active = False
        self._finished = False
        self._warn = WarnOnce("ettr: init comm audit {what} failed ({error}); the job goes on")
        self._listening = False
        self._summary: dict[str, Any] | None = None

    # -- life cycle ----------------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """True between `install()` and `finish()`."""
        return self._active

    def install(self) -> CommAudit:
        """Wrap the functions and start watching the recorder's phases. Idempotent; never raises."""
        if self._active or self._finished:
            return self
        try:
            targets = self._targets if self._targets is not None else _default_targets()
            wrappers: dict[int, Any] = {}  # id(original) -> wrapper: one wrapper per function object
            for module in targets:
                for name in self.config.ops:
                    original = getattr(module, name, None)
                    if original is None or not callable(original):
                        continue
                    wrapper = wrappers.get(id(original))
                    if wrapper is None:
                        wrapper = wrappers[id(original)] = self._wrap(name, original)
                    self._patcher.set(module, name, wrapper, unless_replaced=True)
            self._watch_recorder()
            self._active = True
        except Exception as exc:
            self._warn_once("install", exc)
            self._restore()
        return self

    def finish(self) -> dict[str, Any] | None:
        """Stop auditing: put the originals back, record the summary mark once, return the summary.

        Called automatically at TRAINING_START or the first STEP seen by the recorder. Idempotent.
        """
        if self._finished:
            return self._summary
        self._finished = True
        self._active = False
        self._restore()
        try:
            self._summary = self.summary()
            if self.recorder is not None:
                self.recorder.mark(MARK_NAME, **self._summary)
        except Exception as exc:
            self._warn_once("finish", exc)
        return self._summary

    def __enter__(self) -> CommAudit:
        return self.install()

    def __exit__(self, *exc_info: Any) -> None:
        self.finish()

    # -- results -------------------------------------------------------------------------------------------
    @property
    def stage(self) -> str:
        """The stage calls are attributed to now: the innermost open phase, or `UNPHASED`."""
        return self._stack[-1] if self._stack else UNPHASED

    def summary(self) -> dict[str, Any]:
        """What the mark carries (JSON-ready): totals, per stage and op counts/seconds, kept calls."""
        with self._lock:
            stages = {
                stage: {
                    op: {
                        "num_calls": s.num_calls,
                        "total_s": s.total_s,
                        "max_s": s.max_s,
                        **({"num_errors": s.num_errors} if s.num_errors else {}),
                    }
                    for op, s in ops.items()
                }
                for stage, ops in self._stats.items()
            }
            return {
                "num_calls": self._num_calls,
                "total_s": sum(s.total_s for ops in self._stats.values() for s in ops.values()),
                "num_groups_created": self._num_groups_created,
                "stages": stages,
                "calls": [list(c) for c in self._calls],
                "num_calls_dropped": max(0, self._num_calls - len(self._calls)),
            }

    # -- internals -----------------------------------------------------------------------------------------
    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        audit = self
        creates_group = name in _GROUP_CREATORS

        @functools.wraps(original)
        def audited(*args: Any, **kwargs: Any) -> Any:
            begun = audit._begin(creates_group)
            if begun is None:
                return original(*args, **kwargs)
            failed = True
            try:
                result = original(*args, **kwargs)
                failed = False
                return result
            finally:
                audit._end(name, begun, failed, creates_group)

        audited.__ettr_audit_original__ = original  # type: ignore[attr-defined]
        return audited

    def _begin(self, creates_group: bool) -> tuple[str, float, float] | None:
        """(stage, begin ts, begin clock) of a call to count, or None to pass it straight through."""
        try:
            local = self._local
            depth: int = getattr(local, "depth", 0)
            if not self._active or depth or dynamo_is_tracing():
                # Nested in an audited call (all_gather_object -> all_gather): timed by the outer one,
                # but a nested group creation still makes a group.
                if creates_group and self._active:
                    self._count_group()
                return None
            begun = (self.stage, self._wall_clock(), self._clock())
            local.depth = 1
            return begun
        except Exception as exc:
            self._warn_once("count", exc)
            return None

    def _end(self, op: str, begun: tuple[str, float, float], failed: bool, creates_group: bool) -> None:
        try:
            stage, begin_ts, begin = begun
            self._add(stage, op, begin_ts, self._clock() - begin, failed, creates_group)
        except Exception as exc:
            self._warn_once("count", exc)
        finally:
            self._local.depth = 0

    def _add(
        self, stage: str, op: str, begin_ts: float, duration_s: float, failed: bool, group: bool
    ) -> None:
        try:
            with self._lock:
                stats = self._stats.setdefault(stage, {}).setdefault(op, _OpStats())
                stats.num_calls += 1
                stats.total_s += duration_s
                stats.max_s = max(stats.max_s, duration_s)
                stats.num_errors += failed
                self._num_calls += 1
                if group and not failed:
                    self._num_groups_created += 1
                if len(self._calls) < self.config.max_calls_kept:
                    self._calls.append([stage, op, begin_ts, duration_s])
        except Exception as exc:  # pragma: no cover - defensive
            self._warn_once("count", exc)

    def _count_group(self) -> None:
        with self._lock:
            self._num_groups_created += 1

    def _watch_recorder(self) -> None:
        if self.recorder is not None:
            self.recorder.add_listener(self._observe)
            self._listening = True

    def _observe(self, event: Event) -> None:
        """Recorder listener: track the open phases; training start (or the first step) ends the audit."""
        if not self._active:
            return
        kind, phase = event.kind, event.phase
        if kind is EventKind.PHASE_BEGIN and phase is not None:
            self._stack.append(str(phase))
        elif kind is EventKind.PHASE_END and phase is not None:
            name = str(phase)
            for i in range(len(self._stack) - 1, -1, -1):
                if self._stack[i] == name:
                    del self._stack[i]
                    break
        elif kind in (EventKind.TRAINING_START, EventKind.STEP):
            self.finish()

    def _restore(self) -> None:
        if self._listening and self.recorder is not None:
            self._listening = False
            try:
                self.recorder.remove_listener(self._observe)
            except Exception as exc:
                self._warn_once("restore", exc)
        # A function someone wrapped after us keeps their wrapper; ours passes calls straight through now.
        self._patcher.undo(on_error=lambda exc: self._warn_once("restore", exc))

    def _warn_once(self, what: str, exc: BaseException) -> None:
        self._warn(what, exc)


def start(recorder: RecorderProtocol | None = None, *, config: AuditConfig | None = None) -> CommAudit:
    """Install an audit on `recorder` (default: this process's default recorder) and return it.

    Call it before `init_process_group`. It ends by itself when the recorder sees training start.
    """
    if recorder is None:
        from ettr.runtime import get_recorder

        recorder = get_recorder()
    return CommAudit(recorder, config=config).install()
