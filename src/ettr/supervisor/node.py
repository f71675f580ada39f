"""What the leader and the followers of a multi-node job share (`ettr.supervisor.multinode`): this node's
marks and heartbeats in the ledger, a cached view of its peers, and the end of this node's part as its
peers' ends make it."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ettr.errors import UsageError
from ettr.events import Event, Outcome
from ettr.procs import start_ticks
from ettr.supervisor import peer_words, peers
from ettr.supervisor.books import JobBooks
from ettr.supervisor.classify import AttemptEnd, consequence_of_a_peer, this_nodes_events
from ettr.supervisor.config import RunConfig
from ettr.supervisor.messages import say
from ettr.supervisor.peers import NodeRole, PeerView

_PEER_OUTCOMES = {Outcome.HUNG.value: Outcome.HUNG, Outcome.PREEMPTED.value: Outcome.PREEMPTED}
"""A peer's part's outcome -> this node's part's, when the peer's end ended it (any other: failed)."""


class Node:
    """What the leader and the followers share: node marks, heartbeats, a cached view of the peers."""

    def __init__(self, config: RunConfig, role: NodeRole) -> None:
        self.config = config
        self.role = role
        self.interval_s = min(10.0, max(0.2, config.peer_timeout_s / 4))
        # Waits between attempts (the next rendezvous, the peers' ends) are the whole job's restart or
        # shutdown: they look every second, not per heartbeat (10 s by default: up to 10 s per restart).
        self.poll_s = min(1.0, self.interval_s)
        self.view = PeerView()
        self.peer_end: dict[str, Any] = {}  # the data of the peer's end that ended this node's part
        self._books: JobBooks | None = None
        self._beat_at = 0.0
        self._looked_at = 0.0

    @property
    def books(self) -> JobBooks:
        if self._books is None:
            raise RuntimeError("the peers are asked before the books are open")
        return self._books

    def attach(self, books: JobBooks) -> None:
        self._books = books

    def mark(self, name: str, *, attempt: int, **data: Any) -> None:
        self.books.mark(name, attempt=attempt, node_rank=self.role.node_rank, **data)

    def beat(self, attempt: int, now: float) -> None:
        if now - self._beat_at >= self.interval_s:
            self._beat_at = now
            self.mark(peers.NODE_HEARTBEAT, attempt=attempt)

    def look(self, now: float, *, force: bool = False) -> PeerView | None:
        """A fresh view every heartbeat interval (None between looks)."""
        if not force and now - self._looked_at < self.interval_s:
            return None
        self._looked_at = now
        try:
            self.view = peers.peer_view(self.books.supervisor_events())
        except Exception as exc:
            say(f"cannot read the ledger to see the peers ({exc}); trying again")
            return None
        return self.view

    def mark_start(self, attempt: int) -> None:
        self.mark(
            peers.NODE_START,
            attempt=attempt,
            pid=os.getpid(),
            pid_start_ticks=start_ticks(os.getpid()),
            host=socket.gethostname(),
            nnodes=self.role.nnodes,
        )

    def refuse_another_size(self, events: Sequence[Event]) -> None:
        """UsageError when a live supervisor of another node of this job was given another `--nnodes`."""
        timeout_s = self.config.peer_timeout_s
        if why := peers.another_size(events, self.role, now=time.time(), timeout_s=timeout_s):
            raise UsageError(f"ettr run: {why}")

    def own_events(self, events: Sequence[Event]) -> list[Event]:
        return this_nodes_events(events, host=socket.gethostname(), supervisor_pid=os.getpid())

    def absent(self, attempt: int) -> str | None:
        view = self.look(now := time.time(), force=True) or self.view  # once per start-up line: fresh
        return peers.absent(view, attempt, self.role.peers, now=now)

    def with_unseen_restore(
        self, attempt: int, end: AttemptEnd, events: Sequence[Event] | None
    ) -> AttemptEnd:
        """`end` of this node's failed part, with `peer_words.unseen_restore`'s words where they apply (one node's
        checkpoint directory on another path, or node-local: its ranks started from scratch beside ranks
        that resumed, and the attempt read only as a broken connection)."""
        if end.outcome is Outcome.COMPLETED:
            return end
        if events is None:
            try:
                events = self.books.attempt_events(attempt)
            except Exception:  # the books are read for words only
                return end
        why = peer_words.unseen_restore(events, self.own_events(events), os.path.exists, self.role.node_rank)
        return replace(end, reason=f"{end.reason}; {why}") if why else end

    def peer_ended(self, end: AttemptEnd, reason: str) -> AttemptEnd:
        """`end` of this node's part, ended because of the peer whose end is `peer_end`."""
        data = self.peer_end
        # A peer's part preempted (its supervisor SIGTERMed by the scheduler) is the job's preemption: not
        # counted against the restarts, as a preemption of the job's processes on one node is not.
        outcome = _PEER_OUTCOMES.get(str(data.get("outcome")), Outcome.FAILED)
        exit_code = data.get("exit_code")
        tail, broken = data.get("stderr_tail"), consequence_of_a_peer(end)
        own_message = None if broken else end.message
        return replace(
            end,
            outcome=outcome,
            exit_code=exit_code if isinstance(exit_code, int) else end.exit_code,
            reason=reason,
            signal=data.get("signal") if isinstance(data.get("signal"), str) else end.signal,
            # The peer's exception and words, never this node's beside them; nor this node's broken
            # connection (the consequence) where the peer recorded none (its torchrun SIGKILLed).
            exception=data.get("exception") or (None if broken else end.exception),
            message=data.get("message") if data.get("exception") else data.get("message") or own_message,
            stderr_tail=tuple(map(str, tail[-20:])) if isinstance(tail, list) and tail else end.stderr_tail,
        )
