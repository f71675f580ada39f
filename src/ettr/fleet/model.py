"""`JobSummary`: what the fleet keeps of one job's `EttReport` (small, picklable, no timeline)."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from ettr.accounting import DEFAULT_WINDOW_S, Cause, Detail, EttReport, FailureCause
from ettr.events import Bucket
from ettr.untrusted import one_line

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
    ett_unknown: str | None = None
    """Why the job's ETT cannot be told (`EttReport.ett_unknown`: it ended without a training step seen),
    None when it can. Its `ett_pct` is then 0 by its buckets, not a measurement: the fleet's shares leave
    the job out, its JSON `ett_pct` is null, no regression or gauge reads it."""
    last_event_ts: float | None = None
    """The newest event the job recorded (no heartbeat); None when not known. A running job's wall counter
    goes to it, not to `now`: the job's end, when it comes, is never before it."""
    name: str = ""
    """What a person calls the job: the name of its run directory (the one read, else the one its supervisor
    recorded); "" when unknown. A generated job id (`job-20261202-012743-11158`) says nothing to a person."""
    recorded_run_dir: str = ""
    """The run directory its last supervisor recorded it ran in (`run_dir` of its SUPERVISOR_START); "" when
    none was recorded. A copy of a run directory (or a forgery of one) read elsewhere names another directory
    than the one it was read from (`load.drop_copies`)."""

    @property
    def ett_known(self) -> bool:
        """Whether `ett_pct` is a measurement (a training step was seen)."""
        return self.ett_unknown is None

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
    """`name (job_id)` when the job has a name its id does not already say, else the id; one line whatever
    they hold (`untrusted.one_line`: a run directory's name may hold a newline)."""
    return one_line(f"{name} ({job_id})" if name and name != job_id else job_id)


def summarize(
    report: EttReport,
    *,
    family: str,
    source: str,
    gpus: int,
    gpus_source: str,
    running: bool,
    name: str = "",
    last_event_ts: float | None = None,
    recorded_run_dir: str = "",
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
        ett_unknown=report.ett_unknown,
        name=name,
        last_event_ts=last_event_ts,
        recorded_run_dir=recorded_run_dir,
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
_LATER_FIELDS = frozenset({"name", "ett_unknown", "last_event_ts", "recorded_run_dir"})
"""Fields added after summaries were first stored: a summary without them is read with their defaults."""


def summary_to_json(summary: JobSummary) -> dict[str, Any]:
    """`summary` as plain JSON data (for the on-disk cache); `summary_from_json` reverses it exactly."""
    out = asdict(summary)
    out["buckets_s"] = {b.value: v for b, v in summary.buckets_s.items()}
    out["failures"] = [
        {**asdict(f), "cause": f.cause.value, "detail": f.detail.value} for f in summary.failures
    ]
    out["ttr_s"] = list(summary.ttr_s)
    out["recoveries"] = [list(r) for r in summary.recoveries]
    return out


def summary_from_json(data: Mapping[str, Any]) -> JobSummary:
    """The `JobSummary` of `summary_to_json`'s output, validated (`check_summary`): a stored summary or a
    cache entry may be damaged or forged. Raises KeyError/ValueError/TypeError when malformed."""
    if not isinstance(data, Mapping) or not _FIELDS - _LATER_FIELDS <= set(data) <= _FIELDS:
        raise ValueError("not a JobSummary of this version")  # one stored before names: the same, nameless
    values = dict(data)
    values["name"] = str(data.get("name", ""))
    values["recorded_run_dir"] = str(data.get("recorded_run_dir", ""))
    unknown = data.get("ett_unknown")
    if unknown is not None and not isinstance(unknown, str):
        raise ValueError("ett_unknown is not a string")
    values["ett_unknown"] = None if unknown is None else unknown[:500]
    last_event = data.get("last_event_ts")
    values["last_event_ts"] = None if last_event is None else _number(last_event)
    values["buckets_s"] = {Bucket(k): _number(v) for k, v in _mapping(data["buckets_s"]).items()}
    values["failures"] = tuple(
        FailureCause(
            **{
                **_mapping(f),
                "cause": Cause(_mapping(f)["cause"]),
                "detail": Detail(_mapping(f).get("detail", "unknown")),
            }
        )
        for f in _sequence(data["failures"])
    )
    values["ttr_s"] = tuple(_number(t) for t in _sequence(data["ttr_s"]))
    if data["stragglers"] is not None:
        values["stragglers"] = tuple(str(s) for s in _sequence(data["stragglers"]))
    values["recoveries"] = tuple((str(k), _number(s)) for k, s in _sequence(data["recoveries"]))
    summary = JobSummary(**values)
    check_summary(summary)
    return summary


def _mapping(value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError("not an object")
    return value


def _sequence(value: Any) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise TypeError("not a list")
    return list(value)


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{value!r:.40} is not a number")
    out = float(value)  # OverflowError (a ValueError's kin) for an int past a float's range
    if not math.isfinite(out):
        raise ValueError("not a finite number")
    return out


MAX_GPUS = 1 << 24
"""As many ranks as a ledger row may name (`ettr.ledger.rows.MAX_RANK`)."""
MAX_TS = 1e10
"""Times are Unix seconds before 2286 (as `ettr.ledger.rows.MAX_TS`)."""
MAX_COUNT = 1_000_000
"""No job restarts or fails a million times (as `ettr.ledger.rows.MAX_ATTEMPT`)."""
MAX_TEXT = 4096
_TOLERANCE = 1e-6


def check_summary(summary: JobSummary) -> None:
    """Raise ValueError unless every figure of `summary` is one `summarize` could have made: finite numbers
    in range, times of this era, shares of 0..100 %, buckets that partition its wall time, the ETT% that its
    buckets give. (A summary crafted to be consistent passes: whose it is says `ettr.fleet.stored`.)"""

    def finite(
        name: str, value: Any, low: float = 0.0, high: float = math.inf, *, optional: bool = False
    ) -> None:
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{name} is not a number")
        try:
            number = float(value)
        except OverflowError:
            raise ValueError(f"{name} is out of range") from None
        if not (math.isfinite(number) and low <= number <= high):
            raise ValueError(f"{name} = {number!r:.40} is out of range")

    def count(name: str, value: Any, low: int, high: int, *, optional: bool = False) -> None:
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"{name} = {value!r:.40} is not a count in {low}..{high}")

    for name in ("job_id", "name", "family", "source", "gpus_source", "recorded_run_dir"):
        text = getattr(summary, name)
        if not isinstance(text, str) or len(text) > MAX_TEXT:
            raise ValueError(f"{name} is not a short text")
    if summary.gpus_source not in (GPUS_WORLD_SIZE, GPUS_RANKS, GPUS_ASSUMED):
        raise ValueError(f"gpus_source {summary.gpus_source!r:.40} is unknown")
    count("gpus", summary.gpus, 1, MAX_GPUS)
    count("num_failures", summary.num_failures, 0, MAX_COUNT)
    count("num_attempts", summary.num_attempts, 0, MAX_COUNT)
    count("last_attempt", summary.last_attempt, 0, MAX_COUNT, optional=True)
    for name in ("in_progress", "running"):
        if not isinstance(getattr(summary, name), bool):
            raise ValueError(f"{name} is not true or false")
    finite("wall_start_ts", summary.wall_start_ts, 0.0, MAX_TS)
    finite("wall_end_ts", summary.wall_end_ts, summary.wall_start_ts, MAX_TS)
    finite("wall_s", summary.wall_s, 0.0, MAX_TS)
    for name in ("last_commit_ts", "progress_start_ts", "last_event_ts"):
        finite(name, getattr(summary, name), 0.0, MAX_TS, optional=True)
    for name in ("ett_pct", "idleness_pct", "failure_pct"):
        finite(name, getattr(summary, name), 0.0, 100.0 + _TOLERANCE)
    finite("window_ett_pct", summary.window_ett_pct, 0.0, 100.0 + _TOLERANCE, optional=True)
    finite("window_s", summary.window_s, _TOLERANCE, MAX_TS)
    for name in ("tts_s", "step_time_s", "step_time_p90_s", "straggler_lost_s"):
        finite(name, getattr(summary, name), 0.0, MAX_TS, optional=True)
    lists = (summary.ttr_s, summary.failures, summary.recoveries, summary.stragglers or ())
    if any(len(items) > MAX_COUNT for items in lists):
        raise ValueError("more entries than a job has")
    for ttr in (*summary.ttr_s, *(s for _kind, s in summary.recoveries)):
        finite("ttr_s", ttr, 0.0, MAX_TS)
    for failure in summary.failures:
        count("failures.attempt", failure.attempt, 0, MAX_COUNT)
        finite("failures.ttr_s", failure.ttr_s, 0.0, MAX_TS, optional=True)
        if not isinstance(failure.evidence, str):
            raise ValueError("failures.evidence is not text")
    if set(summary.buckets_s) != set(Bucket):
        raise ValueError("buckets_s does not name every bucket once")
    for bucket, seconds in summary.buckets_s.items():
        finite(f"buckets_s.{bucket.value}", seconds, 0.0, MAX_TS)
    # The report's invariants (EttReport): its buckets partition its wall time, its shares add up to 100 %.
    slack = 1e-3 + 1e-6 * summary.wall_s
    if abs(summary.wall_end_ts - summary.wall_start_ts - summary.wall_s) > slack:
        raise ValueError("wall_s is not the time from wall_start_ts to wall_end_ts")
    if abs(sum(summary.buckets_s.values()) - summary.wall_s) > slack:
        raise ValueError("buckets_s do not add up to wall_s")
    if summary.wall_s > 0:
        shares = summary.ett_pct + summary.idleness_pct + summary.failure_pct
        effective = summary.buckets_s[Bucket.EFFECTIVE_TRAINING] / summary.wall_s * 100.0
        if abs(shares - 100.0) > 1e-3 or abs(effective - summary.ett_pct) > 1e-3:
            raise ValueError("ett_pct is not what its buckets give")
