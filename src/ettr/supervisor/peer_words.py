"""What a node's supervisor says of its peers in an attempt's reason (pure: no I/O, no clock): the ranks of
other nodes in a hang (only each node's supervisor can read its own ranks' state, and says it in its
node_attempt_end), a checkpoint another node's rank restored that this node cannot see, and the peers a
failed part waits to hear from."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ettr.events import Event, EventKind
from ettr.supervisor.peers import PeerView


def peers_hung_ranks(view: PeerView, attempt: int, peers: Sequence[int]) -> str:
    """What the ranks of each of `peers` that joined `attempt` were doing when their node found it hung
    (`node R: rank 1 (pid P) quiet 20.7 s, ..., stopped (SIGSTOP or SIGTSTP)`), as their node_attempt_end
    said; a node that said nothing of them is named as unknown. "" when no peer joined the attempt."""
    said = []
    for node in peers:
        if (attempt, node) not in view.node_joined:
            continue
        data = view.node_ends.get((attempt, node)) or {}
        ranks = data.get("hung_ranks")
        if isinstance(ranks, str) and ranks:
            said.append(f"node {node}: {ranks[:2000]}")
        elif data:
            said.append(f"node {node}: its ranks unknown (its part ended {data.get('outcome')})")
        else:
            said.append(f"node {node}: its ranks unknown (its part has not ended)")
    return "; ".join(said)


def quiet_peers(view: PeerView, nodes: Sequence[int], now: float, timeout_s: float) -> str:
    """Why a node whose ranks failed on a broken connection has not ended the attempt yet: it waits for
    `nodes` (neither ended their part nor heard since the failure) to end it, or to be silent for
    `timeout_s` (`--peer-timeout`) and so lost: `this node's ranks failed on a broken connection; waiting
    for node 1 (supervisor last heard 3 s ago) to end its part, or to be found lost after 60 s of silence`."""
    heard = []
    for n in nodes:
        beat = view.last_beat.get(n)
        when = "never heard" if beat is None else f"supervisor last heard {max(0.0, now - beat):.0f} s ago"
        heard.append(f"node {n} ({when})")
    return (
        f"this node's ranks failed on a broken connection; waiting for {', '.join(heard)} to end its part, "
        f"or to be found lost after {timeout_s:g} s of silence (--peer-timeout)"
    )


def unseen_restore(
    events: Sequence[Event], own: Sequence[Event], exists: Callable[[str], bool], node_rank: int
) -> str | None:
    """Why this node's ranks may have trained from another start than the others' in an attempt whose
    `events` are these (`own`: this node's ranks' only): another node's rank restored a checkpoint file that
    this node cannot see (`exists`), and no rank of this node restored anything. None otherwise. Only
    absolute paths are looked at (a relative one is the training process's cwd's, not the supervisor's)."""

    def restores(evs: Sequence[Event]) -> list[Event]:
        return [e for e in evs if e.rank >= 0 and e.kind is EventKind.PHASE_END and e.phase == "restore"]

    mine = restores(own)
    if mine:
        return None
    ids = {id(e) for e in own}
    for e in restores(events):
        path = (e.data or {}).get("path")
        if id(e) in ids or not isinstance(path, str) or not path.startswith("/"):
            continue
        try:
            seen = exists(path)
        except (OSError, ValueError):
            continue
        if not seen:
            at = f" (step {e.step})" if isinstance(e.step, int) else ""
            return (
                f"node {node_rank} cannot see {path!r}, the checkpoint rank {e.rank} restored{at}, and no rank "
                "of this node restored one: is the checkpoint directory on a file system every node shares?"
            )
    return None
