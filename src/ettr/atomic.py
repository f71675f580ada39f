"""Commit-last file writes: the one helper every ettr writer uses to make a file appear whole or not at all.

`atomic_write(path, data)` writes to a fresh temporary name beside `path` (created exclusively, never through
a symlink), fsyncs it, renames it over `path` and fsyncs the directory. A reader sees the old file or the new
one, never half of either; a crash leaves at most a stray `.NAME.*.tmp` beside it.

One errno policy: a directory that cannot be fsync'd (EINVAL/ENOTSUP/EBADF on some filesystems) is accepted,
since the rename is then as durable as that filesystem makes it; every other error is raised as `OSError`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

_DIR_FSYNC_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EACCES, errno.EPERM})


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so that a rename or create inside it is durable (accepted where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as exc:
        if exc.errno in _DIR_FSYNC_UNSUPPORTED:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _DIR_FSYNC_UNSUPPORTED:
            raise
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """fsync a regular file another library wrote (torch.save, safetensors) before it is committed."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_temp(
    path: str | os.PathLike[str], data: bytes | memoryview | str, *, mode: int = 0o644, durable: bool = True
) -> Path:
    """Write `data` durably (without `durable`: not fsync'd) to a new temporary file beside `path` and return
    its name (not yet renamed).

    The temporary name is random and created with O_EXCL | O_NOFOLLOW, so a file or symlink planted under a
    predictable name is never written through.
    """
    target = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    tmp, fd = _open_temp(target, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            if durable:
                os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    return tmp


def _open_temp(target: Path, mode: int) -> tuple[Path, int]:
    """A new temporary file beside `target` (random name, O_EXCL | O_NOFOLLOW: never one planted there),
    open for reading and writing."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
    return tmp, os.open(tmp, flags, mode)


def atomic_fill(
    path: str | os.PathLike[str], fill: Callable[[int], None], *, mode: int = 0o644, durable: bool = True
) -> None:
    """Replace `path` with what `fill(fd)` writes into a new temporary file beside it (`fd` open for reading
    and writing), whole or not at all, as `atomic_write` does; what `fill` raises leaves nothing behind and
    `path` as it was (so `fill` may check what it wrote before it appears)."""
    target = Path(path)
    _refuse_non_regular(target)
    tmp, fd = _open_temp(target, mode)
    try:
        try:
            fill(fd)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    if durable:
        fsync_dir(target.parent)


def _refuse_non_regular(target: Path) -> None:
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise OSError(errno.EEXIST, "exists and is not a regular file; not replaced", str(target))


def atomic_write(
    path: str | os.PathLike[str], data: bytes | memoryview | str, *, mode: int = 0o644, durable: bool = True
) -> None:
    """Replace `path` with `data` whole or not at all, durably (tmp -> fsync -> rename -> dir fsync).

    `durable=False` leaves out both fsyncs: for copies of data kept elsewhere (a cache restored from its
    store), which a process crash still never shows half-written but a power loss may leave short.

    Refuses (OSError EEXIST) to replace anything at `path` that is not a regular file: a symlink, a
    directory or a device node stays as it is.
    """
    payload = memoryview(data.encode("utf-8") if isinstance(data, str) else data).cast("B")

    def fill(fd: int) -> None:
        written = 0
        while written < len(payload):
            written += os.write(fd, payload[written:])

    atomic_fill(path, fill, mode=mode, durable=durable)


def create_exclusive(
    path: str | os.PathLike[str], data: bytes | str, *, mode: int = 0o644, durable: bool = True
) -> bool:
    """Create `path` with `data` unless something is there (atomic, whole, durable unless `durable=False`,
    as for `atomic_write`); whether we created it."""
    target = Path(path)
    tmp = write_temp(target, data, mode=mode, durable=durable)
    try:
        os.link(tmp, target)
    except FileExistsError:
        return False
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)
    if durable:
        fsync_dir(target.parent)
    return True
