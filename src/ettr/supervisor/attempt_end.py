"""The classification of one attempt's end (`ettr.supervisor.classify.classify`): the data of its ATTEMPT_END
event, written to the books and read back from them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ettr.events import Outcome, clip_failure_message


@dataclass(frozen=True, kw_only=True)
class AttemptEnd:
    """The failure classification of one attempt: the data of its ATTEMPT_END event."""

    outcome: Outcome
    """completed, failed, preempted or hung."""
    exit_code: int | None
    """The command's exit status; for a death by signal, 128 + the signal number (as a shell reports it)."""
    signal: str | None = None
    """Name of the signal that ended the command (SIGKILL, ...), if one did: the command itself, what its
    shell wrapper ran (a shell exits 128 + N after its child's death by signal N), or the failed rank behind
    a launcher (torchrun's failure summary)."""
    reason: str = ""
    """One line for people: what ended the attempt."""
    exception: str | None = None
    """Type name of the Python exception that ended a training process, when known."""
    message: str | None = None
    """That exception's message, when known (`Type: message` is what people look for)."""
    oom: bool = False
    """The attempt ran out of memory (an OOM exception, or the kernel's OOM killer)."""
    stderr_tail: tuple[str, ...] = field(default_factory=tuple)
    """The last lines the command wrote to stderr."""
    injected: str | None = None
    """The `--inject` fault that fired in this attempt, if any."""
    signalled_ts: float | None = None
    """When a rank got the outside signal whose handler ended the job: the accounting's failure instant."""
    rank_gone_ts: float | None = None
    """When the supervisor first saw a training rank's process gone (`gone.first_rank_gone_at`): the failure
    instant of a rank that recorded none (a SIGKILL under a launcher), where the accounting finds no better."""
    hung_ranks: str | None = None
    """A hang: what each training process was doing (`watchdog.describe_ranks`; node 0 adds other nodes')."""
    ranks_at_kill: str | None = None
    """The job did not exit within the grace after the signal ettr forwarded: what each training process was
    doing at the SIGKILL (`watchdog.describe_ranks`; a SIGTERM handler blocked in a collective, a slow save)."""

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> AttemptEnd:
        """The classification an ATTEMPT_END recorded (`to_data`), read back from the books: any field may be
        missing or of the wrong type (an older version, a damaged row); what cannot be read is left out."""

        def text(key: str) -> str | None:
            value = data.get(key)
            return value[:500] if isinstance(value, str) else None

        try:
            outcome = Outcome(str(data.get("outcome")))
        except ValueError:
            outcome = Outcome.UNKNOWN
        code = data.get("exit_code")
        tail = data.get("stderr_tail")
        return cls(
            outcome=outcome,
            exit_code=code if isinstance(code, int) and not isinstance(code, bool) else None,
            signal=text("signal"),
            reason=text("reason") or "",
            exception=text("exception"),
            message=clip_failure_message(data["message"]) if isinstance(data.get("message"), str) else None,
            oom=data.get("oom") is True,
            stderr_tail=tuple(str(line) for line in tail[-20:]) if isinstance(tail, list) else (),
            injected=text("injected"),
            signalled_ts=ts if isinstance(ts := data.get("signalled_ts"), float) else None,
            rank_gone_ts=ts if isinstance(ts := data.get("rank_gone_ts"), float) else None,
            hung_ranks=text("hung_ranks"),
            ranks_at_kill=text("ranks_at_kill"),
        )

    def to_data(self) -> dict[str, Any]:
        """The ATTEMPT_END event's `data`."""
        known = {
            "signalled_ts": self.signalled_ts,
            "rank_gone_ts": self.rank_gone_ts,
            "hung_ranks": self.hung_ranks,
            "ranks_at_kill": self.ranks_at_kill,
        }
        return {
            "outcome": self.outcome.value,
            "exit_code": self.exit_code,
            "signal": self.signal,
            "reason": self.reason,
            "exception": self.exception,
            "message": self.message,
            "oom": self.oom,
            "stderr_tail": list(self.stderr_tail),
            "injected": self.injected,
        } | {key: value for key, value in known.items() if value is not None}
