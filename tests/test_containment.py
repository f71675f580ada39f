"""Containment (docs/supervisor.md): no process of a job outlives its attempt, and a requeue after a
SIGKILLed supervisor kills what that supervisor left running before it continues the books."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ettr.events import EventKind
from ettr.ledger import open_ledger
from ettr.supervisor.containment import AttemptSweep, leftovers

pytestmark = pytest.mark.slow

ETTR = [sys.executable, "-m", "ettr.cli"]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}


def _with_cmdline(token: str) -> list[int]:
    """Pids of live (non-zombie) processes whose command line contains `token`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{entry}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if token in cmdline and state != b"Z" and int(entry) != os.getpid():
            found.append(int(entry))
    return found


def _wait_gone(token: str, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (alive := _with_cmdline(token)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


@pytest.mark.timeout(120)
def test_grandchildren_that_escape_the_tree_are_swept_at_a_normal_end(tmp_path):
    # Each escapes differently: a child that exits within 1 s leaving its own child behind, a setsid double
    # fork, and one that also clears its environment (found only as an orphan adopted by the supervisor).
    token = f"ettr-contain-{os.getpid()}"
    script = tmp_path / "job.sh"
    script.write_text(
        textwrap.dedent(
            f"""\
            sh -c 'sleep 301 {token}-quick 2>/dev/null || exec -a {token}-quick sleep 301 &'
            python3 -c "import os, subprocess; subprocess.Popen(['setsid', 'bash', '-c', 'exec -a {token}-setsid sleep 302'])"
            python3 -c "import subprocess; subprocess.Popen(['env', '-i', 'bash', '-c', 'exec -a {token}-noenv sleep 303'], start_new_session=True)"
            sleep 0.5
            exit 0
            """
        )
    )
    done = subprocess.run(
        [*ETTR, "run", "--run-dir", str(tmp_path / "run"), "--max-restarts", "0", "--", "bash", str(script)],
        capture_output=True, text=True, timeout=90, env=_env(),
    )  # fmt: skip
    try:
        assert done.returncode == 0, done.stderr[-3000:]
        assert _wait_gone(token, 5) == [], done.stderr[-3000:]
        assert "outlived it" in done.stderr
    finally:
        for pid in _with_cmdline(token):
            os.kill(pid, signal.SIGKILL)


TRAINER = """
import sys, time
import ettr
for step in range(1, int(sys.argv[1]) + 1):
    time.sleep(0.05)
    ettr.step(step)
"""


def _num_steps(run_dir: Path, attempt: int) -> int:
    try:
        ledger = open_ledger(run_dir, create=False)
    except Exception:
        return 0
    try:
        return sum(1 for e in ledger.read() if e.kind is EventKind.STEP and e.attempt == attempt)
    finally:
        ledger.close()


@pytest.mark.timeout(180)
def test_a_requeue_after_a_killed_supervisor_kills_the_orphaned_trainer_and_fences_attempt_0(tmp_path):
    trainer = tmp_path / "train.py"
    trainer.write_text(TRAINER)
    run_dir = tmp_path / "run"
    command = ["bash", "-c", f"{sys.executable} {trainer} 2000; true"]
    supervisor = subprocess.Popen(
        [*ETTR, "run", "--run-dir", str(run_dir), "--max-restarts", "0", "--", *command],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while _num_steps(run_dir, 0) < 5 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _num_steps(run_dir, 0) >= 5
        # The supervisor's guard would end the trainer (test below): it is killed first, as a `kill -9` of
        # every process of the user's would, so that the trainer outlives its supervisor.
        (guard,) = _guards_of(supervisor.pid)
        os.kill(guard, signal.SIGKILL)
        supervisor.kill()  # SIGKILL: no books closed, bash dies of its parent-death signal
        supervisor.wait(10)
        time.sleep(1.0)
        orphans = leftovers(run_dir)
        assert orphans, "the trainer did not outlive its supervisor: nothing to test"
        requeue = subprocess.run(
            [*ETTR, "run", "--run-dir", str(run_dir), "--max-restarts", "0", "--", sys.executable, str(trainer), "3"],
            capture_output=True, text=True, timeout=120, env=_env(),
        )  # fmt: skip
        assert requeue.returncode == 0, requeue.stderr[-3000:]
        assert f"pids {orphans[0].pid}" in requeue.stderr and "killed" in requeue.stderr
        assert leftovers(run_dir) == []
        time.sleep(1.0)  # an orphan still running would write more attempt-0 steps now
        events = open_ledger(run_dir).read()
        (end_0,) = [e for e in events if e.kind is EventKind.ATTEMPT_END and e.attempt == 0]
        late = [e for e in events if e.attempt == 0 and e.rank >= 0 and e.ts > end_0.ts]
        assert late == []
        assert [e.attempt for e in events if e.kind is EventKind.ATTEMPT_START] == [0, 1]
    finally:
        for orphan in leftovers(run_dir):
            os.kill(orphan.pid, signal.SIGKILL)


def _guards_of(supervisor: int) -> list[int]:
    """The pids of the guards (`ettr.supervisor.guard`) the supervisor `supervisor` started."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            parent = int(Path(f"/proc/{entry}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"ettr.supervisor.guard" in cmdline and parent == supervisor:
            found.append(int(entry))
    return found


@pytest.mark.timeout(180)
def test_no_trainer_outlives_a_sigkilled_supervisor_behind_a_wrapper(tmp_path):
    # PDEATHSIG ends bash (the supervisor's child); the python it started is ended by the supervisor's guard.
    trainer = tmp_path / "train.py"
    trainer.write_text(TRAINER)
    run_dir = tmp_path / "run"
    command = ["bash", "-c", f"{sys.executable} {trainer} 20000; true"]
    supervisor = subprocess.Popen(
        [*ETTR, "run", "--run-dir", str(run_dir), "--max-restarts", "0", "--", *command],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while _num_steps(run_dir, 0) < 5 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _num_steps(run_dir, 0) >= 5
        assert len(_guards_of(supervisor.pid)) == 1
        supervisor.kill()
        supervisor.wait(10)
        deadline = time.monotonic() + 60
        while leftovers(run_dir) and time.monotonic() < deadline:
            time.sleep(0.1)  # the guard acts on the pipe's EOF; a loaded machine may be slow to run it
        assert leftovers(run_dir) == []
        assert not [p for p in _with_cmdline(str(trainer))]
    finally:
        for orphan in leftovers(run_dir):
            os.kill(orphan.pid, signal.SIGKILL)


def test_the_sweep_of_an_attempt_spares_other_attempts_and_runs(tmp_path):
    env = {
        **_env(),
        "ETTR_RUN_DIR": str(tmp_path),
        "ETTR_ATTEMPT": "3",
        "ETTR_SUPERVISOR_PID": str(os.getpid()),
    }
    mine = subprocess.Popen(["sleep", "60"], env=env)
    other = subprocess.Popen(["sleep", "60"], env={**env, "ETTR_ATTEMPT": "4"})
    try:
        sweep = AttemptSweep(tmp_path, 3)
        # membership, not equality: in a full test session a child this process starts meanwhile (a library's
        # helper process, started by a thread an earlier test left) is the sweep's too, and is not the point
        targets = [pid for pid, _ in sweep.targets()]
        assert mine.pid in targets and other.pid not in targets
        assert mine.pid in sweep.run()
        # The sweep reaps what it kills (adopted orphans are nobody else's to wait for): `mine` is gone.
        assert not os.path.exists(f"/proc/{mine.pid}") and other.poll() is None
    finally:
        other.kill()
        other.wait()
        mine.kill()
        mine.wait()


def test_a_requeue_spares_processes_no_supervisor_started(tmp_path):
    # A shell that exported ETTR_RUN_DIR by hand, and one whose supervisor is alive, are not leftovers.
    env = {**_env(), "ETTR_RUN_DIR": str(tmp_path)}
    by_hand = subprocess.Popen(["sleep", "60"], env=env)
    live = subprocess.Popen(["sleep", "60"], env={**env, "ETTR_SUPERVISOR_PID": str(os.getppid())})
    dead = subprocess.Popen(["sleep", "60"], env={**env, "ETTR_SUPERVISOR_PID": str(2**22 + 11)})
    try:
        assert [leftover.pid for leftover in leftovers(tmp_path)] == [dead.pid]
    finally:
        for proc in (by_hand, live, dead):
            proc.kill()
            proc.wait()
