"""`ettr demo`: the reference DLRM job run twice with the same failures — once as a plain trainer runs it
(the baseline), once with ettr's recovery features (the optimized run) — then both reports side by side in
the terminal and in pictures (`DIR/report.html`). See docs/demo.md.

    ettr demo [--quick] [--out DIR] [--one-after-the-other]     # DIR defaults to runs/demo

Each side is `ettr run -- torchrun --nproc-per-node 2 .../ettr/demo/_examples/dlrm/train.py ...` (the
repository's `examples/dlrm`, shipped in the package) into `DIR/<side>`:
attempt 0 is preempted at one step (`--inject preempt@step=M`: SIGTERM to the whole job; `ettr run` exits
143 and the demo requeues the job, as a scheduler would), attempt 1 crashes at a later step
(`--inject crash@step=N,attempt=1`; the supervisor restarts it), attempt 2 completes. Every number printed is read back from the two run
directories.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO, Literal

from ettr.closing import live_supervisor
from ettr.constants import EXIT_PREEMPTED
from ettr.demo.cpu_meter import CpuSample, sample
from ettr.demo.explain import explain
from ettr.demo.progress import JobState, ProgressDisplay, read_events
from ettr.errors import UsageError
from ettr.procs import set_parent_death_signal
from ettr.run_env import (
    AGENT_ENV,
    COMPILE_RESTORE_ENV,
    COMPILE_SETTLE_S_ENV,
    COMPILE_STORE_ENV,
    ENV_PREFIX,
)
from ettr.supervisor.agent import FORCE_TORCHRUN
from ettr.supervisor.standby import STANDBY_ENV
from ettr.untrusted import remove_tree

PREEMPTED_EXIT_STATUS = EXIT_PREEMPTED
"""`ettr run`'s status for a preempted job: the scheduler (here, the demo) requeues it."""

SIDES = ("baseline", "optimized")


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What both runs train, and where they fail. Both sides get exactly this."""

    steps: int
    """Train until this global step."""
    ckpt_every: int
    """Checkpoint every this many steps (both sides: the same fixed interval)."""
    num_rows: int
    """Rows per embedding table: sets the checkpoint's size (12 tables x rows x 32 floats, plus Adagrad)."""
    compile: bool
    """torch.compile the dense tower (in fresh local caches on every attempt)."""
    worker_startup_s: float
    """Seconds a loader worker takes before its first batch."""
    preempt_step: int
    """Attempt 0 is preempted (SIGTERM to the whole job) when this step completes."""
    crash_step: int
    """Attempt 1 crashes (exit status 1) when this step completes."""
    publish: bool
    """Publish the trained model at the end (each side its own way)."""

    def __post_init__(self) -> None:
        if not 0 < self.ckpt_every < self.preempt_step < self.crash_step < self.steps:
            raise ValueError(
                f"need 0 < ckpt_every ({self.ckpt_every}) < preempt_step ({self.preempt_step}) < crash_step "
                f"({self.crash_step}) < steps ({self.steps})"
            )
        # A failure right after a checkpoint would lose nothing on either side: no story to tell.
        for name in ("preempt_step", "crash_step"):
            if getattr(self, name) % self.ckpt_every == 0:
                raise ValueError(f"{name} must not be a multiple of ckpt_every ({self.ckpt_every})")
        if self.num_rows < 1 or self.worker_startup_s < 0:
            raise ValueError("num_rows must be >= 1 and worker_startup_s >= 0")

    def injections(self) -> list[str]:
        """The `--inject` specs (rank 0; attempts count on across requeues, so each fires once)."""
        return [f"preempt@step={self.preempt_step},attempt=0", f"crash@step={self.crash_step},attempt=1"]

    def describe(self) -> str:
        return (
            f"DLRM on 2 ranks, {self.steps} steps, {'compiled' if self.compile else 'eager'} ({self.num_rows} "
            f"rows x 12 tables); checkpoints: baseline every {self.ckpt_every} steps (sync), optimized `auto` "
            f"(async; prior {AUTO_FAILURES_PER_DAY:g} failures/day worth {AUTO_PRIOR_DAYS * 86_400:g} s, then "
            "the ledger's); failures: preempted at step "
            f"{self.preempt_step} (attempt 0), crash at step {self.crash_step} (attempt 1)"
            + ("; then publishing" if self.publish else "")
        )


QUICK = Workload(
    steps=1200,
    ckpt_every=400,
    num_rows=100_000,
    compile=False,
    worker_startup_s=5.0,
    preempt_step=700,
    crash_step=1100,
    publish=False,
)
"""`--quick` (the test suite runs it): eager and without publishing, so that six launches fit in about
three minutes here."""

DEFAULT = Workload(
    steps=2400,
    ckpt_every=500,
    num_rows=50_000,
    compile=True,
    worker_startup_s=2.5,
    preempt_step=800,
    crash_step=1700,
    publish=True,
)
"""The full demo: the dense tower compiled; ~100 s of training per side (~42 ms a step here, both ranks on
the two cores), so that a healthy job is mostly training and each start-up is a small part of it, as in a
job that trains for hours. The failures come in the first 1,700 steps; the last 700 are healthy training
on both sides. The whole demo takes about 7.5 minutes here."""

AUTO_FAILURES_PER_DAY = 1440.0
"""The `auto` interval's prior on the optimized side: a failure a minute, the rate this demo injects (two in
a job of two to three minutes), as a fleet's history of jobs like this one would give it."""
AUTO_PRIOR_DAYS = 60.0 / 86_400
"""...worth a minute of observation, so the failures the job's own ledger records soon outweigh it."""


@dataclass(frozen=True, kw_only=True)
class Side:
    """How one run trains the workload."""

    name: str
    """`baseline` or `optimized`: the run directory's name under DIR and the job id's suffix."""
    ckpt_mode: str
    """`sync` (torch.save per rank while training waits) or `ettr` (async; saves on SIGTERM, exits 143)."""
    overlap_startup: bool
    """Start the loader workers before the model is built, so their warm-up hides behind it."""
    compile_store: Literal["save", "restore"]
    """ettr's compile store: `restore` (artifacts of earlier jobs of the same model are restored, and what
    this job compiles is saved) or `save` (every attempt compiles cold, as without a store; what it
    compiles is saved for the jobs after it, as every job of a fleet leaves its artifacts)."""
    publish: str
    """Publishing the trained model at the end: `inside` the training job (it builds the inference
    artifact before it ends) or `standalone` (it writes the anchor and ends; `ettr publish` builds the
    artifact afterwards, as a job of its own)."""
    auto_interval: bool = False
    """Checkpoint when ettr's `auto` interval says (measured save cost, failure rate from the ledger)
    instead of every `Workload.ckpt_every` steps."""
    plan_cache: bool = False
    """Compute the TorchRec sharding plan once (attempt 0) and read it back in every later attempt."""
    fast_exit: bool = False
    """End the processes once the final state is committed, without tearing down what is no longer needed."""
    warm_restart: bool = False
    """Restart through ettr's own single-node agent, its workers forked from its zygote (interpreter and
    imports done once per node, ahead; warm standby workers where it cannot fork); else every attempt
    relaunches the real torchrun and its workers cold."""
    inplace: bool = False
    """Train under `ettr.resilient` (needs `warm_restart`: ettr's agent): a rank's crash is recovered in
    place, the surviving rank keeps its process and re-forms the group with the crashed rank's replacement,
    both restoring the last commit from memory (docs/inplace.md); where that cannot be done the process
    restart follows."""
    memory_tier: bool = False
    """Memory-tier commits (`--memory-interval auto`): between storage commits, every rank copies its state to
    shared memory, so that the in-place recovery loses at most that short interval (docs/checkpointing.md).
    Off on both sides: here a memory-tier save blocks as long as a storage save's copy, and in four quick
    demos it added 1.3-2.5 s of blocking for 0-1.3 s less redone (docs/demo.md, "Memory-tier commits")."""

    def train_args(self, *, publish: bool, work_dir: Path) -> list[str]:
        args = ["--ckpt-mode", self.ckpt_mode]
        if self.auto_interval:
            args += ["--ckpt-auto", "--failures-per-day", f"{AUTO_FAILURES_PER_DAY:g}"]
            args += ["--failure-prior-days", f"{AUTO_PRIOR_DAYS:.9g}"]
        args.append("--overlap-startup" if self.overlap_startup else "--no-overlap-startup")
        if self.plan_cache:
            args += ["--plan-cache", str(work_dir / "plan-cache")]
        if self.fast_exit:
            args.append("--fast-exit")
        if self.inplace:
            args.append("--inplace")
        if self.memory_tier:
            args += ["--memory-interval", "auto"]
        return [*args, "--publish", self.publish if publish else "none"]


BASELINE = Side(
    name="baseline", ckpt_mode="sync", overlap_startup=False, compile_store="save", publish="inside"
)
"""The plain job. It starts first, and leaves its compile artifacts in the store: it is the optimized
side's earlier job of the same model."""
OPTIMIZED = Side(
    name="optimized",
    ckpt_mode="ettr",
    overlap_startup=True,
    compile_store="restore",
    publish="standalone",
    auto_interval=True,
    plan_cache=True,
    fast_exit=True,
    warm_restart=True,
    inplace=True,
)


def find_train_script() -> Path:
    """The reference job's `train.py`, shipped inside the package (`ettr/demo/_examples/dlrm`, the repository's
    `examples/dlrm`), so that any install of ettr finds it: a wheel, or a source checkout."""
    import ettr.demo._examples

    script = Path(ettr.demo._examples.__file__).resolve().parent / "dlrm" / "train.py"
    if not script.is_file():
        raise UsageError(
            f"ettr demo: the reference job is missing from this install of ettr ({script}); reinstall ettr "
            "(pip install ettr, or make demo in a source checkout)"
        )
    return script


def _torchrun() -> list[str]:
    beside = Path(sys.executable).with_name("torchrun")
    return [str(beside)] if beside.is_file() else [sys.executable, "-m", "torch.distributed.run"]


@dataclass(frozen=True, kw_only=True)
class Job:
    """One side's run: its paths, command line and environment."""

    side: Side
    run_dir: Path
    work_dir: Path
    """Checkpoints, per-attempt compile caches, the plan cache and the job's log (beside the run dir)."""
    store_dir: Path | None = None
    """ettr's compile store: the baseline saves into it, the optimized side restores from it; kept between
    demos."""
    cache_root: Path | None = None
    """The per-attempt inductor caches' root (`--compile-cache`): `work_dir/compile-cache`, or a private
    directory under the system's temp directory where that path is too long for the loader's sockets
    (`cache_root_for`)."""

    @property
    def compile_cache(self) -> Path:
        return self.cache_root or self.work_dir / "compile-cache"

    @property
    def log_path(self) -> Path:
        return self.work_dir / "job.log"

    @property
    def publish_queue(self) -> Path:
        return self.work_dir / "publish" / "queue"

    def command(self, workload: Workload, script: Path) -> list[str]:
        """`ettr run ... -- torchrun ... train.py ...` of this side, with the workload's failures."""
        run = [sys.executable, "-m", "ettr.cli", "run", "--run-dir", str(self.run_dir)]
        run += ["--job-id", f"demo-{self.side.name}", "--max-restarts", "3", "--hang-timeout", "180"]
        for spec in workload.injections():
            run += ["--inject", spec]
        train = [str(script), "--steps", str(workload.steps), "--ckpt-every", str(workload.ckpt_every)]
        return self._command(run, train, workload, script)

    def _command(self, run: list[str], train: list[str], workload: Workload, script: Path) -> list[str]:
        train += ["--ckpt-dir", str(self.work_dir / "checkpoints"), "--num-rows", str(workload.num_rows)]
        train += ["--worker-startup-s", str(workload.worker_startup_s), "--log-every", "50"]
        train += ["--publish-dir", str(self.work_dir / "publish")]
        if workload.compile:  # fresh local inductor caches on every attempt, as on a newly allocated machine
            train += ["--compile", "--compile-cache", str(self.compile_cache)]
        else:
            train += ["--no-compile"]
        return [
            *run,
            "--",
            *_torchrun(),
            "--nproc-per-node",
            "2",
            *train,
            *self.side.train_args(publish=workload.publish, work_dir=self.work_dir),
        ]

    def environment(self) -> dict[str, str]:
        # Nothing of an enclosing ettr run leaks in (the demo itself may run under one).
        env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
        env["PYTHONUNBUFFERED"] = "1"
        env[COMPILE_STORE_ENV] = str(self.store_dir or self.work_dir / "compile-store")
        env[COMPILE_SETTLE_S_ENV] = "1"  # store the artifacts soon after the first compile
        if self.side.compile_store == "save":
            env[COMPILE_RESTORE_ENV] = "0"  # cold in every attempt; saved for the jobs after it
        if not self.side.warm_restart:  # a plain job: the real torchrun, cold on every attempt
            env[AGENT_ENV] = FORCE_TORCHRUN
            env[STANDBY_ENV] = "0"
        return env


SOCKET_TMP_MAX = 72
"""examples/dlrm `SOCKET_TMP_MAX` (its train.py refuses a `--compile-cache` past it): the longest temp directory
multiprocessing's AF_UNIX sockets fit under, which that option moves TMPDIR beneath."""


def cache_root_for(work_dir: Path, side: str) -> Path | None:
    """None (`work_dir/compile-cache`) where an attempt's temp directory under it fits the loader's sockets
    (examples/dlrm `SOCKET_TMP_MAX`: 72 bytes; a demo's `--out` of more than ~20 characters does not), else a
    new private directory under the system's temp directory (the demo removes it however it ends)."""
    longest = work_dir.resolve() / "compile-cache" / "attempt-999-4194304" / "tmp"
    if len(os.fsencode(longest)) <= SOCKET_TMP_MAX:
        return None
    return Path(tempfile.mkdtemp(prefix=f"ettr-demo-{side}-"))


def prepare(out: Path) -> list[Job]:
    """The two jobs under `out`, after removing what an earlier demo left there (and nothing else: the
    compile store `out/compile-store` is kept for the next demo)."""
    store = out / "compile-store"
    jobs = [
        Job(side=s, run_dir=out / s.name, work_dir=out / f"{s.name}-work", store_dir=store)
        for s in (BASELINE, OPTIMIZED)
    ]
    for job in jobs:
        for path in (job.run_dir, job.work_dir):
            # rmtree refuses a symlink (quietly, with ignore_errors) and the demo then ran in the directory
            # it points to: `baseline -> another run` got the demo's job appended to that run's books.
            if path.is_symlink():
                raise UsageError(
                    f"ettr demo: {path} is a symlink (the demo replaces it); choose another --out"
                )
        if job.run_dir.is_dir() and any(job.run_dir.iterdir()) and not (job.run_dir / "ledger.db").is_file():
            raise UsageError(f"ettr demo: {job.run_dir} is not an ettr run directory; choose another --out")
        # A supervisor of an earlier demo still running there would write into the new run's books.
        if (job.run_dir / "ledger.db").is_file() and (pid := live_supervisor(read_events(job.run_dir))):
            raise UsageError(
                f"ettr demo: {job.run_dir} is still in use by a running `ettr run` (pid {pid}); stop it or "
                "wait for it, or choose another --out"
            )
    try:
        for job in jobs:
            for path in (job.run_dir, job.work_dir):
                # not shutil.rmtree, which recurses once per level: a folder nested 1,200 deep in an earlier
                # run directory there raised RecursionError out of `ettr demo` (a traceback, status 1)
                with contextlib.suppress(FileNotFoundError):
                    remove_tree(path)
            job.work_dir.mkdir(parents=True)
    except OSError as exc:
        raise UsageError(f"ettr demo: cannot use {out} ({exc.strerror or exc})") from None
    return jobs


def start_child(
    command: Sequence[str], log: BinaryIO, env: dict[str, str], *, cpus: frozenset[int] | None = None
) -> subprocess.Popen[bytes]:
    """Start one of the demo's jobs (`ettr run`, `ettr publish`), its output into `log`, on `cpus` only when
    given (every process it starts inherits that). It gets SIGTERM when the demo dies, however (a SIGKILL
    too): its supervisor then stops the job and closes its books, as at a preemption. Before, a killed demo
    left its jobs training, re-parented to init, for as long as they ran."""
    parent = os.getpid()

    def in_child() -> None:  # between fork and exec
        set_parent_death_signal(signal.SIGTERM)
        if os.getppid() != parent:  # the demo died before the line above took effect
            os.kill(os.getpid(), signal.SIGTERM)
        if cpus:
            os.sched_setaffinity(0, cpus)

    return subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=in_child)


def split_cpus(cpus: Collection[int]) -> tuple[frozenset[int], frozenset[int]] | None:
    """Two disjoint halves of equal size of `cpus` (the baseline's and the optimized side's; an odd one out
    goes unused), or None with fewer than two CPUs."""
    ordered = sorted(cpus)
    half = len(ordered) // 2
    if half == 0:
        return None
    return frozenset(ordered[:half]), frozenset(ordered[half : 2 * half])


def usable_cpus() -> frozenset[int] | None:
    """The CPUs this process may run on (None where the platform cannot say or pin: then the sides run one
    after the other)."""
    if not (hasattr(os, "sched_getaffinity") and hasattr(os, "sched_setaffinity")):
        return None
    return frozenset(os.sched_getaffinity(0))


class JobRun:
    """One side's run in progress: launches `ettr run`, and launches it again on the same run directory
    after a preemption (exit 143), as a scheduler requeues a job. `tick` moves it on; it never blocks."""

    def __init__(
        self, job: Job, workload: Workload, script: Path, *, cpus: frozenset[int] | None = None
    ) -> None:
        self.job = job
        self.workload = workload
        self.cpus = cpus
        """The CPUs its processes are kept on (None: any)."""
        self.command = job.command(workload, script)
        self.total_steps = workload.steps
        self.status: int | None = None
        """`ettr run`'s last exit status once the job is over (None while it runs)."""
        self._proc: subprocess.Popen[bytes] | None = None
        self._num_launches = 0
        self._began = 0.0
        self.cpu_samples: list[CpuSample] = []
        """Side by side (`cpus` given): its CPUs and its processes, looked at about once a second."""

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self._began

    def launch(self) -> None:
        if self._num_launches == 0:
            self._began = time.monotonic()
        self._num_launches += 1
        with open(self.job.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.command)}\n".encode())
            log.flush()
            self._proc = start_child(self.command, log, self.job.environment(), cpus=self.cpus)

    def look_at_cpus(self) -> None:
        """Sample how busy its CPUs are and what its own processes used (side by side only)."""
        if self.cpus is None:
            return
        running = self._proc is not None and self._proc.poll() is None
        root = self._proc.pid if running and self._proc is not None else None
        self.cpu_samples.append(sample(time.time(), self.cpus, root))

    def tick(self, display: ProgressDisplay) -> None:
        """Look at the ledger and the process once: show progress, requeue, or finish."""
        if self._proc is None or self.status is not None:
            return
        returncode = self._proc.poll()
        name = self.job.side.name
        # One preemption is planned; a job preempted again and again is given up after three launches. It is
        # requeued before the ledger is read: a read of a large ledger under load took seconds of the job's
        # wall time between its preemption and its requeue (job_end to the next supervisor_start 2.85 s in a
        # demo at load 13-22, ~0.9 s for `ettr run` itself).
        if returncode == PREEMPTED_EXIT_STATUS and self._num_launches < 3:
            self.launch()
            display.note(f"{name}: preempted (ettr run exited 143); requeueing the job")
            return
        self.look_at_cpus()
        state = JobState.of(read_events(self.job.run_dir))
        display.show(self.job.side.name, state, self.total_steps, self.elapsed_s)
        if returncode is None:
            return
        self.status = returncode
        display.done(name)
        display.note(
            f"{name}: ettr run exited {returncode} after {self.elapsed_s:.0f} s (log: {self.job.log_path})"
        )

    @property
    def exited(self) -> bool:
        """The `ettr run` launched has exited and `tick` has not looked at it yet."""
        return self._proc is not None and self.status is None and self._proc.poll() is not None

    def stop(self) -> None:
        """Interrupted: let the supervisor stop the job and close its books."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(timeout=60)


BULK = ("checkpoints", "compile-cache", "compile-store", "publish/anchors", "publish/queue/artifacts")
"""What the demo removes from the work directories at the end: checkpoints, anchors and artifacts are
hundreds of MB each, every attempt's inductor caches ~150 MB of precompiled headers. Logs, publish
records and the run directories stay."""


def drop_bulk(jobs: Sequence[Job]) -> int:
    """Remove `BULK` from the jobs' work directories; returns the bytes freed."""
    freed = 0
    for job in jobs:
        for path in [job.work_dir / name for name in BULK] + ([job.cache_root] if job.cache_root else []):
            freed += sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
            shutil.rmtree(path, ignore_errors=True)
    return freed


class PublishJob:
    """The standalone publish job of `job` (`ettr publish` on its queue): builds the inference artifact from
    the anchor the training job left, in a process and run directory of its own. `start` launches it;
    `finish` waits for it, says how it went and returns its status."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self._proc: subprocess.Popen[bytes] | None = None
        self._began = 0.0

    def start(self) -> None:
        self._began = time.monotonic()
        with open(self.job.work_dir / "publish.log", "ab") as log:
            self._proc = start_child(publish_command(self.job), log, self.job.environment())

    def finish(self, display: ProgressDisplay) -> int:
        assert self._proc is not None
        status = self._proc.wait()
        job = self.job
        runs = sorted((job.publish_queue / "runs").glob("*"))
        where = f"its run directory: {runs[-1]}" if runs else f"log: {job.work_dir / 'publish.log'}"
        display.note(
            f"{job.side.name}: standalone publish job (ettr publish) exited {status} after "
            f"{time.monotonic() - self._began:.0f} s, outside the training job's wall time ({where})"
        )
        return status

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(timeout=60)


def publish_command(job: Job) -> list[str]:
    """`ettr publish` on `job`'s queue, allowed to run the demo's model code only."""
    import ettr.demo._examples

    # The demo's model code (dlrm, shipped in the package) is all this publisher lets its requests run: the
    # package's copy, and where it really lives when that is a link (a source checkout's examples/).
    examples = Path(ettr.demo._examples.__file__).resolve().parent
    command = [sys.executable, "-m", "ettr.cli", "publish", str(job.publish_queue)]
    command += ["--allow-factory", "dlrm.model.*"]
    for allowed in dict.fromkeys([examples, (examples / "dlrm").resolve().parent]):
        command += ["--allow-pythonpath", str(allowed)]
    return command


def run_jobs(
    runs: Sequence[JobRun], display: ProgressDisplay, *, side_by_side: bool, store: Path | None
) -> None:
    """Run the jobs to their ends, each started once the one before it is over, or, `side_by_side` (each on
    its own CPUs, `JobRun.cpus`, so that whatever else the machine runs meanwhile slows both alike), once
    `store` (the compile store, when the workload compiles) holds artifacts, as a store holds an earlier
    job's: at once when there is no store to wait for."""
    waiting: list[JobRun] = list(runs)
    started: list[JobRun] = []
    try:
        while waiting or any(run.status is None for run in started):
            if waiting and (
                not started
                or started[-1].status is not None
                or (side_by_side and (store is None or store_entries(store) > 0))
            ):
                started.append(waiting.pop(0))
                started[-1].launch()
                continue
            for run in sorted(started, key=lambda run: not run.exited):  # an exited job first: its requeue
                run.tick(display)
            wait_any(started, 1.0)
    finally:
        for run in started:
            run.stop()


def wait_any(runs: Sequence[JobRun], timeout_s: float) -> None:
    """Wait up to `timeout_s`, returning soon after one of the `ettr run`s launched exits (a preempted job
    is requeued as soon as it is over, not at the next look)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(run.exited for run in runs):
            return
        time.sleep(0.1)


def store_entries(store: Path) -> int:
    """Committed entries of the compile store at `store` (an entry exists once its manifest does)."""
    return sum(1 for _ in store.glob("*/manifest.json")) if store.is_dir() else 0


def say_store(store: Path, display: ProgressDisplay) -> None:
    """Say where the optimized side's compile artifacts come from: the store, as a fleet's is warm."""
    found = store_entries(store)
    kept = f"{found} entries from earlier demos" if found else "empty"
    display.note(
        f"compile store: {store} ({kept}). The baseline starts first and compiles cold in every attempt; what "
        "it compiles is saved there (never restored by it). The optimized side restores it: the artifacts "
        "of an earlier job of the same model, as a fleet's store holds them"
    )


def _cpu_list(cpus: Collection[int]) -> str:
    ordered = sorted(cpus)
    if len(ordered) > 2 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"CPUs {ordered[0]}-{ordered[-1]}"
    return ("CPU " if len(ordered) == 1 else "CPUs ") + ",".join(map(str, ordered))


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(args: argparse.Namespace) -> int:
    """`ettr demo [--quick] [--out DIR] [--one-after-the-other]`: run both sides, print the comparison, write DIR/report.html.

    Returns 0 when both jobs completed, 1 otherwise. Raises UsageError for an unusable --out or when the
    reference job is missing from this install.
    """
    # Stopped by a scheduler or `kill`: stop the running job too (run_jobs' `finally`), never orphan it.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return _main(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(args: argparse.Namespace) -> int:
    workload = QUICK if args.quick else DEFAULT
    out = Path(args.out)
    script = find_train_script()
    jobs = prepare(out)
    try:
        if workload.compile:  # made here, not by `prepare`, so that it is removed whatever follows
            jobs = [replace(job, cache_root=cache_root_for(job.work_dir, job.side.name)) for job in jobs]
        return _run_demo(args, workload, out, script, jobs)
    finally:  # interrupted or failed too: a private cache root under the system's temp directory is no one's
        for job in jobs:
            if job.cache_root is not None:
                shutil.rmtree(job.cache_root, ignore_errors=True)


def _run_demo(args: argparse.Namespace, workload: Workload, out: Path, script: Path, jobs: list[Job]) -> int:
    from ettr.demo.render import story_lines, story_sections
    from ettr.demo.story import build_story
    from ettr.report.html import write_html
    from ettr.report.load import load_report
    from ettr.report.text import render_comparison

    display = ProgressDisplay(sys.stdout)
    print(f"ettr demo{' --quick' if args.quick else ''}: {workload.describe()}", flush=True)
    if workload.compile:
        say_store(out / "compile-store", display)
    asked_one_after_the_other = getattr(args, "one_after_the_other", False)
    cpus = None if asked_one_after_the_other else usable_cpus()
    halves = split_cpus(cpus) if cpus is not None else None
    if halves is None:
        why = "as asked" if asked_one_after_the_other else "this machine cannot pin them"
        display.note(f"the sides run one after the other, each with the whole machine ({why})")
        runs = [JobRun(job, workload, script) for job in jobs]
    else:
        display.note(
            f"the sides run side by side, each on {len(halves[0])} of the {len(cpus or ())} CPUs ("
            f"baseline {_cpu_list(halves[0])}, optimized {_cpu_list(halves[1])}), so that whatever else this "
            "machine runs meanwhile is beside both (how evenly is measured and said at the end)"
            + (
                "; the optimized side starts once the compile store holds this model's artifacts (an earlier "
                "demo's, or the baseline's first compile)"
                if workload.compile
                else ""
            )
        )
        runs = [JobRun(job, workload, script, cpus=half) for job, half in zip(jobs, halves, strict=True)]
    run_jobs(
        runs,
        display,
        side_by_side=halves is not None,
        store=out / "compile-store" if workload.compile else None,
    )
    failed = [run.job.side.name for run in runs if run.status != 0]
    # After both training jobs, so that it never shares the machine with one of them; the books are read
    # meanwhile (they are closed: the publish job changes nothing in them).
    publishers = [
        PublishJob(run.job)
        for run in runs
        if workload.publish and run.job.side.publish == "standalone" and run.status == 0
    ]
    try:
        for publisher in publishers:
            publisher.start()
        reports = [load_report(job.run_dir) for job in jobs]
        story = build_story(
            jobs[0].run_dir,
            jobs[1].run_dir,
            side_by_side=halves is not None,
            cpu_samples=(runs[0].cpu_samples, runs[1].cpu_samples) if halves is not None else None,
            cpus_per_side=len(halves[0]) if halves is not None else 1,
        )
        for publisher in publishers:
            if publisher.finish(display):
                failed.append(f"the publish job of {publisher.job.side.name}")
    finally:
        for publisher in publishers:
            publisher.stop()
    freed = drop_bulk(jobs)
    print(f"removed {freed / 1e9:.1f} GB of checkpoints, anchors, artifacts and compile caches (logs kept)")
    print()
    print(render_comparison(reports, labels=list(SIDES)))
    print(explain(reports[0], reports[1], published=workload.publish))
    print("\n".join(story_lines(story)))
    html = out / "report.html"
    write_html(reports, html, labels=list(SIDES), extra_sections=story_sections(story))
    print(f"\nreport: {html}   (again: ettr report {jobs[0].run_dir} {jobs[1].run_dir})")
    if failed:
        print(f"ettr demo: {' and '.join(failed)} did not complete; see its log", file=sys.stderr)
        return 1
    return 0
