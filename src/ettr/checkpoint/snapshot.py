"""The snapshot file: one rank's staged state dict as raw tensor bytes under a JSON header, no pickle.

A snapshot is what a memory copy (`ettr.checkpoint.memory`) keeps of a committed checkpoint, and what a
peer sends over the network. It is read back without running anything it holds:

    b"ETTRSNP1" | header length (8 bytes, little endian) | header (JSON) | zero padding to 64 | payload

The header describes the state dict's tree (dicts, lists, tuples, strings, numbers, booleans, None, byte
strings and tensors; dtypes from a fixed list), where each tensor's and byte string's bytes lie in the
payload, the step and the commit it belongs to (`binding`: the SHA-256 of that step's manifest), the
payload's CRC-32 and the header's own. A reader checks, in order: magic, sizes, the header's CRC, that
the binding is the one it expects, then the payload's CRC over every byte — a torn, truncated, stale or
bit-flipped snapshot is refused before any of it is used. The byte strings are the pickled small parts of
a `TrainState` (step, scheduler, RNG, data position), which `TrainState.load` decodes with
`weights_only=True` as it does for a storage checkpoint.

Anything else in a state dict (DTensor, ShardedTensor, arbitrary objects) cannot be written: `write`
raises `SnapshotUnsupported` and the checkpoint is then restored from storage only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import mmap
import os
import stat
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ettr.checkpoint import direct_io, prefault
from ettr.checkpoint.base import CheckpointInvalid
from ettr.checkpoint.checksums import buffer_key, crc32, crc32_combine
from ettr.untrusted import open_regular

MAGIC = b"ETTRSNP1"
FORMAT = "ettr.snapshot/1"
_ALIGN = 64
_MAX_HEADER_BYTES = 64 << 20
"""A header larger than this is refused before it is read (a forged length must not allocate gigabytes)."""

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class SnapshotUnsupported(ValueError):
    """The state dict holds something a snapshot cannot represent (a DTensor, an arbitrary object)."""


@dataclass(frozen=True, kw_only=True)
class Binding:
    """What a snapshot is a copy of: the committed checkpoint of `step` whose manifest has this digest."""

    step: int
    manifest_sha256: str
    world_size: int
    lineage: str = ""
    """A memory-tier copy's (`ettr.checkpoint.memory_tier`): the token of the process lifetime that made it,
    drawn at each restore and shared by its ranks; "" for a copy of a storage commit. Set, the copy is of
    step `step`, committed in memory only, made after the storage commit of `base_step` whose manifest
    has the digest `manifest_sha256`."""
    base_step: int = -1
    """A memory-tier copy's: the newest storage commit its process knew (-1 for a storage-tier copy)."""

    @staticmethod
    def digest(manifest_bytes: bytes) -> str:
        """The digest a snapshot is bound to: SHA-256 of the manifest file's bytes as committed."""
        return hashlib.sha256(manifest_bytes).hexdigest()


@dataclass(frozen=True, kw_only=True)
class SnapshotInfo:
    """A snapshot's header, as read (and checked) from a file."""

    binding: Binding
    rank: int
    num_bytes: int
    """Size of the whole file."""
    created_ts: float


# -- the tree ---------------------------------------------------------------------------------------------


class _Layout:
    """Collects the tensors and byte strings of a state dict and gives each its place in the payload."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.blobs: list[bytes] = []

    def encode(self, value: Any) -> Any:
        if isinstance(value, dict):
            return {"d": [[self.encode_key(k), self.encode(v)] for k, v in value.items()]}
        if isinstance(value, list):
            return {"l": [self.encode(v) for v in value]}
        if type(value) is tuple:
            return {"t": [self.encode(v) for v in value]}
        if type(value) in (torch.Tensor, torch.nn.Parameter):
            return {"T": self._tensor(value)}
        if isinstance(value, bytes | bytearray):
            self.blobs.append(bytes(value))
            return {"B": len(self.blobs) - 1}
        if value is None:
            return {"n": 0}
        if isinstance(value, bool):
            return {"b": value}
        if isinstance(value, int):
            return {"i": value}
        if isinstance(value, float):
            return {"f": value}
        if isinstance(value, str):
            return {"s": value}
        raise SnapshotUnsupported(f"a snapshot cannot hold a {type(value).__module__}.{type(value).__name__}")

    def encode_key(self, key: Any) -> Any:
        if isinstance(key, str):
            return key
        if isinstance(key, int) and not isinstance(key, bool):
            return {"i": key}
        raise SnapshotUnsupported(f"a snapshot cannot hold a dict key of type {type(key).__name__}")

    def _tensor(self, tensor: torch.Tensor) -> int:
        if tensor.layout is not torch.strided or tensor.device.type != "cpu" or tensor.is_quantized:
            raise SnapshotUnsupported(
                f"a snapshot holds dense CPU tensors only, not {tensor.layout}/{tensor.device}"
            )
        if tensor.dtype not in _DTYPE_NAMES:
            raise SnapshotUnsupported(f"a snapshot cannot hold dtype {tensor.dtype}")
        self.tensors.append(tensor.detach())
        return len(self.tensors) - 1


def _decode(node: Any, tensors: list[torch.Tensor], blobs: list[bytes]) -> Any:
    if not isinstance(node, dict) or len(node) != 1:
        raise CheckpointInvalid("snapshot header: malformed tree node")
    ((tag, value),) = node.items()
    if tag == "d" and isinstance(value, list):
        out: dict[Any, Any] = {}
        for pair in value:
            if not (isinstance(pair, list) and len(pair) == 2):
                raise CheckpointInvalid("snapshot header: malformed dict entry")
            key = pair[0]
            if isinstance(key, dict) and set(key) == {"i"} and type(key["i"]) is int:
                key = key["i"]
            elif not isinstance(key, str):
                raise CheckpointInvalid("snapshot header: malformed dict key")
            out[key] = _decode(pair[1], tensors, blobs)
        return out
    if tag in ("l", "t") and isinstance(value, list):
        items = [_decode(v, tensors, blobs) for v in value]
        return items if tag == "l" else tuple(items)
    if tag in ("T", "B") and type(value) is int:
        pool: list[Any] = tensors if tag == "T" else blobs
        if not 0 <= value < len(pool):
            raise CheckpointInvalid("snapshot header: reference out of range")
        return pool[value]
    if tag == "n":
        return None
    if tag == "b" and isinstance(value, bool):
        return value
    if tag == "i" and type(value) is int:
        return value
    if tag == "f" and isinstance(value, float | int) and not isinstance(value, bool):
        try:  # an int past a float's range (10**400) raised OverflowError out of `load`
            return float(value)
        except OverflowError:
            raise CheckpointInvalid("snapshot header: a number out of a float's range") from None
    if tag == "s" and isinstance(value, str):
        return value
    raise CheckpointInvalid(f"snapshot header: unknown tree node {tag!r}")


# -- writing ----------------------------------------------------------------------------------------------


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a dense CPU tensor, without a copy when it is contiguous."""
    flat = tensor.contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def _crc_join(
    crc: int, piece: memoryview, key: tuple[int, int] | None, known: Mapping[tuple[int, int], int]
) -> int:
    """`crc` continued over `piece`: with the CRC-32 the persist took of it as it wrote it (`known[key]`), else
    summed here."""
    if key is not None and key in known:
        return crc32_combine(crc, known[key], piece.nbytes)
    return crc32(piece, crc)


def _align(offset: int) -> int:
    return (offset + _ALIGN - 1) // _ALIGN * _ALIGN


def _header_body(
    binding: Binding,
    *,
    rank: int,
    created_ts: float,
    tree: Any,
    tensors: list[dict[str, Any]],
    blobs: list[dict[str, Any]],
    payload_bytes: int,
    payload_crc32: int,
) -> dict[str, Any]:
    """A snapshot's header (before its own checksum, `_header_bytes`): one layout for a written snapshot, a sealed
    slot and a slot's room estimate."""
    tier = {"lineage": binding.lineage, "base_step": binding.base_step} if binding.lineage else {}
    return {
        "format": FORMAT,
        "step": binding.step,
        "manifest_sha256": binding.manifest_sha256,
        "world_size": binding.world_size,
        **tier,  # a storage-tier copy's header is as it was
        "rank": rank,
        "created_ts": created_ts,
        "tree": tree,
        "tensors": tensors,
        "blobs": blobs,
        "payload_bytes": payload_bytes,
        "payload_crc32": payload_crc32,
    }


def _header_bytes(body: dict[str, Any]) -> bytes:
    body = dict(body)
    body["header_crc32"] = zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def size_of(state_dict: dict[str, Any]) -> int:
    """About how many bytes a snapshot of `state_dict` takes (its tensors' and byte strings' bytes).
    Raises SnapshotUnsupported like `write`."""
    layout = _Layout()
    layout.encode(state_dict)
    return sum(t.numel() * t.element_size() for t in layout.tensors) + sum(len(b) for b in layout.blobs)


def write(
    path: Path,
    state_dict: dict[str, Any],
    *,
    binding: Binding,
    rank: int,
    created_ts: float,
    piece_crcs: Mapping[tuple[int, int], int] | None = None,
    over: FileId | None = None,
) -> int:
    """Write a snapshot of `state_dict` to `path`; returns its size. Without `over`, `path` is a new file
    (created exclusively, never through a symlink) that the caller renames into place. With `over`, `path` is
    an existing snapshot this process wrote (`FileId.of`), overwritten in place so that its memory pages are
    reused instead of new ones allocated and zeroed (about half a copy's CPU): its magic is cleared first
    and written back last, after the payload and the header, so that a copy torn by a crash reads as no
    snapshot at all (and its payload CRC-32 would refuse it too); a file that is not the one named by
    `over` (replaced, a symlink) raises `NotReusable` before anything is written. `piece_crcs`: the CRC-32
    of tensors already summed, by (address, bytes) (`checksums.Sums.pieces`: the persist summed the staged
    buffers as it wrote them); those are not summed again (one that no longer matches the bytes makes the
    snapshot fail its check at load, never pass). Raises SnapshotUnsupported, OSError."""
    layout = _Layout()
    tree = layout.encode(state_dict)
    pieces: list[memoryview] = [_as_bytes(t) for t in layout.tensors] + [memoryview(b) for b in layout.blobs]
    entries, offset = [], 0
    for piece in pieces:
        entries.append([offset, piece.nbytes])
        offset = _align(offset + piece.nbytes)
    tensors_meta = [
        {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape), "at": entries[i]}
        for i, t in enumerate(layout.tensors)
    ]
    blobs_meta = [{"at": entries[len(layout.tensors) + i]} for i in range(len(layout.blobs))]
    payload_bytes = offset
    crc = 0
    known = piece_crcs or {}
    keys = [buffer_key(t) for t in layout.tensors] + [None] * len(layout.blobs)
    for piece, key in zip(pieces, keys, strict=True):
        crc = _crc_join(crc, piece, key, known)
    body = _header_body(
        binding,
        rank=rank,
        created_ts=created_ts,
        tree=tree,
        tensors=tensors_meta,
        blobs=blobs_meta,
        payload_bytes=payload_bytes,
        payload_crc32=crc,
    )
    header = _header_bytes(body)
    data_offset = _align(len(MAGIC) + 8 + len(header))
    nofollow = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    if over is None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | nofollow, 0o600)
    else:
        fd = os.open(path, os.O_WRONLY | nofollow)
        if FileId.of_fd(fd) != over:
            os.close(fd)
            raise NotReusable(f"{path} is not the snapshot this process wrote")
    try:
        if over is not None:
            os.pwrite(fd, bytes(len(MAGIC)), 0)  # no snapshot until the magic is back, last
        os.ftruncate(fd, data_offset + payload_bytes)  # holes for the padding; tmpfs allocates on write
        for (at, _), piece in zip(entries, pieces, strict=True):
            _pwrite_all(fd, piece, data_offset + at)
        os.pwrite(fd, struct.pack("<Q", len(header)) + header, len(MAGIC))
        os.pwrite(fd, MAGIC, 0)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    os.close(fd)
    return data_offset + payload_bytes


# -- staging slots: a snapshot file the stager copies into -------------------------------------------------


@dataclass(eq=False)
class Slot:
    """A snapshot file laid out for the tensors of a state dict and mapped shared (`prepare_slot`): its
    `views` are tensors over the file's payload, which the stager uses as its staging buffers, so that the
    staged copy is already the memory copy's payload; `seal` then writes the rest (the byte strings, the
    header, the magic last). Until sealed, the file's magic is cleared: it reads as no snapshot at all."""

    fd: int
    mapped: mmap.mmap
    device: int
    inode: int
    data_offset: int
    header_room: int
    metas: list[tuple[torch.dtype, tuple[int, ...]]]
    entries: list[tuple[int, int]]
    """(offset in the payload, bytes) of each tensor, in the state dict's order."""
    tensor_bytes: int
    views: list[torch.Tensor]
    addresses: list[int]

    def fits(self, state_dict: dict[str, Any]) -> bool:
        """Whether `state_dict`'s tensors have, in order, this slot's dtypes and shapes."""
        return self._check(state_dict, addresses=False)

    def matches(self, state_dict: dict[str, Any]) -> bool:
        """Whether `state_dict`'s tensors are, in order, this slot's views (what the stager copied into)."""
        return self._check(state_dict, addresses=True)

    def takes(self, state_dict: dict[str, Any]) -> bool:
        """Whether `state_dict`'s tensors, contiguous or not, have this slot's dtypes and shapes (`stage_into`)."""
        return self._check(state_dict, addresses=False, contiguous=False)

    def _check(self, state_dict: dict[str, Any], *, addresses: bool, contiguous: bool = True) -> bool:
        layout = _Layout()
        try:
            layout.encode(state_dict)
        except SnapshotUnsupported:
            return False
        if len(layout.tensors) != len(self.metas):
            return False
        for tensor, (dtype, shape), address in zip(layout.tensors, self.metas, self.addresses, strict=True):
            if (
                tensor.dtype != dtype
                or tuple(tensor.shape) != shape
                or (contiguous and not tensor.is_contiguous())
            ):
                return False
            if addresses and tensor.numel() and tensor.data_ptr() != address:
                return False
        return True

    def is_at(self, path: Path) -> bool:
        """Whether `path` (not through a symlink) is this slot's file."""
        try:
            st = os.lstat(path)
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) == (self.device, self.inode)

    def file_id(self) -> FileId:
        return FileId.of_fd(self.fd)

    def unseal(self) -> None:
        """Clear the magic before the stager writes into the payload again: a snapshot no more."""
        os.pwrite(self.fd, bytes(len(MAGIC)), 0)

    def prefault(self) -> bool:
        """Allocate and map every page of the file now (`prefault.populate_mapping`: nothing written), so
        that the stager's copy into the views does not stop to fault them in. Returns whether it was done."""
        return prefault.populate_mapping(self.mapped)

    def close(self) -> None:
        """Unmap (where no view is alive: else the mapping goes with the last view) and close the file."""
        self.views = []
        with contextlib.suppress(BufferError):
            self.mapped.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


def tensor_keys(state_dict: dict[str, Any]) -> list[tuple[int, int] | None]:
    """The `buffer_key` of each tensor of `state_dict`, in a snapshot's (and a slot's) order."""
    layout = _Layout()
    layout.encode(state_dict)
    return [buffer_key(t) for t in layout.tensors]


def stage_into(slot: Slot, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Copy the tensors of `state_dict` (the live state) into `slot`'s views, in a snapshot's order; returns
    the state dict with each tensor replaced by its view (what `seal` takes: no further copy). Raises
    `NotReusable` where the state does not fit the slot (another shape), SnapshotUnsupported."""
    if not slot.takes(state_dict):
        raise NotReusable("the state does not fit the slot")
    views = iter(slot.views)

    def swap(value: Any) -> Any:  # the traversal of `_Layout.encode`: the same order as the slot's views
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        if isinstance(value, list):
            return [swap(v) for v in value]
        if type(value) is tuple:
            return tuple(swap(v) for v in value)
        if type(value) in (torch.Tensor, torch.nn.Parameter):
            view = next(views)
            with torch.no_grad():
                view.copy_(value.detach())
            return view
        return value

    return swap(state_dict)


def _tensor_plan(state_dict: dict[str, Any]) -> tuple[_Layout, Any, list[tuple[int, int]], int]:
    layout = _Layout()
    tree = layout.encode(state_dict)
    entries, offset = [], 0
    for tensor in layout.tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes >= direct_io.MIN_BYTES:  # on a page of its own start: the persist writes it directly
            offset += direct_io.padding(offset)
        entries.append((offset, nbytes))
        offset = _align(offset + nbytes)
    return layout, tree, entries, offset


def prepare_slot(path: Path, state_dict: dict[str, Any], *, over: FileId | None = None) -> Slot:
    """A slot for the tensors of `state_dict` at `path`: a new file (created exclusively, never through a
    symlink), or, with `over`, the existing file this process wrote there (its memory pages reused; raises
    `NotReusable` if it is not that file). The header is given room for a state dict like this one with
    a quarter to spare (`seal` refuses one that does not fit). Raises SnapshotUnsupported, OSError."""
    layout, tree, entries, tensor_bytes = _tensor_plan(state_dict)
    if not tensor_bytes:
        raise NotReusable("a state without tensor bytes needs no slot")
    blobs = [{"at": [tensor_bytes + 10**12, len(b) * 2 + 10**6]} for b in layout.blobs]  # generous digits
    estimate = _header_body(
        Binding(step=10**15, manifest_sha256="0" * 64, world_size=10**6),
        rank=10**6,
        created_ts=1e10,
        tree=tree,
        tensors=[
            {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape), "at": list(entries[i])}
            for i, t in enumerate(layout.tensors)
        ],
        blobs=blobs,
        payload_bytes=10**15,
        payload_crc32=2**32 - 1,
    )
    header_room = len(_header_bytes(estimate)) * 5 // 4 + 4096
    header_room += direct_io.padding(len(MAGIC) + 8 + header_room)  # the tensors start on a page
    data_offset = _align(len(MAGIC) + 8 + header_room)
    nofollow = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    if over is None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | nofollow, 0o600)
    else:
        fd = os.open(path, os.O_RDWR | nofollow)
    try:
        st = os.fstat(fd)
        if over is not None and (st.st_dev, st.st_ino) != (over.device, over.inode):
            raise NotReusable(f"{path} is not the snapshot this process wrote")
        os.pwrite(fd, bytes(len(MAGIC)), 0)  # no snapshot here until `seal` writes the magic back, last
        size = data_offset + tensor_bytes
        os.ftruncate(fd, size)
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        if over is None:
            with contextlib.suppress(OSError):
                os.unlink(path)
        raise
    views, addresses, metas = [], [], []
    whole = memoryview(mapped)  # each view holds this export: `close` can never unmap under a live view
    for tensor, (at, nbytes) in zip(layout.tensors, entries, strict=True):
        count = nbytes // tensor.element_size()
        flat = (
            torch.frombuffer(whole, dtype=tensor.dtype, count=count, offset=data_offset + at)
            if count
            else torch.empty(0, dtype=tensor.dtype)
        )
        views.append(flat.reshape(tensor.shape))
        addresses.append(int(flat.data_ptr()) if count else 0)
        metas.append((tensor.dtype, tuple(tensor.shape)))
    del whole
    return Slot(
        fd=fd,
        mapped=mapped,
        device=st.st_dev,
        inode=st.st_ino,
        data_offset=data_offset,
        header_room=header_room,
        metas=metas,
        entries=entries,
        tensor_bytes=tensor_bytes,
        views=views,
        addresses=addresses,
    )


def seal(
    slot: Slot,
    state_dict: dict[str, Any],
    *,
    binding: Binding,
    rank: int,
    created_ts: float,
    piece_crcs: Mapping[tuple[int, int], int] | None = None,
) -> int:
    """Make `slot`'s file a snapshot of `state_dict`, whose tensors are the slot's views (the stager copied
    the state into them): the byte strings after the tensors, the header (padded with spaces to its room),
    the magic last. No tensor byte is copied; the payload CRC-32 joins the CRC-32s the persist took of the
    views as it wrote them (`piece_crcs`), the rest are summed here. Returns the file's size. Raises
    `NotReusable` where `state_dict` is not laid out in the slot (the caller writes a snapshot the usual
    way), OSError."""
    if not slot.matches(state_dict):
        raise NotReusable("the staged state is not the slot's")
    layout = _Layout()
    tree = layout.encode(state_dict)
    known = piece_crcs or {}
    crc = 0
    for tensor in layout.tensors:
        crc = _crc_join(crc, _as_bytes(tensor), buffer_key(tensor), known)  # the slot's view: no copy
    blob_entries, offset = [], slot.tensor_bytes
    for blob in layout.blobs:
        blob_entries.append([offset, len(blob)])
        crc = crc32(blob, crc)
        offset = _align(offset + len(blob))
    body = _header_body(
        binding,
        rank=rank,
        created_ts=created_ts,
        tree=tree,
        tensors=[
            {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "at": list(entry)}
            for (dtype, shape), entry in zip(slot.metas, slot.entries, strict=True)
        ],
        blobs=[{"at": entry} for entry in blob_entries],
        payload_bytes=offset,
        payload_crc32=crc,
    )
    header = _header_bytes(body)
    if len(header) > slot.header_room:
        raise NotReusable("the header does not fit the slot's room")
    fd = slot.fd
    os.pwrite(fd, bytes(len(MAGIC)), 0)
    os.ftruncate(fd, slot.data_offset + offset)  # never below the mapped tensors: offset >= tensor_bytes
    for blob, (at, _) in zip(layout.blobs, blob_entries, strict=True):
        _pwrite_all(fd, memoryview(blob), slot.data_offset + at)
    os.pwrite(fd, struct.pack("<Q", slot.header_room) + header.ljust(slot.header_room), len(MAGIC))
    os.pwrite(fd, MAGIC, 0)
    return slot.data_offset + offset


class NotReusable(OSError):
    """The file to overwrite in place is not the snapshot this process wrote there (`write`'s `over`)."""


@dataclass(frozen=True)
class FileId:
    """A file's identity (device, inode) and the time of its last change: a snapshot file this process
    wrote, and may overwrite in place, is still that file."""

    device: int
    inode: int
    ctime_ns: int

    @classmethod
    def _of_stat(cls, st: os.stat_result) -> FileId:
        return cls(st.st_dev, st.st_ino, st.st_ctime_ns)

    @classmethod
    def of_fd(cls, fd: int) -> FileId:
        return cls._of_stat(os.fstat(fd))

    @classmethod
    def of(cls, path: Path) -> FileId | None:
        """The identity of the regular file at `path` (not through a symlink); None if there is none."""
        try:
            st = os.lstat(path)
        except OSError:
            return None
        return cls._of_stat(st) if stat.S_ISREG(st.st_mode) else None


_STILL_MAPPED: set[tuple[int, int]] = set()
"""(device, inode) of snapshot files this process mapped and could not unmap (a tensor `load` returned is
still alive): a private mapping shows later writes to the file, so these are never overwritten in place."""


def still_mapped(file_id: FileId) -> bool:
    """Whether this process may still hold a mapping of the file (`Snapshot.close` could not unmap it)."""
    return (file_id.device, file_id.inode) in _STILL_MAPPED


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < data.nbytes:
        done += os.pwrite(fd, data[done:], offset + done)


# -- reading ----------------------------------------------------------------------------------------------


@dataclass
class Snapshot:
    """A snapshot file mapped into memory whose header checked out (the payload is checked by `load`)."""

    info: SnapshotInfo
    _body: dict[str, Any]
    _map: Any
    """The bytes: a private writable mapping of the file, or a writable buffer (what a peer sent)."""
    _data_offset: int
    _file: tuple[int, int] | None = None
    """(device, inode) of the mapped file (None: bytes a peer sent); in `_STILL_MAPPED` until unmapped."""

    def close(self) -> None:
        """Unmap the file (tensors `load` returned are views of it: copy them first). Where such a view is
        still alive the mapping is left to be freed with it (and the file is never overwritten in place)."""
        if isinstance(self._map, mmap.mmap):
            with contextlib.suppress(BufferError):
                self._map.close()
                if self._file is not None:
                    _STILL_MAPPED.discard(self._file)

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def raw(self) -> memoryview:
        """The whole file's bytes (what a peer is sent)."""
        return memoryview(self._map)

    def load(self) -> dict[str, Any]:
        """The state dict, after the payload's CRC-32 checked out. Its tensors and byte strings are views
        of the mapped file: copy them before `close`. Raises CheckpointInvalid."""
        body, data = self._body, self._data_offset
        size = len(self._map)
        if data + body["payload_bytes"] != size:
            raise CheckpointInvalid(
                f"snapshot is {size} bytes, its header says {data + body['payload_bytes']}"
            )
        view = memoryview(self._map)
        crc = 0
        for meta in [*body["tensors"], *body["blobs"]]:
            at, nbytes = meta["at"]
            crc = crc32(view[data + at : data + at + nbytes], crc)
        if crc != body["payload_crc32"]:
            raise CheckpointInvalid("snapshot payload fails its CRC-32 check (torn or corrupt)")
        tensors = []
        for meta in body["tensors"]:
            at, nbytes = meta["at"]
            dtype = DTYPES[meta["dtype"]]
            count = nbytes // dtype.itemsize
            flat = (
                # through `view`: each tensor holds the buffer export, so `close` cannot unmap under it
                torch.frombuffer(view, dtype=dtype, count=count, offset=data + at)
                if count
                else torch.empty(0, dtype=dtype)
            )
            tensors.append(flat.reshape(meta["shape"]))
        blobs = [bytes(view[data + m["at"][0] : data + m["at"][0] + m["at"][1]]) for m in body["blobs"]]
        del view
        try:
            state = _decode(body["tree"], tensors, blobs)
        except RecursionError:
            raise CheckpointInvalid("snapshot header: the tree is nested too deeply") from None
        if not isinstance(state, dict):
            raise CheckpointInvalid("snapshot header: the state is not a dict")
        return state


def open_snapshot(path: Path) -> Snapshot:
    """Map a snapshot file and check its header (magic, sizes, CRC, entry bounds). The file must be a regular
    file of this user that nobody else may write, as opened (never through a symlink, never blocking on a
    FIFO): its binding is a digest anyone who can read the checkpoint can compute, so a copy another user
    could have written (swapped in under a folder that was checked a moment before) is refused.
    Raises CheckpointInvalid, or OSError (FileNotFoundError: no snapshot)."""
    fd = open_regular(path)
    try:
        st = os.fstat(fd)
        _check_own_file(path, st)
        size = st.st_size
        if size < len(MAGIC) + 8:
            raise CheckpointInvalid("snapshot is truncated")
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    try:
        found = parse_bytes(mapped)
    except BaseException:
        mapped.close()
        raise
    found._file = (st.st_dev, st.st_ino)
    _STILL_MAPPED.add(found._file)
    return found


def _check_own_file(path: Path, st: os.stat_result) -> None:
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        raise CheckpointInvalid(
            f"{path} is owned by uid {st.st_uid}, not this user (not a copy this job wrote)"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CheckpointInvalid(f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):o})")


def parse_bytes(mapped: Any) -> Snapshot:
    """A `Snapshot` over bytes already in memory (a mapped file, or a writable buffer a peer sent), its
    header checked. Raises CheckpointInvalid."""
    size = len(mapped)
    if bytes(mapped[: len(MAGIC)]) != MAGIC:
        raise CheckpointInvalid("not a snapshot (bad magic)")
    (header_len,) = struct.unpack("<Q", mapped[len(MAGIC) : len(MAGIC) + 8])
    if header_len > _MAX_HEADER_BYTES or len(MAGIC) + 8 + header_len > size:
        raise CheckpointInvalid("snapshot header length is out of bounds (truncated?)")
    raw = bytes(mapped[len(MAGIC) + 8 : len(MAGIC) + 8 + header_len])
    body = _check_header(raw)
    data_offset = _align(len(MAGIC) + 8 + header_len)
    for meta in [*body["tensors"], *body["blobs"]]:
        at = meta.get("at") if isinstance(meta, dict) else None
        if not (isinstance(at, list) and len(at) == 2 and all(type(v) is int and v >= 0 for v in at)):
            raise CheckpointInvalid("snapshot header: malformed entry")
        if at[0] + at[1] > body["payload_bytes"]:
            raise CheckpointInvalid("snapshot header: an entry lies outside the payload")
    for meta in body["tensors"]:
        name = meta.get("dtype")
        dtype = DTYPES.get(name) if isinstance(name, str) else None
        shape = meta.get("shape")
        if dtype is None or not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise CheckpointInvalid("snapshot header: malformed tensor entry")
        if _numel(shape, meta["at"][1]) * dtype.itemsize != meta["at"][1]:
            raise CheckpointInvalid("snapshot header: a tensor's size does not match its shape")
    info = SnapshotInfo(
        binding=Binding(
            step=body["step"],
            manifest_sha256=body["manifest_sha256"],
            world_size=body["world_size"],
            lineage=body.get("lineage", ""),
            base_step=body.get("base_step", -1),
        ),
        rank=body["rank"],
        num_bytes=size,
        created_ts=float(body["created_ts"]),
    )
    return Snapshot(info, body, mapped, data_offset)


def _numel(shape: list[int], limit: int) -> int:
    """The element count of `shape`, or `limit + 1` once it passes `limit` (a forged shape of thousands of
    400-digit sizes is a product of millions of digits: minutes of CPU, not a refusal)."""
    if 0 in shape:
        return 0
    count = 1
    for dim in shape:
        count *= dim
        if count > limit:
            return limit + 1
    return count


def _check_header(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise CheckpointInvalid("snapshot header is not JSON (torn or corrupt)") from None
    if not isinstance(body, dict):
        raise CheckpointInvalid("snapshot header is not an object")
    claimed = body.pop("header_crc32", None)
    if claimed != zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()):
        raise CheckpointInvalid("snapshot header fails its CRC-32 check (torn or corrupt)")
    if body.get("format") != FORMAT:
        raise CheckpointInvalid(f"unknown snapshot format {body.get('format')!r}")
    for name, kind in (
        ("step", int),
        ("world_size", int),
        ("rank", int),
        ("payload_bytes", int),
        ("payload_crc32", int),
        ("manifest_sha256", str),
        ("tensors", list),
        ("blobs", list),
        ("tree", dict),  # (missing: a KeyError out of `load`)
    ):
        if not isinstance(body.get(name), kind) or isinstance(body.get(name), bool):
            raise CheckpointInvalid(f"snapshot header: {name} is missing or malformed")
    lineage, base_step = body.get("lineage", ""), body.get("base_step", -1)
    if not isinstance(lineage, str) or type(base_step) is not int:
        raise CheckpointInvalid("snapshot header: lineage or base_step is malformed")
    created = body.get("created_ts")
    try:  # an int past a float's range (10**400) raised OverflowError out of `MemoryCopies.find`
        if not isinstance(created, int | float) or isinstance(created, bool) or not math.isfinite(created):
            raise ValueError
    except (ValueError, OverflowError):
        raise CheckpointInvalid("snapshot header: created_ts is missing or malformed") from None
    return body
