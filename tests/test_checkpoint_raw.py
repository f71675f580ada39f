"""Raw tensor records (`ettr.checkpoint.raw`): a save writes each tensor's bytes, no `torch.save` per tensor;
they load bit-identical, with nothing unpickled; checkpoints of `torch.save` records (every one written
before) still load; a record whose metadata does not fit it is refused."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from ettr.checkpoint import CheckpointConfig, CheckpointManager, IntervalConfig, TrainState, raw
from ettr.checkpoint.base import CheckpointInvalid, step_dir_name
from ettr.checkpoint.trust import check_metadata
from ettr.ledger.base import MemoryLedger
from ettr.testing.recorder import SyncRecorder


class _Model(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.linear = torch.nn.Linear(6, 5)
        self.register_buffer("bf16", torch.randn(3, 4).to(torch.bfloat16))
        self.register_buffer("flags", torch.rand(7) > 0.5)
        self.register_buffer("steps", torch.tensor(seed + 3, dtype=torch.int64))  # 0-dim
        self.register_buffer("empty", torch.empty(0, 2))
        self.register_buffer("strided", torch.randn(4, 6)[:, ::2])  # not contiguous

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def _state(seed: int) -> TrainState:
    model = _Model(seed)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 6)).sum().backward()
    optimizer.step()
    return TrainState(model=model, optimizer=optimizer)


def _manager(root: Path, state: TrainState, **config: Any) -> CheckpointManager:
    cfg = CheckpointConfig(
        root=str(root), interval=IntervalConfig(every_steps=5), memory_copy=False, **config
    )
    if config.get("mode") == "process":
        return CheckpointManager.create(cfg, state, recorder=SyncRecorder(MemoryLedger()))
    return CheckpointManager(cfg, state, recorder=SyncRecorder(MemoryLedger()))


def _same(a: TrainState, b: TrainState) -> bool:
    assert a.optimizer is not None and b.optimizer is not None
    ma, mb = a.model.state_dict(), b.model.state_dict()
    oa, ob = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    return (
        ma.keys() == mb.keys()
        and all(ma[k].dtype == mb[k].dtype and torch.equal(ma[k], mb[k]) for k in ma)
        and all(torch.equal(oa[p][k], ob[p][k]) for p in oa for k in oa[p])
    )


def _metadata(root: Path, step: int) -> Metadata:
    with open(root / step_dir_name(step) / ".metadata", "rb") as f:
        return pickle.load(f)  # noqa: S301 - the test's own checkpoint


def _descriptors(metadata: Metadata) -> set[Any]:
    return {tuple(info.transform_descriptors or ()) for info in metadata.storage_data.values()}


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_raw_records_load_back_bit_identical(tmp_path: Path, mode: str) -> None:
    saved = _state(0)
    with _manager(tmp_path, saved, mode=mode, raw_tensors=True) as manager:
        manager.save(5, wait=True)
    # tensors are raw records; the pickled parts (step, RNG, ...) are DCP's as before
    assert _descriptors(_metadata(tmp_path, 5)) == {(raw.RAW,), ()}
    restored = _state(1)
    assert not _same(saved, restored)
    with _manager(tmp_path, restored) as manager:
        assert manager.restore() == 5
    assert _same(saved, restored)


def test_a_checkpoint_of_torch_save_records_still_loads(tmp_path: Path) -> None:
    """Every checkpoint written before raw records (DCP's own writer, `torch.save` per tensor) resumes."""
    saved = _state(0)
    with _manager(tmp_path, saved, raw_tensors=False) as manager:
        manager.save(5, wait=True)
    assert _descriptors(_metadata(tmp_path, 5)) == {()}
    restored = _state(1)
    with _manager(tmp_path, restored, raw_tensors=True) as manager:  # raw records from now on
        assert manager.restore() == 5
        manager.save(10, wait=True)
    assert _same(saved, restored)
    assert (raw.RAW,) in _descriptors(_metadata(tmp_path, 10))
    again = _state(2)
    with _manager(tmp_path, again) as manager:  # and back (the default): either kind loads
        assert manager.restore() == 10
    assert _same(saved, again)


def test_by_default_a_checkpoint_is_plain_dcp(tmp_path: Path) -> None:
    """A checkpoint written with the defaults loads with DCP's own reader (`dcp.load`,
    `format_utils.dcp_to_torch_save`): raw records are asked for."""
    saved = _state(0)
    with _manager(tmp_path, saved) as manager:
        manager.save(5, wait=True)
    assert _descriptors(_metadata(tmp_path, 5)) == {()}
    target = _state(1).model.state_dict()
    dcp.load(
        {"model": target}, storage_reader=dcp.FileSystemReader(str(tmp_path / step_dir_name(5))), no_dist=True
    )
    assert all(torch.equal(target[k], v) for k, v in saved.model.state_dict().items())


def test_dcp_own_reader_refuses_a_raw_record_instead_of_misreading_it(tmp_path: Path) -> None:
    with _manager(tmp_path, _state(0), raw_tensors=True) as manager:
        manager.save(5, wait=True)
    target = _state(1).model.state_dict()
    with pytest.raises(BaseException) as raised:  # noqa: PT011 - DCP wraps it per rank (a BaseException)
        dcp.load(
            {"model": target},
            storage_reader=dcp.FileSystemReader(str(tmp_path / step_dir_name(5))),
            no_dist=True,
        )
    failures = getattr(raised.value, "failures", {})
    assert "Unknown extension" in str(raised.value) + "".join(str(e) for e in failures.values())


def _one_record(length: int, descriptors: list[str] | None = None) -> tuple[Metadata, ReadItem]:
    index = MetadataIndex("model.w", (0, 0), 0)
    entry = TensorStorageMetadata(
        properties=TensorProperties(dtype=torch.float32),
        size=torch.Size([2, 3]),
        chunks=[ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2, 3]))],
    )
    info = _StorageInfo("__0_0.distcp", 0, length, transform_descriptors=descriptors or [raw.RAW])
    metadata = Metadata(state_dict_metadata={"model.w": entry}, storage_data={index: info})
    item = ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=index,
        dest_offsets=torch.Size([0, 0]),
        storage_index=index,
        storage_offsets=torch.Size([0, 0]),
        lengths=torch.Size([2, 3]),
    )
    return metadata, item


def test_a_raw_record_is_read_as_its_metadata_says_and_refused_when_it_does_not_fit() -> None:
    data = torch.arange(6, dtype=torch.float32).numpy().tobytes()
    metadata, item = _one_record(len(data))
    check_metadata(metadata, {"__0_0.distcp": len(data)})
    got = raw.read_record(io.BytesIO(data), item.storage_index, metadata)
    assert torch.equal(got, torch.arange(6, dtype=torch.float32).reshape(2, 3))
    metadata, item = _one_record(len(data) - 4)  # a length that is not a float32 2x3 tensor's
    with pytest.raises(CheckpointInvalid, match="raw record is 20 bytes"):
        raw.read_record(io.BytesIO(data), item.storage_index, metadata)
    metadata, item = _one_record(len(data))
    with pytest.raises(CheckpointInvalid, match="ends inside"):
        raw.read_record(io.BytesIO(data[:10]), item.storage_index, metadata)


@pytest.mark.parametrize("descriptors", [["zstd"], [raw.RAW, "zstd"], ["ettr-raw-v2"]])
def test_metadata_asking_for_any_other_transform_is_refused(descriptors: list[str]) -> None:
    metadata, _ = _one_record(24, descriptors)
    with pytest.raises(CheckpointInvalid, match="stream transforms"):
        check_metadata(metadata, {"__0_0.distcp": 24})


def test_a_raw_record_of_a_pickled_item_is_refused() -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata, _ = _one_record(24)
    metadata.state_dict_metadata["model.w"] = BytesStorageMetadata()
    with pytest.raises(CheckpointInvalid, match="stream transforms"):
        check_metadata(metadata, {"__0_0.distcp": 24})


def test_only_dcp_file_writers_with_their_plain_layout_write_raw(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    assert raw.can_write_raw(dcp.FileSystemWriter(str(tmp_path)))
    assert not raw.can_write_raw(dcp.FileSystemWriter(str(tmp_path), thread_count=2))
    assert not raw.can_write_raw(dcp.FileSystemWriter(str(tmp_path), single_file_per_rank=False))
    assert not raw.can_write_raw(
        dcp.FileSystemWriter(str(tmp_path), serialization_format=SerializationFormat.SAFETENSORS)
    )
    assert not raw.can_write_raw(object())
    assert os.listdir(tmp_path) == []
