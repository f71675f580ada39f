"""One job's timeline as a Chrome/Perfetto trace: the JSON trace-event format that ui.perfetto.dev and
chrome://tracing both open.

`to_trace(events, report)` is pure (events and their `EttReport` in, a JSON-ready dict out); `write_trace`
commits it to a file. The picture draws the numbers it is given: the bucket track is the report's own
segments, the attempt spans are the report's attempts (closed by the accounting where a SIGKILL left them
open), and phases are paired and clipped by the accounting's own rule, so the trace and `ettr report` agree.

Layout (one Perfetto "process" per group, one "thread" per track):

- ``ETT accounting``: the buckets (one complete event per segment), the TTS and TTR windows, and a counter of
  the effective-training share of the wall time so far (its last value is the report's ETT%).
- ``supervisor``: one span per attempt (outcome, exit code, resumed/last/lost steps) and an instant per
  supervisor event (submitted, allocated, attempt start/end, job end, ...).
- ``rank R`` (one per training rank, every attempt on the same track): phases as complete events (on extra
  lanes where phases overlap, so every lane nests properly), the global step as a counter, and instants for
  process start, training start, resume, checkpoint commits and errors, failures, recompiles and marks.

Timestamps are integer microseconds from the trace origin (the job's wall start, or an earlier event);
`otherData.origin_unix_s` gives that origin as Unix time.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from operator import attrgetter
from pathlib import Path
from typing import Any

from ettr.accounting import EttReport, classify
from ettr.accounting.attempts import pair_phases
from ettr.atomic import atomic_write
from ettr.errors import UsageError
from ettr.events import PHASE_BUCKET, SUPERVISOR_RANK, Bucket, Event, EventKind
from ettr.report.json import plain
from ettr.report.startup_charts import recoveries, tts_window

SCHEMA = "ettr.trace/1"
"""`otherData.schema` of the traces this module writes."""

PID_ACCOUNTING = 1
PID_SUPERVISOR = 2
PID_RANK_BASE = 100
"""The process id of rank R's track group is PID_RANK_BASE + R."""

TID_BUCKETS, TID_WINDOWS = 1, 2
"""Accounting process: the bucket track, then the windows (and their extra lanes, tids 3, 4, ...)."""
TID_ATTEMPTS, TID_SUPERVISOR_EVENTS = 1, 2
TID_RANK_EVENTS = 1000
"""Rank processes: phase lanes are tids 1, 2, ...; instants go to this tid."""

_Clock = Callable[[float], int]
"""Unix seconds -> integer microseconds from the trace's origin."""

_RANK_INSTANTS = {
    EventKind.PROCESS_START: "process start",
    EventKind.TRAINING_START: "training start",
    EventKind.RESUMED: "resumed",
    EventKind.CHECKPOINT_COMMIT: "checkpoint commit",
    EventKind.CHECKPOINT_ERROR: "checkpoint error",
    EventKind.FAILURE: "failure",
    EventKind.RECOMPILE: "recompile",
    EventKind.MARK: "mark",
}


def to_trace(events: Iterable[Event], report: EttReport) -> dict[str, Any]:
    """The trace of one job: ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``.

    `events` are the job's events (any order) and `report` is `accounting.compute` of them. Complete events
    ("X") carry ``dur >= 0``; on each track they are emitted by start time and properly nested.
    """
    # As the accounting: an event without a finite time cannot be placed.
    ordered = sorted((e for e in events if math.isfinite(e.ts)), key=attrgetter("ts"))
    origin = min([report.wall_start_ts, *(e.ts for e in ordered[:1])])

    def us(ts: float) -> int:
        return round((ts - origin) * 1e6)

    out: list[dict[str, Any]] = []
    out += _process(PID_ACCOUNTING, f"ETT accounting (job {report.job_id})", 0)
    out += _thread(PID_ACCOUNTING, TID_BUCKETS, "buckets (the report's timeline)", 0)
    out += _thread(PID_ACCOUNTING, TID_WINDOWS, "TTS / TTR windows", 1)
    out += _accounting(report, us)
    out += _process(PID_SUPERVISOR, "supervisor", 1)
    out += _thread(PID_SUPERVISOR, TID_ATTEMPTS, "attempts", 0)
    out += _thread(PID_SUPERVISOR, TID_SUPERVISOR_EVENTS, "supervisor events", 1)
    out += _supervisor(ordered, report, us)
    by_rank: dict[int, list[Event]] = {}
    for e in ordered:
        if e.rank >= 0:
            by_rank.setdefault(e.rank, []).append(e)
    ranks = sorted(by_rank)
    for rank in ranks:
        out += _rank(rank, by_rank[rank], report, us)
    return {
        "traceEvents": out,
        "displayTimeUnit": "ms",
        "otherData": {
            "schema": SCHEMA,
            "job_id": report.job_id,
            "origin_unix_s": origin,
            "wall_s": report.wall_s,
            "ett_pct": report.ett_pct,
            "num_failures": report.num_failures,
            "in_progress": report.in_progress,
            "ranks": ranks,
        },
    }


def write_trace(events: Iterable[Event], report: EttReport, path: str | os.PathLike[str]) -> None:
    """Write `to_trace(events, report)` to `path`, whole or not at all (`ettr.atomic.atomic_write`).

    Raises `UsageError` (one line) when `path` cannot be written.
    """
    text = json.dumps(to_trace(events, report), separators=(",", ":"), allow_nan=False)
    target = Path(path)
    try:
        atomic_write(target, text)
    except OSError as exc:
        raise UsageError(f"{target}: cannot write the trace ({exc.strerror or exc})") from None


# -- metadata -------------------------------------------------------------------------------------------
def _process(pid: int, name: str, sort_index: int) -> list[dict[str, Any]]:
    return [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": sort_index}},
    ]


def _thread(pid: int, tid: int, name: str, sort_index: int) -> list[dict[str, Any]]:
    return [
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}},
        {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": sort_index}},
    ]


def _complete(pid: int, tid: int, name: str, cat: str, start: int, end: int, args: Mapping) -> dict[str, Any]:
    return {
        "ph": "X",
        "name": name,
        "cat": cat,
        "pid": pid,
        "tid": tid,
        "ts": start,
        "dur": end - start,
        "args": plain(args),
    }


def _instant(pid: int, tid: int, name: str, cat: str, ts: int, args: Mapping) -> dict[str, Any]:
    return {
        "ph": "i",
        "s": "t",
        "name": name,
        "cat": cat,
        "pid": pid,
        "tid": tid,
        "ts": ts,
        "args": plain(args),
    }


# -- the accounting's track -----------------------------------------------------------------------------
def _accounting(report: EttReport, us: _Clock) -> list[dict[str, Any]]:
    position = {a.index: i for i, a in enumerate(report.attempts)}
    out: list[dict[str, Any]] = []
    effective_s = 0.0
    for seg in report.segments:
        start, end = us(seg.start_ts), us(seg.end_ts)
        loss = classify(
            seg.bucket, attempt_position=position.get(seg.attempt, 0) if seg.attempt is not None else 0
        )
        if seg.bucket is Bucket.EFFECTIVE_TRAINING:
            effective_s += seg.end_ts - seg.start_ts
        if end > start:
            args = {"attempt": seg.attempt, "counts_as": loss.value, "seconds": seg.end_ts - seg.start_ts}
            out.append(_complete(PID_ACCOUNTING, TID_BUCKETS, seg.bucket.value, "bucket", start, end, args))
        elapsed_s = seg.end_ts - report.wall_start_ts
        if elapsed_s > 0:
            value = {"effective_training_pct": effective_s / elapsed_s * 100.0}
            out.append(
                {"ph": "C", "name": "ETT % so far", "pid": PID_ACCOUNTING, "tid": 0, "ts": end, "args": value}
            )
    windows: list[tuple[int, int, str, dict[str, Any]]] = []
    window = tts_window(report)
    if window is not None and report.tts_s is not None:
        windows.append((us(window[0]), us(window[1]), "TTS", {"tts_s": report.tts_s}))
    for n, rec in enumerate(recoveries(report)):
        name = f"TTR #{n + 1} (after attempt {rec.failed.index})"
        windows.append((us(rec.detected_ts), us(rec.training_start_ts), name, {"ttr_s": rec.ttr_s}))
    windows.sort(key=lambda w: (w[0], -w[1]))
    lanes = _lanes([(b, e) for b, e, _n, _a in windows])
    for lane in sorted(set(lanes) - {1}):  # windows that overlap without nesting: more lanes
        out += _thread(PID_ACCOUNTING, TID_WINDOWS + lane - 1, f"TTS / TTR windows (lane {lane})", lane)
    for (begin, end, name, args), lane in zip(windows, lanes, strict=True):
        out.append(_complete(PID_ACCOUNTING, TID_WINDOWS + lane - 1, name, "window", begin, end, args))
    return out


# -- the supervisor's track -----------------------------------------------------------------------------
def _supervisor(ordered: Sequence[Event], report: EttReport, us: _Clock) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for a in report.attempts:
        args = {
            "outcome": a.outcome.value,
            "exit_code": a.exit_code,
            "resumed_from_step": a.resumed_from_step,
            "last_step": a.last_step,
            "lost_steps": a.lost_steps,
            "num_steps": a.num_steps,
            "closed_by_accounting": a.closed_by_accounting,
            "failure": a.failure,
            "buckets_s": {b.value: s for b, s in a.buckets_s.items() if s > 0},
        }
        name = f"attempt {a.index}: {a.outcome.value}"
        out.append(
            _complete(PID_SUPERVISOR, TID_ATTEMPTS, name, "attempt", us(a.start_ts), us(a.end_ts), args)
        )
    for e in ordered:
        if e.rank != SUPERVISOR_RANK:
            continue
        args = {"attempt": e.attempt, **(e.data or {})}
        out.append(
            _instant(PID_SUPERVISOR, TID_SUPERVISOR_EVENTS, _supervisor_name(e), "supervisor", us(e.ts), args)
        )
    return out


def _supervisor_name(e: Event) -> str:
    data = e.data or {}
    if e.kind is EventKind.ATTEMPT_START:
        return f"attempt {e.attempt} start"
    if e.kind is EventKind.ATTEMPT_END:
        return f"attempt {e.attempt} end: {data.get('outcome', '?')} (exit {data.get('exit_code')})"
    if e.kind is EventKind.JOB_END:
        return f"job end (exit status {data.get('exit_status')})"
    if e.kind is EventKind.MARK:
        return f"mark: {data.get('name', '?')}"
    return e.kind.value.replace("_", " ")


# -- one rank's tracks ----------------------------------------------------------------------------------
def _rank(rank: int, ordered: Sequence[Event], report: EttReport, us: _Clock) -> list[dict[str, Any]]:
    pid = PID_RANK_BASE + rank
    out = _process(pid, f"rank {rank}", 10 + rank)
    spans = {a.index: (a.start_ts, a.end_ts) for a in report.attempts}
    phases: list[tuple[int, int, str, dict[str, Any]]] = []
    by_attempt: dict[int, list[Event]] = {}
    for e in ordered:
        by_attempt.setdefault(e.attempt, []).append(e)
    for attempt, mine in sorted(by_attempt.items()):
        start_ts, end_ts = spans.get(attempt, (report.wall_start_ts, report.wall_end_ts))
        for begin, end, phase, name in pair_phases(mine, start_ts, end_ts):
            bucket = PHASE_BUCKET.get(phase) if phase is not None else None
            # As the accounting: a background phase (persist) or an unknown one keeps its raw duration only.
            label = bucket.value if bucket else "none (raw duration only)"
            phases.append((us(begin), us(end), name, {"attempt": attempt, "bucket": label}))
    phases.sort(key=lambda p: (p[0], -p[1]))
    lanes = _lanes([(b, e) for b, e, _n, _a in phases])
    for lane in sorted(set(lanes)):
        out += _thread(pid, lane, "phases" if lane == 1 else f"phases (overlapping, lane {lane})", lane)
    for (begin, end, name, phase_args), lane in zip(phases, lanes, strict=True):
        out.append(_complete(pid, lane, name, "phase", begin, end, phase_args))
    out += _thread(pid, TID_RANK_EVENTS, "events", TID_RANK_EVENTS)
    for e in ordered:
        if e.kind is EventKind.STEP and e.step is not None:
            out.append(
                {
                    "ph": "C",
                    "name": "global step",
                    "pid": pid,
                    "tid": 0,
                    "ts": us(e.ts),
                    "args": {"step": e.step},
                }
            )
        elif e.kind in _RANK_INSTANTS:
            args: dict[str, Any] = {"attempt": e.attempt, "step": e.step, **(e.data or {})}
            out.append(_instant(pid, TID_RANK_EVENTS, _rank_name(e), e.kind.value, us(e.ts), args))
    return out


def _rank_name(e: Event) -> str:
    name = _RANK_INSTANTS[e.kind]
    if e.kind is EventKind.RESUMED:
        # No step: from scratch, or a step the instrumentation could not know (its data says which).
        return f"resumed from step {e.step}" if e.step is not None else "resumed (no step recorded)"
    if e.kind in (EventKind.CHECKPOINT_COMMIT, EventKind.CHECKPOINT_ERROR) and e.step is not None:
        return f"{name} (step {e.step})"
    if e.kind is EventKind.MARK:
        return f"mark: {(e.data or {}).get('name', '?')}"
    return name


def _lanes(spans: Sequence[tuple[int, int]]) -> list[int]:
    """A lane (1, 2, ...) for each [begin, end) span such that the spans of one lane nest or follow one
    another, never partly overlap (what a trace viewer's thread track needs). `spans` must be sorted by
    begin, the longer first where two begin together."""
    stacks: list[list[int]] = []  # per lane: the ends of its open spans, outermost first
    lanes = []
    for begin, end in spans:
        for n, stack in enumerate(stacks):
            while stack and stack[-1] <= begin:
                stack.pop()
            if not stack or end <= stack[-1]:
                stack.append(end)
                lanes.append(n + 1)
                break
        else:
            stacks.append([end])
            lanes.append(len(stacks))
    return lanes
