"""`ettr publish QUEUE_DIR`: the command's work (the argparse front is `ettr.cli`).

A failed request stays failed until `--retry` puts it back in the queue (its cause fixed: a factory the
publisher did not allow yet, a missing key).

Exit status: 0 when every request this run handled was published (or was already), 1 when one failed,
2 for bad usage (no such queue, a queue directory that is a symlink, unknown request, no factory allowed). What requests may name (model
code, paths) is the operator's `PublishPolicy` (`--allow-factory`, `--allow-pythonpath`, `--root`). With `--json` the per-request lines go to stderr and
stdout holds one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ettr.errors import UsageError
from ettr.publish.policy import PublishPolicy, parse_allow_entry
from ettr.publish.queue import PublishQueue, RequestState
from ettr.publish.request import PublishError
from ettr.untrusted import printable

if TYPE_CHECKING:
    from ettr.publish.worker import PublishOutcome

# The worker (and with it torch, a second or more) is imported once the arguments are known to be good.

_SAFE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,255}$")


def _line(outcome: PublishOutcome) -> str:
    """One line of an outcome for the operator's terminal: what a request names (its paths, and so the errors
    that quote them) is the requester's text, printed with its escapes written out (`printable`)."""
    return printable(_words(outcome))


def _words(outcome: PublishOutcome) -> str:
    from ettr.publish.worker import PublishStatus

    if outcome.status in (PublishStatus.PUBLISHED, PublishStatus.EXISTING):
        err = (outcome.verification.get("exported_program") or {}).get("max_abs_err")
        verified = f"verified, max |diff| {err:.3g}" if isinstance(err, float) else "verified"
        word = "published" if outcome.status is PublishStatus.PUBLISHED else "already published"
        return f"{word} {outcome.request_id} -> {outcome.artifact_dir} ({verified}; books: {outcome.run_dir})"
    if outcome.status is PublishStatus.LOST:
        return f"handed over {outcome.request_id}: another publisher took it over"
    return f"FAILED {outcome.request_id}: {outcome.error}"


def main(args: argparse.Namespace) -> int:
    queue_dir = Path(args.queue_dir)
    if not os.path.lexists(queue_dir / "requests"):  # a symlink there is refused by `open_layout` below
        what = "no such directory" if not queue_dir.exists() else "not a publish queue (no requests/ inside)"
        raise UsageError(f"ettr publish: {queue_dir}: {what}")
    try:  # the missing directories made, a symlinked one refused before anything is moved
        queue = PublishQueue(queue_dir, create=True)
    except PublishError as exc:
        raise UsageError(f"ettr publish: {exc}") from None
    for flag, dirs in (("--root", args.root), ("--allow-pythonpath", args.allow_pythonpath)):
        for given in dirs:  # a file can hold nothing: the flag would silently allow nothing
            if "://" not in given and Path(given).exists() and not Path(given).is_dir():
                raise UsageError(f"ettr publish: {flag} {given}: not a directory")
    try:
        policy = PublishPolicy.for_queue(
            queue_dir,
            allow=[parse_allow_entry(entry) for entry in args.allow_factory],
            roots=args.root,
            pythonpath_roots=args.allow_pythonpath,
            allow_unsigned=getattr(args, "allow_unsigned", False),
        )
    except ValueError as exc:
        raise UsageError(f"ettr publish: {exc}") from None
    if args.request is not None and not _SAFE_ID.match(args.request):
        raise UsageError(
            f"ettr publish: --request {args.request!r} is not a request id (letters, digits, _.-)"
        )
    if args.request is not None and queue.status(args.request) is None:
        raise UsageError(f"ettr publish: no request {args.request!r} in {queue_dir}")
    if args.watch and args.request is not None:
        raise UsageError("ettr publish: --watch and --request do not go together")
    retried = []
    if getattr(args, "retry", False):  # after every check: a refused run moves nothing
        for request_id in [args.request] if args.request is not None else queue.failed():
            try:
                if queue.requeue(request_id):
                    retried.append(request_id)
            except OSError as exc:
                raise UsageError(f"ettr publish: cannot put {request_id} back in the queue ({exc})") from None
    from ettr.publish.worker import PublishStatus, PublishWorker, WorkerConfig

    try:
        config = WorkerConfig(
            lease_ttl_s=args.lease_ttl, max_attempts=args.max_attempts, poll_interval_s=args.poll_interval
        )
    except ValueError as exc:
        raise UsageError(f"ettr publish: {exc}") from None
    out = sys.stderr if args.json else sys.stdout
    for request_id in retried:
        print(printable(f"retrying {request_id} (it had failed)"), file=out, flush=True)

    def show(outcome: PublishOutcome) -> None:
        print(_line(outcome), file=out, flush=True)

    worker = PublishWorker(queue_dir, config, policy=policy, command=["ettr", "publish", *sys.argv[2:]])
    if args.watch:
        stop = threading.Event()
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
        try:
            print(
                f"watching {queue_dir} (every {config.poll_interval_s:g} s; SIGTERM stops)",
                file=out,
                flush=True,
            )
            outcomes = worker.watch(stop, on_outcome=show)
        except KeyboardInterrupt:
            outcomes = []
        except PublishError as exc:  # the queue's layout swapped for a symlink while it watched
            raise UsageError(f"ettr publish: {exc}") from None
        finally:
            signal.signal(signal.SIGTERM, previous)
    else:
        try:
            outcomes = worker.drain(only=args.request)
        except PublishError as exc:  # the queue's layout swapped for a symlink meanwhile
            raise UsageError(f"ettr publish: {exc}") from None
        for outcome in outcomes:
            show(outcome)
    finished: dict[str, Any] | None = None
    if not outcomes and args.request is not None:
        finished = queue.result(args.request)
        status = queue.status(args.request)
        if status is not None and status.finished and finished is not None:
            where = finished.get("artifact_dir") or finished.get("error")
            again = " (--retry publishes it again)" if status is RequestState.FAILED else ""
            print(printable(f"{args.request} is {status} already: {where}{again}"), file=out)
        else:
            print(f"{args.request} is being published by another publisher", file=out)
    elif not outcomes and not args.watch:
        print(f"nothing to publish in {queue_dir}", file=out)
    num_failed = sum(1 for o in outcomes if not o.ok)
    if num_failed:  # a failed request is not retried by itself: say how, once its cause is fixed
        print(
            f"{num_failed} request(s) failed, kept in {queue_dir / 'failed'}: once the cause is fixed, "
            f"ettr publish {queue_dir} --retry [--request ID] ... publishes them again",
            file=out,
        )
    if args.json:
        print(
            json.dumps(
                {
                    "queue": str(queue_dir.absolute()),
                    "outcomes": [o.to_json() for o in outcomes],
                    "num_published": sum(1 for o in outcomes if o.status is PublishStatus.PUBLISHED),
                    "num_failed": num_failed,
                    "finished": finished,
                }
            )
        )
    if finished is not None and finished.get("error"):
        return 1
    return 1 if num_failed else 0
