"""One attempt from its launch to its classified end: the driver around `AttemptWatch`.

    launch (RunEnv, the agreed port) -> kind.start -> ATTEMPT_START
    every poll (or at once when a process exits or a signal arrives):
        the attempt's events, the supervisor's signals, the hang watchdog, the peers
            -> AttemptWatch.step -> say / signal the attempt
        the next attempt's warm standby once this one trains; the process tree noted every second
    FAILURE_DETECTED mark; leftovers killed, the attempt's marker swept; classify; the peers settle it

The driver does the I/O, the watch decides (`ettr.supervisor.watch`). Every collaborator is handed in (books,
kind, peers, signals, the clock), so the loop runs in a unit test with a fake attempt and a fake clock.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from ettr.constants import FAILURE_DETECTED_MARK, RECOVERY_MARK, RELAUNCH_MARK
from ettr.events import EventKind, Outcome
from ettr.heartbeat import latest_heartbeat, read_pulses
from ettr.procs import oom_kill_count
from ettr.run_env import has_trained, heartbeat_dir, signals_received, trained_modules
from ettr.supervisor import slurm, standby
from ettr.supervisor.attempt import Attempt, AttemptKind, AttemptPlan
from ettr.supervisor.books import JobBooks
from ettr.supervisor.classify import AttemptEnd, classify
from ettr.supervisor.config import RunConfig
from ettr.supervisor.containment import AttemptSweep, Sweep
from ettr.supervisor.gone import exited_early
from ettr.supervisor.guard import JobGuard
from ettr.supervisor.launch import attempt_launch, wrapper_name
from ettr.supervisor.messages import Progress, say
from ettr.supervisor.peers import Peers
from ettr.supervisor.policy import EndedAttempt, ended_from_events
from ettr.supervisor.relaunch import Relaunch
from ettr.supervisor.restart import ExitWaker
from ettr.supervisor.signals import SupervisorSignals
from ettr.supervisor.startwait import StartupWait
from ettr.supervisor.watch import AttemptWatch, WatchConfig, WatchState
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
    WatchEvent,
)
from ettr.supervisor.watchdog import (
    HangBounds,
    HangWatchdog,
    JobProgress,
    LearnedBounds,
    heartbeat_pids,
    ranks_at_hang,
    run_queue_wait_s,
    training_ended,
)

_SNAPSHOT_EVERY_S, _TRAINED_READ_EVERY_S = 1.0, 0.5  # process tree noted; has-trained look


def _names(directory: Path) -> list[str]:
    try:
        return os.listdir(directory)
    except OSError:
        return []


@dataclass(frozen=True, kw_only=True)
class AttemptParts:
    """Everything one attempt's driver works with (the supervisor makes one per job)."""

    config: RunConfig
    books: JobBooks
    kind: AttemptKind
    peers: Peers
    signals: SupervisorSignals
    family: str
    clock: Callable[[], float] = time.time
    sweep: Callable[[int], Sweep] | None = None
    """Makes the attempt's end-of-attempt sweep (default: `AttemptSweep` of the run directory)."""
    guard: JobGuard | None = None
    """Ends the attempt's processes if the supervisor is killed (`ettr.supervisor.guard`)."""


class AttemptRunner:
    """Runs attempts of one job, each to its classified end (see the module docstring)."""

    def __init__(self, parts: AttemptParts) -> None:
        self.parts = parts
        cfg = parts.config
        self._launched = False  # an attempt was started (the first one starts cold: nothing ran before it)
        self._continuing: Attempt | None = None  # an attempt whose processes go on in place into the next
        self._learned = LearnedBounds(parts.books.read)  # the hang bounds the job's books taught so far
        alone = not slurm.in_step(os.environ)  # Slurm's B:USR1 reaches ettr alone: the job's handlers get it
        grace = {"grace_s": cfg.grace_s, "hang_kill_grace_s": cfg.hang_kill_grace_s}
        self.watch = AttemptWatch(WatchConfig(**grace, warning_to_handlers=alone))

    def run(self, attempt: int, *, restarts_done: int = 0, restarts_left: int = 0) -> EndedAttempt:
        """Run attempt `attempt` (`restarts_done` before it; a standby only while `restarts_left`); its end."""
        p = self.parts
        cfg, books = p.config, p.books
        started = p.clock()
        port = p.peers.rendezvous_port(attempt)
        launch = attempt_launch(
            cfg.command,
            run_dir=books.run_dir,
            job_id=books.job_id,
            attempt=attempt,
            started_at=started,
            inject=cfg.inject,
            auto=cfg.auto,
            ledger_url=cfg.ledger_url,
            family=p.family,
            port=port,
        )
        plan = AttemptPlan(
            attempt=attempt,
            launch=launch,
            port=port,
            restarts_done=restarts_done,
            failure_recorded=lambda: books.failure_recorded(attempt),
        )
        oom_before = oom_kill_count()
        sweep = p.sweep(attempt) if p.sweep is not None else AttemptSweep(books.run_dir, attempt)
        continuing, self._continuing = self._continuing, None
        try:
            if continuing is not None:
                running = p.kind.continue_in_place(continuing, plan)
            else:
                running = p.kind.start(plan)
        except OSError as exc:
            if continuing is not None:
                self._continuing = continuing
                self.release()
            books.append(EventKind.ATTEMPT_START, attempt=attempt, ts=started, command=list(launch.argv))
            end = AttemptEnd(outcome=Outcome.FAILED, exit_code=127, reason=f"cannot start: {exc}")
            return EndedAttempt(attempt=attempt, end=end, made_progress=False)
        sweep.spare(running.pids)  # the attempt reaps its own processes; the sweep must not
        if p.guard is not None:
            p.guard.watch(running.pids)
        books.append(
            EventKind.ATTEMPT_START,
            attempt=attempt,
            ts=started,
            pid=running.pid,
            command=list(launch.argv),
            **running.start_data(),
        )
        relaunch = running.relaunch
        if not self._launched and relaunch.path != "forked":  # forked: from a zygote warm before it
            relaunch = Relaunch(path="cold", why="the first attempt this supervisor started")
        self._launched = True
        books.append(EventKind.MARK, attempt=attempt, ts=started, name=RELAUNCH_MARK, **relaunch.to_data())
        if continuing is not None:  # the TTR's kind: the job's other processes went on
            books.append(EventKind.MARK, attempt=attempt, ts=started, name=RECOVERY_MARK, kind="in_place")
            say(f"attempt {attempt} continues in place: {running.describe()}; {running.relaunch.why}")
        else:
            say(f"attempt {attempt} started: {running.describe()}")
        state = self._watch(running, attempt, started=started, sweep=sweep, restarts_left=restarts_left)
        assert state.returncode is not None
        fault = {} if state.fault_at is None else {"fault_ts": state.fault_at}  # detection is a part of TTR
        books.append(
            EventKind.MARK,
            attempt=attempt,
            ts=state.detected_at,
            name=FAILURE_DETECTED_MARK,
            returncode=None if state.continued and state.continued.survived else state.returncode,
            **fault,
        )
        if state.continued:  # its processes go on into the next attempt: nothing is torn down
            self._continuing = running
        else:
            running.kill_leftovers()
            swept = sweep.run(exclude=running.pid)
            if swept:
                pids = ", ".join(map(str, swept))
                say(f"attempt {attempt}: killed {len(swept)} process(es) that outlived it (pids {pids})")
            running.finish()
            if p.guard is not None:
                p.guard.forget(running.pids)
        oom_after = oom_kill_count()
        events = books.attempt_events(attempt)
        events += books.record_unrecorded_steps(attempt, events, since=started)
        self._learned.add(events)
        end = classify(
            returncode=state.returncode,
            stderr_tail=running.stderr_tail(),
            events=p.peers.own_events(events),
            preempted_by=state.forwarded,
            hung_after_s=state.hung_after_s,
            hung_bound=state.hung_bound,
            hung_ranks=state.hung_ranks,
            ranks_at_kill=state.ranks_at_kill,
            oom_killed=oom_before is not None and oom_after is not None and oom_after > oom_before,
            failed_pids=running.failed_pids(),
            seen_gone=running.seen_gone(),
            ranks=running.ranks(),
            wrapper=wrapper_name(launch.argv),
            stopped_after_rank_failure=state.rank_failed,
            signalled=self._outside_signals(state, attempt),
            raised_in_place=bool(state.continued and state.continued.survived),
            left_in_place=bool(state.continued and not state.continued.survived and state.returncode == 0),
        )
        end = p.peers.settle(attempt, end, state.peer_reason, p.signals, events)
        early = (
            exited_early(books.run_dir, attempt, running.ranks(), events)
            if end.outcome is Outcome.FAILED
            else None
        )
        end = replace(end, reason=f"{early}: {end.reason}") if early else end
        return ended_from_events(attempt, end, events)

    def _outside_signals(self, state: WatchState, attempt: int) -> list[tuple[float, int, str]]:
        """Signals the attempt's processes handled themselves, where the supervisor stopped nothing itself but
        a hang (a handler that hung after a scheduler's SIGTERM: classify names it in the hang's reason)."""
        stopped = state.forwarded is not None or state.rank_failed
        if stopped or state.peer_reason is not None or (state.continued and state.returncode != 0):
            return []
        return signals_received(self.parts.books.run_dir, attempt, before=state.detected_at)

    def release(self) -> None:
        """End the processes left for an in-place restart that will not come (the job stops); never raises."""
        running, self._continuing = self._continuing, None
        if running is None:
            return
        p = self.parts
        running.signal_tree(signal.SIGTERM)
        deadline = time.monotonic() + p.config.hang_kill_grace_s
        while running.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        running.kill_leftovers()
        running.events()  # reaps the workers
        running.finish()
        if p.guard is not None:
            p.guard.forget(running.pids)

    def _watch(
        self, running: Attempt, attempt: int, *, started: float, sweep: Sweep, restarts_left: int
    ) -> WatchState:
        """Watch `running` until it exits; the watch's last state."""
        p = self.parts
        cfg = p.config
        run_dir = p.books.run_dir
        dog = HangWatchdog(
            probes=[lambda: p.books.last_activity(attempt), lambda: latest_heartbeat(run_dir, attempt)],
            started_at=started,
            armed_at_start=cfg.hang_timeout_s is not None,
            bounds=self._hang_bounds(),
            progress=lambda: JobProgress.of(read_pulses(run_dir, attempt)),
            starved=lambda: run_queue_wait_s(heartbeat_pids(_names(heartbeat_dir(run_dir, attempt)))),
            ended=lambda: training_ended(heartbeat_pids(_names(heartbeat_dir(run_dir, attempt)))),
            describe=lambda now: ranks_at_hang(run_dir, attempt, now),
        )
        state = self.watch.start(attempt)
        waiting: Progress | None = None  # for the job to exit, once asked to
        starting = StartupWait(
            attempt, started, path=running.relaunch.path, run_dir=run_dir, absent=p.peers.absent
        )
        trained_read_at = float("-inf")
        standby_tried = restarts_left <= 0
        snapshot_at = float("-inf")
        waker = ExitWaker(running.pids, p.signals.wake)  # the loop wakes the instant a process exits
        try:
            while True:
                now = p.clock()
                state = self._look(state, running, sweep, dog, now=now, started=started)
                if state.done:
                    return state
                if starting.due(now) and now - trained_read_at >= _TRAINED_READ_EVERY_S:
                    trained_read_at = now
                    line = starting.check(now, trained=has_trained(p.books.run_dir, attempt))
                    if line is not None:
                        say(line)
                if state.asked and not state.killed:
                    waiting = waiting or Progress(now)
                    if waiting.due(now):
                        what = "what outlived its command" if state.exited else "the job"
                        left_s = max(0.0, state.kill_at - now)
                        say(f"attempt {attempt}: waiting for {what} to exit (SIGKILL in {left_s:.0f} s)")
                if not standby_tried and standby.due(
                    now - started, lambda: has_trained(p.books.run_dir, attempt)
                ):
                    standby_tried = True
                    learned = trained_modules(p.books.run_dir, attempt)  # imported before training
                    sweep.spare(p.kind.prepare_next(warm_modules=learned))
                if now - snapshot_at >= _SNAPSHOT_EVERY_S:
                    running.remember_tree()
                    sweep.reap_adopted(exclude=running.pid)
                    snapshot_at = now
                p.signals.wait(cfg.poll_interval_s)
        finally:
            waker.close()

    def _look(
        self,
        state: WatchState,
        running: Attempt,
        sweep: Sweep,
        dog: HangWatchdog,
        *,
        now: float,
        started: float,
    ) -> WatchState:
        """One look at everything the watch listens to, in a fixed order: the attempt's exit (then whether
        anything of the job outlived it), a signal, the attempt's teardown, a hang, the peers, a failed rank,
        the deadlines."""
        p = self.parts
        happened = running.events()
        exited = [e for e in happened if isinstance(e, Exited)]
        if exited and not state.exited:
            outlived = bool(running.alive() or sweep.alive(exclude=running.pids))
            state = self._step(state, replace(exited[0], outlived=outlived), now, running, sweep)
            if state.done:
                return state
        elif state.draining and not (running.alive() or sweep.alive(exclude=running.pids)):
            return self._step(state, Drained(), now, running, sweep)
        for event in happened:
            if isinstance(event, Continued):
                state = self._step(state, event, now, running, sweep)
                if state.done:
                    return state
        signals = p.signals
        if signals.first is not None and signals.count > state.signals_seen:
            first = signals.first
            if state.signals_seen == 0:  # on record before a kill can take us (whatever the watch does)
                p.books.note_signal(state.attempt, first, ts=now)
            signalled = Signalled(first, signals.count, signals.from_terminal(first), signals.insisted)
            state = self._step(state, signalled, now, running, sweep)
        if any(isinstance(e, Exiting) for e in happened):
            state = self._step(state, Exiting(), now, running, sweep)
        if state.watching_hangs:
            silence_s = dog.check(now)
            if silence_s is not None:
                hung = Hung(silence_s, bound=dog.bound_text, last_sign_at=dog.latest, ranks=dog.ranks)
                state = self._step(state, hung, now, running, sweep)
        if state.watching_peers:
            reason = p.peers.check(state.attempt, now, started)
            if reason is not None:
                state = self._step(state, PeerLost(reason), now, running, sweep)
        if any(isinstance(e, RankFailed) for e in happened):
            state = self._step(state, RankFailed(), now, running, sweep)
        return self._step(state, Tick(), now, running, sweep)

    def _hang_bounds(self) -> HangBounds:
        """The hang bounds of the next attempt: configured, and learned from the job's books so far."""
        cfg = self.parts.config
        learned = self._learned.now()
        return HangBounds(
            override_s=cfg.hang_timeout_s,
            default_s=cfg.default_hang_timeout_s,
            step_multiple=cfg.hang_step_multiple,
            floor_s=cfg.hang_floor_s,
            learned_s=learned,
        )

    def _step(
        self, state: WatchState, event: WatchEvent, now: float, running: Attempt, sweep: Sweep
    ) -> WatchState:
        """Step the watch; do what it says. A signal goes to the whole job: the attempt's own tree, then what
        of the job is outside it (orphans adopted by the supervisor, processes carrying the attempt's marker)."""
        state, actions = self.watch.step(state, event, now)
        for action in actions:
            match action:
                case Say():
                    say(action.text)
                case TellRanks():  # before the SIGKILL that follows: the kernel's word on live processes
                    ranks = ranks_at_hang(self.parts.books.run_dir, state.attempt, now)
                    say(f"{action.text}: {ranks or 'what its ranks were doing is unknown'}; SIGKILL")
                    state = replace(state, ranks_at_kill=ranks)
                case SendSignal(to_handlers=True):
                    slurm.signal_handlers(running.alive(), action.signum)
                case SendSignal():
                    reached = running.signal_tree(action.signum, include_command=action.include_launcher)
                    sweep.signal(action.signum, exclude={*reached, *running.pids})
        return state
