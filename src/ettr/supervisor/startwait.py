"""What an attempt waits for before its first training step, on the console.

After a restart the console said `restarting in 0 s` and `attempt 1 started: pid N`, and then nothing until
the job printed something, for as long as the interpreter, `import torch`, the model build and the restore
took (minutes on a busy node). `StartupWait` says, once an attempt has run `after_s` without a training step,
what it is doing (by its relaunch path: a cold start, a warm or promoted standby, a restart in place), again
at growing intervals while that lasts, and once when the first step comes. Pure: the caller gives the time
and whether the attempt has trained (`ettr.run_env.has_trained`) and says the line returned.
"""

from __future__ import annotations

STARTING = {
    "cold": "cold start: interpreter, imports, model build, restore",
    "warm": "in a warm standby: the script's own start-up, model build, restore",
    "promoted": "in a standby promoted from its warm-up: the rest of its imports, model build, restore",
    "in_place": "restart in place: rejoining the process group, restore",
}
"""What an attempt does before its first step, by its relaunch path (`relaunch.Relaunch.path`)."""

FIRST_LINE_S = 1.0
"""The first line once the attempt has run this long without a training step."""
LATER_LINES_S = (10.0, 30.0, 60.0, 120.0, 300.0)
"""Then at these ages, and every `LATER_LINES_S[-1]` seconds after the last."""


class StartupWait:
    """The console lines of one attempt's start-up (module docstring). `check` once per poll."""

    def __init__(self, attempt: int, started_at: float, *, path: str, after_s: float = FIRST_LINE_S) -> None:
        self._attempt, self._started_at = attempt, started_at
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
        return f"attempt {self._attempt}: still no training step after {age_s:.0f} s ({self._doing})"
