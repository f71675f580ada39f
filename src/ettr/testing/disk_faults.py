"""Disk-full and EIO trials of the checkpoint manager (`benchmarks/checkpoint_faults.py --disk-trials`).

* `FlakyStorage` wraps a `LocalStorage` and raises a transient `OSError(EIO)` on a scheduled number of
  reads (the next `fail_next` reads of any file), as a flaky network mount or a disk retrying a sector
  does. A restore must retry, not quarantine the intact newest checkpoint.
* `disk_full_trial` runs the toy job in this process on a real tmpfs mounted by the trial (root only;
  `can_mount_tmpfs`) sized to hold fewer checkpoints than `keep_last` asks for: saves must make room
  (the job finishes, its last save commits) or, on a disk too small for even one more, fail loudly
  (CHECKPOINT_ERROR naming ENOSPC, `finish` raising); a resume afterwards must load a checkpoint whose
  state equals the uninterrupted run's at that step.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from ettr.checkpoint.storage import LocalStorage


class FlakyStorage(LocalStorage):
    """A local root whose next `fail_next` reads raise a transient EIO (thread-safe counter)."""

    def __init__(self, root: str | os.PathLike[str], *, fail_next: int = 0) -> None:
        super().__init__(root)
        self.fail_next = fail_next
        self.failed = 0
        self._lock = threading.Lock()

    def _maybe_fail(self, rel: str) -> None:
        with self._lock:
            if self.fail_next <= 0:
                return
            self.fail_next -= 1
            self.failed += 1
        raise OSError(errno.EIO, "injected transient I/O error", self.path(rel))

    def read_bytes(self, rel: str) -> bytes:
        self._maybe_fail(rel)
        return super().read_bytes(rel)

    @contextlib.contextmanager
    def open_read(self, rel: str) -> Iterator[BinaryIO]:
        self._maybe_fail(rel)
        with super().open_read(rel) as stream:
            yield stream


def can_mount_tmpfs() -> bool:
    """Whether this process may mount a tmpfs (root, and a `mount` that works here)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    with tempfile.TemporaryDirectory(prefix="ettr-tmpfs-probe-") as probe:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", probe], capture_output=True, check=False
        )
        if done.returncode != 0:
            return False
        subprocess.run(["umount", probe], capture_output=True, check=False)
    return True


@contextlib.contextmanager
def tmpfs(size_bytes: int) -> Iterator[str]:
    """A fresh tmpfs of `size_bytes`, mounted for the block (root only)."""
    with tempfile.TemporaryDirectory(prefix="ettr-diskfull-") as mount_point:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", mount_point],
            check=True,
            capture_output=True,
        )
        try:
            yield mount_point
        finally:
            subprocess.run(["umount", "-l", mount_point], capture_output=True, check=False)


@dataclass(frozen=True)
class DiskTrialResult:
    """What one disk-full or EIO trial found."""

    kind: str
    finished: bool
    """The job's final save committed (`finish` returned)."""
    loud: bool
    """Every failed save was recorded as CHECKPOINT_ERROR naming its errno (ENOSPC), and a failed final
    save raised."""
    num_errors: int
    resumed_step: int | None
    newest_committed: int | None
    bad: bool
    stale: bool
    detail: str = ""


def _job(root: str, *, hidden: int, num_steps: int, keep_last: int) -> Any:
    from ettr.testing.toyjob import ToyJob

    return ToyJob(root=root, hidden=hidden, num_steps=num_steps, every_steps=1, keep_last=keep_last)


def checkpoint_bytes(*, hidden: int) -> int:
    """The size of one toy-job checkpoint of this width (measured by saving one)."""
    from ettr.recorder import NullRecorder
    from ettr.testing.toyjob import run

    with tempfile.TemporaryDirectory(prefix="ettr-size-") as root:
        run(_job(root, hidden=hidden, num_steps=1, keep_last=1), recorder=NullRecorder())
        step_dir = next(e for e in os.scandir(root) if e.is_dir())
        return sum(e.stat().st_size for e in os.scandir(step_dir.path))


def _ledger_facts(ledger: Any) -> tuple[list[str], int | None]:
    from ettr.events import EventKind

    events = ledger.read()
    errors = [str((e.data or {}).get("error", "")) for e in events if e.kind is EventKind.CHECKPOINT_ERROR]
    commits = [e.step for e in events if e.kind is EventKind.CHECKPOINT_COMMIT and e.step is not None]
    return errors, (max(commits) if commits else None)


def disk_full_trial(
    *, size_bytes: int, hidden: int, num_steps: int, keep_last: int, reference: dict[int, str]
) -> DiskTrialResult:
    """Run the toy job on a tmpfs of `size_bytes` (root only), then resume it and check what it gets."""
    from ettr.checkpoint.base import CheckpointError
    from ettr.ledger import MemoryLedger
    from ettr.recorder import Recorder
    from ettr.testing.toyjob import restore_digest, run

    with tmpfs(size_bytes) as mount_point:
        root = os.path.join(mount_point, "ckpt")
        ledger = MemoryLedger()
        recorder = Recorder(ledger)
        finished, raised = True, ""
        try:
            run(_job(root, hidden=hidden, num_steps=num_steps, keep_last=keep_last), recorder=recorder)
        except CheckpointError as exc:
            finished, raised = False, str(exc)
        recorder.flush()
        errors, newest = _ledger_facts(ledger)
        recorder.close()
        step, digest = restore_digest(root, hidden=hidden)
    loud = all("ENOSPC" in e for e in errors) and (finished or "ENOSPC" in raised)
    bad = step is not None and digest != reference.get(step)
    stale = newest is not None and (step is None or step < newest)
    detail = "" if not (bad or stale) else f"resumed {step}, newest commit {newest}"
    return DiskTrialResult("disk_full", finished, loud, len(errors), step, newest, bad, stale, detail)


def eio_trial(*, fail_reads: int, hidden: int, num_steps: int, reference: dict[int, str]) -> DiskTrialResult:
    """Run the toy job, then resume it through storage whose next `fail_reads` reads raise EIO: the
    resume must retry and load the newest checkpoint, intact."""
    from ettr.recorder import NullRecorder
    from ettr.testing.toyjob import restore_digest, run

    with tempfile.TemporaryDirectory(prefix="ettr-eio-") as workdir:
        root = os.path.join(workdir, "ckpt")
        run(_job(root, hidden=hidden, num_steps=num_steps, keep_last=2), recorder=NullRecorder())
        flaky = FlakyStorage(root, fail_next=fail_reads)
        step, digest = restore_digest(root, hidden=hidden, storage=flaky)
    bad = step is not None and digest != reference.get(step)
    stale = step != num_steps
    detail = "" if not (bad or stale) else f"resumed {step} of {num_steps} after {flaky.failed} EIO"
    return DiskTrialResult("eio", True, True, flaky.failed, step, num_steps, bad, stale, detail)
