"""Who the job is and when it was submitted and allocated: from the flags, else from Slurm.

Slurm exports the job id and (since 21.08) `SLURM_JOB_START_TIME`, the allocation time; the submission time
is only in `scontrol show job`, which is asked once, briefly, when the flags leave it unknown.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime

from ettr.supervisor.config import CLOCK_SKEW_S, MAX_AGE_S
from ettr.supervisor.messages import say
from ettr.untrusted import printable

logger = logging.getLogger("ettr")


@dataclass(frozen=True, kw_only=True)
class JobTimes:
    """When the job was submitted and allocated (Unix seconds; None: unknown)."""

    submitted_at: float | None = None
    allocated_at: float | None = None


def default_job_id(environ: Mapping[str, str] | None = None, *, now: float | None = None) -> str:
    """Slurm's job id when there is one, else a fresh id from the time and pid. An array task is named as
    Slurm names it (squeue, sacct, `%A_%a`): the array's id and the task's, `12_0`; its own `SLURM_JOB_ID`
    (13) with the task index made `13_0`, a name no Slurm command knows."""
    environ = os.environ if environ is None else environ
    slurm = environ.get("SLURM_JOB_ID")
    if slurm:
        task = environ.get("SLURM_ARRAY_TASK_ID")
        if task:
            return f"{environ.get('SLURM_ARRAY_JOB_ID') or slurm}_{task}"
        return slurm
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if now is None else now))
    return f"job-{stamp}-{os.getpid()}"


def parse_scontrol_times(text: str) -> JobTimes:
    """SubmitTime and StartTime from `scontrol show job -o` output (local times, 'Unknown' allowed)."""
    fields = dict(token.split("=", 1) for token in text.split() if "=" in token)

    def when(key: str) -> float | None:
        value = fields.get(key, "")
        try:
            return datetime.fromisoformat(value).timestamp()
        except ValueError:
            return None

    return JobTimes(submitted_at=when("SubmitTime"), allocated_at=when("StartTime"))


def slurm_start_time(text: str | None, *, now: float) -> float | None:
    """The allocation time `SLURM_JOB_START_TIME` gives (`text`), or None, said in one line, where it gives
    none: `0`, Slurm's own unknown (its `scontrol` prints a start time of 0 as `StartTime=Unknown`), or a value
    that is no time of this job (not a number, not finite, in the future, or years ago: as `--allocated-at`
    refuses them). `0` was recorded as the allocation, then skipped on every read of the books as damage
    (`skipped 1 unreadable ledger records`), and the other bad values dropped with a line about the ledger;
    now the allocation is booked unknown (TTS from the supervisor's start), unless `scontrol` says it."""
    if text is None or not text.strip():
        return None
    shown = printable(text.strip()[:40])
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if value == 0:
        say(
            "SLURM_JOB_START_TIME=0 is Slurm's unknown start time (scontrol shows StartTime=Unknown): the "
            "allocation time is booked unknown"
        )
        return None
    why = (
        "not a time"
        if not math.isfinite(value)
        else f"{value - now:.0f} s in the future"
        if value > now + CLOCK_SKEW_S
        else f"{(now - value) / (365.25 * 86400):.0f} years before now"
        if value < now - MAX_AGE_S
        else None
    )
    if why is not None:
        say(
            f"SLURM_JOB_START_TIME={shown} is no start time of this job ({why}): the allocation time is booked unknown"
        )
        return None
    return value


def show_job(job_id: str) -> str:
    """`scontrol show job -o JOB_ID`'s one line, or "" (no scontrol, it failed or timed out: 5 s)."""
    exe = shutil.which("scontrol")
    if exe is None:
        return ""
    try:
        done = subprocess.run(
            [exe, "show", "job", "-o", job_id], capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        logger.info("ettr: scontrol show job %s failed (%s)", job_id, exc)
        return ""
    return done.stdout if done.returncode == 0 else ""


def job_times(
    *,
    submitted_at: float | None,
    allocated_at: float | None,
    environ: Mapping[str, str] | None = None,
    scontrol: Callable[[str], str] = show_job,
) -> JobTimes:
    """The flags' times, completed from Slurm where a flag was not given."""
    environ = os.environ if environ is None else environ
    job = environ.get("SLURM_JOB_ID")
    if not job or (submitted_at is not None and allocated_at is not None):
        return JobTimes(submitted_at=submitted_at, allocated_at=allocated_at)
    if allocated_at is None:
        allocated_at = slurm_start_time(environ.get("SLURM_JOB_START_TIME"), now=time.time())
    if submitted_at is None or allocated_at is None:
        asked = parse_scontrol_times(scontrol(job))
        submitted_at = submitted_at if submitted_at is not None else asked.submitted_at
        allocated_at = allocated_at if allocated_at is not None else asked.allocated_at
    return JobTimes(submitted_at=submitted_at, allocated_at=allocated_at)
