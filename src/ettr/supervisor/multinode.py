"""One supervisor per node of a multi-node torchrun job, coordinated through the shared ledger.

    node 0 (leader)                                    node R > 0 (follower)
    SUPERVISOR_START, node_start                       node_start
    per attempt A (index and restart budget from the ledger):
      pick a free port, publish `rendezvous` A  ───►   wait for an open attempt's `rendezvous`
      ATTEMPT_START; torchrun on HOST:port             node_attempt_start; torchrun on HOST:port
      watch: own part, peers' node_attempt_end,        watch: own part, the leader's ATTEMPT_END,
             peers' heartbeats                                the leader's heartbeat
      (a completed part waits for every peer's end)    node_attempt_end
      ATTEMPT_END (job-wide), back-off, next A  ───►   next open attempt ... until JOB_END
    JOB_END, node_end                                  node_end; exit with the job's status

Attempts are job-wide: when any node's part fails, that node writes node_attempt_end, the leader ends its
own part and writes the attempt's ATTEMPT_END, and every other node ends its part on seeing it; all then
restart together on a fresh rendezvous port (rewritten into `--rdzv-endpoint HOST:PORT` / `--master-port`
on every node). A supervisor silent for `--peer-timeout` (SIGKILLed, its host gone) is lost: the leader
ends the attempt; a follower ends its part when the leader is lost and waits for a new leader (a requeued or
restarted node 0) that closes the attempt and continues the job. Hang detection reads the ledger's last
activity of every rank, on every node. The marks are described in `peers.py`.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import replace
from typing import Any

from ettr.constants import EXIT_FAILED
from ettr.errors import UsageError
from ettr.events import EventKind, Outcome
from ettr.procs import pid_alive, start_ticks
from ettr.supervisor import peers
from ettr.supervisor.classify import AttemptEnd
from ettr.supervisor.config import RunConfig
from ettr.supervisor.launch import free_port, torchrun_options
from ettr.supervisor.peers import NodeRole, PeerView
from ettr.supervisor.supervise import Supervisor, _check_command, _say


def node_role_of(config: RunConfig) -> NodeRole | None:
    """This supervisor's role in a multi-node job, None for one node (UsageError for a bad command)."""
    try:
        role = peers.node_role(torchrun_options(config.command))
    except ValueError as exc:
        raise UsageError(f"ettr run: {exc}") from None
    if role is None:
        return None
    if not config.ledger_url:
        raise UsageError(
            f"ettr run: a {role.nnodes}-node job needs --ledger URL, the same on every node "
            "(postgresql://... or sqlite:/// on a filesystem every node shares)"
        )
    if not (config.job_id or os.environ.get("SLURM_JOB_ID")):
        raise UsageError("ettr run: a multi-node job needs --job-id ID, the same on every node")
    return role


def supervisor_for(config: RunConfig) -> Supervisor:
    """The supervisor for `config`: a plain one, or node 0's leader, or another node's follower."""
    role = node_role_of(config)
    if role is None:
        return Supervisor(config)
    return Leader(config, role) if role.leader else Follower(config, role)


class _Node(Supervisor):
    """What the leader and the followers share: node marks, heartbeats, a cached view of the peers."""

    def __init__(self, config: RunConfig, role: NodeRole) -> None:
        super().__init__(config)
        self.role = role
        self._interval = min(10.0, max(0.2, config.peer_timeout_s / 4))
        self._beat_at = 0.0
        self._looked_at = 0.0
        self._view = PeerView()
        self._peer_end: dict[str, Any] = {}

    def _mark(self, name: str, *, attempt: int, **data: Any) -> None:
        self.books.mark(name, attempt=attempt, node_rank=self.role.node_rank, **data)

    def _beat(self, attempt: int, now: float) -> None:
        if now - self._beat_at >= self._interval:
            self._beat_at = now
            self._mark(peers.NODE_HEARTBEAT, attempt=attempt)

    def _look(self, now: float, *, force: bool = False) -> PeerView | None:
        """A fresh view every heartbeat interval (None between looks)."""
        if not force and now - self._looked_at < self._interval:
            return None
        self._looked_at = now
        try:
            self._view = peers.peer_view(self.books.supervisor_events())
        except Exception as exc:
            _say(f"cannot read the ledger to see the peers ({exc}); trying again")
            return None
        return self._view

    def _mark_start(self, attempt: int) -> None:
        self._mark(
            peers.NODE_START,
            attempt=attempt,
            pid=os.getpid(),
            pid_start_ticks=start_ticks(os.getpid()),
            host=socket.gethostname(),
            nnodes=self.role.nnodes,
        )

    def _peer_ended(self, end: AttemptEnd, reason: str) -> AttemptEnd:
        data = self._peer_end
        outcome = Outcome.HUNG if data.get("outcome") == Outcome.HUNG.value else Outcome.FAILED
        exit_code = data.get("exit_code")
        return replace(
            end,
            outcome=outcome,
            exit_code=exit_code if isinstance(exit_code, int) else end.exit_code,
            reason=reason,
            exception=data.get("exception") or end.exception,
            message=data.get("message") or end.message,
        )


class Leader(_Node):
    """Node rank 0: keeps the job's books (the contract's supervisor events) and picks each rendezvous."""

    def _open_books(self) -> int:
        first = super()._open_books()
        self._mark_start(first)
        return first

    def _close_books(self) -> None:
        self._mark(peers.NODE_END, attempt=0)
        super()._close_books()

    def _restarts_used(self) -> int:
        try:
            used = peers.restarts_used(self.books.read())
        except Exception:
            return 0
        if used:
            left = max(0, self.config.max_restarts - used)
            _say(f"the ledger shows {used} restart(s) of job {self.job_id} already spent: {left} left")
        return used

    def _rendezvous_port(self, attempt: int) -> int | None:
        port = free_port("0.0.0.0")
        self._mark(peers.RENDEZVOUS, attempt=attempt, port=port)
        self._peer_end = {}
        return port

    def _peer_check(self, attempt: int, now: float, started: float) -> str | None:
        self._beat(attempt, now)
        view = self._look(now)
        return None if view is None else self._peer_trouble(view, attempt, now, started)

    def _peer_trouble(self, view: PeerView, attempt: int, now: float, started: float) -> str | None:
        failed = peers.failed_peer(view, attempt, self.role.peers)
        if failed is not None:
            node, data = failed
            self._peer_end = dict(data)
            return f"node {node}'s part ended {data.get('outcome')}: {data.get('reason')}"
        lost = peers.lost_peers(
            view, self.role.peers, since=started, now=now, timeout_s=self.config.peer_timeout_s
        )
        if lost:
            self._peer_end = {}
            return f"node {lost[0]}'s supervisor is silent for over {self.config.peer_timeout_s:g} s (lost)"
        return None

    def _settle(self, attempt: int, end: AttemptEnd, peer_reason: str | None) -> AttemptEnd:
        if peer_reason is not None:
            return self._peer_ended(end, peer_reason)
        if end.outcome is not Outcome.COMPLETED:
            return end
        # This node's part completed: the attempt completed when every peer's part did.
        started = time.time()
        while True:
            now = time.time()
            self._beat(attempt, now)
            view = self._look(now, force=True)
            if view is not None:
                trouble = self._peer_trouble(view, attempt, now, started - self.config.peer_timeout_s)
                if trouble is not None:
                    _say(f"attempt {attempt}: {trouble}")
                    return self._peer_ended(end, trouble)
                if all((attempt, n) in view.node_ends for n in self.role.peers):
                    return end
            if self._signal is not None:
                return end
            self._wake.wait(self._interval)
            self._wake.clear()


class Follower(_Node):
    """Node rank R > 0: joins the attempts node 0 opens, reports its part, ends with the job's status."""

    def _open_books(self) -> int:
        previous = self.books.join(self.role.node_rank)
        live = peers.live_node_supervisor(previous, self.role.node_rank)
        if live is not None and live.get("host") == socket.gethostname():
            pid, ticks = live.get("pid"), live.get("pid_start_ticks")
            if (
                isinstance(pid, int)
                and pid != os.getpid()
                and pid_alive(pid, ticks if isinstance(ticks, int) else None)
            ):
                self.books.drop()
                raise UsageError(
                    f"ettr run: node {self.role.node_rank} of job {self.job_id} already has a running "
                    f"supervisor (pid {pid}); give each node its own --node-rank"
                )
        self._mark_start(0)
        self._start_index = sum(1 for e in previous if e.rank < 0)  # positions in `_supervisor_events`
        self._rejoin_guard(peers.peer_view(previous))
        return 0

    def _rejoin_guard(self, view: PeerView) -> None:
        """Attempts this node joined under an earlier supervisor (SIGKILLed) are not joined again: their
        rendezvous is gone. Say so at once, so that the leader need not wait for the peer timeout."""
        node = self.role.node_rank
        joined = [a for (a, n) in view.node_joined if n == node]
        for attempt in joined:
            if attempt not in view.ended and (attempt, node) not in view.node_ends:
                self._mark(
                    peers.NODE_ATTEMPT_END,
                    attempt=attempt,
                    outcome=Outcome.FAILED.value,
                    exit_code=None,
                    reason=f"node {node}'s supervisor was lost (killed) while this attempt ran",
                )
        self._done = max(joined, default=-1)

    def _rendezvous_port(self, attempt: int) -> int | None:
        return self._view.ports.get(attempt)

    def _peer_check(self, attempt: int, now: float, started: float) -> str | None:
        self._beat(attempt, now)
        view = self._look(now)
        if view is None:
            return None
        ended = view.ended.get(attempt)
        if ended is not None:
            data = ended.data or {}
            self._peer_end = dict(data)
            return f"node 0 ended attempt {attempt} ({data.get('outcome')}: {data.get('reason')})"
        if self._leader_lost(view, now):
            self._peer_end = {}
            return f"node 0's supervisor is silent for over {self.config.peer_timeout_s:g} s (lost)"
        return None

    def _leader_lost(self, view: PeerView, now: float) -> bool:
        beat = view.last_beat.get(0)
        return beat is not None and now - beat > self.config.peer_timeout_s

    def _settle(self, attempt: int, end: AttemptEnd, peer_reason: str | None) -> AttemptEnd:
        if peer_reason is None:
            return end
        if self._peer_end.get("outcome") == Outcome.COMPLETED.value and end.outcome is Outcome.COMPLETED:
            return end
        return self._peer_ended(end, peer_reason)

    def run(self) -> int:
        """Follow the job's attempts to its end; the job's exit status (as the leader wrote it)."""
        _check_command(self.config.command)
        self._open_books()
        handlers = self._install_signals()
        status = EXIT_FAILED
        try:
            status = self._follow()
        finally:
            import signal

            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            self._mark(peers.NODE_END, attempt=max(self._done, 0), exit_status=status)
            self._close_books()
        _say(f"node {self.role.node_rank} of job {self.job_id} ended with status {status}")
        return status

    def _follow(self) -> int:
        cfg = self.config
        waiting_since = time.monotonic()
        announced = False
        while True:
            if self._signal is not None:
                return self._stopped_status()
            now = time.time()
            view = self._look(now, force=True) or self._view
            if view.job_end_at is not None and view.job_end_at >= self._start_index:
                return view.job_end_status if view.job_end_status is not None else EXIT_FAILED
            attempt = peers.open_attempt(view, after=self._done)
            if attempt is not None:
                _say(f"node {self.role.node_rank}: joining attempt {attempt} (port {view.ports[attempt]})")
                end = self._run_attempt(attempt)
                self._append(EventKind.ATTEMPT_END, attempt=attempt, **end.to_data())
                self._done = attempt
                waiting_since = time.monotonic()
                announced = False
                continue
            if not announced:
                _say(f"node {self.role.node_rank}: waiting for node 0 to open the next attempt")
                announced = True
            waited = time.monotonic() - waiting_since
            if waited > cfg.follower_wait_s and (
                view.last_beat.get(0) is None or self._leader_lost(view, now)
            ):
                _say(f"no attempt from node 0's supervisor for {waited:.0f} s; giving up")
                return EXIT_FAILED
            self._beat(max(self._done, 0), now)
            self._wake.wait(self._interval)
            self._wake.clear()
