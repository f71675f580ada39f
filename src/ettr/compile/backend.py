"""Where the compile store keeps its bytes: a local directory (default), any fsspec URL, or memory (tests).

The store needs a few operations on slash-separated relative paths; each backend implements them with
the one guarantee the commit protocol relies on: `write` is atomic, so a reader sees the old object,
the new object or nothing, never a torn one. A backend that can lock the store across processes (a
local directory: an flock) lets eviction delete unreferenced files at once; one that cannot (an object
store) says so, and eviction then waits for them to age (`store.UNREFERENCED_GRACE_S`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

from ettr.atomic import atomic_write
from ettr.compile.safety import ensure_private_dir, no_symlink_below, read_no_follow


class StoreBackend(Protocol):
    """Blob storage under one root. Paths are relative, `/`-separated, without `..`."""

    compress: bool
    """Whether archives should be compressed before they are written here (worth it over a network)."""

    def read(self, path: str) -> bytes:
        """The object's bytes. Raises `FileNotFoundError` when it does not exist."""
        ...

    def write(self, path: str, data: bytes) -> None:
        """Create or replace the object atomically (durable on return where the medium allows)."""
        ...

    def list(self, prefix: str) -> list[str]:
        """Names (not paths) of the objects and folders directly under `prefix` ("" for the root)."""
        ...

    def delete(self, path: str) -> None:
        """Remove the object; a missing one is not an error."""
        ...

    def exists(self, path: str) -> bool:
        """Whether the object exists."""
        ...

    def age_s(self, path: str) -> float | None:
        """Seconds since the object was last written (None: unknown)."""
        ...

    def lock(self, *, exclusive: bool, wait: bool) -> AbstractContextManager[bool | None]:
        """Hold the store's lock while the block runs (shared by saves and restores, exclusive for
        eviction); yields True when held, False when `wait` is False and another holder has it, None
        when this backend cannot lock across processes."""
        ...

    def describe(self) -> str:
        """Where this is, for messages."""
        ...


_NOT_WRITABLE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
"""What opening the lock file for writing raises in a store this process may read but not write."""


def _check(path: str) -> str:
    parts = path.split("/")
    if path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"bad store path {path!r} (relative, '/'-separated, no '..')")
    return path


def _is_temporary(name: str) -> bool:
    """Whether `name` is one of `ettr.atomic`'s temporary files (`.NAME.<12 hex>.tmp`)."""
    parts = name.split(".")
    return name.startswith(".") and len(parts) >= 4 and parts[-1] == "tmp" and len(parts[-2]) == 12


class LocalBackend:
    """A directory on a local or mounted file system: write to a temporary file, fsync, rename.

    The root must be this user's own and writable by no one else (`ettr.compile.safety`: created 0700
    when missing; refused (`UnsafeLocation`, a PermissionError) when owned by someone else, group- or
    world-writable, or a symlink); no symlink inside it is followed."""

    compress = False  # a local disk reads uncompressed archives faster than it would decompress them

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser()
        self._checked = False

    def _safe(self, path: str, *, create: bool = False) -> Path:
        if not self._checked:
            if create:
                ensure_private_dir(self.root)
            elif self.root.exists() or self.root.is_symlink():
                ensure_private_dir(self.root)
            else:
                return self.root / _check(path)  # nothing there yet: nothing to read
            self._checked = True
        return no_symlink_below(self.root, _check(path))

    def read(self, path: str) -> bytes:
        return read_no_follow(self._safe(path))

    def local_file(self, path: str) -> Path:
        """Where the object `path` is on this node's disk (checked as `read` checks it; not opened), for a
        kernel copy of it (`CompileStore.copy_into`)."""
        return self._safe(path)

    def write(self, path: str, data: bytes) -> None:
        target = self._safe(path, create=True)
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        atomic_write(target, data)  # tmp -> fsync -> rename (over a link, never through it) -> dir fsync

    def list(self, prefix: str) -> list[str]:
        folder = self._safe(prefix) if prefix else self.root
        if not prefix and self.root.exists():
            self._safe("x")  # the root's own check
        try:
            with os.scandir(folder) as found:  # the directory's own entry types: no stat per name
                return sorted(e.name for e in found if not e.name.startswith(".") and not e.is_symlink())
        except (FileNotFoundError, NotADirectoryError):
            return []

    def delete(self, path: str) -> None:
        try:
            (self.root / _check(path)).unlink()
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            try:
                (self.root / path).rmdir()
            except OSError:
                pass

    def remove_temporaries(self, prefix: str) -> int:
        """Delete the temporary files (`ettr.atomic`'s `.NAME.*.tmp`) directly under `prefix`: a writer killed
        mid-write leaves one (up to the 156 MB precompiled header), which `list` does not show, so nothing
        else would ever delete or count it. Call only under the exclusive lock (no writer is in flight).
        Returns how many it deleted."""
        folder = self._safe(prefix) if prefix else self.root
        removed = 0
        try:
            with os.scandir(folder) as found:
                stray = [e.name for e in found if _is_temporary(e.name) and e.is_file(follow_symlinks=False)]
        except (FileNotFoundError, NotADirectoryError):
            return 0
        for name in stray:
            try:
                (folder / name).unlink()
                removed += 1
            except FileNotFoundError:
                pass
        return removed

    def exists(self, path: str) -> bool:
        try:
            return os.lstat(self._safe(path)).st_size >= 0
        except FileNotFoundError:
            return False

    def age_s(self, path: str) -> float | None:
        try:
            return time.time() - os.lstat(self._safe(path)).st_mtime
        except OSError:
            return None

    @contextlib.contextmanager
    def lock(self, *, exclusive: bool, wait: bool) -> Iterator[bool | None]:
        """An flock on `<root>/.lock` (released when its holder ends, however it ends).

        A store this process cannot write (a read-only mount of a store filled elsewhere) is still read: the
        lock file is opened read-only (an flock needs no write access), and where there is none and none can
        be made, readers go on unlocked (`None`: no process can save into or evict from such a store) and
        eviction is skipped (`False`). Before, every restore from it failed on the lock file (EROFS) and the
        job compiled cold although the store held its entry."""
        self._safe("x", create=True)  # the root: made private, or refused
        path = self.root / ".lock"
        flags = os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | flags, 0o600)
        except OSError as exc:
            if exc.errno not in _NOT_WRITABLE:
                raise
            try:
                fd = os.open(path, os.O_RDONLY | flags)
            except FileNotFoundError:
                yield None if not exclusive else False
                return
        try:
            mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
            try:
                fcntl.flock(fd, mode if wait else mode | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)  # releases the flock

    def describe(self) -> str:
        return str(self.root)


class FsspecBackend:
    """Any fsspec URL (`s3://bucket/prefix`, `gs://...`, `memory://...`). Object stores replace an object
    atomically on put, which is the commit this store needs; fsspec is imported on first use."""

    compress = True

    def __init__(self, url: str) -> None:
        import fsspec

        self.url = url.rstrip("/")
        self._fs, self._root = fsspec.core.url_to_fs(self.url)

    def _full(self, path: str) -> str:
        return f"{self._root}/{_check(path)}" if path else self._root

    def read(self, path: str) -> bytes:
        try:
            return self._fs.cat_file(self._full(path))
        except FileNotFoundError:
            raise
        except OSError as exc:  # some backends wrap "not found"
            if not self._fs.exists(self._full(path)):
                raise FileNotFoundError(path) from exc
            raise

    def write(self, path: str, data: bytes) -> None:
        full = self._full(path)
        parent = full.rsplit("/", 1)[0]
        try:
            self._fs.makedirs(parent, exist_ok=True)
        except Exception:  # object stores have no folders
            pass
        self._fs.pipe_file(full, data)

    def list(self, prefix: str) -> list[str]:
        try:
            entries = self._fs.ls(self._full(prefix), detail=False)
        except FileNotFoundError:
            return []
        names = sorted({str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries})
        return [n for n in names if n and not n.startswith(".")]

    def delete(self, path: str) -> None:
        try:
            self._fs.rm(self._full(path), recursive=True)
        except FileNotFoundError:
            pass

    def exists(self, path: str) -> bool:
        return bool(self._fs.exists(self._full(path)))

    def age_s(self, path: str) -> float | None:
        try:
            info = self._fs.info(self._full(path))
        except (OSError, ValueError):
            return None
        stamp = info.get("mtime") or info.get("LastModified") or info.get("created")
        if hasattr(stamp, "timestamp"):
            stamp = stamp.timestamp()
        try:
            return time.time() - float(stamp) if stamp is not None else None
        except (TypeError, ValueError):
            return None

    @contextlib.contextmanager
    def lock(self, *, exclusive: bool, wait: bool) -> Iterator[bool | None]:
        yield None  # object stores have no locks: eviction waits for unreferenced files to age

    def describe(self) -> str:
        return self.url


class MemoryBackend:
    """In-memory fake for tests (thread-safe); `objects` maps paths to bytes."""

    compress = True  # as a remote store would be

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.written_ts: dict[str, float] = {}
        self._lock = threading.Lock()
        self._store_lock = _ReadersWriterLock()

    def read(self, path: str) -> bytes:
        with self._lock:
            try:
                return self.objects[_check(path)]
            except KeyError:
                raise FileNotFoundError(path) from None

    def write(self, path: str, data: bytes) -> None:
        with self._lock:
            self.objects[_check(path)] = bytes(data)
            self.written_ts[path] = time.time()

    def list(self, prefix: str) -> list[str]:
        head = f"{prefix}/" if prefix else ""
        with self._lock:
            names = {p[len(head) :].split("/", 1)[0] for p in self.objects if p.startswith(head)}
        return sorted(n for n in names if n and not n.startswith("."))

    def delete(self, path: str) -> None:
        with self._lock:
            self.objects.pop(path, None)
            self.written_ts.pop(path, None)

    def exists(self, path: str) -> bool:
        with self._lock:
            return path in self.objects

    def age_s(self, path: str) -> float | None:
        with self._lock:
            written = self.written_ts.get(path)
        return None if written is None else time.time() - written

    def lock(self, *, exclusive: bool, wait: bool) -> AbstractContextManager[bool | None]:
        return self._store_lock.hold(exclusive=exclusive, wait=wait)

    def describe(self) -> str:
        return "memory"


class _ReadersWriterLock:
    """Shared and exclusive holders in one process (the memory backend's store lock)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False

    @contextlib.contextmanager
    def hold(self, *, exclusive: bool, wait: bool) -> Iterator[bool | None]:
        with self._cond:
            while self._writer or (exclusive and self._readers):
                if not wait:
                    break
                self._cond.wait()
            held = not (self._writer or (exclusive and self._readers))
            if held and exclusive:
                self._writer = True
            elif held:
                self._readers += 1
        if not held:
            yield False
            return
        try:
            yield True
        finally:
            with self._cond:
                if exclusive:
                    self._writer = False
                else:
                    self._readers -= 1
                self._cond.notify_all()


def open_backend(location: str | os.PathLike[str]) -> StoreBackend:
    """A backend for a path or URL: `file://` and plain paths are local, other URLs go through fsspec."""
    text = os.fspath(location)
    if "://" in text and not text.startswith("file://"):
        return FsspecBackend(text)
    return LocalBackend(text.removeprefix("file://"))
