"""What a torch.save/torch.load target is, for the checkpoint hooks: a file (by path, open file or fsspec file),
an in-memory buffer, or neither; and the in-memory save waiting for the file it will be written to.

Pure helpers and one small state holder; the hooks in `checkpoint_hooks` decide what to record.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

STEP_KEYS = ("global_step", "step", "iteration", "iter_num")
"""Top-level keys of a loaded checkpoint that name its global step (Lightning, nanoGPT and plain scripts)."""

_WRITE_MODES = frozenset("wax+")


def path_of(target: Any) -> str | None:
    """The real path of a save/load target that is a file: a path, an open file (`name`), an fsspec file
    (`path`); None for anything else (buffers, file descriptors, objects without a file name)."""
    if isinstance(target, (str, os.PathLike)):
        candidate: Any = target
    elif isinstance(target, io.IOBase) or hasattr(target, "read") or hasattr(target, "write"):
        candidate = getattr(target, "path", None)  # fsspec's file objects name their target here
        if not isinstance(candidate, str):
            candidate = getattr(target, "name", None)
        if not isinstance(candidate, str) or not candidate or candidate.startswith("<"):
            return None
        if "://" in candidate:
            return candidate  # a remote fsspec file: its URL is its identity
    else:
        return None
    try:
        return os.path.realpath(os.fspath(candidate))
    except (TypeError, ValueError):
        return None


def is_buffer(target: Any) -> bool:
    """Whether a save target is an in-memory buffer (its bytes may be written to a file afterwards)."""
    return isinstance(target, (io.BytesIO, bytearray, memoryview))


def is_binary_write(mode: Any) -> bool:
    """Whether an `open` mode writes bytes ("wb", "xb", "ab", "r+b", ...)."""
    return isinstance(mode, str) and "b" in mode and any(c in _WRITE_MODES for c in mode)


def step_in(loaded: Any) -> tuple[str, int] | None:
    """(key, step) when a loaded checkpoint names its own global step at the top level, else None."""
    if not isinstance(loaded, Mapping):
        return None
    for key in STEP_KEYS:
        value = loaded.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return key, value
    return None


@dataclass(slots=True)
class BufferSave:
    """A torch.save into an in-memory buffer at `step`, waiting to learn which file its bytes went to."""

    step: int
    begin_ts: float
    end_ts: float
    thread_id: int
    target: str | None = None  # the file opened for writing after it (renamed: its new name)

    def opened_for_write(self, path: str | None) -> None:
        if self.target is None and path is not None:
            self.target = path

    def renamed(self, src: str | None, dst: str | None) -> None:
        if self.target is not None and src == self.target and dst is not None:
            self.target = dst

    def written_until(self) -> float:
        """When the target was last written (its mtime), never before the buffer save ended."""
        if self.target is None:
            return self.end_ts
        try:
            return max(self.end_ts, os.stat(self.target).st_mtime)
        except OSError:
            return self.end_ts
