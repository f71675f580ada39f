"""The rest of a script's save function: what the training loop waits for after `torch.save` returns.

A save function rarely ends at `torch.save`: it copies the file to `model_best.pth` (pytorch/examples
imagenet's `shutil.copyfile`), renames a temporary file into place, writes a JSON beside it, saves a second
file. The loop waits for all of it, so all of it is `checkpoint_blocking`. The bootstrap cannot know where a
save function ends by its name; it knows where the training loop is:

  the loop      the code objects on the stack at an optimizer step (or a backward pass of a loop that has
                no optimizer), noted at the first step after each save (`LoopCodes`)
  the save      the frame that called the save (ettr's and torch's own frames skipped), climbed while its
                caller is user code outside the loop: the function the loop called to save
                (`save_checkpoint` -> `_atomic_save` -> `torch.save` gives `save_checkpoint`); a signal
                handler that saves is its own save function; a save written in the loop's own frame has no
                rest (its window is the call)
  its end       that frame's return (a per-thread profile function, set only for the window and only when
                no profiler is set), else the first sign of training: a backward pass, an optimizer step,
                an evaluation, or the process's exit, whichever comes first

So the books never take the loop's own work (its next batch, forward, backward) for checkpointing, and a save
before the first step (no loop known yet) is the call alone, as before.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any

_SKIPPED = ("ettr.", "torch.", "safetensors.")
"""Modules whose frames are never a script's save function (ettr's wrappers, torch.save's own frames)."""


def _module_of(frame: FrameType) -> str:
    return str(frame.f_globals.get("__name__", ""))


def is_library_frame(frame: FrameType) -> bool:
    """Whether `frame` runs ettr's, torch's or safetensors' code (never a script's)."""
    name = _module_of(frame)
    return name in ("ettr", "torch", "safetensors") or name.startswith(_SKIPPED)


class LoopCodes:
    """The code objects on the stack at the training loop's last noted step (see the module docstring)."""

    def __init__(self) -> None:
        self.codes: frozenset[CodeType] = frozenset()
        self._stale = True  # note at the next step

    def at_step(self) -> None:
        """Called at each step: notes the stack only when a save asked for it since (cheap otherwise)."""
        if not self._stale:
            return
        self._stale = False
        codes: set[CodeType] = set()
        frame: FrameType | None = sys._getframe(1)  # noqa: SLF001 - a walk up the stack, once per save
        while frame is not None:
            codes.add(frame.f_code)
            frame = frame.f_back
        self.codes = frozenset(codes)

    def renew(self) -> None:
        """A save happened: note the loop again at the next step (a new generation may have a new loop)."""
        self._stale = True

    def save_function(self, frame: FrameType | None) -> FrameType | None:
        """The frame of the script's save function around a save whose wrapper runs in `frame`, or None
        (no loop known yet, or the save is written in the loop's own frame)."""
        if not self.codes:
            return None
        while frame is not None and is_library_frame(frame):
            frame = frame.f_back
        if frame is None or frame.f_code in self.codes:
            return None
        while True:
            caller = frame.f_back
            if caller is None or caller.f_code in self.codes or is_library_frame(caller):
                return frame
            frame = caller


@dataclass(slots=True)
class _Open:
    begin_ts: float
    step: int
    path: str
    frame: FrameType | None


class SaveWindow:
    """One save at a time whose blocking span lasts until its save function returns (or training resumes).

    `record(begin_ts, end_ts, step, path)` books the span; it is called once per save, from the thread that
    closes the window. Every method is cheap when no window is open and never raises into the script."""

    def __init__(self, record: Callable[[float, float, int, str], None]) -> None:
        self._record = record
        self.loop = LoopCodes()
        self._open: _Open | None = None
        self._profile: Callable[[FrameType, str, Any], None] | None = None

    @property
    def is_open(self) -> bool:
        return self._open is not None

    def saved(self, begin_ts: float, step: int, path: str, frame: FrameType | None) -> None:
        """A save returned; `frame` is its wrapper's. Books it now, or opens its window to the end of the
        save function."""
        self.loop.renew()
        if self._open is not None:  # a second file of the same save function: its own call, booked now
            self._record(begin_ts, time.time(), step, path)
            return
        target = None
        if threading.current_thread() is threading.main_thread() and sys.getprofile() is None:
            target = self.loop.save_function(frame)
        if target is None:
            self._record(begin_ts, time.time(), step, path)
            return
        self._open = _Open(begin_ts, step, path, target)

        def profile(frame: FrameType, event: str, arg: Any) -> None:
            opened = self._open
            if opened is None or self._profile is not profile:  # closed from another thread: leave this one
                if sys.getprofile() is profile:
                    sys.setprofile(None)
            elif event == "return" and frame is opened.frame:
                self.close()

        self._profile = profile
        sys.setprofile(profile)

    def close(self, end_ts: float | None = None) -> None:
        """The save function returned, or training resumed: book the open window (a no-op when none)."""
        opened, self._open = self._open, None
        if opened is None:
            return
        end = time.time() if end_ts is None else end_ts
        opened.frame = None  # hold no frame past the window
        profile, self._profile = self._profile, None
        if profile is not None and sys.getprofile() is profile:
            sys.setprofile(None)
        self._record(opened.begin_ts, end, opened.step, opened.path)
