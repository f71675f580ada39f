"""What both framework callbacks share: one CHECKPOINT_COMMIT per checkpoint, however many files it has, and
hooks that never raise into the training loop.

A framework may write one checkpoint as several files (Lightning's `save_last` writes the step's file and
`last.ckpt`; the HF Trainer writes a directory). The first file of a step commits the checkpoint; later
files of the same step are `checkpoint_file` marks, so that a later attempt loading any of them is still
matched to its step, and the report counts one checkpoint.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ettr.recorder import RecorderProtocol

logger = logging.getLogger("ettr")
F = TypeVar("F", bound=Callable[..., Any])

CHECKPOINT_FILE_MARK = "checkpoint_file"
"""MARK name of a further file of an already committed checkpoint (data: step, path)."""


class CheckpointCommits:
    """Commits each checkpoint once per process: `committed(step, path)` after every durable file."""

    def __init__(self, rec: RecorderProtocol) -> None:
        self._rec = rec
        self._steps: set[int] = set()
        self._lock = threading.Lock()

    def committed(self, step: int, path: str | os.PathLike[str]) -> None:
        """The file `path` of the checkpoint of `step` is durable (thread-safe: async persists call it)."""
        with self._lock:
            first = step not in self._steps
            self._steps.add(step)
        if first:
            self._rec.checkpoint_committed(step, path)
        else:
            self._rec.mark(CHECKPOINT_FILE_MARK, step=step, path=os.fspath(path))


SAVE_BEGIN_FLUSH_S = 2.0
"""The longest a save waits for its begin to be written (a slow ledger costs one save this much at most)."""


def write_save_begin(rec: RecorderProtocol) -> None:
    """Write what is queued, the CHECKPOINT_BLOCKING begin just recorded included, before a save writes any
    file. A process killed mid-save (kill -9, OOM) then leaves a save begun and never committed, which
    `ettr report` names when a later attempt restores it (`ettr.report.hints`: HF's `get_last_checkpoint`
    and Lightning's "last" pick the torn one); queued, the begin died with the process. One ledger write per
    checkpoint, beside a save that writes the model."""
    rec.flush(SAVE_BEGIN_FLUSH_S)


_warned: set[str] = set()


def never_raises(hook: F) -> F:
    """A callback hook whose errors are logged once and never reach the training loop."""

    @functools.wraps(hook)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return hook(*args, **kwargs)
        except Exception as exc:
            name = getattr(hook, "__qualname__", repr(hook))
            if name not in _warned:
                _warned.add(name)
                logger.warning(
                    "ettr: %s failed (%s: %s); training continues without it", name, type(exc).__name__, exc
                )
            return None

    return guarded  # type: ignore[return-value]
