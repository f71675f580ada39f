"""Raw tensor records in DCP's data files: a tensor's bytes as they are, no `torch.save` around them.

DCP's file writer wraps every tensor in a `torch.save` of its own (a zip archive: pickling, a CRC-32 of
each record, a copy into the archive); a save's persist spent most of its CPU there (issue 26: every CPU
second a persist spends comes out of the steps beside it on a busy node). ettr's writer
(`writer.CommittingWriter`) writes each staged tensor's bytes instead, one rank's items in one file as DCP
would (`__<rank>_0.distcp`: the pickled objects first, then the tensors), and marks each such record in
DCP's metadata with the stream-transform descriptor `RAW` (`_StorageInfo.transform_descriptors`). The
record's dtype and shape are the ones DCP's metadata already holds for that chunk, so a record is read with
no pickle at all: `read_raw` takes its bytes (`length` must be exactly the chunk's) into a new tensor.
A record of `direct_io.MIN_BYTES` or more starts at a multiple of `direct_io.ALIGN` in its file (zero bytes
before it, which the file's CRC-32 covers like any other; since 2026-12-05), so that it can be written past
the page cache; a reader takes each record at the offset DCP's metadata gives it, so files with and
without those gaps read alike, with this ettr and an older one.

Records written by `torch.save` (every checkpoint before this, and those of a writer that is not DCP's
file writer) carry no descriptor and load as before (`torch.load(weights_only=True)`), so a checkpoint of
either kind, or of both, resumes. DCP's own reader refuses a `RAW` record with "Unknown extension" rather
than misread it: load these checkpoints with ettr (`CheckpointManager.restore`, `trust.verified_reader`).
Raw records are asked for (`CheckpointConfig(raw_tensors=True)`); the default stays DCP's own format.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ettr.checkpoint import direct_io
from ettr.checkpoint.base import CheckpointInvalid

RAW = "ettr-raw-v1"
"""The transform descriptor of a raw tensor record (the only one ettr writes or reads)."""


def can_write_raw(inner: Any) -> bool:
    """Whether `inner` is a DCP file writer whose layout `write_raw` reproduces (one file per rank, one
    writer thread, torch.save records, no stream extensions)."""
    from torch.distributed.checkpoint.filesystem import SerializationFormat, _FileSystemWriter

    transforms = getattr(getattr(inner, "transforms", None), "extensions", None)
    return (
        isinstance(inner, _FileSystemWriter)
        and inner.single_file_per_rank
        and inner.thread_count == 1
        and inner.serialization_format == SerializationFormat.TORCH_SAVE
        and not transforms
    )


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def write_raw(inner: Any, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
    """Write this rank's items of `plan` into one data file through `inner`'s file system (DCP's file
    name, its streams: the summing one where the writer sums), tensors as raw records; fsync'd where
    `inner` syncs its files. Returns DCP's write results."""
    name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
    path = inner.fs.concat_path(inner.path, name)
    results: list[WriteResult] = []
    pickled = [item for item in plan.items if item.type == WriteItemType.BYTE_IO]
    tensors = [item for item in plan.items if item.type != WriteItemType.BYTE_IO]
    offset = 0
    with inner.fs.create_stream(path, "wb") as stream:
        # The summing stream sends its large writes past the page cache (`direct_io`).
        if hasattr(stream, "direct"):
            stream.direct = True
        for item in pickled:
            data = planner.resolve_data(item)
            if not isinstance(data, io.BytesIO):
                raise TypeError(f"{item.index.fqn}: a pickled item must resolve to io.BytesIO")
            view = data.getbuffer()
            stream.write(view)
            info = _StorageInfo(name, offset, view.nbytes)
            results.append(WriteResult(index=item.index, size_in_bytes=view.nbytes, storage_data=info))
            offset += view.nbytes
            del view
        for item in tensors:
            tensor = planner.resolve_data(item)
            if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
                raise TypeError(f"{item.index.fqn}: a tensor item must resolve to a CPU tensor")
            chunk = item.tensor_data.chunk if item.tensor_data is not None else None
            if chunk is not None and tuple(tensor.shape) != tuple(chunk.sizes):
                raise ValueError(f"{item.index.fqn}: shape {tuple(tensor.shape)} is not its chunk's")
            view = _bytes_of(tensor)
            if view.nbytes >= direct_io.MIN_BYTES:  # a large record starts on a block (written directly)
                gap = direct_io.padding(offset)
                if gap:
                    stream.write(bytes(gap))
                    offset += gap
            stream.write(view)
            info = _StorageInfo(name, offset, view.nbytes, transform_descriptors=[RAW])
            results.append(WriteResult(index=item.index, size_in_bytes=view.nbytes, storage_data=info))
            offset += view.nbytes
        if inner.sync_files:
            stream.flush()
            try:
                os.fsync(stream.fileno())
            except (AttributeError, io.UnsupportedOperation):
                os.sync()
    return results


def is_raw(info: Any) -> bool:
    """Whether a storage item is a raw record (`RAW` its only transform)."""
    return list(getattr(info, "transform_descriptors", None) or ()) == [RAW]


def split(plan: LoadPlan, metadata: Metadata) -> tuple[LoadPlan, list[Any]]:
    """`plan` less its raw records, and those records' read items."""
    raw: list[Any] = []
    rest: list[Any] = []
    for item in plan.items:
        info = metadata.storage_data.get(item.storage_index)
        (raw if item.type != LoadItemType.BYTE_IO and is_raw(info) else rest).append(item)
    return dataclasses.replace(plan, items=rest), raw


def read_raw(reader: Any, items: list[Any], metadata: Metadata, planner: Any) -> None:
    """Load raw records into the planner's tensors: each record's bytes, through `reader`'s file system
    (DCP's file reader: its `fs` and `path`), become a tensor of the dtype and shape DCP's metadata holds
    for that chunk (nothing is unpickled); its length must be exactly theirs. Raises CheckpointInvalid."""
    per_file: dict[str, list[Any]] = {}
    for item in items:
        per_file.setdefault(metadata.storage_data[item.storage_index].relative_path, []).append(item)
    for relative_path, file_items in per_file.items():
        path = reader.fs.concat_path(reader.path, relative_path)
        with reader.fs.create_stream(path, "rb") as stream:
            for item in sorted(file_items, key=lambda i: metadata.storage_data[i.storage_index].offset):
                tensor = read_record(stream, item.storage_index, metadata)
                for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                    if start != 0 or length != tensor.size(dim):
                        tensor = tensor.narrow(dim, start, length)
                target = planner.resolve_tensor(item).detach()
                if target.size() != tensor.size():
                    raise CheckpointInvalid(
                        f"{item.storage_index.fqn}: stored {tuple(tensor.size())}, wanted {tuple(target.size())}"
                    )
                target.copy_(tensor)
                planner.commit_tensor(item, target)


def read_record(stream: Any, index: Any, metadata: Metadata) -> torch.Tensor:
    """The raw record of storage item `index` (a `MetadataIndex`) from `stream` (its data file): a new tensor
    of the dtype and shape `metadata` holds for that chunk. Raises CheckpointInvalid."""
    info = metadata.storage_data[index]
    entry = metadata.state_dict_metadata.get(index.fqn)
    if not isinstance(entry, TensorStorageMetadata):
        raise CheckpointInvalid(f"{index.fqn}: a raw record of an item that is not a tensor")
    sizes = next(
        (tuple(c.sizes) for c in entry.chunks if tuple(c.offsets) == tuple(index.offset or ())), None
    )
    dtype = entry.properties.dtype
    if sizes is None or not isinstance(dtype, torch.dtype):
        raise CheckpointInvalid(f"{index.fqn}: no chunk at offset {tuple(index.offset or ())}")
    nbytes = math.prod(sizes) * dtype.itemsize
    if info.length != nbytes:
        raise CheckpointInvalid(
            f"{index.fqn}: its raw record is {info.length} bytes, a {dtype} tensor of {sizes} is {nbytes}"
        )
    tensor = torch.empty(sizes, dtype=dtype)
    if nbytes:
        stream.seek(info.offset)
        view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]
        done = 0
        while done < nbytes:
            got = stream.readinto(view[done:])
            if not got:
                raise CheckpointInvalid(f"{index.fqn}: its data file ends inside its raw record")
            done += got
    return tensor
