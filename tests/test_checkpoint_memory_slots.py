"""Staging slots: the stager copies a save into the memory copy's staging file, which becomes the memory copy
at the commit (one atomic swap, no second copy). A restore never takes a copy a later save is writing into,
and a torn slot is refused (docs/checkpointing.md, "Memory used")."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from ettr.checkpoint import CheckpointConfig, CheckpointManager, IntervalConfig, TrainState, snapshot
from ettr.checkpoint import persist as persist_module
from ettr.checkpoint.base import CheckpointInvalid
from ettr.checkpoint.memory import MemoryCopies, manifest_binding
from ettr.checkpoint.snapshot import Binding
from ettr.checkpoint.staging import ReusedStager


def _copies(tmp_path: Path) -> MemoryCopies:
    copies = MemoryCopies(tmp_path / "mem", rank=0)
    copies.staging_slots = True
    return copies


def _binding(step: int) -> Binding:
    return Binding(step=step, manifest_sha256=f"{step:064x}", world_size=1)


def _state(value: float) -> dict[str, Any]:
    return {
        "model": {"w": torch.full((64, 32), value), "b": torch.full((32,), value + 1)},
        "optim": {"m": torch.full((64, 32), -value, dtype=torch.float64)},
        "extra": b"pickled" * int(value + 1),  # a byte string whose size changes between saves
        "step": int(value),
    }


def _range(tensor: torch.Tensor) -> tuple[int, int]:
    begin = int(tensor.data_ptr())
    return begin, begin + tensor.numel() * tensor.element_size()


def _overlaps(buffers: list[torch.Tensor], slot: snapshot.Slot) -> bool:
    spans = [_range(v) for v in slot.views if v.numel()]
    return any(
        b_begin < s_end and s_begin < b_end
        for b_begin, b_end in (_range(b) for b in buffers if b.numel())
        for s_begin, s_end in spans
    )


def _save(copies: MemoryCopies, stager: ReusedStager, state: dict[str, Any], step: int) -> int:
    """One save as the manager makes it: stage, (persist, commit), keep, lend the next slot."""
    staged = stager.stage(state)
    assert isinstance(staged, dict)
    try:
        return copies.keep(staged, _binding(step))
    finally:
        stager.lend(copies.staging_views())


def _load(copies: MemoryCopies, step: int) -> dict[str, Any]:
    found = copies.find(_binding(step))
    assert found.snapshot is not None, found.reason
    with found.snapshot as snap:
        loaded = snap.load()
        return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in _flat(loaded).items()}


def _flat(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _equal(loaded: dict[str, Any], state: dict[str, Any]) -> bool:
    want = _flat(state)
    return set(loaded) == set(want) and all(
        torch.equal(v, want[k]) if isinstance(v, torch.Tensor) else v == want[k] for k, v in loaded.items()
    )


def test_the_staged_copy_becomes_the_memory_copy_without_a_second_copy(tmp_path: Path) -> None:
    copies, stager = _copies(tmp_path), ReusedStager()
    assert _save(copies, stager, _state(1.0), 1)  # the first copy is written; a slot is lent for the next
    assert copies.staging_path().is_file() and stager._lent
    for step in (2, 3, 4):
        assert _save(copies, stager, _state(float(step)), step)
        assert copies._sealed is not None and copies._sealed.is_at(copies.own_path())  # sealed, swapped in
        assert _equal(_load(copies, step), _state(float(step)))
        # every staging buffer is a view of the slot at the staging path, none of the copy at own_path
        assert copies._lent is not None and copies._lent.is_at(copies.staging_path())
        assert not _overlaps(list(stager._buffers.values()), copies._sealed)
    copies.remove_all()
    stager.close()


def test_a_restore_never_takes_a_copy_a_later_save_is_writing_into(tmp_path: Path) -> None:
    copies, stager = _copies(tmp_path), ReusedStager()
    for step in (1, 2, 3):
        _save(copies, stager, _state(float(step)), step)
    # save 4 stages (into the slot) and has not committed: the copy of step 3 is the one to restore, intact
    stager.stage(_state(4.0))
    assert _equal(_load(copies, 3), _state(3.0))
    assert copies.find(_binding(4)).snapshot is None  # nothing of step 4 is a copy before its commit
    # the slot being written reads as no snapshot at all (its magic is cleared until the seal)
    with pytest.raises(CheckpointInvalid, match="bad magic"):
        snapshot.open_snapshot(copies.staging_path())
    copies.remove_all()
    stager.close()


def test_a_slot_torn_while_sealing_is_refused_and_the_old_copy_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copies, stager = _copies(tmp_path), ReusedStager()
    _save(copies, stager, _state(1.0), 1)
    _save(copies, stager, _state(2.0), 2)
    staged = stager.stage(_state(3.0))
    assert isinstance(staged, dict)
    real_pwrite = os.pwrite

    def killed_at_the_header(fd: int, data: Any, offset: int) -> int:
        if offset == len(snapshot.MAGIC):  # the header: the process dies before it and the magic are written
            raise OSError(5, "killed")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", killed_at_the_header)
    assert copies.keep(staged, _binding(3)) == 0  # the copy of step 3 failed, said, and the stale one removed
    monkeypatch.undo()
    stager.lend(copies.staging_views())
    assert copies.find(_binding(3)).snapshot is None
    # had the torn slot been renamed into place (a crash, a bug), it would read as no snapshot at all
    slot = snapshot.prepare_slot(tmp_path / "torn.snap", staged)
    with pytest.raises(CheckpointInvalid, match="bad magic"):
        snapshot.open_snapshot(tmp_path / "torn.snap")
    slot.close()
    copies.remove_all()
    stager.close()


def test_a_sealed_copy_written_into_afterwards_fails_its_check(tmp_path: Path) -> None:
    """Were anything to write into the committed copy's pages (what lending never allows), the payload
    CRC-32 refuses it: a torn copy is never restored."""
    copies, stager = _copies(tmp_path), ReusedStager()
    for step in (1, 2):
        _save(copies, stager, _state(float(step)), step)
    assert copies._sealed is not None
    copies._sealed.views[0].add_(1.0)  # the first tensor of the sealed copy, changed in place
    found = copies.find(_binding(2))
    assert found.snapshot is not None  # the header checks out ...
    with found.snapshot as snap, pytest.raises(CheckpointInvalid, match="CRC-32"):
        snap.load()  # ... the payload does not
    copies.remove_all()
    stager.close()


def test_a_slot_still_mapped_by_a_restore_is_not_written_into(tmp_path: Path) -> None:
    copies, stager = _copies(tmp_path), ReusedStager()
    _save(copies, stager, _state(1.0), 1)
    _save(copies, stager, _state(2.0), 2)
    found = copies.find(_binding(2))
    assert found.snapshot is not None
    alive = found.snapshot.load()  # a restore whose tensors are still alive: its mapping cannot go
    found.snapshot.close()
    sealed_inode = os.lstat(copies.own_path()).st_ino
    _save(copies, stager, _state(3.0), 3)  # the copy of step 2 is swapped out; it is still mapped here
    assert copies._lent is not None and copies._lent.inode != sealed_inode  # a new slot, not that file
    _save(copies, stager, _state(4.0), 4)
    assert torch.equal(alive["model"]["w"], _state(2.0)["model"]["w"])  # what the restore holds is unchanged
    assert _equal(_load(copies, 4), _state(4.0))
    del alive
    copies.remove_all()
    stager.close()


def test_a_state_whose_shapes_change_gets_a_new_slot(tmp_path: Path) -> None:
    copies, stager = _copies(tmp_path), ReusedStager()
    _save(copies, stager, _state(1.0), 1)
    _save(copies, stager, _state(2.0), 2)
    grown = _state(3.0)
    grown["model"]["w"] = torch.full((128, 32), 3.0)
    assert _save(copies, stager, grown, 3)  # written the usual way (the slot did not fit), then a new slot
    assert _equal(_load(copies, 3), grown)
    assert _save(copies, stager, _state(4.0) | {"model": grown["model"]}, 4)
    assert copies._sealed is not None and copies._sealed.is_at(copies.own_path())
    copies.remove_all()
    assert not copies.staging_path().exists()
    stager.close()


def test_a_managers_save_in_flight_never_touches_the_copy_a_restore_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    config = CheckpointConfig(root=str(tmp_path / "ckpt"), interval=IntervalConfig(every_steps=10**6))

    def train() -> None:
        optimizer.zero_grad()
        model(torch.randn(4, 16)).sum().backward()
        optimizer.step()

    release = threading.Event()
    real_persist = persist_module.AsyncPersister._persist

    def held(self: Any, staged: Any, writer: Any) -> Any:
        if not release.is_set():
            release.wait(60)
        return real_persist(self, staged, writer)

    with CheckpointManager(config, TrainState(model=model, optimizer=optimizer)) as manager:
        assert manager.memory is not None
        for step in (1, 2):
            train()
            assert manager.save(step, wait=True)
        committed = {k: v.clone() for k, v in model.state_dict().items()}
        monkeypatch.setattr(persist_module.AsyncPersister, "_persist", held)
        train()
        manager.save(3)  # staged into the slot; its persist held before the commit
        manager.wait_staged()
        train()
        found = manager.memory.find(manifest_binding(manager.storage, 2, 1))
        assert found.snapshot is not None, found.reason
        with found.snapshot as snap:
            loaded = snap.load()
            assert all(torch.equal(loaded["model"][k], v) for k, v in committed.items())
            del loaded
        release.set()
        assert manager.wait()
        found = manager.memory.find(manifest_binding(manager.storage, 3, 1))
        assert found.snapshot is not None, found.reason
        found.snapshot.close()
        manager.memory.remove_all()


def test_the_slot_lent_for_the_next_save_is_faulted_in_and_unchanged(tmp_path: Path) -> None:
    """The next save's slot is prefaulted after the commit (on the persist's thread), not by the next save's
    blocking copy; prefaulting writes nothing: the copy it was swapped out of stays byte for byte."""
    copies, stager = _copies(tmp_path), ReusedStager()
    calls: list[snapshot.Slot] = []
    original = snapshot.Slot.prefault

    def recording(slot: snapshot.Slot) -> bool:
        calls.append(slot)
        before = bytes(slot.mapped)
        done = original(slot)
        assert bytes(slot.mapped) == before  # nothing written
        return done

    snapshot.Slot.prefault = recording  # type: ignore[method-assign]
    try:
        for step in (1, 2, 3):
            assert _save(copies, stager, _state(float(step)), step)
            assert calls and calls[-1] is copies._lent  # the slot lent for the next save, every time
            assert _equal(_load(copies, step), _state(float(step)))
    finally:
        snapshot.Slot.prefault = original  # type: ignore[method-assign]
        copies.remove_all()
        stager.close()


def test_a_restore_makes_the_first_saves_buffers_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After `restore()` the staging buffers are made before the first save (on the persist's thread), and
    the first save's copy allocates nothing."""
    from ettr.checkpoint import staging

    model = torch.nn.Linear(1024, 512)  # 2 MiB of weight: a page-aligned staging buffer
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = CheckpointConfig(root=str(tmp_path / "ckpt"), interval=IntervalConfig(every_steps=10**6))
    with CheckpointManager(config, TrainState(model=model, optimizer=optimizer)) as manager:
        assert manager.restore() is None
        stager = manager._persister.stager
        assert stager._preparing is not None
        stager._preparing.result(timeout=60)
        assert {"model.weight", "model.bias"} <= set(stager._buffers)
        allocated: list[Any] = []
        real = staging._empty_buffer
        monkeypatch.setattr(staging, "_empty_buffer", lambda *a, **k: allocated.append(a) or real(*a, **k))
        assert manager.save(1, wait=True)
        assert not allocated
        monkeypatch.undo()
        assert manager.restore() == 1
