"""CRC-32s taken on the bytes as a save writes them, so that a commit does not read its files back.

A save used to make three passes over its state besides DCP's write: the manifest's CRC-32 re-read every
data file from storage (`commit.file_crc32`), and the memory copy summed the staged tensors again
(`snapshot.write`). Here the persist's DCP writer writes through `SummingFileSystem`: each data file's
stream sums the bytes handed to it, in order, into the file's CRC-32 and size (`Sums.files`), and the
writes that are exactly one staged buffer's bytes (`Sums.expect`) also leave that buffer's own CRC-32
(`Sums.pieces`), which the memory copy reuses (`crc32_combine` joins CRC-32s of adjacent pieces).

A sum is recorded only for a file written front to back through one stream that closed without an error;
a stream that seeks or truncates records nothing, and a file without a recorded sum is read back as
before. What the manifest records is the CRC-32 of the bytes meant to be on disk, so anything that
changes them on the way (a torn write, a bad disk) fails the CRC check at load, as it did.

`crc32` is zlib's CRC-32 (the same values, the same arguments), taken with the fastest implementation
installed: zlib-ng's or ISA-L's (`pip install 'ettr[fast]'`; carry-less multiplication, 13-16 GB/s here
against 2.1 GB/s for the system zlib 1.2.13 Python links), else zlib's. Every CRC-32 of checkpoint bytes
goes through it: the sums of a save, the commit's and a restore's checks, the memory copy's.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache, lru_cache
from typing import Any

from ettr.checkpoint.direct_io import MIN_BYTES, address_of, write_aligned

FAST_CRC32_MODULES = ("zlib_ng.zlib_ng", "isal.isal_zlib")
"""Modules whose `crc32(data, value=0)` is zlib's CRC-32, faster, in the order they are preferred."""
_PROBE = bytes(range(256)) * 33 + b"ettr"


@cache
def crc32_implementation() -> Callable[..., int]:
    """The `crc32` that `crc32` calls: the first of `FAST_CRC32_MODULES` installed whose answers match zlib's
    on a probe (a start value too), else `zlib.crc32`. Resolved once, on first use."""
    expected = (zlib.crc32(_PROBE), zlib.crc32(_PROBE, 0x12345678), zlib.crc32(b"", 7))
    for name in FAST_CRC32_MODULES:
        try:
            candidate = importlib.import_module(name).crc32
            found = (candidate(_PROBE), candidate(_PROBE, 0x12345678), candidate(b"", 7))
        except Exception:  # noqa: BLE001 - a broken optional module: zlib's then
            continue
        if found == expected:
            return candidate
    return zlib.crc32


def crc32(data: Any, value: int = 0) -> int:
    """zlib's CRC-32 of the bytes of `data` (any C-contiguous buffer), continued from `value`; the GIL is
    released while a large buffer is summed. Same values as `zlib.crc32`, faster where zlib-ng or ISA-L is
    installed (see the module docstring)."""
    return int(crc32_implementation()(data, value))


_POLY = 0xEDB88320
PIECE_MIN_BYTES = 1 << 20
"""Writes this large that are one staged buffer's bytes leave their own CRC-32 (smaller ones are summed
into the file's CRC-32 only: joining costs a few microseconds each, summing a small piece costs less)."""


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC-32 polynomial (bit-reflected), as zlib's `multmodp`."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _powers() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _powers()  # x^(2^k) modulo the polynomial


@lru_cache(maxsize=4096)
def _x8nmodp(n: int) -> int:
    """x^(8n) modulo the polynomial: what shifts a CRC past n zero bytes (tensors of one size repeat)."""
    p, k = 1 << 31, 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A + B from crc32(A), crc32(B) and len(B) (zlib's `crc32_combine`, which Python's
    zlib module does not offer)."""
    if len2 <= 0:
        return crc1
    return _multmodp(_x8nmodp(len2), crc1) ^ crc2


@dataclass
class Sums:
    """What the streams of one save summed (shared by the writer and its file system; picklable, so that
    it travels with the writer into DCP's checkpoint process)."""

    files: dict[str, tuple[int, int]] = field(default_factory=dict)
    """(size, CRC-32) of each file written whole, by its name in the checkpoint directory."""
    expect: frozenset[tuple[int, int]] = frozenset()
    """(address, bytes) of the staged buffers whose own CRC-32 is wanted (this process's addresses)."""
    pieces: dict[tuple[int, int], int] = field(default_factory=dict)
    """CRC-32 of each of those buffers as written, by (address, bytes)."""

    def __getstate__(self) -> dict[str, Any]:
        # addresses mean nothing in another process: DCP's checkpoint process sums files only
        return {"files": self.files, "expect": frozenset(), "pieces": {}}


def buffer_key(tensor: Any) -> tuple[int, int] | None:
    """(address, bytes) of a contiguous, non-empty tensor's data: how `Sums.expect` and `Sums.pieces` name a
    staged buffer (the stager names its buffers so, the memory copy looks its tensors up so); None for
    another tensor."""
    if not tensor.is_contiguous() or tensor.numel() == 0:
        return None
    return (int(tensor.data_ptr()), int(tensor.numel() * tensor.element_size()))


def _name(path: str | os.PathLike[str]) -> str:
    return os.fspath(path).replace(os.sep, "/").rpartition("/")[2]


def _same_dir(path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> bool:
    return (
        os.fspath(path).replace(os.sep, "/").rpartition("/")[0]
        == (os.fspath(new_path).replace(os.sep, "/").rpartition("/")[0])
    )


class SummingStream:
    """A write stream that sums what it is handed (see the module docstring); everything else is the
    wrapped stream's."""

    def __init__(self, raw: Any, sums: Sums) -> None:
        self._raw = raw
        self._sums = sums
        self.crc = 0
        self.size = 0
        self.whole = True
        """False once anything but appending happened (a seek, a truncate): no sum is recorded then."""
        self.direct = False
        """Send writes of at least `direct_io.MIN_BYTES` past the page cache where they can go (the raw-record
        writer asks for it: its large records start at a multiple of `direct_io.ALIGN`)."""

    def write(self, data: Any) -> int:
        try:
            view = memoryview(data)
        except TypeError:
            view = None
        if view is None or not view.contiguous:
            self.whole = False
            return int(self._raw.write(data))
        nbytes = view.nbytes
        expect = self._sums.expect
        key = None
        if nbytes >= PIECE_MIN_BYTES and expect:
            address = address_of(view)
            key = (address, nbytes) if address is not None and (address, nbytes) in expect else None
        if key is None:
            self.crc = crc32(view, self.crc)
        else:
            piece = crc32(view)
            self._sums.pieces[key] = piece
            self.crc = crc32_combine(self.crc, piece, nbytes)
        done = write_aligned(self._raw, view) if self.direct and nbytes >= MIN_BYTES else 0
        if done:
            rest = self._raw.write(view[done:]) if done < nbytes else 0
            written = done + (nbytes - done if rest is None else int(rest))
        else:
            written = self._raw.write(data)
        if written is not None and written != nbytes:
            self.whole = False  # a raw stream's short write: the caller writes the rest, unsummed
        self.size += nbytes
        return nbytes if written is None else int(written)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def seek(self, *args: Any) -> int:
        self.whole = False
        return int(self._raw.seek(*args))

    def truncate(self, *args: Any) -> int:
        self.whole = False
        return int(self._raw.truncate(*args))

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close, closed, ...
        return getattr(self._raw, name)


class SummingFileSystem:
    """DCP's file system of a storage writer (`FileSystemWriter.fs`), with each stream opened for writing
    summed into `sums` (see the module docstring); every other call is the wrapped one's."""

    def __init__(self, inner: Any, sums: Sums) -> None:
        self.inner = inner
        self.sums = sums

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        if mode != "wb":
            with self.inner.create_stream(path, mode) as stream:
                yield stream
            return
        name = _name(path)
        self.sums.files.pop(name, None)  # written again: the earlier sum no longer holds
        with self.inner.create_stream(path, mode) as raw:
            stream = SummingStream(raw, self.sums)
            yield stream
        if stream.whole:
            self.sums.files[name] = (stream.size, stream.crc)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        """The wrapped rename; the sum goes with the file (DCP writes `.metadata` under a temporary name)."""
        self.inner.rename(path, new_path)
        summed = self.sums.files.pop(_name(path), None)
        self.sums.files.pop(_name(new_path), None)
        if summed is not None and _same_dir(path, new_path):
            self.sums.files[_name(new_path)] = summed

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("inner", "sums"):  # unpickling: nothing is set yet
            raise AttributeError(name)
        return getattr(self.inner, name)
