"""Slurm's side of `ettr run`: the warning signal before a time limit, the requeue, the restart count.

`sbatch --requeue --signal=B:USR1@T` sends SIGUSR1 to the batch shell T seconds before the time limit (or
a preemption's kill). With `exec ettr run ...` the supervisor is that shell: it forwards SIGTERM to the job
(whose preemption handler saves and exits, `ettr.checkpoint.preempt`), records the attempt as preempted,
asks Slurm to requeue the job (`scontrol requeue $SLURM_JOB_ID`) and exits 143. The requeued run continues
the books (same job id, same ledger); `SLURM_RESTART_COUNT` is then cross-checked against the ledger's
earlier runs of the job, and a mismatch is said in one line.
"""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import NamedTuple

from ettr.events import SUPERVISOR_RANK, Event, EventKind
from ettr.procs import signal_pids, topmost_handlers
from ettr.supervisor.jobinfo import show_job

logger = logging.getLogger("ettr")

WARNING_SIGNAL = signal.SIGUSR1
"""The signal `--signal=B:USR1@T` sends before the kill."""


def forwarded_signal(received: int) -> int:
    """What the job gets when the supervisor receives `received`: Slurm's warning becomes SIGTERM (save,
    then exit), everything else is forwarded as it is."""
    return signal.SIGTERM if received == WARNING_SIGNAL else received


def in_step(environ: Mapping[str, str]) -> bool:
    """Whether this process is a task of an srun step (`SLURM_STEP_NUM_TASKS`; a batch script has none):
    Slurm's `--signal=USR1@T` without `B:` then reaches every process of the step, the job's too; with `B:`
    (or `scancel --batch`) only the batch shell gets it."""
    return "SLURM_STEP_NUM_TASKS" in environ


def signal_handlers(pids: Collection[int], sig: int) -> list[int]:
    """`sig` (Slurm's warning) to those of `pids` with a handler of their own for it, the topmost of each
    line (`ettr.procs.topmost_handlers`); the pids it was sent to."""
    return signal_pids(topmost_handlers(pids, sig), sig)


class Requeue(NamedTuple):
    """What `requeue` did: one line for people, and whether the job is queued again (by this call, or
    already: then a "to continue it" hint would be noise)."""

    line: str
    queued: bool


def requeue(environ: Mapping[str, str], *, timeout_s: float = 10.0) -> Requeue:
    """Ask Slurm to requeue this job (after SIGUSR1)."""
    job = environ.get("SLURM_JOB_ID")
    if not job:
        return Requeue("got SIGUSR1 outside a Slurm job: not requeued", False)
    exe = shutil.which("scontrol")
    if exe is None:
        return Requeue(f"cannot requeue Slurm job {job}: scontrol is not on PATH", False)
    try:
        done = subprocess.run(
            [exe, "requeue", job], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return Requeue(f"scontrol requeue {job} failed ({exc})", False)
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines()
        said = why[-1] if why else str(done.returncode)
        if "pending" in said.lower():  # requeued already: a node failure, a preemption, the job's own handler
            return Requeue(
                f"Slurm job {job} is pending again already (requeued meanwhile, by Slurm or by the job's own "
                f"handler: {said})",
                True,
            )
        return Requeue(f"scontrol requeue {job} failed: {said}", False)
    return Requeue(f"asked Slurm to requeue job {job} (scontrol requeue)", True)


def queued_again(environ: Mapping[str, str], *, show: Callable[[str], str] = show_job) -> str | None:
    """One line when Slurm has requeued this job since this run of it began, else None.

    A requeue (`scontrol requeue`, a preemption, the job's own handler: Lightning's auto-requeue) raises the
    job's `Restarts` before Slurm's SIGTERM reaches the job, so a run that stops on that SIGTERM sees it
    above its own `SLURM_RESTART_COUNT` (unset in a job's first run): Slurm runs the job again, and a "to
    continue it" hint (run this by hand) would start a second copy beside it. None outside Slurm, or when
    `scontrol` cannot say (the hint stays)."""
    job = environ.get("SLURM_JOB_ID")
    if not job:
        return None
    fields = dict(t.split("=", 1) for t in show(job).split() if "=" in t)
    try:
        now, ours = int(fields.get("Restarts", "")), int(environ.get("SLURM_RESTART_COUNT") or 0)
    except ValueError:
        return None
    if now <= ours:
        return None
    state = fields.get("JobState", "?")
    return f"Slurm requeued job {job} (Restarts={now}, JobState={state}): it runs again from the queue"


def earlier_runs(events: Sequence[Event]) -> int:
    """How many supervisors of this job started before (each Slurm run of it starts one on node 0)."""
    return sum(1 for e in events if e.kind is EventKind.SUPERVISOR_START and e.rank == SUPERVISOR_RANK)


def num_attempts(events: Sequence[Event]) -> int:
    """The attempts the ledger holds."""
    return len({e.attempt for e in events if e.kind is EventKind.ATTEMPT_START})


def restart_count_note(events: Sequence[Event], environ: Mapping[str, str]) -> str | None:
    """One line when `SLURM_RESTART_COUNT` disagrees with the ledger's earlier runs of the job, else None.

    Slurm counts the job's requeues; the ledger counts the supervisors that ran it. They differ when a run
    died before its supervisor wrote anything, or when the ledger is not the one the earlier runs used.
    """
    raw = environ.get("SLURM_RESTART_COUNT")
    if raw is None or not environ.get("SLURM_JOB_ID"):
        return None
    try:
        slurm = int(raw)
    except ValueError:
        return f"SLURM_RESTART_COUNT={raw!r} is not a number; not cross-checked with the ledger"
    runs = earlier_runs(events)
    if slurm == runs:
        return None
    return (
        f"Slurm says job {environ['SLURM_JOB_ID']} was restarted {slurm} time(s) (SLURM_RESTART_COUNT) but "
        f"the ledger holds {runs} earlier run(s) of it ({num_attempts(events)} attempt(s)): "
        "a run died before its books began, or this is not the ledger the earlier runs used"
    )
