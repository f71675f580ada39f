"""How an attempt ended where its command's exit status does not say: a rank's death that a wrapper or a
launcher exiting 0 hid (its FAILURE, an injected kill, a death its shell reported), and the signals from outside
that the script's own handler ended the job on. Pure, for `ettr.supervisor.classify`.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable, Mapping, Sequence

from ettr.events import Event, EventKind
from ettr.run_env import LAUNCHER_SIGNAL_RANK
from ettr.supervisor.command_output import shell_reported_deaths, signal_name

STEPS_AFTER_SIGNAL = 5
"""A rank that took more steps than this after a signal its handler took (and after the first checkpoint saved
after it, below) went on training: the handler saved and carried on (a SIGUSR1 "save now"), or let the job
finish; the signal did not end the job."""

SAVE_AFTER_SIGNAL_S = 120.0
"""How long after a signal a checkpoint may commit and still be the save that signal asked for (a scheduler's
grace: Slurm's KillWait 30 s, Kubernetes' 30 s, a cloud's spot notice 30-120 s)."""


def ended_by_signal(
    signalled: Sequence[tuple[float, int, str]], events: Iterable[Event]
) -> list[tuple[float, int, str]]:
    """The signals in `signalled` after which their rank stopped training: at most `STEPS_AFTER_SIGNAL`
    steps after the signal, or after the first checkpoint any rank committed within `SAVE_AFTER_SIGNAL_S` of
    it. The second is a handler that asks for a save and lets the loop finish the step it is in, or waits:
    transformers' JIT checkpoint waits 3 s before the Trainer saves at its next step boundary and stops, 15
    steps of 0.2 s (field trial), and such a job read `completed` at step 61 of 120."""
    if not signalled:
        return []
    steps: list[tuple[int, float]] = []
    commits: list[float] = []
    for e in events:
        if e.kind is EventKind.STEP:
            steps.append((e.rank, e.ts))
        elif e.kind is EventKind.CHECKPOINT_COMMIT:
            commits.append(e.ts)
    commits.sort()

    def stopped(ts: float, rank: int) -> bool:
        after = [t for r, t in steps if r == rank and t > ts]
        if len(after) <= STEPS_AFTER_SIGNAL:
            return True
        saved = next((c for c in commits if c > ts), None)  # the save the signal asked for, if any
        return (
            saved is not None
            and saved - ts <= SAVE_AFTER_SIGNAL_S
            and sum(1 for t in after if t > saved) <= STEPS_AFTER_SIGNAL
        )

    return [(ts, rank, name) for ts, rank, name in signalled if stopped(ts, rank)]


OUTSIDE_STOP_SIGNALS = frozenset(
    {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2}
)
"""The signals a scheduler or an operator sends a job to ask it to stop (or to save first)."""


def killed_unsignalled(
    signalled: Sequence[tuple[float, int, str]], died_of: Mapping[int, int]
) -> tuple[int, int] | None:
    """(rank, signal) of a rank that died of a signal no scheduler sends to ask a job to stop (SIGKILL before
    any grace, SIGSEGV, SIGBUS: `died_of`, rank -> signal, from its launcher's word) and whose handlers noted
    no signal, where other ranks' handlers did: those signals were its launcher stopping the rest (torchrun
    SIGTERMs the surviving workers when one dies), not a scheduler's. None where the launcher itself noted one
    (the signal reached it from outside first)."""
    noted = {rank for _, rank, _ in signalled}
    if not noted or LAUNCHER_SIGNAL_RANK in noted:
        return None
    return next(
        ((r, s) for r, s in sorted(died_of.items()) if r not in noted and s not in OUTSIDE_STOP_SIGNALS),
        None,
    )


def signalled_reason(rank: int, signame: str, how: str, *, in_place: bool = False) -> str:
    """Why an attempt that a signal from outside ended (`ended_by_signal`'s first) is booked preempted
    (`in_place`: only that rank's process ended, and a replacement went on in place with the others)."""
    if rank == LAUNCHER_SIGNAL_RANK:  # torchrun (or accelerate's agent) itself, behind a wrapper
        return (
            f"its launcher received {signame}, not asked of the supervisor (a scheduler or an operator), and "
            f"stopped the job; {how}"
        )
    ended = "its process; replaced in place" if in_place else "the job early"
    return (
        f"rank {rank} received {signame}, not asked of the supervisor (a scheduler or an operator), and its "
        f"handler ended {ended}; {how}"
    )


def shell_kills(lines: Sequence[str], rank_of: Mapping[int, int], wrapper: bool) -> list[Event]:
    """What a shell wrapper said of a training process it ran that died of a signal (bash's `line 3: 731
    Killed ...`: the kernel's OOM killer, an operator), as FAILURE-like marks for `failure_hidden`."""
    if not wrapper:
        return []
    return [
        Event(
            EventKind.MARK,
            0.0,
            0,
            rank_of[pid],
            data={"exception": signal_name(sig), "message": "said by its shell"},
        )
        for pid, sig in shell_reported_deaths(lines).items()
        if pid in rank_of
    ]


def failure_hidden(events: Iterable[Event], killed: Sequence[Event] = ()) -> Event | None:
    """The FAILURE (an uncaught exception, an injected crash: the process ends with it) of a training process
    whose rank never stepped again after it: what a shell wrapper exiting 0 hid. A rank that stepped after
    its FAILURE survived it (a restart in place) or was started again by a launcher inside the command. An
    injected `kill` (SIGKILL: no FAILURE is written) counts as one, with `exception` "SIGKILL"."""
    failures: dict[int, Event] = {}
    stepped: dict[int, float] = {}
    for e in events:
        if e.rank < 0:
            continue
        data = e.data or {}
        if (
            e.kind is EventKind.MARK
            and data.get("name") == "inject"
            and str(data.get("spec")).startswith("kill@")
        ):
            fault = {"exception": "SIGKILL", "message": f"injected {data.get('spec')}"}
            e = Event(EventKind.MARK, e.ts, e.attempt, e.rank, data=fault)
            if e.rank not in failures:
                failures[e.rank] = e
            continue
        if e.kind is EventKind.FAILURE and (e.data or {}).get("exception") and e.rank not in failures:
            failures[e.rank] = e
        elif e.kind is EventKind.STEP:
            stepped[e.rank] = max(e.ts, stepped.get(e.rank, e.ts))
    hidden = next((f for r, f in sorted(failures.items()) if stepped.get(r, f.ts) <= f.ts), None)
    return hidden or next(iter(killed), None)  # (a process gone stepped no more; its time is unknown)


def signal_before_hang(signalled: Sequence[tuple[float, int, str]]) -> str:
    """What a hung attempt's reason adds when a rank's own handler took a signal from outside before it
    (`run_env.signals_received`): a handler that caught the scheduler's SIGTERM and then hung (field trial:
    the DDP tutorial's rank 1 with a SIGTERM handler that never returns) read as a bare hang."""
    if not signalled:
        return ""
    _, rank, signame = signalled[0]
    who = "its launcher" if rank == LAUNCHER_SIGNAL_RANK else f"rank {rank}"
    return (
        f"; {who} received {signame} before it, not asked of the supervisor (a scheduler or an operator), "
        "and its handler did not end the job"
    )
