"""`JobSummary`: what the fleet keeps of one job's `EttReport` (small, picklable, no timeline)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from ettr.accounting import DEFAULT_WINDOW_S, Cause, EttReport, FailureCause
from ettr.events import Bucket

GPUS_WORLD_SIZE = "world_size"
"""`gpus` is the world size the job's training processes recorded (one rank per accelerator)."""
GPUS_RANKS = "ranks"
"""`gpus` is the number of distinct ranks that started or stepped (no world size recorded)."""
GPUS_ASSUMED = "assumed"
"""Nothing said how many ranks ran: `gpus` is 1."""


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSummary:
    """One job as the fleet sees it: the report's figures, its family and size, and its checkpoint state.

    `gpus` counts the job's ranks (its world size): one rank per GPU in a GPU job; a CPU job's ranks count
    the same way, so its "GPU-hours" are rank-hours (`gpus_source` says where the number came from).
    """

    job_id: str
    family: str
    source: str
    """Where it was read from: a run directory, or a ledger URL."""
    gpus: int
    gpus_source: str
    wall_start_ts: float
    wall_end_ts: float
    wall_s: float
    ett_pct: float
    idleness_pct: float
    failure_pct: float
    tts_s: float | None
    ttr_s: tuple[float, ...]
    num_failures: int
    buckets_s: Mapping[Bucket, float]
    failures: tuple[FailureCause, ...]
    num_attempts: int
    last_attempt: int | None
    """Index of the job's last attempt (a failure of an earlier one was restarted)."""
    in_progress: bool
    """No JOB_END recorded."""
    running: bool
    """Believed to be running now (in progress, and its supervisor is alive or on another host)."""
    last_commit_ts: float | None
    """The newest checkpoint commit of the job, any attempt."""
    progress_start_ts: float | None
    """When the last attempt's training began (its work before that was restored or redone)."""
    step_time_s: float | None = None
    """Median seconds per kept step (the report's `step_time_s`); None when none was timed."""
    step_time_p90_s: float | None = None
    window_s: float = DEFAULT_WINDOW_S
    """The window of `window_ett_pct` (`ettr serve --window`; the report's `ett_window`)."""
    window_ett_pct: float | None = None
    """ETT over the last `window_s` of the job's wall time (all of it when shorter)."""
    stragglers: tuple[str, ...] | None = None
    """Its slow ranks or nodes, one line each (`ettr.report.slow.straggler_line`); () when its ranks were
    compared and none straggled; None when they could not be (one rank, or only the reference rank's steps
    were read: a running job, or one without a summary stored at its end)."""
    straggler_lost_s: float | None = None
    """Time the job waited for its slow ranks; None when not checked."""
    recoveries: tuple[tuple[str, float], ...] = ()
    """(kind, headline TTR s) of each recovered failure that trained again (`RecoveryParts.kind`: in_place,
    warm_restart, cold_restart, requeue)."""
    name: str = ""
    """What a person calls the job: the name of its run directory (the one read, else the one its supervisor
    recorded); "" when unknown. A generated job id (`job-20261202-012743-11158`) says nothing to a person."""

    @property
    def label(self) -> str:
        """The job as a person reads it: `job_label(job_id, name)`."""
        return job_label(self.job_id, self.name)

    @property
    def mean_ttr_s(self) -> float | None:
        return sum(self.ttr_s) / len(self.ttr_s) if self.ttr_s else None

    @property
    def gpu_s(self) -> float:
        return self.wall_s * self.gpus


def job_label(job_id: str, name: str) -> str:
    """`name (job_id)` when the job has a name its id does not already say, else the id."""
    return f"{name} ({job_id})" if name and name != job_id else job_id


def summarize(
    report: EttReport,
    *,
    family: str,
    source: str,
    gpus: int,
    gpus_source: str,
    running: bool,
    name: str = "",
) -> JobSummary:
    """The fleet's view of one job's report."""
    commits = [c.ts for c in report.checkpoint_commits]
    last = report.attempts[-1] if report.attempts else None
    failures = tuple(report.failures)
    if running and last is not None and last.closed_by_accounting:
        # The attempt running now has not failed: the report only closed it at the report time.
        failures = tuple(f for f in failures if f.attempt != last.index)
    return JobSummary(
        job_id=report.job_id,
        family=family,
        source=source,
        gpus=gpus,
        gpus_source=gpus_source,
        wall_start_ts=report.wall_start_ts,
        wall_end_ts=report.wall_end_ts,
        wall_s=report.wall_s,
        ett_pct=report.ett_pct,
        idleness_pct=report.idleness_pct,
        failure_pct=report.failure_pct,
        tts_s=report.tts_s,
        ttr_s=tuple(report.ttr_s),
        num_failures=report.num_failures - (len(report.failures) - len(failures)),
        buckets_s=dict(report.buckets_s),  # a plain dict: summaries cross process boundaries (pickle)
        failures=failures,
        num_attempts=len(report.attempts),
        last_attempt=None if last is None else last.index,
        in_progress=report.in_progress,
        running=running,
        last_commit_ts=max(commits) if commits else None,
        progress_start_ts=None if last is None else last.training_start_ts,
        step_time_s=report.step_time.median_s,
        step_time_p90_s=report.step_time.p90_s,
        window_s=report.window.window_s if report.window is not None else DEFAULT_WINDOW_S,
        window_ett_pct=report.window.ett_pct if report.window is not None else None,
        stragglers=_stragglers(report),
        straggler_lost_s=None if report.rank_speed is None else report.rank_speed.lost_s,
        recoveries=tuple((p.kind or "cold_restart", p.headline_s) for p in report.ttr_parts),
        name=name,
    )


def _stragglers(report: EttReport) -> tuple[str, ...] | None:
    from ettr.report.slow import straggler_line

    ranks = report.rank_speed
    if ranks is None or not ranks.checked:
        return None
    return tuple(straggler_line(s, report.wall_start_ts) for s in ranks.stragglers)


@functools.cache
def version() -> str:
    """The installed ettr's version ("unknown" from a source checkout that is not installed)."""
    try:
        from importlib.metadata import version as distribution_version

        return distribution_version("ettr")
    except Exception:  # not installed as a distribution (a source checkout on PYTHONPATH)
        return "unknown"


_FIELDS = frozenset(f.name for f in fields(JobSummary))


def summary_to_json(summary: JobSummary) -> dict[str, Any]:
    """`summary` as plain JSON data (for the on-disk cache); `summary_from_json` reverses it exactly."""
    out = asdict(summary)
    out["buckets_s"] = {b.value: v for b, v in summary.buckets_s.items()}
    out["failures"] = [{**asdict(f), "cause": f.cause.value} for f in summary.failures]
    out["ttr_s"] = list(summary.ttr_s)
    out["recoveries"] = [list(r) for r in summary.recoveries]
    return out


def summary_from_json(data: Mapping[str, Any]) -> JobSummary:
    """The `JobSummary` of `summary_to_json`'s output. Raises KeyError/ValueError/TypeError when malformed."""
    if not _FIELDS - {"name"} <= set(data) <= _FIELDS:  # one stored before names: the same, nameless
        raise ValueError("not a JobSummary of this version")
    values = dict(data)
    values["name"] = str(data.get("name", ""))
    values["buckets_s"] = {Bucket(k): float(v) for k, v in data["buckets_s"].items()}
    values["failures"] = tuple(FailureCause(**{**f, "cause": Cause(f["cause"])}) for f in data["failures"])
    values["ttr_s"] = tuple(float(t) for t in data["ttr_s"])
    if data["stragglers"] is not None:
        values["stragglers"] = tuple(str(s) for s in data["stragglers"])
    values["recoveries"] = tuple((str(k), float(s)) for k, s in data["recoveries"])
    return JobSummary(**values)
