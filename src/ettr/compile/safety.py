"""The compile store's local trust checks: private directories, no symlink followed, bounded unpacking.

Compile artifacts are code the next start runs, so the local store and the directories they are unpacked
into must be the user's own:

* `check_private_dir(path)` refuses a directory that is a symlink, is owned by another user, or is group-
  or world-writable (anyone else who could write it could plant kernels); `ensure_private_dir` creates
  a missing one with mode 0700 first; `make_private_dirs_below` makes and checks a path one level at a
  time below a base others may write (`/tmp`).
* `no_symlink_below(root, rel)` refuses a path under `root` any of whose components is a symlink: ettr
  never follows a symlink that is already in its cache or store directories (reads open with
  O_NOFOLLOW; writes rename over the final name, which replaces a link instead of following it).
* `UnpackLimits` bounds what an archive may expand to (in total, per file, and as a ratio of its packed
  size): a 200 KB archive that expands to 200 MB is refused before anything is written.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ettr.run_env import private_stat_problem
from ettr.untrusted import SymlinkRefused, open_dir_below, open_regular

UNPACK_MAX_BYTES_ENV = "ETTR_COMPILE_UNPACK_MAX_BYTES"
UNPACK_MAX_FILE_BYTES_ENV = "ETTR_COMPILE_UNPACK_MAX_FILE_BYTES"
UNPACK_MAX_RATIO_ENV = "ETTR_COMPILE_UNPACK_MAX_RATIO"


class UnsafeLocation(PermissionError):
    """A store or cache directory that someone other than this user could write, or a symlink in it."""


def check_private_dir(path: Path) -> None:
    """Raise UnsafeLocation unless `path` is a real directory owned by this user that neither group nor
    others may write."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    _check_private_stat(path, st)


def _check_private_stat(path: Path, st: os.stat_result) -> None:
    problem = private_stat_problem(path, st)
    if problem is not None:
        raise UnsafeLocation(problem)


def make_private_dirs_below(base: Path, rel: str | PurePosixPath) -> Path:
    """Make (mode 0700) or open each directory of `rel` below `base`, one level at a time and none through
    a symlink (`ettr.untrusted.open_dir_below`), and `check_private_dir` each as opened: for a predictable
    name in a directory others may write (`/tmp`), where another user could have made it first. `base`
    itself is not checked. Returns `base / rel`; raises UnsafeLocation, or OSError as met."""
    parts = PurePosixPath(rel).parts
    for depth in range(1, len(parts) + 1):
        below = PurePosixPath(*parts[:depth])
        try:
            fd = open_dir_below(base, below, create=True, mode=0o700)
        except SymlinkRefused as exc:
            raise UnsafeLocation(str(exc)) from None
        try:
            _check_private_stat(base / below, os.fstat(fd))
        finally:
            os.close(fd)
    return base / rel


def ensure_private_dir(path: Path) -> None:
    """Create `path` (mode 0700, parents as needed) if missing, then `check_private_dir` it."""
    if not os.path.lexists(path):
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private_dir(path)


def no_symlink_below(root: Path, rel: str | PurePosixPath) -> Path:
    """`root / rel`, after checking that no existing component below `root` (the final one included)
    is a symlink. Raises UnsafeLocation."""
    current = root
    for part in PurePosixPath(rel).parts:
        current = current / part
        try:
            if stat.S_ISLNK(os.lstat(current).st_mode):
                raise UnsafeLocation(f"{current} is a symlink; ettr does not follow it")
        except FileNotFoundError:
            break  # nothing below a missing component exists yet
    return root / rel


def read_no_follow(path: Path) -> bytes:
    """The bytes of a regular file, opened without following a symlink at its name."""
    return read_no_follow_stat(path)[0]


def read_no_follow_stat(path: Path) -> tuple[bytes, os.stat_result]:
    """The bytes of a regular file and its stat, opened without following a symlink at its name."""
    try:  # never blocks: a FIFO in a cache would hold the training process for ever
        fd = open_regular(path)
    except OSError as exc:
        if os.path.islink(path):
            raise UnsafeLocation(f"{path} is a symlink; ettr does not follow it") from exc
        if exc.errno == errno.EINVAL:
            raise UnsafeLocation(f"{path} is {exc.strerror}") from None
        raise
    with os.fdopen(fd, "rb") as stream:
        return stream.read(), os.fstat(stream.fileno())


@dataclass(frozen=True, kw_only=True)
class UnpackLimits:
    """How much an archive may expand to; past any bound it is refused before anything is written."""

    max_total_bytes: int = 4 * 1024**3
    """Sum of the sizes of every file in one archive."""
    max_file_bytes: int = 1024**3
    """Size of any one file."""
    max_ratio: float = 100.0
    """Expanded size over packed size (inductor's caches compress about 5-10x; a zip bomb 1000x)."""

    def __post_init__(self) -> None:
        if self.max_total_bytes <= 0 or self.max_file_bytes <= 0 or not self.max_ratio > 1:
            raise ValueError("UnpackLimits: byte bounds must be > 0 and max_ratio > 1")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> UnpackLimits:
        """The defaults, overridden by `ETTR_COMPILE_UNPACK_MAX_BYTES`, `..._MAX_FILE_BYTES`, `..._MAX_RATIO`."""
        env = dict(os.environ if env is None else env)
        default = cls()
        try:
            return cls(
                max_total_bytes=int(env.get(UNPACK_MAX_BYTES_ENV, default.max_total_bytes)),
                max_file_bytes=int(env.get(UNPACK_MAX_FILE_BYTES_ENV, default.max_file_bytes)),
                max_ratio=float(env.get(UNPACK_MAX_RATIO_ENV, default.max_ratio)),
            )
        except ValueError:
            return default

    def check(self, packed_bytes: int, sizes: list[tuple[str, int]]) -> None:
        """Raise ValueError if members of these sizes break a bound."""
        total = 0
        for name, size in sizes:
            if size > self.max_file_bytes:
                raise ValueError(
                    f"archive member {name!r} expands to {size} bytes (limit {self.max_file_bytes})"
                )
            total += size
        if total > self.max_total_bytes:
            raise ValueError(f"archive expands to {total} bytes (limit {self.max_total_bytes})")
        if total > 1024**2 and total > self.max_ratio * max(1, packed_bytes):
            raise ValueError(
                f"archive of {packed_bytes} bytes expands to {total} bytes "
                f"(more than {self.max_ratio:g} times; limit ETTR_COMPILE_UNPACK_MAX_RATIO)"
            )
