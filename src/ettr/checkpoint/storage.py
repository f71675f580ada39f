"""Where checkpoints live: a local directory (with fsync of files and directories) or any fsspec URL.

Both backends implement `ettr.checkpoint.base.CheckpointStorage`, and each hands out the DCP writer and
reader that suit it (callers never ask which backend they hold). `open_storage` picks one from the root: a
plain path or a `file://` URL is local; anything else goes through fsspec (an optional dependency, imported
only then). Local files are written through `ettr.atomic`; fsspec backends keep their own durable close.
The dict-backed fake for tests is `ettr.testing.memory_storage.MemoryStorage` (no optional extra needed).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, BinaryIO

from ettr.atomic import fsync_dir, write_temp
from ettr.checkpoint.base import MANIFEST_NAME, CheckpointError

if TYPE_CHECKING:
    from torch.distributed.checkpoint import StorageReader, StorageWriter


def _tmp_name(rel: str) -> str:
    head, _, tail = rel.rpartition("/")
    name = f".{tail}.{uuid.uuid4().hex[:8]}.tmp"
    return f"{head}/{name}" if head else name


class LocalStorage:
    """Checkpoints in a local (or network-mounted POSIX) directory."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.path.abspath(os.fspath(root))

    def __repr__(self) -> str:
        return f"LocalStorage({self.root!r})"

    @property
    def url(self) -> str:
        return self.root

    def path(self, rel: str) -> str:
        return os.path.join(self.root, rel) if rel else self.root

    def list_dir(self, rel: str = "") -> dict[str, int | None]:
        entries: dict[str, int | None] = {}
        try:
            with os.scandir(self.path(rel)) as it:
                for entry in it:
                    try:
                        entries[entry.name] = None if entry.is_dir() else entry.stat().st_size
                    except FileNotFoundError:
                        continue  # removed while we looked
        except (FileNotFoundError, NotADirectoryError):
            return {}
        return entries

    @contextlib.contextmanager
    def open_read(self, rel: str) -> Iterator[BinaryIO]:
        with open(self.path(rel), "rb") as stream:
            yield stream

    def read_bytes(self, rel: str) -> bytes:
        with open(self.path(rel), "rb") as stream:
            return stream.read()

    def write_atomic(self, rel: str, data: bytes, *, on_partial: Callable[[], None] | None = None) -> None:
        final = self.path(rel)
        directory = os.path.dirname(final)
        os.makedirs(directory, exist_ok=True)
        tmp = write_temp(final, data)  # ettr.atomic: exclusive, never through a symlink, fsync'd
        try:
            if on_partial is not None:
                on_partial()  # the data is in a temporary file, not yet visible under its name
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
        fsync_dir(directory)

    def make_durable(self, rel_dir: str) -> None:
        full = self.path(rel_dir)
        fsync_dir(full)
        fsync_dir(os.path.dirname(full.rstrip(os.sep)) or os.sep)

    def remove(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path(rel))

    def remove_tree(self, rel_dir: str) -> None:
        full = self.path(rel_dir)
        if os.path.exists(os.path.join(full, MANIFEST_NAME)):
            os.remove(os.path.join(full, MANIFEST_NAME))
            fsync_dir(full)
        shutil.rmtree(full, ignore_errors=True)

    def rename(self, rel: str, new_rel: str) -> None:
        os.replace(self.path(rel), self.path(new_rel))
        fsync_dir(os.path.dirname(self.path(new_rel)))

    def dcp_writer(self, rel_dir: str, *, thread_count: int = 1) -> StorageWriter:
        """DCP's local writer: one file per rank, each fsync'd before `write_data` returns."""
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(
            self.path(rel_dir), single_file_per_rank=True, sync_files=True, thread_count=thread_count
        )

    def dcp_reader(self, rel_dir: str) -> StorageReader:
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(self.path(rel_dir))


class FsspecStorage:
    """Checkpoints behind an fsspec URL (object stores, `memory://` in tests).

    A file written through fsspec is durable once its `close()` returns (an object store completes the
    upload there); a rename of a single object is a copy that appears whole. Directories are implicit.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        from fsspec.core import url_to_fs

        self._url = url.rstrip("/")
        self._options = dict(storage_options or {})
        self._fs, self._root = url_to_fs(self._url, **self._options)

    def __repr__(self) -> str:
        return f"FsspecStorage({self._url!r})"

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self._url, "options": self._options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"], state["options"])  # type: ignore[misc]

    @property
    def url(self) -> str:
        return self._url

    def path(self, rel: str) -> str:
        return f"{self._url}/{rel}" if rel else self._url

    def _full(self, rel: str) -> str:
        return f"{self._root}/{rel}" if rel else self._root

    def list_dir(self, rel: str = "") -> dict[str, int | None]:
        try:
            infos = self._fs.ls(self._full(rel), detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        entries: dict[str, int | None] = {}
        for info in infos:
            name = info["name"].rstrip("/").rsplit("/", 1)[-1]
            entries[name] = None if info.get("type") == "directory" else int(info.get("size") or 0)
        return entries

    @contextlib.contextmanager
    def open_read(self, rel: str) -> Iterator[BinaryIO]:
        with self._fs.open(self._full(rel), "rb") as stream:
            yield stream

    def read_bytes(self, rel: str) -> bytes:
        return self._fs.cat_file(self._full(rel))

    def write_atomic(self, rel: str, data: bytes, *, on_partial: Callable[[], None] | None = None) -> None:
        tmp = self._full(_tmp_name(rel))
        head = self._full(rel).rpartition("/")[0]
        if head:
            self._fs.makedirs(head, exist_ok=True)
        with self._fs.open(tmp, "wb") as stream:
            half = len(data) // 2
            stream.write(data[:half])
            if on_partial is not None:
                on_partial()
            stream.write(data[half:])
        self._fs.mv(tmp, self._full(rel))

    def make_durable(self, rel_dir: str) -> None:
        pass  # closing a file was the durable point

    def remove(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._fs.rm_file(self._full(rel))

    def remove_tree(self, rel_dir: str) -> None:
        self.remove(f"{rel_dir}/{MANIFEST_NAME}")
        with contextlib.suppress(FileNotFoundError):
            self._fs.rm(self._full(rel_dir), recursive=True)

    def rename(self, rel: str, new_rel: str) -> None:
        self._fs.mv(self._full(rel), self._full(new_rel), recursive=True)

    def dcp_writer(self, rel_dir: str, *, thread_count: int = 1) -> StorageWriter:
        """DCP's fsspec writer. Object stores make a file durable when it is closed; DCP's fsync fallback
        (os.sync) would only flush this machine's unrelated dirty pages, so it is off."""
        try:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
        except ImportError:  # pragma: no cover - depends on the environment
            raise CheckpointError(
                f"{self._url} needs fsspec (install it: pip install fsspec, and the filesystem's own package, e.g. s3fs or gcsfs)"
            ) from None
        return FsspecWriter(
            self.path(rel_dir), single_file_per_rank=True, sync_files=False, thread_count=thread_count
        )

    def dcp_reader(self, rel_dir: str) -> StorageReader:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(self.path(rel_dir))


def is_local(root: str | os.PathLike[str]) -> bool:
    """Whether `root` is a local path (no URL scheme, or `file://`)."""
    text = os.fspath(root)
    return "://" not in text or text.startswith("file://")


def open_storage(
    root: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> LocalStorage | FsspecStorage:
    """The storage backend for a checkpoint root (a path, `file://` URL or other fsspec URL)."""
    text = os.fspath(root)
    if text.startswith("file://"):
        return LocalStorage(text[len("file://") :])
    if "://" not in text:
        return LocalStorage(text)
    return FsspecStorage(text, storage_options)
