"""What a compiled job leaves behind that makes the next start fast, and putting it back.

Three artifacts, by name in a store entry:

* `inductor_cache.tar` — inductor's cache directory (`TORCHINDUCTOR_CACHE_DIR`): FX-graph and
  AOTAutograd cache entries, the compiled C++/Triton kernels themselves, and the PGO profile
  (`dynamo/code_state_*`, written when `torch.compiler.config.job_id` is set).
* `precompiled_headers.tar` — inductor's precompiled C++ header (~150 MB, ~27 MB gzip'd). It lives under
  `$TMPDIR/torchinductor_$USER`, outside the cache directory, and inductor rebuilds it (seconds) before it
  even looks for a cached kernel, so a warm start without it is still slow on CPU.
* `megacache.bin` — `torch.compiler.save_cache_artifacts()`, PyTorch's portable archive. On CPU it does
  not carry compiled kernels; it is loaded only when the cache directory archive is absent.

Archives are tar files, gzip'd or not (`collect(compress=...)`: gzip costs ~1.5 s to pack and ~0.7 s to
unpack the header, and saves ~130 MB of transfer; worth it for remote stores, not for a local disk). They
are unpacked defensively: regular files and folders only, no absolute or `..` paths, each file written to
a temporary name and renamed, files already present with the same size left alone (several ranks may
restore into one directory at once). `listing` records each archive's files and sizes, so a restore onto
a node that still has them (a restart on the same machine) skips reading the archive at all.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import os
import tarfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ettr.atomic import atomic_write
from ettr.compile.safety import (
    UnpackLimits,
    UnsafeLocation,
    check_private_dir,
    ensure_private_dir,
    no_symlink_below,
    read_no_follow,
)

INDUCTOR_ARCHIVE = "inductor_cache.tar"
HEADERS_ARCHIVE = "precompiled_headers.tar"
MEGACACHE = "megacache.bin"
ARTIFACT_NAMES = frozenset({INDUCTOR_ARCHIVE, HEADERS_ARCHIVE, MEGACACHE})

_HEADERS_DIRNAME = "precompiled_headers"
_COMPRESS_LEVEL = 1  # level 1 packs the 150 MB header to ~27 MB in ~1.5 s; higher levels gain little


def inductor_cache_dir() -> Path:
    """The cache directory inductor uses in this process (creates it, as inductor would)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def headers_dir() -> Path:
    """Where inductor keeps precompiled headers (fixed when its codecache module was imported)."""
    import sys

    codecache = sys.modules.get("torch._inductor.codecache")
    header_dir = getattr(codecache, "_HEADER_DIR", None)
    if header_dir:
        return Path(header_dir)
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return Path(default_cache_dir()) / _HEADERS_DIRNAME


def _skip(rel: PurePosixPath) -> bool:
    # Lock files and half-written temporaries are per-process state, never artifacts.
    return any(part == "locks" for part in rel.parts) or rel.suffix in (".lock", ".tmp") or ".tmp" in rel.name


def _walk(root: Path, exclude: Path | None) -> list[tuple[PurePosixPath, os.stat_result]]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if exclude is not None:
            dirnames[:] = [d for d in dirnames if here / d != exclude]
        for filename in filenames:
            path = here / filename
            rel = PurePosixPath(path.relative_to(root).as_posix())
            if _skip(rel):
                continue
            try:
                st = path.stat()
            except OSError:  # removed while we walk
                continue
            if not os.path.islink(path):
                found.append((rel, st))
    found.sort(key=lambda item: str(item[0]))
    return found


def fingerprint(root: Path, *, exclude: Path | None = None) -> str:
    """Cheap digest of a directory's file names and sizes (no content read). Modification times are left
    out: a cache hit may rewrite a file with the same content, which is no reason to save again.

    The PGO profiles (`dynamo/code_state_*`) are left out too: torch adds an entry to them in every
    process (a wrapper's `closure_hash` differs from one process to the next), so a warm job that compiled
    nothing new would save its whole entry again (463 MB for a small MLP with the precompiled header). A
    profile that learns something real comes with a recompile, whose new cache files change the digest,
    and the save then packs the profile too."""
    h = hashlib.sha256()
    if root.is_dir():
        for rel, st in _walk(root, exclude):
            if not _is_pgo_profile(rel):
                h.update(f"{rel}\0{st.st_size}\n".encode())
    return h.hexdigest()[:16]


def _is_pgo_profile(rel: PurePosixPath) -> bool:
    return rel.name.startswith("code_state_") and "dynamo" in rel.parts


def pack_dir(
    root: Path, *, exclude: Path | None = None, compress: bool = True
) -> tuple[bytes, dict[str, int]] | None:
    """A tar (gzip'd with `compress`) of the regular files under `root`, and its listing (relative path ->
    size). None when there are no files."""
    if not root.is_dir():
        return None
    members = _walk(root, exclude)
    if not members:
        return None
    buffer = io.BytesIO()
    listing: dict[str, int] = {}
    mode = "w:gz" if compress else "w"
    kwargs = {"compresslevel": _COMPRESS_LEVEL} if compress else {}
    with tarfile.open(fileobj=buffer, mode=mode, **kwargs) as tar:  # type: ignore[call-overload]
        for rel, _st in members:
            try:
                info = tar.gettarinfo(root / rel, arcname=str(rel))
                if not info.isfile():
                    continue  # a symlink planted since the walk: never followed, never packed
                data = read_no_follow(root / rel)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            except OSError:  # vanished between walk and add, or a symlink: skipped
                continue
            listing[str(rel)] = info.size
    return buffer.getvalue(), listing


RESTORE_LOCK_TIMEOUT_S = 120.0
"""The longest a restore waits for another process restoring into the same directory, before it goes on
(unpacking is safe beside another: every file appears whole)."""


@contextlib.contextmanager
def restore_lock(cache_dir: Path, *, timeout_s: float = RESTORE_LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold the node's restore lock of `cache_dir` (`cache_dir/locks/ettr-restore.lock`, an flock: released
    when its holder ends, however it ends). Never raises for the lock itself: without one (no place for
    the file, or `timeout_s` spent waiting) the restore goes on unlocked."""
    fd = -1
    try:
        ensure_private_dir(cache_dir)  # as unpacking would create it (0700)
        (cache_dir / "locks").mkdir(mode=0o700, exist_ok=True)
        fd = os.open(cache_dir / "locks" / "ettr-restore.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.02)
    except OSError:
        pass
    try:
        yield
    finally:
        if fd >= 0:
            os.close(fd)  # releases the flock


def present(listing: Mapping[str, int] | None, dest: Path) -> bool:
    """True when every file of an archive's `listing` is in `dest` with its size (nothing to unpack)."""
    if not listing:
        return False
    for rel, size in listing.items():
        try:
            if (dest / rel).stat().st_size != size:
                return False
        except OSError:
            return False
    return True


@dataclass(frozen=True, kw_only=True)
class UnpackResult:
    """What unpacking an archive did."""

    num_written: int
    num_present: int
    bytes_written: int


def unpack_dir(data: bytes, dest: Path, *, limits: UnpackLimits | None = None) -> UnpackResult:
    """Unpack a `pack_dir` archive into `dest`. Raises `ValueError` on a member that is not a plain
    relative file or folder, or on an archive that expands past `limits` (default:
    `UnpackLimits.from_env()`): the archive is refused as a whole before anything is written. Never
    follows a symlink already in `dest` (raises `UnsafeLocation`, a PermissionError)."""
    limits = limits if limits is not None else UnpackLimits.from_env()
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
        members = tar.getmembers()
        for m in members:
            rel = PurePosixPath(m.name)
            if rel.is_absolute() or ".." in rel.parts or not (m.isfile() or m.isdir()):
                raise ValueError(f"archive member {m.name!r} is not a plain relative file")
        limits.check(len(data), [(m.name, m.size) for m in members if m.isfile()])
        written = present = num_bytes = 0
        plain = data[:2] != b"\x1f\x8b"  # not gzip'd: a member's bytes are a slice of the archive
        view = memoryview(data)
        if dest.is_symlink():
            raise UnsafeLocation(f"{dest} is a symlink; ettr does not unpack through it")
        dest.mkdir(parents=True, exist_ok=True)
        check_private_dir(dest)  # kernels land here: someone else's directory is refused
        for m in members:
            target = no_symlink_below(dest, m.name)
            if m.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            try:
                if os.lstat(target).st_size == m.size:
                    present += 1
                    continue
            except FileNotFoundError:
                pass
            target.parent.mkdir(parents=True, exist_ok=True)
            if plain:
                if m.offset_data + m.size > len(data):
                    raise ValueError(f"archive member {m.name!r} is truncated")
                content: bytes | memoryview = view[m.offset_data : m.offset_data + m.size]
            else:
                source = tar.extractfile(m)
                assert source is not None  # a regular file always has content
                content = source.read()
            # ettr.atomic makes it appear whole. Not fsync'd: the store keeps the archive, and a file left
            # short by a power loss is unpacked again (`present` compares sizes).
            atomic_write(target, content, mode=(m.mode & 0o755) | 0o600, durable=False)
            os.utime(target, (m.mtime, m.mtime))
            written += 1
            num_bytes += m.size
    return UnpackResult(num_written=written, num_present=present, bytes_written=num_bytes)


@dataclass(frozen=True, kw_only=True)
class Collected:
    """Artifacts by name, and the listing of each archive (relative path -> size)."""

    files: dict[str, bytes]
    listing: dict[str, dict[str, int]]


def collect(*, include_megacache: bool = True, compress: bool = True) -> Collected:
    """This process's compile artifacts (call when no compilation is running)."""
    files: dict[str, bytes] = {}
    listing: dict[str, dict[str, int]] = {}
    headers = headers_dir()
    packs = [(INDUCTOR_ARCHIVE, pack_dir(inductor_cache_dir(), exclude=headers, compress=compress))]
    if used_precompiled_headers():
        packs.append((HEADERS_ARCHIVE, pack_dir(headers, compress=compress)))
    for name, packed in packs:
        if packed is not None:
            files[name], listing[name] = packed
    if include_megacache:
        import torch

        saved = torch.compiler.save_cache_artifacts()
        if saved is not None and saved[0]:
            files[MEGACACHE] = saved[0]
    return Collected(files=files, listing=listing)


def used_precompiled_headers() -> bool:
    """Whether this process's inductor used a precompiled header (C++ kernels); when it did not (other
    backends, GPU-only kernels), the node's shared header directory is none of this job's business."""
    import sys

    codecache = sys.modules.get("torch._inductor.codecache")
    if codecache is None:
        return False
    cache_info = getattr(getattr(codecache, "_precompile_header", None), "cache_info", None)
    if cache_info is None:  # inductor changed: keep the headers rather than risk a slow warm start
        return True
    return cache_info().currsize > 0


def collect_fingerprint(cache_dir: Path | None = None, header_dir: Path | None = None) -> str:
    """Changes whenever `collect` would return something new (kernel or header files added)."""
    headers = header_dir or headers_dir()
    return fingerprint(cache_dir or inductor_cache_dir(), exclude=headers) + fingerprint(headers)


@dataclass(frozen=True, kw_only=True)
class RestoreResult:
    """Which artifacts were put back and how much was written."""

    restored: tuple[str, ...]
    num_files: int
    bytes_written: int


def restore(
    files: Mapping[str, bytes], *, cache_dir: Path | None = None, header_dir: Path | None = None
) -> RestoreResult:
    """Put verified artifacts back before compiling: the cache directory and headers when present, else
    the megacache archive. Raises `ValueError` for a malformed archive.

    With `cache_dir` and `header_dir` given, the directories are not looked up and torch is not touched
    unless the megacache is loaded (`needs_megacache` tells): a helper thread can unpack while the main
    thread goes on, then the main thread calls `load_megacache`."""
    restored: list[str] = []
    num_files = num_bytes = 0
    if INDUCTOR_ARCHIVE in files:
        result = unpack_dir(files[INDUCTOR_ARCHIVE], cache_dir or inductor_cache_dir())
        restored.append(INDUCTOR_ARCHIVE)
        num_files, num_bytes = num_files + result.num_written, num_bytes + result.bytes_written
    if HEADERS_ARCHIVE in files:
        result = unpack_dir(files[HEADERS_ARCHIVE], header_dir or headers_dir())
        restored.append(HEADERS_ARCHIVE)
        num_files, num_bytes = num_files + result.num_written, num_bytes + result.bytes_written
    if needs_megacache(files) and (cache_dir is None or header_dir is None):
        load_megacache(files[MEGACACHE])
        restored.append(MEGACACHE)
        num_bytes += len(files[MEGACACHE])
    return RestoreResult(restored=tuple(restored), num_files=num_files, bytes_written=num_bytes)


def needs_megacache(files: Mapping[str, bytes]) -> bool:
    """True when the megacache is the only way to restore these artifacts (no cache directory archive)."""
    return INDUCTOR_ARCHIVE not in files and MEGACACHE in files


def load_megacache(data: bytes) -> None:
    """Hot-load a `torch.compiler.save_cache_artifacts()` archive into this process's caches."""
    import torch

    torch.compiler.load_cache_artifacts(data)
