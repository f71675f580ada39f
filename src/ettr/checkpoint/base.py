"""What the checkpoint package is configured with and what it needs from the rest of ettr.

`CheckpointConfig` is the manager's one configuration object; `CheckpointStorage` is the seam to where
checkpoints live (`ettr.checkpoint.storage` has the local and fsspec backends, `ettr.testing.memory_storage`
the dict-backed fake). The manager writes through `ettr.recorder.RecorderProtocol`.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, runtime_checkable

from ettr.checkpoint.policy import IntervalConfig, parse_memory_interval
from ettr.errors import describe_os_error
from ettr.untrusted import printable

if TYPE_CHECKING:
    from torch.distributed.checkpoint import StorageReader, StorageWriter

MANIFEST_NAME = "ettr-manifest.json"
"""The commit marker of one checkpoint: written last, after every data file is durable."""

STEP_DIR_PATTERN = re.compile(r"^step_(\d+)$")
"""Names of checkpoint directories under the root (`step_000000120`)."""


def step_dir_name(step: int) -> str:
    """The directory name of the checkpoint of `step` (zero-padded so names sort like steps)."""
    if step < 0:
        raise ValueError(f"a checkpoint step must be >= 0, got {step}")
    return f"step_{step:09d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a checkpoint directory name, or None for any other name."""
    match = STEP_DIR_PATTERN.match(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True, kw_only=True)
class CommittedCheckpoint:
    """A checkpoint a manager of this process committed (or restored), named to a consumer that wants its
    state without writing it again (`CheckpointManager.committed`; `ettr.publish.publish_at_end(...,
    checkpoint=)` makes the publish anchor from it by hard links). The consumer verifies and admits it
    again, and proves every tensor it takes bit-identical to the live state before using it."""

    storage: Any
    """Where it is (the manager's `CheckpointStorage`)."""
    step: int
    state_dict: Callable[[], dict[str, Any]]
    """The state as the manager saves it (`TrainState.state_dict`): the live tensors, under the keys its
    records have in DCP's metadata."""
    allow_unsigned: bool = False
    """The manager's own admission settings (an unsigned root it was told to accept)."""
    resume_foreign: bool = False

    @property
    def name(self) -> str:
        return step_dir_name(self.step)


class CheckpointError(Exception):
    """A checkpoint could not be saved or loaded (the message says which and why).

    The message is made printable (`ettr.untrusted.printable`): it often quotes what a manifest says (its
    root, job id, key id, file names), which whoever can write the root may have forged, and it reaches a
    terminal as a warning or a traceback (an OSC 52 sequence in a forged `root` was printed raw)."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(printable(a) if isinstance(a, str) else a for a in args))


class CheckpointInvalid(CheckpointError):
    """A checkpoint directory is incomplete or corrupt: it must not be resumed from."""


class CheckpointRefused(CheckpointInvalid):
    """An intact checkpoint this job does not load unless asked: unsigned in a root whose checkpoints are
    signed, signed with a key this job's ring lacks, or written into another root. Skipped, never moved
    aside or deleted by a restore (the message says how to ask for it)."""


class PersistMode(StrEnum):
    """Where the background persist of a save runs."""

    THREAD = "thread"
    """A thread of the training process: cheap to start; competes with the training loop for the GIL."""
    PROCESS = "process"
    """A separate process (DCP's daemon): no GIL contention; needs a process group (one is made for a
    single process) and an `if __name__ == "__main__":` guard in the training script."""


FaultHook = Callable[[str], None]
"""Called at named points of a persist (`writer.FAULT_POINTS`); for fault-injection tests only."""


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """How and when the `CheckpointManager` saves, where to, and what it keeps."""

    root: str | os.PathLike[str]
    """Where checkpoints go: a local directory or any fsspec URL (`s3://bucket/job`, `memory://x`).
    Each checkpoint is a directory `step_<N>` under it."""
    interval: IntervalConfig = field(default_factory=lambda: IntervalConfig(every_steps=100))
    """When `after_step` saves: every N steps, every S seconds, or `auto` (see `IntervalConfig`)."""
    keep_last: int = 3
    """Committed checkpoints to keep (the newest ones); older ones are deleted after each commit."""
    mode: PersistMode | str = PersistMode.THREAD
    """Where the background persist runs: `thread` or `process` (see `PersistMode`)."""
    verify_checksums: bool = True
    """Whether "latest" re-reads every file and checks its CRC-32 against the manifest (else only sizes: a
    data file changed at the same size then loads as its bytes are, raw tensor records included)."""
    num_io_threads: int = 1
    """Writer threads per rank (DCP's `thread_count`); each writes its own file."""
    raw_tensors: bool = False
    """Write each tensor's bytes as they are into DCP's data files (`ettr.checkpoint.raw`: no `torch.save`
    per tensor, most of a save's write CPU) where the storage's writer is DCP's file writer with one writer
    thread; such checkpoints load with ettr (restore, verify, publish), not with a plain `dcp.load` or
    `dcp_to_torch_save`, nor with an ettr older than 2026-12-04. False (the default): DCP's own format, a
    `torch.save` record per tensor, which any DCP reader loads. Either kind, and checkpoints written
    before, load alike."""
    overlap_staging: bool = True
    """Let the copy of the model and optimizer tensors run while the next step's forward and backward run.
    The loop then waits for it (recorded as CHECKPOINT_BLOCKING) only right before the optimizer's next
    step — or before the next forward for models with running statistics (batch norm) — or at the
    manager's next call. Code that changes model or optimizer tensors in place at any other time must call
    `CheckpointManager.wait_staged()` first (so must code that steps another optimizer over the model).
    Without an optimizer in the `TrainState` there is no step to guard, and saves do not overlap. False:
    every save returns with the copy complete."""
    handle_preemption: bool = False
    """Act on SIGTERM: save at the next step boundary, flush the recorder, exit with 143. The handler is
    installed by `CheckpointManager.create` (a manager built directly is given its `preemption=` watcher)."""
    lease_ttl_s: float = 3600.0
    """How long a reader's lease on a checkpoint protects it from retention (a crashed reader's lease
    expires after this)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the fsspec filesystem of `root` (credentials, endpoint)."""
    secret: bytes | None = field(default=None, repr=False)
    """HMAC key the manifests are signed with. None: the `ETTR_CHECKPOINT_SECRET` environment variable if
    set, else this user's own key (`ettr.checkpoint.keys`: made on first use in a private directory outside
    every checkpoint root). Every key that signed is kept in that key ring, so older checkpoints stay
    verifiable when the key changes; a manifest signed with a ring key whose HMAC does not verify is never
    loaded (docs/trust.md)."""
    allow_unsigned: bool = False
    """Load checkpoints that are unsigned, or signed with a key the ring does not hold, without
    authentication (the explicit downgrade; also `ETTR_CHECKPOINT_ALLOW_UNSIGNED=1`). Off: such a
    checkpoint is refused in a root this user signed checkpoints in. Either way nothing in a checkpoint is
    unpickled as code."""
    resume_foreign: bool = False
    """Resume from a checkpoint whose manifest names another root than this one (copied or moved in from
    another job); also `ETTR_CHECKPOINT_RESUME_FOREIGN=1`. Off: it is refused, and left where it is."""
    job_id: str | None = None
    """The job named in every manifest this manager commits (None: the recorder's job id)."""
    safe_globals: tuple[Any, ...] = ()
    """Classes (and functions) the pickled parts of the state may hold beyond tensors, containers,
    numbers, strings and NumPy's RNG state: a user sampler's own class, say. They are allowed to
    `torch.load(weights_only=True)` while loading; nothing a checkpoint names is ever allowed."""
    fault_hook: FaultHook | None = None
    """Fault-injection tests only: called with a point name during each persist; must be picklable for
    the process mode. None in real jobs."""
    memory_copy: bool = True
    """Keep each rank's last committed checkpoint in host memory that outlives the process (`/dev/shm`,
    `ettr.checkpoint.memory`): a restarted rank on the same host restores from it, after checking it is
    the copy of the newest commit, instead of reading storage. Costs one copy of the rank's staged state
    in shared memory (two while a new one is written), bounded by `memory_max_bytes` and the free space."""
    memory_max_bytes: int | None = None
    """The largest memory copy a rank keeps (None: bounded by the shared-memory file system's free space
    alone, of which 1 GiB or a tenth is always left free)."""
    memory_replicas: int = 1
    """With several nodes, how many peers on other nodes also hold each rank's memory copy, so that a
    replacement node restores from them (0: none). More replicas cost as many copies per holder."""
    memory_interval: float | str | None = None
    """Memory-tier commits between storage commits (`ettr.checkpoint.memory_tier`): every rank copies its
    live state to shared memory at the same step, so that a restore from memory (a restart in place, on a
    surviving node) loses at most this interval, not a storage interval. None (the default): off; "auto":
    Young/Daly from the memory save's measured cost and the failure rate the `auto` storage interval uses;
    or seconds. Costs two more staged states per rank in `/dev/shm` (the copy and its slot), bounded like
    the storage commit's copy; needs `memory_copy` and CPU tensors."""

    def __post_init__(self) -> None:
        if not os.fspath(self.root):
            raise ValueError("root must name a directory or URL for the checkpoints")
        if not isinstance(self.interval, IntervalConfig):
            raise ValueError(f"interval must be an IntervalConfig, got {type(self.interval).__name__}")
        if self.keep_last < 1:
            raise ValueError(
                f"keep_last must be >= 1 (the newest committed one is always kept), got {self.keep_last}"
            )
        try:
            object.__setattr__(self, "mode", PersistMode(self.mode))
        except ValueError:
            raise ValueError(f"mode must be 'thread' or 'process', got {self.mode!r}") from None
        if self.num_io_threads < 1:
            raise ValueError(f"num_io_threads must be >= 1, got {self.num_io_threads}")
        if self.secret is not None and not (isinstance(self.secret, bytes) and self.secret):
            raise ValueError("secret must be non-empty bytes when given")
        object.__setattr__(self, "safe_globals", tuple(self.safe_globals))
        if not all(callable(obj) for obj in self.safe_globals):
            raise ValueError("safe_globals must hold classes or functions (what weights_only may build)")
        if not (self.lease_ttl_s > 0 and math.isfinite(self.lease_ttl_s)):
            raise ValueError(f"lease_ttl_s must be a finite number of seconds > 0, got {self.lease_ttl_s}")
        if self.memory_max_bytes is not None and self.memory_max_bytes < 0:
            raise ValueError(f"memory_max_bytes must be >= 0 or None, got {self.memory_max_bytes}")
        if self.memory_replicas < 0:
            raise ValueError(f"memory_replicas must be >= 0, got {self.memory_replicas}")
        object.__setattr__(self, "memory_interval", parse_memory_interval(self.memory_interval))
        if self.memory_interval is not None and not self.memory_copy:
            raise ValueError(
                "memory_interval needs memory_copy=True (memory-tier commits live beside its copies)"
            )


class ReadableStorage(Protocol):
    """The read side of a checkpoint storage (6 members): where it is, what it holds, the bytes of a file,
    and the DCP reader that suits it. What verifying, listing and choosing a checkpoint need."""

    @property
    def url(self) -> str:
        """The root, as a path or URL (for messages and events)."""
        ...

    def path(self, rel: str) -> str:
        """The full path or URL of `rel` (what DCP's writers and readers are given)."""
        ...

    def list_dir(self, rel: str = "") -> dict[str, int | None]:
        """Entries directly under `rel`: name -> size in bytes for files, None for directories.
        An empty dict if `rel` does not exist."""
        ...

    def open_read(self, rel: str) -> AbstractContextManager[BinaryIO]:
        """Open a file for reading (raises FileNotFoundError if it is missing)."""
        ...

    def read_bytes(self, rel: str) -> bytes: ...

    def dcp_reader(self, rel_dir: str) -> StorageReader:
        """A DCP StorageReader of directory `rel_dir`."""
        ...


class WritableStorage(Protocol):
    """The write side of a checkpoint storage (6 members): whole files, durable names, removal, renames,
    and the DCP writer that suits it."""

    def write_atomic(self, rel: str, data: bytes, *, on_partial: Callable[[], None] | None = None) -> None:
        """Write `data` to a temporary name, make it durable, then rename it to `rel`.
        `on_partial` is called while the data is written but not yet visible as `rel` (fault-injection
        tests); an exception from it leaves nothing behind."""
        ...

    def make_durable(self, rel_dir: str) -> None:
        """Make the names created in `rel_dir` (and `rel_dir` itself in its parent) durable."""
        ...

    def remove(self, rel: str) -> None:
        """Delete one file; a missing file is not an error."""
        ...

    def remove_tree(self, rel_dir: str) -> None:
        """Delete a checkpoint directory, its manifest first (so a crash midway leaves it invisible)."""
        ...

    def rename(self, rel: str, new_rel: str) -> None: ...

    def dcp_writer(self, rel_dir: str, *, thread_count: int = 1) -> StorageWriter:
        """A DCP StorageWriter into directory `rel_dir` whose `write_data` returns once the files are
        durable (one file per rank, `thread_count` writer threads each)."""
        ...


@runtime_checkable
class CheckpointStorage(ReadableStorage, WritableStorage, Protocol):
    """The place checkpoints live, addressed by paths relative to its root (`step_000000010/x.distcp`): its
    read side and its write side. Code that only reads takes a `ReadableStorage`.

    Every write that returns is durable (fsync'd, or an object store's completed upload); `write_atomic`
    makes the file appear whole or not at all. A backend hands out the DCP writer and reader that suit it
    (`dcp_writer`, `dcp_reader`): nothing outside it knows which backend it is. Implementations must be
    picklable for the process-mode persist (which receives one).
    """


def _describe_one(exc: BaseException) -> str:
    current: BaseException | None = exc
    for _ in range(8):  # the OSError under DCP's or our wrappers says the cause best
        if isinstance(current, OSError) and current.errno is not None:
            return describe_os_error(current)
        if current is None:
            break
        current = current.__cause__ or current.__context__
    return f"{type(exc).__name__}: {exc}"


def describe_error(exc: BaseException) -> str:
    """One line for a failed save or load: DCP's CheckpointException carries a traceback per rank; an
    OSError anywhere in the chain is named by its errno (`ENOSPC (No space left on device): path`)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, wrapped in sorted(failures.items()):
            inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            parts.append(f"rank {rank}: {_describe_one(inner)}")
        return "; ".join(parts)
    return _describe_one(exc)


def iter_chunks(stream: BinaryIO, chunk_bytes: int = 8 << 20) -> Iterator[bytes]:
    """Read a stream in chunks (for checksums of files larger than memory allows at once)."""
    while True:
        chunk = stream.read(chunk_bytes)
        if not chunk:
            return
        yield chunk
