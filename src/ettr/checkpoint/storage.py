"""Where checkpoints live: a local directory (with fsync of files and directories) or any fsspec URL.

Both backends implement `ettr.checkpoint.base.CheckpointStorage`, and each hands out the DCP writer and
reader that suit it (callers never ask which backend they hold). `open_storage` picks one from the root: a
plain path or a `file://` URL is local; anything else goes through fsspec (an optional dependency, imported
only then). Local files are written through `ettr.atomic`, and nothing below a local root is reached
through a symlink (docs/checkpointing.md); fsspec backends keep their own durable close.
The dict-backed fake for tests is `ettr.testing.memory_storage.MemoryStorage` (no optional extra needed).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import stat
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, BinaryIO

from ettr import torch_compat
from ettr.atomic import fsync_dir, write_temp
from ettr.checkpoint.base import MANIFEST_NAME, CheckpointError
from ettr.untrusted import TooDeep, open_regular, remove_tree

logger = logging.getLogger("ettr")

if TYPE_CHECKING:
    from torch.distributed.checkpoint import StorageReader, StorageWriter


def _tmp_name(rel: str) -> str:
    head, _, tail = rel.rpartition("/")
    name = f".{tail}.{uuid.uuid4().hex[:8]}.tmp"
    return f"{head}/{name}" if head else name


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | _NOFOLLOW


class SymlinkRefused(OSError):
    """A path below a checkpoint root leads through a symlink (or a device, a FIFO): ettr does not follow it."""


def _parts(rel: str) -> list[str]:
    """The components of a path relative to the root; refuses absolute paths and `.`/`..`."""
    text = os.fspath(rel)
    parts = [p for p in text.split("/") if p]
    if text.startswith("/") or any(p in (".", "..") for p in parts) or "\0" in text:
        raise SymlinkRefused(errno.EINVAL, "not a path below the checkpoint root", text)
    return parts


def _refused(exc: OSError, where: str) -> OSError:
    """An O_NOFOLLOW open that met a symlink (ELOOP, or ENOTDIR for a directory) said as such."""
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return SymlinkRefused(exc.errno, "a symlink or not a directory; ettr does not follow it", where)
    return exc


class LocalStorage:
    """Checkpoints in a local (or network-mounted POSIX) directory.

    Nothing below the root is reached through a symlink (the root itself may be one: the user chose it).
    Reads open every directory below the root, and the file, with O_NOFOLLOW; listings leave out
    symlinks, devices and FIFOs, so retention, leases, quarantine and `latest` never see them; writes,
    removals and renames check that no directory on the way is a symlink; DCP's reader and writer get a
    file system that does the same (`_NoFollowFileSystem`), and a symlink where a checkpoint directory is
    to be written is removed, never written through.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.path.abspath(os.fspath(root))

    def __repr__(self) -> str:
        return f"LocalStorage({self.root!r})"

    @property
    def url(self) -> str:
        return self.root

    def path(self, rel: str) -> str:
        return os.path.join(self.root, rel) if rel else self.root

    # -- no symlink below the root -----------------------------------------------------------------------
    @contextlib.contextmanager
    def _dir(self, rel_dir: str, *, create: bool = False) -> Iterator[int]:
        """A descriptor of directory `rel_dir`, each component opened with O_NOFOLLOW (made, 0755, when
        missing and `create`). Raises FileNotFoundError or SymlinkRefused."""
        if create:
            os.makedirs(self.root, exist_ok=True)  # the root itself (it may be a symlink: the user's choice)
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            walked = ""
            for part in _parts(rel_dir):
                walked = f"{walked}/{part}" if walked else part
                try:
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=fd)
                    try:
                        child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                    except OSError as exc:
                        raise _refused(exc, self.path(walked)) from None
                except OSError as exc:
                    raise _refused(exc, self.path(walked)) from None
                os.close(fd)
                fd = child
            yield fd
        finally:
            os.close(fd)

    def _split(self, rel: str) -> tuple[str, str]:
        parts = _parts(rel)
        if not parts:
            raise SymlinkRefused(errno.EISDIR, "names the root, not a file below it", self.root)
        return "/".join(parts[:-1]), parts[-1]

    def _checked_dir_path(self, rel_dir: str, *, create: bool = False) -> str:
        """The path of directory `rel_dir` after checking that no component below the root is a symlink."""
        with self._dir(rel_dir, create=create):
            pass
        return self.path(rel_dir)

    def open_no_follow(self, rel: str, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
        """A descriptor of file `rel`, opened without following a symlink anywhere below the root; a
        read of anything but a regular file is refused."""
        head, name = self._split(rel)
        with self._dir(head, create=bool(flags & os.O_CREAT)) as dir_fd:
            try:  # never blocks: a FIFO named like a manifest would hold a resume for ever
                return open_regular(name, flags, mode, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno == errno.EINVAL:
                    raise SymlinkRefused(errno.EINVAL, exc.strerror, self.path(rel)) from None
                raise _refused(exc, self.path(rel)) from None

    # -- the storage Protocol ----------------------------------------------------------------------------
    def list_dir(self, rel: str = "") -> dict[str, int | None]:
        entries: dict[str, int | None] = {}
        try:
            with self._dir(rel) as fd, os.scandir(fd) as it:
                for entry in it:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # removed while we looked
                    if stat.S_ISDIR(st.st_mode):
                        entries[entry.name] = None
                    elif stat.S_ISREG(st.st_mode):
                        entries[entry.name] = st.st_size
                    # symlinks, devices, FIFOs, sockets: not ettr's, never followed, not listed
        except (FileNotFoundError, NotADirectoryError, SymlinkRefused):
            return {}
        return entries

    @contextlib.contextmanager
    def open_read(self, rel: str) -> Iterator[BinaryIO]:
        with os.fdopen(self.open_no_follow(rel), "rb") as stream:
            yield stream

    def read_bytes(self, rel: str) -> bytes:
        with os.fdopen(self.open_no_follow(rel), "rb") as stream:
            return stream.read()

    def write_atomic(self, rel: str, data: bytes, *, on_partial: Callable[[], None] | None = None) -> None:
        head, _name = self._split(rel)
        self._checked_dir_path(head, create=True)
        final = self.path(rel)
        directory = os.path.dirname(final)
        tmp = write_temp(final, data)  # ettr.atomic: exclusive, never through a symlink, fsync'd
        try:
            if on_partial is not None:
                on_partial()  # the data is in a temporary file, not yet visible under its name
            os.replace(tmp, final)  # replaces a link at `final`, never follows it
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
        fsync_dir(directory)

    def link_from(self, source: LocalStorage, src_rel: str, rel: str) -> None:
        """Hard-link the regular file `src_rel` of `source` (another local root, or this one) to `rel` here:
        the same bytes under a second name, written nothing. No symlink below either root is followed
        (a symlink at `src_rel` is refused, not linked). Raises OSError: EXDEV across file systems, EEXIST
        when `rel` exists, EPERM/EMLINK where the file system has no hard links (callers write instead)."""
        src_head, src_name = source._split(src_rel)
        head, name = self._split(rel)
        with source._dir(src_head) as src_fd, self._dir(head, create=True) as dst_fd:
            st = os.stat(src_name, dir_fd=src_fd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                raise SymlinkRefused(
                    errno.EINVAL, "not a regular file; ettr does not link it", source.path(src_rel)
                )
            os.link(src_name, name, src_dir_fd=src_fd, dst_dir_fd=dst_fd, follow_symlinks=False)

    def make_durable(self, rel_dir: str) -> None:
        full = self._checked_dir_path(rel_dir)
        fsync_dir(full)
        fsync_dir(os.path.dirname(full.rstrip(os.sep)) or os.sep)

    def remove(self, rel: str) -> None:
        head, name = self._split(rel)
        try:
            with self._dir(head) as dir_fd:
                os.unlink(name, dir_fd=dir_fd)  # a symlink is removed itself, never its target
        except FileNotFoundError:
            pass

    def remove_tree(self, rel_dir: str) -> None:
        head, name = self._split(rel_dir)
        try:
            with self._dir(head) as parent_fd:
                st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    os.unlink(name, dir_fd=parent_fd)  # a planted link goes, what it points at stays
                    return
        except FileNotFoundError:
            return
        with contextlib.suppress(FileNotFoundError), self._dir(rel_dir) as fd:
            os.unlink(MANIFEST_NAME, dir_fd=fd)  # first: a crash midway leaves it incomplete, not committed
            fsync_dir(self.path(rel_dir))
        try:
            remove_tree(self.path(rel_dir))  # never follows symlinks inside, nor recurses
        except OSError as exc:
            if not os.path.lexists(self.path(rel_dir)):
                return
            if isinstance(exc, TooDeep):
                raise
            # as shutil.rmtree(ignore_errors=True) did: what cannot be deleted is left, quietly

    def rename(self, rel: str, new_rel: str) -> None:
        head, name = self._split(rel)
        new_head, new_name = self._split(new_rel)
        with self._dir(head) as src_fd, self._dir(new_head) as dst_fd:
            os.replace(name, new_name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
        fsync_dir(self.path(new_head))

    def prepare_dir(self, rel_dir: str) -> None:
        """Make `rel_dir` a real directory to write a checkpoint into: a symlink (or file) planted under
        its name is removed, never written through."""
        head, name = self._split(rel_dir)
        with self._dir(head, create=True) as parent_fd:
            try:
                st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None and not stat.S_ISDIR(st.st_mode):
                logger.warning("ettr: removing %s, which is not a directory (a symlink?)", self.path(rel_dir))
                os.unlink(name, dir_fd=parent_fd)
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o755, dir_fd=parent_fd)

    def dcp_writer(self, rel_dir: str, *, thread_count: int = 1) -> StorageWriter:
        """DCP's local writer: one file per rank, each fsync'd before `write_data` returns; it writes
        through `_NoFollowFileSystem` into a directory `prepare_dir` made real."""
        from torch.distributed.checkpoint import FileSystemWriter

        self.prepare_dir(rel_dir)
        writer = FileSystemWriter(
            self.path(rel_dir), single_file_per_rank=True, sync_files=True, thread_count=thread_count
        )
        writer.fs = _NoFollowFileSystem(self)
        return writer

    def dcp_reader(self, rel_dir: str) -> StorageReader:
        from torch.distributed.checkpoint import FileSystemReader

        reader = FileSystemReader(self.path(rel_dir))
        reader.fs = _NoFollowFileSystem(self)
        return reader


@functools.cache
def _no_follow_file_system() -> type:
    """DCP's local FileSystem, opening every path below a LocalStorage root without following symlinks."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class NoFollowFileSystem(FileSystem):
        def __init__(self, storage: LocalStorage) -> None:
            self.storage = storage

        def __reduce__(self) -> tuple[Any, ...]:  # DCP's process mode pickles the writer
            return (_NoFollowFileSystem, (self.storage,))

        def _rel(self, path: str | os.PathLike[str]) -> str:
            rel = os.path.relpath(os.fspath(path), self.storage.root)
            if rel == "." or rel.startswith(".."):
                raise SymlinkRefused(errno.EINVAL, "outside the checkpoint root", os.fspath(path))
            return rel.replace(os.sep, "/")

        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
            if mode == "rb":
                flags = os.O_RDONLY
            elif mode == "wb":
                flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            else:
                raise ValueError(f"unsupported mode {mode!r}")
            with os.fdopen(self.storage.open_no_follow(self._rel(path), flags), mode) as stream:
                yield stream

        def mkdir(self, path: str | os.PathLike[str]) -> None:
            self.storage.prepare_dir(self._rel(path))

        def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
            self.storage.rename(self._rel(path), self._rel(new_path))

        def exists(self, path: str | os.PathLike[str]) -> bool:
            rel = self._rel(path)
            head, _, name = rel.rpartition("/")
            return name in self.storage.list_dir(head)

        def rm_file(self, path: str | os.PathLike[str]) -> None:
            self.storage.remove(self._rel(path))

        def ls(self, path: str | os.PathLike[str]) -> list[str]:
            return [os.path.join(os.fspath(path), n) for n in self.storage.list_dir(self._rel(path))]

    return NoFollowFileSystem


def _NoFollowFileSystem(storage: LocalStorage) -> Any:  # noqa: N802 - a class made on first use (torch import)
    return _no_follow_file_system()(storage)


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
            FsspecWriter = torch_compat.fsspec_writer_class()
        except ImportError:  # pragma: no cover - depends on the environment
            raise CheckpointError(
                f"{self._url} needs fsspec (install it: pip install fsspec, and the filesystem's own package, e.g. s3fs or gcsfs)"
            ) from None
        return FsspecWriter(
            self.path(rel_dir), single_file_per_rank=True, sync_files=False, thread_count=thread_count
        )

    def dcp_reader(self, rel_dir: str) -> StorageReader:
        return torch_compat.fsspec_reader_class()(self.path(rel_dir))


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
