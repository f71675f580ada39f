"""`ettr` command line: argparse front for every command; the work happens in the modules it calls.

Bad usage or bad input never shows a traceback: one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import json
import math
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from ettr.argtypes import ledger_url_arg, parse_time, path_arg
from ettr.errors import UsageError


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line and exit status 2."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see --help)")


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be >= 0")
    return value


def _positive_int(text: str) -> int:
    value = _non_negative_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be >= 1")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number > 0")
    return value


MIN_HANG_STEP_FACTOR = 2.0
"""A hang bound under two step times would kill healthy steps that merely vary."""


def _hang_step_factor(text: str) -> float:
    value = _positive_float(text)
    if value < MIN_HANG_STEP_FACTOR:
        raise argparse.ArgumentTypeError(
            f"{text} is too small: a bound under {MIN_HANG_STEP_FACTOR:g} step times would kill healthy steps "
            "that merely vary"
        )
    return value


# -- ettr run --------------------------------------------------------------------------------------------
def _add_run(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", type=path_arg, help="where the ledger and logs go (default runs/<job-id>)")
    p.add_argument(
        "--job-id", help="the job's id (default: Slurm's job id inside a Slurm job, else a fresh one)"
    )
    p.add_argument("--max-restarts", type=_non_negative_int, default=3, help="restarts after failures (3)")
    p.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="SPEC",
        help="fault to inject: KIND@WHEN[,attempt=A][,rank=R]; KIND crash|kill|hang|preempt, "
        "WHEN step=N|time=S|checkpoint (repeatable)",
    )
    p.add_argument(
        "--hang-timeout",
        type=_positive_float,
        metavar="SECONDS",
        help="seconds without progress that count as a hang once steps run (default: 10 step times, at least "
        "10 s; start-up and long phases such as evaluation get 300 s or what the job's books show)",
    )
    p.add_argument(
        "--hang-step-factor",
        type=_hang_step_factor,
        metavar="K",
        help="once steps run, K median step times without progress count as a hang (default 10; at least 2; "
        "not with --hang-timeout, which replaces that bound)",
    )
    p.add_argument(
        "--hang-phase-timeout",
        type=_positive_float,
        metavar="SECONDS",
        help="the hang bound of start-up and of long phases such as evaluation, checkpoint, compile (default "
        "300; the job's books can make it longer)",
    )
    p.add_argument(
        "--submitted-at",
        type=parse_time,
        metavar="TIME",
        help="when the job was submitted: Unix seconds (1764650000) or ISO-8601 (2026-12-02T05:50:00+00:00)",
    )
    p.add_argument(
        "--allocated-at",
        type=parse_time,
        metavar="TIME",
        help="when its resources were allocated (same formats as --submitted-at)",
    )
    p.add_argument("--no-auto", action="store_true", help="no zero-code instrumentation of Python children")
    p.add_argument("--family", help="job family for `ettr fleet` (default: the script or module name)")
    p.add_argument(
        "--ledger",
        type=ledger_url_arg,
        metavar="URL",
        help="where the books go: sqlite:///PATH or postgresql://USER@HOST/DB (default: RUN_DIR/ledger.db)",
    )
    p.add_argument(
        "--continue-job",
        action="store_true",
        help="with --ledger and --job-id: add this run to that job although another run directory started it "
        "(a requeue elsewhere); without it such a job id is refused. Also: continue a job that completed "
        "(outside Slurm, refused without it)",
    )
    p.add_argument(
        "--grace",
        type=_positive_float,
        metavar="SECONDS",
        help="after a preemption signal (SIGTERM, SIGINT, Slurm's SIGUSR1) is forwarded to the job, how long it "
        "may take to exit (its own save on SIGTERM) before SIGKILL (default 10; give what the scheduler "
        "allows: Slurm's KillWait, Kubernetes' terminationGracePeriodSeconds, less a few seconds)",
    )
    p.add_argument(
        "--peer-timeout",
        type=_positive_float,
        metavar="SECONDS",
        help="multi-node jobs: silence after which a node's supervisor counts as lost (default 60)",
    )
    p.add_argument(
        "command", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARGS...]", help="python or torchrun command"
    )
    p.usage = "%(prog)s [options] -- COMMAND [ARGS...]"


def _run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("ettr run: no command given (usage: ettr run [options] -- COMMAND [ARGS...])")
    args.command = command
    from ettr.memory_sweep import sweep
    from ettr.supervisor import main as supervise

    sweep()  # memory copies of this node's jobs that ended without removing theirs (docs/checkpointing.md)
    return supervise(args, at_job_end=_store_at_job_end)


def _store_at_job_end(run_dir: Path, *, ledger_url: str | None, job_id: str) -> None:
    """The job's fleet summary, stored once at its end (docs/fleet.md). The fleet's modules (and the
    accounting they import: 17 modules) are imported here, at the job's end, not before its supervisor
    starts, where they were on the path of every start and requeue."""
    from ettr.fleet.stored import store_at_job_end

    store_at_job_end(run_dir, ledger_url=ledger_url, job_id=job_id)


# -- ettr report -----------------------------------------------------------------------------------------
def _add_report(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "run_dirs",
        nargs="*",
        type=path_arg,
        metavar="RUN_DIR",
        help="run directories (several compare them; none: the newest under ./runs)",
    )
    p.add_argument(
        "--ledger",
        type=ledger_url_arg,
        metavar="URL",
        help="report a job from a ledger URL instead (with --job-id; alone: list its jobs)",
    )
    p.add_argument(
        "--job-id", metavar="ID", help="with --ledger: the job to report (repeatable)", action="append"
    )
    p.add_argument("--json", action="store_true", help="print the ettr.report/1 JSON (an array for several)")
    p.add_argument(
        "--html", type=path_arg, metavar="FILE", help="also write a self-contained HTML report to FILE"
    )
    p.add_argument(
        "--trace",
        type=path_arg,
        metavar="FILE",
        help="also write a Chrome/Perfetto trace of the job (one RUN_DIR)",
    )
    p.add_argument(
        "--tensorboard",
        type=path_arg,
        metavar="DIR",
        help="also write TensorBoard scalars to DIR (several: a run each)",
    )
    p.add_argument(
        "--window",
        type=_positive_float,
        default=3600.0,
        metavar="SECONDS",
        help="the windowed ETT's window: ETT over the last SECONDS of wall time (default 3600)",
    )
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = (
        "examples:\n  ettr report runs/job-1\n  ettr report runs/job-1 --trace job-1.trace.json   "
        "# open in ui.perfetto.dev\n  ettr report runs/a runs/b --tensorboard tb/   # tensorboard --logdir tb/"
    )


def _report(args: argparse.Namespace) -> int:
    from ettr.report.load import load_requested

    if args.trace and (len(args.run_dirs) > 1 or len(set(args.job_id or ())) > 1):
        # (several --job-id wrote the first job's trace alone, and said nothing of the others)
        raise UsageError(
            "ettr report: --trace takes one RUN_DIR or --job-id (a trace is one job's timeline; run once per job)"
        )
    if args.tensorboard:
        from ettr.report.tensorboard import require_tensorboard

        require_tensorboard()
    if args.ledger and not args.job_id and not args.run_dirs:
        return _list_ledger_jobs(args.ledger, as_json=args.json)
    requested = load_requested(
        args.run_dirs, ledger_url=args.ledger, job_ids=args.job_id, window_s=args.window
    )
    for problem in requested.problems:  # one bad run directory: the others are still reported (status 2)
        print(f"ettr report: skipped {problem}", file=sys.stderr)
    loaded, run_dirs = requested.loaded, requested.run_dirs
    reports = [report for _events, report in loaded]
    from ettr.ledger.undelivered import undelivered_note

    for run_dir in run_dirs:  # a ledger outage's spill not delivered yet: the figures lack it
        note = undelivered_note(run_dir)
        if note:
            print(f"ettr report: note: {note}", file=sys.stderr)
    from ettr.report.json import to_dict
    from ettr.report.labels import run_labels
    from ettr.report.text import render, render_comparison

    # A ledger's jobs have no run directory: they are named by their job ids (None), not by zero labels
    # (`ettr report --ledger URL --job-id A --job-id B`, and any --html of a ledger's job, gave a traceback).
    labels = run_labels(run_dirs) if run_dirs else None
    if args.html:
        from ettr.report.html import write_html

        write_html(reports, args.html, labels=labels)
        print(f"ettr report: wrote {args.html}", file=sys.stderr)
    if args.trace:
        from ettr.report.trace import write_trace

        write_trace(loaded[0][0], reports[0], args.trace)
        print(f"ettr report: wrote {args.trace} (open it in https://ui.perfetto.dev)", file=sys.stderr)
    if args.tensorboard:
        from ettr.report.tensorboard import write_runs

        write_runs(reports, run_dirs, args.tensorboard, asked=args.run_dirs)
        print(
            f"ettr report: wrote TensorBoard scalars to {args.tensorboard} (tensorboard --logdir {args.tensorboard})",
            file=sys.stderr,
        )
    if args.json:
        # Segments (the full timeline) can run to megabytes for long jobs; the HTML report draws them.
        payload = [to_dict(r, include_segments=False) for r in reports]
        several = len(args.run_dirs) > 1 or len(args.job_id or ()) > 1  # an array, even with one left
        print(json.dumps(payload if several else payload[0], indent=2))
    elif len(reports) == 1:
        print(render(reports[0]))
        from ettr.report.hints import no_step_hints, started_over_hints, torn_checkpoint_hints

        events = loaded[0][0]
        hints = (*no_step_hints(events, reports[0]), *torn_checkpoint_hints(events))
        for hint in (*hints, *started_over_hints(events, reports[0])):
            print(f"\nnote: {hint}")
        from ettr.report.audit import render as render_audit

        audit = render_audit(loaded[0][0])
        if audit:
            print("\ninit communication audit (start-up collectives and process groups, per init stage)")
            print(audit)
    else:
        print(render_comparison(reports, labels=labels))
    return 2 if requested.problems else 0


def _list_ledger_jobs(url: str, *, as_json: bool) -> int:
    """`ettr report --ledger URL` without --job-id: the jobs the ledger holds, oldest first."""
    from ettr.ledger.url import list_jobs

    jobs = list_jobs(url)
    if as_json:
        print(json.dumps({"jobs": jobs}))
    elif not jobs:
        print("no jobs in this ledger yet")
    else:
        print(f"{len(jobs)} job(s); report one with: ettr report --ledger URL --job-id ID")
        for job_id in jobs:
            print(f"  {job_id}")
    return 0


# -- ettr interval ---------------------------------------------------------------------------------------
def _add_interval(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--blocking",
        type=_positive_float,
        required=True,
        metavar="SECONDS",
        help="what one save costs the training loop: its blocking (plus any wait for the previous save and "
        "the step time its background persist costs)",
    )
    p.add_argument(
        "--failures-per-day",
        type=_positive_float,
        required=True,
        metavar="F",
        help="interruptions of the whole job per day (failures and preemptions; all its nodes together)",
    )
    p.add_argument(
        "--train-hours", type=_positive_float, default=24.0, metavar="H", help="training hours/day (24)"
    )
    p.add_argument(
        "--json", action="store_true", help="print one JSON object (optimal_interval_s, wasted_pct, ...)"
    )


def _interval(args: argparse.Namespace) -> int:
    from ettr.interval import IntervalModel, curve

    try:
        model = IntervalModel(
            blocking_s=args.blocking, failures_per_day=args.failures_per_day, train_hours=args.train_hours
        )
    except ValueError as exc:
        raise UsageError(f"ettr interval: {exc}") from None
    try:  # extreme inputs (1e308, 5e-324) overflow or underflow the model: say so, never print Infinity
        best = model.optimal_interval_s
        points = curve(model)
        numbers = [best, model.wasted_pct(best), model.wasted_s(best), model.mtbf_s]
        numbers += [model.young_interval_s, model.daly_interval_s]
        numbers += [x for point in points for x in point]
    except (ValueError, ZeroDivisionError, OverflowError):
        numbers = [math.nan]
    if not all(math.isfinite(x) and x >= 0 for x in numbers) or not best > 0:
        raise UsageError(
            f"ettr interval: --blocking {args.blocking:g} with --failures-per-day {args.failures_per_day:g} "
            "is outside the numbers the model can compute (give values of real jobs)"
        )
    if model.wasted_pct(best) >= 99.995:  # shows as 100.00%: nothing is kept
        raise UsageError(
            f"ettr interval: a checkpoint blocking {args.blocking:g} s with a failure every "
            f"{model.mtbf_s:g} s on average: no checkpoint interval keeps the job making progress"
        )
    if args.json:
        print(
            json.dumps(
                {
                    "optimal_interval_s": best,
                    "wasted_pct": model.wasted_pct(best),
                    "wasted_s_per_day": model.wasted_s(best),
                    "young_interval_s": model.young_interval_s,
                    "daly_interval_s": model.daly_interval_s,
                    "mtbf_s": model.mtbf_s,
                    "curve": [{"interval_s": t, "wasted_pct": w} for t, w in points],
                }
            )
        )
        return 0
    print(
        f"optimal checkpoint interval: {best:.0f} s ({best / 60:.1f} min) -> "
        f"{model.wasted_pct(best):.2f}% of training time wasted ({model.wasted_s(best) / 60:.1f} min/day; "
        "restarts not counted)"
    )
    print(
        f"  first-order forms: Young {model.young_interval_s:.0f} s, Daly {model.daly_interval_s:.0f} s; "
        f"mean time between failures: {model.mtbf_s / 3600:.1f} h (docs/interval.md)"
    )
    print("  interval        wasted")
    for interval_s, wasted in points:
        mark = "  <- optimum" if abs(interval_s - best) < 1e-9 else ""
        print(f"  {interval_s / 60:7.1f} min  {wasted:6.2f}%{mark}")
    return 0


# -- ettr demo -------------------------------------------------------------------------------------------
def _add_demo(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quick",
        action="store_true",
        help="a short run (1,200 steps: a few minutes; 5-6 min on a busy 2-core machine)",
    )
    p.add_argument(
        "--out", type=path_arg, default="runs/demo", metavar="DIR", help="where the runs go (runs/demo)"
    )
    p.add_argument(
        "--one-after-the-other",
        action="store_true",
        help="run the sides one after the other, each with the whole machine, instead of side by side on "
        "half of its CPUs each (a change of the machine's load between them then moves the comparison)",
    )


def _demo(args: argparse.Namespace) -> int:
    from ettr.demo.app import main as demo

    return demo(args)


# -- ettr compile-report ---------------------------------------------------------------------------------
def _add_compile_report(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=path_arg, metavar="RUN_DIR", help="run directory of an ettr job")
    p.add_argument("--json", action="store_true", help="print the ettr.compile-report/1 JSON")


def _compile_report(args: argparse.Namespace) -> int:
    from ettr.report.compile_text import load, render
    from ettr.report.json import plain

    summary = load(args.run_dir)
    # A ledger's numbers may be forged or not finite: JSON has no Infinity, so they print as null.
    print(json.dumps(plain(summary), indent=2, allow_nan=False) if args.json else render(summary))
    return 0


# -- ettr publish ----------------------------------------------------------------------------------------
def _add_publish(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "queue_dir",
        type=path_arg,
        metavar="QUEUE_DIR",
        help="the publish queue the training job enqueued into",
    )
    p.add_argument("--watch", action="store_true", help="keep publishing requests as they arrive (a worker)")
    p.add_argument(
        "--poll-interval",
        type=_positive_float,
        default=2.0,
        metavar="SECONDS",
        help="--watch: look this often",
    )
    p.add_argument(
        "--lease-ttl",
        type=_positive_float,
        default=120.0,
        metavar="SECONDS",
        help="a claim not renewed for this long is retried by another publisher (120)",
    )
    p.add_argument("--max-attempts", type=_positive_int, default=3, metavar="N", help="tries per request (3)")
    p.add_argument("--request", metavar="ID", help="publish only this request")
    p.add_argument(
        "--retry",
        action="store_true",
        help="put failed requests (only --request's with it) back in the queue first and publish them again, "
        "once their cause is fixed (a factory not allowed, a missing key)",
    )
    p.add_argument("--json", action="store_true", help="end with one JSON object of what was published")
    p.add_argument(
        "--allow-factory",
        action="append",
        default=[],
        metavar="MODULE:CALLABLE|MODULE.*",
        help="model code a request may name (repeatable; entry points in ettr.publish_factories count too)",
    )
    p.add_argument(
        "--root",
        action="append",
        type=path_arg,
        default=[],
        metavar="DIR",
        help="anchors, artifacts and run dirs must lie here (repeatable; default: the queue's parent dir)",
    )
    p.add_argument(
        "--allow-pythonpath",
        action="append",
        type=path_arg,
        default=[],
        metavar="DIR",
        help="a request's pythonpath entries may lie here (repeatable; default: none beyond sys.path)",
    )
    p.add_argument(
        "--allow-unsigned",
        action="store_true",
        help="load anchors this publisher's key ring cannot authenticate (unsigned, or another user's key); "
        "nothing in an anchor runs as code either way",
    )


def _publish(args: argparse.Namespace) -> int:
    from ettr.publish.command import main as publish

    return publish(args)


# -- ettr deliver ----------------------------------------------------------------------------------------
def _add_deliver(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "run_dirs",
        nargs="+",
        type=path_arg,
        metavar="RUN_DIR",
        help="run directories of jobs on a shared ledger (ettr run --ledger postgresql://...)",
    )


def _deliver(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ettr.ledger.base import LedgerError
    from ettr.ledger.locate import is_run_dir, unsearchable
    from ettr.ledger.undelivered import deliver_undelivered
    from ettr.untrusted import one_line

    status = 0
    bad: list[str] = []  # the bad directories are one line at the end: the others are still delivered
    run_dirs = list(dict.fromkeys(args.run_dirs))
    for run_dir in run_dirs:
        try:
            if not Path(run_dir).is_dir() or not is_run_dir(run_dir):
                raise LedgerError(unsearchable(run_dir) or f"{run_dir}: not an ettr run directory")
            done = deliver_undelivered(run_dir)
        except (LedgerError, OSError) as exc:
            bad.append(str(exc))
            continue
        # one line each, whatever the name (`ettr deliver runs/*` of a shared folder: a directory named
        # `x\nruns/y: delivered 9 spilled event(s)` added a line of its own to what a person reads)
        name = one_line(str(run_dir))
        if not done.complete:
            status = 1
            # why, as the server said it: 'did not answer; try again later' hid a refusal that waiting never
            # mends (no password: the run directory's URL never holds one, give PGPASSWORD or ~/.pgpass)
            why = f" ({one_line(done.why)})" if done.why else ""
            print(
                f"ettr deliver: {name}: the ledger server did not answer{why}; {done.left.num_events} event(s) "
                f"stay in {name}/ledger-spill (nothing is lost; try again later)",
                file=sys.stderr,
            )
        elif done.num_delivered:
            print(f"{name}: delivered {done.num_delivered} spilled event(s) to the ledger")
        else:
            print(f"{name}: nothing to deliver")
        if done.left.num_live_files:
            print(
                f"{name}: {done.left.num_live_files} spill file(s) belong to a writer still running "
                "(it delivers them itself)"
            )
    if bad:
        what = f"skipped {len(bad)} of {len(run_dirs)} run directories: " if len(run_dirs) > 1 else "skipped "
        print(_error_line("ettr deliver", _one_line(what + "; ".join(bad))), file=sys.stderr)
        return 2
    return status


def _lazy(module: str, name: str) -> Callable[[Any], Any]:
    """`module.name`, imported when first called (the CLI imports no command's module up front)."""

    def call(arg: Any) -> Any:

        return getattr(importlib.import_module(module), name)(arg)

    return call


_COMMANDS: dict[
    str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
] = {
    "run": ("supervise a training command, restart it, record everything", _add_run, _run),
    "report": ("report ETT% and the wall-time breakdown of run directories", _add_report, _report),
    "interval": ("the checkpoint interval that wastes the least time", _add_interval, _interval),
    "demo": ("baseline vs optimized reference job, with injected failures", _add_demo, _demo),
    "publish": (
        "build inference artifacts from anchor checkpoints (a publish queue)",
        _add_publish,
        _publish,
    ),
    "compile-report": (
        "compile time, recompile reasons and learned dynamic inputs of a run",
        _add_compile_report,
        _compile_report,
    ),
    "deliver": (
        "deliver ledger events a server outage left in run directories (exactly once)",
        _add_deliver,
        _deliver,
    ),
    "simulate": (
        "what-if ETT of a job at any scale, fed by its own ledger",
        _lazy("ettr.simulate.command", "add_arguments"),
        _lazy("ettr.simulate.command", "main"),
    ),
    "fleet": (
        "ETT across many jobs: families, regressions, failure causes, preemption order",
        _lazy("ettr.fleet.command", "add_fleet_arguments"),
        _lazy("ettr.fleet.command", "fleet_main"),
    ),
    "serve": (
        "Prometheus /metrics of many jobs (run directories or a shared ledger)",
        _lazy("ettr.fleet.command", "add_serve_arguments"),
        _lazy("ettr.fleet.command", "serve_main"),
    ),
}


_EXAMPLES = {
    "run": """examples:
  ettr run -- python train.py                        # zero-code: record, restart up to 3 times
  ettr run --max-restarts 5 --inject crash@step=50 -- torchrun --nproc-per-node 2 train.py
  ettr run --run-dir runs/my-job -- python train.py  # a requeue: the same run dir continues the job
  ettr run --ledger postgresql://ettr@db/ettr --job-id J -- torchrun --nnodes 2 --node-rank R \\
      --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node0:29400 train.py   # on each node R
a hang is 10 step times without progress (at least 10 s) once steps run, 300 s in start-up and long phases
(evaluation, checkpoint, restore, compile; longer if the job's books show them longer); --hang-timeout
replaces the step bound, --hang-step-factor K makes it K step times, --hang-phase-timeout S the 300 s.
exit status: 0 completed, 1 restarts used up, 2 bad input, 3 restarts would not help (the same failure
before the first step, restarts that reach no new step, or that fail the same way at the same place),
143 preempted, 130 Ctrl-C""",
    "report": """examples:
  ettr report runs/my-job                    # terminal report
  ettr report runs/my-job --json             # the ettr.report/1 schema
  ettr report runs/base runs/opt --html cmp.html   # compare runs, write an HTML page""",
    "interval": """examples:
  ettr interval --blocking 15 --failures-per-day 3          # ~15.3 min
  ettr interval --blocking 2 --failures-per-day 10 --json""",
    "demo": """examples:
  ettr demo                 # baseline vs optimized reference job (several minutes)
  ettr demo --quick --out /tmp/demo
  ettr demo --one-after-the-other   # each side with the whole machine (docs/demo.md: what each way costs)""",
    "publish": """examples:
  ettr publish runs/publish-queue --allow-factory 'mypkg.models.*'      # build every queued artifact
  ettr publish runs/publish-queue --allow-factory mypkg.models:build --watch   # serve the queue
  ettr publish runs/publish-queue --allow-factory 'mypkg.models.*' --retry     # failed ones again, cause fixed
  ettr publish q --allow-factory 'dlrm.*' --allow-pythonpath examples --root /data/publish
see docs/trust.md: a request names only allowed model code, and paths inside the roots""",
    "deliver": """examples:
  ettr deliver runs/my-job        # after `ettr fleet` / `ettr report` said events wait there
a PostgreSQL outage longer than the supervisor's 60 s drain at the job's end leaves the job's events in
RUN_DIR/ledger-spill/; the next `ettr run` in that run directory delivers them, or this command now.
Exit status: 0 delivered (or nothing waited), 1 the server did not answer (nothing lost), 2 bad input""",
    "compile-report": """examples:
  ettr compile-report runs/my-job
  ettr compile-report runs/my-job --json""",
}


def _version() -> str:
    from ettr import __version__

    return f"ettr {__version__}"


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with `only` (a command's name) that command's flags alone, the others' left
    unparsed (their help lines stay): `ettr run` no longer imports the fleet's and the simulator's modules
    to build flags it never parses, before its supervisor starts (0.05 s of CPU with bytecode caches, 0.12 s
    without, on every start of a job and every requeue)."""
    parser = _Parser(
        prog="ettr",
        description="Effective Training Time for PyTorch jobs.",
        epilog="run 'ettr COMMAND --help' for a command's flags and examples",
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=_Parser)
    for name, (help_text, add, _handler) in _COMMANDS.items():
        sub_parser = sub.add_parser(
            name,
            # argparse %-formats `help` (not `description`): a literal % must be doubled there.
            help=help_text.replace("%", "%%"),
            description=help_text,
            epilog=_EXAMPLES.get(name),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        if only is None or name == only:
            add(sub_parser)
    return parser


_NO_RESULT_ON_STDOUT = frozenset({"run", "demo"})
"""Commands whose result is not what they print (a job's exit status, files): they run with stdout closed."""

_BAD_PATH_ERRNOS = frozenset(
    {errno.ENAMETOOLONG, errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.EINVAL, errno.EACCES}
)
"""An OSError with one of these escaping a command is bad input (exit 2); any other is a failure (exit 1)."""


MAX_ERROR_CHARS = 1000
"""An error line quoting a huge argument keeps its start and its end (what to do), not every character."""


def _one_line(text: str) -> str:
    """`text` with control characters (a newline or carriage return in a user's argument) escaped, at most
    about `MAX_ERROR_CHARS` long."""
    line = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    if len(line) > MAX_ERROR_CHARS:
        half = MAX_ERROR_CHARS // 2 - 40
        line = f"{line[:half]} ...[{len(line) - 2 * half} characters cut]... {line[-half:]}"
    return line


_OWN_PREFIX = re.compile(r"^(ettr(?: [a-z][a-z-]*)?): (?:error: )?")


def _error_line(command: str, message: str) -> str:
    """One error line in the one style every command uses: `ettr COMMAND: what was wrong; what to do`.

    Messages raised deep inside a command may carry a prefix of their own (`ettr run: `, `ettr: `); the line
    names the command once: the one that was run, or the message's own where the command line did not parse."""
    own = _OWN_PREFIX.match(message)
    if own is None:
        return f"{command}: {message}"
    return f"{own.group(1) if command == 'ettr' else command}: {message[own.end() :]}"


def main(argv: Sequence[str] | None = None) -> int:
    command = "ettr"
    try:
        words = list(sys.argv[1:] if argv is None else argv)
        only = words[0] if words and words[0] in _COMMANDS else None  # `ettr COMMAND ...`: its flags alone
        args, extra = build_parser(only).parse_known_args(words)
        if extra:  # the top parser would say `ettr: unrecognized ...` for a subcommand's bad flag
            where = f"ettr {args.cmd}" if getattr(args, "cmd", None) else "ettr"
            raise UsageError(f"{where}: unrecognized arguments: {' '.join(extra)} (see {where} --help)")
        if args.cmd is None:
            raise UsageError("ettr: no command given (one of: " + ", ".join(_COMMANDS) + "; see --help)")
        command = f"ettr {args.cmd}"
        if sys.stdout is None and args.cmd not in _NO_RESULT_ON_STDOUT:  # started with `>&-`
            raise UsageError(f"{command}: standard output is closed, its result would be lost (redirect it)")
        return _COMMANDS[args.cmd][2](args)
    except UsageError as exc:
        print(_error_line(command, _one_line(str(exc))), file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    except OSError as exc:  # a path the system refuses (too long, not a directory, ...): still one line
        where = f" ({_one_line(str(exc.filename))[:200]})" if exc.filename else ""
        what = _one_line(exc.strerror or str(exc))
        if exc.errno == errno.EBADF and not exc.filename:  # `1</dev/null`: stdout open, but not for writing
            what = f"cannot write standard output ({what})"
        print(f"{command}: {what}{where}", file=sys.stderr)
        return 2 if exc.errno in _BAD_PATH_ERRNOS else 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
