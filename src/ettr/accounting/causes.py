"""Why each failure happened: infra, user code, preemption, hang or unknown, with the evidence.

Pure: reads only what an attempt's ATTEMPT_END (the supervisor's `classify`) and the training processes'
FAILURE events recorded, as kept in `AttemptReport.failure`. The rules, first match wins:

1. outcome `preempted` -> preemption (a forwarded or direct SIGTERM/SIGINT: a scheduler or an operator);
2. outcome `hung` -> hang (the watchdog saw no progress and no heartbeat);
3. the kernel's OOM killer (SIGKILL while the cgroup's oom_kill counter rose) -> infra;
4. an exception or stderr text of the distributed runtime (collective timeout, NCCL/gloo error,
   rendezvous or store failure, connection reset by a peer, ECC/Xid) -> infra;
5. the supervisor itself was lost while the attempt ran (a later supervisor closed it from the ledger: node
   loss, or the whole job killed) -> infra;
6. death by another signal (SIGKILL, SIGBUS, SIGSEGV, ...: the system, a node agent, native code) -> infra;
7. a Python exception in the training code (including CUDA out-of-memory raised to the script) -> user;
8. the process could not be started -> user (a bad command line);
9. anything else (a bare non-zero exit status, an attempt no end was recorded for) -> unknown.

Meta's NoF counts infra failures only; `ettr` counts every failure in `num_failures` and the infra ones in
`num_infra_failures`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from ettr.accounting.liveness import counts_as_failure
from ettr.events import Outcome

if TYPE_CHECKING:
    from ettr.accounting.model import AttemptReport


class Cause(StrEnum):
    """The closed set of failure causes."""

    INFRA = "infra"
    USER = "user"
    PREEMPTION = "preemption"
    HANG = "hang"
    UNKNOWN = "unknown"


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


# Exception type names and stderr text of the distributed runtime and the hardware under it.
_INFRA_EXCEPTIONS = frozenset(
    {
        "DistError",
        "DistBackendError",
        "DistNetworkError",
        "DistStoreError",
        "RendezvousError",
        "RendezvousClosedError",
        "RendezvousConnectionError",
        "RendezvousTimeoutError",
        "RendezvousStateError",
        "NcclError",
        "ConnectionResetError",
        "BrokenPipeError",
    }
)
_INFRA_TEXT = (
    "collective operation timeout",
    "Watchdog caught collective",
    "NCCL error",
    "ncclSystemError",
    "ncclRemoteError",
    "ProcessGroupNCCL",
    "Connection reset by peer",
    "Connection closed by peer",
    "RendezvousTimeoutError",
    "RendezvousClosedError",
    "DistStoreError",
    "Socket Timeout",
    "uncorrectable ECC",
    "Uncorrectable ECC",
    "Xid",
    "NVLink",
    "(SIGKILL) received by PID",
    "(SIGBUS) received by PID",
    "(SIGSEGV) received by PID",
)
_USER_START_FAILURE = "cannot start"


def classify_failure(attempt: AttemptReport) -> tuple[Cause, str]:
    """The cause of the failure of `attempt` (which did not complete) and its evidence (rules above)."""
    failure: Mapping[str, Any] = attempt.failure or {}
    reason = str(failure.get("reason") or "")
    if attempt.outcome is Outcome.PREEMPTED:
        return Cause.PREEMPTION, reason or "outcome preempted"
    if attempt.outcome is Outcome.HUNG:
        return Cause.HANG, reason or "outcome hung"
    sig = failure.get("signal")
    if failure.get("oom") and sig == "SIGKILL":
        return Cause.INFRA, f"OOM-killed by the kernel ({reason or 'SIGKILL, oom_kill counter rose'})"
    process = failure.get("process_failure")
    process_exc = process.get("exception") if isinstance(process, Mapping) else None
    exception = failure.get("exception") or process_exc
    if exception in _INFRA_EXCEPTIONS:
        return Cause.INFRA, f"distributed runtime exception {exception}"
    texts = [str(line) for line in failure.get("stderr_tail") or ()]
    if isinstance(process, Mapping) and process.get("message"):
        texts.append(str(process["message"]))
    hit = next((t for t in _INFRA_TEXT for line in texts if t in line), None)
    if hit is not None:
        return Cause.INFRA, f"the distributed runtime or hardware: {hit!r} in its output"
    if failure.get("closed_from_ledger"):
        return (
            Cause.INFRA,
            f"its supervisor was lost while it ran (node loss or the whole job killed): {reason}",
        )
    if sig:
        what = reason if reason.startswith("killed by") else f"killed by {sig}"
        return Cause.INFRA, f"{what} (a signal from outside the training code)"
    if exception:
        return Cause.USER, f"exception {exception} in the training code" + (f" ({reason})" if reason else "")
    if reason.startswith(_USER_START_FAILURE):
        return Cause.USER, reason
    if attempt.closed_by_accounting:
        return Cause.UNKNOWN, "no end recorded (still running, or its supervisor was lost)"
    code = attempt.exit_code
    return Cause.UNKNOWN, reason or (f"exit status {code}" if code is not None else "no exit status")


def failure_causes(attempts: Sequence[AttemptReport]) -> tuple[FailureCause, ...]:
    """One `FailureCause` per attempt that did not complete (the report's `num_failures`), in order,
    each with the TTR of its recovery (the same rule as the report's `ttr_s`)."""
    out = []
    for position, attempt in enumerate(attempts):
        if not counts_as_failure(attempt.outcome):
            continue
        cause, evidence = classify_failure(attempt)
        recovered = next((a for a in attempts[position + 1 :] if a.training_start_ts is not None), None)
        ttr = None
        if recovered is not None and recovered.training_start_ts is not None:
            ttr = recovered.training_start_ts - attempt.end_ts
        out.append(FailureCause(attempt=attempt.index, cause=cause, evidence=evidence, ttr_s=ttr))
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
