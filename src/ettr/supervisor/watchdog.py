"""The hang watchdog: an attempt that shows no progress and no heartbeat for `timeout_s` is hung.

Progress is the newest event a training process of the attempt wrote to the ledger (the recorder writes at
least every 0.5 s while there is something to write); heartbeats are the training-thread samples of
`ettr.heartbeat`. Both come from the training thread's own activity, so a process whose helper
threads are fine while its training thread is stuck is still caught. A time that cannot be the attempt's
(`CLOCK_SKEW_S` before its start, or after now) is no sign of life.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

ActivityProbe = Callable[[], "float | None"]
"""Returns the Unix time of the latest sign of life it knows of, or None."""

CLOCK_SKEW_S = 60.0
"""A sign of life dated more than this before the attempt's start or after now is not the attempt's (another
job's spill file, a damaged row, a host whose clock is far off): it neither arms the watchdog nor keeps the
attempt alive."""


class HangWatchdog:
    """Decides when an attempt counts as hung.

    Args:
        timeout_s: the longest silence allowed.
        probes: where signs of life are read (the ledger's latest event, the newest heartbeat).
        started_at: the attempt's start; counts as a sign of life only with `armed_at_start`.
        armed_at_start: start the clock at the attempt's start (an explicit `--hang-timeout`); otherwise
            the watchdog arms at the first sign of life, so a command that never reports (not Python,
            `--no-auto` without API calls) is not killed by the default timeout.
        min_interval_s: probes are read at most this often.
    """

    def __init__(
        self,
        *,
        timeout_s: float,
        probes: Sequence[ActivityProbe],
        started_at: float,
        armed_at_start: bool,
        min_interval_s: float = 0.5,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._probes = tuple(probes)
        self._latest: float | None = started_at if armed_at_start else None
        self._earliest = started_at - CLOCK_SKEW_S
        self._min_interval_s = min_interval_s
        self._checked_at = float("-inf")

    @property
    def latest(self) -> float | None:
        """The latest sign of life seen so far."""
        return self._latest

    def check(self, now: float) -> float | None:
        """The silence in seconds if the attempt is hung at `now`, else None."""
        if now - self._checked_at >= self._min_interval_s:
            self._read(now)
        if self._latest is None or now - self._latest <= self.timeout_s:
            return None
        if self._checked_at != now:
            self._read(now)  # never call a hang on a stale reading
        if self._latest is None:
            return None
        silence_s = now - self._latest
        return silence_s if silence_s > self.timeout_s else None

    def _read(self, now: float) -> None:
        self._checked_at = now
        for probe in self._probes:
            try:
                ts = probe()
            except Exception:  # a probe that cannot be read says nothing
                ts = None
            if ts is None or not self._earliest <= ts <= now + CLOCK_SKEW_S:
                continue  # none, or not a time of this attempt (NaN included)
            if self._latest is None or ts > self._latest:
                self._latest = ts
