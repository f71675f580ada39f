"""Memory-tier commits: each rank's live state copied to shared memory between storage commits.

A storage commit every few seconds bounds what a failure loses to that interval; a recovery that restores
from memory (a restart in place, a process restarted on a surviving node) can lose less. With
`CheckpointConfig.memory_interval` set, every rank copies its live state, at the same step on every rank,
into a snapshot file of its own in the memory copies' private directory, `rank-<r>.mem.snap`, through a
staging slot of its own (`.rank-<r>.mem.snap.staging`): the state is copied into the slot's mapped views,
the slot sealed (byte strings, header, payload CRC-32 over every byte, magic last: `snapshot.seal`) and
swapped with the copy in one atomic `renameat2(RENAME_EXCHANGE)`; the copy swapped out is the next slot.

Its binding (`snapshot.Binding`): the step S, the world size, the manifest digest of the newest storage
commit this process knew (N), and a lineage token that rank 0 draws at each restore and every rank of that
process lifetime shares. A restore uses it only when every rank holds a copy of the same (S, token), made
after the storage commit that is the newest in storage now, with S > N (`manager`); otherwise the
storage-tier paths run as before. Nothing else here is trusted: the same folder, owner and CRC checks as a
storage-tier copy's (`memory.MemoryCopies.open_checked`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

from ettr.checkpoint import snapshot
from ettr.checkpoint.memory import Found, MemoryCopies, UnsafeMemoryDir, exchange
from ettr.checkpoint.snapshot import Binding, Slot

logger = logging.getLogger("ettr")


class MemoryTier:
    """One rank's memory-tier copy, kept in the directory of its `MemoryCopies` (see the module docstring)."""

    def __init__(self, copies: MemoryCopies) -> None:
        self.copies = copies
        self.rank = copies.rank
        self.last_kept_bytes = 0
        self.made_slot = False
        """Whether the last `keep` made a new slot (allocated its pages) rather than reusing the last one."""
        self._slot: Slot | None = None
        """The slot the next save copies into (unsealed, at `staging_path`)."""
        self._current: Slot | None = None
        """The slot this process sealed and swapped to `path` (mapped: it is the next save's slot)."""

    def path(self) -> Path:
        return self.copies.directory / f"rank-{self.rank}.mem.snap"

    def staging_path(self) -> Path:
        """Never a copy to restore: its magic is cleared while the state is copied in."""
        return self.copies.directory / f".rank-{self.rank}.mem.snap.staging"

    def keep(self, state_dict: dict[str, Any], binding: Binding) -> int:
        """Replace this rank's memory-tier copy with `state_dict` (the live state: its tensors are copied into
        the slot, the rest sealed with it) bound to `binding`; returns its size, 0 when it was not kept (the
        older copy is removed then: it is no longer the newest). Never raises for a copy that cannot be kept."""
        if not binding.lineage:
            raise ValueError("a memory-tier copy needs a lineage")
        slot: Slot | None = None
        self.made_slot = False
        try:
            slot = self._slot_for(state_dict)
            if slot is None:
                self.remove()
                return 0
            self._slot = None  # never lent again unless it comes back from the swap below
            staged = snapshot.stage_into(slot, state_dict)
            written = snapshot.seal(slot, staged, binding=binding, rank=self.rank, created_ts=time.time())
            del staged
            self._swap_in(slot)
        except (snapshot.SnapshotUnsupported, snapshot.NotReusable, UnsafeMemoryDir, OSError) as exc:
            logger.info("ettr: no memory-tier copy of step %d (%s)", binding.step, exc)
            if slot is not None and slot is not self._current:
                slot.close()
            self.remove()
            return 0
        self.last_kept_bytes = written
        return written

    def _slot_for(self, state_dict: dict[str, Any]) -> Slot | None:
        """The slot to copy into: the one swapped out by the last save where it still takes this state, else
        a new file (None where there is no room, or the state has no tensors)."""
        size = snapshot.size_of(state_dict)
        why = self.copies.room_problem(size, new_file=False)  # the limit and the folders
        slot = self._slot
        if slot is not None and not why and slot.is_at(self.staging_path()) and slot.takes(state_dict):
            slot.unseal()
            return slot
        self._close(slot)
        self._slot = None
        MemoryCopies.discard(self.staging_path())  # another process's (killed), or a slot that no longer fits
        why = why or self.copies.room_problem(size, new_file=True)
        if why:
            logger.info("ettr: no memory-tier copy (%s)", why)
            return None
        try:
            slot = snapshot.prepare_slot(self.staging_path(), state_dict)
        except snapshot.NotReusable:
            return None
        slot.prefault()
        self.made_slot = True
        return slot

    def _swap_in(self, slot: Slot) -> None:
        staging, path = self.staging_path(), self.path()
        swapped = False
        with contextlib.suppress(FileNotFoundError):  # no copy yet: the slot takes its place
            swapped = exchange(staging, path)
        if not swapped:
            os.replace(staging, path)
        previous, self._current = self._current, slot
        if swapped and previous is not None and previous.is_at(staging):
            previous.unseal()  # a slot again: no snapshot until the next save seals it
            self._slot = previous  # the copy swapped out: the next save's slot, its pages and mapping reused
        else:
            self._close(previous)
            if swapped:  # another process's copy (or one this process restored from): never written into
                MemoryCopies.discard(staging)

    def find(self, *, newest: Binding) -> Found:
        """This rank's memory-tier copy if it was made after the storage commit `newest` (the newest in
        storage: its step, manifest digest, and the world size) and holds a newer step; its header verified,
        its payload checked by `Snapshot.load`. Never raises."""
        if self._current is None:
            MemoryCopies.discard(self.staging_path())  # a killed predecessor's slot: only memory held
        opened = self.copies.open_found(self.path(), "memory-tier copy")
        if opened.snapshot is None:
            return opened
        found = opened.snapshot
        info = found.info
        problem = ""
        if info.rank != self.rank:
            problem = f"it is rank {info.rank}'s"
        elif not info.binding.lineage:
            problem = "it is a storage commit's copy"
        elif info.binding.world_size != newest.world_size:
            problem = f"it was saved by {info.binding.world_size} ranks, not {newest.world_size}"
        elif info.binding.manifest_sha256 != newest.manifest_sha256 or info.binding.base_step != newest.step:
            problem = f"it was made after another storage commit than step {newest.step}, the newest (stale)"
        elif info.binding.step <= newest.step:
            problem = f"it holds step {info.binding.step}, not newer than storage's {newest.step}"
        if problem:
            found.close()
            return Found(snapshot=None, reason=f"memory-tier copy not used: {problem}")
        return Found(snapshot=found)

    def _close(self, slot: Slot | None) -> None:
        if slot is not None and slot is not self._slot and slot is not self._current:
            slot.close()

    def release(self) -> None:
        """Let go of the slots (unmapped; the staging file removed); the copy stays for a restore."""
        slots = (self._slot, self._current)
        self._slot = self._current = None
        for slot in slots:
            if slot is not None:
                slot.close()
        MemoryCopies.discard(self.staging_path())

    def remove(self) -> None:
        """Remove this rank's memory-tier copy and its slot (no longer the newest, or the job is over)."""
        self.release()
        MemoryCopies.discard(self.path())
        self.last_kept_bytes = 0
