"""Reading many jobs: run directories found under the given paths, or every job of a shared ledger URL.

The I/O half of `ettr fleet` and `ettr serve`: events in, one `JobSummary` per job out (the math is
`ettr.accounting` and the rest of `ettr.fleet`). Run directories are read in parallel worker processes
when there are many; a `SummaryCache` keeps the summaries of finished jobs whose ledger did not change, so
that a `/metrics` scrape re-reads only what moved.
"""

from __future__ import annotations

import logging
import math
import os
import socket
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from ettr.accounting import DEFAULT_WINDOW_S, compute
from ettr.errors import UsageError
from ettr.events import SUPERVISOR_RANK, Event, EventKind
from ettr.family import UNKNOWN_FAMILY, derive_family, valid_family
from ettr.fleet.model import (
    GPUS_ASSUMED,
    GPUS_RANKS,
    GPUS_WORLD_SIZE,
    MAX_GPUS,
    MAX_TEXT,
    JobSummary,
    check_summary,
    summarize,
)
from ettr.ledger import LedgerError, is_run_dir, ledger_path
from ettr.untrusted import printable
from ettr.warn import WarnOnce

logger = logging.getLogger("ettr")

_STEP = EventKind.STEP
_SUPERVISOR_START = EventKind.SUPERVISOR_START
_JOB_END = EventKind.JOB_END
_PROCESS_START = EventKind.PROCESS_START

_PARALLEL_FROM = 16
"""Below this many run directories, reading them in this process is faster than starting workers."""


def family_of(events: Iterable[Event]) -> str:
    """The family the supervisor recorded (`ettr run --family`, or derived from its command at the time);
    for run directories of an older ettr, derived from the recorded command. Only a family `ettr run` would
    take (`family.valid_family`): a forged ledger's `train\nfleet: 9 jobs | ETT 99.9%` printed as lines of
    `ettr fleet`'s own; none valid is the unknown family."""
    command = None
    for e in events:
        if e.kind is EventKind.SUPERVISOR_START and e.data:
            family = e.data.get("family")
            if isinstance(family, str) and family and valid_family(family) is None:
                return family
            if command is None and isinstance(e.data.get("command"), list):
                command = [str(c) for c in e.data["command"]]
    derived = derive_family(command) if command else UNKNOWN_FAMILY
    return derived if valid_family(derived) is None else UNKNOWN_FAMILY


@dataclass(frozen=True, slots=True)
class _Scan:
    last_ts: float
    gpus: int
    gpus_source: str
    open_start: Event | None
    """The last SUPERVISOR_START when no JOB_END followed it."""


def _scan(events: Sequence[Event]) -> _Scan:
    """One pass over the events for what the fleet needs beyond the report (the job's size, the open
    supervisor start, the last timestamp)."""
    last_ts = -math.inf
    world = 0
    ranks: set[int] = set()
    start: Event | None = None
    for e in events:
        if e.ts > last_ts:
            last_ts = e.ts
        kind = e.kind
        if kind is _STEP:
            ranks.add(e.rank)
        elif kind is _SUPERVISOR_START:
            start = e
        elif kind is _JOB_END:
            start = None
        elif kind is _PROCESS_START and e.rank >= 0:
            ranks.add(e.rank)
            size = (e.data or {}).get("world_size")
            if isinstance(size, int) and not isinstance(size, bool) and world < size <= MAX_GPUS:
                world = size  # a larger one is damage, not a world size
    ranks.discard(SUPERVISOR_RANK)
    if world > 0:
        gpus, source = world, GPUS_WORLD_SIZE
    elif ranks:
        gpus, source = len(ranks), GPUS_RANKS
    else:
        gpus, source = 1, GPUS_ASSUMED
    return _Scan(last_ts=last_ts, gpus=gpus, gpus_source=source, open_start=start)


STALE_MARGIN_S = 60.0
"""A supervisor on another host is taken to be alive while its job was active within its hang timeout plus
this margin (its own watchdog would have ended a job silent for longer, and recorded it)."""


def is_running(
    events: Sequence[Event],
    open_start: Event | None = None,
    *,
    now: float | None = None,
    last_activity_ts: float | None = None,
) -> bool:
    """Whether the job is running now: no JOB_END after its last supervisor start, and that supervisor is
    alive: checked by pid on this host; on another host, taken to be alive while the job was active
    (`last_activity_ts`) within its hang timeout plus `STALE_MARGIN_S` of `now`."""
    from ettr.closing import live_supervisor

    start = open_start if open_start is not None else _scan(events).open_start
    if start is None:
        return False
    data = start.data or {}
    host = data.get("host")
    if host and host != socket.gethostname():
        if now is None or last_activity_ts is None:
            return True
        timeout = data.get("hang_timeout_s")
        timeout_s = float(timeout) if isinstance(timeout, int | float) and timeout > 0 else 300.0
        return now - last_activity_ts <= timeout_s + STALE_MARGIN_S
    return live_supervisor(events) is not None


def name_of(events: Iterable[Event], run_dir: Path | None = None) -> str:
    """What a person calls the job: the name of `run_dir` (where it was read), else of the run directory its
    last supervisor recorded (a job read from a shared ledger); "" when neither is known."""
    if run_dir is not None:
        return Path(run_dir).absolute().name
    recorded = recorded_run_dir(events)
    return Path(recorded).name if recorded else ""


def recorded_run_dir(events: Iterable[Event]) -> str:
    """The run directory the job's last supervisor recorded (`run_dir` of its SUPERVISOR_START); "" if none."""
    recorded = ""
    for e in events:
        if e.kind is EventKind.SUPERVISOR_START and e.rank == SUPERVISOR_RANK and isinstance(e.data, dict):
            found = e.data.get("run_dir")
            if isinstance(found, str) and found:
                recorded = found
    return recorded


def summarize_events(
    events: Sequence[Event],
    *,
    job_id: str,
    source: str,
    now: float,
    run_dir: Path | None = None,
    window_s: float = DEFAULT_WINDOW_S,
) -> JobSummary:
    """One job's summary: a running job is closed at `now`, any other at the last event it recorded;
    `window_s` is the window of its windowed ETT."""
    scan = _scan(events)
    running = False
    if scan.open_start is not None:
        activity = scan.last_ts
        if run_dir is not None:
            from ettr.heartbeat import latest_heartbeat

            beat = latest_heartbeat(run_dir, max(e.attempt for e in events))
            activity = max(activity, beat) if beat is not None else activity
        running = is_running(events, scan.open_start, now=now, last_activity_ts=activity)
    report = compute(
        events,
        max(scan.last_ts, now) if running else scan.last_ts,
        job_id=job_id,
        supervisor_alive=running if scan.open_start is not None else None,
        window_s=window_s,
    )
    return summarize(
        report,
        family=family_of(events),
        source=source,
        name=name_of(events, run_dir),
        recorded_run_dir=recorded_run_dir(events)[:MAX_TEXT],
        gpus=scan.gpus,
        gpus_source=scan.gpus_source,
        running=running,
        last_event_ts=scan.last_ts if math.isfinite(scan.last_ts) else None,
    )


def find_run_dirs(paths: Sequence[str | os.PathLike[str]], unsearched: list[str] | None = None) -> list[Path]:
    """Run directories given, or found under the given folders (at any depth; a run directory's own
    subfolders are not searched). A folder that cannot be listed (no permission, gone meanwhile) is one line
    appended to `unsearched` (a fleet lists it beside the ledgers it could not read: the jobs under it are
    missing from the figures, and must not be so in silence). Raises `UsageError` for a missing path or when
    none is found (naming the folders that could not be searched)."""
    found: list[Path] = []
    cannot: list[str] = []
    for given in paths:
        path = Path(given)
        if not path.exists():
            raise UsageError(f"{path}: no such file or directory (give run directories or folders of them)")
        if is_run_dir(path):
            found.append(path)
            continue
        if not path.is_dir():
            raise UsageError(f"{path}: not a directory (give run directories or folders of them)")
        found.extend(_run_dirs_below(path, cannot))
    if not found:
        why = f" ({cannot[0]}{f'; and {len(cannot) - 1} more' if len(cannot) > 1 else ''})" if cannot else ""
        raise UsageError(
            f"no ettr run directory (with a ledger.db or ledger-url.json) in {', '.join(map(str, paths))}{why}"
        )
    if unsearched is not None:
        unsearched.extend(f"{line}; the run directories under it are not read" for line in cannot)
    unique = list(dict.fromkeys(p.absolute() for p in found))
    return unique


MAX_SEARCH_DEPTH = 64
"""How many folders deep below a given folder run directories are looked for. The search was recursive
(`os.walk`): a folder nested 3,000 deep under a fleet's root ended `ettr fleet` and `ettr serve` with a
RecursionError traceback, no job shown."""


def _run_dirs_below(top: Path, cannot: list[str]) -> Iterator[Path]:
    """The run directories under the folder `top`, in sorted depth-first order, without recursion: hidden
    folders and symlinks are not entered, nor a run directory's own subfolders; a folder that cannot be
    listed, or lies deeper than `MAX_SEARCH_DEPTH`, is one line in `cannot`."""
    stack = [(top, 0)]
    while stack:
        here, depth = stack.pop()
        if depth and is_run_dir(here):
            yield here
            continue
        if depth >= MAX_SEARCH_DEPTH:
            cannot.append(f"{here}: cannot be searched (more than {MAX_SEARCH_DEPTH} folders deep)")
            continue
        try:
            with os.scandir(here) as entries:
                names = [
                    e.name for e in entries if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)
                ]
        except OSError as exc:
            cannot.append(f"{here}: cannot be searched ({exc.strerror or exc})")
            continue
        stack.extend((here / name, depth + 1) for name in sorted(names, reverse=True))


def same_books(run_dirs: Sequence[Path]) -> dict[Path, Path]:
    """Run directory -> the earlier one of `run_dirs` whose books are the same job at the same ledger URL
    (their `ledger-url.json` pointers name one URL and job id): every node's run directory of a multi-node
    job, which a fleet counted once per node (two nodes: the job twice, its wall time x GPUs doubled)."""
    from ettr.ledger.locate import read_pointer

    first: dict[tuple[str, str], Path] = {}
    same: dict[Path, Path] = {}
    for run_dir in run_dirs:
        pointer = read_pointer(run_dir)
        if pointer is None:
            continue
        earlier = first.setdefault(pointer, run_dir)
        if earlier != run_dir:
            same[run_dir] = earlier
    return same


def _ledger_signature(run_dir: Path) -> tuple[int, ...]:
    """What changes when events are appended: the database file's and its WAL's modification time and size.
    An empty WAL counts as none: a reader may create one, and it holds no event. Empty for a run directory
    whose books are at a URL (nothing here changes with them: never cached)."""
    if not ledger_path(run_dir).is_file():
        return ()
    out: list[int] = []
    for suffix in ("", "-wal"):
        try:
            st = os.stat(str(ledger_path(run_dir)) + suffix)
        except OSError:
            out += [0, 0]
            continue
        out += [st.st_mtime_ns, st.st_size] if st.st_size or not suffix else [0, 0]
    return tuple(out)


def load_run_dir(
    run_dir: Path, now: float, use_stored: bool = True, window_s: float = DEFAULT_WINDOW_S
) -> JobSummary | str:
    """The summary of one run directory, or why it cannot be read (a fleet skips it, saying so): the one its
    supervisor stored at job end while the ledger holds exactly the rows it was computed from
    (`ettr.fleet.stored`), else computed from the events. Never raises: one damaged run directory is one
    line of a fleet's problems, never the end of the fleet."""
    try:
        return _load_run_dir(run_dir, now, use_stored, window_s)
    except Exception as exc:  # noqa: BLE001 - whatever else a damaged directory does, the others go on
        logger.debug("ettr fleet: %s", run_dir, exc_info=True)
        return f"{run_dir}: cannot be accounted ({type(exc).__name__}: {str(exc)[:200]})"


def _load_run_dir(run_dir: Path, now: float, use_stored: bool, window_s: float) -> JobSummary | str:
    from ettr.fleet.stored import load_stored
    from ettr.ledger import locate
    from ettr.report.load import job_id_of, no_events

    stored = load_stored(run_dir) if use_stored else None
    if stored is not None and stored.window_s == window_s:  # stored with another window: recompute
        return stored
    try:
        # Without a stored summary only the rows the accounting needs; an audit (`use_stored=False`) reads
        # every row, as the stored summary was computed from: the slow-rank check needs every rank's steps.
        events, mark = locate(run_dir).read_marked(for_accounting=use_stored)
    except (LedgerError, OSError) as exc:
        return f"{run_dir}: {exc}"
    if not events:
        return f"{run_dir}: {no_events(mark.num_rows)}"
    summary = summarize_events(
        events,
        job_id=job_id_of(events, run_dir),
        source=str(run_dir),
        now=now,
        run_dir=run_dir,
        window_s=window_s,
    )
    check_summary(summary)  # what damaged events could still make impossible is a problem, not a figure
    return _with_ranks_of(stored, summary)


def _with_ranks_of(stored: JobSummary | None, summary: JobSummary) -> JobSummary:
    """`summary` with the slow-rank check of `stored` (a summary of the very same rows, stored for another
    window), which read every rank's steps where `summary` read only the reference rank's."""
    if stored is None or summary.stragglers is not None:
        return summary
    return replace(summary, stragglers=stored.stragglers, straggler_lost_s=stored.straggler_lost_s)


CACHE_VERSION = 9
"""Bumped whenever a summary of the same ledger could come out different (accounting rules, fields).
2: the `evaluation` bucket. 3: step time, windowed ETT, stragglers. 4: ETT unknown for a job no process of
which ever reported (a wrapper hid its trainer), however it ended. 5: the family derived for an older run
directory looks through launchers (accelerate, deepspeed, srun, mpirun). 6: a `BrokenPipeError` is a user
exception, not infra (collective) (`ettr.causes`). 7: a supervised last attempt whose ATTEMPT_END row was
lost completed when the job ended with status 0; the derived family looks through shells and `env`. 8: a
submission or allocation dated after the job's books begin is unknown (it made the wall time 0). 9: a summary
keeps the run directory its supervisor recorded (`recorded_run_dir`), which tells a job's own run directory from
a copy (or a forgery) of its books (`drop_copies`): one stored before it would read as a copy."""


def default_cache_dir() -> Path:
    """Where `ettr fleet` keeps summaries of finished jobs: $XDG_CACHE_HOME/ettr/fleet (~/.cache/... where it is
    unset or not absolute, as for every other cache of ettr: a relative one named a folder of whatever directory
    `ettr fleet` ran in, a cron job's or a shared one)."""
    from ettr.run_env import user_cache_home

    return Path(user_cache_home(), "ettr", "fleet")


class SummaryCache:
    """Summaries of finished jobs by run directory, valid while the ledger files keep their size and time.

    In memory (`ettr serve` between scrapes) and, with a `directory`, on disk as one small JSON file per run
    directory (`ettr fleet` run again, e.g. by cron): a finished job's ledger does not change, so its
    events are read and accounted once. A running job is never cached (its figures move with the clock).
    A cache file that cannot be read or written is ignored: the cache only ever saves time.
    """

    def __init__(self, directory: Path | None = None) -> None:
        self._entries: dict[Path, tuple[tuple[int, ...], JobSummary]] = {}
        self.directory = directory

    def _file(self, run_dir: Path) -> Path | None:
        if self.directory is None:
            return None
        import hashlib
        import os

        # fsencode: a directory name that is not UTF-8 (its bytes as surrogates) is a name like any other.
        digest = hashlib.sha256(os.fsencode(run_dir.absolute())).hexdigest()[:32]
        return self.directory / f"{digest}.json"

    def get(self, run_dir: Path, signature: tuple[int, ...]) -> JobSummary | None:
        entry = self._entries.get(run_dir)
        if entry is not None and entry[0] == signature:
            return entry[1]
        path = self._file(run_dir)
        if path is None:
            return None

        from ettr.fleet.model import summary_from_json
        from ettr.fleet.stored import MAX_SUMMARY_BYTES
        from ettr.untrusted import read_json_file

        try:
            data = read_json_file(path, MAX_SUMMARY_BYTES)
            if data.get("key") != self._key(run_dir, signature):
                return None
            summary = summary_from_json(data["summary"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        self._entries[run_dir] = (signature, summary)
        return summary

    @staticmethod
    def _key(run_dir: Path, signature: tuple[int, ...]) -> list[Any]:
        from ettr.fleet.model import version

        return [CACHE_VERSION, version(), str(run_dir.absolute()), list(signature)]

    def put(self, run_dir: Path, signature: tuple[int, ...], summary: JobSummary) -> None:
        if summary.running or self._entries.get(run_dir, (None,))[0] == signature:
            return
        self._entries[run_dir] = (signature, summary)
        path = self._file(run_dir)
        if path is None:
            return
        import json

        from ettr.atomic import atomic_write
        from ettr.fleet.model import summary_to_json

        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            payload = {"key": self._key(run_dir, signature), "summary": summary_to_json(summary)}
            atomic_write(path, json.dumps(payload, allow_nan=False))
        except (OSError, ValueError) as exc:
            logger.debug("ettr fleet: cannot cache %s (%s)", run_dir, exc)


def _on_unanswering_servers(run_dirs: Sequence[Path]) -> dict[Path, str]:
    """The run directories whose books are on a PostgreSQL server that makes no connection now, each with
    why. One try per server: a fleet of run directories on a server that is down (or stalled) would
    otherwise wait out the connect timeout once per run directory (100 of them: 5 minutes, and a scrape of
    `ettr serve` ran past its deadline, serving not even the jobs kept in SQLite)."""
    from ettr.ledger import locate
    from ettr.ledger.url import scheme_of

    by_server: dict[str, list[Path]] = {}
    for run_dir in run_dirs:
        try:
            url = locate(run_dir).url
            if url is not None and scheme_of(url) == "postgresql":
                by_server.setdefault(url, []).append(run_dir)
        except (LedgerError, UsageError, OSError):
            continue  # its read says what is wrong
    if not by_server:
        return {}
    from ettr.ledger.postgres import unanswered

    out: dict[Path, str] = {}
    for url, dirs in by_server.items():
        why = unanswered(url)
        if why is not None:
            out.update(dict.fromkeys(dirs, why))
    return out


def load_run_dirs(
    run_dirs: Sequence[Path],
    *,
    now: float,
    workers: int | None = None,
    cache: SummaryCache | None = None,
    use_stored: bool = True,
    window_s: float = DEFAULT_WINDOW_S,
) -> tuple[list[JobSummary], list[str]]:
    """Summaries of `run_dirs` (in their order) and the problems of those that could not be read; with
    `use_stored=False` every job is accounted from its events (no stored summary, no cache); `window_s`
    is the window of their windowed ETT (a cached summary of another window is not used)."""
    if not use_stored:
        cache = None
    results: dict[Path, JobSummary | str] = {}
    todo: list[Path] = []
    signatures: dict[Path, tuple[int, ...]] = {}
    for run_dir, first in same_books(run_dirs).items():
        results[run_dir] = (
            f"{run_dir}: the same job's books as {first} (one ledger URL and job id): counted once"
        )
    for run_dir in run_dirs:
        if run_dir in results:
            continue
        signatures[run_dir] = _ledger_signature(run_dir)
        cached = (
            cache.get(run_dir, signatures[run_dir]) if cache is not None and signatures[run_dir] else None
        )
        if cached is not None and cached.window_s == window_s:
            results[run_dir] = cached
        else:
            todo.append(run_dir)
    for run_dir, why in _on_unanswering_servers(todo).items():  # one try per server, not per run directory
        results[run_dir] = f"{run_dir}: {why}"
    todo = [run_dir for run_dir in todo if run_dir not in results]
    # Default: half the CPUs (SMT siblings and the rest of the machine keep the other half); on a small
    # machine that is one, and reading in this process beats starting workers.
    num_workers = min(workers or max(1, (os.cpu_count() or 1) // 2), len(todo))
    if num_workers > 1 and len(todo) >= _PARALLEL_FROM:
        # forkserver: the caller may run threads (ettr serve), which fork does not copy safely.
        with ProcessPoolExecutor(num_workers, mp_context=get_context("forkserver")) as pool:
            chunk = max(1, len(todo) // (num_workers * 8))
            for run_dir, result in zip(
                todo,
                pool.map(
                    load_run_dir,
                    todo,
                    [now] * len(todo),
                    [use_stored] * len(todo),
                    [window_s] * len(todo),
                    chunksize=chunk,
                ),
                strict=True,
            ):
                results[run_dir] = result
    else:
        for run_dir in todo:
            results[run_dir] = load_run_dir(run_dir, now, use_stored, window_s)
    summaries, problems = [], []
    for run_dir in run_dirs:
        result = results[run_dir]
        if isinstance(result, str):
            problems.append(result)
            continue
        if not result.name:  # stored or cached before names
            result = replace(result, name=name_of((), run_dir))
        summaries.append(result)
        if cache is not None and signatures[run_dir]:
            cache.put(run_dir, signatures[run_dir], result)
    return drop_copies(summaries, problems)


def drop_copies(summaries: list[JobSummary], problems: list[str]) -> tuple[list[JobSummary], list[str]]:
    """One job per job id and start instant: a run directory copied (`cp -r runs/exp1 backup/exp1`, a
    synced mirror) is the same job's books again, and a fleet counted each copy (six copies of an mnist run
    were six jobs, six times its GPU-hours). Two jobs with one id started at once to the microsecond are
    one job, counted from its own run directory: the one its books say its supervisor ran in (a copy's books
    name the original). Where none is (the original moved or gone), the copy that reaches furthest is kept
    (an older copy of a running job's books ends earlier). The others are named in `problems`.

    Reaching furthest alone let anyone who can write a fleet's folder replace a job: a copy of its books with
    a later end (`runs/aa-evil`) was counted, and the job's own directory skipped as "a copy of the books of
    runs/aa-evil". Where several directories each say the books were written there (books rewritten: one of
    them is not what its supervisor wrote), which is the job cannot be told: each is counted, and one
    warning line names them; never is one silently replaced by another."""
    groups: dict[tuple[str, float], list[JobSummary]] = {}
    for summary in summaries:
        groups.setdefault((summary.job_id, round(summary.wall_start_ts, 6)), []).append(summary)
    dropped: set[int] = set()
    for group in groups.values():
        if len(group) == 1:
            continue
        homes = [s for s in group if _at_home(s)]
        if len(homes) > 1:
            _CONFLICT(
                f"ettr fleet: warning: job {printable(group[0].job_id)} is claimed by "
                + " and ".join(printable(s.source) for s in homes)
                + ", started at the same instant, each one's books saying its supervisor ran there (books "
                "copied and rewritten: one is not what its supervisor wrote); each is counted: check which is "
                "the job"
            )
        counted = homes or [max(group, key=lambda s: s.wall_end_ts)]
        first = max(counted, key=lambda s: s.wall_end_ts)
        own = "; they name that directory as their own" if homes else ""
        for summary in group:
            if any(summary is c for c in counted):
                continue
            dropped.add(id(summary))
            problems.append(
                f"{summary.source}: a copy of the books of {first.source} (job {first.job_id}, started at the "
                f"same instant{own}): counted once"
            )
    return [s for s in summaries if id(s) not in dropped], problems


_CONFLICT = WarnOnce("{what}")


def _at_home(summary: JobSummary) -> bool:
    """Whether `summary` was read from the run directory its supervisor recorded (the same directory, by
    device and inode: a path through a symlink, or another mount of it, is the same)."""
    if not summary.recorded_run_dir:
        return False
    try:
        here, recorded = os.stat(summary.source), os.stat(summary.recorded_run_dir)
    except (OSError, ValueError):
        return False
    return (here.st_dev, here.st_ino) == (recorded.st_dev, recorded.st_ino)


def _events_of_jobs(
    url: str, job_ids: Sequence[str], *, for_accounting: bool = True
) -> Iterator[tuple[str, list[Event] | str]]:
    """Each job's events for the accounting, or why they cannot be read: a PostgreSQL ledger over one
    connection, the server leaving out the rows the accounting does not use (`ettr.ledger.accounted`);
    another ledger through `open_url`. The reasons name the URL without its password."""
    from ettr.ledger.postgres import redact
    from ettr.ledger.url import open_url, scheme_of

    shown = redact(url)

    if scheme_of(url) == "postgresql" and job_ids:
        from ettr.ledger.postgres import read_jobs_marked

        try:
            for job_id, found in read_jobs_marked(url, job_ids, for_accounting=for_accounting):
                yield (
                    job_id,
                    (f"{shown} job {job_id}: {found}" if isinstance(found, LedgerError) else found[0]),
                )
        except LedgerError as exc:
            raise UsageError(f"{shown}: cannot read its jobs ({exc})") from None
        return
    for job_id in job_ids:
        try:
            ledger = open_url(url, job_id=job_id)
            try:
                yield job_id, ledger.read()
            finally:
                ledger.close()
        except (LedgerError, UsageError, OSError, ValueError) as exc:
            yield job_id, f"{shown} job {job_id}: {exc}"


def load_ledger_url(
    url: str, *, now: float, use_stored: bool = True, window_s: float = DEFAULT_WINDOW_S
) -> tuple[list[JobSummary], list[str]]:
    """Summaries of every job in a shared ledger (`sqlite:///PATH` or `postgresql://...`): a finished job's
    stored summary while the ledger holds exactly the rows it was computed from, else from its events.
    What it prints, returns and raises (each job's `source`, the problems, the errors) names the URL without
    its password: `ettr fleet --json` and its stderr end up in CI logs and dashboards."""
    from ettr.ledger.postgres import redact

    shown = redact(url)
    try:
        from ettr.ledger.url import (  # type: ignore[import-not-found, unused-ignore]
            list_jobs,
            scheme_of,
        )
    except ImportError:
        raise UsageError(
            f"{shown}: this ettr has no shared-ledger support (ettr.ledger.url); give run directories instead"
        ) from None
    try:
        job_ids = list_jobs(url)
    except (LedgerError, OSError, ValueError) as exc:
        raise UsageError(f"{shown}: cannot list its jobs ({exc})") from None
    from ettr.fleet.stored import Untrusted, decode

    stored: dict[str, Any] = {}
    if use_stored and scheme_of(url) == "postgresql":
        from ettr.ledger.postgres import read_summaries

        try:
            stored = read_summaries(url)
        except LedgerError as exc:
            logger.info(
                "ettr fleet: %s: no stored summaries read (%s); reading every job's events", shown, exc
            )
    results: dict[str, JobSummary | str | None] = {}
    other_window: dict[str, JobSummary] = {}
    for job_id in job_ids:
        if job_id in stored:
            try:
                summary = decode(stored[job_id][0], stored[job_id][1], source=shown)
            except Untrusted as exc:  # its events are read instead
                logger.warning(
                    "ettr fleet: %s job %s: its stored summary is not used (%s)", shown, job_id, exc
                )
                summary = None
            if summary is not None and summary.job_id == job_id:
                if summary.window_s == window_s:
                    results[job_id] = summary
                else:
                    other_window[job_id] = summary
    todo = [job_id for job_id in job_ids if job_id not in results]
    for job_id, events in _events_of_jobs(url, todo, for_accounting=use_stored):
        if isinstance(events, str):
            results[job_id] = events
        elif events:
            try:
                summary = summarize_events(events, job_id=job_id, source=shown, now=now, window_s=window_s)
                check_summary(summary)
            except Exception as exc:  # noqa: BLE001 - one damaged job is one problem line, the others go on
                logger.debug("ettr fleet: %s job %s", shown, job_id, exc_info=True)
                results[job_id] = f"{shown} job {job_id}: cannot be accounted ({type(exc).__name__}: {exc})"
            else:
                results[job_id] = _with_ranks_of(other_window.get(job_id), summary)
        else:
            results[job_id] = None
    summaries = [r for r in (results[j] for j in job_ids) if isinstance(r, JobSummary)]
    problems = [r for r in (results[j] for j in job_ids) if isinstance(r, str)]
    if not summaries and not problems:
        raise UsageError(f"{shown}: the ledger holds no jobs yet")
    return summaries, problems
