"""Peer copies: each rank's memory copy also held by `replicas` ranks on other nodes, so that a replacement
node — whose shared memory died with the node it replaces — restores from its peers instead of storage.

Ranks are placed on nodes as torchrun places them: `LOCAL_WORLD_SIZE` consecutive ranks per node. Rank r's
copy is held by ranks r + k * LOCAL_WORLD_SIZE (mod the world size), k = 1..replicas: the same local rank on
the next nodes. After each commit every rank sends its snapshot to its holders and receives those it holds
(`replicate`, collective, over the checkpoint's own gloo group, in the persist's thread); a rank that has no
copy of its own this time sends nothing (a zero size), and its holders drop what they held for it (it is
stale). At a restore (`fetch`), ranks that lack their own copy get it from a holder that has one bound to the
same commit; a copy that arrives is checked like one read from shared memory. Memory: each holder keeps
`replicas` more copies (of the same size as its own, for the same local rank), and each commit sends
`replicas` copies of every rank's state over the network.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ettr.checkpoint.memory import MemoryCopies
from ettr.checkpoint.snapshot import Binding, Snapshot, parse_bytes

logger = logging.getLogger("ettr")


@dataclass(frozen=True, kw_only=True)
class PeerPlan:
    """Who holds whose copy (see the module docstring)."""

    rank: int
    world_size: int
    ranks_per_node: int
    replicas: int

    @classmethod
    def from_environ(
        cls, rank: int, world_size: int, replicas: int, environ: Mapping[str, str] | None = None
    ) -> PeerPlan | None:
        """The plan of a job of several nodes (None: one node, or no replicas)."""
        env = os.environ if environ is None else environ
        try:
            per_node = int(env.get("LOCAL_WORLD_SIZE", ""))
        except ValueError:
            return None
        if replicas < 1 or per_node < 1 or world_size <= per_node or world_size % per_node:
            return None
        return cls(rank=rank, world_size=world_size, ranks_per_node=per_node, replicas=replicas)

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def holders_of(self, rank: int) -> list[int]:
        """The ranks on other nodes that hold `rank`'s copy."""
        count = min(self.replicas, self.num_nodes - 1)
        return [(rank + k * self.ranks_per_node) % self.world_size for k in range(1, count + 1)]

    def held_here(self) -> list[int]:
        """The ranks whose copies this rank holds."""
        return [r for r in range(self.world_size) if self.rank in self.holders_of(r)]


def replicate(
    plan: PeerPlan, copies: MemoryCopies, binding: Binding | None, group: dist.ProcessGroup | None
) -> None:
    """Send this rank's copy (of `binding`; None: it has none) to its holders and keep the copies this rank
    holds. Collective: every rank calls it after every commit. Raises what the group raises."""
    own: Snapshot | None = None
    if binding is not None:
        found = copies.find(binding)
        own = found.snapshot
    try:
        payload = _as_tensor(own)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        works = [dist.isend(size, dst, group=group) for dst in plan.holders_of(plan.rank)]
        sources = plan.held_here()
        sizes = {src: torch.zeros(1, dtype=torch.int64) for src in sources}
        works += [dist.irecv(sizes[src], src, group=group) for src in sources]
        _wait(works)
        works = [
            dist.isend(payload, dst, group=group) for dst in plan.holders_of(plan.rank) if payload.numel()
        ]
        received = {
            src: torch.empty(int(sizes[src]), dtype=torch.uint8) for src in sources if int(sizes[src])
        }
        works += [dist.irecv(buffer, src, group=group) for src, buffer in received.items()]
        _wait(works)
    finally:
        works = []
        if own is not None:
            del payload
            own.close()
    for src in sources:
        if src in received:
            copies.keep_held(src, _bytes_of(received[src]))
        else:
            copies.discard(copies.held_path(src))


def fetch(
    plan: PeerPlan, copies: MemoryCopies, binding: Binding, have_own: bool, group: dist.ProcessGroup | None
) -> Snapshot | None:
    """Collective, at a restore: every rank that lacks its own copy of `binding` gets it from a holder that has
    it. Returns the copy this rank received (checked: header, rank, binding; the payload is checked by its
    `load`), or None (it had its own, or nobody held it)."""
    held = {src: copies.find(binding, rank=src).snapshot for src in plan.held_here()}
    try:
        state = {"own": have_own, "held": sorted(src for src, snap in held.items() if snap is not None)}
        everyone: list[dict[str, object]] = [{} for _ in range(plan.world_size)]
        dist.all_gather_object(everyone, state, group=group)
        transfers = _transfers(plan, everyone)  # (holder, needy) pairs, the same on every rank
        works = []
        sizes: dict[int, torch.Tensor] = {}
        payloads: dict[int, torch.Tensor] = {}
        for holder, needy in transfers:
            if holder == plan.rank:
                payloads[needy] = _as_tensor(held[needy])
                works.append(dist.isend(torch.tensor([payloads[needy].numel()]), needy, group=group))
            elif needy == plan.rank:
                sizes[holder] = torch.zeros(1, dtype=torch.int64)
                works.append(dist.irecv(sizes[holder], holder, group=group))
        _wait(works)
        works = [
            dist.isend(payloads[needy], needy, group=group)
            for holder, needy in transfers
            if holder == plan.rank
        ]
        buffers = {holder: torch.empty(int(size), dtype=torch.uint8) for holder, size in sizes.items()}
        works += [dist.irecv(buffer, holder, group=group) for holder, buffer in buffers.items()]
        _wait(works)
        payloads.clear()
    finally:
        for snap in held.values():
            if snap is not None:
                snap.close()
    if not buffers:
        return None
    ((holder, buffer),) = buffers.items()
    try:
        snap = parse_bytes(_bytes_of(buffer))
    except Exception as exc:
        logger.warning("ettr: the copy rank %d sent is unusable (%s)", holder, exc)
        return None
    info = snap.info
    if info.rank != plan.rank or info.binding != binding:
        logger.warning("ettr: rank %d sent a copy of another rank or commit; not used", holder)
        snap.close()
        return None
    return snap


def _transfers(plan: PeerPlan, everyone: list[dict[str, object]]) -> list[tuple[int, int]]:
    """For each rank without its own copy, the first holder that holds it: (holder, needy)."""
    pairs = []
    for needy, state in enumerate(everyone):
        if state.get("own"):
            continue
        for holder in plan.holders_of(needy):
            held = everyone[holder].get("held")
            if isinstance(held, list) and needy in held:
                pairs.append((holder, needy))
                break
    return pairs


def _wait(works: list[Any]) -> None:
    for work in works:
        if work is not None:
            work.wait()


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A received uint8 tensor's bytes, writable, without a copy."""
    return memoryview(tensor.numpy())  # type: ignore[arg-type]


def _as_tensor(snap: Snapshot | None) -> torch.Tensor:
    """A snapshot's bytes as a uint8 tensor (a view of the mapped file; empty for none)."""
    if snap is None:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(snap.raw(), dtype=torch.uint8)
