"""Memory copies: the last committed checkpoint of each rank kept in host memory that outlives the process.

After a checkpoint of step N commits, each rank writes its staged state (the copy the save already made)
to a snapshot file (`ettr.checkpoint.snapshot`) in shared memory — `/dev/shm/ettr-<uid>/ckpt-<hash of
the root>/rank-<r>.snap` by default (`ettr.run_env.memory_root`) — bound to that commit: the snapshot records
the SHA-256 of step N's manifest. A restarted rank on the same host (a new process: a crash, a SIGKILL, a
restart in place) restores from it instead of reading storage, and only when every check passes: its
step is the newest committed one in storage, its binding matches that manifest's bytes, its header and the
CRC-32 of every payload byte verify, and it is a file of this user that nobody else may write, in folders
nobody else may swap (a snapshot carries no signature: its binding and CRCs are anyone's to compute, so
where it lies is what keeps another user's forged copy out). Otherwise the storage path runs as before.

One copy per rank, and one staging slot (`.rank-<r>.snap.staging`, `snapshot.Slot`) where the stager can
use it (thread mode, no pinned buffers): the next save's staging buffers are views of the slot, so the staged
copy is already the copy's payload. After the commit the slot is sealed (byte strings, header, magic last)
and swapped with the copy in one atomic `renameat2(RENAME_EXCHANGE)`; the copy swapped out is the next
slot, and the stager lets go of every view of the file that became the copy (`ReusedStager.lend`), so a
later save never writes into the copy a restore could take. A slot is never read as a copy (its magic is
cleared while it is written). A state that does not fit the slot is written the usual way:

The first copy a process keeps is written under a temporary name and renamed over the
old one; each later one overwrites the file that process wrote in place (its shared-memory pages reused,
not allocated and zeroed again: about half of a copy's CPU), its magic cleared first and written back last
(`snapshot.write`), so that a copy torn by a crash or a kill reads as no snapshot, and its payload CRC-32
would refuse it as well. A file that was replaced meanwhile, or that this process still maps (a restore
from it whose tensors are still alive), is never overwritten: a new one is written and renamed. A copy that would leave
less than `reserve_bytes` of the file system free, or exceed `max_bytes`, is not written (the old one is
removed: it is stale once a newer step committed). With several nodes each rank also keeps the copies of
its peers on other nodes (`held-rank-<r>.snap`, `ettr.checkpoint.memory_peers`), so that a replacement
node restores from them.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ettr import memory_sweep
from ettr.checkpoint import snapshot
from ettr.checkpoint.base import (
    CheckpointInvalid,
    ReadableStorage,
    step_dir_name,
)
from ettr.checkpoint.commit import read_manifest_bytes
from ettr.checkpoint.snapshot import Binding, FileId, Slot, Snapshot
from ettr.run_env import MEMORY_OWNER_NAME, private_dir_problem
from ettr.warn import WarnOnce

logger = logging.getLogger("ettr")

DEFAULT_RESERVE_BYTES = 1 << 30
"""Memory copies leave at least this much of the shared-memory file system free (or a tenth of it, if
that is less)."""


class UnsafeMemoryDir(PermissionError):
    """The memory-copy directory is a symlink, another user's, or writable by others."""


_REFUSED_DIR = WarnOnce("{what}")
"""A memory-copy folder refused (`UnsafeMemoryDir`) is said once per process and folder, not at every save."""


def _ensure_private(path: Path) -> None:
    """Create `path` (0700, parents too) if missing; refuse it unless it is a real directory of this user
    that nobody else may write (a copy read from it is restored into the training state)."""
    if not os.path.lexists(path):
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    problem = private_dir_problem(path)
    if problem is not None:
        raise UnsafeMemoryDir(f"{problem}; memory copies are not kept there")


def manifest_binding(storage: ReadableStorage, step: int, world_size: int) -> Binding:
    """The binding of step `step`'s committed checkpoint: the digest of its manifest's bytes as stored.
    Raises OSError (FileNotFoundError: not committed), CheckpointInvalid (a manifest too large to be one)."""
    data = read_manifest_bytes(storage, step_dir_name(step))
    return Binding(step=step, manifest_sha256=Binding.digest(data), world_size=world_size)


@dataclass(frozen=True, kw_only=True)
class Found:
    """A memory copy that passed every check, or why there is none."""

    snapshot: Snapshot | None
    reason: str = ""

    @property
    def key(self) -> tuple[int, str] | None:
        """(step, lineage) of the copy: what the ranks compare for a memory-tier copy (None: no copy)."""
        if self.snapshot is None:
            return None
        return self.snapshot.info.binding.step, self.snapshot.info.binding.lineage


class MemoryCopies:
    """One rank's memory copies of one checkpoint root.

    Args:
        directory: where this root's copies live (created private, 0700).
        rank: this process's rank.
        max_bytes: the largest copy kept (None: only the free-space reserve bounds it).
        reserve_bytes: the shared-memory file system keeps at least min(this, a tenth of its size) free.
    """

    def __init__(
        self,
        directory: Path,
        *,
        rank: int,
        max_bytes: int | None = None,
        reserve_bytes: int = DEFAULT_RESERVE_BYTES,
    ) -> None:
        self.directory = directory
        self.rank = rank
        self.max_bytes = max_bytes
        self.reserve_bytes = reserve_bytes
        self.last_kept_bytes = 0
        """Size of the copy last written (0: none)."""
        self.owner = ""
        """The run directory written to the `owner` file with each copy ("" outside a run)."""
        self._lease_name = ""
        self._own_file: FileId | None = None
        """The copy this process last wrote (`own_path`): the next one overwrites it in place, reusing its
        memory pages, while it is still that file and no mapping of it may be alive (`snapshot.write`)."""
        self.staging_slots = False
        """Whether saves stage into a slot of this rank's copies (`staging_views`): the manager turns it on
        where its stager can use one (thread mode, no pinned buffers)."""
        self._lent: Slot | None = None
        """The staging slot the stager copies the next save into (`staging_path`; `staging_views`)."""
        self._sealed: Slot | None = None
        """The slot that is the copy at `own_path` (sealed; the stager's views of it were let go): the next
        seal swaps it to `staging_path`, where it is lent again."""
        self._spare: Slot | None = None
        """After a swap: the slot that was the copy at `own_path`, now at `staging_path` (lent next)."""
        self._spare_file: FileId | None = None
        """After a swap: the file written the usual way that was at `own_path`, now at `staging_path`."""
        self._lend_keys: list[tuple[int, int] | None] = []
        self._bookkeeping = threading.Lock()

    @classmethod
    def for_root(
        cls,
        memory_root: Path,
        storage_url: str,
        *,
        rank: int,
        owner: str | os.PathLike[str] | None = None,
        max_bytes: int | None = None,
    ) -> MemoryCopies:
        """The copies of the checkpoint root `storage_url` under `memory_root`; `owner`: the run directory
        of the job writing them (`ettr run` removes its job's copies when the job ends)."""
        key = hashlib.sha256(os.fsencode(storage_url)).hexdigest()[:16]  # a root that is not UTF-8 too
        copies = cls(memory_root / f"ckpt-{key}", rank=rank, max_bytes=max_bytes)
        copies.owner = "" if owner is None else os.path.abspath(os.fspath(owner))
        return copies

    def own_path(self) -> Path:
        return self.directory / f"rank-{self.rank}.snap"

    def staging_path(self) -> Path:
        """The staging slot: the next save's staged copy, never a restorable copy (its magic is cleared)."""
        return self.directory / f".rank-{self.rank}.snap.staging"

    def held_path(self, rank: int) -> Path:
        """Where the copy of peer `rank` is held here."""
        return self.directory / f"held-rank-{rank}.snap"

    # -- keeping ----------------------------------------------------------------------------------------------
    def keep(
        self,
        state_dict: dict[str, Any] | None,
        binding: Binding | None,
        piece_crcs: Mapping[tuple[int, int], int] | None = None,
    ) -> int:
        """Replace this rank's copy with `state_dict` (the staged state of the committed `binding`); returns
        its size, 0 when it was not kept (too large, no room, not representable: the old copy is removed,
        since a newer step has committed). `piece_crcs`: CRC-32s the persist already took of staged
        tensors (`snapshot.write`). Never raises for a copy that cannot be kept.

        Where `state_dict`'s tensors are the views of the lent staging slot (`staging_views`: the stager
        copied this save into the slot), the slot is sealed and swapped with the copy at `own_path` in one
        atomic rename (`RENAME_EXCHANGE`): no tensor byte is copied. Otherwise the copy is written as
        before. Either way a slot for the next save is prepared: the file swapped out (the old copy's
        pages), else a new one; `staging_views` then names its views."""
        path = self.own_path()
        if state_dict is None or binding is None:
            self.last_kept_bytes = self._keep_none(path)
            return 0
        lent, self._lent = self._lent, None  # never lent again, whatever happens below
        try:
            size = snapshot.size_of(state_dict)
            sealable = lent is not None and lent.matches(state_dict)
            why = self._no_room(size, new_file=not sealable)
            if why:
                self._close_slot(lent)
                logger.info("ettr: no memory copy of step %d (%s); restores read storage", binding.step, why)
                self.last_kept_bytes = self._keep_none(path)
                return 0
            written = 0
            if sealable:
                assert lent is not None
                with contextlib.suppress(snapshot.NotReusable):
                    written = self._seal(lent, state_dict, binding, piece_crcs)
            if not written:
                self._close_slot(lent)
                written = self._write_copy(path, state_dict, binding, piece_crcs)
            self._lend_next(state_dict, size)
        except snapshot.SnapshotUnsupported as exc:
            logger.info("ettr: no memory copy of step %d (%s); restores read storage", binding.step, exc)
            written = self._keep_none(path)
        except UnsafeMemoryDir as exc:  # the folder's, not this save's: said once (each save said it again)
            _REFUSED_DIR(f"ettr: memory copies are not kept ({exc}); restores read storage (said once)")
            written = self._keep_none(path)
        except OSError as exc:
            logger.warning(
                "ettr: memory copy of step %d failed (%s); restores read storage", binding.step, exc
            )
            written = self._keep_none(path)
        finally:
            if lent is not None and lent is not self._sealed:
                self._close_slot(lent)
        self.last_kept_bytes = written
        return written

    def _keep_none(self, path: Path) -> int:
        """No copy of this save: the older one at `path` is removed (a restore must not take it for the newest)
        and the slots let go. Returns the bytes kept: 0."""
        self.discard(path)
        self.release_slots()
        return 0

    def _write_copy(
        self,
        path: Path,
        state_dict: dict[str, Any],
        binding: Binding,
        piece_crcs: Mapping[tuple[int, int], int] | None,
    ) -> int:
        """The copy written the usual way (a copy of every staged byte), over this process's own file in
        place where it can be, else a new file renamed into place."""
        over, self._own_file = self._own_file, None
        sealed, self._sealed = self._sealed, None
        self._close_slot(sealed)  # its file is overwritten or replaced here: no longer a slot
        written = 0

        def write(to: Path, over: FileId | None = None) -> int:
            return snapshot.write(
                to,
                state_dict,
                binding=binding,
                rank=self.rank,
                created_ts=time.time(),
                piece_crcs=piece_crcs,
                over=over,
            )

        if over is not None and not snapshot.still_mapped(over) and FileId.of(path) == over:
            self._remove_strays(path)
            with contextlib.suppress(snapshot.NotReusable):  # replaced meanwhile: a new file, below
                written = write(path, over=over)
        if not written:
            written = self._write_into_place(path, write)
        self._own_file = FileId.of(path)
        return written

    def _seal(
        self,
        slot: Slot,
        state_dict: dict[str, Any],
        binding: Binding,
        piece_crcs: Mapping[tuple[int, int], int] | None,
    ) -> int:
        """Seal the lent slot (the staged copy is its payload) and swap it into `own_path` atomically; the
        old copy's file is then at `staging_path`. Raises NotReusable (nothing renamed), OSError."""
        staging, path = self.staging_path(), self.own_path()
        if not slot.is_at(staging):
            raise snapshot.NotReusable(f"{staging} is not the slot this process lent")
        written = snapshot.seal(
            slot, state_dict, binding=binding, rank=self.rank, created_ts=time.time(), piece_crcs=piece_crcs
        )
        swapped = False
        try:
            swapped = _exchange(staging, path)
        except FileNotFoundError:  # no copy at `own_path` (removed): the slot simply takes its place
            pass
        if not swapped:
            os.replace(staging, path)  # atomic too; the old copy's pages are freed, not reused
        previous, self._sealed = self._sealed, slot
        previous_file, self._own_file = self._own_file, slot.file_id()
        if not swapped:
            self._close_slot(previous)
            previous, previous_file = None, None
        self._spare = previous
        self._spare_file = previous_file if previous is None else None
        return written

    def _lend_next(self, state_dict: dict[str, Any], size: int) -> None:
        """Prepare the slot the next save stages into: the file swapped out of `own_path` (its pages, and
        its mapping where it was a slot, reused) while it is still that file and nothing maps it privately
        (a restore's tensors); else a new file, where there is room for it."""
        staging = self.staging_path()
        spare, self._spare = self._spare, None
        spare_file, self._spare_file = self._spare_file, None
        if not self.staging_slots:
            self._close_slot(spare)
            self.discard(staging)
            return
        slot: Slot | None = None
        if spare is not None:
            if spare.is_at(staging) and not snapshot.still_mapped(spare.file_id()) and spare.fits(state_dict):
                spare.unseal()
                slot = spare
            else:
                self._close_slot(spare)
        elif spare_file is not None and not snapshot.still_mapped(spare_file):
            with contextlib.suppress(snapshot.NotReusable, snapshot.SnapshotUnsupported, FileNotFoundError):
                slot = snapshot.prepare_slot(staging, state_dict, over=spare_file)
        if slot is None:
            self.discard(staging)  # a slot of another process (killed), or one that does not fit this state
            if self._no_room(size, new_file=True):
                return  # the next save stages into private buffers, as without slots
            with contextlib.suppress(snapshot.NotReusable):
                slot = snapshot.prepare_slot(staging, state_dict)
        if slot is None:
            return
        self._lent = slot
        self._lend_keys = snapshot.tensor_keys(state_dict)
        # Here, on the persist's thread after the commit, not in the next save's blocking copy: a new slot's
        # pages allocated and zeroed, an old copy's file mapped (nothing written; a no-op where mapped).
        slot.prefault()

    def staging_views(self) -> dict[tuple[int, int], Any]:
        """The lent slot's views by the `buffer_key` of the staged tensor each takes the place of (what
        `ReusedStager.lend` takes); empty when no slot is lent."""
        slot = self._lent
        if slot is None:
            return {}
        return {key: view for key, view in zip(self._lend_keys, slot.views, strict=True) if key is not None}

    def _close_slot(self, slot: Slot | None) -> None:
        if slot is not None and slot is not self._lent and slot is not self._sealed:
            slot.close()

    def release_slots(self) -> None:
        """Let go of the staging slots: unmapped, the staging file removed (it is never a copy to restore);
        the copy at `own_path` stays. The stager must be lent `staging_views()` (now empty) after this."""
        lent, sealed, spare = self._lent, self._sealed, self._spare
        self._lent = self._sealed = self._spare = None
        self._spare_file = None
        for slot in (lent, sealed, spare):
            if slot is not None:
                slot.close()
        self.discard(self.staging_path())

    def keep_held(self, rank: int, data: memoryview) -> bool:
        """Hold peer `rank`'s snapshot bytes (as it sent them); its header is checked first. Returns whether
        it was kept."""
        path = self.held_path(rank)
        try:
            header = snapshot.parse_bytes(data)
            if header.info.rank != rank:
                raise CheckpointInvalid(f"a snapshot of rank {header.info.rank} sent as rank {rank}'s")
            why = self._no_room(data.nbytes)
            if why:
                self.discard(path)
                logger.info("ettr: not holding rank %d's memory copy (%s)", rank, why)
                return False
            self._write_into_place(path, lambda tmp: _write_bytes(tmp, data))
        except UnsafeMemoryDir as exc:
            self.discard(path)
            _REFUSED_DIR(f"ettr: peers' memory copies are not held ({exc}) (said once)")
            return False
        except (CheckpointInvalid, OSError) as exc:
            self.discard(path)
            logger.warning("ettr: not holding rank %d's memory copy (%s)", rank, exc)
            return False
        return True

    def room_problem(self, size: int, *, new_file: bool = True) -> str:
        """Why a snapshot of `size` bytes cannot be kept in this directory ("" if it can): the limit, the
        folders' checks (raises UnsafeMemoryDir), the free-space reserve where it is a `new_file`."""
        return self._no_room(size, new_file=new_file)

    def _no_room(self, size: int, *, new_file: bool = True) -> str:
        """Why a copy of `size` bytes cannot be kept ("" if it can); `new_file=False`: its bytes are in the
        file system already (a sealed slot), only the limit and the folder are checked."""
        if self.max_bytes is not None and size > self.max_bytes:
            return f"{size} bytes > the {self.max_bytes}-byte limit"
        with self._bookkeeping:  # the persist's thread and the memory tier's (the training loop's) both
            _ensure_private(self.directory.parent)
            _ensure_private(self.directory)
            self._write_owner()
            self._lease_name = self._lease_name or memory_sweep.lease_name()
            if not os.path.lexists(self.directory / self._lease_name):  # who keeps these copies alive
                memory_sweep.write_lease(self.directory)  # (`ettr.memory_sweep`)
        if not new_file:
            return ""
        fs = os.statvfs(self.directory)
        free = fs.f_bavail * fs.f_frsize
        reserve = min(self.reserve_bytes, fs.f_blocks * fs.f_frsize // 10)
        if size + reserve > free:
            return f"{size} bytes would leave less than {reserve} of {free} free in {self.directory}"
        return ""

    def _write_owner(self) -> None:
        path = self.directory / MEMORY_OWNER_NAME
        try:
            if os.fsdecode(path.read_bytes()).strip() == self.owner:
                return
        except OSError:
            pass
        data = os.fsencode(self.owner) + b"\n"  # the path's bytes: a run directory need not be UTF-8
        self._write_into_place(path, lambda tmp: _write_bytes(tmp, memoryview(data)))

    def _write_into_place(self, path: Path, write: Any) -> int:
        self._remove_strays(path)
        tmp = path.with_name(f"{self._stray_prefix(path)}{secrets.token_hex(6)}.tmp")
        try:
            written = int(write(tmp))
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return written

    def _stray_prefix(self, path: Path) -> str:
        # The rank is in the name: every rank writes the shared `owner` file, and one rank's clean-up must
        # never remove another's temporary file while it is being written (its rename then failed, and
        # with it that rank's memory copy).
        return f".{path.name}.r{self.rank}."

    def _remove_strays(self, path: Path) -> None:
        """Temporary files of `path` this rank left behind when it was killed writing them."""
        prefix = self._stray_prefix(path)
        with contextlib.suppress(OSError), os.scandir(self.directory) as entries:
            for entry in entries:
                if entry.name.startswith(prefix) and entry.name.endswith(".tmp"):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)

    # -- finding ----------------------------------------------------------------------------------------------
    def find(self, binding: Binding, *, rank: int | None = None) -> Found:
        """This rank's copy (or the copy held for peer `rank`) if it is the copy of `binding` and its header
        verifies; the payload is checked by `Snapshot.load`. Never raises."""
        path = self.own_path() if rank is None else self.held_path(rank)
        want = self.rank if rank is None else rank
        if rank is None and self._lent is None and self._sealed is None:
            self.discard(self.staging_path())  # a killed predecessor's slot: never a copy, only memory held
        opened = self.open_found(path, "memory copy")
        if opened.snapshot is None:
            return opened
        found = opened.snapshot
        info = found.info
        problem = ""
        if info.rank != want:
            problem = f"it is rank {info.rank}'s, not rank {want}'s"
        elif info.binding.step != binding.step:
            problem = f"it holds step {info.binding.step}, the newest commit is step {binding.step} (stale)"
        elif info.binding.world_size != binding.world_size:
            problem = f"it was saved by {info.binding.world_size} ranks, not {binding.world_size}"
        elif info.binding.manifest_sha256 != binding.manifest_sha256:
            problem = f"it belongs to another commit of step {binding.step} (manifest digest differs)"
        elif info.binding.lineage:  # never taken for a storage commit's copy (`memory_tier`)
            problem = "it is a memory-tier copy"
        if problem:
            found.close()
            return Found(snapshot=None, reason=f"memory copy not used: {problem}")
        return Found(snapshot=found)

    def open_found(self, path: Path, what: str) -> Found:
        """`open_checked`, with why it failed as the reason (`what`: "memory copy", "memory-tier copy")."""
        try:
            return Found(snapshot=self.open_checked(path))
        except FileNotFoundError:
            return Found(snapshot=None, reason=f"no {what}")
        except (CheckpointInvalid, OSError) as exc:
            return Found(snapshot=None, reason=f"{what} unusable: {exc}")

    def open_checked(self, path: Path) -> Snapshot:
        """Open the snapshot at `path` in this root's directory, its folders checked private first and its
        header verified (`snapshot.open_snapshot`). Raises CheckpointInvalid, OSError (FileNotFoundError:
        none), UnsafeMemoryDir."""
        # the folder above too: whoever may write it can swap this folder for theirs after its check
        _ensure_private(self.directory.parent)
        _ensure_private(self.directory)
        return snapshot.open_snapshot(path)

    # -- removing ---------------------------------------------------------------------------------------------
    @staticmethod
    def discard(path: Path) -> None:
        with contextlib.suppress(OSError):
            os.unlink(path)

    def remove_all(self) -> None:
        """Remove this rank's copy and the copies it holds for peers (the job is over for this rank)."""
        self.release_slots()
        self.discard(self.own_path())
        with contextlib.suppress(OSError), os.scandir(self.directory) as entries:
            for entry in entries:
                own_tier = (f"rank-{self.rank}.mem.snap", f".rank-{self.rank}.mem.snap.")  # `memory_tier`'s
                if (
                    entry.name.startswith("held-rank-")
                    or entry.name.startswith(f".rank-{self.rank}.snap.")
                    or entry.name.startswith(own_tier)
                ):
                    self.discard(Path(entry.path))
        memory_sweep.remove_lease(self.directory)
        with contextlib.suppress(OSError):
            # the last rank out; not while another rank's process runs: one that had no copy (none fitted)
            # may be about to write its copy of the final step, and lost it to the removal ("memory copy of
            # step N failed (No such file or directory ...)" at the end of a job that completed)
            if memory_sweep.only_bookkeeping_left(self.directory) and not memory_sweep.another_keeper_runs(
                self.directory
            ):
                shutil.rmtree(self.directory)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap the files at `a` and `b` in one atomic step (Linux `renameat2(RENAME_EXCHANGE)`): at every
    moment each name is one of the two complete files. False where the OS or file system cannot (the
    caller renames instead); FileNotFoundError where either is missing."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), os.fspath(b))


def exchange(a: Path, b: Path) -> bool:
    """Swap the files at `a` and `b` atomically where the OS can (`_exchange`); the memory tier's too."""
    return _exchange(a, b)


def _write_bytes(path: Path, data: memoryview) -> int:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, 0o600)
    try:
        done = 0
        while done < data.nbytes:
            done += os.write(fd, data[done:])
    finally:
        os.close(fd)
    return data.nbytes


def fill(target: Any, loaded: Any, where: str = "") -> Any:
    """Put `loaded` (a snapshot's state dict) into `target` (`TrainState.load_target`'s) the way DCP loads:
    tensors are copied into the target's own tensors in place, other leaves are replaced. Raises
    CheckpointInvalid where the two trees differ (a key missing, a shape or dtype that is not the target's)."""
    import torch

    if isinstance(target, dict):
        if not isinstance(loaded, dict):
            raise CheckpointInvalid(f"memory copy: {where or 'the state'} is not a dict")
        for key in list(target):
            if key not in loaded:
                raise CheckpointInvalid(f"memory copy lacks {where}{key}")
            target[key] = fill(target[key], loaded[key], f"{where}{key}.")
        return target
    if isinstance(target, list | tuple):
        if not isinstance(loaded, list | tuple) or len(loaded) != len(target):
            raise CheckpointInvalid(f"memory copy: {where.rstrip('.')} has another length")
        items = [fill(t, v, f"{where}{i}.") for i, (t, v) in enumerate(zip(target, loaded, strict=True))]
        if isinstance(target, list):
            target[:] = items
            return target
        return tuple(items)
    if isinstance(target, torch.Tensor):
        if (
            not isinstance(loaded, torch.Tensor)
            or loaded.shape != target.shape
            or loaded.dtype != target.dtype
        ):
            raise CheckpointInvalid(f"memory copy: {where.rstrip('.')} has another shape or dtype")
        with torch.no_grad():
            target.copy_(loaded)
        return target
    return loaded
