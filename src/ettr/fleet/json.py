"""The contract's `ettr.fleet/1` object of a `FleetReport` (what `ettr fleet --json` prints).

Contract keys first (schema, ett_pct, jobs, regressions; each job and regression with its contract keys
first), then the extras. Plain JSON values; non-finite floats become null.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ettr.accounting import Cause
from ettr.events import Bucket
from ettr.fleet.aggregate import Distribution, FleetReport, Totals
from ettr.fleet.model import JobSummary
from ettr.fleet.preempt import PreemptCost
from ettr.fleet.regress import Regression
from ettr.report.json import plain

SCHEMA = "ettr.fleet/1"
GPUS_NOTE = (
    "gpus counts a job's ranks (its world size, one rank per GPU); a CPU job's ranks count the same way, "
    "so its GPU-hours are rank-hours; gpus_source says where each number came from"
)


def distribution(d: Distribution) -> dict[str, Any]:
    return {"count": d.count, "mean": d.mean, "p50": d.p50, "p90": d.p90, "max": d.max}


def job_dict(j: JobSummary) -> dict[str, Any]:
    return {
        "job_id": j.job_id,
        "family": j.family,
        "wall_s": j.wall_s,
        "ett_pct": j.ett_pct,  # a number, as ettr.fleet/1 says; `ett_unknown` says when it is no measurement
        "tts_s": j.tts_s,
        "num_failures": j.num_failures,
        "gpus": j.gpus,
        "start_ts": j.wall_start_ts,
        # Extras beyond the contract.
        "name": j.name,
        "end_ts": j.wall_end_ts,
        "idleness_pct": j.idleness_pct,
        "failure_pct": j.failure_pct,
        "ett_unknown": j.ett_unknown,
        "mean_ttr_s": j.mean_ttr_s,
        "ttr_s": list(j.ttr_s),
        "gpus_source": j.gpus_source,
        "buckets_s": {b.value: j.buckets_s[b] for b in Bucket},
        "failures": [
            {
                "attempt": f.attempt,
                "cause": f.cause.value,
                "detail": f.detail.value,
                "evidence": f.evidence,
                "ttr_s": f.ttr_s,
            }
            for f in j.failures
        ],
        "num_attempts": j.num_attempts,
        "in_progress": j.in_progress,
        "running": j.running,
        "last_commit_ts": j.last_commit_ts,
        "source": j.source,
        "step_time_s": j.step_time_s,
        "step_time_p90_s": j.step_time_p90_s,
        "window_s": j.window_s,
        "window_ett_pct": j.window_ett_pct,
        "stragglers": None if j.stragglers is None else list(j.stragglers),
        "straggler_lost_s": j.straggler_lost_s,
        "recoveries": [{"kind": kind, "ttr_s": ttr_s} for kind, ttr_s in j.recoveries],
    }


def regression_dict(r: Regression) -> dict[str, Any]:
    return {
        "job_id": r.job_id,
        "family": r.family,
        "metric": r.metric,
        "baseline": r.baseline,
        "value": r.value,
        # Extras beyond the contract.
        "name": r.name,
        "change": r.change,
        "first_value": r.first_value,
        "robust_z": r.robust_z,
        "first_job_start_ts": r.first_job_start_ts,
        "num_baseline_jobs": r.num_baseline_jobs,
        "num_changed_jobs": r.num_changed_jobs,
    }


def totals_dict(t: Totals) -> dict[str, Any]:
    return {
        "num_jobs": t.num_jobs,
        "gpus": t.gpus,
        "gpu_hours": t.wall_gpu_s / 3600.0,
        "ett_pct": t.ett_pct,
        "idleness_pct": t.idleness_pct,
        "failure_pct": t.failure_pct,
        "jobs_ett_unknown": t.num_ett_unknown,
        "bucket_gpu_hours": {b.value: t.bucket_gpu_s[b] / 3600.0 for b in Bucket},
        "num_failures": t.num_failures,
        "num_infra_failures": t.failures_by_cause[Cause.INFRA],
        "num_failures_by_cause": {c.value: n for c, n in t.failures_by_cause.items()},
        "num_failures_by_detail": {d.value: n for d, n in t.failures_by_detail.items()},
        "tts_s": distribution(t.tts),
        "ttr_s": distribution(t.ttr),
        "ttr_s_by_cause": {c.value: distribution(d) for c, d in t.ttr_by_cause.items()},
        "ttr_s_by_kind": {kind: distribution(d) for kind, d in t.ttr_by_kind.items()},
    }


def preempt_dict(c: PreemptCost) -> dict[str, Any]:
    return {
        "job_id": c.job_id,
        "name": c.name,
        "family": c.family,
        "gpus": c.gpus,
        "cost_gpu_s": c.cost_gpu_s,
        "unsaved_s": c.unsaved_s,
        "recovery_s": c.recovery_s,
        "recovery_source": c.recovery_source,
        "last_commit_ts": c.last_commit_ts,
    }


def to_dict(
    report: FleetReport,
    *,
    problems: Sequence[str] = (),
    preempt: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The `ettr.fleet/1` object; `problems` are the jobs that could not be read; `preempt` (with
    --preempt-order) the preemption order object."""
    t = report.fleet
    out: dict[str, Any] = {
        "schema": SCHEMA,
        "ett_pct": t.ett_pct,
        "jobs": [job_dict(j) for j in report.jobs],
        "regressions": [regression_dict(r) for r in report.regressions],
        # Extras beyond the contract.
        "weighting": "wall time x gpus",
        "gpus_note": GPUS_NOTE,
        **{k: v for k, v in totals_dict(t).items() if k != "ett_pct"},
        "lost_gpu_hours": {b.value: h for b, h in t.lost_gpu_hours.items()},
        "costliest_buckets": [{"bucket": b.value, "gpu_hours": h} for b, h in report.costliest_buckets],
        "worst_jobs": [
            {
                "job_id": j.job_id,
                "name": j.name,
                "family": j.family,
                "ett_pct": j.ett_pct,
                "gpu_hours": j.gpu_s / 3600.0,
            }
            for j in report.worst_jobs
        ],
        "families": {name: totals_dict(v) for name, v in report.families.items()},
        "days": {name: totals_dict(v) for name, v in report.days.items()},
        "weeks": {name: totals_dict(v) for name, v in report.weeks.items()},
        "problems": list(problems),
        "jobs_with_stragglers": [
            {
                "job_id": j.job_id,
                "name": j.name,
                "family": j.family,
                "stragglers": list(j.stragglers),
                "lost_s": j.straggler_lost_s,
            }
            for j in report.jobs
            if j.stragglers
        ],
        "num_jobs_ranks_not_compared": sum(1 for j in report.jobs if j.stragglers is None),
        "step_speed_outliers": [
            {
                "job_id": o.job_id,
                "name": o.name,
                "family": o.family,
                "step_time_s": o.step_time_s,
                "family_step_time_s": o.family_step_time_s,
                "change": o.change,
                "num_family_jobs": o.num_family_jobs,
            }
            for o in report.step_speed
        ],
    }
    if preempt is not None:
        out["preempt_order"] = dict(preempt)
    return plain(out)


def preempt_object(
    costs: Sequence[PreemptCost], *, now: float, need_gpus: int | None, victims: Sequence[PreemptCost] | None
) -> dict[str, Any]:
    """The `--preempt-order` object: every running job cheapest first, and with --need-gpus the victims."""
    out: dict[str, Any] = {
        "now_ts": now,
        "cost_formula": "(unsaved_s + recovery_s) * gpus",
        "order": [preempt_dict(c) for c in costs],
    }
    if need_gpus is not None:
        chosen = list(victims or ())
        out["need_gpus"] = need_gpus
        out["victims"] = [c.job_id for c in chosen]
        out["freed_gpus"] = sum(c.gpus for c in chosen)
        out["enough"] = out["freed_gpus"] >= need_gpus
        out["cost_gpu_s"] = sum(c.cost_gpu_s for c in chosen)
    return out
