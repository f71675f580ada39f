"""Time to recover (and to start) broken into its parts. Pure: no I/O, no clock.

A recovery runs from the failure to the first training step of the next attempt that trained. Its parts, in
the order they happen, each from one milestone to the next (a missing milestone gives its time to the next
part, so the parts always add up to the whole):

    detection      the failure (first FAILURE of any rank or `--inject kill` MARK, else the fault the supervisor
                   saw: a hang's last sign of life, its `failure_detected` MARK's `fault_ts`) -> the
                   supervisor knew (that MARK, else
                   ATTEMPT_END); where none of those, the failed attempt's `rank_gone_ts` (the supervisor's
                   first look that saw a rank's process gone: a SIGKILL under a launcher or ettr's agent);
                   None when the fault time is unknown (a SIGKILL no one saw, a lost node)
    teardown       -> ATTEMPT_END of the failed attempt (the rest of its processes gone)
    backoff        -> the end of the supervisor's wait (its `restart_backoff` MARK, else ATTEMPT_START);
                   a requeue whose run recorded its allocation: -> the requeue (its run's submission),
                   then REQUEUE_PARTS `scheduling` (-> allocated) and `hardware_setup` (-> that run's
                   supervisor start), as the buckets split the gap
    relaunch       -> the first PROCESS_START of the next attempt (fork/exec, a launcher's own start-up and
                   rendezvous, e.g. torchrun's agent; in a warm standby, the rest of its warm-up); of each
                   rank, the process that trained (`_own_process_start`: a Python program instrumented as
                   rank 0 before it launched the ranks is the launcher's start-up). Which
                   path ran and why (`relaunch_path`, `relaunch_why`: warm | promoted | cold | forked | spare) comes from
                   the supervisor's `relaunch` MARK of the next attempt
    imports        -> the `imports_done` MARK of the reference rank's process (interpreter, site, `import torch`,
                   ettr's bootstrap); 0 when not recorded (its time then falls into the parts after it)
    then to the training start, each instant goes to the first of these that is open on the reference rank:
    compile        COMPILE phases
    restore        RESTORE phases (checkpoint load)
    first_batch    GET_FIRST_BATCH_DATA / DATA_WAIT phases (data fast-forward and the first batch)
    process_group  PROCESS_GROUP_INIT phases (rendezvous of the ranks)
    evaluation     EVAL phases (the evaluation a resumed script repeats before its first step)
    other_init     the rest: the script's own set-up (model, optimizer, anything unrecorded)
    first_step     the training start -> the first STEP (the first step, slower than the others)

Each recovery has a kind (`RecoveryParts.kind`, one of `RECOVERY_KINDS`): `in_place` when the attempt that
recovered was a restart in place (the supervisor's `recovery` MARK of that attempt says `kind: "in_place"`:
ettr's agent kept the other processes and replaced the failed rank), `requeue` when a new supervisor run started between the two
attempts (a scheduler's requeue), `warm_restart` when the relaunch took warm standbys (`relaunch` path warm,
promoted or forked: the agent's zygote), else `cold_restart`.

Two spans, each labelled wherever it is shown (docs/buckets.md, "TTS, TTR"):
- the headline (`RecoveryParts.headline_s`, equal to the contract's TTR in `EttReport.ttr_s`): the failed
  attempt's end (ATTEMPT_END: the failure detected and its processes gone) to the training start of the
  attempt that recovered, i.e. backoff through other_init;
- the whole (`RecoveryParts.total_s`): from the failure (or from its detection when the failure time is
  unknown: `failure_known`) to the first step.
TTS gets the same parts after `before_launch` (its origin -> the first attempt's ATTEMPT_START), with
`launch` instead of relaunch; its headline (the contract's TTS) runs from the origin to the training start.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Protocol

from ettr.constants import BACKOFF_MARK, FAILURE_DETECTED_MARK, IMPORTS_MARK, RECOVERY_MARK, RELAUNCH_MARK
from ettr.events import Event, EventKind, Phase

RECOVERY_PARTS = (
    "detection",
    "teardown",
    "backoff",
    "relaunch",
    "imports",
    "compile",
    "restore",
    "first_batch",
    "process_group",
    "evaluation",
    "other_init",
    "first_step",
)
"""The parts of a recovery, in the order they happen."""
REQUEUE_PARTS = ("scheduling", "hardware_setup")
"""Parts of a requeue's recovery whose run recorded when it was allocated (Slurm's `StartTime`, and its reset
`SubmitTime`), between backoff and relaunch, as in the buckets: the run's wait in the scheduler's queue
(submitted -> allocated) and its hardware set-up (allocated -> its supervisor's start). backoff is then the
teardown until the requeue, relaunch the new supervisor's own start and launch; without those times the
whole wait is backoff; with the allocation alone, `scheduling` is unknown (None) and the queue's wait stays
in backoff."""
ALL_RECOVERY_PARTS = (*RECOVERY_PARTS[:3], *REQUEUE_PARTS, *RECOVERY_PARTS[3:])
"""Every part a recovery may have, in the order they happen."""
STARTUP_PARTS = ("before_launch", "launch", *RECOVERY_PARTS[4:])
"""The parts of the time to start."""
BEFORE_HEADLINE = frozenset({"detection", "teardown"})
"""Parts of a recovery before the headline TTR starts (the failure -> the failed attempt's end)."""
AFTER_HEADLINE = frozenset({"first_step"})
"""Parts after the headline TTR/TTS ends (the training start -> the first step)."""
RECOVERY_KINDS = ("in_place", "warm_restart", "cold_restart", "requeue")
"""How a failure was recovered (the contract's `kind` beside the TTR parts)."""
IN_PLACE = "in_place"
"""The `kind` of the supervisor's `recovery` MARK of an attempt that restarted the job in place."""

_IN_PROCESS = (  # (part, phases), the first open one takes the instant
    ("compile", frozenset({Phase.COMPILE})),
    ("restore", frozenset({Phase.RESTORE})),
    ("first_batch", frozenset({Phase.GET_FIRST_BATCH_DATA, Phase.DATA_WAIT})),
    ("process_group", frozenset({Phase.PROCESS_GROUP_INIT})),
    ("evaluation", frozenset({Phase.EVAL})),
)

Span = tuple[float, float, Phase | None, str]


class RunTimes(Protocol):
    """A supervisor run's start and, when it recorded them, its own submission and allocation (a requeued
    run's: `ettr.accounting.attempts.RunStart`)."""

    @property
    def ts(self) -> float: ...
    @property
    def submitted_ts(self) -> float | None: ...
    @property
    def allocated_ts(self) -> float | None: ...


def queue_wait(run: RunTimes, floor: float) -> tuple[float, float] | None:
    """(queued, allocated) of a requeued run that recorded its allocation, clamped to [floor, its supervisor's
    start]: when it entered the scheduler's queue (its submission; its allocation where that is unknown) and
    when it was allocated. None without an allocation. The buckets (`timeline`) and the TTR parts split a
    requeue's gap with it alike."""
    if run.allocated_ts is None:
        return None
    allocated = min(max(run.allocated_ts, floor), run.ts)
    queued = allocated if run.submitted_ts is None else min(max(run.submitted_ts, floor), allocated)
    return queued, allocated


@dataclass(frozen=True, slots=True, kw_only=True)
class RecoveryParts:
    """Where the time of one recovery (or of the start) went; `parts_s` in the order of the parts."""

    failed_attempt: int | None
    """The attempt that failed; None for the time to start."""
    recovered_attempt: int
    start_ts: float
    """The failure (else its detection), or the TTS origin."""
    first_step_ts: float
    parts_s: Mapping[str, float | None]
    """Seconds per part (RECOVERY_PARTS, with REQUEUE_PARTS after backoff for a requeue whose run recorded
    its allocation; or STARTUP_PARTS); a part the events cannot tell is None."""
    headline_start_ts: float = 0.0
    """Where the headline TTR/TTS starts: the failed attempt's end, or the TTS origin."""
    training_start_ts: float = 0.0
    """Where the headline ends: the training start of the attempt that recovered (or started)."""
    failure_known: bool = True
    """Whether `start_ts` is the failure itself (False: no rank recorded it, the whole starts at detection)."""
    relaunch_path: str | None = None
    """How the next attempt's process(es) started (the supervisor's `relaunch` MARK): `warm` (a standby that
    had done its warm-up), `promoted` (a standby still warming, promoted to normal priority), `cold`;
    None when not recorded."""
    relaunch_why: str | None = None
    """Why that path, in a few words (None when not recorded)."""
    kind: str | None = None
    """How the failure was recovered, one of `RECOVERY_KINDS` (None for the time to start)."""
    restored_from: str | None = None
    """Where the ranks of the recovered attempt restored their checkpoint from: the sources their RESTORE
    phases recorded (`memory`, `peer`, `storage`), joined with `+` where ranks differed; `nothing` when no rank
    recorded one and the attempt resumed from no step (`NOTHING_RESTORED`: it started over, the attempts
    table's `-`); None when that is unknown (it resumed from a step, or from one ettr could not place, with no
    restore ettr saw)."""
    restored_why: str | None = None
    """Why ranks that keep memory copies read storage (their RESTORE phases' `memory_not_used`: a rank's own
    reason first, `; `-joined), e.g. `rank 1: memory copy not used: it holds step 325, the newest commit is
    step 350 (stale)`; None when memory was used or not kept."""
    restored_tier: str | None = None
    """Where the ranks restored a memory-tier commit (`CheckpointConfig.memory_interval`: a step newer than
    storage's newest, its RESTORE phases' `tier`): `a memory-only commit of step S; storage had N`; None
    otherwise."""

    @property
    def total_s(self) -> float:
        """The whole: failure (else detection) or origin -> the first step."""
        return self.first_step_ts - self.start_ts

    @property
    def headline_s(self) -> float:
        """The span the headline shows (the contract's TTR or TTS): `headline_start_ts` -> training start;
        the parts between detection/teardown and first_step add up to it."""
        return self.training_start_ts - self.headline_start_ts


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptMilestones:
    """What the parts are computed from, for one attempt (filled by `milestones`)."""

    index: int
    start_ts: float
    end_ts: float
    failure_ts: float | None
    detected_ts: float | None
    backoff_end_ts: float | None
    process_start_ts: float | None
    imports_ts: float | None
    training_start_ts: float | None
    first_step_ts: float | None
    phases: Sequence[Span]
    relaunch: Mapping[str, object] | None = None
    """The supervisor's `relaunch` MARK data of this attempt (path, why), if recorded."""
    recovery: str | None = None
    """The `kind` of the supervisor's `recovery` MARK of this attempt (`in_place`), if recorded."""
    restored_from: str | None = None
    """The sources the ranks' RESTORE phases recorded (`RecoveryParts.restored_from`)."""
    restored_why: str | None = None
    """Why memory copies were not used (`RecoveryParts.restored_why`)."""
    restored_tier: str | None = None
    """A memory-tier commit the ranks restored (`RecoveryParts.restored_tier`)."""


def rank_failure_times(rank_events: Mapping[int, Sequence[Event]]) -> list[float]:
    """When the training ranks said they failed: each FAILURE, and each `inject` MARK of an `--inject kill`
    (written and flushed just before the SIGKILL, which leaves no FAILURE). Not the FAILURE of a process that
    had become the ranks' launcher (`launcher_failure_times`)."""
    return [
        e.ts
        for r, evs in rank_events.items()
        if r >= 0
        for e in evs
        if (e.kind == EventKind.FAILURE and not _from_launcher(e))
        or (
            e.kind == EventKind.MARK
            and isinstance(e.data, Mapping)
            and str(e.data.get("spec")).startswith("kill@")
        )
    ]


def launcher_failure_times(rank_events: Mapping[int, Sequence[Event]]) -> list[float]:
    """The FAILUREs of processes instrumented as a rank that had become the ranks' launcher (`data.launcher`:
    `fabric run`'s in-process torchrun agent raising `ChildFailedError`, an `mp.spawn` program): they come
    after the launcher saw a rank die and stopped the others, so they date the failure only where nothing
    else does. `fabric run` behind `bash run.sh`, rank 1 SIGKILLed: its ChildFailedError came 0.34 s after
    the kill, the supervisor saw the rank gone after 0.15 s."""
    return [
        e.ts
        for r, evs in rank_events.items()
        if r >= 0
        for e in evs
        if e.kind == EventKind.FAILURE and _from_launcher(e)
    ]


def _from_launcher(event: Event) -> bool:
    return isinstance(event.data, Mapping) and event.data.get("launcher") is True


def milestones(
    *,
    index: int,
    start_ts: float,
    end_ts: float,
    rank_events: Mapping[int, Sequence[Event]],
    reference_rank: int | None,
    training_start_ts: float | None,
    first_step_ts: float | None,
    phases: Sequence[Span],
    rank_gone_ts: float | None = None,
) -> AttemptMilestones:
    """The milestones of one attempt from its events (supervisor events under rank -1); `rank_gone_ts`: when
    the supervisor saw a rank gone, the failure where the events know none (`attempts.rank_gone`)."""
    failures = rank_failure_times(rank_events)
    own_starts = {r: _own_process_start(evs, first_step_ts) for r, evs in rank_events.items() if r >= 0}
    starts = [ts for ts in own_starts.values() if ts is not None]
    supervisor = rank_events.get(-1, ())
    reference = rank_events.get(reference_rank, ()) if reference_rank is not None else ()
    reference_start = own_starts.get(reference_rank) if reference_rank is not None else None
    if reference_start is not None:  # that process's own imports, not a launcher's before it
        reference = [e for e in reference if e.ts >= reference_start]
    # A fault no rank recorded (a hang: its last sign of life) as the supervisor's detection saw it.
    fault = (_first_mark_data(supervisor, FAILURE_DETECTED_MARK) or {}).get("fault_ts")
    if isinstance(fault, int | float) and not isinstance(fault, bool) and start_ts <= fault <= end_ts:
        failures.append(float(fault))
    if not failures and rank_gone_ts is not None:
        failures.append(rank_gone_ts)
    if not failures:
        failures = launcher_failure_times(rank_events)
    return AttemptMilestones(
        index=index,
        start_ts=start_ts,
        end_ts=end_ts,
        failure_ts=min(failures) if failures else None,
        detected_ts=_first_mark(supervisor, FAILURE_DETECTED_MARK),
        backoff_end_ts=_first_mark(supervisor, BACKOFF_MARK),
        process_start_ts=min(starts) if starts else None,
        imports_ts=_first_mark(reference, IMPORTS_MARK),
        training_start_ts=training_start_ts,
        first_step_ts=first_step_ts,
        phases=phases,
        relaunch=_first_mark_data(supervisor, RELAUNCH_MARK),
        recovery=_text((_first_mark_data(supervisor, RECOVERY_MARK) or {}).get("kind")),
        restored_from=_restore_sources(rank_events),
        restored_why=_memory_not_used(rank_events),
        restored_tier=_memory_tier(rank_events),
    )


def _restore_sources(rank_events: Mapping[int, Sequence[Event]]) -> str | None:
    """The sources of the ranks' completed restores (`memory`, `peer`, `storage`), `+`-joined; None: none."""
    return "+".join(sorted(_restore_texts(rank_events, "source", 40))) or None


def _memory_tier(rank_events: Mapping[int, Sequence[Event]]) -> str | None:
    """`a memory-only commit of step S; storage had N` when the ranks' completed RESTOREs loaded a memory-tier
    commit (their `tier`, `storage_step`); None otherwise."""
    found = {
        (e.step, data.get("storage_step"))
        for e, data in _restores(rank_events)
        if data.get("tier") == "memory"
    }
    return (
        "; ".join(f"a memory-only commit of step {s}; storage had {n}" for s, n in sorted(found, key=str))
        or None
    )


def _memory_not_used(rank_events: Mapping[int, Sequence[Event]]) -> str | None:
    """The ranks' reasons for reading storage instead of their memory copies (`memory_not_used` of their
    completed RESTOREs): a rank's own reason (`rank R: ...`) before the others' `another rank ...`."""
    found = _restore_texts(rank_events, "memory_not_used", 300)
    own = sorted(w for w in found if w.startswith("rank "))
    return "; ".join(own or sorted(found)) or None


def _restore_texts(rank_events: Mapping[int, Sequence[Event]], key: str, limit: int) -> set[str]:
    """The texts under `key` of the ranks' completed RESTOREs, each cut to `limit` characters."""
    return {
        data[key][:limit]
        for _, data in _restores(rank_events)
        if isinstance(data.get(key), str) and data[key]
    }


def _restores(rank_events: Mapping[int, Sequence[Event]]) -> Iterator[tuple[Event, Mapping[str, Any]]]:
    """The ranks' completed RESTOREs (their PHASE_END events) that carry data, with it."""
    for rank, events in rank_events.items():
        for e in events if rank >= 0 else ():
            if e.kind == EventKind.PHASE_END and e.phase == Phase.RESTORE and isinstance(e.data, Mapping):
                yield e, e.data


def _own_process_start(events: Sequence[Event], first_step_ts: float | None) -> float | None:
    """When the process that trained as this rank started: its last PROCESS_START by the attempt's first step
    (else its first). A Python program that started the ranks itself (`fabric run`, torchrun's agent run
    in-process, `mp.spawn`) was instrumented as this rank before it became their launcher, and its start and
    imports are the launch's, as torchrun's own are, not the rank's."""
    starts = [e.ts for e in events if e.kind == EventKind.PROCESS_START]
    if not starts:
        return None
    before = [ts for ts in starts if first_step_ts is None or ts <= first_step_ts]
    return max(before) if before else min(starts)


def _first_mark(events: Iterable[Event], name: str) -> float | None:
    for e in events:
        if e.kind == EventKind.MARK and e.data is not None and e.data.get("name") == name:
            return e.ts
    return None


def _first_mark_data(events: Iterable[Event], name: str) -> Mapping[str, object] | None:
    for e in events:
        if e.kind == EventKind.MARK and isinstance(e.data, Mapping) and e.data.get("name") == name:
            return e.data
    return None


def _text(value: object) -> str | None:
    return value[:500] if isinstance(value, str) else None


def recovery_kind(failed: AttemptMilestones, recovered: AttemptMilestones, *, requeued: bool) -> str:
    """How `recovered` recovered `failed`'s failure (see the module docstring); `requeued`: a new supervisor
    run started between them."""
    if recovered.recovery == IN_PLACE:
        return IN_PLACE
    if requeued:
        return "requeue"
    path = (recovered.relaunch or {}).get("path")
    return "warm_restart" if path in ("warm", "promoted", "forked", "spare") else "cold_restart"


def recovery_parts(
    failed: AttemptMilestones,
    recovered: AttemptMilestones,
    *,
    requeued: bool = False,
    run: RunTimes | None = None,
    run_gap_start_ts: float | None = None,
) -> RecoveryParts | None:
    """The parts of the recovery from `failed` to `recovered` (which trained); None if it did not train.
    `requeued`: a new supervisor run started between them (its kind is then `requeue`); `run`: that run,
    whose recorded allocation splits the wait into REQUEUE_PARTS; `run_gap_start_ts`: the end of the attempt
    just before that run (later than `failed`'s end when attempts failed between them: none of their time
    is the run's wait, though Slurm's whole-second SubmitTime may say so)."""
    if recovered.training_start_ts is None or recovered.first_step_ts is None:
        return None
    end = failed.end_ts
    detected = min(failed.detected_ts, end) if failed.detected_ts is not None else end
    failure = failed.failure_ts if failed.failure_ts is not None and failed.failure_ts <= detected else None
    parts: dict[str, float | None] = {
        "detection": None if failure is None else detected - failure,
        "teardown": end - detected,
    }
    limit = recovered.training_start_ts

    def at(ts: float, after: float) -> float:
        return max(after, min(ts, limit))

    floor = end if run is None or run_gap_start_ts is None else min(max(run_gap_start_ts, end), run.ts)
    wait = None if run is None else queue_wait(run, floor)
    if run is not None and wait is not None:  # as the buckets split a requeue's gap
        queued, allocated = wait
        marks = [end, at(queued, end)]
        marks.append(at(allocated, marks[-1]))
        marks.append(at(run.ts, marks[-1]))
        for name, begin, stop in zip(("backoff", *REQUEUE_PARTS), marks, marks[1:], strict=False):
            parts[name] = stop - begin
        if run.submitted_ts is None:  # the wait in the queue is in backoff, its length unknown: not 0
            parts["scheduling"] = None
        cursor = marks[-1]
    else:
        backoff_end = failed.backoff_end_ts if failed.backoff_end_ts is not None else recovered.start_ts
        cursor = at(backoff_end, end)
        parts["backoff"] = cursor - end
    cursor = _startup(parts, recovered, cursor, "relaunch")
    return RecoveryParts(
        failed_attempt=failed.index,
        recovered_attempt=recovered.index,
        start_ts=detected if failure is None else failure,
        first_step_ts=max(cursor, recovered.first_step_ts),
        parts_s=MappingProxyType(parts),
        headline_start_ts=end,
        training_start_ts=recovered.training_start_ts,
        failure_known=failure is not None,
        relaunch_path=_text((recovered.relaunch or {}).get("path")),
        relaunch_why=_text((recovered.relaunch or {}).get("why")),
        kind=recovery_kind(failed, recovered, requeued=requeued),
        restored_from=recovered.restored_from,
        restored_why=recovered.restored_why,
        restored_tier=recovered.restored_tier,
    )


def startup_parts(origin_ts: float, attempt: AttemptMilestones) -> RecoveryParts | None:
    """The parts of the time to start: `origin_ts` to the first step of `attempt` (None if it did not train)."""
    if attempt.training_start_ts is None or attempt.first_step_ts is None:
        return None
    launch = min(max(origin_ts, attempt.start_ts), attempt.training_start_ts)
    parts: dict[str, float | None] = {"before_launch": launch - origin_ts}
    cursor = _startup(parts, attempt, launch, "launch")
    return RecoveryParts(
        failed_attempt=None,
        recovered_attempt=attempt.index,
        start_ts=origin_ts,
        first_step_ts=max(cursor, attempt.first_step_ts),
        parts_s=MappingProxyType(parts),
        headline_start_ts=origin_ts,
        training_start_ts=attempt.training_start_ts,
    )


def _startup(parts: dict[str, float | None], a: AttemptMilestones, cursor: float, launch: str) -> float:
    """Fill the parts from `cursor` (the launch) to `a`'s first step; returns the first step's time."""
    assert a.training_start_ts is not None and a.first_step_ts is not None
    start = a.training_start_ts

    def advance(to: float | None) -> float:
        return cursor if to is None else max(cursor, min(to, start))

    after = advance(a.process_start_ts)
    parts[launch], cursor = after - cursor, after
    after = advance(a.imports_ts)
    parts["imports"], cursor = after - cursor, after
    parts.update(_sweep(a.phases, cursor, start))
    parts["first_step"] = max(0.0, a.first_step_ts - start)
    return max(start, a.first_step_ts)


def _sweep(phases: Sequence[Span], begin: float, end: float) -> dict[str, float]:
    """[begin, end) split among the in-process parts: each instant to the first part with a phase open."""
    names = [name for name, _ in _IN_PROCESS]
    spans: list[tuple[float, float, int]] = []
    for b, f, phase, _ in phases:
        for priority, (_, members) in enumerate(_IN_PROCESS):
            if phase in members:
                b2, f2 = max(b, begin), min(f, end)
                if f2 > b2:
                    spans.append((b2, f2, priority))
    out = dict.fromkeys([*names, "other_init"], 0.0)
    if end <= begin:
        return out
    cuts = sorted({begin, end, *(s[0] for s in spans), *(s[1] for s in spans)})
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        open_ = [p for b, f, p in spans if b <= lo and f >= hi]
        out[names[min(open_)] if open_ else "other_init"] += hi - lo
    return out


class ResolvedAttempt(Protocol):
    """What `breakdowns` reads of a resolved attempt (`ettr.accounting.attempts.Attempt`)."""

    @property
    def index(self) -> int: ...
    @property
    def start_ts(self) -> float: ...
    @property
    def end_ts(self) -> float: ...
    @property
    def reference_rank(self) -> int | None: ...
    @property
    def training_start_ts(self) -> float | None: ...
    @property
    def step_ts(self) -> Sequence[float]: ...
    @property
    def phases(self) -> Sequence[Span]: ...
    @property
    def rank_gone_ts(self) -> float | None: ...


NOTHING_RESTORED = "nothing"
"""`RecoveryParts.restored_from` of a recovered attempt that restored nothing (it started over)."""


def with_nothing_restored(
    parts: RecoveryParts, resumed_from_step: int | None, resume_unknown: bool
) -> RecoveryParts:
    """`parts` saying `nothing` was restored where no rank recorded a restore and its recovered attempt resumed
    from no step (`resumed_from_step` None, and not for want of knowing: `resume_unknown`): before, such a
    recovery read `(restored from) ?`, as if where it restored from were unknown, beside the attempts table's
    `-` (resumed from nothing)."""
    if parts.restored_from is not None or resumed_from_step is not None or resume_unknown:
        return parts
    return replace(parts, restored_from=NOTHING_RESTORED)


def breakdowns(
    raw_events: Mapping[int, Mapping[int, Sequence[Event]]],
    attempts: Sequence[ResolvedAttempt],
    recovered_pairs: Sequence[tuple[int, int]],
    tts: tuple[float, int] | None,
    runs: Sequence[RunTimes] = (),
) -> tuple[tuple[RecoveryParts, ...], RecoveryParts | None]:
    """The parts of each recovery ((failed index, recovered index) pairs) and of the start ((origin, attempt
    index) or None), from the resolved attempts and the raw events of each attempt by rank. `runs`: each
    supervisor run, in time order (a recovery across one is a requeue; the last in the gap, the run that
    started the recovered attempt, splits the wait)."""
    by_index = {
        a.index: milestones(
            index=a.index,
            start_ts=a.start_ts,
            end_ts=a.end_ts,
            rank_events=raw_events.get(a.index, {}),
            reference_rank=a.reference_rank,
            training_start_ts=a.training_start_ts,
            first_step_ts=a.step_ts[0] if a.step_ts else None,
            phases=a.phases,
            rank_gone_ts=a.rank_gone_ts,
        )
        for a in attempts
    }
    found = []
    for failed, recovered in recovered_pairs:
        before, after = by_index[failed], by_index[recovered]
        requeued = any(before.end_ts <= r.ts <= after.start_ts for r in runs)
        run = next((r for r in reversed(runs) if before.end_ts < r.ts <= after.start_ts), None)
        gap = max((a.end_ts for a in attempts if failed <= a.index < recovered), default=None)
        parts = recovery_parts(before, after, requeued=requeued, run=run, run_gap_start_ts=gap)
        if parts is not None:
            found.append(parts)
    start = None if tts is None else startup_parts(tts[0], by_index[tts[1]])
    return tuple(found), start
