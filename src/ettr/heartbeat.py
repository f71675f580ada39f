"""Training-thread heartbeats: proof that a training process is doing something between its events.

A long phase (imports, model build, a big checkpoint) records no event for a while; a hung collective
records none forever. To tell them apart the bootstrap runs `MainThreadHeartbeat` in each training process:
a sampler that looks at the *training thread's* stack twice a second and touches a file in the run
directory only when that stack changed. A background thread that merely beats would keep a hung job alive;
this one goes quiet as soon as the training thread stops moving, whatever the other threads do. A single
C call that runs longer than the hang timeout looks like a hang: choose the timeout above the longest op.

Files: `RUN_DIR/heartbeats/attempt-A/rank-R-pid-P` (the layout is part of the run contract,
`ettr.run_env.heartbeat_path`); the supervisor reads their newest mtime (`latest_heartbeat`).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from ettr.run_env import heartbeat_dir


def latest_heartbeat(run_dir: str | os.PathLike[str], attempt: int) -> float | None:
    """Unix time of the newest heartbeat of `attempt` (None: none yet)."""
    latest = None
    try:
        with os.scandir(heartbeat_dir(run_dir, attempt)) as entries:
            for entry in entries:
                try:
                    mtime = entry.stat().st_mtime
                except OSError:
                    continue
                latest = mtime if latest is None or mtime > latest else latest
    except OSError:
        return None
    return latest


def _stack_fingerprint(frame: FrameType | None, depth: int = 6) -> tuple[tuple[int, int], ...]:
    marks: list[tuple[int, int]] = []
    while frame is not None and len(marks) < depth:
        marks.append((id(frame.f_code), frame.f_lasti))
        frame = frame.f_back
    return tuple(marks)


def _touch(path: Path) -> None:
    """Create `path` if missing and mark it now; never through a symlink planted at its name."""
    flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags | getattr(os, "O_NONBLOCK", 0), 0o644)
    try:
        os.utime(fd)
    finally:
        os.close(fd)


class MainThreadHeartbeat:
    """Touches this process's heartbeat file whenever the training thread's stack has changed.

    Args:
        path: the heartbeat file.
        interval_s: how often the training thread is sampled.
        thread_id: the training thread (default: the main thread).
        stands_down: asked before each beat; True: this process turned out not to be a rank (a Python
            program that started torchrun: its workers beat), and it beats no more.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        interval_s: float = 0.5,
        thread_id: int | None = None,
        stands_down: Callable[[], bool] | None = None,
    ):
        self.path = Path(path)
        self._stands_down = stands_down
        self.interval_s = interval_s
        self._thread_id = threading.main_thread().ident if thread_id is None else thread_id
        self._stop = threading.Event()
        self._last: tuple[tuple[int, int], ...] | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Beat once now and start the sampler (a daemon thread). Never raises."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _touch(self.path)
        except OSError:
            return  # no place to beat: the supervisor then goes by events alone
        self._thread = threading.Thread(target=self._run, name="ettr-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def sample(self) -> bool:
        """Beat if the training thread moved since the last sample; whether it beat."""
        thread_id = self._thread_id
        frame = None if thread_id is None else sys._current_frames().get(thread_id)  # the one cheap probe
        if frame is None:
            return False  # the training thread is gone (interpreter shutting down)
        fingerprint = _stack_fingerprint(frame)
        del frame
        if fingerprint == self._last:
            return False
        self._last = fingerprint
        if self._stands_down is not None and self._stands_down():
            self._stop.set()  # a launcher's stack moving says nothing of its ranks
            return False
        try:
            os.utime(self.path, follow_symlinks=False)
        except OSError:
            try:
                _touch(self.path)
            except OSError:
                return False
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception:  # telemetry never takes the process down
                return
