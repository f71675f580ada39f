"""Joining one generation of a resilient job, and leaving it.

`join` waits on the job's store until every rank has joined generation g (each adds itself to a counter
under the generation's own prefix), then makes the default process group over `PrefixStore("ettr/inplace/
<g>/pg/")` — fresh keys, so nothing of an earlier generation is read. A generation that moves on while a
rank waits (another failure meanwhile) is left for the newer one. `leave` tears a generation down so that
its peers notice at once: every process group is destroyed (`destroy_process_group`: the default and all
made from it, the checkpoint manager's included) and the objects that held them are collected, which closes
their connections; a peer blocked in a gloo collective with this rank then fails within milliseconds.
NCCL's communicators are aborted first. Once every rank has returned from the generation nobody can be
blocked on this rank, and the collection is left out (`leave(collect=False)`).
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ettr import procs, torch_compat
from ettr.bootstrap.group_teardown import release
from ettr.inplace import libraries
from ettr.inplace.store import ABANDONED_KEY
from ettr.untrusted import printable, whole_number

logger = logging.getLogger("ettr")

_POLL_S = 0.002
_ABANDONED_POLL_S = 0.05


class RendezvousTimeout(RuntimeError):
    """Not every rank joined the generation in time."""


class RendezvousAbandoned(RendezvousTimeout):
    """The job's store could not be handed over to every rank (`ettr.inplace.store`): no generation forms."""


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
    looked = 0.0
    while int(keys.add("joined", 0)) < world_size:
        if moved_on(generation):
            raise GenerationMovedOn(f"generation {generation} was overtaken while it formed")
        if time.monotonic() - looked > _ABANDONED_POLL_S:  # a rank whose store hand-over failed never joins
            looked = time.monotonic()
            if store.check([ABANDONED_KEY]):
                why = store.get(ABANDONED_KEY).decode("utf-8", "replace")[:300]
                raise RendezvousAbandoned(f"generation {generation} cannot form: {printable(why)}")
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


def announce(keys: dist.Store, rank: int) -> None:
    """Say in this generation's keys (`generation_store`) which process is `rank`: `dead_peer` on another
    rank of the same host looks it up. Never raises (the look is then not made)."""
    space = procs.pid_space()
    if space is not None:
        try:
            keys.set(f"proc/{rank}", f"{space} {os.getpid()} {procs.start_ticks(os.getpid())}")
        except Exception as exc:  # a store gone with a failure: the generation fails on its own
            logger.debug("ettr: announcing rank %d: %s", rank, exc)


def returned(keys: dist.Store, rank: int) -> None:
    """Say that `rank`'s `train` returned in this generation (`dead_peer` no longer looks at it)."""
    keys.set(f"done/{rank}", "1")


def dead_peer(keys: dist.Store, rank: int, world_size: int) -> int | None:
    """A rank of this generation, other than `rank`, whose `train` has not returned and whose process is gone:
    it `announce`d a process of this host and PID namespace that no longer runs. None where none is known
    dead (a rank on another host or in another container is never judged; nor one whose words do not parse:
    they come from the job's store)."""
    space = procs.pid_space()
    if space is None:
        return None
    for peer in range(world_size):
        if peer == rank or keys.check([f"done/{peer}"]) or not keys.check([f"proc/{peer}"]):
            continue
        words = keys.get(f"proc/{peer}").decode("utf-8", "replace").split(" ")
        if len(words) != 4 or f"{words[0]} {words[1]}" != space:
            continue
        pid, ticks = whole_number(words[2]), whole_number(words[3])
        if pid is not None and not procs.running(pid, ticks):
            return peer
    return None


def leave(
    backend: str, *, release_wait_s: float = 0.0, exiting: bool = False, collect: bool = True
) -> tuple[float, bool]:
    """Tear down this generation's process groups (see the module docstring). Returns the seconds it took
    and whether the default group was released (False: something still holds it, so its connections stay
    open and a peer blocked on this rank would wait for the collective timeout; what holds it is logged).
    A group still held is looked at again for up to `release_wait_s`, for a background thread of the
    failed generation to end. `exiting`: the process leaves for good (`train` returned, or a SystemExit
    such as a preemption's 143 passes through, its traceback still holding the frames that hold the group):
    nobody waits on this rank's connections, so what holds the group is said at debug level only.
    `collect=False`: every rank has returned from the generation (`_Runner._completed`), so no peer can be
    blocked on this rank: the groups are destroyed but the objects that hold them are not collected (a full
    collection and the group's destructor, 0.3-0.4 s at the end of the demo's DLRM job here, all on the
    way out of the process); the released flag is then False unless nothing held the group. Never
    raises."""
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
    if not collect:
        released = default is None or sys.getrefcount(default) <= 2
        del default
        return time.monotonic() - begin, released
    release()  # groups the script destroyed itself (a `finally:` in train), held to the exit handlers
    gc.collect()  # process groups held by the failed generation's objects (DDP's reducer): their sockets close
    released = default is None or sys.getrefcount(default) <= 2  # `default` and getrefcount's own argument
    pause_s = 0.005
    while not released and time.monotonic() - begin < release_wait_s:
        # A background thread of the failed generation may still hold it: an async checkpoint's persist that a
        # `train` without a `with` did not wait for (its collectives fail now that the groups are gone).
        time.sleep(pause_s)
        pause_s = min(pause_s * 2, 0.2)
        gc.collect()
        released = sys.getrefcount(default) <= 2
    level = logging.DEBUG if exiting else logging.WARNING
    if not released and logger.isEnabledFor(level):
        logger.log(
            level,
            "ettr: the failed generation's process group is still held after %.1f s, by %s",
            time.monotonic() - begin,
            holders(default),
        )
    del default
    return time.monotonic() - begin, released


def holders(obj: object, *, depth: int = 5, limit: int = 6) -> str:
    """Where `obj` is referenced from, read outwards (`dict['_process_group'] <- ShardedTensor <- dict[...]
    <- frame save (checkpoint/persist.py:120)`): what keeps a process group alive. Never raises."""
    ours = {leave.__code__, holders.__code__}
    found: list[str] = []
    seen: set[int] = {id(found)}

    def label(ref: object, child: object) -> str:
        code = getattr(ref, "f_code", None)
        if code is not None:
            path = "/".join(code.co_filename.split("/")[-2:])
            return f"frame {code.co_name} ({path}:{getattr(ref, 'f_lineno', '?')})"
        if isinstance(ref, dict):
            key = next((k for k, v in ref.items() if v is child), None)
            return f"{_module_of(ref) or 'dict'}[{key!r}]" if isinstance(key, str) else "dict"
        attrs = getattr(ref, "__dict__", None)
        key = next((k for k, v in attrs.items() if v is child), None) if isinstance(attrs, dict) else None
        return f"{type(ref).__qualname__}.{key}" if key else type(ref).__qualname__

    running = _locals_of_running_frames(ours | {_locals_of_running_frames.__code__})

    def walk(target: object, chain: list[str], level: int) -> None:
        for frame_label in running.get(id(target), ()):
            if len(found) < limit:
                found.append(" <- ".join([*chain, frame_label]))
        refs = [r for r in gc.get_referrers(target) if id(r) not in seen]
        seen.add(id(refs))
        for index in range(len(refs)):
            ref = refs[index]
            code = getattr(ref, "f_code", None)
            if code in ours or code is walk.__code__ or len(found) >= limit:
                continue
            seen.add(id(ref))
            path = [*chain, label(ref, target)]
            if level + 1 >= depth or code is not None or isinstance(ref, dict) and _module_of(ref):
                found.append(" <- ".join(path))
            else:
                walk(ref, path, level + 1)

    try:
        walk(obj, [], 0)
    except Exception as exc:  # a diagnostic: never the reason a teardown fails
        return f"(not found: {exc})"
    return "; ".join(found) or "nothing the collector tracks (a C extension's reference)"


def _locals_of_running_frames(skip: set[object]) -> dict[int, list[str]]:
    """The objects the functions running now in any thread hold in local variables (a running frame's locals
    are not seen by the collector's referrers), each with where: {id: ["thread T: frame f (file:line)"]}."""
    import threading

    names = {t.ident: t.name for t in threading.enumerate()}
    held: dict[int, list[str]] = {}
    for ident, frame in sys._current_frames().items():
        current: Any = frame
        while current is not None:
            code = current.f_code
            if code not in skip:
                path = "/".join(code.co_filename.split("/")[-2:])
                where = f"thread {names.get(ident, ident)}: frame {code.co_name} ({path}:{current.f_lineno})"
                for value in list(current.f_locals.values()):
                    held.setdefault(id(value), []).append(where)
            current = current.f_back
    return held


def _module_of(namespace: dict[object, object]) -> str | None:
    """The name of the module whose globals `namespace` is, if it is one."""
    name = namespace.get("__name__")
    if not isinstance(name, str):
        return None
    module = sys.modules.get(name)
    return name if module is not None and getattr(module, "__dict__", None) is namespace else None


def _abort_nccl() -> None:
    """NCCL does not fail a collective whose peer died: abort the communicators so that nothing waits."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None or not torch.cuda.is_available():
        return
    try:
        abort()
    except Exception as exc:
        logger.debug("ettr: aborting NCCL: %s", exc)
