"""`ettr run` inside real Slurm batch jobs (a single-node cluster from `tests/slurm_cluster.py`, started by the
`slurm_cluster` fixture): a requeue by `scontrol requeue`, and Slurm's SIGUSR1 warning (save, exit,
requeue). Each job keeps one report across its runs: attempts, the pending time as `scheduling`, the resume."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ettr.events import EventKind
from ettr.ledger import open_ledger, read_run_events

pytestmark = pytest.mark.slow

PLAIN = str(Path(__file__).parent / "scripts" / "train_plain.py")


def _script(tmp: Path, *command: str) -> Path:
    """tmp/job.sh: `ettr run --run-dir tmp/run -- COMMAND` (default: the plain job, 30 steps, a save every 5)."""
    py = sys.executable
    run_dir, ckpt = tmp / "run", tmp / "ckpt"
    plain = (py, PLAIN, "--ckpt-dir", str(ckpt), "--num-steps", "30", "--save-every", "5", "--step-s", "0.2")
    command = command or plain
    body = f"""#!/bin/bash
#SBATCH --requeue
#SBATCH --open-mode=append
# The supervisor is the batch shell itself (exec), so that Slurm's signals reach it.
exec {py} -m ettr.cli run --run-dir {run_dir} -- {" ".join(command)}
"""
    path = tmp / "job.sh"
    path.write_text(body)
    path.chmod(0o755)
    return path


def _submit(cluster: Any, tmp: Path, job: Path | None = None) -> str:
    """sbatch `job` (default: `_script(tmp)`), its output in tmp/slurm.out; the job's number."""
    env = {k: v for k, v in cluster.env().items() if not k.startswith("ETTR_")}
    done = subprocess.run(
        ["sbatch", "--parsable", "-o", str(tmp / "slurm.out"), str(job or _script(tmp))],
        capture_output=True, text=True, env=env, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def _state(cluster: Any, job: str) -> str:
    out = cluster.run("scontrol", "show", "job", "-o", job).stdout
    fields = dict(t.split("=", 1) for t in out.split() if "=" in t)
    return fields.get("JobState", "")


def _wait(condition: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.3)  # other processes (Slurm, the job) make this true; nothing to await on
    raise AssertionError(f"timed out waiting for {what}")


def _steps(run_dir: Path) -> int:
    try:
        ledger = open_ledger(run_dir, create=False)
    except Exception:
        return 0
    try:
        return max((e.step or 0 for e in ledger.read() if e.kind is EventKind.STEP), default=0)
    finally:
        ledger.close()


def _start_now(cluster: Any, job: str) -> float:
    """A requeued job waits ~2 minutes (its BeginTime): start it sooner (again, should Slurm set it again
    while the first run's batch step winds down).

    Not in the second its first run ended: slurmd revoked that run's job credential then, and a launch whose
    credential is from the same second (Slurm keeps whole seconds) is refused as "Job credential revoked" and
    the job FAILS. Slurm's own BeginTime delay exists for this; the test waits 2 s of it.

    The seconds the job was seen pending (a lower bound of its wait in the queue)."""
    pending_since: float | None = None

    def running_again() -> bool:
        nonlocal pending_since
        out = cluster.run("scontrol", "show", "job", "-o", job).stdout
        if "JobState=PENDING" in out and "Reason=BeginTime" in out:
            pending_since = time.monotonic() if pending_since is None else pending_since
            if time.monotonic() - pending_since >= 2.0:
                cluster.run("scontrol", "update", f"jobid={job}", "StartTime=now")
        assert "JobState=FAILED" not in out, f"the requeued job failed: {out.strip()}"
        # Started again: running, or already done (a requeued run that ends at once can run and complete
        # between two looks: the full suite at load timed out here with the job done, status 0). Not
        # COMPLETING: the first run winds down in that state after the requeue.
        started = "JobState=RUNNING" in out or "JobState=COMPLETED" in out
        return started and "Restarts=0" not in out

    _wait(running_again, 60, f"job {job} running again")
    return 0.0 if pending_since is None else time.monotonic() - pending_since


def _report(run_dir: Path) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "ettr.cli", "report", str(run_dir), "--json"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rep = json.loads(done.stdout)
    assert math.fsum(rep["buckets_s"].values()) == pytest.approx(rep["wall_s"], rel=1e-6, abs=1e-6)
    return rep


def _check_one_report(rep: dict[str, Any], job: str, pended_s: float) -> None:
    assert rep["job_id"] == job
    first, last = rep["attempts"][0], rep["attempts"][-1]
    assert first["outcome"] == "preempted" and last["outcome"] == "completed"
    assert last["resumed_from_step"] is not None and last["resumed_from_step"] >= 5
    assert last["last_step"] == 30
    # The time the requeued job pended is the scheduler's: the requeued attempt's `scheduling`, about what
    # the test waited before starting it (Slurm's times are whole seconds: 1 s either way).
    assert last["buckets_s"]["scheduling"] >= pended_s - 1.5
    # The TTR table books that wait as the buckets do, not as the supervisor's back-off.
    requeue = rep["ttr_parts"][-1]
    assert requeue["kind"] == "requeue"
    assert requeue["parts_s"]["scheduling"] == pytest.approx(last["buckets_s"]["scheduling"], abs=1e-6)


def test_a_requeued_batch_job_keeps_one_report(slurm_cluster: Any, tmp_path: Path) -> None:
    job = _submit(slurm_cluster, tmp_path)
    _wait(lambda: _steps(tmp_path / "run") >= 8, 90, "step 8")
    done = slurm_cluster.run("scontrol", "requeue", job)
    assert done.returncode == 0, done.stderr
    pended = _start_now(slurm_cluster, job)
    _wait(lambda: _state(slurm_cluster, job) == "COMPLETED", 120, f"job {job} completed")
    out = (tmp_path / "slurm.out").read_text()
    assert "continuing job" in out and "SLURM_RESTART_COUNT" not in out  # Slurm and the ledger agree
    # Slurm runs it again: no hint to continue it by hand (a second copy beside Slurm's).
    assert "to continue it" not in out and f"Slurm requeued job {job} (Restarts=1" in out
    _check_one_report(_report(tmp_path / "run"), job, pended)


def test_slurms_warning_signal_saves_exits_and_requeues(slurm_cluster: Any, tmp_path: Path) -> None:
    job = _submit(slurm_cluster, tmp_path)
    _wait(lambda: _steps(tmp_path / "run") >= 8, 90, "step 8")
    # What `--signal=B:USR1@T` sends T seconds before the time limit, sent now.
    done = slurm_cluster.run("scancel", "--signal=USR1", "--batch", job)
    assert done.returncode == 0, done.stderr
    _wait(lambda: "asked Slurm to requeue" in (tmp_path / "slurm.out").read_text(), 60, "the requeue")
    pended = _start_now(slurm_cluster, job)
    _wait(lambda: _state(slurm_cluster, job) == "COMPLETED", 120, f"job {job} completed")
    out = (tmp_path / "slurm.out").read_text()
    assert "got SIGUSR1: forwarding it to the job as SIGTERM" in out
    assert "SLURM_RESTART_COUNT" not in out
    rep = _report(tmp_path / "run")
    _check_one_report(rep, job, pended)
    assert rep["attempts"][0]["exit_code"] == 143
    assert os.path.exists(tmp_path / "run")


DDP_STEPS = str(Path(__file__).parent / "scripts" / "ddp_steps.py")  # its rank from SLURM_PROCID under srun


def test_the_tasks_of_an_srun_step_are_recorded_under_their_slurm_ranks(
    slurm_cluster: Any, tmp_path: Path
) -> None:
    from ettr.supervisor.launch import free_port

    py, run_dir = sys.executable, tmp_path / "run"
    job = tmp_path / "job.sh"
    job.write_text(
        f"""#!/bin/bash
#SBATCH -n 2
export MASTER_ADDR=127.0.0.1 MASTER_PORT={free_port()}
exec {py} -m ettr.cli run --run-dir {run_dir} --inject crash@step=4,rank=1 -- srun -n 2 {py} {DDP_STEPS}
"""
    )
    number = _submit(slurm_cluster, tmp_path, job)
    _wait(lambda: _state(slurm_cluster, number) == "COMPLETED", 240, f"job {number} completed")
    events = read_run_events(run_dir)
    starts = sorted((e.attempt, e.rank) for e in events if e.kind is EventKind.PROCESS_START)
    assert starts == [(0, 0), (0, 1), (1, 0), (1, 1)]  # each task under its SLURM_PROCID, not two rank 0s
    fired = [
        (e.attempt, e.rank)
        for e in events
        if e.kind is EventKind.MARK and (e.data or {}).get("name") == "inject"
    ]
    assert fired == [(0, 1)]
    last = {
        r: max(e.step or 0 for e in events if e.kind is EventKind.STEP and (e.attempt, e.rank) == (1, r))
        for r in (0, 1)
    }
    assert last == {0: 8, 1: 8}


SAVES_LONGER_THAN_KILLWAIT = """
import pathlib, signal, sys, time
ready = pathlib.Path(sys.argv[1])
if ready.exists():
    sys.exit(0)  # the requeued run: done
signal.signal(signal.SIGTERM, lambda *_: time.sleep(120))  # a final save longer than Slurm's KillWait
ready.write_text("ready")
time.sleep(300)
"""


def test_a_supervisor_slurm_kills_after_its_sigterm_leaves_a_preemption(
    slurm_cluster: Any, tmp_path: Path
) -> None:
    # Slurm's requeue: SIGTERM to every process of the job, SIGKILL `KillWait` (5 s here) later, before the
    # job had saved and the supervisor had closed the attempt. The requeued run closed it as a lost node
    # (failed, infra) and spent a restart on it (field trial: DDP tutorial, torchrun behind bash).
    py, run_dir, script, ready = sys.executable, tmp_path / "run", tmp_path / "slow.py", tmp_path / "ready"
    script.write_text(SAVES_LONGER_THAN_KILLWAIT)
    job = _script(tmp_path, py, str(script), str(ready))
    number = _submit(slurm_cluster, tmp_path, job)
    _wait(ready.exists, 90, "the script to start")
    assert slurm_cluster.run("scontrol", "requeue", number).returncode == 0
    _start_now(slurm_cluster, number)
    _wait(lambda: _state(slurm_cluster, number) == "COMPLETED", 120, f"job {number} completed")
    out = (tmp_path / "slurm.out").read_text()
    assert "closed 1 attempt(s) a killed supervisor left open" in out  # Slurm's SIGKILL took the supervisor
    assert "already spent on failures" not in out  # a preemption uses no restart
    rep = _report(run_dir)
    assert [a["outcome"] for a in rep["attempts"]] == ["preempted", "completed"]
    assert rep["attempts"][0]["exit_code"] is None  # unknown, not a number
    assert rep["num_failures_by_cause"]["preemption"] == 1 and rep["num_failures_by_cause"]["infra"] == 0


SAVES_AND_REQUEUES_ON_SIGUSR1 = """
import os, pathlib, signal, subprocess, sys, time
here = pathlib.Path(sys.argv[1])
if (here / "ready").exists():
    sys.exit(0)  # the requeued run: resumes from its save, done
def on_warning(*_):  # Lightning's auto-requeue (SLURMEnvironment): its HPC checkpoint, then the requeue
    (here / "saved").write_text("saved")
    subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=False)
stop = []
signal.signal(signal.SIGUSR1, on_warning)
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
(here / "ready").write_text("ready")
while not stop:
    time.sleep(0.1)
"""


def test_slurms_warning_reaches_the_jobs_own_sigusr1_handler_and_the_job_is_requeued_once(
    slurm_cluster: Any, tmp_path: Path
) -> None:
    # `--signal=B:USR1@T` signals the batch shell alone: the supervisor. A Lightning job with auto-requeue
    # got SIGTERM alone, saved no HPC checkpoint, and its requeued run started over from step 0.
    py, run_dir, script = sys.executable, tmp_path / "run", tmp_path / "lightning_like.py"
    script.write_text(SAVES_AND_REQUEUES_ON_SIGUSR1)
    job = _script(tmp_path, py, str(script), str(tmp_path))
    number = _submit(slurm_cluster, tmp_path, job)
    _wait((tmp_path / "ready").exists, 90, "the script to start")
    assert slurm_cluster.run("scancel", "--signal=USR1", "--batch", number).returncode == 0
    # Who requeues is a race, either way once: the handler's `scontrol requeue` (the supervisor's then finds
    # the job pending again), or the supervisor's when its SIGTERM to the job's tree ended that scontrol.
    said = ("pending again already", "asked Slurm to requeue")
    _wait(lambda: any(s in (tmp_path / "slurm.out").read_text() for s in said), 60, "the requeue")
    _start_now(slurm_cluster, number)
    _wait(lambda: _state(slurm_cluster, number) == "COMPLETED", 120, f"job {number} completed")
    assert (tmp_path / "saved").exists()  # the job's own handler ran: its save
    shown = slurm_cluster.run("scontrol", "show", "job", "-o", number).stdout
    assert "Restarts=1 " in shown  # requeued once, not twice
    out = (tmp_path / "slurm.out").read_text()
    assert "as SIGUSR1 first to the processes with a SIGUSR1 handler" in out
    rep = _report(run_dir)
    assert [a["outcome"] for a in rep["attempts"]] == ["preempted", "completed"]
