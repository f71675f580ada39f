"""The hang watchdog: an attempt that shows no sign of life for longer than the bound that applies now is hung.

Signs of life are the newest event a training process of the attempt wrote to the ledger (the recorder writes
at least every 0.5 s while there is something to write), the training-thread heartbeats of `ettr.heartbeat`
and their pulses. All come from the training thread's own activity, so a process whose helper threads are
fine while its training thread is stuck is still caught. A time that cannot be the attempt's is none.

The bound follows the job (`HangBounds.bound`, from the pulses: `JobProgress`):
- before the job's steps settle (the first `min_intervals` step intervals): the start-up bound (with
  `--hang-timeout`, only until the first step: that bound needs no step time);
- while a phase that may legitimately take long is open on a rank (compile, restore, checkpoint, evaluation,
  a data wait, ...): that phase's bound;
- else: `step_multiple` x the job's median step time, at least `floor_s` (a job with 0.05 s steps that stops
  is hung after ~10 s, not 300 s); `--hang-timeout` replaces this one.
The start-up and phase bounds are `default_s` (300 s, or `--hang-timeout` if larger), raised to 3x the longest
that phase (or start-up) took in the job's own books (`learned_bounds`), so a job whose restore took 400 s
before gets 1,200 s for it now.

Load: silence is counted only while the job's processes were not waiting for a CPU (the growth of their
run-queue wait, `/proc/PID/schedstat`, is taken off), so a job starved by a busy machine is not called hung.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from ettr.events import Event, EventKind
from ettr.heartbeat import PERSISTING_ADVICE, PULSE_SUFFIX, Pulse, persisting_words, read_pulses
from ettr.procs import descendants, run_state, running
from ettr.run_env import heartbeat_dir, launcher_parent_path
from ettr.untrusted import whole_number

ActivityProbe = Callable[[], "float | None"]
"""Returns the Unix time of the latest sign of life it knows of, or None."""

CLOCK_SKEW_S = 60.0
"""A sign of life dated more than this before the attempt's start or after now is not the attempt's (another
job's spill file, a damaged row, a far-off clock): it neither arms the watchdog nor keeps the attempt alive."""

STARTUP = "start-up"
"""The name of the start-up bound (before the job's steps settle)."""

_LEARNED_MULTIPLE = 3.0


@dataclass(frozen=True, slots=True)
class JobProgress:
    """How the attempt's training processes move, from their pulses (`ettr.heartbeat.read_pulses`)."""

    settled: bool = False
    """Enough step intervals were seen for a step time (the job is past its start-up)."""
    step_s: float | None = None
    """The job's median step time (the slowest rank's median: all wait for it)."""
    phases: frozenset[str] = frozenset()
    """The phases open on any rank now."""
    stepped: bool = False
    """Some rank completed a training step in this attempt: training runs, settled or not."""

    @classmethod
    def of(cls, pulses: Iterable[Pulse], *, min_intervals: int = 5) -> JobProgress:
        pulses = list(pulses)
        timed = [p.step_s for p in pulses if p.step_s is not None and p.num_intervals >= min_intervals]
        return cls(
            settled=bool(timed),
            step_s=max(timed) if timed else None,
            phases=frozenset().union(*(p.phases for p in pulses)),
            stepped=any(p.steps > 0 for p in pulses),
        )


@dataclass(frozen=True, kw_only=True)
class HangBounds:
    """How long an attempt may be silent, by what it is doing (see the module docstring)."""

    override_s: float | None = None
    """`--hang-timeout`: the bound from the first step on (no step time needed), and the least of every other."""
    default_s: float = 300.0
    """The start-up and phase bound unless the books teach a longer one."""
    step_multiple: float = 10.0
    """Once steps run: this many median step times of silence is a hang..."""
    floor_s: float = 10.0
    """...but never less than this (a process descheduled for a moment, a slow logging step)."""
    learned_s: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    """Phase name (or `STARTUP`) -> a bound learned from the job's books (`learned_bounds`)."""

    def __post_init__(self) -> None:
        for name in ("default_s", "step_multiple", "floor_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        if self.override_s is not None and not (self.override_s > 0 and math.isfinite(self.override_s)):
            raise ValueError(f"override_s must be a finite number > 0, got {self.override_s}")

    def _long(self, name: str) -> float:
        return max(self.default_s, self.override_s or 0.0, self.learned_s.get(name, 0.0))

    def bound(self, progress: JobProgress) -> tuple[float, str]:
        """The silence allowed now, and which bound it is (for people)."""
        if progress.phases:
            name = max(progress.phases, key=self._long)
            return self._long(name), f"the bound of phase {name}"
        if self.override_s is not None and (progress.settled or progress.stepped):  # needs no step time
            return self.override_s, "--hang-timeout"
        if not progress.settled or progress.step_s is None:
            return self._long(STARTUP), "the start-up bound"
        steps_s = self.step_multiple * progress.step_s
        if steps_s <= self.floor_s:
            why = f"the floor of the step bound ({self.step_multiple:g} x {progress.step_s:.3g} s)"
            return self.floor_s, why
        return steps_s, f"{self.step_multiple:g} x the step time of {progress.step_s:.3g} s"


def learned_bounds(events: Sequence[Event], *, multiple: float = _LEARNED_MULTIPLE) -> dict[str, float]:
    """`multiple` x the longest span of each phase, and of start-up (a process's start to its first step), in a
    job's books (training processes' events): what `HangBounds.learned_s` takes."""
    longest: dict[str, float] = {}

    def note(name: str, seconds: float) -> None:
        if math.isfinite(seconds) and 0 < seconds < 1e7:
            longest[name] = max(longest.get(name, 0.0), seconds)

    started: dict[tuple[int, int], float] = {}
    for e in events:
        if e.rank < 0:
            continue
        if e.kind is EventKind.PHASE_END and e.phase is not None and isinstance(e.value, int | float):
            note(str(e.phase), e.ts - float(e.value))
        elif e.kind is EventKind.PROCESS_START:
            started.setdefault((e.attempt, e.rank), e.ts)
        elif e.kind is EventKind.STEP and (e.attempt, e.rank) in started:
            note(STARTUP, e.ts - started.pop((e.attempt, e.rank)))
    return {name: multiple * seconds for name, seconds in longest.items()}


class LearnedBounds:
    """`learned_bounds` of a job's books, kept up to date without reading them whole before every attempt:
    read whole once (a requeued job's earlier attempts), then each ended attempt's events add theirs (each
    bound is the longest span of its kind within one attempt, so the job's are the largest of its
    attempts'). Reading the whole books before each attempt took 22 s and 330 MB of the supervisor's memory
    per restart of a job whose books held a million steps."""

    def __init__(self, read_all: Callable[[], Sequence[Event]]) -> None:
        self._read_all = read_all
        self._learned: dict[str, float] | None = None

    def add(self, events: Sequence[Event]) -> None:
        """What an ended attempt's events teach (before the first read: nothing to do, it reads them too)."""
        if self._learned is not None:
            for name, seconds in learned_bounds(events).items():
                self._learned[name] = max(self._learned.get(name, 0.0), seconds)

    def now(self) -> dict[str, float]:
        """The bounds learned so far ({} while the books cannot be read: tried again at the next call)."""
        if self._learned is None:
            try:
                self._learned = learned_bounds(self._read_all())
            except Exception:  # unreadable books: the configured bounds
                return {}
        return dict(self._learned)


_STATES = {
    "R": "running on a CPU (a busy loop, a long call in C)",
    "S": "asleep (waiting: a collective, a lock, a sleep, I/O)",
    "D": "in uninterruptible I/O",
    "T": "stopped (SIGSTOP or SIGTSTP)",
    "t": "stopped by a debugger",
    "Z": "exited, not reaped",
}


def describe_ranks(
    run_dir: str | os.PathLike[str], attempt: int, now: float, *, local: Collection[int] = ()
) -> str:
    """For people, at a hang: each training process of `attempt` (its heartbeat files; not a program that
    turned out to be a launcher: `launcher_parent_path`), quietest first: its
    rank and pid, how long its training thread has been quiet (its last heartbeat), the steps it completed (at
    least: its last pulse's) and the phases open in it (its pulse), and what the kernel says it does
    (`/proc/PID/stat`'s state) where the pid is one of `local` (this supervisor's processes; a pid of another
    host, or one reused since, says nothing; none by that pid here: not running here); "" when there are
    none."""
    beats: dict[int, tuple[int, float]] = {}
    try:
        with os.scandir(heartbeat_dir(run_dir, attempt)) as entries:
            for entry in entries:
                (pid,) = heartbeat_pids([entry.name]) or (None,)
                if pid is None:
                    continue
                rank_text = entry.name.split("-", 2)[1]
                try:
                    beats[pid] = (int(rank_text), entry.stat(follow_symlinks=False).st_mtime)
                except (OSError, ValueError):
                    continue
    except OSError:
        return ""
    pulses = {p.pid: p for p in read_pulses(run_dir, attempt) if p.pid is not None}
    parts = []
    for pid, (rank, beat) in sorted(beats.items(), key=lambda item: (item[1][1], item[1][0])):
        if launcher_parent_path(run_dir, attempt, pid).exists():
            continue  # a Python program that started torchrun: a launcher, not a rank
        words = [f"rank {rank} (pid {pid}) quiet {max(0.0, now - beat):.1f} s"]
        pulse = pulses.get(pid)
        if pulse is not None:
            # a pulse is written at most twice a second: a process stopped or holding the GIL since may
            # have done a few more
            words.append(f"at least {pulse.steps} step{'s' if pulse.steps != 1 else ''} done")
            if pulse.phases:
                words.append("in " + ", ".join(sorted(pulse.phases)))
            if pulse.persisting:
                words.append(persisting_words(pulse.persisting, now))
        state = run_state(pid)
        if state is None:  # no such process here: it ended (a rank that finished), or it is another host's
            words.append("not running here (exited, or on another host)")
        elif pid in local:
            words.append(_STATES.get(state, f"state {state}"))
        else:  # a pid of another host, or reused since: its state says nothing
            words.append("state unknown")
        parts.append(", ".join(words))
    return "; ".join(parts) + (PERSISTING_ADVICE if any(p.persisting for p in pulses.values()) else "")


def ranks_at_hang(run_dir: str | os.PathLike[str], attempt: int, now: float) -> str:
    """`describe_ranks` for the supervisor that found `attempt` hung: the kernel's word only on processes of
    its own tree; "" when nothing can be read (a description is no reason to miss the kill)."""
    try:
        local = {pid for pid, _ in descendants(os.getpid())}
        return describe_ranks(run_dir, attempt, now, local=local)
    except Exception:
        return ""


def run_queue_wait_s(pids: Iterable[int]) -> dict[int, float]:
    """pid -> the time it has spent waiting for a CPU so far (`/proc/PID/schedstat`, seconds), for those of
    `pids` that can be read (not another host's process; a kernel with schedstat)."""
    waits = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/schedstat", "rb") as f:
                waits[pid] = int(f.read(256).split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            continue
    return waits


def training_ended(pids: Sequence[int]) -> bool:
    """Whether the training processes `pids` (`heartbeat_pids` of an attempt: every one that started) have
    all exited, zombies not reaped yet included (`ettr.procs.running`); False when there are none yet."""
    return bool(pids) and not any(running(pid, None) for pid in pids)


def heartbeat_pids(names: Iterable[str]) -> list[int]:
    """The pids in heartbeat file names (`rank-R-pid-P`, `ettr.run_env.heartbeat_path`)."""
    pids = []
    for name in names:
        if name.endswith(PULSE_SUFFIX) or not name.startswith("rank-"):
            continue
        pid = whole_number(name.rpartition("-pid-")[2])
        if pid is not None:
            pids.append(pid)
    return pids


class HangWatchdog:
    """Decides when an attempt counts as hung.

    Args:
        timeout_s: the longest silence allowed, whatever the job does (without `bounds`).
        probes: where signs of life are read (the ledger's latest event, the newest heartbeat).
        started_at: the attempt's start; counts as a sign of life only with `armed_at_start`.
        armed_at_start: start the clock at the attempt's start (an explicit `--hang-timeout`); otherwise
            the watchdog arms at the first sign of life, so a command that never reports (not Python,
            `--no-auto` without API calls) is not killed.
        min_interval_s: probes are read at most this often.
        bounds: the bounds that follow the job (instead of `timeout_s`), with `progress`: how it moves now.
        starved: each of the job's processes' total wait for a CPU so far (`run_queue_wait_s`); the largest
            growth during a silence is not counted.
        ended: whether every training process of the attempt has exited (`training_ended`): a silence after
            that is its launcher's (torchrun's exit barrier waiting for another node), not a hang.
        describe: what each training process is doing at a time (`ranks_at_hang`), read when a hang is
            found (`ranks`).
    """

    def __init__(
        self,
        *,
        probes: Sequence[ActivityProbe],
        started_at: float,
        armed_at_start: bool,
        timeout_s: float | None = None,
        min_interval_s: float = 0.5,
        bounds: HangBounds | None = None,
        progress: Callable[[], JobProgress] | None = None,
        starved: Callable[[], Mapping[int, float]] | None = None,
        ended: Callable[[], bool] | None = None,
        describe: Callable[[float], str] | None = None,
    ) -> None:
        if bounds is None and not (timeout_s is not None and timeout_s > 0):
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._bounds = bounds
        self._fixed_s = timeout_s
        self._progress = progress or JobProgress
        self._starved = starved
        self._ended = ended
        self._describe = describe
        self.ranks = ""
        """What each training process was doing when the last hang was found (`describe`)."""
        self._probes = tuple(probes)
        self._latest: float | None = started_at if armed_at_start else None
        self._earliest = started_at - CLOCK_SKEW_S
        self._min_interval_s = min_interval_s
        self._checked_at = float("-inf")
        self._wait_at_latest: Mapping[
            int, float
        ] = {}  # the run-queue waits when the latest sign of life was seen
        self._wait_now: Mapping[int, float] = {}
        self.bound_s, self.why = (timeout_s or 0.0), "--hang-timeout"
        """The bound that applied at the last check, and which it was."""

    @property
    def latest(self) -> float | None:
        """The latest sign of life seen so far."""
        return self._latest

    @property
    def bound_text(self) -> str:
        """The bound that applied at the last check, for people (`the floor of the step bound ...: 10 s`)."""
        return f"{self.why}: {self.bound_s:.3g} s"

    @property
    def timeout_s(self) -> float:
        """The bound that applied at the last check."""
        return self.bound_s

    def check(self, now: float) -> float | None:
        """The silence in seconds if the attempt is hung at `now`, else None."""
        if now - self._checked_at >= self._min_interval_s:
            self._read(now)
        if self._latest is None or self._silence(now) <= self.bound_s:
            return None
        if self._checked_at != now:
            self._read(now)  # never call a hang on a stale reading
        if self._latest is None:
            return None
        silence_s = self._silence(now)
        if silence_s <= self.bound_s:
            return None
        try:
            ended = self._ended is not None and self._ended()
        except Exception:  # unreadable: as if they ran
            ended = False
        if ended:
            return None
        if self._describe is not None:
            try:
                self.ranks = self._describe(now)
            except Exception:  # a description is no reason to miss the kill
                self.ranks = ""
        return silence_s

    def _silence(self, now: float) -> float:
        assert self._latest is not None
        before, after = self._wait_at_latest, self._wait_now
        starved_s = max((after[pid] - before[pid] for pid in after.keys() & before.keys()), default=0.0)
        return now - self._latest - max(0.0, starved_s)

    def _read(self, now: float) -> None:
        self._checked_at = now
        newer = False
        for probe in self._probes:
            try:
                ts = probe()
            except Exception:  # a probe that cannot be read says nothing
                ts = None
            if ts is None or not self._earliest <= ts <= now + CLOCK_SKEW_S:
                continue  # none, or not a time of this attempt (NaN included)
            if self._latest is None or ts > self._latest:
                self._latest, newer = ts, True
        if self._starved is not None:
            try:
                self._wait_now = dict(self._starved())
            except Exception:
                self._wait_now = {}
            if newer:
                self._wait_at_latest = self._wait_now
            else:  # a process seen for the first time: its wait so far was before this silence
                self._wait_at_latest = {**self._wait_now, **self._wait_at_latest}
        if self._bounds is not None:
            try:
                progress = self._progress()
            except Exception:  # unreadable pulses: the start-up bound, the most patient
                progress = JobProgress()
            self.bound_s, self.why = self._bounds.bound(progress)
        else:
            assert self._fixed_s is not None
            self.bound_s = self._fixed_s
