"""The supervisor's loop in pieces, without processes: the pure `AttemptWatch` and `RestartPolicy`, and the
`AttemptRunner` driving a fake `Attempt` with a fake clock (no sleeping, no timing)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest

from ettr.constants import FAILURE_DETECTED_MARK, RELAUNCH_MARK, SIGNALLED_MARK
from ettr.events import Event, EventKind, Outcome, Phase
from ettr.ledger import MemoryLedger
from ettr.run_env import heartbeat_dir
from ettr.supervisor.attempt import AttemptEvent, AttemptPlan
from ettr.supervisor.books import JobBooks
from ettr.supervisor.classify import AttemptEnd
from ettr.supervisor.config import RunConfig
from ettr.supervisor.peers import NoPeers
from ettr.supervisor.policy import EndedAttempt, RestartPolicy
from ettr.supervisor.relaunch import Relaunch
from ettr.supervisor.runner import AttemptParts, AttemptRunner
from ettr.supervisor.signals import SupervisorSignals
from ettr.supervisor.watch import AttemptWatch, WatchConfig
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
)
from ettr.supervisor.watchdog import STARTUP

TERM, KILL, USR1 = int(signal.SIGTERM), int(signal.SIGKILL), int(signal.SIGUSR1)
WATCH = AttemptWatch(WatchConfig(grace_s=10.0, hang_kill_grace_s=3.0, flush_window_s=0.6))


def sent(actions: Iterable[object]) -> list[tuple[int, bool]]:
    return [(a.signum, a.include_launcher) for a in actions if isinstance(a, SendSignal)]


def said(actions: Iterable[object]) -> list[str]:
    return [a.text for a in actions if isinstance(a, Say)]


# -- AttemptWatch --------------------------------------------------------------------------------------------
def test_a_signal_is_forwarded_then_sigkill_after_the_grace() -> None:
    state = WATCH.start(4)
    state, actions = WATCH.step(state, Signalled(TERM, 1), 100.0)
    assert sent(actions) == [(TERM, True)] and "forwarding it to the job" in said(actions)[0]
    assert state.forwarded == TERM and state.stopping and not state.watching_hangs
    assert state.fault_at == state.detected_at == 100.0  # the signal is the fault: detection 0, not unknown
    state, actions = WATCH.step(state, Tick(), 109.9)
    assert actions == []
    state, actions = WATCH.step(state, Tick(), 110.0)
    assert sent(actions) == [(KILL, True)]
    # what each rank was doing is asked of the driver before the SIGKILL, while the processes still live
    assert actions[0] == TellRanks("attempt 4: the job did not exit within the 10 s grace after SIGTERM")
    state, actions = WATCH.step(state, Tick(), 120.0)
    assert actions == []  # killed once
    state, _ = WATCH.step(state, Exited(-KILL), 121.0)
    assert state.done and state.returncode == -KILL and state.forwarded == TERM


def test_slurms_warning_goes_to_the_job_as_sigterm_and_a_terminals_ctrl_c_is_not_sent_again() -> None:
    _, actions = WATCH.step(WATCH.start(0), Signalled(int(signal.SIGUSR1), 1), 1.0)
    assert sent(actions) == [(TERM, True)] and "as SIGTERM" in said(actions)[0]
    state, actions = WATCH.step(WATCH.start(0), Signalled(int(signal.SIGINT), 1, from_terminal=True), 1.0)
    assert sent(actions) == [] and "from the terminal" in said(actions)[0]
    assert state.forwarded == signal.SIGINT and state.kill_at == 11.0


def test_slurms_warning_to_the_supervisor_alone_goes_first_to_the_jobs_own_sigusr1_handlers() -> None:
    # `--signal=B:USR1@T`: the batch shell alone got it. Lightning's auto-requeue saves its HPC checkpoint in
    # its SIGUSR1 handler: as SIGTERM alone, the requeued run started over from its last periodic checkpoint.
    watch = AttemptWatch(WatchConfig(warning_to_handlers=True))
    state, actions = watch.step(watch.start(0), Signalled(USR1, 1), 1.0)
    signals = [(a.signum, a.to_handlers) for a in actions if isinstance(a, SendSignal)]
    assert signals == [(USR1, True), (TERM, False)]  # the handlers' save first, then the usual SIGTERM
    assert "as SIGTERM (as SIGUSR1 first to the processes with a SIGUSR1 handler" in said(actions)[0]
    assert state.forwarded == USR1 and state.kill_at == 11.0
    for other in (TERM, int(signal.SIGHUP)):  # only Slurm's warning
        _, actions = watch.step(watch.start(0), Signalled(other, 1), 1.0)
        assert [a.to_handlers for a in actions if isinstance(a, SendSignal)] == [False]
    # A task of an srun step: Slurm signalled every process of the step, the job's handlers got it already
    _, actions = WATCH.step(WATCH.start(0), Signalled(USR1, 1), 1.0)
    assert [(a.signum, a.to_handlers) for a in actions if isinstance(a, SendSignal)] == [(TERM, False)]


def test_a_second_signal_kills_at_once_and_the_same_count_is_not_news() -> None:
    state, _ = WATCH.step(WATCH.start(0), Signalled(TERM, 1), 1.0)
    state, actions = WATCH.step(state, Signalled(TERM, 1), 2.0)
    assert actions == [] and state.kill_at == 11.0
    state, actions = WATCH.step(state, Signalled(TERM, 2), 3.0)
    assert actions == [] and state.kill_at == 3.0
    _, actions = WATCH.step(state, Tick(), 3.0)
    assert sent(actions) == [(KILL, True)] and not any(isinstance(a, TellRanks) for a in actions)  # no grace


def test_a_hang_is_sigterm_then_sigkill_and_stops_everything_else() -> None:
    state, actions = WATCH.step(WATCH.start(2), Hung(6.5), 50.0)
    assert sent(actions) == [(TERM, True)] and said(actions) == [
        "attempt 2: no progress for 6.5 s: hung, killing it"
    ]
    assert state.hung_after_s == 6.5 and state.detected_at == 50.0
    assert not (state.watching_hangs or state.watching_peers or state.watching_ranks)
    for late in (Hung(9.0), PeerLost("node 1 lost"), RankFailed()):
        assert WATCH.step(state, late, 51.0) == (state, [])
    state, actions = WATCH.step(state, Signalled(TERM, 1), 51.0)
    assert actions == [] and state.forwarded is None  # a hung attempt is not preempted
    _, actions = WATCH.step(state, Tick(), 53.0)
    assert sent(actions) == [(KILL, True)]


def test_no_hang_while_the_attempt_only_tears_down() -> None:
    state, _ = WATCH.step(WATCH.start(0), Exiting(), 1.0)
    assert not state.watching_hangs
    assert WATCH.step(state, Hung(400.0), 2.0) == (state, [])


def test_no_hang_while_a_failed_rank_or_a_lost_peer_ends_the_attempt() -> None:
    # Two agents, node 1 lost: node 0's rank died of the broken collective and its torchrun took more than the
    # hang bound to wind down on a loaded machine; the watchdog called it `hung`, hiding the cause.
    for cause in (RankFailed(), PeerLost("node 1's supervisor is silent (lost)")):
        state, _ = WATCH.step(WATCH.start(0), cause, 10.0)
        state, _ = WATCH.step(state, Tick(), 10.6)
        assert not state.watching_hangs
        assert WATCH.step(state, Hung(10.0), 11.0) == (state, [])


def test_a_peer_ends_this_nodes_part_once() -> None:
    state, actions = WATCH.step(WATCH.start(1), PeerLost("node 1's part ended failed: x"), 5.0)
    assert sent(actions) == [(TERM, True)] and "ending this node's part" in said(actions)[0]
    assert state.peer_reason is not None and state.kill_at == 8.0 and state.detected_at is None
    assert WATCH.step(state, PeerLost("again"), 6.0) == (state, [])


def test_a_failed_rank_stops_the_rest_after_the_flush_window_leaving_the_launcher() -> None:
    state, actions = WATCH.step(WATCH.start(0), RankFailed(), 10.0)
    assert actions == [] and state.rank_failed and state.detected_at == 10.0
    state, actions = WATCH.step(state, Tick(), 10.5)
    assert actions == []  # the others' recorders still write their last events
    state, actions = WATCH.step(state, Tick(), 10.6)
    assert sent(actions) == [(TERM, False)] and "a rank failed" in said(actions)[0]
    state, actions = WATCH.step(state, Tick(), 20.5)
    assert actions == []
    state, actions = WATCH.step(state, Tick(), 20.6)
    assert sent(actions) == [(KILL, True)]
    state, _ = WATCH.step(state, Exited(1, at=99.0), 21.0)
    assert state.detected_at == 10.0  # the failed rank's death, not the launcher's exit


def test_a_preemption_during_the_flush_window_is_a_preemption() -> None:
    state, _ = WATCH.step(WATCH.start(0), RankFailed(), 10.0)
    state, actions = WATCH.step(state, Signalled(TERM, 1), 10.1)
    assert sent(actions) == [(TERM, True)]
    _, actions = WATCH.step(state, Tick(), 11.0)
    assert actions == []  # no second SIGTERM to the rest: the forwarded one is theirs


def test_the_exit_is_detected_when_the_attempt_saw_it() -> None:
    state, _ = WATCH.step(WATCH.start(0), Exited(3, at=7.0), 9.0)
    assert state.done and state.detected_at == 7.0
    assert WATCH.step(state, Signalled(TERM, 1), 10.0) == (state, [])


def test_an_attempt_that_goes_on_in_place_ends_at_once_and_nothing_is_signalled() -> None:
    state, actions = WATCH.step(WATCH.start(2), Continued(-9, at=5.0), 5.2)
    assert actions == [] and state.done and state.continued and state.returncode == -9
    assert state.detected_at == 5.0 and state.continued is not None and not state.continued.survived
    assert WATCH.step(state, Tick(), 100.0) == (state, [])  # no SIGKILL deadline follows
    # a raise the process lived on: the runner books no exit status for it
    raised, _ = WATCH.step(WATCH.start(2), Continued(1, survived=True), 5.2)
    assert raised.continued is not None and raised.continued.survived
    stopping, _ = WATCH.step(WATCH.start(2), Signalled(TERM, 1), 1.0)
    state, actions = WATCH.step(stopping, Continued(1), 1.1)
    assert actions == [] and not state.continued  # a job being stopped is not restarted in place


def test_watch_config_refuses_bad_graces() -> None:
    with pytest.raises(ValueError, match="grace_s"):
        WatchConfig(grace_s=-1)


# -- RestartPolicy -------------------------------------------------------------------------------------------
def ended(
    outcome: Outcome, *, progress: bool = True, attempt: int = 0, step: int | None = None
) -> EndedAttempt:
    if progress and step is None:
        step = 10 * (attempt + 1)  # each attempt a little further
    end = AttemptEnd(outcome=outcome, exit_code=1)
    return EndedAttempt(attempt=attempt, end=end, made_progress=progress, last_step=step)


def test_the_restart_policy() -> None:
    policy = RestartPolicy(max_restarts=2, backoff_s=0.5, max_backoff_s=30.0)
    done = policy.decide(ended(Outcome.COMPLETED), signalled=signal.SIGTERM)
    assert (done.restart, done.exit_status) == (False, 0)
    first = policy.decide(ended(Outcome.FAILED))
    assert (first.restart, first.wait_s, first.why) == (True, 0.0, "restarting in 0 s (1 of 2)")
    cannot_start = policy.decide(ended(Outcome.FAILED, progress=False))
    assert cannot_start.wait_s == 0.5
    second = policy.decide(ended(Outcome.HUNG, attempt=1), history=[ended(Outcome.FAILED)])
    assert (second.restart, second.wait_s) == (True, 0.0)  # it trained on (step 20 > 10): at once again
    stuck = policy.decide(ended(Outcome.HUNG, attempt=1, step=10), history=[ended(Outcome.FAILED)])
    assert (stuck.restart, stuck.wait_s) == (True, 1.0)  # no new step: doubling
    history = [ended(Outcome.FAILED), ended(Outcome.HUNG, attempt=1)]
    out = policy.decide(ended(Outcome.FAILED, attempt=2), history=history)
    assert (out.restart, out.exit_status, out.why) == (False, 1, "no restarts left")
    preempted = policy.decide(ended(Outcome.PREEMPTED), signalled=signal.SIGTERM)
    assert (preempted.restart, preempted.exit_status) == (False, 143)
    interrupted = policy.decide(ended(Outcome.INTERRUPTED), signalled=signal.SIGINT)
    assert interrupted.exit_status == 130
    with pytest.raises(ValueError, match="max_restarts"):
        RestartPolicy(max_restarts=-1)


# -- AttemptRunner with a fake attempt and a fake clock --------------------------------------------------------
class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeSignals(SupervisorSignals):
    """Waiting advances the fake clock; `at` delivers a signal when the clock passes a time."""

    def __init__(self, clock: FakeClock, at: dict[float, int] | None = None) -> None:
        super().__init__()
        self.clock = clock
        self.at = dict(at or {})

    def wait(self, timeout_s: float) -> None:
        self.clock.now += timeout_s
        for when in sorted(self.at):
            if self.clock.now >= when:
                self._on_signal(self.at.pop(when), None)


class FakeAttempt:
    """Exits with `code` at `exits_at`; after SIGTERM to all of it, exits as `on_term` says ((delay, code);
    None: ignores it); after SIGTERM to all but the launcher, as `on_rest_term` says; at once on SIGKILL."""

    def __init__(
        self,
        clock: FakeClock,
        *,
        exits_at: float | None = None,
        code: int = 0,
        on_term: tuple[float, int] | None = (0.0, -TERM),
        on_rest_term: tuple[float, int] | None = None,
        rank_failed_at: float | None = None,
    ) -> None:
        self.clock, self.exits_at, self.code = clock, exits_at, code
        self.on_term, self.on_rest_term, self.rank_failed_at = on_term, on_rest_term, rank_failed_at
        self.pid = 4242
        self.relaunch = Relaunch(path="cold", why="a fake starts cold")
        self.signals: list[tuple[float, int, bool]] = []
        self.returncode: int | None = None
        self.child_until: float | None = None  # a child that outlives the command runs until then
        self.child_saves_s = 2.0  # ... or until this long after a SIGTERM that reaches it

    @property
    def pids(self) -> Sequence[int]:
        return []

    def start_data(self) -> dict[str, Any]:
        return {"kind": "fake"}

    def describe(self) -> str:
        return "a fake"

    def failed_pids(self) -> list[list[int]]:
        return []

    def seen_gone(self) -> list[tuple[float, list[int]]]:
        return []

    def ranks(self) -> dict[int, int]:
        return {}

    def events(self) -> list[AttemptEvent]:
        if self.returncode is None and self.exits_at is not None and self.clock.now >= self.exits_at:
            self.returncode = self.code
        if self.returncode is not None:
            return [Exited(self.returncode)]
        if self.rank_failed_at is not None and self.clock.now >= self.rank_failed_at:
            self.rank_failed_at = None
            return [RankFailed()]
        return []

    def signal_tree(self, sig: int, *, include_command: bool = True) -> list[int]:
        self.signals.append((self.clock.now, sig, include_command))
        reaction = self.on_term if include_command else self.on_rest_term
        if sig == KILL:
            self.returncode = -KILL if self.returncode is None else self.returncode
            self.child_until = None
        elif sig == TERM and self.returncode is not None and self.child_until is not None:
            self.child_until = min(self.child_until, self.clock.now + self.child_saves_s)
        elif sig == TERM and reaction is not None:
            delay, code = reaction
            self.exits_at, self.code = self.clock.now + delay, code
            if include_command and self.child_until is not None:  # the whole tree got it
                self.child_until = min(self.child_until, self.clock.now + self.child_saves_s)
        return [self.pid]

    def alive(self) -> list[int]:
        """A child (the python a wrapper started) may outlive the command until `child_until`."""
        running = self.child_until is not None and self.clock.now < self.child_until
        return [4243] if running and self.returncode is not None else []

    def remember_tree(self) -> None:
        pass

    def kill_leftovers(self) -> None:
        pass

    def finish(self, timeout_s: float = 2.0) -> None:
        pass

    def stderr_tail(self, num_lines: int = 20) -> list[str]:
        return ["the end"]


class FakeKind:
    def __init__(self, attempt: FakeAttempt) -> None:
        self.attempt, self.plans, self.prepared = attempt, [], 0

    def start(self, plan: AttemptPlan) -> FakeAttempt:
        self.plans.append(plan)
        return self.attempt

    def prepare_next(self, *, warm_modules: Sequence[str] = ()) -> list[int]:
        self.prepared += 1
        return []

    def discard(self) -> None:
        pass


class NoSweep:
    def spare(self, pids: Iterable[int]) -> None:
        pass

    def alive(self, exclude: Collection[int] = ()) -> list[int]:
        return []

    def signal(self, sig: int, exclude: Collection[int] = ()) -> list[int]:
        return []

    def reap_adopted(self, exclude: int | None = None) -> None:
        pass

    def run(self, exclude: int | None = None) -> list[int]:
        return []


class ActiveLedger(MemoryLedger):
    """A ledger whose training activity can be set (what the hang watchdog reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.activity: float | None = None

    def last_activity(self, attempt: int) -> float | None:
        return self.activity


def runner_for(
    tmp_path: Path,
    attempt: FakeAttempt,
    clock: FakeClock,
    signals: FakeSignals,
    kind: FakeKind | None = None,
    ledger: ActiveLedger | None = None,
    **config: Any,
) -> tuple[AttemptRunner, ActiveLedger, FakeKind]:
    cfg = RunConfig(command=("python", "train.py"), run_dir=str(tmp_path), **config)
    ledger = ActiveLedger() if ledger is None else ledger
    books = JobBooks(cfg, run_dir=tmp_path, job_id="j", family="train", ledger=ledger)
    kind = kind or FakeKind(attempt)
    parts = AttemptParts(
        config=cfg, books=books, kind=kind, peers=NoPeers(), signals=signals, family="train",
        clock=clock, sweep=lambda attempt: NoSweep(),
    )  # fmt: skip
    return AttemptRunner(parts), ledger, kind


def supervisor_events(ledger: MemoryLedger, kind: EventKind) -> list[Event]:
    return [e for e in ledger.read() if e.kind is kind]


def marks(ledger: MemoryLedger, name: str) -> list[Event]:
    return [e for e in supervisor_events(ledger, EventKind.MARK) if (e.data or {}).get("name") == name]


def test_the_runner_books_a_completed_attempt(tmp_path: Path) -> None:
    clock = FakeClock()
    fake = FakeAttempt(clock, exits_at=1005.0)
    runner, ledger, kind = runner_for(tmp_path, fake, clock, FakeSignals(clock))
    ended = runner.run(0, restarts_done=0, restarts_left=3)
    assert ended.end.outcome is Outcome.COMPLETED and not ended.made_progress
    (plan,) = kind.plans
    (start,) = supervisor_events(ledger, EventKind.ATTEMPT_START)
    assert start.ts == 1000.0 and start.data == {
        "pid": 4242,
        "command": list(plan.launch.argv),
        "kind": "fake",
    }
    (detected,) = marks(ledger, FAILURE_DETECTED_MARK)
    assert detected.data == {"name": FAILURE_DETECTED_MARK, "returncode": 0}
    assert detected.ts >= 1005.0 and plan.launch.env["ETTR_ATTEMPT"] == "0" and fake.signals == []
    assert kind.prepared == 0  # no step, and not 60 s in: no standby yet
    (relaunch,) = marks(ledger, RELAUNCH_MARK)
    assert relaunch.data == {
        "name": RELAUNCH_MARK,
        "path": "cold",
        "why": "the first attempt this supervisor started",
    }


class CountingLedger(ActiveLedger):
    """Counts the reads of the whole books."""

    def __init__(self) -> None:
        super().__init__()
        self.whole_reads = 0

    def read(self) -> list[Event]:
        self.whole_reads += 1
        return super().read()

    def read_attempt(self, attempt: int) -> list[Event]:
        return [e for e in super().read() if e.attempt == attempt and e.rank >= 0]


def test_a_restart_does_not_read_the_whole_books(tmp_path: Path) -> None:
    """A long job's books hold millions of steps; the supervisor read them whole at each attempt's end and
    again before each attempt (its hang bounds): 22 s and 330 MB per restart at a million events. Now: one
    attempt's events at its end, and the whole books once, for the bounds an earlier run taught."""
    clock, ledger = FakeClock(), CountingLedger()
    fake = FakeAttempt(clock, exits_at=1005.0)
    runner, _, _ = runner_for(tmp_path, fake, clock, FakeSignals(clock), ledger=ledger)
    started = [Event(EventKind.PROCESS_START, 100.0, 0, 0), Event(EventKind.STEP, 110.0, 0, 0, step=1)]
    ledger.append([*started, Event(EventKind.ATTEMPT_START, 99.0, 0, -1)])
    assert runner._hang_bounds().learned_s == {STARTUP: 3 * 10.0}  # a requeue: what the earlier run taught
    later = [Event(EventKind.PROCESS_START, 200.0, 1, 1), Event(EventKind.STEP, 240.0, 1, 1, step=2)]
    ledger.append([*later, Event(EventKind.STEP, 241.0, 2, 0, step=3)])
    assert runner.parts.books.attempt_events(1) == later
    runner._learned.add(later)
    assert runner._hang_bounds().learned_s == {STARTUP: 3 * 40.0}  # the longest start-up of any attempt
    assert ledger.whole_reads == 1


def test_the_next_attempts_standby_is_prepared_once_while_restarts_remain(tmp_path: Path) -> None:
    clock = FakeClock()
    fake = FakeAttempt(clock, exits_at=1070.0)
    runner, _, kind = runner_for(tmp_path, fake, clock, FakeSignals(clock))
    runner.run(0, restarts_left=1)
    assert kind.prepared == 1
    clock, none_left = FakeClock(), FakeAttempt(clock, exits_at=1070.0)
    runner, _, kind = runner_for(tmp_path, none_left, clock, FakeSignals(clock))
    runner.run(0, restarts_left=0)
    assert kind.prepared == 0


def pulse(
    run_dir: Path, attempt: int, *, step_s: float | None, phases: Sequence[str] = (), rank: int = 0
) -> None:
    """What a training process's heartbeat thread writes (`ettr.heartbeat.Progress.snapshot`)."""
    path = heartbeat_dir(run_dir, attempt) / f"rank-{rank}-pid-999999.pulse"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "v": 1,
        "steps": 20,
        "step_s": step_s,
        "intervals": 0 if step_s is None else 19,
        "phases": list(phases),
    }
    path.write_text(json.dumps(doc))


def test_the_runner_kills_a_hung_attempt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    clock = FakeClock()
    fake = FakeAttempt(clock, on_term=None)  # ignores SIGTERM: SIGKILL after the hang grace
    runner, ledger, _ = runner_for(
        tmp_path, fake, clock, FakeSignals(clock), hang_timeout_s=5.0, poll_interval_s=0.25
    )
    pulse(tmp_path, 1, step_s=0.2)  # its steps run: --hang-timeout is the bound
    ledger.activity = 1002.0  # the last sign of life
    ended = runner.run(1)
    assert ended.end.outcome is Outcome.HUNG and ended.end.exit_code == 137
    assert (
        "no progress and no heartbeat for 5.2 s (over --hang-timeout: 5 s); killed by SIGKILL"
        in ended.end.reason
    )
    (term_at, term, _), (kill_at, kill, _) = fake.signals
    assert (term, kill, term_at, kill_at) == (TERM, KILL, 1007.25, 1010.25)
    (detected,) = marks(ledger, FAILURE_DETECTED_MARK)
    assert (
        detected.ts == 1007.25 and (detected.data or {})["fault_ts"] == 1002.0
    )  # detection: 5.25 s of the TTR
    assert (
        "attempt 1: no progress for 5.2 s (over --hang-timeout: 5 s): hung, killing it"
        in capsys.readouterr().err
    )


def test_a_fast_step_job_that_hangs_is_caught_in_seconds(tmp_path: Path) -> None:
    clock = FakeClock()
    fake = FakeAttempt(clock, on_term=(0.5, -TERM))
    runner, ledger, _ = runner_for(tmp_path, fake, clock, FakeSignals(clock))  # no --hang-timeout
    pulse(tmp_path, 0, step_s=0.05)
    ledger.activity = 1001.0
    ended = runner.run(0)
    assert ended.end.outcome is Outcome.HUNG
    assert "over the floor of the step bound (10 x 0.05 s): 10 s" in ended.end.reason
    ((term_at, _, _),) = fake.signals
    assert 1011.0 < term_at <= 1011.6  # 10 s after the last sign of life, not the old 300 s


def test_a_slow_step_job_gets_a_multiple_of_its_step_time(tmp_path: Path) -> None:
    clock = FakeClock()
    fake = FakeAttempt(clock, on_term=(0.5, -TERM))
    runner, ledger, _ = runner_for(tmp_path, fake, clock, FakeSignals(clock))
    pulse(tmp_path, 0, step_s=4.0)
    ledger.activity = 1001.0
    ended = runner.run(0)
    assert ended.end.outcome is Outcome.HUNG and "10 x the step time of 4 s: 40 s" in ended.end.reason
    ((term_at, _, _),) = fake.signals
    assert 1041.0 < term_at <= 1041.6


@pytest.mark.parametrize("phase", ["eval", "checkpoint_blocking", "restore", "compile"])
def test_a_long_phase_in_a_fast_step_job_is_not_a_hang(tmp_path: Path, phase: str) -> None:
    clock = FakeClock()
    fake = FakeAttempt(clock, exits_at=1062.0)  # a 60 s evaluation (a sleep: no heartbeat), then done
    runner, ledger, _ = runner_for(tmp_path, fake, clock, FakeSignals(clock), hang_timeout_s=5.0)
    pulse(tmp_path, 0, step_s=0.05, phases=[phase])
    ledger.activity = 1001.0
    ended = runner.run(0)
    assert ended.end.outcome is Outcome.COMPLETED and fake.signals == []


def test_a_phase_longer_than_the_default_is_a_hang_unless_the_books_say_it_takes_that_long(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    fake = FakeAttempt(clock, on_term=(0.5, -TERM))
    runner, ledger, _ = runner_for(tmp_path, fake, clock, FakeSignals(clock))
    pulse(tmp_path, 0, step_s=0.05, phases=["eval"])
    ledger.activity = 1001.0
    assert "over the bound of phase eval: 300 s" in runner.run(0).end.reason
    clock = FakeClock()
    fake = FakeAttempt(clock, exits_at=1500.0)  # a 499 s evaluation
    runner, ledger, _ = runner_for(tmp_path, fake, clock, FakeSignals(clock))
    ledger.append(
        [Event(EventKind.PHASE_END, 500.0, 0, 0, phase=Phase.EVAL, value=100.0)]
    )  # took 400 s before
    pulse(tmp_path, 1, step_s=0.05, phases=["eval"])
    ledger.activity = 1001.0
    assert runner.run(1).end.outcome is Outcome.COMPLETED and fake.signals == []


def test_a_start_up_longer_than_the_hang_timeout_is_not_a_hang(tmp_path: Path) -> None:
    clock = FakeClock()
    fake = FakeAttempt(clock, exits_at=1030.0)  # 30 s of silent start-up (a loaded machine) before it ends
    runner, _, _ = runner_for(tmp_path, fake, clock, FakeSignals(clock), hang_timeout_s=6.0)
    assert runner.run(0).end.outcome is Outcome.COMPLETED and fake.signals == []


@pytest.mark.parametrize("forged", [0.0, 1e12])
def test_the_runner_ignores_activity_that_cannot_be_this_attempts(tmp_path: Path, forged: float) -> None:
    clock = FakeClock()
    fake = FakeAttempt(clock, exits_at=1400.0)
    runner, ledger, _ = runner_for(tmp_path, fake, clock, FakeSignals(clock))
    ledger.activity = forged  # another job's spill file, a bit flip: no sign of life of this attempt
    assert runner.run(0).end.outcome is Outcome.COMPLETED and fake.signals == []
    fake = FakeAttempt(clock := FakeClock(), on_term=None)
    runner, ledger, _ = runner_for(tmp_path, fake, clock, FakeSignals(clock), hang_timeout_s=5.0)
    ledger.activity = forged
    assert runner.run(0).end.outcome is Outcome.HUNG  # never kept alive by it either


def test_the_runner_forwards_a_preemption(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    clock = FakeClock()
    fake = FakeAttempt(clock, on_term=(1.0, 0))  # saves for 1 s on SIGTERM, then exits 0
    runner, _, _ = runner_for(tmp_path, fake, clock, FakeSignals(clock, at={1003.0: TERM}))
    ended = runner.run(0, restarts_left=2)
    assert [(s, whole) for _, s, whole in fake.signals] == [(TERM, True)]  # done within the grace
    assert ended.end.outcome is Outcome.PREEMPTED
    assert "got SIGTERM: forwarding it to the job, SIGKILL in 10 s" in capsys.readouterr().err


def test_the_runner_gives_slurms_warning_to_the_processes_with_a_handler_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS", raising=False)  # the batch shell: `B:USR1` reached it alone
    code = (
        "import signal, sys\n"
        "signal.signal(signal.SIGUSR1, lambda *a: print('saved on SIGUSR1', flush=True))\n"
        "print('ready', flush=True); sys.stdin.read()"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"

    class WithAHandler(FakeAttempt):
        def alive(self) -> list[int]:
            return [child.pid, *super().alive()]

    clock = FakeClock()
    fake = WithAHandler(clock, on_term=(1.0, 0))
    runner, _, _ = runner_for(tmp_path, fake, clock, FakeSignals(clock, at={1003.0: USR1}))
    try:
        ended = runner.run(0)
    finally:
        out, _ = child.communicate("", timeout=60)
    assert "saved on SIGUSR1" in out and child.returncode == 0
    assert fake.signals[0][1] == TERM  # then the whole job: SIGTERM, as ever
    assert ended.end.outcome is Outcome.PREEMPTED


def test_the_sigkill_at_the_end_of_the_grace_says_what_each_rank_was_doing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Lightning's SIGTERM handler broadcasts: rank 0 waits in it, rank 1 got the signal in a barrier; neither
    # exits, and the grace's SIGKILL said nothing of why.
    for rank, pid, phase in ((0, 999998, "sigterm_handler"), (1, 999999, "barrier")):
        beat = heartbeat_dir(tmp_path, 0) / f"rank-{rank}-pid-{pid}"
        beat.parent.mkdir(parents=True, exist_ok=True)
        beat.write_text("")
        os.utime(beat, (1002.0 + rank, 1002.0 + rank))
        doc = {"v": 1, "steps": 7, "step_s": 0.1, "intervals": 6, "phases": [phase]}
        beat.with_name(beat.name + ".pulse").write_text(json.dumps(doc))
    clock = FakeClock()
    fake = FakeAttempt(clock, on_term=None)  # ignores SIGTERM
    runner, _, _ = runner_for(tmp_path, fake, clock, FakeSignals(clock, at={1003.0: TERM}))
    end = runner.run(0).end
    (_, first, _), (_, second, _) = fake.signals
    assert (first, second) == (TERM, KILL) and end.outcome is Outcome.PREEMPTED
    rank0 = "rank 0 (pid 999998) quiet 11.0 s, at least 7 steps done, in sigterm_handler"
    rank1 = "rank 1 (pid 999999) quiet 10.0 s, at least 7 steps done, in barrier"
    line = "attempt 0: the job did not exit within the 10 s grace after SIGTERM: rank 0 (pid 999998)"
    err = capsys.readouterr().err
    assert line in err and rank1 in err and err.rstrip().endswith("; SIGKILL")
    assert end.ranks_at_kill is not None and rank0 in end.ranks_at_kill and rank1 in end.ranks_at_kill
    assert f"; at the SIGKILL after the grace: {end.ranks_at_kill}" in end.reason
    assert AttemptEnd.from_data(end.to_data()).ranks_at_kill == end.ranks_at_kill  # kept in ATTEMPT_END


def test_a_second_signal_kills_at_once(tmp_path: Path) -> None:
    clock = FakeClock()
    fake = FakeAttempt(clock, on_term=None)
    runner, _, _ = runner_for(tmp_path, fake, clock, FakeSignals(clock, at={1003.0: TERM, 1004.0: TERM}))
    ended = runner.run(0)
    (_, first, _), (killed_at, second, _) = fake.signals
    assert (first, second) == (TERM, KILL) and killed_at == pytest.approx(1004.0, abs=0.11)
    assert ended.end.outcome is Outcome.PREEMPTED and ended.end.signal == "SIGKILL"


def test_the_runner_stops_the_rest_after_a_failed_rank(tmp_path: Path) -> None:
    clock = FakeClock()
    fake = FakeAttempt(clock, rank_failed_at=1001.0, on_rest_term=(0.5, 1))  # the launcher then exits 1
    runner, ledger, _ = runner_for(tmp_path, fake, clock, FakeSignals(clock))
    ended = runner.run(0)
    ((at, sig, whole),) = fake.signals
    assert (sig, whole) == (TERM, False) and at == pytest.approx(1001.6)
    assert ended.end.outcome is Outcome.FAILED and ended.end.exit_code == 1
    (detected,) = marks(ledger, FAILURE_DETECTED_MARK)
    assert detected.ts == pytest.approx(1001.0)  # the rank's death, not the launcher's exit


def test_an_attempt_that_cannot_start_is_a_failure_with_its_start_booked(tmp_path: Path) -> None:
    class Broken(FakeKind):
        def start(self, plan: AttemptPlan) -> FakeAttempt:
            raise FileNotFoundError("no such file: python")

    clock = FakeClock()
    fake = FakeAttempt(clock)
    runner, ledger, _ = runner_for(tmp_path, fake, clock, FakeSignals(clock), kind=Broken(fake))
    ended = runner.run(0)
    assert (ended.end.outcome, ended.end.exit_code) == (Outcome.FAILED, 127)
    assert "cannot start" in ended.end.reason and supervisor_events(ledger, EventKind.ATTEMPT_START)


# -- the rest of the grace for what outlives the command ---------------------------------------------------------
def test_what_outlives_a_signalled_wrapper_has_the_rest_of_the_grace() -> None:
    state, _ = WATCH.step(WATCH.start(0), Signalled(TERM, 1), 100.0)
    state, actions = WATCH.step(state, Exited(-TERM, outlived=True), 100.05)  # bash died at once
    assert actions == [] and state.draining and not state.done and state.kill_at == 110.0
    state, actions = WATCH.step(state, Tick(), 102.0)
    assert actions == []  # python still saves: no SIGKILL, no second SIGTERM
    state, _ = WATCH.step(state, Drained(), 102.1)
    assert state.done and state.returncode == -TERM and state.forwarded == TERM


def test_what_outlives_the_grace_is_killed_then() -> None:
    state, _ = WATCH.step(WATCH.start(0), Signalled(TERM, 1), 100.0)
    state, _ = WATCH.step(state, Exited(-TERM, outlived=True), 100.05)
    state, actions = WATCH.step(state, Tick(), 110.0)
    assert sent(actions) == [(KILL, True)] and state.done


def test_what_outlives_a_command_that_ended_on_its_own_is_asked_to_stop() -> None:
    state, actions = WATCH.step(WATCH.start(3), Exited(0, outlived=True), 50.0)
    assert actions == [] and state.draining and state.returncode == 0  # it may still leave by itself
    state, actions = WATCH.step(state, Tick(), 50.9)
    assert actions == []
    state, actions = WATCH.step(state, Tick(), 51.0)  # `outlived_settle_s` later: asked
    assert sent(actions) == [(TERM, True)] and "outlived its command" in said(actions)[0]
    assert state.kill_at == 54.0 and state.draining and state.returncode == 0
    state, actions = WATCH.step(state, Signalled(TERM, 1), 52.0)
    assert actions == [] and state.forwarded is None  # asked already; its end was not a preemption
    state, actions = WATCH.step(state, Signalled(TERM, 2), 52.5)
    assert state.kill_at == 52.5
    _, actions = WATCH.step(state, Tick(), 52.5)
    assert sent(actions) == [(KILL, True)]


def test_what_leaves_by_itself_right_after_the_command_is_not_signalled() -> None:
    # multiprocessing's resource tracker outlives a spawning script by a few milliseconds, on every run
    state, actions = WATCH.step(WATCH.start(0), Exited(0, outlived=True), 50.0)
    state, more = WATCH.step(state, Tick(), 50.2)
    state, last = WATCH.step(state, Drained(), 50.3)
    assert actions == more == last == [] and state.done and state.returncode == 0


def test_the_runner_lets_the_python_behind_a_dead_wrapper_finish_its_save(tmp_path: Path) -> None:
    clock = FakeClock()
    wrapper = FakeAttempt(clock, on_term=(0.0, -TERM))  # bash dies of the SIGTERM at once ...
    wrapper.child_until = float("inf")  # ... while the python it started runs on, saving 2 s once asked
    runner, ledger, _ = runner_for(tmp_path, wrapper, clock, FakeSignals(clock, at={1003.0: TERM}))
    ended = runner.run(0)
    assert [s for _, s, _ in wrapper.signals] == [TERM]  # never SIGKILLed: the save completed
    assert clock.now == pytest.approx(1005.0, abs=0.11) and ended.end.outcome is Outcome.PREEMPTED
    (detected,) = marks(ledger, FAILURE_DETECTED_MARK)
    assert detected.ts == pytest.approx(1003.0, abs=0.11)  # the wrapper's death, not the save's end


def test_the_runner_puts_the_first_stop_signal_on_record_at_once(tmp_path: Path) -> None:
    # Slurm SIGKILLs the supervisor `KillWait` after its SIGTERM, maybe before the attempt ends: the signal
    # must be in the books by then (`SIGNALLED_MARK`), so that the requeued run closes a preemption.
    clock = FakeClock()
    fake = FakeAttempt(clock, on_term=None)
    runner, ledger, _ = runner_for(tmp_path, fake, clock, FakeSignals(clock, at={1003.0: USR1, 1004.0: USR1}))
    runner.run(0)
    (noted,) = marks(ledger, SIGNALLED_MARK)  # once, the first signal as received
    assert (noted.data or {})["signal"] == "SIGUSR1" and noted.ts == pytest.approx(1003.0, abs=0.11)
    # The command died of Slurm's SIGTERM (it reached every process) before the runner looked at its own:
    # the python behind it still saves, and the stop is on record all the same.
    clock = FakeClock()
    wrapper = FakeAttempt(clock, exits_at=1003.0, code=-TERM)
    wrapper.child_until = float("inf")
    runner, ledger, _ = runner_for(tmp_path, wrapper, clock, FakeSignals(clock, at={1003.0: TERM}))
    runner.run(0)
    (noted,) = marks(ledger, SIGNALLED_MARK)
    assert (noted.data or {})["signal"] == "SIGTERM" and noted.ts == pytest.approx(1003.0, abs=0.11)


def test_a_signal_after_the_command_ended_is_said() -> None:
    # Slurm's SIGTERM reaches every process: `bash train.sh` died of it before the supervisor looked at its
    # own; the torchrun behind it still ran. The supervisor passed the signal on without a word (a time-limit
    # job's output showed Slurm's CANCELLED line and nothing of ettr's).
    state, _ = WATCH.step(WATCH.start(0), Exited(-TERM, outlived=True), 100.0)
    state, actions = WATCH.step(state, Signalled(TERM, 1), 100.05)
    assert sent(actions) == [(TERM, True)]
    assert said(actions) == [
        "got SIGTERM after the job's command ended: what is left of the job gets it, SIGKILL within 10 s"
    ]


def test_a_supervisor_line_is_one_write_with_its_newline(monkeypatch: pytest.MonkeyPatch) -> None:
    # stderr writes through: a line written in two parts let the job's own output (the same Slurm output
    # file) in between them.
    from ettr.supervisor.messages import say

    class Recording:
        def __init__(self) -> None:
            self.writes: list[str] = []

        def write(self, text: str) -> int:
            self.writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    err = Recording()
    monkeypatch.setattr(sys, "stderr", err)
    say("got SIGUSR1: forwarding it to the job as SIGTERM, SIGKILL in 10 s")
    assert err.writes == ["ettr: got SIGUSR1: forwarding it to the job as SIGTERM, SIGKILL in 10 s\n"]
