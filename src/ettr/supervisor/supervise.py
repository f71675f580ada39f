"""The supervisor of one job on one node: its parts put together, and the loop over attempts.

    supervisor start (job submitted / allocated, if known)            JobBooks.open (or join, on node R > 0)
    for each attempt, until it completes, is preempted, or restarts run out:
        ATTEMPT_START; run it; watch for exit, a signal, a hang, a peer   AttemptRunner (AttemptKind, AttemptWatch)
        ATTEMPT_END (outcome, exit code, signal, reason, exception, ...)  classify, Peers.settle
        restart at once, after a back-off that follows the cause, or stop RestartPolicy (from the failure's cause)
    JOB_END; exit 0 completed, 1 failed after the restarts, 3 restarts would not help, 143 preempted (130 Ctrl-C)

The parts: `books.JobBooks` (the only way to the ledger), `attempt.AttemptKind` (how attempts start: the
command as it is, or ettr as torchrun's agent), `runner.AttemptRunner` (one attempt, driving the pure
`watch.AttemptWatch`), `policy.RestartPolicy` (pure), `multinode.Peers` (the other nodes, or none),
`signals.SupervisorSignals`. A node of a multi-node job other than node 0 follows the attempts node 0 opens
instead of deciding them (`Peers.leads`).

Each event is appended to the ledger at once (durable on return), so whatever kills the supervisor, the run
directory holds everything up to that instant.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import time
from pathlib import Path
from typing import Any, Protocol

from ettr.constants import BACKOFF_MARK, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_PREEMPTED
from ettr.errors import UsageError
from ettr.events import EventKind, Outcome
from ettr.family import derive_family
from ettr.inject import FaultKind, why_unfired
from ettr.ledger.postgres import redact
from ettr.run_env import Launcher, remove_memory_dirs_of_run
from ettr.supervisor import agent, containment, slurm
from ettr.supervisor.attempt import AttemptKind, CommandKind
from ettr.supervisor.books import JobBooks
from ettr.supervisor.config import RunConfig
from ettr.supervisor.guard import JobGuard
from ettr.supervisor.jobinfo import default_job_id
from ettr.supervisor.launch import detect_launcher
from ettr.supervisor.messages import Progress, ended_line, say
from ettr.supervisor.multinode import peers_for
from ettr.supervisor.peers import NoPeers, Peers
from ettr.supervisor.policy import Decision, EndedAttempt, RestartPolicy, restarts_used, stopped_status
from ettr.supervisor.process import open_standard_fds
from ettr.supervisor.runner import AttemptParts, AttemptRunner
from ettr.supervisor.signals import SupervisorSignals
from ettr.supervisor.worker_kind import WorkerGroupKind


def _check_command(command: tuple[str, ...]) -> None:
    program = command[0]
    if os.sep in program:
        if not (os.path.isfile(program) and os.access(program, os.X_OK)):
            raise UsageError(f"ettr run: cannot execute {program!r} (no such executable file)")
    elif shutil.which(program) is None:
        raise UsageError(f"ettr run: {program!r} is not a command found on PATH")


def kind_for(config: RunConfig, run_dir: Path) -> AttemptKind:
    """How the attempts of `config.command` run: ettr as the agent of a single-node static torchrun
    command (its workers started by ettr, in warm standbys), else the command as it is. Says why a torchrun
    command keeps the real torchrun."""
    command = config.command
    found = None if agent.forced_torchrun() else agent.parse(command)
    if isinstance(found, agent.WorkerSpec):
        return WorkerGroupKind(
            found,
            run_dir=run_dir,
            max_restarts=config.max_restarts,
            teardown_grace_s=config.hang_kill_grace_s,
        )
    if detect_launcher(command) is Launcher.TORCHRUN:
        why = "ETTR_AGENT=torchrun" if found is None else found
        say(f"runs the real torchrun ({why}): each restart starts it cold")
    return CommandKind(run_dir)


logger = logging.getLogger("ettr")


class JobEndHook(Protocol):
    """What runs once a job's books are closed, on the node that keeps its events: `ettr.cli` hands in the
    fleet's `store_at_job_end` (the job's summary, stored once), so the supervisor never imports the fleet."""

    def __call__(self, run_dir: Path, *, ledger_url: str | None, job_id: str) -> None: ...


class Supervisor:
    """Runs one job per `RunConfig` on this node (see the module docstring). Use once:
    `Supervisor(config, peers=...).run()`; `peers` defaults to none (a job on one node)."""

    def __init__(
        self, config: RunConfig, *, peers: Peers | None = None, at_job_end: JobEndHook | None = None
    ) -> None:
        self.config = config
        self.at_job_end = at_job_end
        job_id = config.job_id or default_job_id()
        self.run_dir = Path(config.run_dir or Path("runs") / job_id).absolute()
        self.family = config.family or derive_family(config.command)
        self.books = JobBooks(config, run_dir=self.run_dir, job_id=job_id, family=self.family)
        self.peers: Peers = peers if peers is not None else NoPeers()
        self.policy = RestartPolicy(
            max_restarts=config.max_restarts,
            backoff_s=config.backoff_s,
            max_backoff_s=config.max_backoff_s,
            max_restarts_without_progress=config.max_restarts_without_progress,
        )
        self.signals = SupervisorSignals()
        self._ended: list[EndedAttempt] = []
        self._decision: Decision | None = None  # the policy's last

    @property
    def job_id(self) -> str:
        return self.books.job_id

    def run(self) -> int:
        """Supervise the job to its end; the contract's exit status (0, 1, 130 or 143). Raises UsageError.

        The signal handlers are in place from the first instant to the last: a signal before the first
        attempt ends the job at once with its books opened and closed (no traceback, nothing left open)."""
        open_standard_fds()  # before any file is opened: a closed stdout must not become the job's ledger
        self.signals.install()
        try:
            return self._run()
        finally:
            self.signals.restore()

    def _run(self) -> int:
        cfg = self.config
        _check_command(cfg.command)
        containment.become_subreaper()  # orphans of the job re-parent here, so the sweep finds them
        first = self.peers.open(self.books)
        if cfg.hang_timeout_s is None and any(s.kind is FaultKind.HANG for s in cfg.inject):
            say(
                f"a hang is injected without --hang-timeout: once steps run it is detected after "
                f"{cfg.hang_step_multiple:g} step times without progress (at least {cfg.hang_floor_s:g} s); "
                f"in start-up and long phases after {cfg.default_hang_timeout_s:g} s"
            )
        kind = kind_for(cfg, self.run_dir)
        guard = JobGuard.start(self.run_dir)  # no process of the job outlives a SIGKILLed supervisor
        runner = AttemptRunner(
            AttemptParts(
                config=cfg,
                books=self.books,
                kind=kind,
                peers=self.peers,
                signals=self.signals,
                family=self.family,
                guard=guard,
            )
        )
        status = EXIT_FAILED
        try:
            status = self._lead(runner, first) if self.peers.leads else self._follow(runner, first)
        finally:
            runner.release()  # processes kept for an in-place restart that did not come
            kind.discard()
            if guard is not None:
                guard.close()
            last = self._ended[-1] if self._ended else None
            end: dict[str, Any] = {
                "exit_status": status,
                "num_attempts": len(self._ended),
                "outcome": None if last is None else last.end.outcome.value,
            }
            if self._decision is not None:
                end["why"] = self._decision.why  # the restart policy's last word
            self.books.append(EventKind.JOB_END, attempt=first + max(0, len(self._ended) - 1), **end)
            ran = {e.attempt: (e.first_step, e.last_step) for e in self._ended}
            for spec in self.books.unfired(cfg.inject):
                why = (
                    why_unfired(spec, ran)
                    if cfg.auto
                    else "--no-auto: only an instrumented process can fire it"
                )
                say(f"injected fault {spec} never fired" + (f" ({why})" if why else ""))
            self.peers.close(status, last_attempt=first - 1 if last is None else last.attempt)
            remove_memory_dirs_of_run(self.run_dir)  # the job is over: nothing of it stays in /dev/shm
            self.books.close()
            self._job_ended(status)
        self._say_end(status)
        return status

    def _job_ended(self, status: int) -> None:
        """Call the `at_job_end` hook once the books are closed (node 0 of a multi-node job); never raises.

        Not for a preempted job (143): it ends to be requeued, and its requeue's supervisor start makes a
        summary stored now stale at once (the fleet reads the job's events until its last end). Stored, it
        stood between the preemption and the requeue: a scheduler requeues once this process has exited,
        and the summary's accounting took 0.25-0.29 s of that (0.17 s of CPU, the demo's optimized job,
        load 10)."""
        if self.at_job_end is None or not self.books.keeps_job_events or status == EXIT_PREEMPTED:
            return
        try:
            self.at_job_end(self.run_dir, ledger_url=self.config.ledger_url, job_id=self.job_id)
        except Exception as exc:  # noqa: BLE001 - what follows the job never fails it
            logger.info("ettr: the job-end hook failed (%s)", exc)

    def _lead(self, runner: AttemptRunner, first: int) -> int:
        """Run attempts from `first` until the policy stops the job; its exit status. The job's earlier
        attempts in its books (a requeued job) count as this supervisor's own: the restart budget and the
        rules that stop restarts that would not help are the job's, across `ettr run` invocations."""
        earlier = [h for h in self.books.history() if h.attempt < first]
        if restarts_used(earlier):
            left = max(0, self.config.max_restarts - restarts_used(earlier))
            say(
                f"the books show {restarts_used(earlier)} restart(s) of job {self.job_id} already spent on "
                f"failures (preemptions are not counted): {left} left"
            )
        attempt = first
        while True:
            if self.signals.first is not None:  # during the back-off
                return stopped_status(self.signals.first)
            history = [*earlier, *self._ended]
            used = restarts_used(history)
            left = self.config.max_restarts - used
            done = restarts_used(earlier) + len(self._ended)  # torchrun's TORCHELASTIC_RESTART_COUNT
            ended = runner.run(attempt, restarts_done=done, restarts_left=left)
            self.books.append(EventKind.ATTEMPT_END, attempt=attempt, **ended.end.to_data())
            decision = self.policy.decide(ended, history=history, signalled=self.signals.first)
            self._ended.append(ended)
            self._decision = decision
            end = ended.end
            if end.outcome is not Outcome.COMPLETED:
                say(ended_line(attempt, end, decision.why))
            if not decision.restart:
                assert decision.exit_status is not None
                return decision.exit_status
            deadline = time.monotonic() + decision.wait_s
            waiting = Progress(time.monotonic())
            while self.signals.first is None and (wait_s := deadline - time.monotonic()) > 0:
                self.signals.wait(min(wait_s, 1.0))
                if waiting.due(time.monotonic()) and deadline - time.monotonic() > 1.0:
                    say(f"attempt {attempt + 1} starts in {deadline - time.monotonic():.0f} s (back-off)")
            self.books.append(EventKind.MARK, attempt=attempt, name=BACKOFF_MARK, wait_s=decision.wait_s)
            attempt += 1

    def _follow(self, runner: AttemptRunner, first: int) -> int:
        """Join the attempts the leading node opens, from `first`, until the job ends; its exit status."""
        after = first - 1
        while True:
            if self.signals.first is not None:
                return stopped_status(self.signals.first)
            turn = self.peers.turn(after, time.time())
            if turn.status is not None:
                return turn.status
            if turn.attempt is None:
                self.signals.wait(turn.wait_s)
                continue
            ended = runner.run(turn.attempt)
            self.books.append(EventKind.ATTEMPT_END, attempt=turn.attempt, **ended.end.to_data())
            self._ended.append(ended)
            after = turn.attempt

    def _say_end(self, status: int) -> None:
        cfg = self.config
        if not self.peers.leads:
            say(f"node {self.peers.node_rank} of job {self.job_id} ended with status {status}")
        else:
            if cfg.ledger_url:
                where = f"--ledger {shlex.quote(redact(cfg.ledger_url))} --job-id {shlex.quote(self.job_id)}"
            else:
                where = shlex.quote(str(self.run_dir))
            say(f"job {self.job_id} ended with status {status}; report: ettr report {where}")
            if self.signals.first == slurm.WARNING_SIGNAL and status == EXIT_PREEMPTED:
                requeue = slurm.requeue(os.environ)
                say(requeue.line)
                if requeue.queued:  # Slurm runs it again: a hint to continue it by hand would be noise
                    return
        if status in (EXIT_PREEMPTED, EXIT_INTERRUPTED):
            requeued = slurm.queued_again(os.environ)
            if requeued is not None:  # Slurm runs it again: a hint to continue it by hand would be a 2nd copy
                say(requeued)
                return
            say(f"to continue it (a requeue): {self._continue_command()}")

    def _continue_command(self) -> str:
        """The `ettr run` that continues this job on this node. Under a ledger URL it names the job id: the
        run directory does not (its books are the URL's), and without it a multi-node node's `ettr run` is
        refused (`needs --job-id`) and a one-node one opens a new job under a made-up id."""
        cfg = self.config
        ledger = ["--ledger", redact(cfg.ledger_url), "--job-id", self.job_id] if cfg.ledger_url else []
        return shlex.join(["ettr", "run", "--run-dir", str(self.run_dir), *ledger, "--", *cfg.command])


def supervisor_for(config: RunConfig, *, at_job_end: JobEndHook | None = None) -> Supervisor:
    """The supervisor of `config` on this node, with its peers: none, or the other nodes of a multi-node
    torchrun job (`ettr.supervisor.multinode`). Raises UsageError for a bad multi-node command."""
    return Supervisor(config, peers=peers_for(config), at_job_end=at_job_end)


def run(config: RunConfig, *, at_job_end: JobEndHook | None = None) -> int:
    """Supervise `config.command` per the contract; returns the exit status (raises `UsageError`)."""
    return supervisor_for(config, at_job_end=at_job_end).run()
