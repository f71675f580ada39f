"""Which recorded save a loaded checkpoint file is, for the zero-code resume attribution.

A save hook records, with each checkpoint file it commits, the file's identity as the save left it
(`file_identity`: size, mtime in ns and a hash of its first and last 64 KiB; for a torch.distributed.checkpoint
directory, that of its `.metadata`, written last by the save, so files the script adds beside it later do
not count; for another directory, a hash of its top-level entries' names, sizes and mtimes). At a load in a
later attempt, `SaveIndex.attribute` ties the file on disk to the recorded saves: a step only when the saves
it can be all name that step. Several ranks or attempts that saved one path at different steps and cannot be
told apart, or a file that is none of the recorded saves (rewritten by a writer whose save was never
recorded, a save torn mid-write, a file replaced or copied in by the user), give an unknown step with the
reason -- never another save's step.

A file whose identity is exactly that of a recorded save is that save, even under another name (a save to a
temporary file whose rename into place was never recorded: its rank was killed first). Saves recorded
without an identity (by an older ettr, or to a remote fsspec URL, which is not read back) give their step
when they all name one and no save of that path left an identity; so do the saves of a file whose identity
cannot be read at the load. The torch.save zip format ends with its central directory, which holds the
CRC-32 of every record, so for it the tail hash follows the whole content.

`file_identity` reads a file (at most 128 KiB); `SaveIndex` is pure.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ettr.events import Event, EventKind

IDENTITY_KEY = "identity"
"""The data key of a CHECKPOINT_COMMIT / `checkpoint_file` mark that holds the file's identity."""

SAMPLE_BYTES = 64 * 1024
"""Bytes hashed at each end of a file."""

DCP_METADATA = ".metadata"
"""The file a torch.distributed.checkpoint save writes last into its directory (it indexes the shards)."""

_MAX_ENTRIES = 10_000  # a directory listing beyond this is not worth hashing: no identity


def file_identity(path: str) -> str | None:
    """The identity of the file (or directory) at `path` as it is now; None when it cannot be read (gone,
    unreadable, a remote URL)."""
    if "://" in path:
        return None
    try:
        info = os.stat(path)
        if stat.S_ISDIR(info.st_mode):
            metadata = os.path.join(path, DCP_METADATA)
            if not os.path.isfile(metadata):
                return _directory_identity(path)
            path, info = metadata, os.stat(metadata)  # a DCP checkpoint: what its save wrote last
        if not stat.S_ISREG(info.st_mode):
            return None  # a device or a pipe: nothing to read back (a FIFO's open would block)
        digest = hashlib.blake2b(digest_size=16)
        with open(path, "rb") as f:
            digest.update(f.read(SAMPLE_BYTES))
            if info.st_size > 2 * SAMPLE_BYTES:
                f.seek(info.st_size - SAMPLE_BYTES)
            digest.update(f.read(SAMPLE_BYTES))
    except (OSError, ValueError):
        return None
    return f"f{info.st_size}-{info.st_mtime_ns}-{digest.hexdigest()}"


def _directory_identity(path: str) -> str | None:
    digest = hashlib.blake2b(digest_size=16)
    with os.scandir(path) as entries:
        listed: list[tuple[str, int, int, bool]] = []
        for entry in entries:
            if len(listed) >= _MAX_ENTRIES:
                return None
            info = entry.stat(follow_symlinks=False)
            listed.append((entry.name, info.st_size, info.st_mtime_ns, stat.S_ISDIR(info.st_mode)))
    for name, size, mtime_ns, is_dir in sorted(listed):
        digest.update(f"{name}\0{size}\0{mtime_ns}\0{int(is_dir)}\n".encode("utf-8", "surrogateescape"))
    return f"d{len(listed)}-{digest.hexdigest()}"


@dataclass(frozen=True, slots=True)
class RecordedSave:
    """One checkpoint file that a save of an earlier attempt committed."""

    step: int
    identity: str | None  # as the save left it; None: not recorded (an older ettr) or not readable then
    attempt: int
    rank: int


@dataclass(frozen=True, slots=True)
class Attribution:
    """What a loaded file is: the step of the save it is (`step`), or None with the reason it is unknown;
    `rewritten_since`: when the file is none of the recorded saves of its path though some of them left an
    identity (written since by a writer ettr did not see, replaced, or a save torn mid-write), those saves
    ("steps 2, 4, rank 0, attempt 0")."""

    step: int | None
    reason: str | None = None
    rewritten_since: str | None = None


class SaveIndex:
    """The checkpoint files that earlier attempts committed, by path and by identity (pure)."""

    def __init__(self, saves: Iterable[tuple[str, RecordedSave]] = ()) -> None:
        self.by_path: dict[str, list[RecordedSave]] = {}
        self.by_identity: dict[str, set[int]] = {}
        for path, save in saves:
            self.by_path.setdefault(path, []).append(save)
            if save.identity is not None:
                self.by_identity.setdefault(save.identity, set()).add(save.step)

    @classmethod
    def from_events(cls, events: Iterable[Event], *, before_attempt: int, file_mark: str) -> SaveIndex:
        """The saves committed (CHECKPOINT_COMMIT paths and `file_mark` marks) in attempts before
        `before_attempt`; paths are realpaths (URLs as they are)."""
        return cls(_recorded(events, before_attempt, file_mark))

    def __contains__(self, path: object) -> bool:
        return path in self.by_path

    def attribute(self, path: str, on_disk: str | None) -> Attribution | None:
        """The step of the loaded file at `path`, whose identity now is `on_disk` (None: unreadable). None when
        it is no file this job saved (no save of that path, and no save left a file of that identity)."""
        saves = self.by_path.get(path, [])
        exact = self.by_identity.get(on_disk, set()) if on_disk is not None else set()
        if len(exact) == 1:  # the very file a save left (here, or under the name it was saved as)
            return Attribution(next(iter(exact)))
        if not saves and not exact:
            return None
        steps = ", ".join(str(step) for step in sorted({s.step for s in saves} | exact))
        writers = _writers(saves)
        if exact:
            return Attribution(None, f"{path} is the same file as saves at steps {steps} ({writers})")
        # No exact match. Had a save of this path left an identity, the file is not that save, and a save
        # without one cannot be told from a rewrite either; only when none left one (or the file cannot be
        # read now) are the recorded saves all there is to go on.
        unidentified = on_disk is None or all(s.identity is None for s in saves)
        possible = {s.step for s in saves} if unidentified else set()
        if len(possible) == 1:
            return Attribution(possible.pop())
        if possible:
            return Attribution(
                None,
                f"{path} was saved at steps {steps} ({writers}) and ettr cannot tell which of these saves it"
                " holds",
            )
        return Attribution(
            None,
            f"{path} is none of the saves recorded for it (steps {steps}, {writers}): it was written since by"
            " a save ettr did not record, or replaced",
            rewritten_since=f"steps {steps}, {writers}",
        )


def identities_saved_in(events: Iterable[Event], attempt: int, *, file_mark: str) -> frozenset[str]:
    """The identities of the files that saves of `attempt` itself left (its processes that saved before the
    books were read): a file one of them wrote is that attempt's own, neither a resume nor a torn checkpoint."""
    return frozenset(
        save.identity
        for _, save in _recorded(events, attempt + 1, file_mark)
        if save.attempt == attempt and save.identity is not None
    )


def _recorded(
    events: Iterable[Event], before_attempt: int, file_mark: str
) -> Iterator[tuple[str, RecordedSave]]:
    for e in events:
        if e.attempt >= before_attempt:
            continue
        data: Mapping[str, Any] = e.data if isinstance(e.data, Mapping) else {}
        if e.kind is EventKind.CHECKPOINT_COMMIT:
            step, path = e.step, data.get("path")
        elif e.kind is EventKind.MARK and data.get("name") == file_mark:
            step, path = data.get("step"), data.get("path")
        else:
            continue
        if not isinstance(step, int) or isinstance(step, bool) or not path:
            continue
        identity = data.get(IDENTITY_KEY)
        save = RecordedSave(step, identity if isinstance(identity, str) else None, e.attempt, e.rank)
        yield real_path(str(path)), save


def real_path(path: str) -> str:
    """A recorded checkpoint path as the hooks see a load's path: the realpath; a URL as it is."""
    return path if "://" in path else os.path.realpath(path)


def _writers(saves: Sequence[RecordedSave]) -> str:
    if not saves:
        return "saved under other names"
    ranks = sorted({s.rank for s in saves})
    attempts = sorted({s.attempt for s in saves})
    rank_part = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
    attempt_part = (
        f"attempt {attempts[0]}" if len(attempts) == 1 else "attempts " + ", ".join(map(str, attempts))
    )
    return f"{rank_part}, {attempt_part}"
