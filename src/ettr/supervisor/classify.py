"""Why an attempt ended: outcome, exit code, signal, OOM-kill, Python exception and the end of stderr.

Pure: the cgroup's OOM-kill counter that tells an OOM-kill from any other SIGKILL is read before and after the
attempt by the supervisor (`ettr.procs.oom_kill_count`)."""

from __future__ import annotations

import signal
from collections.abc import Iterable, Mapping, Sequence

from ettr.causes import STOPPED_THE_REST, Detail, diagnose
from ettr.events import Event, EventKind, Outcome, clip_failure_message
from ettr.supervisor.attempt_end import AttemptEnd
from ettr.supervisor.command_output import (
    OOM_EXCEPTIONS,
    child_signal,
    exception_line_from_stderr,
    oom_said,
    signal_name,
    spawn_signals,
    torchrun_exitcodes,
    torchrun_signal,
    worker_sigkill_said,
    wrapped_signal,
)
from ettr.supervisor.gone import first_failed_rank, first_rank_gone_at
from ettr.supervisor.hidden_ends import (
    ended_by_signal,
    failure_hidden,
    killed_unsignalled,
    shell_kills,
    signal_before_hang,
    signalled_reason,
)


def this_nodes_events(events: Iterable[Event], *, host: str, supervisor_pid: int) -> list[Event]:
    """`events` less those of ranks another node's supervisor started: the ranks whose PROCESS_START names
    another host or another supervisor pid. A multi-node job's nodes write one ledger, and a node's part
    that ended without an exception of its own (its torchrun SIGKILLed) took another node's rank's broken
    connection for its cause. Ranks that recorded no PROCESS_START with both names stay."""
    events = list(events)
    started: dict[int, bool] = {}
    for e in events:
        data = e.data or {}
        if e.kind is EventKind.PROCESS_START and "host" in data and "supervisor_pid" in data:
            mine = data["host"] == host and data["supervisor_pid"] == supervisor_pid
            started[e.rank] = started.get(e.rank, False) or mine
    return [e for e in events if started.get(e.rank, True)]


def _world_size(events: Iterable[Event]) -> int:
    """The largest world size the ranks' PROCESS_STARTs name (1: none; a node's ranks: `this_nodes_events`)."""
    sizes = [(e.data or {}).get("world_size") for e in events if e.kind is EventKind.PROCESS_START]
    return max((n for n in sizes if isinstance(n, int)), default=1)


def classify(
    *,
    returncode: int,
    stderr_tail: Sequence[str] = (),
    events: Iterable[Event] = (),
    preempted_by: int | None = None,
    hung_after_s: float | None = None,
    hung_bound: str = "",
    hung_ranks: str = "",
    ranks_at_kill: str = "",
    oom_killed: bool = False,
    failed_pids: Sequence[Sequence[int]] = (),
    seen_gone: Sequence[tuple[float, Sequence[int]]] = (),
    ranks: Mapping[int, int] | None = None,
    wrapper: bool | str = False,
    stopped_after_rank_failure: bool = False,
    signalled: Sequence[tuple[float, int, str]] = (),
    raised_in_place: bool = False,
    left_in_place: bool = False,
) -> AttemptEnd:
    """Classify how an attempt ended.

    Args:
        returncode: `Popen.returncode` (negative: killed by that signal).
        stderr_tail: the last lines of its stderr.
        events: the attempt's events from training processes (FAILURE, PROCESS_START, `inject` marks).
        preempted_by: the signal the supervisor received and forwarded (the attempt was preempted).
        hung_after_s: set when the hang watchdog killed the attempt: the silence it saw; `hung_bound` which bound
            that was over (`the bound of phase eval`, `10 x the step time of 0.05 s`); `hung_ranks` what each
            training process was doing then (`watchdog.describe_ranks`).
        ranks_at_kill: the job did not exit within the grace after `preempted_by`: what each training
            process was doing at the SIGKILL (the end of a preemption's reason, and its own field).
        oom_killed: the cgroup's OOM-kill counter rose during the attempt.
        failed_pids: the attempt's processes seen to end, one list per look that saw them gone, in the
            order of the looks (ettr's agent: the failed worker; under a launcher, the ranks the supervisor saw
            die). The failed rank is in the first look that saw a rank gone: its exception, not the connection
            error another rank died of after it (`first_failed_rank`). `seen_gone`: each look's time and the pids it saw gone that did not mark a clean exit (`first_rank_gone_at`).
        ranks: pid -> rank of the processes whose rank the launcher knows (`Attempt.ranks`), beside those the
            PROCESS_START events name (a worker that went on into this attempt in place recorded none in it).
        wrapper: the command is a shell (or srun), whose exit status 128 + N says that what it ran died of
            signal N; a string names it (`launch.wrapper_name`: "srun", "shell wrapper").
        stopped_after_rank_failure: the supervisor stopped the attempt's processes because a rank died with a
            FAILURE on record (`restart.PeerFailureWatch`): a SIGTERM or SIGKILL that ended the command (or
            what its shell wrapper ran) is ettr's, not the failure; the failed rank's is.
        signalled: (time, rank, signal name) of the signals the attempt's processes handled themselves
            (`ettr.bootstrap.outside_signals`), where the supervisor sent none: a scheduler or an operator
            signalled the job directly, and the script's handler ended it early (with status 0 after a save,
            Lightning's `SIGTERMException`; or 1, torchrun's `SignalException`). Booked preempted unless a
            rank's own failure came first.
        raised_in_place: the failed rank raised and the wrapper of a resilient job caught it; its process
            lived on and the attempt goes on in place (`inplace.InPlace.survived`): no process exited, so
            `returncode` (the interpreter's 1) is no exit status of anything; none is booked.
        left_in_place: the failed rank exited 0 while its peers trained, and was replaced in place
            (`inplace.InPlace.left`: a `sys.exit(0)` or a SIGTERM handler's exit inside `train`): a failure.
    """
    sig = -returncode if returncode < 0 else None
    exit_code: int | None = 128 + sig if sig is not None else returncode
    if raised_in_place:
        exit_code = None
    rank_of = {
        e.data["pid"]: e.rank
        for e in events
        if e.kind is EventKind.PROCESS_START and e.data and isinstance(e.data.get("pid"), int)
    }
    rank_of.update(ranks or {})
    failures = [e for e in events if e.kind is EventKind.FAILURE and (e.data or {}).get("exception")]
    root = first_failed_rank(failed_pids, rank_of, failures)
    blamed = [e for e in failures if root is None or e.rank == root]
    exception: str | None = None
    message: str | None = None
    if blamed:
        data = blamed[0].data or {}
        exception = str(data["exception"])
        message = clip_failure_message(str(data["message"])) if data.get("message") else None
    marks = [e.data or {} for e in events if e.kind is EventKind.MARK]
    injected = next((str(d.get("spec")) for d in marks if d.get("name") == "inject"), None)
    if exception is None and returncode != 0 and not (root is not None and failures):
        # (a traceback in stderr is the failed rank's own unless another rank recorded its failure)
        found = exception_line_from_stderr(stderr_tail)
        if found is not None:
            exception, message = found
    child_died_of = child_signal(exception, message) if not blamed else None
    if child_died_of is not None:  # the launcher's traceback says its child was killed: not the code's
        exception = message = None
    behind = None  # the signal that ended what the command ran: its shell's 128 + N, torchrun's summary
    shell_said = False  # `behind` is the shell's 128 + N (else torchrun's summary of the failed rank)
    agent_said = False  # `behind` is the signal torchrun's agent said it got
    root_code = torchrun_exitcodes(stderr_tail).get(root, 0) if root is not None else 0
    if sig is None and returncode != 0 and not raised_in_place:
        if wrapper:
            behind = wrapped_signal(returncode)
            shell_said = behind is not None
        if behind is None and root_code < 0:
            # (behind a shell wrapper too: `bash run.sh` exits with torchrun's 1 when a rank was SIGKILLed)
            behind = -root_code
        if behind is None and not blamed and (killed := spawn_signals(stderr_tail)):
            # mp.spawn names the first of its processes to die of a signal: the failed rank, which recorded
            # no exception (a rank SIGKILLed: its peer's "Connection reset by peer" read as a broken
            # collective before 2026-12-04). A SIGTERM after ettr stopped the rest was ettr's own.
            named = killed.get(root) if root is not None else next(iter(killed.values()))
            if not (stopped_after_rank_failure and named == signal.SIGTERM):
                behind = named
        if behind is None and child_died_of is not None:
            behind, agent_said = child_died_of, True
        agent_got = torchrun_signal(stderr_tail) if behind is None else None
        if agent_got is not None:  # torchrun itself was signalled (its process group, `exec torchrun`)
            behind, agent_said = agent_got, True
    tail_text = "\n".join(stderr_tail)
    signalled_ts: float | None = None
    # a rank's DataLoader worker SIGKILLed while the cgroup's OOM-kill counter rose: the kernel's OOM killer
    worker_oom = oom_killed and worker_sigkill_said(message, tail_text)
    oom = (
        (signal.SIGKILL in (sig, behind) and oom_killed)
        or worker_oom
        or oom_said(exception, returncode, tail_text)
    )
    launcher_exit = f"the launcher exited {returncode}"
    if raised_in_place:
        how = "recovered in place (its process lived on)"
    elif sig is not None:
        how = f"killed by {signal_name(sig)}"
    elif behind is not None and shell_said and wrapper == "srun":
        how = f"killed by {signal_name(behind)} (its srun task; srun exited {returncode})"
    elif behind is not None and shell_said:
        how = f"killed by {signal_name(behind)} (behind its shell wrapper, which exited {returncode})"
    elif behind is not None and (child_died_of is not None or not agent_said):
        how = f"killed by {signal_name(behind)} ({launcher_exit})"
    elif behind is not None:
        how = f"{signal_name(behind)} to torchrun, which stopped its workers and exited {returncode}"
    else:
        how = f"exit status {returncode}"
    ended_by = sig if sig is not None else behind
    stops = (signal.SIGTERM, signal.SIGKILL)
    ours = (  # the command (or what its shell ran) ended by the signal ettr sent to stop the rest
        stopped_after_rank_failure
        and hung_after_s is None
        and preempted_by is None
        # a launcher that ends on ettr's SIGTERM with status 0 (DeepSpeed's, when the signal comes before it
        # saw the rank's death) would otherwise read as completed
        # (the shell's 128 + N, or torch elastic's summary: `accelerate launch` exiting 1 with "exitcode: -15")
        # (or torchrun's own word that it got ettr's SIGTERM: behind a wrapper that then exits torchrun's 1)
        and (
            sig in stops
            or ((shell_said or agent_said) and behind in stops)
            or -root_code in stops
            or returncode == 0
        )
    )
    if ours:
        # That signal is not why the attempt failed: the failed rank's own death is, where torchrun said it
        # (a SIGTERM it names is ettr's stop: a rank that raised was still tearing down when it came).
        ended_by = -root_code if root_code < 0 and -root_code != signal.SIGTERM else None
        rank_oomed = root is not None and not blamed and oom_killed and ended_by in (None, signal.SIGKILL)
        oom = exception in OOM_EXCEPTIONS or worker_oom or rank_oomed
    if hung_after_s is not None:
        outcome = Outcome.HUNG
        over = f" (over {hung_bound})" if hung_bound else ""
        reason = f"no progress and no heartbeat for {hung_after_s:.1f} s{over}; {how}"
        reason += (f"; {hung_ranks}" if hung_ranks else "") + signal_before_hang(signalled or ())
    elif preempted_by == signal.SIGINT:
        outcome = Outcome.INTERRUPTED
        reason = f"interrupted (SIGINT forwarded to the job); {how}"
    elif preempted_by is not None:
        outcome = Outcome.PREEMPTED
        reason = f"{signal_name(preempted_by)} forwarded to the job; {how}"
    elif ours:
        # A shell wrapper around torchrun: the supervisor saw rank 1 die with its exception and stopped the
        # rest before torchrun did; the wrapper then exited 143. Not a preemption, and not a signal's fault.
        outcome = Outcome.FAILED
        who = f"rank {root}" if root is not None else "a rank"
        if exception:
            what = f": {exception}"
        elif ended_by is not None:
            what = f" (killed by {signal_name(ended_by)}{', out of memory' if oom else ''})"
        else:
            what = " (out of memory)" if oom else " (no exception recorded)"
        ended = "the command exited 0 after it" if returncode == 0 else how
        reason = f"{who} failed{what}{STOPPED_THE_REST}{ended})"
    elif (
        (signalled := ended_by_signal(signalled, events))
        and not (failures and min(e.ts for e in failures) < signalled[0][0])
        and killed_unsignalled(signalled, _died_of(stderr_tail)) is None
    ):
        # The job was signalled from outside (not through ettr run) and its own handler ended it: stopped
        # early, whatever its status. A preemption: restarted, not counted, the scheduler told (143).
        outcome = Outcome.PREEMPTED
        exception = message = None  # what ranks died of after the signal is its consequence
        signalled_ts, first_rank, first_sig = signalled[0]
        ended_by = signal.Signals[first_sig] if first_sig in signal.Signals.__members__ else ended_by
        reason = signalled_reason(first_rank, first_sig, how, in_place=left_in_place)
    elif left_in_place:  # not a completion: the others went on without it (`inplace.InPlace.left`)
        outcome = Outcome.FAILED
        who = f"rank {root}" if root is not None else "a rank"
        reason = f"{who} exited 0 while the others still trained (it left on its own); replaced in place"
    elif returncode == 0 and (
        hidden := failure_hidden(events, shell_kills(stderr_tail, rank_of, bool(wrapper)))
    ):
        # `bash run.sh` whose script runs `python train.py` and then something else (an `echo`, a copy of the
        # logs) exits with that last command's status: the training process's death reads as success.
        outcome = Outcome.FAILED
        data = hidden.data or {}
        exception = str(data["exception"])
        message = clip_failure_message(str(data["message"])) if data.get("message") else None
        died_of = exception
        if hidden.kind is not EventKind.FAILURE:  # an injected kill, a death its shell reported: a signal
            ended_by = signal.Signals[died_of] if died_of in signal.Signals.__members__ else signal.SIGKILL
            exception, message = None, None
        if wrapper:
            reason = (
                f"exit status 0 of its shell wrapper, but rank {hidden.rank} died of {died_of} (the wrapper "
                "hides its failure: `exec` the training command, or exit with its status)"
            )
        else:  # a launcher or a program that starts its ranks itself and does not pass a rank's death on
            reason = f"exit status 0, but rank {hidden.rank} died of {died_of} (its launcher hid the failure)"
    elif returncode == 0:
        outcome = Outcome.COMPLETED
        reason = "completed"
    elif ended_by == signal.SIGTERM:
        # Nobody asked the supervisor to stop, yet the job got SIGTERM: a scheduler or an operator
        # preempting it directly. Counted as a preemption, and restarted like a failure.
        outcome = Outcome.PREEMPTED
        reason = f"{how}, not asked of the supervisor (a scheduler or an operator)"
    elif raised_in_place:  # no exit status: what the rank raised is the failure
        outcome = Outcome.FAILED
        who = f"rank {root}" if root is not None else "a rank"
        what = (" (out of memory)" if oom else "") + (f": {exception}" if exception else "")
        reason = f"{who} raised an exception{what}; {how}"  # `messages.ended_line` adds the message
    else:
        outcome = Outcome.FAILED
        if root is not None and (len(set(rank_of.values())) > 1 or _world_size(events) > 1):
            # the rank that failed first, not one that lost it as a peer; one bracket, not two in a row:
            # `killed by SIGKILL (rank 1; the launcher exited 1)` (until 2026-12-05 `(the launcher exited 1)
            # (rank 1)`)
            aside = f" ({launcher_exit})"
            if how.endswith(aside):
                how = f"{how.removesuffix(aside)} (rank {root}; {launcher_exit})"
            else:
                how += f" (rank {root})"
        reason = how + (" (out of memory)" if oom else "") + (f": {exception}" if exception else "")
    stuck = ranks_at_kill if preempted_by is not None and hung_after_s is None else ""  # the grace ran out
    reason += f"; at the SIGKILL after the grace: {stuck}" if stuck else ""
    if injected:
        reason += f" [injected {injected}]"
    return AttemptEnd(
        outcome=outcome,
        exit_code=exit_code,
        signal=signal_name(ended_by) if ended_by is not None else None,
        reason=reason,
        exception=exception,
        message=message,
        oom=oom,
        stderr_tail=tuple(stderr_tail),
        injected=injected,
        signalled_ts=signalled_ts,
        hung_ranks=hung_ranks or None if outcome is Outcome.HUNG else None,
        ranks_at_kill=stuck or None,
        rank_gone_ts=first_rank_gone_at(seen_gone, rank_of) if outcome is not Outcome.COMPLETED else None,
    )


def consequence_of_a_peer(end: AttemptEnd) -> bool:
    """Whether this node's failure looks like what a peer's failure does to it (a broken collective)."""
    failure = {**end.to_data(), "process_failure": {"exception": end.exception, "message": end.message}}
    diagnosis = diagnose(outcome=end.outcome, failure=failure, trained=True)  # the message says gloo's reset
    return diagnosis.detail is Detail.COLLECTIVE


def _died_of(stderr_tail: Sequence[str]) -> dict[int, int]:
    """rank -> the signal its launcher says it died of (torchrun's failure summary, `mp.spawn`'s exception)."""
    died = {rank: -code for rank, code in torchrun_exitcodes(stderr_tail).items() if code < 0}
    return {**spawn_signals(stderr_tail), **died}
