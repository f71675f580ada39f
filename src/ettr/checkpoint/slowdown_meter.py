"""The live measure of what a background persist costs the training steps beside it, for the `auto`
interval: the same rule as the report's (`ettr.accounting.slowdown`), kept small and online.

The manager calls `on_step` at every step boundary with whether a persist is running; when a persist has
ended, `on_step` returns the extra step time it cost (busy step time minus as many steady steps, the
steady step time being the median of recent quiet steps), else None. Pure apart from the clock, which is a
parameter.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

QUIET_WINDOW = 64
"""Recent quiet step intervals the steady step time is the median of."""


class SlowdownMeter:
    """Step intervals inside and outside persists; the extra seconds of each finished persist."""

    def __init__(self, *, warmup_steps: int = 3) -> None:
        self._last_s: float | None = None
        self._skip = warmup_steps
        self._quiet: deque[float] = deque(maxlen=QUIET_WINDOW)
        self._busy: list[float] = []
        self._was_persisting = False

    def reset(self) -> None:
        """Forget the last step (after a restore or a blocking save: the next interval is not a step's)."""
        self._last_s = None

    def steady_step_s(self) -> float | None:
        """The steady step time: the median of the recent quiet step intervals (None before there is one)."""
        return statistics.median(self._quiet) if self._quiet else None

    def on_step(self, now_s: float, *, persisting: bool) -> float | None:
        """A step ended at `now_s`; `persisting`: a persist ran during it. Returns a finished persist's extra
        step seconds (None when none finished, or nothing is known to compare with)."""
        last, self._last_s = self._last_s, now_s
        if last is not None and now_s > last:
            if self._skip > 0:
                self._skip -= 1
            elif persisting:
                self._busy.append(now_s - last)
            else:
                self._quiet.append(now_s - last)
        finished = self._was_persisting and not persisting
        self._was_persisting = persisting
        if not finished:
            return None
        busy, self._busy = self._busy, []
        steady = self.steady_step_s()
        if not busy or steady is None:
            return None
        return max(0.0, math.fsum(busy) - len(busy) * steady)
