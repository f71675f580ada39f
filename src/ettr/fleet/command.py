"""`ettr fleet` and `ettr serve`: their flags and their work (the argparse front is `ettr.cli`).

`ettr fleet` exit status: 0, or with `--check` 1 when a regression was found (0 when none); 2 for bad
usage or when no job could be read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ettr.accounting.window import DEFAULT_WINDOW_S
from ettr.argtypes import ledger_url_arg, parse_time, path_arg
from ettr.errors import UsageError
from ettr.fleet.model import JobSummary

if TYPE_CHECKING:
    from ettr.fleet.load import SummaryCache

FLEET_EPILOG = """examples:
  ettr fleet runs/                        every run directory under runs/: table of ETT, buckets, families
  ettr fleet runs/ --json > fleet.json    the ettr.fleet/1 object
  ettr fleet runs/ --html fleet.html      a self-contained dashboard
  ettr fleet runs/ --check                exit 1 when a family regressed (cron, CI)
  ettr fleet --ledger postgresql://ettr@db/ettr --since 2026-11-24
  ettr fleet runs/ --preempt-order --need-gpus 16 --json | jq -r '.preempt_order.victims[]'
  ettr fleet runs/ --from-events --no-cache   every job accounted from its events (an audit)
"""

SERVE_EPILOG = """examples:
  ettr serve runs/ --port 9464            Prometheus metrics at http://127.0.0.1:9464/metrics
  ettr serve --ledger postgresql://ettr@db/ettr --port 9464 --addr 0.0.0.0   (every interface)
"""


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be >= 1")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number of seconds > 0")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a port number (0-65535)")
    return value


def _add_sources(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "run_dirs",
        nargs="*",
        type=path_arg,
        metavar="RUN_DIR",
        help="run directories, or folders holding them",
    )
    p.add_argument(
        "--ledger",
        type=ledger_url_arg,
        metavar="URL",
        help="a shared ledger: sqlite:///PATH or postgresql://...",
    )
    p.add_argument(
        "--workers",
        type=_count,
        metavar="N",
        help="processes reading run directories (default: half the CPUs)",
    )
    p.add_argument(
        "--cache-dir",
        type=path_arg,
        metavar="DIR",
        help="summaries of finished jobs are kept here, so each ledger is read once "
        "(default $XDG_CACHE_HOME/ettr/fleet, i.e. ~/.cache/ettr/fleet)",
    )
    p.add_argument("--no-cache", action="store_true", help="read every ledger, keep nothing")
    p.add_argument(
        "--from-events",
        action="store_true",
        help="account every job from its events, ignoring the summaries supervisors stored at job end "
        "(an audit; the figures are the same, only slower)",
    )


def add_fleet_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `ettr fleet`."""
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = FLEET_EPILOG
    _add_sources(p)
    p.add_argument("--since", type=parse_time, metavar="TIME", help="only jobs started at or after TIME")
    p.add_argument("--check", action="store_true", help="exit 1 when a regression is found, 0 when none")
    p.add_argument("--preempt-order", action="store_true", help="running jobs, cheapest to preempt first")
    p.add_argument(
        "--need-gpus", type=_count, metavar="N", help="with --preempt-order: victims freeing N GPUs"
    )
    p.add_argument("--json", action="store_true", help="print the ettr.fleet/1 JSON object")
    p.add_argument(
        "--html", type=path_arg, metavar="FILE", help="also write a self-contained HTML dashboard to FILE"
    )


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `ettr serve`."""
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = SERVE_EPILOG
    _add_sources(p)
    p.add_argument("--port", type=_port, default=9464, metavar="P", help="port of /metrics (9464)")
    p.add_argument(
        "--addr",
        default="127.0.0.1",
        help="address to listen on (127.0.0.1: this host only; 0.0.0.0 for every interface)",
    )
    p.add_argument(
        "--window",
        type=_seconds,
        default=DEFAULT_WINDOW_S,
        metavar="SECONDS",
        help="the windowed ETT's window: each job's ETT over its last SECONDS of wall time (3600)",
    )


def check_sources(cmd: str, args: argparse.Namespace) -> None:
    if bool(args.run_dirs) == bool(args.ledger):
        raise UsageError(f"ettr {cmd}: give run directories or --ledger URL (one of the two)")


def make_cache(args: argparse.Namespace) -> SummaryCache:
    """The summary cache the flags ask for (in memory only with --no-cache)."""

    from ettr.fleet.load import SummaryCache, default_cache_dir

    if getattr(args, "no_cache", False):
        return SummaryCache()
    given = getattr(args, "cache_dir", None)
    if given is not None:
        path = Path(given)
        if not given or (os.path.lexists(path) and not path.is_dir()):
            raise UsageError(
                f"--cache-dir {given!r}: not a directory (give a folder for the cache, or --no-cache)"
            )
        try:  # a cache that can never be written would silently save nothing: say so now
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(
                f"--cache-dir {given!r}: cannot be made ({exc.strerror or exc}; give another folder, or --no-cache)"
            ) from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise UsageError(f"--cache-dir {given!r}: not writable (give another folder, or --no-cache)")
    return SummaryCache(Path(given) if given else default_cache_dir())


def load_jobs(
    args: argparse.Namespace,
    *,
    now: float,
    cache: SummaryCache | None = None,
    cmd: str = "fleet",
    run_dirs: Sequence[Path] | None = None,
) -> tuple[list[JobSummary], list[str]]:
    """The jobs the flags name (`run_dirs`: the run directories they name, when already found), and the
    problems of those that could not be read (folders that could not be searched first). Raises
    `UsageError` (`ettr CMD: ...`) when the sources are unusable."""
    from ettr.fleet.load import find_run_dirs, load_ledger_url, load_run_dirs

    try:
        use_stored = not getattr(args, "from_events", False)
        window_s = getattr(args, "window", None) or DEFAULT_WINDOW_S
        if args.ledger:
            return load_ledger_url(args.ledger, now=now, use_stored=use_stored, window_s=window_s)
        unsearched: list[str] = []
        if run_dirs is None:
            run_dirs = find_run_dirs(args.run_dirs, unsearched)
        jobs, problems = load_run_dirs(
            run_dirs,
            now=now,
            workers=args.workers,
            cache=cache or make_cache(args),
            use_stored=use_stored,
            window_s=window_s,
        )
        return jobs, unsearched + problems
    except UsageError as exc:
        if str(exc).startswith("ettr "):
            raise
        raise UsageError(f"ettr {cmd}: {exc}") from None


def _find_run_dirs(given: Sequence[str], unsearched: list[str]) -> list[Path]:
    from ettr.fleet.load import find_run_dirs

    try:
        return find_run_dirs(given, unsearched)
    except UsageError as exc:
        raise UsageError(f"ettr fleet: {exc}") from None


def _undelivered(run_dirs: Sequence[Path]) -> list[tuple[Path, str]]:
    """The run directories where a ledger outage's spilled events still wait, each with its note."""
    from ettr.ledger.undelivered import undelivered_note

    found = ((run_dir, undelivered_note(run_dir)) for run_dir in run_dirs)
    return [(run_dir, note) for run_dir, note in found if note]


def fleet_main(args: argparse.Namespace) -> int:
    """`ettr fleet` with parsed flags."""
    from ettr.fleet import json as fleet_json
    from ettr.fleet.aggregate import build_fleet
    from ettr.fleet.preempt import choose_victims, preemption_costs
    from ettr.fleet.regress import find_regressions
    from ettr.fleet.text import render, render_preempt
    from ettr.untrusted import one_line

    check_sources("fleet", args)
    if args.need_gpus is not None and not args.preempt_order:
        raise UsageError("ettr fleet: --need-gpus goes with --preempt-order")
    now = time.time()
    unsearched: list[str] = []
    run_dirs = None if args.ledger else _find_run_dirs(args.run_dirs, unsearched)
    jobs, problems = load_jobs(args, now=now, run_dirs=run_dirs)
    problems = unsearched + problems
    # A problem names what it read (a directory's name, a URL from a pointer file): its control characters
    # are escaped, as the text output's are (a name holding ESC [ 2 J cleared the operator's terminal).
    for problem in problems:
        print(f"ettr fleet: skipped {one_line(problem)}", file=sys.stderr)  # one line each: `runs/x\nETT 99%`
    undelivered = _undelivered(run_dirs or ())
    for _run_dir, note in undelivered:
        print(f"ettr fleet: note: {one_line(note)}", file=sys.stderr)
    if not jobs:
        raise UsageError("ettr fleet: no job could be read (see the lines above)")
    regressions = find_regressions(jobs)
    shown: Sequence[JobSummary] = jobs
    if args.since is not None:
        shown = [j for j in jobs if j.wall_start_ts >= args.since]
        regressions = [r for r in regressions if r.first_job_start_ts >= args.since]
    report = build_fleet(shown, regressions)
    preempt = None
    costs = victims = None
    if args.preempt_order:
        costs = preemption_costs(jobs, now)
        if args.need_gpus is not None:
            victims, _enough = choose_victims(costs, args.need_gpus)
        preempt = fleet_json.preempt_object(costs, now=now, need_gpus=args.need_gpus, victims=victims)
    if args.html:
        from ettr.fleet.html import write_html

        write_html(report, args.html)
    if args.json:
        payload = fleet_json.to_dict(report, problems=problems, preempt=preempt)
        payload["undelivered"] = [{"run_dir": str(d), "note": note} for d, note in undelivered]
        print(json.dumps(payload, indent=2))
    elif costs is not None:
        print(render_preempt(costs, victims, args.need_gpus), end="")
    else:
        print(render(report, problems), end="")
    if args.check:
        return 1 if report.regressions else 0
    return 0


def serve_main(args: argparse.Namespace) -> int:
    """`ettr serve` with parsed flags: serve /metrics until SIGTERM or Ctrl-C."""
    from ettr.fleet.serve import serve_forever

    check_sources("serve", args)
    return serve_forever(args)
