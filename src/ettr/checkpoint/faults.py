"""SIGKILL trials: kill the toy job at random moments or at persist points, then check what a resume gets.

Each trial runs `toyjob` in a real child process (forked from a forkserver that has torch imported, so a
trial costs milliseconds to start), kills it with SIGKILL, and then restores the checkpoint root exactly as
the next attempt would. The resume is *bad* if restoring raises, or if the restored state differs from the
state an uninterrupted run had after that step (the reference digests) — i.e. an incomplete or corrupt
checkpoint was loaded. It is *stale* if it is older than the newest step the ledger says was committed (a
commit event that lied). Trials chain on one root until the job completes, like a job that fails again
and again, then start afresh.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ettr.checkpoint.commit import list_checkpoints
from ettr.checkpoint.storage import LocalStorage
from ettr.checkpoint.toyjob import ToyJob, reference_digests, restore_digest
from ettr.events import EventKind


@dataclass(frozen=True)
class TrialResult:
    """What one SIGKILL trial did and found."""

    index: int
    kill: str
    """`random <seconds>s` or the persist point (`manifest_partial`, ...)."""
    exit_code: int | None
    """The child's exit status (-9: SIGKILL; 0: it finished before the kill)."""
    num_incomplete: int
    """Checkpoint directories without a manifest when the child died (> 0: killed mid-persist)."""
    resumed_step: int | None
    committed_step: int | None
    """Highest CHECKPOINT_COMMIT step in the trial's ledger."""
    bad: bool
    stale: bool
    detail: str


def _child_main(job: ToyJob, run_dir: str, started: Any) -> None:
    import logging
    import warnings

    import ettr.checkpoint.toyjob as toyjob
    from ettr.ledger import open_ledger
    from ettr.recorder import Recorder

    logging.getLogger("ettr").setLevel(logging.ERROR)  # the skipped-checkpoint warnings are expected here
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    recorder = Recorder(open_ledger(run_dir), run_dir=run_dir)
    toyjob.run(job, recorder=recorder, on_step=lambda step: started.set())


def _highest_commit(run_dir: str) -> int | None:
    from ettr.ledger import open_ledger

    path = Path(run_dir) / "ledger.db"
    if not path.exists():
        return None
    ledger = open_ledger(run_dir, create=False)
    try:
        steps = [
            e.step for e in ledger.read() if e.kind is EventKind.CHECKPOINT_COMMIT and e.step is not None
        ]
    finally:
        ledger.close()
    return max(steps) if steps else None


class TrialRunner:
    """Runs SIGKILL trials of the toy job under `workdir` (which it owns).

    Args:
        workdir: scratch directory for checkpoint roots and ledgers.
        hidden: toy-model width (the checkpoint holds ~3 * hidden^2 floats).
        num_steps: steps of one whole job.
        every_steps: save interval; 1 keeps a persist in flight almost all the time.
        mode: persist mode of the child's checkpoint manager.
        seed: seeds the trial schedule (kill times, points).
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        *,
        hidden: int = 384,
        num_steps: int = 24,
        every_steps: int = 1,
        mode: str = "thread",
        seed: int = 0,
    ) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.hidden, self.num_steps, self.every_steps, self.mode = hidden, num_steps, every_steps, mode
        self._rng = random.Random(seed)
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(["ettr.checkpoint.toyjob", "ettr.recorder", "ettr.ledger"])
        self._reference = reference_digests(ToyJob(root="-", hidden=hidden, num_steps=num_steps))
        self._chain = 0
        self._root: Path | None = None
        self.full_run_s: float | None = None
        """Wall time of one uninterrupted child run (measured by `calibrate`)."""

    def _job(self, root: Path, **faults: Any) -> ToyJob:
        return ToyJob(
            root=str(root),
            hidden=self.hidden,
            num_steps=self.num_steps,
            every_steps=self.every_steps,
            mode=self.mode,
            keep_last=2,
            **faults,
        )

    def _start(self, job: ToyJob, run_dir: Path) -> tuple[Any, Any]:
        started = self._context.Event()
        process = self._context.Process(target=_child_main, args=(job, str(run_dir), started), daemon=True)
        process.start()
        return process, started

    def calibrate(self) -> float:
        """Run the job once without faults; returns (and remembers) its wall time after the first step."""
        root = self.workdir / "calibrate"
        shutil.rmtree(root, ignore_errors=True)
        process, started = self._start(self._job(root / "ckpt"), root)
        started.wait(timeout=300)
        begin = time.monotonic()
        process.join(timeout=300)
        self.full_run_s = time.monotonic() - begin
        if process.exitcode != 0:
            raise RuntimeError(f"the calibration run failed with exit status {process.exitcode}")
        shutil.rmtree(root, ignore_errors=True)
        return self.full_run_s

    def _trial_root(self) -> Path:
        if self._root is None:
            self._chain += 1
            self._root = self.workdir / f"chain{self._chain:03d}"
            shutil.rmtree(self._root, ignore_errors=True)
            self._root.mkdir(parents=True)
        return self._root

    def run_trial(self, index: int, *, point: str | None = None, nth_save: int = 1) -> TrialResult:
        """One trial: SIGKILL at `point` during the `nth_save`-th save, or (None) at a random moment.

        A point trial starts a fresh job (so that the `nth_save`-th save happens); a random one continues
        the current chain.
        """
        if point is not None:
            self._root = None
        root = self._trial_root()
        if point is None:
            horizon_s = self.full_run_s or self.calibrate()
            delay_s = self._rng.uniform(0.0, horizon_s)
            kill = f"random {delay_s:.3f}s"
            process, started = self._start(self._job(root / "ckpt"), root)
            started.wait(timeout=120)  # after the first step: start-up is not what is under test
            time.sleep(delay_s)
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
        else:
            kill = point
            process, _ = self._start(self._job(root / "ckpt", kill_at=point, kill_on_save=nth_save), root)
        process.join(timeout=300)
        if process.is_alive():  # pragma: no cover - a hung child is itself a failure
            os.kill(process.pid, signal.SIGKILL)
            process.join()
        storage = LocalStorage(root / "ckpt")
        num_incomplete = sum(1 for c in list_checkpoints(storage) if not c.has_manifest)
        committed = _highest_commit(str(root))
        try:
            step, digest = restore_digest(str(root / "ckpt"), hidden=self.hidden)
        except BaseException as exc:  # noqa: BLE001 - a resume that raises is exactly what we count
            step, digest, detail = None, None, f"restore raised {type(exc).__name__}: {exc}"
            bad = True
        else:
            expected = self._reference.get(step if step is not None else 0)
            bad = step is not None and digest != expected
            detail = f"state differs from the reference at step {step}" if bad else ""
        stale = committed is not None and (step is None or step < committed)
        if stale and not detail:
            detail = f"resumed from {step} though the ledger says step {committed} committed"
        if process.exitcode == 0 or bad or step == self.num_steps:
            self._root = None  # this chain is done (or broken): start the next trial afresh
        return TrialResult(index, kill, process.exitcode, num_incomplete, step, committed, bad, stale, detail)
