"""A report's figures as TensorBoard scalars, tagged the way Google's ml-goodput-measurement tags its own.

`scalars(report)` is pure (an `EttReport` in, `Scalar`s out); `write_tensorboard` writes them as event
files through `torch.utils.tensorboard.SummaryWriter` (imported only here, when asked for: TensorBoard is an
optional extra: `pip install tensorboard`).

Tags (docs/exports.md has the table):

- ``goodput/goodput`` (ETT%) and ``badput/<bucket>`` (each lost-time bucket, % of wall time): the scheme of
  ml-goodput-measurement's monitor (``goodput/goodput``, ``badput/<badput type>``, step = the job's last
  step), with ettr's closed set of buckets as the badput types.
- ``ettr/...``: the rest of the report: idleness and failure %, wall and effective seconds, each bucket in
  seconds, TTS, mean TTR, number of failures (all at the job's last step), and ``ettr/ttr_s`` with one point
  per recovered failure (step 1, 2, ...).
- ``ettr/attempt/...``: one series per figure with one point per attempt (step = attempt index): its
  duration, ETT% of its share of the wall time, buckets in seconds, lost steps, last and resumed-from steps.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ettr.accounting import EttReport
from ettr.atomic import atomic_write
from ettr.errors import UsageError
from ettr.events import Bucket
from ettr.report.labels import run_labels


@dataclass(frozen=True, slots=True, kw_only=True)
class Scalar:
    """One TensorBoard scalar point."""

    tag: str
    value: float
    step: int
    wall_time: float
    """Unix seconds: when the figure was true (the job's end, the attempt's end, the recovery)."""


def scalars(report: EttReport) -> list[Scalar]:
    """Every scalar of `report`, in the order they are written (see the module docstring for the tags)."""
    step = max((a.last_step for a in report.attempts if a.last_step is not None), default=0)
    end = report.wall_end_ts

    def job(tag: str, value: float) -> Scalar:
        return Scalar(tag=tag, value=float(value), step=step, wall_time=end)

    # no goodput scalar when no training step was seen (`ett_unknown`): 0 would plot a wrong number
    out = [] if report.ett_unknown is not None else [job("goodput/goodput", report.ett_pct)]
    out += [
        job(f"badput/{b.value}", report.bucket_pct(b)) for b in Bucket if b is not Bucket.EFFECTIVE_TRAINING
    ]
    out += [
        job("ettr/idleness_pct", report.idleness_pct),
        job("ettr/failure_pct", report.failure_pct),
        job("ettr/wall_s", report.wall_s),
        job("ettr/effective_training_s", report.effective_training_s),
        job("ettr/num_failures", report.num_failures),
    ]
    out += [job(f"ettr/buckets_s/{b.value}", report.buckets_s[b]) for b in Bucket]
    if report.tts_s is not None:
        out.append(job("ettr/tts_s", report.tts_s))
    if report.mean_ttr_s is not None:
        out.append(job("ettr/mean_ttr_s", report.mean_ttr_s))
    for n, ttr_s in enumerate(report.ttr_s, start=1):
        out.append(Scalar(tag="ettr/ttr_s", value=ttr_s, step=n, wall_time=end))
    for a in report.attempts:

        def point(tag: str, value: float, a_step: int = a.index, ts: float = a.end_ts) -> Scalar:
            return Scalar(tag=f"ettr/attempt/{tag}", value=float(value), step=a_step, wall_time=ts)

        share_s = sum(a.buckets_s.values())
        effective_pct = a.buckets_s[Bucket.EFFECTIVE_TRAINING] / share_s * 100.0 if share_s > 0 else 0.0
        out += [point("duration_s", a.duration_s), point("ett_pct", effective_pct)]
        out += [point("lost_steps", a.lost_steps), point("num_steps", a.num_steps)]
        if a.last_step is not None:
            out.append(point("last_step", a.last_step))
        if a.resumed_from_step is not None:
            out.append(point("resumed_from_step", a.resumed_from_step))
        out += [point(f"buckets_s/{b.value}", a.buckets_s[b]) for b in Bucket]
    return out


def require_tensorboard() -> None:
    """Raise `UsageError` (one line) unless `torch.utils.tensorboard` can be imported."""
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        raise UsageError(
            "ettr report: --tensorboard needs the tensorboard package (install it: pip install tensorboard)"
        ) from None


def run_logdirs(logdir: str | os.PathLike[str], labels: Sequence[str]) -> list[Path]:
    """Where each run's event file goes: `logdir` itself for one run; for several, one directory per run
    (TensorBoard shows each as a run) at `labels` (`report.labels.run_labels` of the run directories: `a/job`
    is the nested `logdir/a/job`), a repeated one suffixed `-2`, `-3`..."""
    root = Path(logdir)
    if len(labels) == 1:
        return [root]
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        rel = "/".join(p for p in (_safe(part) for part in label.split("/")) if p) or "run"
        seen[rel] = seen.get(rel, 0) + 1
        out.append(root / (rel if seen[rel] == 1 else f"{rel}-{seen[rel]}"))
    return out


def write_runs(
    reports: Sequence[EttReport],
    run_dirs: Sequence[str | os.PathLike[str]],
    logdir: str | os.PathLike[str],
    *,
    asked: Sequence[str | os.PathLike[str]] | None = None,
) -> list[Path]:
    """What `ettr report RUN_DIR... --tensorboard DIR` writes: each report's event file in its
    `run_logdirs` directory (DIR itself for one run). `asked`: every run directory asked for, of which
    `run_dirs` could be read: each keeps its place among all of them, so that one that could not be read
    leaves the others where a later run puts them (before, the one left went into DIR itself, and a later
    run with both mixed the two layouts). Reports with no run directory (a ledger's jobs) are named by their
    job ids. Returns the files written."""
    return [
        write_tensorboard(r, d)
        for r, d in zip(reports, _places(reports, run_dirs, logdir, asked), strict=True)
    ]


def _places(
    reports: Sequence[EttReport],
    run_dirs: Sequence[str | os.PathLike[str]],
    logdir: str | os.PathLike[str],
    asked: Sequence[str | os.PathLike[str]] | None,
) -> list[Path]:
    if not run_dirs:
        return run_logdirs(logdir, [r.job_id for r in reports])
    every = [os.fspath(d) for d in (asked or run_dirs)]
    places = run_logdirs(logdir, run_labels(every))
    chosen, i = [], 0
    for run_dir in [os.fspath(d) for d in run_dirs]:  # read in the order asked: a subsequence of `every`
        while i < len(every) and every[i] != run_dir:
            i += 1
        if i == len(every):  # not among those asked after all: placed among the ones read only
            return run_logdirs(logdir, run_labels(run_dirs))
        chosen.append(places[i])
        i += 1
    return chosen


def write_tensorboard(report: EttReport, logdir: str | os.PathLike[str]) -> Path:
    """Write `scalars(report)` as one TensorBoard event file in `logdir` (created if missing); return its path.

    The file's name is fixed by the job (its id and start), so exporting the same job again replaces its
    file instead of adding a second, conflicting one. The file is committed whole
    (`ettr.atomic.atomic_write`). Raises `UsageError` when tensorboard is missing or `logdir` unwritable.
    """
    require_tensorboard()
    from torch.utils.tensorboard import SummaryWriter

    target_dir = Path(logdir)
    name = f"events.out.tfevents.{int(report.wall_start_ts)}.ettr.{_safe(report.job_id) or 'job'}"
    try:
        target_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="ettr-tb-") as scratch:  # never a half file in logdir
            writer = SummaryWriter(log_dir=scratch)
            try:
                for s in scalars(report):
                    writer.add_scalar(s.tag, s.value, global_step=s.step, walltime=s.wall_time)
            finally:
                writer.close()
            (written,) = Path(scratch).glob("events.out.tfevents.*")
            atomic_write(target_dir / name, written.read_bytes())
    except OSError as exc:
        raise UsageError(
            f"{target_dir}: cannot write the TensorBoard scalars ({exc.strerror or exc})"
        ) from None
    return target_dir / name


def _safe(name: str) -> str:
    """`name` as one path component: letters, digits, '.', '_' and '-' kept, anything else as '_'."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name).strip(".")
