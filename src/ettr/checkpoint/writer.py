"""A DCP storage writer that commits: after DCP's own `finish`, the coordinator writes ettr's manifest.

`CommittingWriter` wraps the DCP writer its storage hands out (`CheckpointStorage.dcp_writer`: DCP's
`FileSystemWriter` for a local directory, its `FsspecWriter` for an object store) and delegates every call
to it, with one addition: `finish` — which DCP calls on the coordinator rank once every rank's `write_data`
has returned, i.e. once every data file is written and durable — goes on to `commit.commit`: checksums of
every file and the manifest, written last. The checksums are taken as the files are written
(`checksums.SummingFileSystem` around the DCP writer's file system): each rank's write results carry its
files' (size, CRC-32) to the coordinator (`_Summed`, unwrapped before DCP's `.metadata` is written), so
the commit reads no data file back. So the commit happens wherever the persist runs (a thread, or
DCP's checkpoint process), and a save's upload future completes only after the manifest rename is durable.

In the process mode the persist outlives nothing: a persist process whose trainer died stops before it
commits (its parent pid changes), and a watchdog thread ends it soon after.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any

from torch.distributed.checkpoint.filesystem import _metadata_fn, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ettr.checkpoint.base import CheckpointError, CheckpointStorage, FaultHook, step_dir_name
from ettr.checkpoint.checksums import SummingFileSystem, Sums
from ettr.checkpoint.commit import commit
from ettr.checkpoint.raw import can_write_raw, write_raw

FAULT_POINTS = ("data_written", "metadata_written", "manifest_begin", "manifest_partial", "manifest_renamed")
"""Where `CheckpointConfig.fault_hook` is called during a persist, in order (the first on every rank, the
others on the coordinator)."""

_ORPHAN_POLL_S = 0.2
_watchdog_started = False


def _exit_when_orphaned(owner_pid: int) -> None:
    while True:
        if os.getppid() != owner_pid:
            os._exit(70)  # the trainer is gone: a persist nobody waits for must not commit later
        time.sleep(_ORPHAN_POLL_S)


def _start_orphan_watchdog(owner_pid: int) -> None:
    global _watchdog_started
    if os.getpid() != owner_pid and not _watchdog_started:
        # We run in DCP's checkpoint process: end it if the trainer dies (a daemon process is only
        # reaped at a clean exit of its parent, not after a SIGKILL).
        _watchdog_started = True
        threading.Thread(
            target=_exit_when_orphaned, args=(owner_pid,), name="ettr-orphan-watch", daemon=True
        ).start()


@dataclasses.dataclass
class _Summed(_StorageInfo):
    """DCP's storage info of one written item, with its file's (size, CRC-32) as written: how a rank's sums
    reach the coordinator (in DCP's gather of write results). Never written: `finish` unwraps it."""

    file_size: int = -1
    file_crc32: int = -1

    @classmethod
    def of(cls, info: _StorageInfo, size: int, crc: int) -> _Summed:
        return cls(**_info_fields(info), file_size=size, file_crc32=crc)

    def plain(self) -> _StorageInfo:
        return _StorageInfo(**_info_fields(self))


def _info_fields(info: _StorageInfo) -> dict[str, Any]:
    """The fields DCP's own `_StorageInfo` has, of `info` (a `_Summed` or a plain one)."""
    return {f.name: getattr(info, f.name) for f in dataclasses.fields(_StorageInfo)}


def _unsummed(result: WriteResult, sums: dict[str, tuple[int, int]]) -> WriteResult:
    """`result` with DCP's own storage info (what `.metadata` may hold); the file's (size, CRC-32) a rank
    sent in a `_Summed` go to `sums`."""
    info = result.storage_data
    if not isinstance(info, _Summed):
        return result
    sums[info.relative_path] = (info.file_size, info.file_crc32)
    return dataclasses.replace(result, storage_data=info.plain())


class CommittingWriter(StorageWriter):
    """Delegates to the storage's own DCP writer, then commits the checkpoint of `step` in `finish`.

    Args:
        inner: the DCP writer that writes the data files (from `storage.dcp_writer`).
        storage: where the checkpoint is (the manifest goes beside the data).
        step: the checkpoint's step.
        world_size: ranks that wrote it (recorded in the manifest).
        fault_hook: fault-injection tests only (`FAULT_POINTS`).
        secret: HMAC key the manifest is signed with (None: unsigned).
        job_id: the job the manifest names.
        raw_tensors: write tensors as raw records where the inner writer is DCP's file writer (`raw`).
    """

    def __init__(
        self,
        inner: StorageWriter,
        *,
        storage: CheckpointStorage,
        step: int,
        world_size: int,
        fault_hook: FaultHook | None = None,
        secret: bytes | None = None,
        job_id: str | None = None,
        raw_tensors: bool = False,
    ) -> None:
        self.inner = inner
        self.raw_tensors = raw_tensors
        self.secret = secret
        self.job_id = job_id
        self.storage = storage
        self.step = step
        self.world_size = world_size
        self.fault_hook = fault_hook
        self.owner_pid = os.getpid()
        self.sums = Sums()
        """What this rank's streams summed (`checksums`); set `sums.expect` before the write to have the
        CRC-32 of those staged buffers too."""
        fs = getattr(inner, "fs", None)
        if hasattr(fs, "create_stream"):  # DCP's file-system writers; another's files are read back at commit
            inner.fs = SummingFileSystem(fs, self.sums)  # type: ignore[attr-defined]

    def _fault(self, point: str) -> None:
        if self.fault_hook is not None:
            self.fault_hook(point)

    def _check_owner(self) -> None:
        if os.getpid() != self.owner_pid and os.getppid() != self.owner_pid:
            raise CheckpointError(f"the training process {self.owner_pid} is gone; not committing")

    # -- DCP's StorageWriter, delegated ------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.inner.reset(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # made for one directory by its storage; never chosen by DCP from an id

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        _start_orphan_watchdog(self.owner_pid)
        self.inner.set_up_storage_writer(is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return self.inner.prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return self.inner.prepare_global_plan(plans)

    def storage_meta(self) -> StorageMeta | None:
        return self.inner.storage_meta()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self.raw_tensors and can_write_raw(self.inner):
            future: Future[list[WriteResult]] = Future()
            future.set_result(write_raw(self.inner, plan, planner))  # no torch.save per tensor (`raw`)
        else:
            future = self.inner.write_data(plan, planner)
            future.wait()  # DCP's file writers complete synchronously; this keeps the hook after the data
        self._fault("data_written")
        summed: Future[list[WriteResult]] = Future()
        summed.set_result([self._with_sum(result) for result in future.value()])
        return summed

    def _with_sum(self, result: WriteResult) -> WriteResult:
        info = result.storage_data
        if type(info) is not _StorageInfo or info.relative_path not in self.sums.files:
            return result
        size, crc = self.sums.files[info.relative_path]
        return dataclasses.replace(result, storage_data=_Summed.of(info, size, crc))

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self._check_owner()
        sums: dict[str, tuple[int, int]] = {}
        plain_results = [[_unsummed(result, sums) for result in rank_results] for rank_results in results]
        self.inner.finish(metadata, plain_results)
        self._fault("metadata_written")
        if _metadata_fn in self.sums.files:
            sums[_metadata_fn] = self.sums.files[_metadata_fn]
        names = {_metadata_fn}
        for rank_results in plain_results:
            for result in rank_results:
                names.add(result.storage_data.relative_path)
        commit(
            self.storage,
            self.step,
            names,
            world_size=self.world_size,
            fault_hook=self._commit_point,
            secret=self.secret,
            job_id=self.job_id,
            sums=sums,
        )

    def _commit_point(self, point: str) -> None:
        if point == "manifest_begin":
            # Checked last thing before the manifest: a persist whose trainer died meanwhile never commits
            # (nobody would record the commit, and the next attempt may already be scanning the root).
            self._check_owner()
        self._fault(point)


def make_writer(
    storage: CheckpointStorage,
    step: int,
    *,
    world_size: int,
    num_io_threads: int = 1,
    fault_hook: FaultHook | None = None,
    secret: bytes | None = None,
    job_id: str | None = None,
    raw_tensors: bool = False,
) -> CommittingWriter:
    """A DCP StorageWriter for the checkpoint of `step` that commits (signed with `secret`, naming
    `job_id`) in `finish`; with `raw_tensors`, tensors are raw records (`raw`) where the storage's writer
    is DCP's file writer."""
    inner = storage.dcp_writer(step_dir_name(step), thread_count=num_io_threads)
    return CommittingWriter(
        inner,
        storage=storage,
        step=step,
        world_size=world_size,
        fault_hook=fault_hook,
        secret=secret,
        job_id=job_id,
        raw_tensors=raw_tensors,
    )
