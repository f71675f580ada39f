"""What a compiled job leaves behind that makes the next start fast, and putting it back.

Three artifacts, by name in a store entry, each a tree of files (relative path -> file):

* `inductor_cache` — inductor's cache directory (`TORCHINDUCTOR_CACHE_DIR`): FX-graph and AOTAutograd
  cache entries, the compiled C++/Triton kernels themselves, and the PGO profile (`dynamo/code_state_*`,
  written when `torch.compiler.config.job_id` is set).
* `precompiled_headers` — inductor's precompiled C++ header. It lives under `$TMPDIR/torchinductor_$USER`,
  outside the cache directory, and inductor rebuilds it (seconds) before it even looks for a cached
  kernel, so a warm start without it is still slow on CPU. It is the same for every model of one
  torch/compiler build: the store keeps it once (`store`: files are stored by content).
* `megacache` — `torch.compiler.save_cache_artifacts()`, PyTorch's portable archive (one file). On CPU
  it does not carry compiled kernels; it is loaded only when the cache directory is absent from the entry.

`collect` names the files (read by the store, never through a symlink); `restore_tree` writes an entry's
files back defensively: plain relative paths only (the store checks them), never through a symlink
already in the directory, each file written to a temporary name and renamed, files already present with
the same size left alone (several ranks may restore into one directory at once), everything bounded by
`UnpackLimits` before anything is written. A restore onto a node that still has every file (a restart on
the same machine) reads nothing but the manifest.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TypeVar

from ettr import torch_compat
from ettr.atomic import atomic_write
from ettr.compile.safety import (
    UnpackLimits,
    UnsafeLocation,
    check_private_dir,
    ensure_private_dir,
    no_symlink_below,
)
from ettr.compile.store import FileSource, StoredFile, safe_relative

INDUCTOR_ARCHIVE = "inductor_cache"
HEADERS_ARCHIVE = "precompiled_headers"
MEGACACHE = "megacache"
ARTIFACT_NAMES = frozenset({INDUCTOR_ARCHIVE, HEADERS_ARCHIVE, MEGACACHE})

_HEADERS_DIRNAME = "precompiled_headers"

T = TypeVar("T")


def inductor_cache_dir() -> Path:
    """The cache directory inductor uses in this process (creates it, as inductor would)."""
    return Path(torch_compat.inductor_cache_dir())


def headers_dir() -> Path:
    """Where inductor keeps precompiled headers (fixed when its codecache module was imported)."""
    header_dir = torch_compat.inductor_header_dir()
    if header_dir:
        return Path(header_dir)
    return Path(torch_compat.inductor_default_cache_dir()) / _HEADERS_DIRNAME


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


def listing_fingerprint(sizes: Mapping[str, int]) -> str:
    """`fingerprint` of a directory holding exactly these files (relative path -> size): of what a store
    entry lists, so that it can be compared with the directory it was restored into."""
    h = hashlib.sha256()
    for rel in sorted(sizes):
        path = PurePosixPath(rel)
        if not _skip(path) and not _is_pgo_profile(path):
            h.update(f"{path}\0{sizes[rel]}\n".encode())
    return h.hexdigest()[:16]


def _is_pgo_profile(rel: PurePosixPath) -> bool:
    return rel.name.startswith("code_state_") and "dynamo" in rel.parts


def tree(root: Path, *, exclude: Path | None = None) -> dict[str, FileSource]:
    """The regular files under `root` (relative path -> path), without locks, temporaries or symlinks:
    what the store saves of a directory (it reads each file without following a symlink)."""
    if not root.is_dir():
        return {}
    return {str(rel): root / rel for rel, _st in _walk(root, exclude)}


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


def present(files: Mapping[str, StoredFile] | None, dest: Path) -> bool:
    """True when every file of an artifact is in `dest` with its size (nothing to restore)."""
    if not files:
        return False
    for rel, stored in files.items():
        try:
            if (dest / rel).stat().st_size != stored.size:
                return False
        except OSError:
            return False
    return True


@dataclass(frozen=True, kw_only=True)
class UnpackResult:
    """What restoring an artifact did."""

    num_written: int
    num_present: int
    bytes_written: int


COPY_MIN_BYTES = 1 << 20
"""A stored file at least this large is restored by `copy` when it is given (a kernel copy, checked where it
lands: the 156 MB precompiled header), not read into memory and written out again."""


def restore_tree(
    files: Mapping[str, StoredFile],
    dest: Path,
    read: Callable[[StoredFile], bytes],
    *,
    limits: UnpackLimits | None = None,
    copy: Callable[[StoredFile, Path, int], bool] | None = None,
) -> UnpackResult:
    """Write an artifact's files into `dest`, each read (and checked) by `read`, or those of `COPY_MIN_BYTES`
    and more copied (and checked before they appear) by `copy(stored, target, mode)` where it returns True
    (`CompileStore.copy_into`). Raises `ValueError` for a path that is not plain and relative, or for files
    past `limits` (default: `UnpackLimits.from_env()`), before anything is written; never follows a symlink
    already in `dest` (raises `UnsafeLocation`, a PermissionError). Files already there with their size are
    left alone."""
    limits = limits if limits is not None else UnpackLimits.from_env()
    for rel in files:
        if not safe_relative(rel):
            raise ValueError(f"stored file {rel!r} is not a plain relative path")
    sizes = [(rel, stored.size) for rel, stored in files.items()]
    limits.check(sum(size for _, size in sizes), sizes)
    if dest.is_symlink():
        raise UnsafeLocation(f"{dest} is a symlink; ettr does not restore through it")
    dest.mkdir(parents=True, exist_ok=True)
    check_private_dir(dest)  # kernels land here: someone else's directory is refused
    written = num_present = num_bytes = 0
    for rel, stored in sorted(files.items()):
        target = no_symlink_below(dest, rel)
        try:
            if os.lstat(target).st_size == stored.size:
                num_present += 1
                continue
        except FileNotFoundError:
            pass
        target.parent.mkdir(parents=True, exist_ok=True)
        mode = (stored.mode & 0o755) | 0o600
        # Either way it appears whole. Not fsync'd: the store keeps the file, and one left short by a power
        # loss is restored again (`present` compares sizes).
        if copy is None or stored.size < COPY_MIN_BYTES or not copy(stored, target, mode):
            atomic_write(target, read(stored), mode=mode, durable=False)
        os.utime(target, (stored.mtime, stored.mtime))
        written += 1
        num_bytes += stored.size
    return UnpackResult(num_written=written, num_present=num_present, bytes_written=num_bytes)


@dataclass(frozen=True, kw_only=True)
class Collected:
    """This process's artifacts: the workload's (inductor's cache directory, the megacache archive) and the
    build's (the precompiled headers: the same for every workload of one torch/compiler build)."""

    artifacts: dict[str, dict[str, FileSource]]
    headers: dict[str, FileSource]
    """Empty when this process used no precompiled header."""


def header_variant(rel: str) -> str:
    """The precompiled header a file of the header directory belongs to: `x.h` for `x.h` and its compiled
    forms (`x.h.gch`, `x.h.pch`); any other file is a variant of its own."""
    head, dot_h, _rest = rel.partition(".h.")
    return head + ".h" if dot_h else rel


def header_files(files: Mapping[str, T], variants: Collection[str]) -> dict[str, T]:
    """The files of `files` (the header directory's, or a stored listing) that belong to `variants`."""
    return {rel: f for rel, f in files.items() if header_variant(rel) in variants}


def collect(*, include_megacache: bool = True, headers_used: Collection[str] = ()) -> Collected:
    """This process's compile artifacts (call when no compilation is running). `headers_used`: the
    precompiled headers this process's inductor was given (`pch_memo.used_headers`); when some are named,
    only their files are collected, not every header of the directory (which may be the node's, shared by
    every process whose TMPDIR it is); empty, or none of them there: all of them."""
    headers = headers_dir()
    found: dict[str, dict[str, FileSource]] = {}
    cache = tree(inductor_cache_dir(), exclude=headers)
    if cache:
        found[INDUCTOR_ARCHIVE] = cache
    if include_megacache:
        import torch

        saved = torch.compiler.save_cache_artifacts()
        if saved is not None and saved[0]:
            found[MEGACACHE] = {MEGACACHE: bytes(saved[0])}
    header_tree = tree(headers) if used_precompiled_headers() else {}
    used_tree = header_files(header_tree, headers_used) if headers_used else {}
    if used_tree:  # else none of them is in this directory (it moved): all, as before
        header_tree = used_tree
    return Collected(artifacts=found, headers=header_tree)


def used_precompiled_headers() -> bool:
    """Whether this process's inductor used a precompiled header (C++ kernels); when it did not (other
    backends, GPU-only kernels), the node's shared header directory is none of this job's business."""
    used = torch_compat.inductor_used_precompiled_header()
    return True if used is None else used  # inductor changed: keep the headers rather than risk a slow start


def collect_fingerprint(cache_dir: Path | None = None, header_dir: Path | None = None) -> str:
    """Changes whenever `collect` would return something new (kernel or header files added)."""
    headers = header_dir or headers_dir()
    return fingerprint(cache_dir or inductor_cache_dir(), exclude=headers) + fingerprint(headers)


def load_megacache(data: bytes) -> None:
    """Hot-load a `torch.compiler.save_cache_artifacts()` archive into this process's caches."""
    import torch

    torch.compiler.load_cache_artifacts(data)
