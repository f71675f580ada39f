"""Signals a training process handles itself: noted where the supervisor finds them.

A scheduler or an operator may signal the training processes directly, not `ettr run`: Slurm's `--signal`
(SIGUSR1 before the time limit), `scancel --signal`, a `kill` of the job's process group, a container
runtime. A script with its own handler (Lightning's, which raises `SIGTERMException`, a `SystemExit`; any
"save and exit" handler) then ends with status 0 or 1 after a few steps, and the attempt read as
`completed` (the scheduler saw success and never requeued the rest) or as a failure of unknown cause.

Here `signal.signal` is wrapped in the training process: a handler the script installs for one of
`WATCHED` is called through `noting(handler)`, which first writes `ettr.run_env.signalled_path` (one small
file per process and signal: no lock, no ledger write, safe in a handler that ends the process) and then
calls the script's handler. `signal.getsignal` returns the script's own handler (Lightning checks it). The
supervisor reads the files of the attempt's processes (`signals_received`) when it classifies an attempt
that it did not stop itself (`ettr.supervisor.classify`: booked preempted, restarted like one). A signal
whose default action ends the process needs none of this: the exit status says it.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from ettr.patcher import Patcher

logger = logging.getLogger("ettr")

WATCHED = frozenset({signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2})
"""What schedulers send to stop or warn a job (SIGINT is a person's Ctrl-C at a terminal: ettr sees it too)."""

_patcher = Patcher()
_WRAPPED_ATTR = "__ettr_handler__"
_stops: list[int] = []
"""The stop signals (SIGTERM) this training process's own handler was called for (`stop_received`)."""


def stop_received() -> bool:
    """Whether the script's own handler of this process was called for SIGTERM: a stop is underway (a
    preemption, `ettr run` forwarding one), and what the process raises from now on is its consequence — a
    DataLoader worker killed by the same SIGTERM (torch's SIGCHLD handler raises over the handler's
    `SystemExit`), a handler that raises — not a failure to restart in place (`ettr.inplace.wrapper`)."""
    return bool(_stops)


def install(run_dir: str, attempt: int, rank: int) -> None:
    """Wrap `signal.signal` and `signal.getsignal` in this training process (idempotent, never raises)."""
    from ettr.run_env import signalled_path

    owner = os.getpid()

    def note(signum: int) -> None:
        if os.getpid() != owner:
            return  # a forked child (a data-loader worker) inherits the wrapper: it is no training process
        if signum == signal.SIGTERM:
            _stops.append(signum)
        try:
            from ettr.atomic import create_exclusive
            from ettr.untrusted import make_dirs_below

            path = signalled_path(run_dir, attempt, os.getpid(), signal.Signals(signum).name)
            make_dirs_below(run_dir, path.parent)  # never through a symlinked agent/
            create_exclusive(path, f"{rank} {time.time():.3f}", durable=False)
        except Exception:
            pass  # there already, or no place for it

    def make_signal(original: Callable[..., Any]) -> Callable[..., Any]:
        def ettr_signal(signalnum: Any, handler: Any) -> Any:
            if signalnum in WATCHED and callable(handler) and not hasattr(handler, _WRAPPED_ATTR):
                handler = noting(handler, note)
            return handler_of(original(signalnum, handler))

        return ettr_signal

    def make_getsignal(original: Callable[..., Any]) -> Callable[..., Any]:
        def ettr_getsignal(signalnum: Any) -> Any:
            return handler_of(original(signalnum))

        return ettr_getsignal

    try:
        _patcher.wrap(signal, "signal", make_signal)
        _patcher.wrap(signal, "getsignal", make_getsignal)
    except Exception as exc:
        logger.warning(
            "ettr: signals handled by the script will not be noted (%s: %s)", type(exc).__name__, exc
        )


def noting(handler: Callable[..., Any], note: Callable[[int], None]) -> Callable[..., Any]:
    """`handler`, called after `note(signum)`; not again while it still runs.

    The same stop comes twice within milliseconds under `exec ettr run` in a Slurm batch script: Slurm's
    requeue, preemption, cancel or time limit signals every process of the job, and the supervisor forwards
    the SIGTERM it got too (so does torchrun to its workers). Python runs a handler again inside itself when
    the second one lands while the first call still runs: a handler that saves and exits (field trial:
    `scontrol requeue`, "saving at step 51" twice, the outer save cut off by the inner `sys.exit`) began a
    second save of the same file and abandoned the first half-written. Without ettr each process got one.
    A signal that arrives while the script's handler for it runs is therefore dropped (the handler is
    handling that stop already); once the handler returned, the next one is delivered as ever. A person who
    insists has SIGKILL, or a second signal to `ettr run` (which then SIGKILLs)."""
    running: set[int] = set()

    def on_signal(signum: int, frame: Any) -> Any:
        if signum in running:
            return None  # the same stop again, within its own handling (see above)
        note(signum)
        running.add(signum)
        try:
            return handler(signum, frame)
        finally:
            running.discard(signum)

    setattr(on_signal, _WRAPPED_ATTR, handler)
    return on_signal


def handler_of(installed: Any) -> Any:
    """The script's own handler for what `signal` holds (ours wraps it)."""
    return getattr(installed, _WRAPPED_ATTR, installed)
