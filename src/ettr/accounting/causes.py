"""Why each failure happened, with the evidence: the rules of `ettr.causes` applied to a report's attempts.

Pure: reads only what an attempt's ATTEMPT_END (the supervisor's `classify`) and the training processes'
FAILURE events recorded, as kept in `AttemptReport.failure`. Each failure has a cause (infra, user,
preemption, hang, unknown) and a detail (preempted, hung, oom_killed, collective, hardware, node_lost,
process_lost, startup, exception, unknown): the table in `ettr.causes`, which the supervisor's restart policy
decides from too. An attempt no end was recorded for (closed by the accounting) with no other evidence is
unknown.

Meta's NoF counts infra failures only; `ettr` counts every failure in `num_failures` and the infra ones in
`num_infra_failures`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ettr.accounting.liveness import counts_as_failure
from ettr.causes import Cause, Detail, Diagnosis, diagnose

__all__ = [
    "Cause",
    "Detail",
    "FailureCause",
    "classify_failure",
    "count_by_cause",
    "diagnose_attempt",
    "failure_causes",
    "ttr_by_cause",
]

if TYPE_CHECKING:
    from ettr.accounting.model import AttemptReport


@dataclass(frozen=True, slots=True, kw_only=True)
class FailureCause:
    """One failure (an attempt that did not complete) and why."""

    attempt: int
    """Index of the attempt that failed."""
    cause: Cause
    evidence: str
    """One line: what in the books led to `cause`."""
    ttr_s: float | None
    """Failure detected (the attempt's end) to the next training start; None when nothing trained after."""
    detail: Detail = Detail.UNKNOWN
    """What happened (`ettr.causes.Detail`)."""


def diagnose_attempt(attempt: AttemptReport) -> Diagnosis:
    """The cause, detail and evidence of the failure of `attempt` (which did not complete)."""
    code = None if attempt.closed_by_accounting else attempt.exit_code  # no end: no exit status of its own
    failure: Mapping[str, Any] = {"exit_code": code, **(attempt.failure or {})}
    found = diagnose(outcome=attempt.outcome, failure=failure, trained=attempt.trained)
    if found.cause is Cause.UNKNOWN and attempt.closed_by_accounting:
        return Diagnosis(
            cause=Cause.UNKNOWN,
            detail=Detail.UNKNOWN,
            evidence="no end recorded (still running, or its supervisor was lost)",
        )
    return found


def classify_failure(attempt: AttemptReport) -> tuple[Cause, str]:
    """The cause of the failure of `attempt` (which did not complete) and its evidence."""
    found = diagnose_attempt(attempt)
    return found.cause, found.evidence


def failure_causes(attempts: Sequence[AttemptReport]) -> tuple[FailureCause, ...]:
    """One `FailureCause` per attempt that did not complete (the report's `num_failures`), in order,
    each with the TTR of its recovery (the same rule as the report's `ttr_s`)."""
    out = []
    for position, attempt in enumerate(attempts):
        if not counts_as_failure(attempt.outcome):
            continue
        found = diagnose_attempt(attempt)
        recovered = next((a for a in attempts[position + 1 :] if a.training_start_ts is not None), None)
        ttr = None
        if recovered is not None and recovered.training_start_ts is not None:
            ttr = recovered.training_start_ts - attempt.end_ts
        out.append(
            FailureCause(
                attempt=attempt.index,
                cause=found.cause,
                evidence=found.evidence,
                ttr_s=ttr,
                detail=found.detail,
            )
        )
    return tuple(out)


def count_by_cause(causes: Sequence[FailureCause]) -> dict[Cause, int]:
    """Number of failures per cause, every cause present."""
    counts = dict.fromkeys(Cause, 0)
    for c in causes:
        counts[c.cause] += 1
    return counts


def ttr_by_cause(causes: Sequence[FailureCause]) -> dict[Cause, tuple[float, ...]]:
    """The TTRs of the recovered failures per cause, every cause present."""
    out: dict[Cause, list[float]] = {c: [] for c in Cause}
    for c in causes:
        if c.ttr_s is not None:
            out[c.cause].append(c.ttr_s)
    return {c: tuple(v) for c, v in out.items()}
