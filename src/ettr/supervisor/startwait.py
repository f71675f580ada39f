"""What an attempt waits for before its first training step, on the console.

After a restart the console said `restarting in 0 s` and `attempt 1 started: pid N`, and then nothing until
the job printed something, for as long as the interpreter, `import torch`, the model build and the restore
took (minutes on a busy node). `StartupWait` says, once an attempt has run `after_s` without a training step,
what it is doing (by its relaunch path: a cold start, a warm or promoted standby, a restart in place), again
at growing intervals while that lasts, and once when the first step comes. The caller gives the time and
whether the attempt has trained (`ettr.run_env.has_trained`) and says the line returned.

A command that replaces the PYTHONPATH it was given (`export PYTHONPATH=$PWD` in a wrapper script) runs its
ranks without ettr's bootstrap: no steps, no heartbeats, no hang detection. The console said `still no
training step after 60 s (cold start: ...)` about a job that had trained 80 steps and hung, for ever. So once
an attempt has run `UNBOOTED_AFTER_S` with no heartbeat at all, the line names a Python process of the
attempt whose PYTHONPATH lacks the bootstrap (`unbooted_python`), once.

The later lines also name the phases the ranks' pulses say are open now (`open_phases`): nanoGPT's first
`torch.compile` took 379 s at load 40 and every line said `cold start: interpreter, imports, model build,
restore`; now they end `; now: compile on ranks 0, 1`.

Processes the script starts itself that step an optimizer without joining a process group (pytorch/examples'
`mnist_hogwild`) are no ranks, and nobody records their steps (`ettr.bootstrap.unrecorded`): the lines said
`cold start` for as long as they trained. Once one of them has stepped, the next line names them, once.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ettr.bootstrap import pythonpath_dir
from ettr.heartbeat import read_pulses
from ettr.procs import descendants, environ_of
from ettr.run_env import RUN_DIR_ENV, heartbeat_dir, unrecorded_trainers

STARTING = {
    "cold": "cold start: interpreter, imports, model build, restore",
    "warm": "in a warm standby: the script's own start-up, model build, restore",
    "forked": "forked warm from the agent's zygote: the script's own start-up, model build, restore",
    "spare": "a spare that had run the script's start-up ahead: rejoining the process group, model build, restore",
    "promoted": "in a standby promoted from its warm-up: the rest of its imports, model build, restore",
    "in_place": "restart in place: rejoining the process group, restore",
}
"""What an attempt does before its first step, by its relaunch path (`relaunch.Relaunch.path`)."""

FIRST_LINE_S = 1.0
"""The first line once the attempt has run this long without a training step."""
LATER_LINES_S = (10.0, 30.0, 60.0, 120.0, 300.0)
"""Then at these ages, and every `LATER_LINES_S[-1]` seconds after the last."""


UNBOOTED_AFTER_S = 10.0
"""An attempt without a heartbeat this long is looked at for ranks started without the bootstrap."""


def unbooted_python(run_dir: str | os.PathLike[str], attempt: int, *, root: int | None = None) -> str | None:
    """What to say of `attempt` when it runs Python without ettr's bootstrap: a process of `root`'s tree
    (default: this supervisor's) with the run's `ETTR_RUN_DIR` whose `PYTHONPATH` lacks
    `bootstrap.pythonpath_dir()`, while no training process of the attempt has beaten; None otherwise."""
    try:
        with os.scandir(heartbeat_dir(run_dir, attempt)) as entries:
            if any(True for _ in entries):
                return None  # something reports
    except OSError:
        pass  # no heartbeat yet
    ours = os.path.realpath(run_dir)
    bootstrap = str(pythonpath_dir())
    for pid, _ in descendants(os.getpid() if root is None else root):
        env = environ_of(pid)
        if env is None or os.path.realpath(env.get(RUN_DIR_ENV) or "/nonexistent") != ours:
            continue  # not this run's (or unreadable)
        try:
            exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
        except OSError:
            continue
        path = env.get("PYTHONPATH", "")
        if exe.startswith("python") and bootstrap not in path.split(os.pathsep):
            given = f"PYTHONPATH={path}" if path else "no PYTHONPATH"
            return (
                f"pid {pid} ({exe}) runs without ettr's bootstrap ({given}; the command replaced the one it was "
                "given): no steps, heartbeats or hang detection from it; add to PYTHONPATH, do not replace it"
            )
    return None


def open_phases(run_dir: str | os.PathLike[str], attempt: int) -> str | None:
    """The phases open now in `attempt`'s pulses, with their ranks (`compile on ranks 0, 1; restore on rank
    1`), None when none is."""
    ranks: dict[str, set[int]] = {}
    for pulse in read_pulses(run_dir, attempt):
        for phase in pulse.phases:
            ranks.setdefault(phase, set()).add(pulse.rank)
    if not ranks:
        return None
    return "; ".join(
        f"{phase} on rank{'s' if len(on) > 1 else ''} {', '.join(str(r) for r in sorted(on))}"
        for phase, on in sorted(ranks.items())
    )


class StartupWait:
    """The console lines of one attempt's start-up (module docstring). `check` once per poll."""

    def __init__(
        self,
        attempt: int,
        started_at: float,
        *,
        path: str,
        after_s: float = FIRST_LINE_S,
        run_dir: str | os.PathLike[str] | None = None,
        unbooted: Callable[[], str | None] | None = None,
        absent: Callable[[int], str | None] | None = None,
        phases: Callable[[], str | None] | None = None,
        unrecorded: Callable[[], list[int]] | None = None,
    ) -> None:
        """`unbooted` (default with `run_dir`: `unbooted_python` of the attempt) is asked, from
        `UNBOOTED_AFTER_S` on, at each line until it once had something to say. `absent` (a multi-node
        job's `Peers.absent`) says which other nodes the attempt's rendezvous waits for: node 0 said
        `still no training step after 120 s (cold start: ...)` of a node 1 that had never been started.
        `phases` (default with `run_dir`: `open_phases` of the attempt) says which phases the ranks are in now.
        `unrecorded` (default with `run_dir`: `unrecorded_trainers` of the attempt) names the processes that
        train without being ranks.
        """
        if unrecorded is None and run_dir is not None:
            unrecorded = lambda: unrecorded_trainers(run_dir, attempt)  # noqa: E731
        self._unrecorded = unrecorded
        self._absent = absent
        if phases is None and run_dir is not None:
            phases = lambda: open_phases(run_dir, attempt)  # noqa: E731
        self._phases = phases
        self._attempt, self._started_at = attempt, started_at
        if unbooted is None and run_dir is not None:
            unbooted = lambda: unbooted_python(run_dir, attempt)  # noqa: E731
        self._unbooted = unbooted
        self._doing = STARTING.get(path, "start-up")
        self._next_s = after_s
        self._later = list(LATER_LINES_S)
        self._said = False
        self.done = False
        """The first step came (or the attempt is over): nothing more to say."""

    def due(self, now: float) -> bool:
        """Whether `check` has something to look at now (the caller's cue to read whether it trained): once
        a line is due, and after the first line at every poll (the caller may space its reads)."""
        return not self.done and (self._said or now - self._started_at >= self._next_s)

    def check(self, now: float, *, trained: bool) -> str | None:
        """The line to say now, or None."""
        if self.done:
            return None
        age_s = now - self._started_at
        if trained:
            self.done = True
            if not self._said:
                return None
            return f"attempt {self._attempt}: first training step {age_s:.1f} s after its start"
        if age_s < self._next_s:
            return None
        while self._later and self._later[0] <= age_s:
            self._later.pop(0)
        self._next_s = self._later.pop(0) if self._later else age_s + LATER_LINES_S[-1]
        first = not self._said
        self._said = True
        if first:
            return f"attempt {self._attempt}: waiting for its first training step ({self._doing})"
        line = f"attempt {self._attempt}: still no training step after {age_s:.0f} s"
        pids = _ask(self._unrecorded, [])
        if pids:
            self._unrecorded = None  # said once; later lines say so in short
            self._doing = "its processes train unrecorded"
            return (
                f"attempt {self._attempt}: no training step recorded after {age_s:.0f} s: "
                f"process{'es' if len(pids) > 1 else ''} {', '.join(map(str, pids))}, started "
                "by the script itself, step an optimizer but joined no process group (Hogwild-style "
                "training): they are no ranks, so ettr does not count their steps and this job's ETT will "
                "be unknown"
            )
        if self._unbooted is not None and age_s >= UNBOOTED_AFTER_S:
            try:
                why = self._unbooted()
            except Exception:  # a diagnosis is no reason to stop the watch
                why = None
            if why is not None:
                self._unbooted = None  # said once; later lines say so in short
                self._doing = "a process runs without ettr's bootstrap: its steps are not seen"
                return f"{line}: {why}"
        waits = self._absent(self._attempt) if self._absent is not None else None
        try:
            now_in = self._phases() if self._phases is not None else None
        except Exception:  # a diagnosis is no reason to stop the watch
            now_in = None
        return f"{line} ({waits or self._doing}{f'; now: {now_in}' if now_in else ''})"


def _ask(question: Callable[[], list[int]] | None, default: list[int]) -> list[int]:
    """A diagnosis's answer (`default` when there is none, or it failed: no reason to stop the watch)."""
    if question is None:
        return default
    try:
        return question()
    except Exception:
        return default
