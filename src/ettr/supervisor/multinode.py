"""The nodes of a multi-node torchrun job, as the `Peers` (`ettr.supervisor.peers`) handed to each node's
supervisor: node 0's `LeaderPeers`, the others' `FollowerPeers`, coordinated through the shared ledger.

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

Attempts are job-wide: when any node's part fails, that node writes node_attempt_end, the leader ends its own part and
writes the attempt's ATTEMPT_END, and every other node ends its part on seeing it; all then restart together on a
fresh rendezvous port (rewritten into `--rdzv-endpoint HOST:PORT` / `--master-port` on every node). A supervisor
silent for `--peer-timeout` (SIGKILLed, its host gone) is lost: the leader ends the attempt; a follower ends its part
when the leader is lost and waits for a new leader (a requeued or restarted node 0) that closes the attempt and
continues the job. Hang detection reads the ledger's last activity of every rank, on every node. The marks are
described in `peers.py`."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from dataclasses import replace

from ettr.constants import EXIT_FAILED
from ettr.errors import UsageError
from ettr.events import Event, Outcome
from ettr.procs import pid_alive
from ettr.supervisor import peer_words, peers
from ettr.supervisor.books import JobBooks
from ettr.supervisor.classify import AttemptEnd, consequence_of_a_peer
from ettr.supervisor.config import RunConfig
from ettr.supervisor.launch import free_port, torchrun_options
from ettr.supervisor.messages import Progress, say
from ettr.supervisor.node import Node
from ettr.supervisor.peers import NodeRole, NoPeers, Peers, PeerView, Turn
from ettr.supervisor.signals import SupervisorSignals


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


def peers_for(config: RunConfig) -> Peers:
    """The peers of the job `config` runs: none, or this node as node 0's leader or another's follower."""
    role = node_role_of(config)
    if role is None:
        return NoPeers()
    return LeaderPeers(config, role) if role.leader else FollowerPeers(config, role)


class LeaderPeers:
    """Node 0: it keeps the job's books (the contract's supervisor events) and picks each rendezvous."""

    leads = True

    def __init__(self, config: RunConfig, role: NodeRole) -> None:
        self.node = Node(config, role)
        self.node_rank = role.node_rank

    def open(self, books: JobBooks) -> int:
        self.node.attach(books)
        first = books.open(check=self.node.refuse_another_size)
        self.node.mark_start(first)
        return first

    def own_events(self, events: Sequence[Event]) -> list[Event]:
        return self.node.own_events(events)

    def absent(self, attempt: int) -> str | None:
        return self.node.absent(attempt)

    def rendezvous_port(self, attempt: int) -> int | None:
        port = free_port("0.0.0.0")
        self.node.mark(peers.RENDEZVOUS, attempt=attempt, port=port)
        self.node.peer_end = {}
        return port

    def check(self, attempt: int, now: float, started: float) -> str | None:
        self.node.beat(attempt, now)
        view = self.node.look(now)
        return None if view is None else self._trouble(view, attempt, now, started)

    def _trouble(self, view: PeerView, attempt: int, now: float, started: float) -> str | None:
        node = self.node
        failed = peers.failed_peer(view, attempt, node.role.peers)
        if failed is not None:
            rank, data = failed
            node.peer_end = dict(data)
            return f"node {rank}'s part ended {data.get('outcome')}: {data.get('reason')}"
        timeout_s = node.config.peer_timeout_s
        lost = peers.lost_peers(view, node.role.peers, since=started, now=now, timeout_s=timeout_s)
        if lost:
            node.peer_end = {}
            return f"node {lost[0]}'s supervisor is silent for over {timeout_s:g} s (lost)"
        return None

    def settle(
        self,
        attempt: int,
        end: AttemptEnd,
        peer_reason: str | None,
        signals: SupervisorSignals,
        events: Sequence[Event] | None = None,
    ) -> AttemptEnd:
        node = self.node
        if peer_reason is not None:
            return node.peer_ended(end, peer_reason)
        if end.outcome is Outcome.FAILED and not node.books.attempt_events(attempt):  # no rank started:
            if waited := node.absent(attempt):  # torchrun's rendezvous timed out waiting for them
                return replace(end, reason=f"{end.reason} ({waited})")
        end = node.with_unseen_restore(attempt, end, events)
        if end.outcome is Outcome.HUNG:
            return self._with_peers_ranks(attempt, end, signals)
        if end.outcome is Outcome.FAILED and consequence_of_a_peer(end):
            behind = self._peer_behind(attempt, signals)
            if behind is not None:
                say(f"attempt {attempt}: {behind}")
                return node.peer_ended(end, behind)
            return end
        if end.outcome is not Outcome.COMPLETED:
            return end
        # This node's part completed: the attempt completed when every peer's part did.
        started = time.time()
        waiting = Progress(started)
        while True:
            now = time.time()
            node.beat(attempt, now)
            view = node.look(now, force=True)
            if view is not None:
                trouble = self._trouble(view, attempt, now, started - node.config.peer_timeout_s)
                if trouble is not None:
                    say(f"attempt {attempt}: {trouble}")
                    return node.peer_ended(end, trouble)
                running = [n for n in node.role.peers if (attempt, n) not in view.node_ends]
                if not running:
                    return end
                if waiting.due(now):
                    nodes = ", ".join(map(str, running))
                    say(
                        f"attempt {attempt}: this node's part completed; waiting for node(s) {nodes} to end theirs"
                    )
            if signals.first is not None:
                return end
            signals.wait(node.poll_s)

    def _with_peers_ranks(self, attempt: int, end: AttemptEnd, signals: SupervisorSignals) -> AttemptEnd:
        """This node found the attempt hung: its reason names what this node's ranks were doing, which in a
        collective hang is only the victims' side (asleep in the collective) while the rank that stopped runs
        on another node. Each node's supervisor finds the same silence in the ledger and describes its own
        ranks (only it can read their state): add each peer's description to the reason. Waits while a peer
        that joined the attempt has neither ended its part nor gone silent, at most the peer timeout (the
        next attempt waits for that peer's part to end anyway)."""
        node = self.node
        begin = time.time()
        timeout_s = node.config.peer_timeout_s
        view = node.view
        while True:
            now = time.time()
            node.beat(attempt, now)
            view = node.look(now, force=True) or view
            waiting = [
                n
                for n in node.role.peers
                if (attempt, n) in view.node_joined
                and (attempt, n) not in view.node_ends
                and now - view.last_beat.get(n, 0.0) <= timeout_s
            ]
            if not waiting or now - begin > timeout_s + node.interval_s or signals.first is not None:
                break
            signals.wait(node.poll_s)
        said = peer_words.peers_hung_ranks(view, attempt, node.role.peers)
        if not said:
            return end
        ranks = f"{end.hung_ranks}; {said}" if end.hung_ranks else said
        return replace(end, reason=f"{end.reason}; {said}", hung_ranks=ranks)

    def _peer_behind(self, attempt: int, signals: SupervisorSignals) -> str | None:
        """This node's part failed in a collective: the peer behind it, if one failed or was lost (a node
        that died broke its peers' connections before its silence could tell). Waits while a peer has
        neither ended its part nor been heard since, at most the peer timeout."""
        node = self.node
        begin = time.time()
        timeout_s = node.config.peer_timeout_s
        waiting = Progress(begin, after_s=1.0)
        while True:
            now = time.time()
            node.beat(attempt, now)
            view = node.look(now, force=True)
            if view is not None:
                trouble = self._trouble(view, attempt, now, begin - 2 * timeout_s)
                if trouble is not None:
                    return trouble
                quiet = [
                    n
                    for n in node.role.peers
                    if (attempt, n) not in view.node_ends and view.last_beat.get(n, 0.0) < begin
                ]
                if not quiet:
                    return None  # every peer ended its part or is alive: this node's failure is its own
                if waiting.due(now):  # a lost node is silent for --peer-timeout: say why nothing happens
                    say(f"attempt {attempt}: {peer_words.quiet_peers(view, quiet, now, timeout_s)}")
            if now - begin > timeout_s + node.interval_s or signals.first is not None:
                return None
            signals.wait(node.poll_s)

    def turn(self, after: int, now: float) -> Turn:
        return Turn(attempt=after + 1)

    def close(self, status: int, *, last_attempt: int) -> None:
        self.node.mark(peers.NODE_END, attempt=0)


class FollowerPeers:
    """Node R > 0: it joins the attempts node 0 opens, reports its part, ends with the job's status."""

    leads = False

    def __init__(self, config: RunConfig, role: NodeRole) -> None:
        self.node = Node(config, role)
        self.node_rank = role.node_rank
        self._done = -1  # the latest attempt this node joined under an earlier supervisor
        self._joined = False  # this run took part in an attempt: a wait after it may end in the job's end
        self._start_index = 0  # positions in the supervisors' events: a JOB_END before it is an earlier run's
        self._waiting_since: float | None = None
        self._waiting: Progress | None = None

    def open(self, books: JobBooks) -> int:
        node = self.node
        node.attach(books)
        rank = node.role.node_rank
        previous = books.join(rank)
        live = peers.live_node_supervisor(previous, rank)
        if live is not None and live.get("host") == socket.gethostname():
            pid, ticks = live.get("pid"), live.get("pid_start_ticks")
            if (
                isinstance(pid, int)
                and pid != os.getpid()
                and pid_alive(pid, ticks if isinstance(ticks, int) else None)
            ):
                books.drop()
                raise UsageError(
                    f"ettr run: node {rank} of job {books.job_id} already has a running "
                    f"supervisor (pid {pid}); give each node its own --node-rank"
                )
        try:
            node.refuse_another_size(previous)
        except UsageError:
            books.drop()
            raise
        node.mark_start(0)
        self._start_index = sum(1 for e in previous if e.rank < 0)
        self._rejoin_guard(peers.peer_view(previous))
        return self._done + 1

    def _rejoin_guard(self, view: PeerView) -> None:
        """Attempts this node joined under an earlier supervisor (SIGKILLed) are not joined again: their
        rendezvous is gone. Say so at once, so that the leader need not wait for the peer timeout."""
        rank = self.node.role.node_rank
        joined = [a for (a, n) in view.node_joined if n == rank]
        for attempt in joined:
            if attempt not in view.ended and (attempt, rank) not in view.node_ends:
                why = f"node {rank}'s supervisor was lost (killed) while this attempt ran"
                self.node.mark(
                    peers.NODE_ATTEMPT_END, attempt=attempt, outcome="failed", exit_code=None, reason=why
                )
        self._done = max(joined, default=-1)

    def own_events(self, events: Sequence[Event]) -> list[Event]:
        return self.node.own_events(events)

    def absent(self, attempt: int) -> str | None:
        return self.node.absent(attempt)

    def rendezvous_port(self, attempt: int) -> int | None:
        return self.node.view.ports.get(attempt)

    def check(self, attempt: int, now: float, started: float) -> str | None:
        node = self.node
        node.beat(attempt, now)
        view = node.look(now)
        if view is None:
            return None
        ended = view.ended.get(attempt)
        if ended is not None:
            data = ended.data or {}
            node.peer_end = dict(data)
            return f"node 0 ended attempt {attempt} ({data.get('outcome')}: {data.get('reason')})"
        if self._leader_lost(view, now):
            node.peer_end = {}
            return f"node 0's supervisor is silent for over {node.config.peer_timeout_s:g} s (lost)"
        return None

    def _leader_lost(self, view: PeerView, now: float) -> bool:
        beat = view.last_beat.get(0)
        return beat is not None and now - beat > self.node.config.peer_timeout_s

    def settle(
        self,
        attempt: int,
        end: AttemptEnd,
        peer_reason: str | None,
        signals: SupervisorSignals,
        events: Sequence[Event] | None = None,
    ) -> AttemptEnd:
        if peer_reason is None:
            return self.node.with_unseen_restore(attempt, end, events)
        if self.node.peer_end.get("outcome") == Outcome.COMPLETED.value and end.outcome is Outcome.COMPLETED:
            return end
        return self.node.peer_ended(end, peer_reason)

    def turn(self, after: int, now: float) -> Turn:
        node = self.node
        view = node.look(now, force=True) or node.view
        if view.job_end_at is not None and view.job_end_at >= self._start_index:
            return Turn(status=view.job_end_status if view.job_end_status is not None else EXIT_FAILED)
        attempt = peers.open_attempt(view, after=after)
        if attempt is not None:
            say(f"node {node.role.node_rank}: joining attempt {attempt} (port {view.ports[attempt]})")
            self._waiting_since, self._joined = None, True
            return Turn(attempt=attempt)
        if self._waiting_since is None:
            self._waiting_since, self._waiting = now, Progress(now, after_s=10.0, every_s=30.0)
            what = "node 0's next attempt or the job's end" if self._joined else "node 0 to open an attempt"
            say(f"node {node.role.node_rank}: waiting for {what}")
        waited = now - self._waiting_since
        if self._waiting is not None and self._waiting.due(now):
            say(f"node {node.role.node_rank}: still waiting for node 0 ({waited:.0f} s)")
        if waited > node.config.follower_wait_s and (
            view.last_beat.get(0) is None or self._leader_lost(view, now)
        ):
            say(f"no attempt from node 0's supervisor for {waited:.0f} s; giving up")
            return Turn(status=EXIT_FAILED)
        node.beat(max(after, 0), now)
        return Turn(wait_s=node.poll_s)

    def close(self, status: int, *, last_attempt: int) -> None:
        self.node.mark(peers.NODE_END, attempt=max(last_attempt, 0), exit_status=status)
