"""Large raw records are written past the page cache (`ettr.checkpoint.direct_io`): each starts on a block of
its file, the staging buffers and memory-copy slots that hold them start on a page, and what is read back
is unchanged — with the gaps, and from files written before them (no gaps)."""

from __future__ import annotations

import fcntl
import io
import mmap
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata

from ettr.checkpoint import CheckpointConfig, CheckpointManager, IntervalConfig, TrainState, direct_io, raw
from ettr.checkpoint.base import step_dir_name
from ettr.checkpoint.commit import verify
from ettr.checkpoint.snapshot import open_snapshot, prepare_slot
from ettr.checkpoint.staging import ReusedStager
from ettr.checkpoint.storage import LocalStorage
from ettr.ledger.base import MemoryLedger
from ettr.testing.recorder import SyncRecorder

BIG = (
    direct_io.MIN_BYTES // 4 + 123
)  # float32 elements: a record over MIN_BYTES whose length is no block multiple


def _takes_direct_io(directory: Path) -> bool:
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        fd = os.open(directory / ".probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(directory / ".probe")
    return True


def _state(seed: int) -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, BIG // 3 + 1), torch.nn.Linear(BIG // 3 + 1, 2)
    )  # one large weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    return TrainState(model=model, optimizer=optimizer)


def _manager(root: Path, state: TrainState, **config: Any) -> CheckpointManager:
    cfg = CheckpointConfig(root=str(root), interval=IntervalConfig(every_steps=5), raw_tensors=True, **config)
    return CheckpointManager(cfg, state, recorder=SyncRecorder(MemoryLedger()))


def _equal(a: TrainState, b: TrainState) -> bool:
    ma, mb = a.model.state_dict(), b.model.state_dict()
    assert a.optimizer is not None and b.optimizer is not None
    oa, ob = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    return all(torch.equal(ma[k], mb[k]) for k in ma) and all(
        torch.equal(oa[p][k], ob[p][k]) for p in oa for k in oa[p]
    )


def _large_records(root: Path, step: int) -> list[Any]:
    with open(root / step_dir_name(step) / ".metadata", "rb") as f:
        metadata: Metadata = pickle.load(f)  # noqa: S301 - the test's own checkpoint
    return [i for i in metadata.storage_data.values() if raw.is_raw(i) and i.length >= direct_io.MIN_BYTES]


@pytest.mark.parametrize("memory_copy", [False, True])
def test_large_records_start_on_a_block_and_load_back_bit_identical(
    tmp_path: Path, memory_copy: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    written = []
    real = direct_io.write_aligned

    def counting(raw_stream: Any, view: memoryview) -> int:
        written.append(real(raw_stream, view))
        return written[-1]

    monkeypatch.setattr("ettr.checkpoint.checksums.write_aligned", counting)
    monkeypatch.setenv("ETTR_MEMORY_DIR", str(tmp_path / "shm"))
    saved = _state(0)
    with _manager(tmp_path / "ckpt", saved, memory_copy=memory_copy) as manager:
        for step in (5, 10):  # the second save stages into the memory copy's slot (when there is one)
            manager.save(step, wait=True)
    records = _large_records(tmp_path / "ckpt", 10)
    assert len(records) == 2 and all(info.offset % direct_io.ALIGN == 0 for info in records)
    assert verify(LocalStorage(str(tmp_path / "ckpt")), step_dir_name(10), secret=None)  # CRC-32s: gaps too
    if _takes_direct_io(tmp_path):
        assert sum(1 for n in written if n) >= 4  # both saves: every large record, past the page cache
    restored = _state(1)
    with _manager(tmp_path / "ckpt", restored, memory_copy=False) as manager:
        assert manager.restore() == 10
    assert _equal(saved, restored)


def test_process_mode_writes_large_records_on_blocks_and_loads_them_back(tmp_path: Path) -> None:
    """DCP's checkpoint process writes from the shared-memory staging buffers (page-aligned views too)."""
    saved = _state(0)
    cfg = CheckpointConfig(
        root=str(tmp_path),
        interval=IntervalConfig(every_steps=5),
        raw_tensors=True,
        mode="process",
        memory_copy=False,
    )
    with CheckpointManager.create(cfg, saved, recorder=SyncRecorder(MemoryLedger())) as manager:
        manager.save(5, wait=True)
    records = _large_records(tmp_path, 5)
    assert len(records) == 2 and all(info.offset % direct_io.ALIGN == 0 for info in records)
    restored = _state(1)
    with _manager(tmp_path, restored, memory_copy=False) as manager:
        assert manager.restore() == 5
    assert _equal(saved, restored)


def test_files_written_before_the_gaps_still_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A raw checkpoint of an ettr before 2026-12-05 (records back to back, written through the page cache)."""
    monkeypatch.setattr(direct_io, "MIN_BYTES", 1 << 62)
    saved = _state(0)
    with _manager(tmp_path, saved, memory_copy=False) as manager:
        manager.save(5, wait=True)
    monkeypatch.undo()
    assert any(info.offset % direct_io.ALIGN for info in _large_records(tmp_path, 5))
    restored = _state(1)
    with _manager(tmp_path, restored, memory_copy=False) as manager:
        assert manager.restore() == 5
    assert _equal(saved, restored)


def test_write_aligned_writes_whole_blocks_from_aligned_memory_at_an_aligned_position(tmp_path: Path) -> None:
    if not _takes_direct_io(tmp_path):
        pytest.skip("this file system does not take O_DIRECT")
    page = mmap.mmap(-1, 3 * direct_io.ALIGN)  # page-aligned memory
    page.write(os.urandom(3 * direct_io.ALIGN))
    view = memoryview(page)[: 2 * direct_io.ALIGN + 100]
    path = tmp_path / "f"
    with open(path, "wb") as stream:
        stream.write(b"x" * direct_io.ALIGN)  # buffered, then flushed by write_aligned
        flags = fcntl.fcntl(stream.fileno(), fcntl.F_GETFL)
        assert direct_io.write_aligned(stream, view) == 2 * direct_io.ALIGN
        assert fcntl.fcntl(stream.fileno(), fcntl.F_GETFL) == flags  # O_DIRECT only for that write
        stream.write(view[2 * direct_io.ALIGN :])
        assert stream.tell() == 3 * direct_io.ALIGN + 100
    assert path.read_bytes() == b"x" * direct_io.ALIGN + bytes(view)
    del view
    page.close()


def test_write_aligned_declines_what_it_cannot_write_directly(tmp_path: Path) -> None:
    page = mmap.mmap(-1, 3 * direct_io.ALIGN)
    view = memoryview(page)
    assert direct_io.write_aligned(io.BytesIO(), view) == 0  # no file descriptor
    with open(tmp_path / "f", "wb") as stream:
        stream.write(b"x")  # an unaligned position
        assert direct_io.write_aligned(stream, view) == 0
    with open(tmp_path / "g", "wb") as stream:
        assert direct_io.write_aligned(stream, view[1:]) == 0  # an unaligned address
        assert direct_io.write_aligned(stream, view[: direct_io.ALIGN - 1]) == 0  # less than a block
    assert (tmp_path / "f").read_bytes() == b"x" and (tmp_path / "g").read_bytes() == b""
    del view
    page.close()


def test_large_staging_buffers_and_slot_tensors_start_on_a_page(tmp_path: Path) -> None:
    state = {"big": torch.randn(BIG), "small": torch.randn(10), "big2": torch.randn(BIG).to(torch.float64)}
    staged = ReusedStager().stage(state)
    assert isinstance(staged, dict)
    assert (
        staged["big"].data_ptr() % direct_io.ALIGN == 0 and staged["big2"].data_ptr() % direct_io.ALIGN == 0
    )
    assert all(torch.equal(staged[k], state[k]) for k in state)
    # each its own storage, exactly its size: DCP's own writer clones a tensor that views a larger one
    assert all(staged[k].untyped_storage().nbytes() == staged[k].nbytes for k in ("big", "big2"))
    slot = prepare_slot(tmp_path / "slot", state)
    try:
        by_shape = {tuple(v.shape) + (v.dtype,): v for v in slot.views}
        assert by_shape[(BIG, torch.float32)].data_ptr() % direct_io.ALIGN == 0
        assert by_shape[(BIG, torch.float64)].data_ptr() % direct_io.ALIGN == 0
    finally:
        slot.close()


def test_an_older_snapshot_layout_still_opens(tmp_path: Path) -> None:
    """A memory copy written before the tensors started on a page (`snapshot.write` keeps that layout)."""
    from ettr.checkpoint.snapshot import Binding, write

    state = {"big": torch.randn(BIG), "n": 3}
    write(
        tmp_path / "s.snap",
        state,
        binding=Binding(step=1, manifest_sha256="0" * 64, world_size=1),
        rank=0,
        created_ts=0.0,
    )
    with open_snapshot(tmp_path / "s.snap") as snapshot:
        loaded = snapshot.load()
        assert torch.equal(loaded["big"], state["big"]) and loaded["n"] == 3
