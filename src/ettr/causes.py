"""Why an attempt failed, from what its ATTEMPT_END recorded: one rule set for the report and the supervisor.

Pure; imports only `ettr.events`. The accounting gives each failure of a report its cause with it
(`ettr.accounting.causes`), and the supervisor's restart policy decides from the same answer
(`ettr.supervisor.policy`), so what the report says and what the supervisor did never disagree.

A failure has a cause (whose problem: the closed `Cause` set, the fleet's and Prometheus' label) and a
detail (what happened: the closed `Detail` set). The rules, first match wins:

| # | evidence                                                                      | cause      | detail             |
|---|-------------------------------------------------------------------------------|------------|--------------------|
| 1 | outcome `preempted` (SIGTERM/SIGINT from the supervisor, a scheduler, an operator), or `interrupted` (a person's Ctrl-C to `ettr run`) | preemption | preempted |
| 2 | outcome `hung` (the watchdog saw no progress within the bound for its phase)  | hang       | hung               |
| 3 | SIGKILL (of a rank or its DataLoader worker) while the cgroup's `oom_kill` counter rose (the kernel's OOM killer) | infra | oom_killed |
| 4 | any other SIGKILL of the failed process (from outside: what its peers then say of the broken connection is its consequence) | infra | process_lost |
| 5 | its supervisor, or a peer node's, was lost while it ran (closed from the ledger, or a peer's supervisor silent past the peer timeout: the broken collectives around it are its consequence) | infra | node_lost |
| 6 | a collective / rendezvous / store timeout or error, NCCL/gloo, a peer's reset | infra      | collective         |
| 7 | ECC, Xid, NVLink errors in the output                                         | infra      | hardware           |
| 8 | death by another signal (SIGBUS, SIGSEGV, SIGABRT, ...: the system, native code; SIGSEGV, SIGBUS, SIGILL and SIGFPE of the failed rank before rules 5-7: its peers' resets are its consequence) | infra | process_lost |
| 9 | it failed before its first step (cannot start, an exception or exit status at start-up) | user | startup     |
| 10| a Python exception in the training code (CUDA out-of-memory raised to the script too) | user | exception    |
| 11| anything else (a bare non-zero exit status after training, no end recorded; a rank that ended without an exception before its peers' broken collectives, `EXITED_EARLY`, checked before rule 5) | unknown | unknown |

A SIGKILL whose cgroup counter did not rise (or cannot be read: no cgroup v2, a container without
`memory.events`) is `process_lost`, never guessed to be an OOM kill: the evidence says which, in words.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from ettr.events import Outcome


class Cause(StrEnum):
    """Whose problem a failure is (the closed set the fleet counts by)."""

    INFRA = "infra"
    USER = "user"
    PREEMPTION = "preemption"
    HANG = "hang"
    UNKNOWN = "unknown"


class Detail(StrEnum):
    """What happened (the closed set; each belongs to one `Cause`, see the module docstring)."""

    PREEMPTED = "preempted"
    HUNG = "hung"
    OOM_KILLED = "oom_killed"
    COLLECTIVE = "collective"
    HARDWARE = "hardware"
    NODE_LOST = "node_lost"
    PROCESS_LOST = "process_lost"
    STARTUP = "startup"
    EXCEPTION = "exception"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True, kw_only=True)
class Diagnosis:
    """The cause of one failure, its detail and the evidence (one line for people)."""

    cause: Cause
    detail: Detail
    evidence: str


# Exception type names and output text of the distributed runtime.
_COLLECTIVE_EXCEPTIONS = frozenset(
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
        # ettr.resilient's own: not every rank joined the next generation in time (a peer hung or died in
        # its start-up). A soak's SIGSTOPped rank 0 read `user (startup)` from rank 1's timeout, and two in a
        # row would have stopped the job as "the same failure twice before the first step".
        "RendezvousTimeout",
    }
)
# Not `BrokenPipeError`/`ConnectionResetError` by their names: the distributed runtime raises its own types,
# and a Python process meets these writing to a closed pipe (a job piped into `head` read `infra
# (collective)`), a data loader's worker or an HTTP source; a reset's words still match below.
_COLLECTIVE_TEXT = (
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
    # gloo's own timeout of a send or recv (`[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting
    # 15000ms for recv operation to complete`): a peer stalled; it read `user (exception)` (field trial, a
    # SIGSTOPped rank 1 under the DDP tutorial with a 15 s process-group timeout)
    "ms for recv operation to complete",
    "ms for send operation to complete",
)
_HARDWARE_TEXT = ("uncorrectable ECC", "Uncorrectable ECC", "Xid", "NVLink")
WORKER_KILLED_TEXT = "is killed by signal: Killed"  # a DataLoader worker's SIGKILL (torch's words)
# torch's RuntimeError when a worker's death was noticed by its queue's timeout (chained from the above)
_WORKER_GONE = re.compile(r"DataLoader worker \(pid\(s\) [\d, ]+\) exited unexpectedly")
_SIGNAL_TEXT = (
    "(SIGKILL) received by PID",
    "(SIGBUS) received by PID",
    "(SIGSEGV) received by PID",
    # a rank's DataLoader worker died of a signal (the OOM killer, a full /dev/shm, a crash in a C extension);
    # the rank's RuntimeError is its consequence, not the training code's error (strsignal's words)
    WORKER_KILLED_TEXT,
    "is killed by signal: Bus error",
    "is killed by signal: Segmentation fault",
)
# Signals a process gets from its own crash (native code, the hardware, the system), not from a collective: the
# failed rank's death by one is the cause, whatever its peers wrote after it. Not SIGABRT: NCCL's watchdog
# aborts the rank whose collective timed out, and its words then say why.
_NATIVE_CRASH_SIGNALS = frozenset({"SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE"})
_START_FAILURE = "cannot start"
EXITED_EARLY = (
    "exited without an exception while its peers still trained, and they failed on the broken connection"
)
STOPPED_THE_REST = "; ettr stopped the rest ("  # `rank 1 failed: X; ettr stopped the rest (...)` (classify)
_SUPERVISOR_LOST = (
    "supervisor was lost",  # "node 1's supervisor was lost (killed) while ...", a closed attempt
    "supervisor is silent for over",  # "node 1's supervisor is silent for over 60 s (lost)": the leader's word
)


_RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s*")


def _narrated(line: str) -> bool:
    """A line of ettr's own narration (`ettr: generation 2 failed on rank 1 (... Connection reset by peer);
    restarting in place`, `ettr: checkpoint of step 3660 failed (...)`): an earlier failure ettr handled and
    quotes, not evidence of this one. A soak's rank killed by SIGSEGV read `collective` from the in-place line
    of the kill before it, which the surviving rank had written into the same stream."""
    return _RANK_PREFIX.sub("", line.lstrip(), count=1).startswith("ettr: ")


def is_collective_error(exception: str | None, message: str | None) -> bool:
    """Whether a process's exception is what the distributed runtime raises when a peer is gone or a
    collective broke (`DistBackendError`, gloo's "Connection closed by peer", a watchdog timeout): the
    consequence of another rank's failure, as far as the process's own words tell."""
    if exception in _COLLECTIVE_EXCEPTIONS:
        return True
    return bool(message) and any(t in str(message) for t in _COLLECTIVE_TEXT)


def diagnose(*, outcome: Outcome, failure: Mapping[str, Any], trained: bool) -> Diagnosis:
    """The cause of an attempt's failure (rules above).

    Args:
        outcome: how it ended (not `completed`).
        failure: what its ATTEMPT_END recorded (`ettr.supervisor.classify.AttemptEnd.to_data`), optionally
            with `process_failure` (the first FAILURE a training process recorded: exception, message) and
            `closed_from_ledger` (a later supervisor closed it); data from disk, so any value may be missing
            or of the wrong type.
        trained: a training process of the attempt completed a step.
    """
    reason = _text(failure.get("reason"))
    if outcome in (Outcome.PREEMPTED, Outcome.INTERRUPTED):
        # Stopped from outside by asking, not a fault. A Ctrl-C to `ettr run` read `infra (process_lost):
        # killed by SIGINT (a signal from outside the training code)`: the fleet's infra failures counted it.
        return Diagnosis(
            cause=Cause.PREEMPTION, detail=Detail.PREEMPTED, evidence=reason or f"outcome {outcome.value}"
        )
    if outcome is Outcome.HUNG:
        return Diagnosis(cause=Cause.HANG, detail=Detail.HUNG, evidence=reason or "outcome hung")
    sig = _text(failure.get("signal"))
    if failure.get("oom") is True and sig == "SIGKILL":
        what = reason or "SIGKILL, oom_kill counter rose"
        return Diagnosis(
            cause=Cause.INFRA, detail=Detail.OOM_KILLED, evidence=f"OOM-killed by the kernel ({what})"
        )
    if sig == "SIGKILL":
        # A 2-rank DDP job whose rank 0 was SIGKILLed read `collective`: rank 1's "Connection reset by peer"
        # (its FAILURE, the first any rank recorded) matched first. The kill is the failure.
        return _killed(reason, sig)
    if sig in _NATIVE_CRASH_SIGNALS:
        # The failed rank itself died of a crash signal (its launcher's summary or its own status): what its
        # peers then say (gloo's `Connection reset by peer`, a DistBackendError) is the consequence. A DDP
        # job whose rank 1 segfaulted was printed `killed by SIGSEGV (rank 1)` and booked `collective` from
        # rank 0's reset (field trial, pytorch/examples' multigpu_torchrun.py, with and without a wrapper).
        what = (
            reason if f"killed by {sig}" in reason else f"killed by {sig}"
        )  # `rank 1 failed (killed by ...`
        return Diagnosis(
            cause=Cause.INFRA,
            detail=Detail.PROCESS_LOST,
            evidence=f"{what} (a crash in native code or the system; its peers' broken connections follow from it)",
        )
    if EXITED_EARLY in reason:
        # A rank's script ended it (its end, a sys.exit) while its peers trained on: their broken collectives
        # follow from it; why it ended is the script's and not known here.
        return Diagnosis(cause=Cause.UNKNOWN, detail=Detail.UNKNOWN, evidence=reason)
    if failure.get("closed_from_ledger") is True:
        return Diagnosis(
            cause=Cause.INFRA,
            detail=Detail.NODE_LOST,
            evidence=f"its supervisor was lost while it ran (node loss or the whole job killed): {reason}",
        )
    if any(lost in reason for lost in _SUPERVISOR_LOST) and not sig:
        # A peer node died: its peers' collectives broke first ("Connection reset by peer"), which is
        # the consequence, not the cause (a two-node job whose node 1 was killed read `collective`).
        return Diagnosis(cause=Cause.INFRA, detail=Detail.NODE_LOST, evidence=reason)
    process = failure.get("process_failure")
    process_exc = _text(process.get("exception")) if isinstance(process, Mapping) else ""
    exception = _text(failure.get("exception")) or process_exc
    if exception in _COLLECTIVE_EXCEPTIONS:
        return Diagnosis(
            cause=Cause.INFRA, detail=Detail.COLLECTIVE, evidence=f"distributed runtime exception {exception}"
        )
    tail = failure.get("stderr_tail")
    texts = [str(line) for line in tail if not _narrated(str(line))] if isinstance(tail, list | tuple) else []
    if isinstance(process, Mapping) and process.get("message"):
        texts.append(str(process["message"]))
    own = _text(failure.get("message"))
    if not own and isinstance(process, Mapping) and process_exc == exception:
        own = _text(process.get("message"))
    if own and (WORKER_KILLED_TEXT in own or _WORKER_GONE.search(own)):
        # The failed rank's own words say its DataLoader worker died (torch's `exited unexpectedly` is raised
        # from the `is killed by signal: ...` it printed first): the worker's death is the cause, not the
        # training code. A real OOM kill of a worker (a v1 memory cgroup of 1.5 GB, the worker allocating 3
        # GB) read `user (exception)`.
        if failure.get("oom") is True:
            return Diagnosis(
                cause=Cause.INFRA,
                detail=Detail.OOM_KILLED,
                evidence=f"OOM-killed by the kernel (a DataLoader worker: {own[:120]!r})",
            )
        signalled = [line for line in texts if "DataLoader worker" in line and "is killed by signal" in line]
        return Diagnosis(
            cause=Cause.INFRA,
            detail=Detail.PROCESS_LOST,
            evidence=f"a DataLoader worker died: {(signalled[-1] if signalled else own).strip()[:160]!r}",
        )
    if exception and own and not is_collective_error(exception, own):
        # The failed rank's own exception and words are known and name no broken collective: the output's
        # other lines (its peers' "Connection closed by peer", the consequence) are not its cause (a Lightning
        # DDP job whose rank 1 crashed read `collective` from rank 0's gloo traceback). Without its words
        # (a bare RuntimeError) the output is all there is to go by.
        texts = [own]
    elif own:
        texts.append(own)
    for detail, needles in (
        (Detail.COLLECTIVE, _COLLECTIVE_TEXT),
        (Detail.HARDWARE, _HARDWARE_TEXT),
        (Detail.PROCESS_LOST, _SIGNAL_TEXT),
    ):
        hit = next((t for t in needles for line in texts if t in line), None)
        if hit is not None:
            what = "the distributed runtime" if detail is Detail.COLLECTIVE else "the hardware or system"
            return Diagnosis(cause=Cause.INFRA, detail=detail, evidence=f"{what}: {hit!r} in its output")
    if sig:
        return _killed(reason, sig)
    if reason.startswith(_START_FAILURE) or (not trained and (exception or failure.get("exit_code"))):
        what = f"exception {exception}" if exception else (reason or "a non-zero exit status")
        said = next((line.strip() for line in reversed(texts) if line.strip()), "")
        said = "" if exception or not said else f": {said[:200]}"  # its last words say why
        return Diagnosis(
            cause=Cause.USER, detail=Detail.STARTUP, evidence=f"{what} before the first step{said}"
        )
    if exception:
        evidence = f"exception {exception} in the training code" + (f" ({reason})" if reason else "")
        return Diagnosis(cause=Cause.USER, detail=Detail.EXCEPTION, evidence=evidence)
    code = failure.get("exit_code")
    evidence = reason or (f"exit status {code}" if isinstance(code, int) else "no exit status")
    return Diagnosis(cause=Cause.UNKNOWN, detail=Detail.UNKNOWN, evidence=evidence)


def _killed(reason: str, sig: str) -> Diagnosis:
    what = reason if reason.startswith("killed by") else f"killed by {sig}"
    return Diagnosis(
        cause=Cause.INFRA,
        detail=Detail.PROCESS_LOST,
        evidence=f"{what} (a signal from outside the training code)",
    )


def signature(outcome: Outcome, failure: Mapping[str, Any], diagnosis: Diagnosis) -> tuple[str, ...]:
    """What makes two failures 'the same way': cause, detail, exit status, signal and exception type."""
    process = failure.get("process_failure")
    exception = _text(failure.get("exception")) or (
        _text(process.get("exception")) if isinstance(process, Mapping) else ""
    )
    code = failure.get("exit_code")
    sig = _text(failure.get("signal"))
    if exception and (STOPPED_THE_REST in _text(failure.get("reason")) or not sig):
        # A rank raised: the status is the launcher's or ettr's stop as the command took it (torchrun's 1 when
        # it saw the rank die first, a wrapper's 143 when ettr stopped the rest first, torchrun's 1 after it
        # stopped its workers on ettr's SIGTERM), which varies from one attempt to the next with who was
        # first; the same NaN behind a wrapper read as different failures and all restarts ran.
        code, sig = None, ""
    return (
        outcome.value,
        diagnosis.cause.value,
        diagnosis.detail.value,
        str(code) if isinstance(code, int) else "",
        sig,
        exception,
    )


def _text(value: object) -> str:
    return value[:500] if isinstance(value, str) else ""
