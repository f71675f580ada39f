"""The supervisor loop: launch attempts, watch them, restart after failures, and keep the books.

    supervisor start (job submitted / allocated, if known)
    for each attempt, until it completes, is preempted, or restarts run out:
        ATTEMPT_START; run the command; watch for exit, a forwarded SIGTERM/SIGINT, or a hang
        ATTEMPT_END (outcome, exit code, signal, reason, exception, OOM, stderr tail)
        back off before the next attempt (none before the first restart after progress; 0.5 s, doubling)
    JOB_END; exit 0 completed, 1 failed after the restarts, 143 preempted

Each event is appended to the ledger at once (durable on return), so whatever kills the supervisor, the run
directory holds everything up to that instant.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from ettr.constants import (
    BACKOFF_MARK,
    EXIT_COMPLETED,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    FAILURE_DETECTED_MARK,
    RELAUNCH_MARK,
)
from ettr.errors import UsageError
from ettr.events import EventKind, Outcome
from ettr.family import derive_family
from ettr.heartbeat import latest_heartbeat
from ettr.inject import FaultKind
from ettr.ledger.postgres import redact
from ettr.run_env import has_trained, trained_modules
from ettr.supervisor import agent, containment, slurm, standby
from ettr.supervisor.books import JobBooks
from ettr.supervisor.classify import AttemptEnd, classify, oom_kill_count
from ettr.supervisor.config import RunConfig
from ettr.supervisor.jobinfo import default_job_id
from ettr.supervisor.launch import AttemptLaunch, attempt_launch, detect_launcher, free_port
from ettr.supervisor.messages import say
from ettr.supervisor.process import AttemptProcess
from ettr.supervisor.restart import (
    ExitWaker,
    PeerFailureWatch,
    backoff_wait_s,
    stopped_after_peer_failure,
    trained,
)
from ettr.supervisor.watchdog import HangWatchdog
from ettr.supervisor.workers import StandbyGroup, WorkerGroup

logger = logging.getLogger("ettr")

_FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, slurm.WARNING_SIGNAL)
_FLUSH_WINDOW_S = 0.6
"""After a rank failed, how long the others may still run before they are stopped: a Recorder writes its
events within 0.5 s, so their last steps are in the books."""


_say = say


def _check_command(command: tuple[str, ...]) -> None:
    program = command[0]
    if os.sep in program:
        if not (os.path.isfile(program) and os.access(program, os.X_OK)):
            raise UsageError(f"ettr run: cannot execute {program!r} (no such executable file)")
    elif shutil.which(program) is None:
        raise UsageError(f"ettr run: {program!r} is not a command found on PATH")


def _terminal_delivered(sig: int) -> bool:
    """Whether `sig` is a Ctrl-C the terminal already sent to our whole (foreground) process group."""
    if sig != signal.SIGINT:
        return False
    try:
        return os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp()
    except OSError:
        return False


class Supervisor:
    """Runs one job per `RunConfig` (see the module docstring). Use once: `Supervisor(config).run()`."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        job_id = config.job_id or default_job_id()
        self.run_dir = Path(config.run_dir or Path("runs") / job_id).absolute()
        self.family = config.family or derive_family(config.command)
        self.books = JobBooks(config, run_dir=self.run_dir, job_id=job_id, family=self.family)
        self._signal: int | None = None
        self._num_signals = 0
        self._wake = threading.Event()
        self._standby: standby.Standby | StandbyGroup | None = None  # the next attempt's, started ahead
        self._agent: agent.WorkerSpec | None | bool = False  # False: not parsed yet (`_worker_spec`)
        self._workers: tuple[list[list[str]], list[dict[str, str]]] = ([], [])  # the attempt's, per rank
        self._restarts_left = 0
        self._made_progress = False  # the last attempt completed a step (see restart.backoff_wait_s)
        self._launched = False  # an attempt was started (the first one starts cold: nothing ran before it)

    # -- the books (`books.py`) -----------------------------------------------------------------------------
    @property
    def job_id(self) -> str:
        return self.books.job_id

    def _append(self, kind: EventKind, *, attempt: int = 0, ts: float | None = None, **data: Any) -> None:
        self.books.append(kind, attempt=attempt, ts=ts, **data)

    def _open_books(self) -> int:
        """Open the books (closing what a killed predecessor left open); the first attempt's index."""
        return self.books.open()

    def _close_books(self) -> None:
        self.books.close()

    # -- signals -----------------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._num_signals += 1
        if self._signal is None:
            self._signal = signum
        self._wake.set()

    def _install_signals(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {sig: signal.signal(sig, self._on_signal) for sig in _FORWARDED_SIGNALS}

    # -- one attempt -------------------------------------------------------------------------------------
    def _run_attempt(self, attempt: int) -> AttemptEnd:
        cfg = self.config
        started = time.time()
        launch = attempt_launch(
            cfg.command,
            run_dir=self.run_dir,
            job_id=self.job_id,
            attempt=attempt,
            started_at=started,
            inject=cfg.inject,
            auto=cfg.auto,
            ledger_url=cfg.ledger_url,
            family=self.family,
            port=self._rendezvous_port(attempt),
        )
        oom_before = oom_kill_count()
        sweep = containment.AttemptSweep(self.run_dir, attempt)
        try:
            spec = self._worker_spec()
            if spec is not None:
                group = self._start_workers(spec, attempt, launch)
                sweep.spare(group.pids)  # the group reaps its workers; the sweep must not
                proc: AttemptProcess | WorkerGroup = group
                relaunch = group.relaunch
            else:
                proc, relaunch = self._relaunch(launch.argv, launch.env, attempt)
        except OSError as exc:
            self._append(EventKind.ATTEMPT_START, attempt=attempt, ts=started, command=list(launch.argv))
            return AttemptEnd(outcome=Outcome.FAILED, exit_code=127, reason=f"cannot start: {exc}")
        workers = {"agent": "ettr", "worker_pids": proc.pids} if isinstance(proc, WorkerGroup) else {}
        self._append(
            EventKind.ATTEMPT_START,
            attempt=attempt,
            ts=started,
            pid=proc.pid,
            command=list(launch.argv),
            **workers,
        )
        if not self._launched:
            relaunch = standby.Relaunch(path="cold", why="the first attempt this supervisor started")
        self._launched = True
        self._append(EventKind.MARK, attempt=attempt, ts=started, name=RELAUNCH_MARK, **relaunch.to_data())
        watchdog = HangWatchdog(
            timeout_s=cfg.hang_timeout_s or cfg.default_hang_timeout_s,
            probes=[
                lambda: self.books.last_activity(attempt),
                lambda: latest_heartbeat(self.run_dir, attempt),
            ],
            started_at=started,
            armed_at_start=cfg.hang_timeout_s is not None,
        )
        forwarded: int | None = None
        hung_after_s: float | None = None
        peer_reason: str | None = None
        kill_at = float("inf")
        killed = False
        snapshot_at = 0.0
        # the loop wakes the instant the command (each worker) exits
        waker = ExitWaker(proc.pids if isinstance(proc, WorkerGroup) else [proc.pid], self._wake)
        detected_at: float | None = None  # when the supervisor knew the attempt was over (hang: at once)
        peer_failed = False
        stop_at = float("inf")
        peers = PeerFailureWatch(lambda: self.books.failure_recorded(attempt))
        while (returncode := proc.poll()) is None:
            now = time.time()
            if self._signal is not None and forwarded is None and hung_after_s is None:
                forwarded = self._signal
                name = signal.Signals(forwarded).name
                if _terminal_delivered(forwarded):
                    # Ctrl-C: the terminal signalled our whole process group, the job included; a second
                    # SIGINT would interrupt the job's own KeyboardInterrupt handling.
                    _say(f"got {name} from the terminal: the job got it too; SIGKILL in {cfg.grace_s:g} s")
                else:
                    sent = slurm.forwarded_signal(forwarded)
                    as_ = "" if sent == forwarded else f" as {signal.Signals(sent).name}"
                    _say(f"got {name}: forwarding it to the job{as_}, SIGKILL in {cfg.grace_s:g} s")
                    proc.signal_tree(sent)
                kill_at = now + cfg.grace_s
            if self._num_signals >= 2:
                kill_at = min(kill_at, now)  # asked twice: no more grace
            exiting = isinstance(proc, WorkerGroup) and proc.exiting()  # teardown after the last step
            if forwarded is None and hung_after_s is None and not exiting:
                hung_after_s = watchdog.check(now)
                if hung_after_s is not None:
                    detected_at = now
                    _say(f"attempt {attempt}: no progress for {hung_after_s:.1f} s: hung, killing it")
                    proc.signal_tree(signal.SIGTERM)
                    kill_at = now + cfg.hang_kill_grace_s
            if forwarded is None and hung_after_s is None and peer_reason is None:
                peer_reason = self._peer_check(attempt, now, started)
                if peer_reason is not None:
                    _say(f"attempt {attempt}: {peer_reason}: ending this node's part")
                    proc.signal_tree(signal.SIGTERM)
                    kill_at = now + cfg.hang_kill_grace_s
            if (
                forwarded is None
                and hung_after_s is None
                and detected_at is None
                and isinstance(proc, AttemptProcess)
            ):
                if peers.check(proc.known_tree()):  # (a WorkerGroup stops the rest itself)
                    detected_at, peer_failed = now, True
                    stop_at = now + _FLUSH_WINDOW_S  # the other ranks' last events reach the ledger first
            if peer_failed and forwarded is None and hung_after_s is None and now >= stop_at:
                _say(f"attempt {attempt}: a rank failed; stopping the others (SIGKILL in {cfg.grace_s:g} s)")
                # The launcher itself is left to see its workers end and report the failure as usual.
                proc.signal_tree(signal.SIGTERM, include_command=False)
                kill_at, stop_at = now + cfg.grace_s, float("inf")
            if now >= kill_at and not killed:
                proc.signal_tree(signal.SIGKILL)
                killed = True
            if (
                self._standby is None
                and self._restarts_left
                and standby.due(now - started, lambda: has_trained(self.run_dir, attempt))
            ):
                self._standby = self._start_standby(launch, proc, attempt)
                sweep.spare(self._standby.pids if self._standby else ())
                self._restarts_left = 0 if self._standby is None else self._restarts_left  # tried once
            if now - snapshot_at >= 1.0:
                proc.remember_tree()
                sweep.reap_adopted(exclude=proc.pid)
                snapshot_at = now
            self._wake.wait(cfg.poll_interval_s)
            self._wake.clear()
        if detected_at is None and isinstance(proc, WorkerGroup):
            detected_at = proc.failed_at  # the instant the group saw its failed worker exit
        self._append(
            EventKind.MARK, attempt=attempt, ts=detected_at, name=FAILURE_DETECTED_MARK, returncode=returncode
        )
        waker.close()
        proc.kill_leftovers()
        swept = sweep.run(exclude=proc.pid)
        if swept:
            _say(
                f"attempt {attempt}: killed {len(swept)} process(es) that outlived it (pids {', '.join(map(str, swept))})"
            )
        proc.finish()
        oom_after = oom_kill_count()
        events = self.books.attempt_events(attempt)
        self._made_progress = trained(events)
        end = classify(
            returncode=returncode,
            stderr_tail=proc.stderr_tail(),
            events=events,
            preempted_by=forwarded,
            hung_after_s=hung_after_s,
            oom_killed=oom_before is not None and oom_after is not None and oom_after > oom_before,
        )
        return self._settle(attempt, stopped_after_peer_failure(end) if peer_failed else end, peer_reason)

    # -- hooks of a multi-node job (`multinode.py`); one node alone: no peers ----------------------------------
    def _rendezvous_port(self, attempt: int) -> int | None:
        """The rendezvous port of `attempt` agreed with the peers (None: pick one locally)."""
        return None

    def _peer_check(self, attempt: int, now: float, started: float) -> str | None:
        """Why a peer ends this attempt (None: carry on); called every poll."""
        return None

    def _settle(self, attempt: int, end: AttemptEnd, peer_reason: str | None) -> AttemptEnd:
        """The attempt's end once the peers' parts are known."""
        return end

    def _restarts_used(self) -> int:
        """Restarts spent before this supervisor started (a job-wide budget reads them from the ledger)."""
        return 0

    def _relaunch(
        self, argv: Sequence[str], env: Mapping[str, str], attempt: int
    ) -> tuple[AttemptProcess, standby.Relaunch]:
        """This attempt's process, in the standby when it fits (`standby.relaunch`), else started cold."""
        ready, self._standby = self._standby, None
        if isinstance(ready, StandbyGroup):
            ready.discard()
            ready = None
        return standby.relaunch(ready, argv, env, attempt=attempt)

    def _start_standby(
        self, launch: AttemptLaunch, proc: AttemptProcess | WorkerGroup, attempt: int
    ) -> standby.Standby | StandbyGroup | None:
        """The next attempt's process(es), started now (None: standbys are off, or the command has none)."""
        if not standby.enabled():
            return None
        learned = trained_modules(self.run_dir, attempt)  # what this attempt imported before training
        if isinstance(proc, WorkerGroup):
            argvs, envs = self._workers
            return StandbyGroup.start(argvs, envs, per_attempt=agent.PER_ATTEMPT_NAMES, warm_modules=learned)
        return standby.Standby.start(launch.argv, launch.env, warm_modules=learned)

    # -- ettr as the torchrun agent (`agent.py`, `workers.py`) -------------------------------------------------
    def _worker_spec(self) -> agent.WorkerSpec | None:
        """The workers ettr starts itself for a single-node static torchrun command (None: run the command
        as is); says once why a torchrun command keeps the real torchrun."""
        if self._agent is False:
            command = self.config.command
            found = None if agent.forced_torchrun() else agent.parse(command)
            self._agent = found if isinstance(found, agent.WorkerSpec) else None
            if isinstance(found, str) and detect_launcher(command).value == "torchrun":
                _say(f"runs the real torchrun ({found}): each restart starts it cold")
            elif found is None and detect_launcher(command).value == "torchrun":
                _say("runs the real torchrun (ETTR_AGENT=torchrun): each restart starts it cold")
        return self._agent if isinstance(self._agent, agent.WorkerSpec) else None

    def _start_workers(self, spec: agent.WorkerSpec, attempt: int, launch: AttemptLaunch) -> WorkerGroup:
        """Attempt `attempt`'s workers, in the warm standbys where they fit. Raises OSError."""
        port = self._rendezvous_port(attempt) or free_port()
        cfg = self.config
        argvs, envs = [], []
        for rank in range(spec.nproc):
            error_file = agent.error_file(self.run_dir, attempt, rank)
            error_file.parent.mkdir(parents=True, exist_ok=True)
            argvs.append(list(spec.argv))
            envs.append(
                agent.worker_env(
                    spec,
                    launch.env,
                    local_rank=rank,
                    port=port,
                    restart_count=cfg.max_restarts - self._restarts_left,
                    max_restarts=cfg.max_restarts,
                    error_file=error_file,
                )
            )
        self._workers = (argvs, envs)
        ready, self._standby = self._standby, None
        if ready is not None and not isinstance(ready, StandbyGroup):
            ready.discard()
            ready = None
        return WorkerGroup.start(
            argvs,
            envs,
            standbys=ready,
            teardown_grace_s=cfg.hang_kill_grace_s,
            run_dir=self.run_dir,
            attempt=attempt,
        )

    def _stopped_status(self) -> int:
        return EXIT_INTERRUPTED if self._signal == signal.SIGINT else EXIT_PREEMPTED

    def _say_unfired(self) -> None:
        for spec in self.books.unfired(self.config.inject):
            why = "" if self.config.auto else " (--no-auto: only an instrumented process can fire it)"
            _say(f"injected fault {spec} never fired{why}")

    # -- the job -----------------------------------------------------------------------------------------
    def run(self) -> int:
        """Supervise the job to its end; the contract's exit status (0, 1 or 143)."""
        cfg = self.config
        _check_command(cfg.command)
        containment.become_subreaper()  # orphans of the job re-parent here, so the sweep finds them
        first = self._open_books()
        if cfg.hang_timeout_s is None and any(s.kind is FaultKind.HANG for s in cfg.inject):
            _say(
                f"a hang is injected without --hang-timeout: it is detected after the default "
                f"{cfg.default_hang_timeout_s:g} s without progress"
            )
        previous_handlers = self._install_signals()
        status = EXIT_FAILED
        num_attempts = 0
        last: AttemptEnd | None = None
        used = self._restarts_used()
        try:
            for restart in range(used, cfg.max_restarts + 1):
                if self._signal is not None:
                    status = self._stopped_status()
                    break
                attempt = first + restart - used
                num_attempts += 1
                self._restarts_left = cfg.max_restarts - restart
                last = self._run_attempt(attempt)
                self._append(EventKind.ATTEMPT_END, attempt=attempt, **last.to_data())
                if last.outcome is Outcome.COMPLETED:
                    status = EXIT_COMPLETED
                    break
                if self._signal is not None:
                    _say(f"attempt {attempt} {last.outcome}: {last.reason}; not restarting")
                    status = self._stopped_status()
                    break
                if restart == cfg.max_restarts:
                    _say(f"attempt {attempt} {last.outcome}: {last.reason}; no restarts left")
                    status = EXIT_FAILED
                    break
                wait_s = backoff_wait_s(
                    restart,
                    outcome=last.outcome,
                    made_progress=self._made_progress,
                    backoff_s=cfg.backoff_s,
                    max_backoff_s=cfg.max_backoff_s,
                )
                _say(
                    f"attempt {attempt} {last.outcome}: {last.reason}; "
                    f"restarting in {wait_s:g} s ({restart + 1} of {cfg.max_restarts})"
                )
                deadline = time.monotonic() + wait_s
                while self._signal is None and (left := deadline - time.monotonic()) > 0:
                    self._wake.wait(left)
                    self._wake.clear()
                self._append(EventKind.MARK, attempt=attempt, name=BACKOFF_MARK, wait_s=wait_s)
        finally:
            if self._standby is not None:
                self._standby.discard()
            for sig, handler in previous_handlers.items():
                signal.signal(sig, handler)
            self._append(
                EventKind.JOB_END,
                attempt=first + max(0, num_attempts - 1),
                exit_status=status,
                num_attempts=num_attempts,
                outcome=None if last is None else last.outcome.value,
            )
            self._say_unfired()
            self._close_books()
            self.books.store_summary()
        if cfg.ledger_url:
            where = f"--ledger {shlex.quote(redact(cfg.ledger_url))} --job-id {shlex.quote(self.job_id)}"
        else:
            where = shlex.quote(str(self.run_dir))
        _say(f"job {self.job_id} ended with status {status}; report: ettr report {where}")
        if self._signal == slurm.WARNING_SIGNAL and status == EXIT_PREEMPTED:
            _say(slurm.requeue(os.environ))
        if status in (EXIT_PREEMPTED, EXIT_INTERRUPTED):
            ledger = ["--ledger", redact(cfg.ledger_url)] if cfg.ledger_url else []
            command = shlex.join(["ettr", "run", "--run-dir", str(self.run_dir), *ledger, "--", *cfg.command])
            _say(f"to continue it (a requeue): {command}")
        return status


def run(config: RunConfig) -> int:
    """Supervise `config.command` per the contract; returns the exit status (raises `UsageError`).

    A torchrun command with `--nnodes N > 1` gets a node's supervisor (`multinode.py`)."""
    from ettr.supervisor.multinode import supervisor_for

    return supervisor_for(config).run()
