"""Reading small files that anyone who can write a run directory may have written: bounded, never blocking.

A run directory's `fleet-summary.json`, a fleet cache entry or a pointer file is read by tools (`ettr fleet`,
`ettr serve`, `ettr report`) that must go on when one of them is damaged or forged. So a read never follows a
symlink (`/dev/zero` behind a link would fill memory), never opens a FIFO or device (a FIFO blocks for ever),
never reads more than its caller's bound, and a JSON document nested deeper than a bound, or holding a NaN or
an infinity, is refused as malformed instead of raising `RecursionError` in whoever walks it next.
Every refusal is an `OSError` (the file) or a `ValueError` (its content): one line a caller can list.

Directories are the other half: anyone who can write a run directory or a publish queue can swap a
subdirectory for a symlink (`RUN_DIR/heartbeats -> /`), and a writer that makes `base/a/b` with
`mkdir(parents=True)` and then writes there writes wherever the link points. `open_dir_below` /
`make_dirs_below` walk from a base the user named (which may itself be a symlink: they chose it) one
component at a time with O_NOFOLLOW | O_DIRECTORY, so a symlink or a non-directory on the way is refused
(`SymlinkRefused`) instead of followed.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
from collections.abc import Sequence
from pathlib import Path, PurePath
from typing import Any

MAX_JSON_DEPTH = 32
"""Deeper JSON than this is damage: ettr writes flat records (a summary nests three levels)."""


_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symlink"),
)


def file_kind(mode: int) -> str:
    """What a file of `st_mode` `mode` is, for a message: `a regular file`, `a FIFO`, `a directory`, ..."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def not_regular(path: str | os.PathLike[str]) -> str | None:
    """What `path` is when something other than a regular file is there (`a FIFO`, `a directory`, ...,
    `a broken symlink`); None for a regular file (through symlinks) or nothing at all. For a file that is
    opened by a library that takes a name, not a descriptor (SQLite): check before it opens a FIFO."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a broken symlink" if os.path.islink(path) else None
    except OSError:
        return None  # the opener says why
    return None if stat.S_ISREG(mode) else file_kind(mode)


def open_regular(
    path: str | os.PathLike[str],
    flags: int = os.O_RDONLY,
    mode: int = 0o644,
    *,
    dir_fd: int | None = None,
    follow_symlinks: bool = False,
) -> int:
    """A descriptor of the regular file `path`, opened with `flags`, or an OSError: the one way to open a
    file someone else may have put there. Opening never blocks (a FIFO opened for reading waits for a writer
    for ever: it is opened non-blocking, refused, and the flag cleared for a regular file); a FIFO, device,
    directory or socket is refused with EINVAL (the message says which), a symlink with ELOOP unless
    `follow_symlinks`."""
    extra = getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow_symlinks:
        extra |= getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags | extra, mode, dir_fd=dir_fd)
    try:
        st_mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(st_mode):
            raise OSError(errno.EINVAL, f"not a regular file ({file_kind(st_mode)})", os.fspath(path))
        if not flags & getattr(os, "O_NONBLOCK", 0):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small_file(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """The bytes of the regular file `path`, at most `max_bytes` of them. Raises OSError (ELOOP for a
    symlink, EINVAL for a FIFO, device or directory, EFBIG for a larger file) and never blocks."""
    fd = open_regular(path)
    try:
        st = os.fstat(fd)
        if st.st_size > max_bytes:
            raise OSError(errno.EFBIG, f"larger than {max_bytes} bytes", str(path))
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # it grew while read
        raise OSError(errno.EFBIG, f"larger than {max_bytes} bytes", str(path))
    return data


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number ettr writes")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 parses as infinity
        raise ValueError(f"{text[:40]} is not a number ettr writes")
    return value


_MAX_INT_DIGITS = 300


def _bounded_int(text: str) -> int:
    # Below a float's range (10**308), far above anything ettr writes: one of 400 digits passed the parse,
    # then raised OverflowError (not ValueError) out of the float() of whatever read it.
    if len(text) > _MAX_INT_DIGITS:
        raise ValueError(f"{text[:40]}... is not a number ettr writes")
    return int(text)


def whole_number(text: str) -> int | None:
    """`text` as a whole number >= 0 when it is ASCII digits only (at most 300 of them), else None: the
    one check before `int()` of a name or value someone else wrote. `str.isdigit` is no such check:
    `'²'.isdigit()` is True and `int('²')` raises ValueError (a heartbeat named `rank-0-pid-²`), and
    `int()` refuses more than 4,300 digits."""
    if not text.isascii() or not text.isdigit() or len(text) > _MAX_INT_DIGITS:
        return None
    return int(text)


def loads_bounded(text: str | bytes, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """`json.loads(text)` for untrusted text: NaN and infinities refused (and numbers that overflow: `1e400`,
    an integer of more than 300 digits), nesting bounded by `max_depth`
    (checked before parsing, so a 100,000-level document costs one scan). Raises ValueError."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"not UTF-8 ({exc.reason})") from None
    if _depth(text) > max_depth:
        raise ValueError(f"nested deeper than {max_depth} levels")
    try:
        return json.loads(
            text, parse_constant=_refuse_constant, parse_float=_finite_float, parse_int=_bounded_int
        )
    except RecursionError:  # cannot happen below the bound; kept so no caller ever sees one
        raise ValueError("nested too deep") from None


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(r"[\[\]{}]")


def _depth(text: str) -> int:
    """The deepest bracket nesting of JSON `text` (brackets inside strings do not count)."""
    if "[" not in text and "{" not in text:
        return 0
    depth = deepest = 0
    for match in _BRACKET.finditer(_STRING.sub("", text)):
        if match.group() in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def read_json_file(path: str | os.PathLike[str], max_bytes: int, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """`loads_bounded` of `read_small_file(path, max_bytes)`. Raises OSError or ValueError."""
    return loads_bounded(read_small_file(path, max_bytes), max_depth=max_depth)


# -- directories below a trusted base ----------------------------------------------------------------------
_DIR_NOFOLLOW = (
    os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
)


class SymlinkRefused(OSError):
    """A directory below a trusted base is a symlink (or a file, a FIFO, ...): ettr does not go through it.
    `filename` is the path of the component refused, `strerror` what is there (`a symlink`, `a regular
    file`, ...); `str()` is one line (`q/requests is a symlink; ettr does not follow a symlink there`)."""

    def __str__(self) -> str:
        if self.strerror == "a symlink":
            return f"{self.filename} is a symlink; ettr does not follow a symlink there"
        return f"{self.filename} is {self.strerror}, not a directory"


def _refusal(exc: OSError, parent_fd: int, name: str, where: Path) -> OSError:
    """The OSError an O_NOFOLLOW | O_DIRECTORY open of `name` raised, said as what is there."""
    if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
        return OSError(exc.errno, exc.strerror, os.fspath(where))
    try:
        kind = file_kind(os.lstat(name, dir_fd=parent_fd).st_mode)
    except OSError:
        kind = "not a directory"
    return SymlinkRefused(exc.errno, kind, os.fspath(where))


def _components(rel: str | os.PathLike[str]) -> list[str]:
    parts = [p for p in PurePath(rel).parts]
    if PurePath(rel).is_absolute() or any(p in (".", "..") for p in parts) or "\0" in os.fspath(rel):
        raise ValueError(f"{os.fspath(rel)!r} is not a path below a directory")
    return parts


def open_dir_below(
    base: str | os.PathLike[str], rel: str | os.PathLike[str], *, create: bool = False, mode: int = 0o755
) -> int:
    """A descriptor (O_DIRECTORY, close it) of the directory `base / rel`: the one way to reach a directory
    that others may write into (a run directory's subdirectories, a publish queue's).

    `base` is opened as given (a symlink there is followed: the user named it) and, with `create`, made with
    its parents when missing. Each component of `rel` is opened with O_NOFOLLOW | O_DIRECTORY relative to
    the one above it and, with `create`, made (`mode`) when missing. Raises `SymlinkRefused` when a
    component is a symlink or not a directory, FileNotFoundError for a missing one without `create`,
    ValueError when `rel` is absolute or holds `..`, any other OSError as met."""
    parts = _components(rel)
    if create:
        os.makedirs(base, exist_ok=True)
    fd = os.open(base, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    where = Path(base)
    try:
        for part in parts:
            where = where / part
            try:
                child = os.open(part, _DIR_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise FileNotFoundError(
                        errno.ENOENT, os.strerror(errno.ENOENT), os.fspath(where)
                    ) from None
                try:
                    os.mkdir(part, mode, dir_fd=fd)
                except FileExistsError:
                    pass  # made meanwhile (another writer); opened, and so checked, below
                try:
                    child = os.open(part, _DIR_NOFOLLOW, dir_fd=fd)
                except OSError as exc:
                    raise _refusal(exc, fd, part, where) from None
            except OSError as exc:
                raise _refusal(exc, fd, part, where) from None
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_dirs_below(
    base: str | os.PathLike[str], directory: str | os.PathLike[str], *, mode: int = 0o755
) -> Path:
    """Make `directory` (`base` itself or a path below it, spelt from `base`) and every missing directory
    between, none of them reached through a symlink (`open_dir_below`); returns `directory` as a Path.
    For writers that then write into it by name: `mkdir(parents=True)` follows a planted link, this
    refuses it (`SymlinkRefused`). Raises ValueError when `directory` is not below `base`."""
    target = Path(directory)
    try:
        rel = target.relative_to(base)
    except ValueError:
        raise ValueError(f"{target} is not below {os.fspath(base)}") from None
    os.close(open_dir_below(base, rel, create=True, mode=mode))
    return target


def symlinked_dirs(
    base: str | os.PathLike[str], names: Sequence[str], *, inside: Sequence[str] = ()
) -> list[SymlinkRefused]:
    """The directories `base/NAME` (each NAME a path below `base`) that exist but are symlinks or not
    directories, and the symlinks directly inside `base/NAME` for each NAME of `inside`, each as the
    `SymlinkRefused` a writer would meet ([] when there is none; missing ones are no fault). For a check
    before anything is written (`ettr run` on an existing run directory)."""
    refused = []
    for name in names:
        try:
            os.close(open_dir_below(base, name))
        except SymlinkRefused as exc:
            refused.append(exc)
        except OSError:
            continue  # missing (or unreadable): a writer makes it, or says why
    for name in inside:
        try:
            fd = open_dir_below(base, name)
        except OSError:
            continue  # missing, or refused above
        try:
            for entry in sorted(os.listdir(fd)):
                if stat.S_ISLNK(os.lstat(entry, dir_fd=fd).st_mode):
                    where = os.fspath(Path(base) / name / entry)
                    refused.append(SymlinkRefused(errno.ELOOP, "a symlink", where))
        except OSError:
            pass
        finally:
            os.close(fd)
    return refused


MAX_REMOVE_DEPTH = 128
"""How deep below a directory `remove_tree` deletes (one descriptor open per level)."""


class TooDeep(OSError):
    """A directory tree nested deeper than `remove_tree` deletes: left in place."""


def remove_tree(path: str | os.PathLike[str], *, max_depth: int = MAX_REMOVE_DEPTH) -> None:
    """Delete the directory `path` and everything in it, without recursion and never following a symlink
    below it (a link is removed, not what it names). `shutil.rmtree` recurses once per level: a folder nested
    1,500 deep planted in a checkpoint root raised RecursionError out of the restore of every attempt (and
    out of retention and of the save replacing an incomplete directory). A tree deeper than `max_depth` is
    refused (`TooDeep`) once what lies above that depth is deleted; so is a symlink at `path`. Raises
    OSError as met (FileNotFoundError when `path` is gone)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    levels: list[tuple[int, str, list[str]]] = []  # (fd, its name in the level above, subfolders left)

    def enter(name: str, parent_fd: int | None) -> None:
        fd = os.open(name, flags, dir_fd=parent_fd)
        subdirs = []
        try:
            with os.scandir(fd) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        subdirs.append(entry.name)
                    else:
                        os.unlink(entry.name, dir_fd=fd)
        except BaseException:
            os.close(fd)
            raise
        levels.append((fd, name, subdirs))

    try:
        enter(os.fspath(path), None)
        while levels:
            fd, name, subdirs = levels[-1]
            if subdirs:
                if len(levels) > max_depth:
                    raise TooDeep(
                        f"{os.fspath(path)} is nested more than {max_depth} folders deep; left in place"
                    )
                enter(subdirs.pop(), fd)
                continue
            levels.pop()
            os.close(fd)
            if levels:
                os.rmdir(name, dir_fd=levels[-1][0])
        os.rmdir(path)
    finally:
        for fd, _name, _subdirs in levels:
            os.close(fd)


def one_line(text: str) -> str:
    """`printable(text)` with its newlines written as `\\n` too: a value that is one line where ettr prints it
    (a job's id or name, a family, a table cell), so that a forged one (a directory named `x\\nETT 99%`, a
    forged ledger's family) cannot add lines of its own to what a person reads."""
    return printable(text).replace("\n", "\\n")


_SGR = re.compile("\x1b\\[[0-9;]*m")
"""A terminal's select-graphic-rendition sequence (bold, colour, reset): styling, dropped from what ettr prints."""


def printable(text: str) -> str:
    """`text` with every character that is not printable (an escape sequence a training process or a forged
    ledger put in an exception message or a family name: OSC 52 sets a clipboard in some terminals) written
    as its escape, newlines kept: what ettr prints of what it read. Styling (bold, colours) is dropped and a
    tab is a space, neither escaped: torch.load's weights_only error puts `\\x1b[1m` ... `\\x1b[0m` around a
    sentence and starts its lines with tabs, printed as `\\x1b[1m` and `\\t` in the failure's line."""
    if text.isprintable():
        return text
    text = _SGR.sub("", text).replace("\t", " ")
    return "\n".join(
        "".join(c if c.isprintable() else repr(c)[1:-1] for c in line) for line in text.split("\n")
    )
