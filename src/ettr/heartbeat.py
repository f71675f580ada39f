"""Training-thread heartbeats: proof that a training process is doing something between its events.

A long phase (imports, model build, a big checkpoint) records no event for a while; a hung collective
records none forever. To tell them apart the bootstrap runs `MainThreadHeartbeat` in each training process:
a sampler that looks at the *training thread's* stack twice a second and touches a file in the run
directory only when that stack changed. A background thread that merely beats would keep a hung job alive;
this one goes quiet as soon as the training thread stops moving, whatever the other threads do. A single
C call that runs longer than the hang timeout looks like a hang: choose the timeout above the longest op.

Files: `RUN_DIR/heartbeats/attempt-A/rank-R-pid-P` (the layout is part of the run contract,
`ettr.run_env.heartbeat_path`); the supervisor reads their newest mtime (`latest_heartbeat`).

Beside it, `rank-R-pid-P.pulse` says how the job moves, for hang bounds that follow the job
(`ettr.supervisor.watchdog`): a `Progress` listener on the process's Recorder notes each STEP's time and the
phases open (a deque append on the recording thread), and the sampler thread writes a small JSON document
(`{"v": 1, "steps": N, "step_s": S, "phases": [...]}`: steps completed, the median of the last step
intervals, the phases open now) whenever that changed, at most twice a second, atomically (written aside,
renamed into place). The supervisor reads it with `read_pulses`; nothing read is ever run, and a pulse is
read only if it is a small regular file (a FIFO there is skipped, never waited in). A phase is also open while
the training thread's stack runs a registered wait site (`Progress.add_wait_site`: the bootstrap registers the
DataLoader's wait for its workers as `data_wait`, `torch.save` as `checkpoint_blocking`, ...:
`ettr.bootstrap.long_calls`), seen by the sampler, nothing recorded.

Never through a symlink: the directories from the run directory down to the file are made with
`ettr.untrusted.make_dirs_below` (a `heartbeats/` or `attempt-A/` that someone swapped for a symlink is
refused: that process logs one line and does not beat), and the file itself is opened with O_NOFOLLOW.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
import sys
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import CodeType, FrameType

from ettr.atomic import atomic_write
from ettr.events import Event, EventKind
from ettr.run_env import heartbeat_dir
from ettr.untrusted import SymlinkRefused, loads_bounded, make_dirs_below, read_small_file, whole_number

logger = logging.getLogger("ettr")

PULSE_SUFFIX = ".pulse"
_PULSE_VERSION = 1
_PULSE_MAX_BYTES = 4096
_INTERVALS_KEPT = 32
"""Step intervals a pulse's median is taken over (recent: after a warm-up or a slowdown it follows the job)."""
_WAIT_SITE_DEPTH = 256
"""Frames of the training thread's stack looked at for a wait site (`Progress.add_wait_site`): Dynamo's
`_compile` was measured up to 121 frames below the top during an inductor compile (64 missed it)."""
_PERSISTING_KEPT = 8
"""Async saves still persisting that a pulse names (the oldest)."""
_BACKGROUND_PHASES = frozenset({"checkpoint_persist"})
"""Phases that run beside training (an overlapped persist): the training thread is not waiting on them."""


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


@dataclass(frozen=True, slots=True)
class Pulse:
    """How one training process moves, as its last pulse file said."""

    rank: int
    steps: int
    """Steps it completed in this attempt."""
    step_s: float | None
    """The median of its last step intervals (None: fewer than two steps)."""
    num_intervals: int
    """How many intervals that median is over."""
    phases: frozenset[str]
    """The phases open in it now (those the training thread waits on)."""
    pid: int | None = None
    """The process (from the file's name)."""
    persisting: tuple[tuple[int | None, float], ...] = ()
    """Async checkpoint saves still persisting in the background: (step, since when), oldest first."""


class Progress:
    """What a pulse says, kept from the process's own events: a Recorder listener (`observe`), cheap on the
    recording thread; `snapshot` is read by the heartbeat's sampler thread."""

    def __init__(self) -> None:
        # Reentrant: a signal handler that interrupted `observe` on the training thread records too (a save
        # in a SIGTERM handler) and comes back here on the same thread; a plain lock would wait for ever.
        self._lock = threading.RLock()
        self._step_ts: deque[float] = deque(maxlen=_INTERVALS_KEPT + 1)
        self._steps = 0
        self._open: dict[str, int] = {}
        self._sites: dict[int, tuple[CodeType, str]] = {}  # by the code's id (it is kept alive here)
        self._waiting: frozenset[str] = frozenset()
        self._persisting: dict[tuple[int | None, str], float] = {}  # (step, path) -> staged at
        self.version = 0
        """Grows with every change (the sampler writes a pulse only when it moved)."""

    def observe(self, event: Event) -> None:
        kind = event.kind
        if kind is EventKind.STEP:
            with self._lock:
                self._step_ts.append(event.ts)
                self._steps += 1
                self.version += 1
        elif kind is EventKind.PHASE_BEGIN and event.phase is not None:
            with self._lock:
                name = str(event.phase)
                self._open[name] = self._open.get(name, 0) + 1
                self.version += 1
        elif kind is EventKind.PHASE_END and event.phase is not None:
            with self._lock:
                name = str(event.phase)
                if self._open.get(name, 0) > 0:  # an END alone (a whole span) opened nothing
                    self._open[name] -= 1
                    if not self._open[name]:
                        del self._open[name]
                    self.version += 1
                self._note_persist(name, event)

    def _note_persist(self, name: str, event: Event) -> None:
        """An async save's staging span (`persist: "async"`) starts a persist in the background; its
        CHECKPOINT_PERSIST span (the same step and path, at its future's end) ends it. Under the lock."""
        data = event.data if isinstance(event.data, dict) else {}
        key = (event.step, str(data.get("path")))
        if name == "checkpoint_blocking" and data.get("persist") == "async":
            self._persisting[key] = event.ts
            self.version += 1
        elif name == "checkpoint_persist" and self._persisting.pop(key, None) is not None:
            self.version += 1

    def add_wait_site(self, code: CodeType, phase: str) -> None:
        """While the training thread's stack runs `code` (a library's wait for its own workers: the
        DataLoader's wait for a batch), the pulse says `phase` is open, as if the process had recorded it;
        nothing is recorded and nothing is added to the call (the heartbeat's sampler looks)."""
        with self._lock:  # replaced whole: the sampler reads it bare
            self._sites = {**self._sites, id(code): (code, phase)}

    def note_stack(self, frame: FrameType | None) -> None:
        """The sampler's look at the training thread's stack: the wait sites it is in now."""
        sites = self._sites
        if not sites:
            return
        waiting = set()
        depth = 0
        while frame is not None and depth < _WAIT_SITE_DEPTH:
            site = sites.get(id(frame.f_code))
            if site is not None:
                waiting.add(site[1])
            frame = frame.f_back
            depth += 1
        if waiting != self._waiting:
            with self._lock:
                self._waiting = frozenset(waiting)
                self.version += 1

    def snapshot(self) -> dict[str, object]:
        """The pulse document now."""
        with self._lock:
            times = list(self._step_ts)
            steps = self._steps
            open_now = self._open.keys() | self._waiting
            phases = sorted(p for p in open_now if p not in _BACKGROUND_PHASES)
            persisting = sorted(
                ((step, ts) for (step, _), ts in self._persisting.items()), key=lambda x: x[1]
            )
        intervals = [b - a for a, b in zip(times, times[1:], strict=False) if b >= a]
        return {
            "v": _PULSE_VERSION,
            "steps": steps,
            "step_s": statistics.median(intervals) if intervals else None,
            "intervals": len(intervals),
            "phases": phases,
            "persisting": [[step, ts] for step, ts in persisting[:_PERSISTING_KEPT]],
        }


def _write_pulse(path: Path, document: dict[str, object]) -> None:
    """Write `document` at `path` atomically, never through a symlink (`atomic_write`, not fsync'd: a pulse
    is a hint that the next one replaces). Its aside name is random: the fixed `.NAME.tmp` it had could be
    planted first by whoever may write the run directory, and a FIFO there held the heartbeat thread in
    open() for ever (no more touches: the job looked hung and was killed)."""
    atomic_write(path, json.dumps(document, separators=(",", ":")), durable=False)


def read_pulses(run_dir: str | os.PathLike[str], attempt: int) -> list[Pulse]:
    """The pulses of `attempt`'s training processes ([] when none). A file that is not a pulse of this
    version (damaged, forged, too big) is skipped; JSON is parsed, never run."""
    found = []
    try:
        with os.scandir(heartbeat_dir(run_dir, attempt)) as entries:
            names = [e.name for e in entries if e.name.endswith(PULSE_SUFFIX) and e.name.startswith("rank-")]
    except OSError:
        return []
    for name in names:
        try:
            rank = int(name.split("-", 2)[1])
            # Never a wait: a FIFO by a pulse's name held the supervisor's watch loop in open() for ever
            # (no restart, no hang detection, SIGTERM unheard); symlinks, devices, big files refused too.
            doc = loads_bounded(read_small_file(heartbeat_dir(run_dir, attempt) / name, _PULSE_MAX_BYTES))
        except (OSError, ValueError, IndexError):
            continue
        pulse = _pulse_from(rank, doc)
        if pulse is not None:
            pid = whole_number(name.removesuffix(PULSE_SUFFIX).rpartition("-pid-")[2])
            found.append(pulse if pid is None else dataclasses.replace(pulse, pid=pid))
    return found


def _pulse_from(rank: int, doc: object) -> Pulse | None:
    if not isinstance(doc, dict) or doc.get("v") != _PULSE_VERSION:
        return None
    steps, step_s, intervals, phases = (
        doc.get("steps"),
        doc.get("step_s"),
        doc.get("intervals"),
        doc.get("phases"),
    )
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        return None
    if not isinstance(intervals, int) or isinstance(intervals, bool) or intervals < 0:
        return None
    if step_s is not None and not (isinstance(step_s, int | float) and 0 <= step_s < 1e7):
        return None  # NaN, negative, absurd, a string: not a pulse
    if not isinstance(phases, list) or not all(isinstance(p, str) and len(p) <= 64 for p in phases):
        return None
    return Pulse(
        rank=rank,
        steps=steps,
        step_s=None if step_s is None else float(step_s),
        num_intervals=intervals,
        phases=frozenset(phases[:32]),
        persisting=_persisting_from(doc.get("persisting")),
    )


def _persisting_from(value: object) -> tuple[tuple[int | None, float], ...]:
    """A pulse's `persisting` ([[step or null, since], ...]; absent in an older ettr's): () if malformed."""
    if not isinstance(value, list):
        return ()
    found = []
    for item in value[:_PERSISTING_KEPT]:
        if not (isinstance(item, list) and len(item) == 2):
            return ()
        step, since = item
        if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
            return ()
        if not isinstance(since, int | float) or isinstance(since, bool) or not 0 <= since < 1e11:
            return ()
        found.append((step, float(since)))
    return tuple(found)


def persisting_words(persisting: tuple[tuple[int | None, float], ...], now: float) -> str:
    """`an async checkpoint save of step 30 persisting for 10.4 s` for a hang's description."""
    step, since = persisting[0]
    which = "an async checkpoint save" + ("" if step is None else f" of step {step}")
    more = f" (and {len(persisting) - 1} more)" if len(persisting) > 1 else ""
    return f"{which}{more} persisting for {max(0.0, now - since):.1f} s"


PERSISTING_ADVICE = (
    " (an async save's collectives on the process group the training uses can wait on the training's: "
    "give dcp.async_save a process group of its own)"
)
"""Said once after a hang's ranks when one of them had an async save persisting."""


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
        progress: the process's `Progress` (a Recorder listener); its pulse is written beside `path`
            whenever it changed.
        run_dir: the run directory `path` lies below: the directories between are made without following
            a symlink (`make_dirs_below`); None: `path`'s directory is taken as given.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        interval_s: float = 0.5,
        thread_id: int | None = None,
        stands_down: Callable[[], bool] | None = None,
        progress: Progress | None = None,
        run_dir: str | os.PathLike[str] | None = None,
    ):
        self.path = Path(path)
        self._run_dir = run_dir
        self._progress = progress
        self._pulsed = 0  # the progress version last written (0: nothing happened yet)
        self._stands_down = stands_down
        self.interval_s = interval_s
        self._thread_id = threading.main_thread().ident if thread_id is None else thread_id
        self._stop = threading.Event()
        self._last: tuple[tuple[int, int], ...] | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Beat once now and start the sampler (a daemon thread). Never raises."""
        try:
            if self._run_dir is not None:
                make_dirs_below(self._run_dir, self.path.parent)
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            _touch(self.path)
        except SymlinkRefused as exc:  # someone else's link: beat nowhere rather than through it
            logger.warning("ettr: this process writes no heartbeat: %s", exc)
            return
        except (OSError, ValueError):
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
        moved = fingerprint != self._last
        # asked at every sample where a pulse may follow: a launcher waiting for its torchrun in
        # `subprocess.run` (a wait site: `other`) would otherwise pulse that phase for the whole job
        if self._stands_down is not None and (moved or self._progress is not None) and self._stands_down():
            self._stop.set()  # a launcher's stack moving says nothing of its ranks
            self._withdraw_pulse()  # nor its pulse of their bounds
            return False
        if self._progress is not None:
            self._progress.note_stack(frame)
        del frame
        if not moved:
            return False
        self._last = fingerprint
        try:
            os.utime(self.path, follow_symlinks=False)
        except OSError:
            try:
                _touch(self.path)
            except OSError:
                return False
        return True

    def _withdraw_pulse(self) -> None:
        try:
            os.unlink(self.path.with_name(self.path.name + PULSE_SUFFIX))
        except OSError:
            pass  # none written

    def pulse(self) -> bool:
        """Write the pulse if the progress changed since the last one; whether it wrote."""
        progress = self._progress
        if progress is None or progress.version == self._pulsed:
            return False
        version = progress.version
        try:
            _write_pulse(self.path.with_name(self.path.name + PULSE_SUFFIX), progress.snapshot())
        except OSError:
            return False
        self._pulsed = version
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
                if not self._stop.is_set():
                    self.pulse()
            except Exception:  # telemetry never takes the process down
                return
