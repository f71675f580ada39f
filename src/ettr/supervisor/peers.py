"""What the supervisors of a multi-node job tell each other through the ledger (pure: no I/O, no clock).

A torchrun job with `--nnodes N` (N > 1) runs one `ettr run` per node, all on one ledger URL and job id.
Node rank 0's supervisor is the job's *leader*: it alone writes the contract's supervisor events
(SUPERVISOR_START, ATTEMPT_START/END, JOB_END), so the books read like a one-supervisor job whose ranks
happen to live on several hosts. Every supervisor, the leader included, writes node marks (kind MARK,
rank -1, `data.name` below, `data.node_rank`):

    node_start          pid, pid_start_ticks, host, nnodes        (a supervisor of that node began)
    node_heartbeat      every `heartbeat interval` while it lives  (peers detect a SIGKILLed supervisor)
    rendezvous          port: the rendezvous port of that attempt  (leader only, before its ATTEMPT_START)
    node_attempt_start  pid, command                               (that node launched its part)
    node_attempt_end    outcome, exit_code, reason, ...            (that node's part ended)
    node_end            exit_status                                (that supervisor ended)

The accounting files rank -1 marks under their attempt and never places them, so they do not change a
report's buckets (`ettr.accounting.attempts.gather`).

`Peers` is the seam a supervisor sees its peers through (handed in, never subclassed): `NoPeers` for a job on
one node, `ettr.supervisor.multinode`'s leader and followers for several.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ettr.events import SUPERVISOR_RANK, Event, EventKind, Outcome

if TYPE_CHECKING:
    from ettr.supervisor.books import JobBooks
    from ettr.supervisor.classify import AttemptEnd
    from ettr.supervisor.signals import SupervisorSignals

NODE_START = "node_start"
NODE_HEARTBEAT = "node_heartbeat"
RENDEZVOUS = "rendezvous"
NODE_ATTEMPT_START = "node_attempt_start"
NODE_ATTEMPT_END = "node_attempt_end"
NODE_END = "node_end"
NODE_MARKS = frozenset(
    {NODE_START, NODE_HEARTBEAT, RENDEZVOUS, NODE_ATTEMPT_START, NODE_ATTEMPT_END, NODE_END}
)


@dataclass(frozen=True, kw_only=True)
class NodeRole:
    """Where this supervisor sits in a multi-node job."""

    node_rank: int
    nnodes: int

    def __post_init__(self) -> None:
        if self.nnodes < 2:
            raise ValueError(f"a multi-node job has at least 2 nodes, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} is not in 0..{self.nnodes - 1}")

    @property
    def leader(self) -> bool:
        """Node rank 0 leads: it picks each attempt's rendezvous port and keeps the job's books."""
        return self.node_rank == 0

    @property
    def peers(self) -> tuple[int, ...]:
        """The other nodes' ranks."""
        return tuple(r for r in range(self.nnodes) if r != self.node_rank)


def node_role(options: Sequence[tuple[str, str | None]]) -> NodeRole | None:
    """The role named by torchrun's options ((name, value) pairs), or None for a one-node job.

    `--nnodes N` or `N:N`; an elastic range (`1:4`) is refused: the attempts of an elastic job cannot be
    job-wide when the set of nodes changes. `--node-rank` defaults to 0, as in torchrun.
    """
    values = {name.replace("_", "-"): value for name, value in options}
    nnodes_text = values.get("--nnodes") or "1"
    low, _, high = nnodes_text.partition(":")
    try:
        nnodes = int(low)
        if high and int(high) != nnodes:
            raise ValueError(f"elastic --nnodes {nnodes_text} is not supported with ettr (give one number)")
        node_rank = int(values.get("--node-rank") or "0")
    except ValueError as exc:
        if "elastic" in str(exc):
            raise
        raise ValueError(f"--nnodes {nnodes_text!r} / --node-rank must be integers") from None
    if nnodes <= 1:
        return None
    return NodeRole(node_rank=node_rank, nnodes=nnodes)


def node_mark(name: str, *, node_rank: int, attempt: int, ts: float, **data: Any) -> Event:
    """A node mark (see the module docstring)."""
    return Event(
        EventKind.MARK, ts, attempt, SUPERVISOR_RANK, data={"name": name, "node_rank": node_rank, **data}
    )


def _mark(event: Event) -> tuple[str, int] | None:
    if event.kind is not EventKind.MARK or event.rank != SUPERVISOR_RANK or not event.data:
        return None
    name, node = event.data.get("name"), event.data.get("node_rank")
    if name not in NODE_MARKS or not isinstance(node, int):
        return None
    return str(name), node


@dataclass(frozen=True, kw_only=True)
class PeerView:
    """What the ledger says about the job's nodes and attempts, as of one read."""

    ports: Mapping[int, int] = field(default_factory=dict)
    """attempt -> its rendezvous port (the latest published)."""
    ended: Mapping[int, Event] = field(default_factory=dict)
    """attempt -> the leader's ATTEMPT_END."""
    node_ends: Mapping[tuple[int, int], Mapping[str, Any]] = field(default_factory=dict)
    """(attempt, node) -> that node's node_attempt_end data."""
    node_joined: Mapping[tuple[int, int], int] = field(default_factory=dict)
    """(attempt, node) -> pid of the supervisor that launched that node's part."""
    last_beat: Mapping[int, float] = field(default_factory=dict)
    """node -> time of its supervisor's latest sign of life."""
    job_end_at: int | None = None
    """Index (in the events read) of the latest JOB_END."""
    job_end_status: int | None = None
    """Its exit status."""


def _int_in(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def peer_view(events: Sequence[Event]) -> PeerView:
    """Read the node marks and the leader's attempt ends out of a job's events (in append order). A
    rendezvous port outside 1..65535 (or `true`) is no port, and a JOB_END status outside 0..255 is unknown
    (the followers then exit 1): the ledger is shared, and a damaged or forged row made a follower launch
    `--rdzv-endpoint HOST:True`, or exit 0 with status 256 (`sys.exit` keeps the low byte)."""
    ports: dict[int, int] = {}
    ended: dict[int, Event] = {}
    node_ends: dict[tuple[int, int], Mapping[str, Any]] = {}
    joined: dict[tuple[int, int], int] = {}
    beats: dict[int, float] = {}
    job_end_at: int | None = None
    status: int | None = None
    for index, e in enumerate(events):
        if e.rank != SUPERVISOR_RANK:
            continue
        if e.kind is EventKind.ATTEMPT_END:
            ended.setdefault(e.attempt, e)
            continue
        if e.kind is EventKind.JOB_END:
            job_end_at = index
            raw = (e.data or {}).get("exit_status")
            status = raw if _int_in(raw, 0, 255) else None
            continue
        mark = _mark(e)
        if mark is None:
            continue
        name, node = mark
        data = e.data or {}
        beats[node] = max(beats.get(node, e.ts), e.ts)
        if name == RENDEZVOUS and _int_in(data.get("port"), 1, 65535):
            ports[e.attempt] = int(data["port"])
        elif name == NODE_ATTEMPT_START:
            pid = data.get("supervisor_pid")
            joined[(e.attempt, node)] = pid if isinstance(pid, int) else -1
        elif name == NODE_ATTEMPT_END:
            node_ends.setdefault((e.attempt, node), data)
    return PeerView(
        ports=ports,
        ended=ended,
        node_ends=node_ends,
        node_joined=joined,
        last_beat=beats,
        job_end_at=job_end_at,
        job_end_status=status,
    )


def lost_peers(
    view: PeerView, peers: Sequence[int], *, since: float, now: float, timeout_s: float
) -> list[int]:
    """Peers whose supervisor was alive at or after `since` (an attempt's start) and has been silent for
    more than `timeout_s`. A peer silent since before `since` is not lost *in this attempt*: the attempt's
    rendezvous waits for it (torchrun's own rendezvous timeout ends that wait)."""
    lost = []
    for node in peers:
        beat = view.last_beat.get(node)
        if beat is not None and beat >= since and now - beat > timeout_s:
            lost.append(node)
    return lost


def failed_peer(view: PeerView, attempt: int, peers: Sequence[int]) -> tuple[int, Mapping[str, Any]] | None:
    """The first peer whose part of `attempt` ended other than completed, with its node_attempt_end data."""
    for node in peers:
        data = view.node_ends.get((attempt, node))
        if data is not None and data.get("outcome") != Outcome.COMPLETED.value:
            return node, data
    return None


def open_attempt(view: PeerView, *, after: int) -> int | None:
    """The newest attempt > `after` with a published rendezvous and no ATTEMPT_END (one to join)."""
    open_ = [a for a in view.ports if a > after and a not in view.ended]
    return max(open_) if open_ else None


def absent(view: PeerView, attempt: int, nodes: Sequence[int], *, now: float) -> str | None:
    """What `attempt`'s rendezvous waits for, of `nodes`: those that have not launched their part of it
    (node 0 launches after publishing its port), each with when its supervisor was last heard; None when
    all have (the wait is the start-up's own)."""
    missing = [n for n in nodes if (attempt, n) not in view.node_joined and (n or attempt not in view.ports)]
    if not missing:
        return None
    said = [
        f"node {n}'s supervisor never started" if n not in view.last_beat
        else f"node {n}'s supervisor last heard {now - view.last_beat[n]:.0f} s ago"
        for n in missing
    ]  # fmt: skip
    return (
        f"torchrun's rendezvous waits for node(s) {', '.join(map(str, missing))} to join: {'; '.join(said)}"
    )


def live_node_supervisor(events: Sequence[Event], node_rank: int) -> Mapping[str, Any] | None:
    """The node_start data of the latest supervisor of `node_rank` that has not written node_end."""
    current: Mapping[str, Any] | None = None
    for e in events:
        mark = _mark(e)
        if mark is None or mark[1] != node_rank:
            continue
        if mark[0] == NODE_START:
            current = e.data or {}
        elif mark[0] == NODE_END:
            current = None
    return current


def another_size(events: Sequence[Event], role: NodeRole, *, now: float, timeout_s: float) -> str | None:
    """Why `role` cannot join: a live supervisor of another node of this job (heard within `timeout_s` of
    `now`) was started with another `--nnodes` (None: none was). Such nodes never meet: torchrun's c10d
    rendezvous waits for the node count each agent was given, silently, until its join timeout (600 s by
    default), then the next attempt does the same."""
    starts: dict[int, Mapping[str, Any]] = {}
    beats: dict[int, float] = {}
    for e in events:
        mark = _mark(e)
        if mark is None or mark[1] == role.node_rank:
            continue
        name, node = mark
        beats[node] = max(beats.get(node, e.ts), e.ts)
        if name == NODE_START:
            starts[node] = e.data or {}
        elif name == NODE_END:
            starts.pop(node, None)
    for node, data in sorted(starts.items()):
        nnodes = data.get("nnodes")
        if isinstance(nnodes, int) and nnodes != role.nnodes and now - beats[node] <= timeout_s:
            return (
                f"node {node} of this job runs with --nnodes {nnodes} (supervisor pid {data.get('pid')} on "
                f"{data.get('host')}), this node with --nnodes {role.nnodes}: give every node the same --nnodes"
            )
    return None


@dataclass(frozen=True, kw_only=True)
class Turn:
    """What a node that does not lead does next: join `attempt`, end with the job's `status`, or wait."""

    attempt: int | None = None
    status: int | None = None
    wait_s: float = 0.0


class Peers(Protocol):
    """The other supervisors of this job, as this node's supervisor sees them."""

    leads: bool
    """Whether this node decides the job's attempts and keeps its books (one node, or node 0)."""
    node_rank: int
    """This node's rank in the job (0 on one node)."""

    def open(self, books: JobBooks) -> int:
        """Open (or join) the job's books as this node's role requires; the first attempt this node runs."""
        ...

    def rendezvous_port(self, attempt: int) -> int | None:
        """The rendezvous port of `attempt` agreed with the peers (None: pick one locally)."""
        ...

    def check(self, attempt: int, now: float, started: float) -> str | None:
        """Why a peer ends this attempt (None: carry on); asked every poll while the attempt runs."""
        ...

    def absent(self, attempt: int) -> str | None:
        """What other nodes `attempt`'s start waits for (`absent`), as last seen; None: none."""
        ...

    def own_events(self, events: Sequence[Event]) -> list[Event]:
        """The training processes' `events` of an attempt that this node's part classifies by (another
        node's ranks' exceptions are not its part's)."""
        ...

    def settle(
        self,
        attempt: int,
        end: AttemptEnd,
        peer_reason: str | None,
        signals: SupervisorSignals,
        events: Sequence[Event] | None = None,
    ) -> AttemptEnd:
        """The attempt's end once the peers' parts are known (`events`: the attempt's, as read; None: read
        them where needed)."""
        ...

    def turn(self, after: int, now: float) -> Turn:
        """For a node that does not lead: what to do after attempt `after` (a leading node opens
        `after + 1` itself)."""
        ...

    def close(self, status: int, *, last_attempt: int) -> None:
        """This node's supervisor ends with `status`, the latest attempt it ran being `last_attempt` (-1: none);
        before its books close."""
        ...


class NoPeers:
    """A job on one node: nobody else to ask."""

    leads = True
    node_rank = 0

    def open(self, books: JobBooks) -> int:
        return books.open()

    def rendezvous_port(self, attempt: int) -> int | None:
        return None

    def check(self, attempt: int, now: float, started: float) -> str | None:
        return None

    def absent(self, attempt: int) -> str | None:
        return None

    def own_events(self, events: Sequence[Event]) -> list[Event]:
        return list(events)  # one supervisor's ranks, on whichever hosts (srun, pdsh)

    def settle(
        self,
        attempt: int,
        end: AttemptEnd,
        peer_reason: str | None,
        signals: SupervisorSignals,
        events: Sequence[Event] | None = None,
    ) -> AttemptEnd:
        return end

    def turn(self, after: int, now: float) -> Turn:
        return Turn(attempt=after + 1)

    def close(self, status: int, *, last_attempt: int) -> None:
        pass
