"""`ettr run` end to end with real processes: unmodified scripts, injected faults, and the contract report.

Each test runs `tests/scripts/train_plain.py` (or `train_ddp.py` under torchrun) exactly as a user would,
with `python -m ettr.cli run ... -- python SCRIPT`, then checks `ettr report --json` against what the
script did: the sleeps in the script are lower bounds for their buckets (never upper bounds: this machine
is shared), and step counts, resume points, lost steps and failures are exact.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ettr.constants import SIGNALLED_MARK
from ettr.events import Event, EventKind
from ettr.ledger import LedgerError, open_ledger, read_run_events

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "scripts"
PLAIN = str(SCRIPTS / "train_plain.py")
DDP = str(SCRIPTS / "train_ddp.py")
ETTR = [sys.executable, "-m", "ettr.cli"]
STEP_S = 0.1
FIRST_BATCH_S = 0.3
INIT_S = 0.2


def run_ettr(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    return subprocess.run(
        [*ETTR, *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def plain(ckpt: Path, *extra: str) -> list[str]:
    return [
        sys.executable, PLAIN, "--ckpt-dir", str(ckpt), "--num-steps", "12", "--save-every", "5",
        "--step-s", str(STEP_S), "--first-batch-s", str(FIRST_BATCH_S), "--init-s", str(INIT_S), *extra,
    ]  # fmt: skip


def report(run_dir: Path) -> dict[str, Any]:
    done = run_ettr("report", str(run_dir), "--json", timeout=120)
    assert done.returncode == 0, done.stderr
    rep = json.loads(done.stdout)
    assert rep["schema"] == "ettr.report/1"
    # The buckets partition wall time, for the job and for each attempt's share.
    assert math.fsum(rep["buckets_s"].values()) == pytest.approx(rep["wall_s"], rel=1e-6, abs=1e-6)
    assert rep["ett_pct"] + rep["idleness_pct"] + rep["failure_pct"] == pytest.approx(100.0)
    attempts_total = math.fsum(math.fsum(a["buckets_s"].values()) for a in rep["attempts"])
    assert attempts_total <= rep["wall_s"] + 1e-6
    return rep


def supervisor_events(run_dir: Path, kind: EventKind) -> list[Event]:
    return [e for e in open_ledger(run_dir, create=False).read() if e.kind is kind and e.rank < 0]


def summary(rep: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [
        (a["outcome"], a["exit_code"], a["resumed_from_step"], a["last_step"], a["lost_steps"])
        for a in rep["attempts"]
    ]


def test_crash_at_a_step_is_recovered_from_the_last_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = run_ettr(
        "run", "--run-dir", str(run_dir), "--inject", "crash@step=7", "--", *plain(tmp_path / "ckpt")
    )
    assert done.returncode == 0, done.stderr
    rep = report(run_dir)
    # Steps 1-7, crash right after 7; the save after step 5 was the last one: steps 6 and 7 are lost.
    assert summary(rep) == [("failed", 1, None, 7, 2), ("completed", 0, 5, 12, 0)]
    assert rep["num_failures"] == 1 and len(rep["ttr_s"]) == 1
    buckets = rep["buckets_s"]
    assert buckets["data_wait"] >= 2 * FIRST_BATCH_S  # both attempts waited for their first batch
    assert buckets["effective_training"] >= 12 * STEP_S  # 12 kept steps (5 + 7)
    assert buckets["wasted_progress"] >= 2 * STEP_S  # steps 6 and 7 of attempt 0
    # No back-off before the first restart of a crash after progress (ettr.supervisor.restart).
    backoffs = [
        e.data
        for e in supervisor_events(run_dir, EventKind.MARK)
        if (e.data or {}).get("name") == "restart_backoff"
    ]
    assert [b["wait_s"] for b in backoffs if b] == [0.0]
    assert buckets["init"] >= 2 * INIT_S and buckets["restore"] > 0 and buckets["checkpoint_blocking"] > 0
    assert rep["tts_s"] >= INIT_S + FIRST_BATCH_S
    assert rep["ttr_s"][0] >= INIT_S + FIRST_BATCH_S  # start-up, first batch
    assert sum(v for v in rep["ttr_parts"][0]["parts_s"].values() if v is not None) >= INIT_S + FIRST_BATCH_S
    end = supervisor_events(run_dir, EventKind.ATTEMPT_END)[0].data or {}
    assert end["exception"] == "InjectedCrash" and end["injected"] == "crash@step=7,attempt=0,rank=0"
    assert any("injecting crash" in line for line in end["stderr_tail"])
    assert [e.data["exit_status"] for e in supervisor_events(run_dir, EventKind.JOB_END)] == [0]


def test_sigkill_with_atomic_saves(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    command = plain(tmp_path / "ckpt", "--atomic")  # torch.save(tmp) + os.replace(tmp, final)
    done = run_ettr("run", "--run-dir", str(run_dir), "--inject", "kill@step=7", "--", *command)
    assert done.returncode == 0, done.stderr
    rep = report(run_dir)
    assert summary(rep) == [("failed", 137, None, 7, 2), ("completed", 0, 5, 12, 0)]
    end = supervisor_events(run_dir, EventKind.ATTEMPT_END)[0].data or {}
    assert end["signal"] == "SIGKILL" and not end["oom"]


def test_hang_is_detected_killed_and_recovered(tmp_path: Path) -> None:
    """No --hang-timeout: the bound follows the job (its 0.1 s steps: the 10 s floor), however long its start-up
    takes on a loaded machine (the start-up bound is 300 s) and however long it waits for a CPU."""
    run_dir = tmp_path / "run"
    done = run_ettr(
        "run", "--run-dir", str(run_dir), "--inject", "hang@step=7", "--", *plain(tmp_path / "ckpt"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rep = report(run_dir)
    assert summary(rep) == [("hung", 143, None, 7, 2), ("completed", 0, 5, 12, 0)]
    assert rep["num_failures"] == 1
    assert [(f["cause"], f["detail"]) for f in rep["failures"]] == [("hang", "hung")]
    # From the last kept step to the watchdog firing: the lost steps and the whole silence are wasted (the
    # SIGTERM grace after it is restart).
    assert rep["buckets_s"]["wasted_progress"] >= 10.0 + 2 * STEP_S
    end = supervisor_events(run_dir, EventKind.ATTEMPT_END)[0].data or {}
    assert "no progress and no heartbeat" in end["reason"] and "step bound" in end["reason"]
    # The silence before the kill is the recovery's detection part.
    (parts,) = rep["ttr_parts"]
    assert parts["parts_s"]["detection"] >= 10.0


def test_preemption_is_forwarded_and_a_requeued_run_continues_the_books(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    ckpt = tmp_path / "ckpt"
    done = run_ettr("run", "--run-dir", str(run_dir), "--inject", "preempt@step=7", "--", *plain(ckpt))
    assert done.returncode == 143, done.stderr
    assert "forwarding it to the job" in done.stderr
    assert [e.data["exit_status"] for e in supervisor_events(run_dir, EventKind.JOB_END)] == [143]
    first = report(run_dir)
    assert summary(first) == [("preempted", 143, None, 7, 2)]
    # The scheduler requeues the job: same run directory, same job id, attempts numbered on.
    again = run_ettr("run", "--run-dir", str(run_dir), "--", *plain(ckpt))
    assert again.returncode == 0, again.stderr
    rep = report(run_dir)
    assert rep["job_id"] == first["job_id"]
    assert summary(rep) == [("preempted", 143, None, 7, 2), ("completed", 0, 5, 12, 0)]
    assert [a["index"] for a in rep["attempts"]] == [0, 1] and rep["num_failures"] == 1


def test_two_rank_torchrun_job_crashes_once_and_completes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    torchrun = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port=29500", DDP,
        "--ckpt-dir", str(tmp_path / "ckpt"), "--num-steps", "10", "--save-every", "4", "--step-s", str(STEP_S),
    ]  # fmt: skip
    done = run_ettr("run", "--run-dir", str(run_dir), "--inject", "crash@step=6,rank=1", "--", *torchrun)
    assert done.returncode == 0, done.stderr
    rep = report(run_dir)
    # Rank 1 crashed after step 6; rank 0 (the reference) cannot finish step 7 without it. Rank 0 saved step 4.
    assert summary(rep) == [("failed", 1, None, 6, 2), ("completed", 0, 4, 10, 0)]
    assert rep["num_failures"] == 1
    events = open_ledger(run_dir, create=False).read()
    commands = [e.data["command"] for e in events if e.kind is EventKind.ATTEMPT_START]
    ports = [next(a for a in c if a.startswith("--master-port=")) for c in commands]
    assert len(set(ports)) == 2 and "--master-port=29500" not in ports  # a fresh rendezvous per attempt
    assert all("--max-restarts=0" in c for c in commands)
    starts = sorted((e.attempt, e.rank) for e in events if e.kind is EventKind.PROCESS_START)
    assert starts == [(0, 0), (0, 1), (1, 0), (1, 1)]  # the workers, never the torchrun agent
    failures = [
        (e.attempt, e.rank, (e.data or {}).get("exception")) for e in events if e.kind is EventKind.FAILURE
    ]
    assert failures[0] == (0, 1, "InjectedCrash")  # rank 0 may then fail too, on the broken collective
    assert all(attempt == 0 for attempt, _, _ in failures)
    end = supervisor_events(run_dir, EventKind.ATTEMPT_END)[0].data or {}
    assert end["exception"] == "InjectedCrash"  # the root cause, not torchrun's ChildFailedError
    pg_inits = {
        (e.attempt, e.rank)
        for e in events
        if e.kind is EventKind.PHASE_END and e.phase == "process_group_init"
    }
    assert pg_inits == {(0, 0), (0, 1), (1, 0), (1, 1)}


def _wait_for(condition: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)  # polling a condition another process makes true; nothing to await on
    raise AssertionError(f"timed out waiting for {what}")


def _pid_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def test_a_sigkilled_supervisor_leaves_a_reportable_run_that_the_next_one_continues(tmp_path: Path) -> None:
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    # --atomic: the SIGKILL may land in the middle of a save; a plain torch.save over the file would leave a
    # truncated checkpoint that the script itself cannot load (its bug, not ettr's; see test_sigkill_with_atomic_saves).
    command = [sys.executable, PLAIN, "--ckpt-dir", str(ckpt), "--num-steps", "40", "--save-every", "5",
               "--step-s", str(STEP_S), "--first-batch-s", "0", "--init-s", "0", "--atomic"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    supervisor = subprocess.Popen(
        [*ETTR, "run", "--run-dir", str(run_dir), "--", *command],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def far_enough() -> list[Event]:
            try:  # the supervisor may be creating the ledger right now (the file exists, no schema yet)
                events = read_run_events(run_dir)
            except LedgerError:
                return []
            return events if any(e.kind is EventKind.STEP and e.step >= 12 for e in events) else []

        events = _wait_for(far_enough, 120, "step 12")
        child = next(e.data["pid"] for e in events if e.kind is EventKind.ATTEMPT_START)
        supervisor.send_signal(signal.SIGKILL)
        supervisor.wait(30)
        _wait_for(lambda: _pid_gone(child), 30, "the training process to die with its supervisor")
    finally:
        supervisor.kill()
        supervisor.wait()
    killed = report(run_dir)
    (attempt,) = killed["attempts"]
    # No failure is counted until a requeue says what happened: the books say their supervisor was lost.
    assert attempt["outcome"] == "unknown" and attempt["last_step"] >= 12 and attempt["end_ts"] is not None
    assert killed["state"] == "supervisor_lost" and killed["num_failures"] == 0
    assert killed["wall_s"] > 0
    last_step = attempt["last_step"]

    again = run_ettr("run", "--run-dir", str(run_dir), "--", *command)
    assert again.returncode == 0, again.stderr
    assert "closed 1 attempt(s) a killed supervisor left open" in again.stderr
    closed = supervisor_events(run_dir, EventKind.ATTEMPT_END)[0]
    assert closed.attempt == 0 and (closed.data or {}).get("closed_from_ledger") is True
    rep = report(run_dir)
    resumed = rep["attempts"][1]["resumed_from_step"]
    # the last commit: a multiple of 5 at most 5 steps back, or exactly 5 when the SIGKILL landed between a
    # step that saves (15) and its save's commit (a full suite's run: last step 15, resumed from 10)
    assert resumed is not None and resumed % 5 == 0 and last_step - 5 <= resumed <= last_step
    assert resumed > last_step - 5 or last_step % 5 == 0
    assert summary(rep) == [
        ("failed", None, None, last_step, last_step - resumed),
        ("completed", 0, resumed, 40, 0),
    ]


def test_a_crash_while_a_checkpoint_is_written_loses_that_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = run_ettr(
        "run", "--run-dir", str(run_dir), "--inject", "crash@checkpoint", "--", *plain(tmp_path / "ckpt")
    )
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "ckpt" / "step-5.pt").exists() or (tmp_path / "ckpt" / "step-10.pt").exists()
    rep = report(run_dir)
    # The first save (after step 5) never committed: the next attempt starts from scratch.
    assert summary(rep) == [("failed", 1, None, 5, 5), ("completed", 0, None, 12, 0)]


def test_no_auto_leaves_the_script_alone(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = run_ettr(
        "run",
        "--run-dir",
        str(run_dir),
        "--no-auto",
        "--inject",
        "crash@step=3",
        "--",
        *plain(tmp_path / "ckpt"),
    )
    assert done.returncode == 0, done.stderr  # no automatic steps, so no step for the fault to follow
    kinds = {e.kind for e in open_ledger(run_dir, create=False).read() if e.rank >= 0}
    assert EventKind.PROCESS_START in kinds and EventKind.STEP not in kinds
    assert EventKind.CHECKPOINT_COMMIT not in kinds


def test_restarts_run_out_and_every_attempt_is_classified(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    now = time.time()
    done = run_ettr(
        "run", "--run-dir", str(run_dir), "--job-id", "bad-input", "--max-restarts", "1",
        "--submitted-at", str(now - 20), "--allocated-at", str(now - 5),
        "--", sys.executable, "-c", "import sys; print('about to fail', file=sys.stderr); raise ValueError('bad')",
    )  # fmt: skip
    assert done.returncode == 3  # the same failure twice before the first step: restarts would not help
    assert "failed the same way twice before its first step (ValueError, exit status 1)" in done.stderr
    ends = [e.data or {} for e in supervisor_events(run_dir, EventKind.ATTEMPT_END)]
    assert [(d["outcome"], d["exit_code"], d["exception"]) for d in ends] == [("failed", 1, "ValueError")] * 2
    assert "ValueError: bad" in ends[0]["stderr_tail"][-1]
    assert [e.data["exit_status"] for e in supervisor_events(run_dir, EventKind.JOB_END)] == [3]
    rep = report(run_dir)
    assert rep["job_id"] == "bad-input" and rep["num_failures"] == 2
    assert [(f["cause"], f["detail"]) for f in rep["failures"]] == [("user", "startup")] * 2
    assert rep["buckets_s"]["scheduling"] == pytest.approx(15, abs=0.01)
    assert rep["buckets_s"]["hardware_setup"] >= 5


def test_a_command_that_cannot_run_is_bad_usage(tmp_path: Path) -> None:
    done = run_ettr("run", "--run-dir", str(tmp_path / "run"), "--", str(tmp_path / "no-such-python"), "x.py")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "cannot execute" in done.stderr and "Traceback" not in done.stderr
    nothing = run_ettr("run", "--run-dir", str(tmp_path / "run"))
    assert nothing.returncode == 2 and "no command given" in nothing.stderr


SAVING_ON_SIGTERM = """
import os, pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
(out.parent / "ready").write_text(str(os.getpid()))
while not stop:
    time.sleep(0.05)
with open(out.with_suffix(".tmp"), "w") as f:  # the final save: a second of writing
    for i in range(10):
        f.write(f"part {i}\\n"); f.flush(); time.sleep(0.1)
os.replace(out.with_suffix(".tmp"), out)
sys.exit(143)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_the_python_behind_a_shell_wrapper_finishes_its_save_on_a_preemption(
    tmp_path: Path, sig: int
) -> None:
    # bash runs python without exec and dies of the SIGTERM at once: python gets it too, and the rest of the
    # grace to save (it was SIGKILLed ~60 ms after bash, mid-save, as "a process that outlived it").
    script, wrapper, saved = tmp_path / "train.py", tmp_path / "wrap.sh", tmp_path / "out" / "ckpt"
    saved.parent.mkdir()
    script.write_text(SAVING_ON_SIGTERM)
    wrapper.write_text(f"#!/bin/bash\n{sys.executable} {script} {saved}\necho wrapper done\n")
    wrapper.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    supervisor = subprocess.Popen(
        [*ETTR, "run", "--run-dir", str(tmp_path / "run"), "--", str(wrapper)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        _wait_for(lambda: (saved.parent / "ready").exists(), 120, "the script to start")
        supervisor.send_signal(sig)
        _, err = supervisor.communicate(timeout=120)
    finally:
        supervisor.kill()
    assert supervisor.returncode == 143, err
    assert saved.read_text().splitlines()[-1] == "part 9", err  # the save completed
    assert "outlived" not in err
    (end,) = supervisor_events(tmp_path / "run", EventKind.ATTEMPT_END)
    assert (end.data or {})["outcome"] == "preempted"


SLOW_TO_STOP = """
import pathlib, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: time.sleep(120))  # a final save longer than the scheduler waits
pathlib.Path(sys.argv[1]).write_text("ready")
time.sleep(120)
"""


def test_a_supervisor_killed_after_a_schedulers_sigterm_leaves_a_preemption(tmp_path: Path) -> None:
    # Slurm's requeue (or preemption, or time limit): SIGTERM to every process of the job, SIGKILL `KillWait`
    # later (5 s on the test cluster), before the job had finished saving and ettr had closed the attempt.
    # The requeued run closed it as a lost node: a failure of the infrastructure, one restart spent.
    run_dir, script, ready = tmp_path / "run", tmp_path / "slow.py", tmp_path / "ready"
    script.write_text(SLOW_TO_STOP)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    supervisor = subprocess.Popen(
        [*ETTR, "run", "--run-dir", str(run_dir), "--", sys.executable, str(script), str(ready)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _wait_for(ready.exists, 120, "the script to start")
        supervisor.send_signal(signal.SIGTERM)

        def signalled() -> bool:
            try:
                events = read_run_events(run_dir)
            except LedgerError:
                return False
            return any(
                e.kind is EventKind.MARK and (e.data or {}).get("name") == SIGNALLED_MARK for e in events
            )

        _wait_for(signalled, 60, "the signal on record")
        supervisor.send_signal(signal.SIGKILL)  # KillWait is over
        supervisor.wait(30)
    finally:
        supervisor.kill()
        supervisor.wait()
    again = run_ettr("run", "--run-dir", str(run_dir), "--", sys.executable, "-c", "pass")
    assert again.returncode == 0, again.stderr
    assert "already spent on failures" not in again.stderr  # a preemption uses no restart
    rep = report(run_dir)
    assert [a["outcome"] for a in rep["attempts"]] == ["preempted", "completed"]
    assert rep["attempts"][0]["exit_code"] is None  # what it would have exited with is unknown
    assert rep["num_failures_by_cause"]["preemption"] == 1 and rep["num_failures_by_cause"]["infra"] == 0


@pytest.mark.parametrize("closed", [(1,), (1, 2), (0, 1, 2)])
def test_a_closed_stdout_is_not_a_failure_of_the_job(tmp_path: Path, closed: tuple[int, ...]) -> None:
    # `ettr run ... >&-`: the job writes to stdout (and stderr); it used to inherit a closed fd 1, or the
    # supervisor's next file on it (echo: "write error: Bad file descriptor", the job booked failed).
    run_dir = tmp_path / "run"
    command = ["bash", "-c", "set -e; echo to stderr >&2; echo to stdout"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}

    def close_fds() -> None:
        for fd in closed:
            os.close(fd)

    done = subprocess.run(
        [*ETTR, "run", "--run-dir", str(run_dir), "--max-restarts", "0", "--", *command],
        env=env, preexec_fn=close_fds, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0
    (end,) = supervisor_events(run_dir, EventKind.ATTEMPT_END)
    assert (end.data or {})["outcome"] == "completed"
    assert report(run_dir)["attempts"][0]["outcome"] == "completed"  # the ledger took none of the output


FINISHED_THEN_KILLED = """
import os, signal, ettr
attempt = int(os.environ["ETTR_ATTEMPT"])
if attempt == 0:
    for step in range(1, 4):
        ettr.step(step)
else:
    ettr.resumed_from(3)  # the checkpoint of the last step
if {says_so}:
    ettr.training_ended()
ettr.get_recorder().flush()
if attempt < 3:
    os.kill(os.getpid(), signal.SIGKILL)  # killed after its training ended, and again after each resume
"""


@pytest.mark.parametrize("says_so", [True, False])
def test_a_job_killed_after_its_training_ended_is_finishing_not_stalling(
    tmp_path: Path, says_so: bool
) -> None:
    # spare_kills (seed 0): a resilient job's rank killed after its last step, then its spare, then the rank
    # restarted from that step: "2 restarts in a row reached no new step: restarts would not help" (exit 3),
    # its training over. With the end of its loop in the books the restarts are finishing and it completes;
    # without it (an unmodified script says nothing) the rule is as before.
    run_dir = tmp_path / "run"
    script = FINISHED_THEN_KILLED.format(says_so=says_so)
    done = run_ettr(
        "run", "--run-dir", str(run_dir), "--max-restarts", "3", "--", sys.executable, "-c", script
    )
    ends = [(e.data or {}).get("outcome") for e in supervisor_events(run_dir, EventKind.ATTEMPT_END)]
    if says_so:
        assert done.returncode == 0, done.stderr[-2000:]
        assert ends == ["failed", "failed", "failed", "completed"]
    else:
        assert done.returncode == 3, done.stderr[-2000:]
        assert "2 restarts in a row reached no new step: restarts would not help" in done.stderr
        assert ends == ["failed"] * 3
