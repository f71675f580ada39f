"""The watch over one running attempt, as a pure state machine: `step(state, event, now) -> (state, actions)`.

Events come from the attempt (`Exited`, `Exiting`, `RankFailed`: `ettr.supervisor.attempt.Attempt.events`),
from the supervisor's signal handlers (`Signalled`), from the hang watchdog (`Hung`), from the other nodes of a
multi-node job (`PeerLost`), and from the clock (`Tick`, every poll). Actions are what the driver does for the
watch (`Say` a line, `SendSignal` to the attempt). No I/O and no clock: `now` is a parameter, so the rules are
tested with a fake attempt and a fake clock (tests/test_attempt_watch.py).

The rules:
- a signal to the supervisor (the first) is forwarded to the whole job (SIGUSR1, SIGHUP, SIGQUIT as SIGTERM;
  Slurm's SIGUSR1 first to the job's own SIGUSR1 handlers, `warning_to_handlers`), unless it is a terminal's
  Ctrl-C, which the job got already; SIGKILL follows `grace_s` later, after a word of what each rank was
  doing then (`TellRanks`: a SIGTERM handler blocked in a collective, a slow save); a second signal kills at once;
- no progress for the hang timeout (`Hung`, not while the attempt only tears its processes down, nor once
  a failed rank or a lost peer is ending it): SIGTERM, SIGKILL `hang_kill_grace_s` later;
- a peer node's part ended or its supervisor was lost (`PeerLost`): this node's part is ended the same way;
- a worker failed and the others go on in place (`Continued`, ettr's agent with a resilient job): the attempt is
  over at once, nothing is signalled (its processes carry on into the next attempt);
- a rank died with a FAILURE on record while its launcher still runs (`RankFailed`): after `flush_window_s`
  (the other ranks' recorders write their last events) the rest of the tree gets SIGTERM, the launcher
  itself is left to report the failure; SIGKILL `grace_s` later;
- whichever comes first decides: after a forwarded signal or a hang nothing else is acted on (but a second
  signal), and the attempt's end is classified from what the watch saw (`WatchState`);
- when the command exits while processes of the job still run (a shell wrapper dies of the SIGTERM while the
  python it started saves its checkpoint), they get the rest of the grace before any SIGKILL: if the job was
  asked to stop already, until the deadline it was given then; else those still there `outlived_settle_s`
  later (not a resource tracker that leaves by itself) are asked (SIGTERM) and get `hang_kill_grace_s`. The
  watch is done when none is left (`Drained`) or the deadline passed.
"""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass, replace

from ettr.supervisor.signals import forwarded_signal
from ettr.supervisor.slurm import WARNING_SIGNAL
from ettr.supervisor.watch_events import (
    Continued,
    Drained,
    Exited,
    Exiting,
    Hung,
    PeerLost,
    RankFailed,
    Say,
    SendSignal,
    Signalled,
    TellRanks,
    Tick,
    WatchAction,
    WatchEvent,
)


# -- the machine ----------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class WatchConfig:
    """The watch's deadlines."""

    grace_s: float = 10.0  # after a forwarded signal, or SIGTERM to a failed rank's job: until SIGKILL
    hang_kill_grace_s: float = 3.0
    """After SIGTERM to a hung attempt (or to this node's part when a peer ends it): how long before SIGKILL."""
    flush_window_s: float = 0.6
    """After a rank failed, how long the others may still run: a Recorder writes its events within 0.5 s."""
    outlived_settle_s: float = 1.0
    """The command exited with processes of the job still running: how long they may leave before SIGTERM."""
    warning_to_handlers: bool = False  # Slurm's SIGUSR1 reached ettr alone (`B:USR1`): handlers get it first

    def __post_init__(self) -> None:
        for name in ("grace_s", "hang_kill_grace_s", "flush_window_s", "outlived_settle_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")


_NEVER = math.inf


@dataclass(frozen=True, kw_only=True)
class WatchState:
    """What the watch knows of one attempt."""

    attempt: int
    forwarded: int | None = None
    """The signal the supervisor received and passed on (the attempt is being preempted or interrupted)."""
    hung_after_s: float | None = None
    """The silence after which the attempt was declared hung."""
    hung_bound: str = ""
    """Which bound that silence was over (`ettr.supervisor.watchdog.HangBounds`)."""
    hung_ranks: str = ""  # what each training process was doing then (`Hung.ranks`)
    fault_at: float | None = None
    """When the fault happened, where the watch knows it better than the exit (a hang: its last sign of life)."""
    peer_reason: str | None = None
    """Why another node ended this attempt."""
    rank_failed: bool = False
    """A rank failed while its launcher ran, and the supervisor stopped the rest."""
    exiting: bool = False
    detected_at: float | None = None
    """When the supervisor knew the attempt was over (a hang: at once; a failed rank: at its death; a signal it
    forwarded: at once; else the command's exit)."""
    signals_seen: int = 0
    stop_others_at: float = _NEVER
    kill_at: float = _NEVER
    ask_at: float = _NEVER
    """When processes that outlived the command on its own exit are asked to stop (unless gone by then)."""
    killed: bool = False
    returncode: int | None = None
    """The command's status, once it exited."""
    draining: bool = False
    """The command exited and processes of the job still run: they get the rest of the grace."""
    asked: bool = False
    """The job was asked to stop (SIGTERM, or the terminal's SIGINT): a process still running has its grace."""
    hurried: bool = False
    """A second signal took the job's grace away: its SIGKILL is no grace running out."""
    ranks_at_kill: str = ""
    """What each training process was doing when the grace ran out (the driver's answer to `TellRanks`)."""
    continued: Continued | None = None
    """The failure it ended in, which its other processes survived: the next attempt goes on in them."""

    @property
    def done(self) -> bool:
        """The command exited and nothing of the job runs any more (or it was SIGKILLed)."""
        return self.returncode is not None and not self.draining

    @property
    def exited(self) -> bool:
        return self.returncode is not None

    @property
    def stopping(self) -> bool:
        """Ending on the supervisor's own terms (a forwarded signal, a hang): nothing else is acted on."""
        return self.forwarded is not None or self.hung_after_s is not None

    @property
    def watching_hangs(self) -> bool:
        """Whether a `Hung` would be acted on (the driver need not read the watchdog otherwise): not once
        the attempt is over or being ended for a cause already known (a failed rank, a lost peer: the
        silence of its teardown is not a hang, and calling it one would hide the cause)."""
        return (
            not self.exited
            and not self.stopping
            and not self.exiting
            and not self.rank_failed
            and self.peer_reason is None
        )

    @property
    def watching_peers(self) -> bool:
        """Whether a `PeerLost` would be acted on (the driver need not ask the peers otherwise)."""
        return not self.exited and not self.stopping and self.peer_reason is None

    @property
    def watching_ranks(self) -> bool:
        """Whether a `RankFailed` would be acted on."""
        return not self.exited and not self.stopping and self.detected_at is None


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class AttemptWatch:
    """The rules above, as `step(state, event, now) -> (state, actions)`; keeps no state of its own."""

    def __init__(self, config: WatchConfig | None = None) -> None:
        self.config = config or WatchConfig()

    def start(self, attempt: int) -> WatchState:
        return WatchState(attempt=attempt)

    def step(self, state: WatchState, event: WatchEvent, now: float) -> tuple[WatchState, list[WatchAction]]:
        """The state after `event` at `now`, and what to do about it."""
        if state.done:
            return state, []
        match event:
            case Exited():
                return self._exited(state, event, now)
            case Drained():
                return replace(state, draining=False), []
            case Continued():
                if state.exited or state.stopping:
                    return state, []
                at = event.at if event.at is not None else now
                return replace(state, returncode=event.returncode, detected_at=at, continued=event), []
            case Signalled():
                return self._signalled(state, event, now)
            case Hung():
                return self._hung(state, event, now)
            case PeerLost():
                return self._peer_lost(state, event, now)
            case RankFailed():
                if not state.watching_ranks:
                    return state, []
                stop_at = now + self.config.flush_window_s
                return replace(state, rank_failed=True, detected_at=now, stop_others_at=stop_at), []
            case Exiting():
                return replace(state, exiting=True), []
            case Tick():
                return self._tick(state, now)
        raise TypeError(f"not a watch event: {event!r}")

    def _exited(self, state: WatchState, event: Exited, now: float) -> tuple[WatchState, list[WatchAction]]:
        if state.exited:
            return state, []
        detected = state.detected_at
        if detected is None:  # known no earlier than now: its exit, or what the attempt saw before it
            detected = event.at if event.at is not None else now
        state = replace(state, returncode=event.returncode, detected_at=detected, draining=event.outlived)
        if not event.outlived or state.asked:
            return state, []  # what is left got the job's signal already, and has the rest of its grace
        # The command ended on its own and left processes running. Most leave by themselves at once (the
        # helper `multiprocessing` starts, its resource tracker, sees its pipe close and exits): only what
        # is still there after `outlived_settle_s` is asked to stop, then killed (`_tick`).
        return replace(state, ask_at=now + self.config.outlived_settle_s, stop_others_at=_NEVER), []

    def _signalled(
        self, state: WatchState, event: Signalled, now: float
    ) -> tuple[WatchState, list[WatchAction]]:
        actions: list[WatchAction] = []
        if event.count <= state.signals_seen:
            return state, actions
        state = replace(state, signals_seen=event.count)
        if state.exited:
            # Its end is known: a signal now only hurries what is left of it.
            if not state.asked:
                name, grace = _signal_name(event.signum), self.config.grace_s
                what = "what is left of the job gets it, SIGKILL within"
                actions.append(Say(f"got {name} after the job's command ended: {what} {grace:g} s"))
                actions.append(SendSignal(forwarded_signal(event.signum)))
                state = replace(state, kill_at=min(state.kill_at, now + self.config.grace_s), asked=True)
            if event.insists:
                state = replace(state, kill_at=now)
            return state, actions
        if not state.stopping:
            grace = self.config.grace_s
            name = _signal_name(event.signum)
            if event.from_terminal:
                # Ctrl-C: the terminal signalled our whole process group, the job included; a second SIGINT
                # would interrupt the job's own KeyboardInterrupt handling.
                actions.append(
                    Say(f"got {name} from the terminal: the job got it too; SIGKILL in {grace:g} s")
                )
            else:
                sent = forwarded_signal(event.signum)
                as_ = "" if sent == event.signum else f" as {_signal_name(sent)}"
                if event.signum == WARNING_SIGNAL != sent and self.config.warning_to_handlers:
                    as_ += f" (as {name} first to the processes with a {name} handler of their own)"
                    actions.append(SendSignal(event.signum, to_handlers=True))
                actions.append(Say(f"got {name}: forwarding it to the job{as_}, SIGKILL in {grace:g} s"))
                actions.append(SendSignal(sent))
            # The preemption is known now: what follows (the job's final save or its teardown) comes after
            # its detection, as a failed rank's teardown does (docs/buckets.md, the failure instant).
            # The signal is the fault too: the TTR's detection part of a preemption is 0, not unknown.
            detected = state.detected_at if state.detected_at is not None else now
            fault = state.fault_at if state.fault_at is not None else detected
            state = replace(
                state,
                forwarded=event.signum,
                kill_at=now + grace,
                asked=True,
                detected_at=detected,
                fault_at=fault,
            )
        if event.insists:  # asked twice: no more grace
            state = replace(state, kill_at=min(state.kill_at, now), hurried=True)
        return state, actions

    def _hung(self, state: WatchState, event: Hung, now: float) -> tuple[WatchState, list[WatchAction]]:
        if not state.watching_hangs:
            return state, []
        over = f" (over {event.bound})" if event.bound else ""
        text = f"attempt {state.attempt}: no progress for {event.silence_s:.1f} s{over}: hung, killing it"
        state = replace(
            state,
            hung_after_s=event.silence_s,
            hung_bound=event.bound,
            hung_ranks=event.ranks,
            fault_at=event.last_sign_at,
            detected_at=now,
            kill_at=now + self.config.hang_kill_grace_s,
            asked=True,
        )
        return state, [Say(text), SendSignal(signal.SIGTERM)]

    def _peer_lost(
        self, state: WatchState, event: PeerLost, now: float
    ) -> tuple[WatchState, list[WatchAction]]:
        if not state.watching_peers:
            return state, []
        state = replace(
            state, peer_reason=event.reason, kill_at=now + self.config.hang_kill_grace_s, asked=True
        )
        text = f"attempt {state.attempt}: {event.reason}: ending this node's part"
        return state, [Say(text), SendSignal(signal.SIGTERM)]

    def _tick(self, state: WatchState, now: float) -> tuple[WatchState, list[WatchAction]]:
        actions: list[WatchAction] = []
        if state.rank_failed and not state.stopping and now >= state.stop_others_at:
            grace = self.config.grace_s
            actions.append(
                Say(f"attempt {state.attempt}: a rank failed; stopping the others (SIGKILL in {grace:g} s)")
            )
            # The launcher itself is left to see its workers end and report the failure as usual.
            actions.append(SendSignal(signal.SIGTERM, include_launcher=False))
            state = replace(state, kill_at=now + grace, stop_others_at=_NEVER, asked=True)
        if state.draining and not state.asked and now >= state.ask_at:
            grace = self.config.hang_kill_grace_s
            state = replace(state, kill_at=now + grace, asked=True)
            text = f"attempt {state.attempt}: processes outlived its command: SIGTERM to them, SIGKILL in {grace:g} s"
            actions += [Say(text), SendSignal(signal.SIGTERM)]
        if now >= state.kill_at and not state.killed:
            if state.forwarded is not None and state.hung_after_s is None and not state.hurried:
                what = "what is left of the job" if state.exited else "the job"
                sent, grace = _signal_name(forwarded_signal(state.forwarded)), self.config.grace_s
                actions.append(
                    TellRanks(
                        f"attempt {state.attempt}: {what} did not exit within the {grace:g} s grace after {sent}"
                    )
                )
            actions.append(SendSignal(signal.SIGKILL))
            state = replace(state, killed=True)
        if state.killed and state.draining:
            state = replace(state, draining=False)  # what is left is swept
        return state, actions
