"""A dict-backed `CheckpointStorage` for tests: no disk, no optional extra (fsspec is not needed).

`MemoryStorage` keeps every file as bytes in a dict keyed by its path relative to the root; directories are
implicit (a name with files under it). It implements the whole seam, including the DCP writer and reader
(DCP's own file-system writer and reader over a `FileSystemBase` that reads and writes the dict), so a
`CheckpointManager` runs on it unchanged in thread mode:

    storage = MemoryStorage()
    with CheckpointManager(config, state, recorder=SyncRecorder(), storage=storage) as manager: ...

It lives in one process: the process persist mode (which pickles its storage into DCP's checkpoint process)
needs a real backend. Thread-safe (DCP's writer threads write to it concurrently).
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
import uuid
from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any, BinaryIO

from ettr.checkpoint.base import MANIFEST_NAME

if TYPE_CHECKING:
    from torch.distributed.checkpoint import StorageReader, StorageWriter

_SCHEME = "memory-fake://"


class MemoryStorage:
    """Checkpoints in a dict (see the module docstring). `name` only tells instances apart in messages."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name or uuid.uuid4().hex[:8]
        self.files: dict[str, bytes] = {}
        """Every file, by its path relative to the root (what the tests inspect or corrupt)."""
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"MemoryStorage({self.name!r}, {len(self.files)} files)"

    def __reduce__(self) -> Any:
        raise TypeError("MemoryStorage lives in one process (the process persist mode needs a real backend)")

    @property
    def url(self) -> str:
        return f"{_SCHEME}{self.name}"

    def path(self, rel: str) -> str:
        return f"{self.url}/{rel}" if rel else self.url

    def rel(self, full: str | os.PathLike[str]) -> str:
        """The relative path of a full path handed out by `path` (what DCP passes back)."""
        text = os.fspath(full)
        if text == self.url:
            return ""
        prefix = self.url + "/"
        if not text.startswith(prefix):
            raise FileNotFoundError(f"{text} is not inside {self.url}")
        return text[len(prefix) :].strip("/")

    def list_dir(self, rel: str = "") -> dict[str, int | None]:
        prefix = f"{rel.strip('/')}/" if rel.strip("/") else ""
        entries: dict[str, int | None] = {}
        with self._lock:
            for name, data in self.files.items():
                if not name.startswith(prefix):
                    continue
                head, sep, _ = name[len(prefix) :].partition("/")
                entries[head] = None if sep else len(data)
        return entries

    @contextlib.contextmanager
    def open_read(self, rel: str) -> Iterator[BinaryIO]:
        yield io.BytesIO(self.read_bytes(rel))

    def read_bytes(self, rel: str) -> bytes:
        with self._lock:
            try:
                return self.files[rel]
            except KeyError:
                raise FileNotFoundError(self.path(rel)) from None

    def write_atomic(self, rel: str, data: bytes, *, on_partial: Callable[[], None] | None = None) -> None:
        if on_partial is not None:
            on_partial()  # nothing is visible yet: the dict entry appears whole, below
        self._put(rel, bytes(data))

    def _put(self, rel: str, data: bytes) -> None:
        with self._lock:
            self.files[rel] = data

    def make_durable(self, rel_dir: str) -> None:
        pass  # every write is "durable" at once

    def remove(self, rel: str) -> None:
        with self._lock:
            self.files.pop(rel, None)

    def remove_tree(self, rel_dir: str) -> None:
        self.remove(f"{rel_dir}/{MANIFEST_NAME}")  # the manifest first, as on disk
        prefix = f"{rel_dir}/"
        with self._lock:
            for name in [n for n in self.files if n.startswith(prefix)]:
                del self.files[name]

    def rename(self, rel: str, new_rel: str) -> None:
        with self._lock:
            if rel in self.files:
                self.files[new_rel] = self.files.pop(rel)
                return
            prefix = f"{rel}/"
            moved = [n for n in self.files if n.startswith(prefix)]
            if not moved:
                raise FileNotFoundError(self.path(rel))
            for name in moved:
                self.files[f"{new_rel}/{name[len(prefix) :]}"] = self.files.pop(name)

    def dcp_writer(self, rel_dir: str, *, thread_count: int = 1) -> StorageWriter:
        from torch.distributed.checkpoint.filesystem import _FileSystemWriter

        writer = _FileSystemWriter(
            self.path(rel_dir), single_file_per_rank=True, sync_files=False, thread_count=thread_count
        )
        writer.fs = _dict_file_system(self)
        writer.path = self.path(rel_dir)
        return writer

    def dcp_reader(self, rel_dir: str) -> StorageReader:
        from torch.distributed.checkpoint import FileSystemReader

        reader = FileSystemReader(self.path(rel_dir))
        reader.fs = _dict_file_system(self)
        reader.path = self.path(rel_dir)
        return reader


class _Stream(io.BytesIO):
    """A file being written: it appears in the storage, whole, when closed."""

    def __init__(self, storage: MemoryStorage, rel: str) -> None:
        super().__init__()
        self._storage, self._rel = storage, rel

    def close(self) -> None:
        if not self.closed:
            self._storage._put(self._rel, self.getvalue())
        super().close()


def _dict_file_system(storage: MemoryStorage) -> Any:
    from torch.distributed.checkpoint.filesystem import FileSystemBase

    class DictFileSystem(FileSystemBase):
        """DCP's file-system interface over a `MemoryStorage`."""

        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
            rel = storage.rel(path)
            if "w" in mode:
                with _Stream(storage, rel) as stream:
                    yield stream
            else:
                with io.BytesIO(storage.read_bytes(rel)) as stream:
                    yield stream

        def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
            return f"{os.fspath(path).rstrip('/')}/{suffix}"

        def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
            storage.rename(storage.rel(path), storage.rel(new_path))

        def init_path(self, path: str | os.PathLike[str]) -> str:
            return os.fspath(path)

        def mkdir(self, path: str | os.PathLike[str]) -> None:
            pass  # directories are implicit

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
            return os.fspath(checkpoint_id).startswith(_SCHEME)

        def exists(self, path: str | os.PathLike[str]) -> bool:
            rel = storage.rel(path)
            head, _, tail = rel.rpartition("/")
            return tail in storage.list_dir(head)

        def rm_file(self, path: str | os.PathLike[str]) -> None:
            storage.remove(storage.rel(path))

    return DictFileSystem()
