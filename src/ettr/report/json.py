"""The contract's `ettr.report/1` object of an `EttReport` (what `ettr report --json` prints).

Keys come in the contract's order; everything beyond the contract is added after its keys, never instead
of them. Values are plain JSON types (numbers, strings, null, lists, objects), non-finite floats as null.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ettr.accounting import AttemptReport, EttReport
from ettr.accounting.causes import count_by_cause, ttr_by_cause
from ettr.events import Bucket
from ettr.report import slow, steptime, ttr_parts, window
from ettr.report.slowdown import to_json as slowdown_json
from ettr.report.status import status

SCHEMA = "ettr.report/1"


def to_dict(report: EttReport, *, include_segments: bool = True) -> dict[str, Any]:
    """The `ettr.report/1` object of `report`.

    Contract keys first (schema, job_id, wall_s, ett_pct, idleness_pct — numbers always; when no training step
    was seen `ett_unknown` says why ett_pct is no measurement —, failure_pct, tts_s, ttr_s,
    num_failures, buckets_s, attempts, step_time_s — median seconds per kept step, null when none, also in
    each attempt), then the extras: step_time_p90_s and num_timed_steps (top level and per attempt),
    num_kept_steps, ett_window (ETT over the last hour or the window asked for: `ettr.report.window`),
    rank_speed (slow ranks: `ettr.report.slow`), slow_steps (step time beyond the steady step), ett_unknown (null, or why ETT cannot be told), in_progress, state (ended | running | supervisor_lost | in_progress), open_job (null when
    the job ended: state, status — the sentence the text report shows —, last_event_ts, attempt, attempt_open,
    bucket, open_phases, last_step, last_step_ts, last_commit_step, steps_at_risk, stop_signal, stop_signal_ts:
    the signal that reached the supervisor of the open attempt and when, null when none), wall_start_ts, wall_end_ts,
    effective_training_s, idleness_s, failure_s, submitted_ts, allocated_ts, supervisor_start_ts,
    job_exit_status, num_fenced_events (training events recorded after their attempt ended, not counted),
    phases_s, recompiles, checkpoint_commits, tts_window (origin_ts, training_start_ts,
    attempt; null when no attempt trained), recoveries (one per `ttr_s` entry: failed_attempt, outcome,
    detected_ts, recovered_attempt, training_start_ts, ttr_s), failures (attempt, cause, evidence,
    ttr_s), num_failures_by_cause, ttr_s_by_cause, num_infra_failures, step_slowdown (null without a
    persist: steady_step_s, persist_step_s, inflation, extra_s, num_quiet_steps, num_busy_steps, saves),
    ttr_parts (one per recovery) and tts_parts (`ettr.report.ttr_parts.to_json`: where each second from
    failure to first step went, with `headline_s`, equal to that recovery's `ttr_s`), tts_measures and
    ttr_measures (what the headline `tts_s` and `ttr_s` measure, in words) and, unless `include_segments` is False (a
    long job with per-step phases has millions), segments as [start_ts, end_ts, bucket, attempt] lists.
    """
    out: dict[str, Any] = {
        "schema": SCHEMA,
        "job_id": report.job_id,
        "wall_s": report.wall_s,
        # Numbers, as `ettr.report/1` says (they sum to 100 with failure_pct, from the buckets); when no
        # training step was seen `ett_unknown` says why ett_pct is no measurement (the text report says unknown)
        "ett_pct": report.ett_pct,
        "idleness_pct": report.idleness_pct,
        "failure_pct": report.failure_pct,
        "tts_s": report.tts_s,
        "ttr_s": list(report.ttr_s),
        "num_failures": report.num_failures,
        "buckets_s": _buckets(report.buckets_s),
        "attempts": [_attempt(a) for a in report.attempts],
        # Added in the third wave: median time per kept step (null when none), then its extras.
        **steptime.to_json(report.step_time),
        "num_kept_steps": report.num_kept_steps,
        "ett_window": window.to_json(report.window),
        "rank_speed": slow.rank_speed_json(report.rank_speed),
        "slow_steps": slow.slow_steps_json(report.slow_steps),
        # Extras beyond the contract.
        "ett_unknown": report.ett_unknown,
        "in_progress": report.in_progress,
        "state": report.state.value,
        "open_job": _open_job(report),
        "wall_start_ts": report.wall_start_ts,
        "wall_end_ts": report.wall_end_ts,
        "effective_training_s": report.effective_training_s,
        "idleness_s": report.idleness_s,
        "failure_s": report.failure_s,
        "submitted_ts": report.submitted_ts,
        "allocated_ts": report.allocated_ts,
        "supervisor_start_ts": report.supervisor_start_ts,
        "job_exit_status": report.job_exit_status,
        "num_fenced_events": report.num_fenced_events,
        "phases_s": dict(report.phases_s),
        "recompiles": [
            {"ts": r.ts, "attempt": r.attempt, "rank": r.rank, "reason": r.reason, "data": plain(r.data)}
            for r in report.recompiles
        ],
        "checkpoint_commits": [
            {"ts": c.ts, "attempt": c.attempt, "rank": c.rank, "step": c.step, "path": c.path}
            for c in report.checkpoint_commits
        ],
        "checkpoint_errors": [
            {
                "ts": c.ts,
                "attempt": c.attempt,
                "rank": c.rank,
                "step": c.step,
                "path": c.path,
                "error": c.error,
            }
            for c in report.checkpoint_errors
        ],
        "tts_window": None
        if report.tts_window is None
        else {
            "origin_ts": report.tts_window.origin_ts,
            "training_start_ts": report.tts_window.training_start_ts,
            "attempt": report.tts_window.attempt,
        },
        "recoveries": [
            {
                "failed_attempt": r.failed.index,
                "outcome": r.failed.outcome.value,
                "detected_ts": r.detected_ts,
                "recovered_attempt": r.recovered.index,
                "training_start_ts": r.training_start_ts,
                "ttr_s": r.ttr_s,
            }
            for r in report.recoveries
        ],
        "failures": [
            {
                "attempt": f.attempt,
                "cause": f.cause.value,
                "detail": f.detail.value,
                "evidence": f.evidence,
                "ttr_s": f.ttr_s,
            }
            for f in report.failures
        ],
        "num_failures_by_cause": {c.value: n for c, n in count_by_cause(report.failures).items()},
        "ttr_s_by_cause": {c.value: list(v) for c, v in ttr_by_cause(report.failures).items()},
        "num_infra_failures": report.num_infra_failures,
        "step_slowdown": slowdown_json(report.slowdown),
        "ttr_parts": [ttr_parts.to_json(p) for p in report.ttr_parts],
        "tts_parts": ttr_parts.to_json(report.tts_parts),
        "tts_measures": ttr_parts.TTS_MEASURES,
        "ttr_measures": ttr_parts.TTR_MEASURES,
    }
    if include_segments:
        out["segments"] = [[s.start_ts, s.end_ts, s.bucket.value, s.attempt] for s in report.segments]
    return plain(out)


def _open_job(report: EttReport) -> dict[str, Any] | None:
    o = report.open_job
    if o is None:
        return None
    return {
        "state": o.state.value,
        "status": status(report),
        "last_event_ts": o.last_event_ts,
        "attempt": o.attempt,
        "attempt_open": o.attempt_open,
        "bucket": None if o.bucket is None else o.bucket.value,
        "open_phases": list(o.open_phases),
        "last_step": o.last_step,
        "last_step_ts": o.last_step_ts,
        "last_commit_step": o.last_commit_step,
        "steps_at_risk": o.steps_at_risk,
        "stop_signal": o.stop_signal,
        "stop_signal_ts": o.stop_signal_ts,
    }


def _buckets(buckets: Mapping[Bucket, float]) -> dict[str, float]:
    return {bucket.value: buckets[bucket] for bucket in Bucket}


def _attempt(attempt: AttemptReport) -> dict[str, Any]:
    out: dict[str, Any] = {
        "index": attempt.index,
        "start_ts": attempt.start_ts,
        "end_ts": attempt.end_ts,
        "outcome": attempt.outcome.value,
        "exit_code": attempt.exit_code,
        "resumed_from_step": attempt.resumed_from_step,
        "last_step": attempt.last_step,
        "lost_steps": attempt.lost_steps,
        "buckets_s": _buckets(attempt.buckets_s),
        **steptime.to_json(attempt.step_time),
        # Extras beyond the contract.
        "duration_s": attempt.duration_s,
        "training_start_ts": attempt.training_start_ts,
        "num_steps": attempt.num_steps,
        "reference_rank": attempt.reference_rank,
        "closed_by_accounting": attempt.closed_by_accounting,
        "phases_s": dict(attempt.phases_s),
        "resumed_step_unknown": attempt.resumed_step_unknown,
        "lost_steps_estimated": attempt.lost_steps_estimated,
    }
    if attempt.failure is not None:
        out["failure"] = dict(attempt.failure)
    return out


def plain(value: Any) -> Any:
    """`value` as JSON-safe data: mappings with string keys, lists, finite numbers, strings, None."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return str(value)  # a StrEnum becomes its plain value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [plain(v) for v in value]
    return str(value)
