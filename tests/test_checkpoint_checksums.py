"""A save sums its files as it writes them (`ettr.checkpoint.checksums`): the commit reads no data file back,
the memory copy does not sum the staged tensors again, and what load verifies is unchanged — a file changed
on its way to storage, or a memory copy whose bytes are not the ones summed, is still refused."""

from __future__ import annotations

import contextlib
import io
import pickle
import random
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from ettr.checkpoint import CheckpointConfig, CheckpointManager, IntervalConfig, TrainState, checksums
from ettr.checkpoint import snapshot as snapshot_module
from ettr.checkpoint.base import MANIFEST_NAME, CheckpointError, CheckpointInvalid, step_dir_name
from ettr.checkpoint.checksums import PIECE_MIN_BYTES, SummingFileSystem, Sums, crc32, crc32_combine
from ettr.checkpoint.commit import commit, find_latest, verify
from ettr.checkpoint.memory import MemoryCopies
from ettr.checkpoint.snapshot import Binding, open_snapshot, write
from ettr.ledger.base import MemoryLedger
from ettr.run_env import memory_root
from ettr.testing.memory_storage import MemoryStorage
from ettr.testing.recorder import SyncRecorder


def test_crc32_combine_is_zlibs() -> None:
    rng = random.Random(7)
    for len_a, len_b in [(0, 0), (0, 5), (5, 0), (1, 1), (100, 4096), (3, 1 << 20), (70_001, 123_457)]:
        a, b = rng.randbytes(len_a), rng.randbytes(len_b)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len_b) == zlib.crc32(a + b)


def test_crc32_is_zlibs_whichever_implementation_is_installed() -> None:
    """`crc32` (zlib-ng's or ISA-L's where installed, else zlib's) gives zlib's values, so checkpoints summed
    with one verify with any other, before and after: same buffers, same start values."""
    rng = random.Random(3)
    buffers: list[Any] = [b"", b"a", rng.randbytes(4097), bytearray(rng.randbytes(1 << 20))]
    buffers.append(memoryview(torch.arange(1000, dtype=torch.float32).numpy()))
    for data in buffers:
        for start in (0, 1, 0xFFFFFFFF):
            assert crc32(data, start) == zlib.crc32(data, start)


def test_a_fast_crc32_that_disagrees_with_zlib_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    broken = types.ModuleType("ettr_test_broken_crc")
    broken.crc32 = lambda data, value=0: (zlib.crc32(data, value) + 1) & 0xFFFFFFFF  # type: ignore[attr-defined]
    monkeypatch.setitem(__import__("sys").modules, "ettr_test_broken_crc", broken)
    monkeypatch.setattr(checksums, "FAST_CRC32_MODULES", ("ettr_test_broken_crc", "ettr_test_absent_crc"))
    checksums.crc32_implementation.cache_clear()
    try:
        assert checksums.crc32_implementation() is zlib.crc32
    finally:
        checksums.crc32_implementation.cache_clear()


class CountingStorage(MemoryStorage):
    """A `MemoryStorage` that counts the files read (and can damage data files as they are stored)."""

    def __init__(self, damage: str = "") -> None:
        super().__init__()
        self.reads: list[str] = []
        self.damage = damage

    @contextlib.contextmanager
    def open_read(self, rel: str) -> Any:
        self.reads.append(rel)
        yield io.BytesIO(self.read_bytes(rel))

    def _put(self, rel: str, data: bytes) -> None:
        if rel.endswith(".distcp") and self.damage == "flip":
            data = bytearray(data)
            data[len(data) // 2] ^= 0x01  # one bit changed between DCP's write and the medium
            data = bytes(data)
        elif rel.endswith(".distcp") and self.damage == "truncate":
            data = data[:-10]
        super()._put(rel, data)


def _state(hidden: int = 64) -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.Linear(hidden, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, hidden)).sum().backward()
    optimizer.step()
    return TrainState(model=model, optimizer=optimizer)


def _manager(storage: MemoryStorage, state: TrainState, **config: Any) -> CheckpointManager:
    cfg = CheckpointConfig(root=storage.url, interval=IntervalConfig(every_steps=1), **config)
    return CheckpointManager(cfg, state, recorder=SyncRecorder(MemoryLedger()), storage=storage)


def test_a_save_reads_none_of_its_files_back_and_its_manifest_sums_what_is_stored() -> None:
    storage = CountingStorage()
    with _manager(storage, _state(), memory_copy=False) as manager:
        assert manager.save(3, wait=True)
    name = step_dir_name(3)
    assert [
        rel for rel in storage.reads if not rel.endswith(MANIFEST_NAME)
    ] == []  # no data file, no .metadata
    manifest = verify(storage, name)  # every file's CRC-32, re-read here, matches what the save recorded
    assert set(manifest.files) == {".metadata", "__0_0.distcp"}
    for file_name, entry in manifest.files.items():
        data = storage.files[f"{name}/{file_name}"]
        assert (entry.size, entry.crc32) == (len(data), zlib.crc32(data))


def test_the_metadata_dcp_writes_holds_only_dcps_own_storage_info() -> None:
    storage = CountingStorage()
    with _manager(storage, _state(), memory_copy=False) as manager:
        assert manager.save(1, wait=True)
    metadata = pickle.loads(storage.files[f"{step_dir_name(1)}/.metadata"])
    assert {type(info).__name__ for info in metadata.storage_data.values()} == {"_StorageInfo"}


def test_a_file_changed_on_its_way_to_storage_fails_its_check_at_load() -> None:
    """The manifest records the CRC-32 of the bytes DCP wrote; a read-back sum recorded the damage instead,
    and the damaged checkpoint verified."""
    storage = CountingStorage(damage="flip")
    with _manager(storage, _state(), memory_copy=False) as manager:
        assert manager.save(2, wait=True)  # the damage is not visible to the writer
    with pytest.raises(CheckpointInvalid, match="fails its CRC-32 check"):
        verify(storage, step_dir_name(2))
    assert find_latest(storage).latest is None
    with _manager(storage, _state(), memory_copy=False) as manager:
        assert manager.restore() is None


def test_a_file_stored_shorter_than_written_never_commits() -> None:
    storage = CountingStorage(damage="truncate")
    with _manager(storage, _state(), memory_copy=False) as manager:
        assert not manager.save(4, wait=True)
    assert MANIFEST_NAME not in storage.list_dir(step_dir_name(4))


def test_commit_reads_back_only_files_without_a_sum() -> None:
    storage = CountingStorage()
    name = step_dir_name(5)
    storage.write_atomic(f"{name}/a", b"alpha")
    storage.write_atomic(f"{name}/b", b"beta")
    commit(storage, 5, ["a", "b"], sums={"a": (5, zlib.crc32(b"alpha"))})
    assert storage.reads == [f"{name}/b"]
    verify(storage, name)
    with pytest.raises(CheckpointError, match="has 4 bytes in storage, 9 were written"):
        commit(storage, 5, ["a", "b"], sums={"b": (9, 0)})


class _DictFs:
    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}

    @contextlib.contextmanager
    def create_stream(self, path: str, mode: str) -> Any:
        stream = io.BytesIO()
        yield stream
        self.files[path] = stream.getvalue()


def test_a_stream_that_seeks_or_fails_records_no_sum() -> None:
    sums = Sums()
    fs = SummingFileSystem(_DictFs(), sums)
    with fs.create_stream("d/whole", "wb") as stream:
        stream.write(b"abc")
        stream.write(memoryview(b"def"))
    with fs.create_stream("d/sought", "wb") as stream:
        stream.write(b"abc")
        stream.seek(0)
        stream.write(b"x")
    with pytest.raises(RuntimeError), fs.create_stream("d/failed", "wb") as stream:
        stream.write(b"abc")
        raise RuntimeError
    assert sums.files == {"whole": (6, zlib.crc32(b"abcdef"))}


def test_a_staged_buffer_written_whole_leaves_its_own_crc() -> None:
    buffer = torch.arange(PIECE_MIN_BYTES // 4, dtype=torch.float32)
    raw = memoryview(buffer.numpy()).cast("B")
    sums = Sums(expect=frozenset({(buffer.data_ptr(), raw.nbytes)}))
    fs = SummingFileSystem(_DictFs(), sums)
    with fs.create_stream("d/f", "wb") as stream:
        stream.write(b"header")
        stream.write(raw)
        stream.write(b"trailer")
    assert sums.pieces == {(buffer.data_ptr(), raw.nbytes): zlib.crc32(raw)}
    assert sums.files["f"] == (raw.nbytes + 13, zlib.crc32(b"header" + bytes(raw) + b"trailer"))
    assert pickle.loads(pickle.dumps(sums)).pieces == {}  # addresses never travel to another process


# -- the memory copy --------------------------------------------------------------------------------------------

BINDING = Binding(step=3, manifest_sha256="cd" * 32, world_size=1)


def test_a_snapshot_sums_only_what_was_not_summed_already(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = torch.randn(PIECE_MIN_BYTES // 4)
    small = torch.ones(3)
    key = (big.data_ptr(), big.numel() * 4)
    summed: list[int] = []
    monkeypatch.setattr(
        snapshot_module,
        "zlib",
        type("Z", (), {"crc32": staticmethod(lambda d, c=0: summed.append(len(d)) or zlib.crc32(d, c))}),
    )
    path = tmp_path / "s.snap"
    write(
        path,
        {"big": big, "small": small},
        binding=BINDING,
        rank=0,
        created_ts=1.0,
        piece_crcs={key: zlib.crc32(memoryview(big.numpy()).cast("B"))},
    )
    assert big.numel() * 4 not in summed  # only the small tensor and the header were summed
    with open_snapshot(path) as snap:
        loaded = snap.load()  # the payload's CRC-32, summed whole at load, matches
        assert torch.equal(loaded["big"], big)
        del loaded


def test_a_snapshot_whose_given_crc_is_not_its_bytes_is_refused_at_load(tmp_path: Path) -> None:
    big = torch.randn(PIECE_MIN_BYTES // 4)
    path = tmp_path / "s.snap"
    write(
        path,
        {"big": big},
        binding=BINDING,
        rank=0,
        created_ts=1.0,
        piece_crcs={(big.data_ptr(), big.numel() * 4): 12345},
    )
    with open_snapshot(path) as snap, pytest.raises(CheckpointInvalid, match="CRC-32"):
        snap.load()


def test_the_memory_copy_reuses_the_persists_sums(monkeypatch: pytest.MonkeyPatch) -> None:
    summed: list[int] = []
    monkeypatch.setattr(
        snapshot_module,
        "zlib",
        type("Z", (), {"crc32": staticmethod(lambda d, c=0: summed.append(len(d)) or zlib.crc32(d, c))}),
    )
    storage = CountingStorage()
    hidden = 1024  # 4 MiB weights: staged buffers written whole
    state = _state(hidden)
    with _manager(storage, state) as manager:
        assert manager.save(6, wait=True)
        assert manager.memory is not None and manager.memory.own_path().is_file()
    assert hidden * hidden * 4 not in summed
    copies = MemoryCopies.for_root(memory_root(), storage.url, rank=0)
    restored = _state(hidden)
    with _manager(storage, restored) as manager:
        assert manager.restore() == 6 and manager.restored_from == "memory"
    assert torch.equal(restored.model[0].weight, state.model[0].weight)
    copies.remove_all()
