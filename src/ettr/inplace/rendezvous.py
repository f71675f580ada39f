"""Joining one generation of a resilient job, and leaving it.

`join` waits on the job's store until every rank has joined generation g (each adds itself to a counter
under the generation's own prefix), then makes the default process group over `PrefixStore("ettr/inplace/
<g>/pg/")` — fresh keys, so nothing of an earlier generation is read. A generation that moves on while a
rank waits (another failure meanwhile) is left for the newer one. `leave` tears a generation down so that
its peers notice at once: every process group is destroyed (`destroy_process_group`: the default and all
made from it, the checkpoint manager's included) and the objects that held them are collected, which closes
their connections; a peer blocked in a gloo collective with this rank then fails within milliseconds.
NCCL's communicators are aborted first.
"""

from __future__ import annotations

import datetime
import gc
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ettr import torch_compat
from ettr.inplace import libraries

logger = logging.getLogger("ettr")

_POLL_S = 0.002


class RendezvousTimeout(RuntimeError):
    """Not every rank joined the generation in time."""


class GenerationMovedOn(RuntimeError):
    """A newer generation began while this one was forming."""


@dataclass(frozen=True, kw_only=True)
class Joined:
    """Timings of one `join`, for the books."""

    wait_s: float
    """Waiting for every rank to join (a replacement's start-up shows here)."""
    init_s: float
    """Making the process group once all had joined."""


def generation_store(store: dist.Store, generation: int) -> dist.Store:
    """The keys of generation `generation` (the user's own rendezvous may use them too)."""
    return dist.PrefixStore(f"ettr/inplace/{generation}/", store)


def join(
    store: dist.Store,
    generation: int,
    *,
    rank: int,
    world_size: int,
    backend: str,
    timeout_s: float,
    collective_timeout_s: float,
    moved_on: Callable[[int], bool],
) -> Joined:
    """Join generation `generation` and make its default process group. Raises RendezvousTimeout,
    GenerationMovedOn."""
    begin = time.monotonic()
    keys = generation_store(store, generation)
    keys.add("joined", 1)
    deadline = begin + timeout_s
    while int(keys.add("joined", 0)) < world_size:
        if moved_on(generation):
            raise GenerationMovedOn(f"generation {generation} was overtaken while it formed")
        if time.monotonic() > deadline:
            raise RendezvousTimeout(
                f"generation {generation}: {int(keys.add('joined', 0))} of {world_size} ranks joined in "
                f"{timeout_s:g} s"
            )
        time.sleep(_POLL_S)
    joined = time.monotonic()
    # Forming the group waits for every peer to connect: bounded like the rest of the rendezvous, so that a
    # rank killed while the group forms leaves its peers waiting `timeout_s` (then they give up), not the
    # collective timeout (gloo's connect waits up to 5 x the group's timeout). Collectives then get theirs.
    form_s = min(timeout_s, collective_timeout_s)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("pg/", keys),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=form_s),
    )
    if form_s != collective_timeout_s and not torch_compat.set_group_timeout(collective_timeout_s):
        logger.debug("ettr: this torch cannot set a group's timeout; collectives time out at %g s", form_s)
    return Joined(wait_s=joined - begin, init_s=time.monotonic() - joined)


def leave(backend: str) -> tuple[float, bool]:
    """Tear down this generation's process groups (see the module docstring). Returns the seconds it took
    and whether the default group was released (False: something still holds it, so its connections stay
    open and a peer blocked on this rank would wait for the collective timeout). Never raises."""
    begin = time.monotonic()
    default = torch_compat.default_group()
    try:
        if dist.is_initialized():
            if backend == "nccl":
                _abort_nccl()
            dist.destroy_process_group()
    except Exception as exc:  # a group already broken by the failure
        logger.debug("ettr: tearing down the process groups: %s", exc)
    libraries.forget()  # what libraries cached of this generation (TorchRec's groups and its one-time broadcast)
    gc.collect()  # process groups held by the failed generation's objects (DDP's reducer): their sockets close
    released = default is None or sys.getrefcount(default) <= 2  # `default` and getrefcount's own argument
    del default
    return time.monotonic() - begin, released


def _abort_nccl() -> None:
    """NCCL does not fail a collective whose peer died: abort the communicators so that nothing waits."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None or not torch.cuda.is_available():
        return
    try:
        abort()
    except Exception as exc:
        logger.debug("ettr: aborting NCCL: %s", exc)
