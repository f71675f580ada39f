"""`ettr demo`'s progress display: where each job is, read from its ledger while it runs.

`read_events` (never raises), `JobState.of(events)` (pure: latest attempt, rank 0's stage and step) and
`ProgressDisplay` (one rewritten line on a terminal, a line per change otherwise).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from ettr.events import Event, EventKind, Outcome


# -- watching a job through its ledger -------------------------------------------------------------------
def read_events(run_dir: Path) -> list[Event]:
    """The events recorded so far (empty before the supervisor created the ledger). Never raises."""
    from ettr.ledger import ledger_path, read_run_events

    if not ledger_path(run_dir).is_file():
        return []
    try:
        return read_run_events(run_dir)
    except Exception:  # being created or written right now: the next tick reads it
        return []


@dataclass(frozen=True, kw_only=True)
class JobState:
    """Where a job is, from its events: its latest attempt, what rank 0 does, its step."""

    attempt: int | None
    stage: str
    """The latest open phase of rank 0, `training`, `starting`, or how the attempt ended."""
    step: int
    """Highest step rank 0 completed in this attempt (0: none yet)."""
    num_failures: int

    @classmethod
    def of(cls, events: Sequence[Event]) -> JobState:
        starts = [e for e in events if e.kind is EventKind.ATTEMPT_START]
        if not starts:
            return cls(attempt=None, stage="starting", step=0, num_failures=0)
        attempt = starts[-1].attempt
        num_failures, step, outcome = 0, 0, None
        open_phases: dict[tuple[str, float], float] = {}
        for e in events:
            if e.kind is EventKind.ATTEMPT_END:
                num_failures += (e.data or {}).get("outcome") not in (None, Outcome.COMPLETED)
                outcome = (e.data or {}).get("outcome") if e.attempt == attempt else outcome
            if e.attempt != attempt or e.rank != 0:
                continue
            if e.kind is EventKind.STEP and e.step is not None:
                step = max(step, e.step)
            elif e.kind is EventKind.PHASE_BEGIN and e.phase is not None:
                open_phases[(str(e.phase), e.ts)] = e.ts
            elif e.kind is EventKind.PHASE_END and e.phase is not None and e.value is not None:
                open_phases.pop((str(e.phase), e.value), None)
        if outcome is not None:
            stage = str(outcome)
        elif open_phases:
            stage = max(open_phases.items(), key=lambda item: item[1])[0][0]
        else:
            stage = "training" if step else "starting"
        return cls(attempt=attempt, stage=stage, step=step, num_failures=num_failures)

    def text(self, total_steps: int) -> str:
        attempt = "-" if self.attempt is None else str(self.attempt)
        return f"attempt {attempt}  {self.stage:<21} step {self.step:>4}/{total_steps}  failures {self.num_failures}"


class ProgressDisplay:
    """Shows what is running. On a terminal: one line, rewritten at every tick, with every running job.
    Otherwise: a plain line per job when its attempt or stage changes, and every `plain_every_s` while
    only its step moves."""

    def __init__(
        self,
        stream: TextIO,
        *,
        tty: bool | None = None,
        plain_every_s: float = 10.0,
        columns: int | None = None,
    ) -> None:
        self.stream = stream
        self.tty = stream.isatty() if tty is None else tty
        self.plain_every_s = plain_every_s
        self.columns = columns
        """Width of the terminal line (None: the terminal's width when drawing)."""
        self._current: dict[str, str] = {}
        self._shown: dict[str, tuple[object, ...]] = {}
        self._shown_at: dict[str, float] = {}
        self._width = 0

    def show(self, name: str, state: JobState, total_steps: int, elapsed_s: float) -> None:
        if self.tty:
            attempt = "-" if state.attempt is None else state.attempt
            self._current[name] = (
                f"{name}: attempt {attempt} {state.stage} step {state.step}/{total_steps} {elapsed_s:.0f} s"
            )
            columns = self.columns or shutil.get_terminal_size().columns
            line = " | ".join(self._current.values())[: columns - 1]
            self.stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
            self.stream.flush()
            return
        key = (state.attempt, state.stage)
        now = time.monotonic()
        shown = self._shown.get(name, ())
        if key != shown[:2] or (state.step != shown[2] and now - self._shown_at[name] >= self.plain_every_s):
            print(f"{name:<9}  {state.text(total_steps)}  {elapsed_s:5.0f} s", file=self.stream, flush=True)
            self._shown[name], self._shown_at[name] = (*key, state.step), now

    def note(self, text: str) -> None:
        """A line of its own (below the rewritten line, which the next tick draws again)."""
        if self.tty and self._width:
            self.stream.write("\n")
            self._width = 0
        print(text, file=self.stream, flush=True)

    def done(self, name: str) -> None:
        """`name` is no longer running: drop it from the terminal line."""
        self._current.pop(name, None)
