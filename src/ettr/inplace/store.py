"""The rendezvous store of a resilient job: one that outlives any of its ranks.

Every generation re-forms the process group over this store (under a prefix of its own), so it must not
live inside a rank that may die. Which one, in order:

1. `ETTR_INPLACE_STORE` (set by ettr's agent): `file:///PATH`, a FileStore (one host), or `tcp://HOST:PORT`,
   a TCPStore someone else serves;
2. under torchrun's agent (`TORCHELASTIC_USE_AGENT_STORE=True`): the agent's own TCPStore at
   MASTER_ADDR:MASTER_PORT, which outlives the workers (under a prefix of the run id and restart count);
3. all ranks on this host (`LOCAL_WORLD_SIZE == WORLD_SIZE`): a FileStore in shared memory
   (`ettr.run_env.memory_root`), whose fresh name rank 0 hands the others through the usual env:// store;
4. otherwise the env:// TCPStore rank 0 serves: a failure of rank 0 then ends the job (no in-place restart).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from ettr.run_env import INPLACE_STORE_ENV, memory_root, private_dir_problem
from ettr.untrusted import printable, whole_number

_PATH_KEY = "ettr/inplace/filestore"
_OPENED_KEY = "ettr/inplace/filestore-opened"
_FAILED_KEY = "ettr/inplace/filestore-failed"
"""Set by a rank whose part of the hand-over failed (`rank R: why`), in the bootstrap store and, where it has it
open, the FileStore (`ABANDONED_KEY`): the others stop waiting for it at once."""
ABANDONED_KEY = "ettr/inplace/abandoned"
"""In the job's store: the in-place store could not be handed over (`rank R: why`); `rendezvous.join` gives up
at once on it, instead of waiting for a rank that will never join."""
_POLL_S = 0.005
_REASON_CHARS = 300
_STORE_NAME = re.compile(r"inplace-[0-9]+-[0-9a-f]{12}\.store")
"""The name rank 0 gives the job's FileStore (`_local_file_store`); the others open no other."""


class StoreUnavailable(RuntimeError):
    """The job's rendezvous store cannot be opened."""


@dataclass
class JobStore:
    """The store, what it is (for messages), and whether this process should delete its file at the end."""

    store: dist.Store
    describe: str
    survives_rank_0: bool
    """Whether the store outlives rank 0 (False: rank 0 serves it)."""
    owned_path: Path | None = None
    """A FileStore this rank made (rank 0, case 3): deleted by `close`."""

    def close(self) -> None:
        if self.owned_path is not None:
            with contextlib.suppress(OSError):
                self.owned_path.unlink()


def open_job_store(
    *, rank: int, world_size: int, timeout_s: float, environ: Mapping[str, str] | None = None
) -> JobStore:
    """Open (or, rank 0 where it serves it, create) the job's store. Collective in cases 3 and 4."""
    env = os.environ if environ is None else environ
    timeout = datetime.timedelta(seconds=timeout_s)
    explicit = env.get(INPLACE_STORE_ENV, "").strip()
    if explicit:
        return _explicit(explicit, timeout)
    host, port = env.get("MASTER_ADDR", "127.0.0.1"), env.get("MASTER_PORT", "")
    if not port:
        raise StoreUnavailable(
            "MASTER_PORT is not set: start the job with torchrun (or set ETTR_INPLACE_STORE)"
        )
    if _port(port) is None:
        raise StoreUnavailable(f"MASTER_PORT={printable(port[:40])!r} is not a port (1-65535)")
    if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        agent_store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        # The agent's store outlives its workers: the keys of a restart of the job (new workers) must
        # not meet those of the processes before it.
        launch = f"{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        store: dist.Store = dist.PrefixStore(f"ettr/{launch}/", agent_store)
        return JobStore(store, f"torchrun's agent store at {host}:{port}", survives_rank_0=True)
    bootstrap = dist.TCPStore(
        host, int(port), world_size=world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False
    )
    local_world = env.get("LOCAL_WORLD_SIZE", "")
    root = memory_root(env)
    if local_world == str(world_size) and root is not None:
        return _local_file_store(bootstrap, rank=rank, world_size=world_size, root=root, timeout=timeout)
    return JobStore(bootstrap, f"rank 0's store at {host}:{port}", survives_rank_0=False)


def _port(text: str) -> int | None:
    """`text` as a TCP port (1-65535), else None: `str.isdigit` passed '²' (then `int` raised ValueError) and
    70000 (TCPStore raised TypeError), neither the `StoreUnavailable` a caller of `open_job_store` is told of."""
    port = whole_number(text)
    return port if port is not None and 0 < port < 65536 else None


def _explicit(url: str, timeout: datetime.timedelta) -> JobStore:
    if url.startswith("file://"):
        path = url.removeprefix("file://")
        store: dist.Store = dist.FileStore(path, -1)
        store.set_timeout(timeout)
        return JobStore(store, f"the FileStore {path}", survives_rank_0=True)
    if url.startswith("tcp://"):
        host, _, port = url.removeprefix("tcp://").rpartition(":")
        if _port(port) is None:
            raise StoreUnavailable(f"{INPLACE_STORE_ENV}={url!r}: expected tcp://HOST:PORT")
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        return JobStore(store, f"the TCPStore at {host}:{port}", survives_rank_0=True)
    raise StoreUnavailable(f"{INPLACE_STORE_ENV}={url!r}: expected file:///PATH or tcp://HOST:PORT")


def _store_path_of_rank_0(named: bytes, root: Path) -> str:
    """The FileStore path rank 0 put in the bootstrap store, if it is one rank 0 makes: a fresh name directly
    in this user's private `root`. Anyone who can reach rank 0's TCP store could have set the key instead
    (torch's stores take no credentials), and every later generation of the job re-forms through that file:
    a path of theirs (`/tmp/theirs.store`) would hand them the job's rendezvous. Raises StoreUnavailable."""
    path = named.decode("utf-8", "replace")
    candidate = Path(path)
    if not candidate.is_absolute() or candidate.parent != root or not _STORE_NAME.fullmatch(candidate.name):
        raise StoreUnavailable(
            f"rank 0's store names {printable(path)!r} as the job's FileStore, not a file rank 0 makes in {root}"
        )
    problem = private_dir_problem(root)
    if problem is not None:
        raise StoreUnavailable(f"the in-place store is not kept there: {problem}")
    return path


def _local_file_store(
    bootstrap: dist.Store, *, rank: int, world_size: int, root: Path, timeout: datetime.timedelta
) -> JobStore:
    """A FileStore under `root` with a fresh name (a stale file of an earlier job is never reused), made
    by rank 0 and handed to the others through the bootstrap store; rank 0 keeps serving that until every
    rank has opened the file. A rank whose part fails says so in the store (`_FAILED_KEY`) before it raises,
    and a rank waiting in the hand-over raises at once when it reads that (StoreUnavailable naming the rank
    and why): before, rank 0 waited out its whole rendezvous timeout (120 s) for a rank that had already
    given up, and the job's fall-back to a process restart waited with it."""
    opened: list[dist.Store] = []
    try:
        return _hand_over(
            bootstrap, rank=rank, world_size=world_size, root=root, timeout=timeout, opened=opened
        )
    except _PeerFailed as exc:
        _abandon(opened, None, str(exc))  # said in the bootstrap store already, by the rank that failed
        raise
    except Exception as exc:
        _abandon(opened, bootstrap, f"rank {rank}: {type(exc).__name__}: {exc}")
        raise


class _PeerFailed(StoreUnavailable):
    """Another rank's part of the hand-over failed (it said so in the store)."""


def _hand_over(
    bootstrap: dist.Store,
    *,
    rank: int,
    world_size: int,
    root: Path,
    timeout: datetime.timedelta,
    opened: list[dist.Store],
) -> JobStore:
    deadline = time.monotonic() + timeout.total_seconds()
    owned = None
    if rank == 0:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        problem = private_dir_problem(root)
        if problem is not None:  # another user's directory: they could swap the store for a file of theirs
            raise StoreUnavailable(f"the in-place store is not kept there: {problem}")
        owned = root / f"inplace-{os.getpid()}-{secrets.token_hex(6)}.store"
        bootstrap.set(_PATH_KEY, str(owned))
        path = str(owned)
    else:
        while not bootstrap.check([_PATH_KEY]):
            _peer_failed(bootstrap)
            if time.monotonic() > deadline:
                raise StoreUnavailable("rank 0 did not name the job's FileStore in time")
            time.sleep(_POLL_S)
        path = _store_path_of_rank_0(bootstrap.get(_PATH_KEY), root)
    store = dist.FileStore(path, -1)
    store.set_timeout(timeout)
    opened.append(store)
    bootstrap.add(_OPENED_KEY, 1)
    if rank == 0:  # the others must have read the name before rank 0's server goes
        while bootstrap.add(_OPENED_KEY, 0) < world_size:
            _peer_failed(bootstrap)
            if time.monotonic() > deadline:
                raise StoreUnavailable("not every rank opened the job's FileStore in time")
            time.sleep(_POLL_S)
    return JobStore(store, f"the FileStore {path}", survives_rank_0=True, owned_path=owned)


def _peer_failed(bootstrap: dist.Store) -> None:
    """Raise _PeerFailed when a rank said its part of the hand-over failed."""
    if bootstrap.check([_FAILED_KEY]):
        said = bootstrap.get(_FAILED_KEY).decode("utf-8", "replace")[:_REASON_CHARS]
        raise _PeerFailed(f"the hand-over of the job's FileStore failed on {printable(said)}")


def _abandon(opened: list[dist.Store], bootstrap: dist.Store | None, said: str) -> None:
    """Say in the bootstrap store (where given: this rank's own failure) and in the FileStore this rank opened
    that the hand-over failed (`said`), so that no rank waits for it: best effort (rank 0's server may be
    gone already)."""
    said = said[:_REASON_CHARS]
    if bootstrap is not None:
        with contextlib.suppress(Exception):
            bootstrap.set(_FAILED_KEY, said)
    for store in opened:
        with contextlib.suppress(Exception):
            if not store.check([ABANDONED_KEY]):
                store.set(ABANDONED_KEY, said)
