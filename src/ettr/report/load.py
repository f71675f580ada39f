"""Reading a run directory into an EttReport: the I/O half of `ettr report` (the math is `accounting`).

`read_run(run_dir)` is the one way every command reads a run directory (events and report); it raises
`UsageError` with one clear line for anything unusable.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ettr.accounting import DEFAULT_WINDOW_S, EttReport, compute
from ettr.closing import open_attempts, recorded_job_id, supervisor_alive
from ettr.errors import UsageError
from ettr.events import Event
from ettr.ledger import LedgerError, locate
from ettr.steptail import tail_events


def read_events(run_dir: str | os.PathLike[str]) -> list[Event]:
    """All events of a run directory, wherever its books are (`ettr.ledger.locate`). Raises `UsageError`
    (one clear line) for anything unusable."""
    path = Path(run_dir)
    if not path.exists():
        raise UsageError(f"{path}: no such run directory")
    if not path.is_dir():
        raise UsageError(f"{path}: not a directory (give the run directory of an ettr job)")
    try:
        books = locate(path)
        events = books.read()
    except LedgerError as exc:
        raise UsageError(str(exc)) from None
    if not events:
        where = path if books.url is None else books.where
        try:
            num_rows = books.mark().num_rows
        except (LedgerError, OSError):
            num_rows = 0
        raise UsageError(f"{where}: {no_events(num_rows)}")
    if supervisor_alive(events) is False:  # killed with an attempt open: the steps its processes kept
        events = [*events, *(e for a in open_attempts(events) for e in tail_events(path, a, events))]
    return events


def no_events(num_rows: int) -> str:
    """Why a ledger of `num_rows` rows gave no event: none yet, or none of them readable (a ledger whose rows
    were all damaged or forged said it held no events yet, which was not so)."""
    if num_rows > 0:
        return f"none of the ledger's {num_rows} records could be read (damaged, or written by a newer ettr)"
    return "the ledger holds no events yet"


def report_time(
    events: Sequence[Event], *, wall_clock_s: float | None = None, alive: bool | None = None
) -> float:
    """The `now` to close an unfinished job at: the current time while its supervisor still runs on this
    host, else the last thing the ledger saw (a supervisor killed with SIGKILL left the books open).
    `alive`: `supervisor_alive(events)` when the caller already asked."""
    last_ts = max(e.ts for e in events)
    if not (supervisor_alive(events) if alive is None else alive):
        return last_ts
    return max(last_ts, time.time() if wall_clock_s is None else wall_clock_s)


def compute_report(events: Sequence[Event], *, job_id: str, window_s: float = DEFAULT_WINDOW_S) -> EttReport:
    """The report of a job's events as `ettr report` shows it: closed now while its supervisor runs, else at
    its last event, with the supervisor's liveness (`ettr.closing.supervisor_alive`) given to the
    accounting so that a running job reads `running` and one whose supervisor died `supervisor lost`;
    `window_s`: the windowed ETT's window (the last hour by default)."""
    alive = supervisor_alive(events)
    now = report_time(events, alive=alive)
    return compute(events, now, job_id=job_id, supervisor_alive=alive, window_s=window_s)


def job_id_of(events: Sequence[Event], run_dir: str | os.PathLike[str]) -> str:
    """The job id its supervisor recorded, else the run directory's name."""
    return recorded_job_id(events) or Path(run_dir).absolute().name


def read_run(
    run_dir: str | os.PathLike[str], *, window_s: float = DEFAULT_WINDOW_S
) -> tuple[list[Event], EttReport]:
    """The events of one run directory and its report, as `ettr report` shows it."""
    events = read_events(run_dir)
    return events, compute_report(events, job_id=job_id_of(events, run_dir), window_s=window_s)


def load_from_ledger(
    url: str, job_id: str, *, window_s: float = DEFAULT_WINDOW_S
) -> tuple[list[Event], EttReport]:
    """The events of job `job_id` in the ledger at `url` and its report. Raises `UsageError`."""
    from ettr.ledger.url import open_url

    try:
        ledger = open_url(url, job_id=job_id, create=False)
    except UsageError as exc:
        raise UsageError(f"ettr report: {exc}") from None
    try:
        events = ledger.read()
    except LedgerError as exc:
        raise UsageError(f"ettr report: {exc}") from None
    finally:
        ledger.close()
    if not events:
        raise UsageError(f"ettr report: job {job_id!r} has no events in the ledger yet")
    return events, compute_report(events, job_id=job_id, window_s=window_s)


@dataclass(frozen=True, kw_only=True)
class Requested:
    """What `ettr report` could read of what it was asked for."""

    loaded: list[tuple[list[Event], EttReport]]
    """The events and report of each run directory (or ledger job) read, in the order given."""
    run_dirs: list[str]
    """The run directories read, beside `loaded` (empty for ledger jobs)."""
    problems: list[str] = field(default_factory=list)
    """One line for each run directory that could not be read (the others are still reported)."""


def load_requested(
    run_dirs: Sequence[str],
    *,
    ledger_url: str | None,
    job_ids: Sequence[str] | None,
    window_s: float = DEFAULT_WINDOW_S,
) -> Requested:
    """What `ettr report` was asked for: RUN_DIRs, or jobs of a ledger URL. One unreadable run directory among
    several is one of `problems`, never the end of the comparison. Raises `UsageError` when nothing can be
    read (one RUN_DIR: its own line) and for bad usage."""
    if ledger_url:
        if run_dirs:
            raise UsageError("ettr report: give --ledger URL --job-id ID (and no RUN_DIR)")
        if not job_ids:
            raise UsageError(
                "ettr report: --ledger URL needs --job-id ID (`ettr report --ledger URL` lists them)"
            )
        return Requested(
            loaded=[load_from_ledger(ledger_url, job_id, window_s=window_s) for job_id in job_ids],
            run_dirs=[],
        )
    if job_ids:
        raise UsageError("ettr report: --job-id needs --ledger URL (a RUN_DIR names its job itself)")
    if not run_dirs:
        newest = newest_run_dir(DEFAULT_RUNS_DIR)
        if newest is None:
            raise UsageError(
                f"ettr report: give RUN_DIR... or --ledger URL --job-id ID (no run directory under "
                f"./{DEFAULT_RUNS_DIR}/ to default to)"
            )
        print(f"ettr report: the newest run, {newest} (give RUN_DIR for another)", file=sys.stderr)
        run_dirs = [str(newest)]
    if len(run_dirs) == 1:
        return Requested(loaded=[read_run(run_dirs[0], window_s=window_s)], run_dirs=list(run_dirs))
    loaded, read, problems = [], [], []
    for run_dir in run_dirs:
        try:
            loaded.append(read_run(run_dir, window_s=window_s))
        except UsageError as exc:
            problems.append(str(exc))
            continue
        read.append(run_dir)
    if not loaded:  # bad input: one line, as for every command
        raise UsageError(
            f"ettr report: none of the {len(run_dirs)} run directories could be read: " + "; ".join(problems)
        )
    return Requested(loaded=loaded, run_dirs=read, problems=problems)


DEFAULT_RUNS_DIR = "runs"
"""Where `ettr run` puts run directories by default (`runs/<job-id>`): `ettr report` alone reads the newest."""


def newest_run_dir(parent: str | os.PathLike[str]) -> Path | None:
    """The run directory under `parent` whose books changed last (a ledger.db, or a pointer to a ledger
    URL); None if there is none. Unreadable entries are skipped."""
    from ettr.ledger.url import POINTER_FILENAME

    best: tuple[float, Path] | None = None
    try:
        entries = list(Path(parent).iterdir())
    except OSError:
        return None
    for entry in entries:
        for name in ("ledger.db", POINTER_FILENAME):
            try:
                mtime = (entry / name).stat().st_mtime
            except OSError:
                continue
            if best is None or mtime > best[0]:
                best = (mtime, entry)
    return None if best is None else best[1]


def load_report(run_dir: str | os.PathLike[str]) -> EttReport:
    """The report of one run directory, as `ettr report` shows it."""
    return read_run(run_dir)[1]


load = read_run
"""The name `read_run` had before (kept for callers written against it)."""
