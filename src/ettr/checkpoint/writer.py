"""DCP storage writers that commit: after DCP's own `finish`, the coordinator writes ettr's manifest.

The writers are DCP's `FileSystemWriter` / `FsspecWriter` with one change: `finish` — which DCP calls on
the coordinator rank once every rank's `write_data` has returned, i.e. once every data file is written
and fsync'd — goes on to `commit.commit`: checksums of every file and the manifest, written last. So the
commit happens wherever the persist runs (a thread, or DCP's checkpoint process), and a save's upload
future completes only after the manifest rename is durable.

In the process mode the persist outlives nothing: a persist process whose trainer died stops before it
commits (its parent pid changes), and a watchdog thread ends it soon after.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _metadata_fn
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult

from ettr.checkpoint.base import CheckpointError, CheckpointStorage, FaultHook, step_dir_name
from ettr.checkpoint.commit import commit
from ettr.checkpoint.storage import LocalStorage

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


class _CommitMixin:
    """Adds the commit to a DCP writer. Set up by `make_writer`."""

    _ettr_storage: CheckpointStorage
    _ettr_step: int
    _ettr_world_size: int
    _ettr_hook: FaultHook | None
    _ettr_owner_pid: int

    def _ettr_setup(
        self, storage: CheckpointStorage, step: int, world_size: int, fault_hook: FaultHook | None
    ) -> None:
        self._ettr_storage = storage
        self._ettr_step = step
        self._ettr_world_size = world_size
        self._ettr_hook = fault_hook
        self._ettr_owner_pid = os.getpid()

    def _ettr_fault(self, point: str) -> None:
        if self._ettr_hook is not None:
            self._ettr_hook(point)

    def _ettr_check_owner(self) -> None:
        if os.getpid() != self._ettr_owner_pid and os.getppid() != self._ettr_owner_pid:
            raise CheckpointError(f"the training process {self._ettr_owner_pid} is gone; not committing")

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        global _watchdog_started
        if os.getpid() != self._ettr_owner_pid and not _watchdog_started:
            # We run in DCP's checkpoint process: end it if the trainer dies (a daemon process is only
            # reaped at a clean exit of its parent, not after a SIGKILL).
            _watchdog_started = True
            threading.Thread(
                target=_exit_when_orphaned,
                args=(self._ettr_owner_pid,),
                name="ettr-orphan-watch",
                daemon=True,
            ).start()
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)  # type: ignore[misc]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Any:
        future = super().write_data(plan, planner)  # type: ignore[misc]
        future.wait()  # DCP's file writer completes synchronously; this keeps the hook after the data
        self._ettr_fault("data_written")
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self._ettr_check_owner()
        super().finish(metadata, results)  # type: ignore[misc]
        self._ettr_fault("metadata_written")
        names = {_metadata_fn}
        for rank_results in results:
            for result in rank_results:
                names.add(result.storage_data.relative_path)
        commit(
            self._ettr_storage,
            self._ettr_step,
            names,
            world_size=self._ettr_world_size,
            fault_hook=self._ettr_commit_point,
        )

    def _ettr_commit_point(self, point: str) -> None:
        if point == "manifest_begin":
            # Checked last thing before the manifest: a persist whose trainer died meanwhile never commits
            # (nobody would record the commit, and the next attempt may already be scanning the root).
            self._ettr_check_owner()
        self._ettr_fault(point)


class CommitFileSystemWriter(_CommitMixin, FileSystemWriter):
    """DCP's local-filesystem writer (fsync of every file) that commits with an ettr manifest."""


try:  # fsspec is an optional dependency (the `io` extra)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter as _FsspecWriter
except ImportError:  # pragma: no cover - depends on the environment
    _FsspecWriter = None

if _FsspecWriter is not None:

    class CommitFsspecWriter(_CommitMixin, _FsspecWriter):  # type: ignore[valid-type,misc]
        """DCP's fsspec writer (object stores) that commits with an ettr manifest."""


def make_writer(
    storage: CheckpointStorage,
    step: int,
    *,
    world_size: int,
    num_io_threads: int = 1,
    fault_hook: FaultHook | None = None,
) -> Any:
    """A DCP StorageWriter for the checkpoint of `step` that commits in its `finish`."""
    path = storage.path(step_dir_name(step))
    writer: Any
    if isinstance(storage, LocalStorage):
        writer = CommitFileSystemWriter(
            path, single_file_per_rank=True, sync_files=True, thread_count=num_io_threads
        )
    else:
        if _FsspecWriter is None:
            raise CheckpointError(f"{storage.url} needs fsspec: pip install 'ettr[io]'")
        # Object stores make a file durable when it is closed; DCP's fsync fallback (os.sync) would only
        # flush this machine's unrelated dirty pages.
        writer = CommitFsspecWriter(
            path, single_file_per_rank=True, sync_files=False, thread_count=num_io_threads
        )
    writer._ettr_setup(storage, step, world_size, fault_hook)
    return writer


def make_reader(storage: CheckpointStorage, step: int) -> Any:
    """A DCP StorageReader for the checkpoint of `step`."""
    path = storage.path(step_dir_name(step))
    if isinstance(storage, LocalStorage):
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(path)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(path)
