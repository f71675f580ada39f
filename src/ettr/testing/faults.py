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

import itertools
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
from ettr.events import EventKind
from ettr.testing.toyjob import ToyJob, reference_digests, restore_from


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
    restored_from: str | None = None
    """Where the resume read the state: "memory" (the rank's memory copy), "storage", None (nothing)."""


def _child_main(job: ToyJob, run_dir: str, started: Any, ready_after_step: int) -> None:
    import logging
    import warnings

    import ettr.testing.toyjob as toyjob
    from ettr.ledger import open_ledger
    from ettr.recorder import Recorder

    # This process's and its persist process's messages (a killed trainer's checkpoint process complains
    # about the broken pipe) go to the trial's directory, not the terminal.
    os.makedirs(run_dir, exist_ok=True)
    log = os.open(os.path.join(run_dir, "stderr.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 2)
    os.close(log)
    logging.getLogger("ettr").setLevel(logging.ERROR)  # the skipped-checkpoint warnings are expected here
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    recorder = Recorder(open_ledger(run_dir), run_dir=run_dir)
    try:
        steps_here = itertools.count(1)  # steps of this process (a resumed job starts at a later global step)

        def on_step(step: int) -> None:
            if next(steps_here) >= ready_after_step:
                started.set()

        toyjob.run(job, recorder=recorder, on_step=on_step)
    finally:
        recorder.close()  # a multiprocessing child skips atexit: write what is queued before exiting


def _commits(run_dir: str) -> list[tuple[float, int]]:
    """(time, step) of every CHECKPOINT_COMMIT in a trial's ledger, oldest first."""
    from ettr.ledger import open_ledger

    if not (Path(run_dir) / "ledger.db").exists():
        return []
    ledger = open_ledger(run_dir, create=False)
    try:
        events = ledger.read()
    finally:
        ledger.close()
    return sorted(
        (e.ts, e.step) for e in events if e.kind is EventKind.CHECKPOINT_COMMIT and e.step is not None
    )


def _highest_commit(run_dir: str) -> int | None:
    steps = [step for _, step in _commits(run_dir)]
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
        self._context.set_forkserver_preload(["ettr.testing.toyjob", "ettr.recorder", "ettr.ledger"])
        self._reference = reference_digests(ToyJob(root="-", hidden=hidden, num_steps=num_steps))
        self._chain = 0
        self._root: Path | None = None
        self._progress = 0  # the step the current chain's job will resume from
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
        # In process mode the second save waits for the first persist, which starts DCP's checkpoint
        # process: kills count from when that is up. (Not a daemon: that mode starts a child of its own.)
        ready_after_step = 2 if self.mode == "process" else 1
        process = self._context.Process(
            target=_child_main, args=(job, str(run_dir), started, ready_after_step), daemon=False
        )
        process.start()
        return process, started

    def calibrate(self) -> float:
        """Run the job once without faults; returns (and remembers) how long it trains and persists after
        it is ready: from then to its last commit (its shutdown afterwards is not what is under test)."""
        root = self.workdir / "calibrate"
        shutil.rmtree(root, ignore_errors=True)
        process, started = self._start(self._job(root / "ckpt"), root)
        started.wait(timeout=300)
        ready_ts = time.time()
        process.join(timeout=300)
        if process.exitcode != 0:
            raise RuntimeError(f"the calibration run failed with exit status {process.exitcode}")
        commits = _commits(str(root))
        self.full_run_s = max(0.05, (commits[-1][0] if commits else time.time()) - ready_ts)
        shutil.rmtree(root, ignore_errors=True)
        return self.full_run_s

    def _trial_root(self) -> Path:
        if self._root is None:
            self._chain += 1
            self._root = self.workdir / f"chain{self._chain:03d}"
            self._progress = 0
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
            full_run_s = self.full_run_s or self.calibrate()
            # kill somewhere in what is left of the job (a resumed job has fewer steps to go)
            horizon_s = full_run_s * max(0.1, (self.num_steps - self._progress) / self.num_steps)
            delay_s = self._rng.uniform(0.0, horizon_s)
            kill = f"random {delay_s:.3f}s"
            process, started = self._start(self._job(root / "ckpt"), root)
            started.wait(timeout=120)  # start-up is not what is under test
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
        source = None
        try:
            step, digest, source = restore_from(str(root / "ckpt"), hidden=self.hidden)
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
        self._progress = step or 0
        if process.exitcode == 0 or bad or step == self.num_steps:
            self._root = None  # this chain is done (or broken): start the next trial afresh
        return TrialResult(
            index, kill, process.exitcode, num_incomplete, step, committed, bad, stale, detail, source
        )
