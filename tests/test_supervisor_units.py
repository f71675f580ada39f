"""The supervisor's parts in isolation: command lines, environment, classification, watchdog, books, Slurm."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ettr.bootstrap import pythonpath_dir
from ettr.closing import recorded_job_id
from ettr.events import SUPERVISOR_RANK, Event, EventKind, Outcome
from ettr.heartbeat import MainThreadHeartbeat, latest_heartbeat
from ettr.inject import parse_spec
from ettr.procs import descendants, start_ticks
from ettr.run_env import INSTRUMENTED_ENV, Launcher
from ettr.supervisor import books
from ettr.supervisor.classify import classify, exception_from_stderr
from ettr.supervisor.config import RunConfig
from ettr.supervisor.jobinfo import default_job_id, job_times, parse_scontrol_times
from ettr.supervisor.launch import attempt_launch, detect_launcher, torchrun_command
from ettr.supervisor.process import AttemptProcess
from ettr.supervisor.watchdog import HangWatchdog


# -- command lines ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("command", "launcher"),
    [
        (["torchrun", "--nproc-per-node=2", "train.py"], Launcher.TORCHRUN),
        (["/venv/bin/torchrun", "train.py"], Launcher.TORCHRUN),
        (["python3", "-m", "torch.distributed.run", "train.py"], Launcher.TORCHRUN),
        (["python", "train.py", "-m", "torch.distributed.run"], Launcher.PYTHON),
        (["/usr/bin/python3.11", "train.py"], Launcher.PYTHON),
        (["bash", "run.sh"], Launcher.OTHER),
    ],
)
def test_detect_launcher(command: list[str], launcher: Launcher) -> None:
    assert detect_launcher(command) is launcher


def test_torchrun_gets_a_fresh_port_and_no_restarts_of_its_own() -> None:
    out = torchrun_command(
        [
            "torchrun",
            "--nproc_per_node",
            "2",
            "--max_restarts",
            "5",
            "--master-port=29500",
            "train.py",
            "--master-port",
            "1",
            "--lr=3",
        ],
        41234,
    )
    assert out == [
        "torchrun", "--nproc_per_node=2", "--master-port=41234", "--max-restarts=0", "train.py",
        "--master-port", "1", "--lr=3",
    ]  # fmt: skip
    # No port given: the static rendezvous gets one; c10d gets a local endpoint.
    assert torchrun_command(["torchrun", "--standalone", "t.py"], 5) == [
        "torchrun", "--standalone", "--max-restarts=0", "t.py",
    ]  # fmt: skip
    assert torchrun_command(["python", "-m", "torch.distributed.run", "-m", "pkg.train"], 7) == [
        "python", "-m", "torch.distributed.run", "-m", "--max-restarts=0", "--master-port=7", "pkg.train",
    ]  # fmt: skip
    assert (
        torchrun_command(["torchrun", "--rdzv-backend=c10d", "t.py"], 9)[-2] == "--rdzv-endpoint=127.0.0.1:9"
    )
    local = torchrun_command(["torchrun", "--rdzv_endpoint", "localhost:29400", "t.py"], 11)
    assert "--rdzv_endpoint=localhost:11" in local
    remote = torchrun_command(["torchrun", "--rdzv-endpoint=node7:29400", "t.py"], 11)
    assert "--rdzv-endpoint=node7:29400" in remote  # other nodes could not follow a new port


def test_attempt_environment(tmp_path: Path) -> None:
    launch = attempt_launch(
        ["python", "train.py"],
        run_dir=tmp_path,
        job_id="j1",
        attempt=2,
        started_at=123.5,
        inject=(parse_spec("crash@step=1"),),
        auto=False,
        base_env={"PYTHONPATH": "/mine", INSTRUMENTED_ENV: "99", "KEEP": "1"},
    )
    env = launch.env
    assert env["ETTR_RUN_DIR"] == str(tmp_path) and env["ETTR_JOB_ID"] == "j1" and env["ETTR_ATTEMPT"] == "2"
    assert env["PYTHONPATH"] == f"{pythonpath_dir()}{os.pathsep}/mine"
    assert (pythonpath_dir() / "sitecustomize.py").is_file()
    assert sorted(p.name for p in pythonpath_dir().iterdir() if p.suffix == ".py") == ["sitecustomize.py"]
    assert env["ETTR_AUTO"] == "0" and env["ETTR_SUPERVISOR_PID"] == str(os.getpid())
    assert float(env["ETTR_ATTEMPT_STARTED_AT"]) == 123.5 and "crash" in env["ETTR_INJECT"]
    assert INSTRUMENTED_ENV not in env and env["KEEP"] == "1"


def test_run_config_validates() -> None:
    with pytest.raises(ValueError, match="command"):
        RunConfig(command=())
    with pytest.raises(ValueError, match="max_restarts"):
        RunConfig(command=("x",), max_restarts=-1)
    with pytest.raises(ValueError, match="hang_timeout_s"):
        RunConfig(command=("x",), hang_timeout_s=0)
    with pytest.raises(ValueError, match="job_id"):
        RunConfig(command=("x",), job_id="a/b")


# -- classification ---------------------------------------------------------------------------------------
TRACEBACK = [
    "step 3",
    "Traceback (most recent call last):",
    '  File "train.py", line 9, in <module>',
    "    main()",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
]


def test_exception_type_from_the_last_traceback() -> None:
    assert exception_from_stderr(TRACEBACK) == "OutOfMemoryError"
    assert exception_from_stderr(["Traceback (most recent call last):", "  x", "KeyboardInterrupt"]) == (
        "KeyboardInterrupt"
    )
    assert exception_from_stderr(["no traceback here"]) is None


def test_classify_each_way_an_attempt_ends() -> None:
    done = classify(returncode=0)
    assert done.outcome is Outcome.COMPLETED and done.exit_code == 0 and done.signal is None

    oom = classify(returncode=1, stderr_tail=TRACEBACK)
    assert oom.outcome is Outcome.FAILED and oom.exception == "OutOfMemoryError" and oom.oom
    assert oom.to_data()["stderr_tail"] == TRACEBACK

    process_said = [Event(EventKind.FAILURE, 1.0, data={"exception": "ValueError"})]
    failed = classify(returncode=1, stderr_tail=["ChildFailedError:"], events=process_said)
    assert failed.exception == "ValueError" and not failed.oom and "ValueError" in failed.reason

    killed = classify(returncode=-signal.SIGKILL, oom_killed=True)
    assert (killed.outcome, killed.exit_code, killed.signal, killed.oom) == (
        Outcome.FAILED,
        137,
        "SIGKILL",
        True,
    )
    assert "out of memory" in killed.reason

    hung = classify(returncode=-signal.SIGTERM, hung_after_s=4.2)
    assert hung.outcome is Outcome.HUNG and "4.2 s" in hung.reason

    preempted = classify(returncode=-signal.SIGTERM, preempted_by=signal.SIGTERM)
    assert preempted.outcome is Outcome.PREEMPTED and preempted.exit_code == 143
    graceful = classify(returncode=0, preempted_by=signal.SIGTERM)  # the script saved and exited cleanly
    assert graceful.outcome is Outcome.PREEMPTED
    outside = classify(returncode=-signal.SIGTERM)  # a scheduler signalled the job itself
    assert outside.outcome is Outcome.PREEMPTED

    marks = [Event(EventKind.MARK, 1.0, data={"name": "inject", "spec": "kill@step=3,attempt=0,rank=0"})]
    injected = classify(returncode=-signal.SIGKILL, events=marks)
    assert injected.injected == "kill@step=3,attempt=0,rank=0" and "injected kill" in injected.reason


# -- hang watchdog ----------------------------------------------------------------------------------------
def test_watchdog_counts_silence_from_the_latest_sign_of_life() -> None:
    seen: list[float | None] = [None]
    dog = HangWatchdog(timeout_s=3.0, probes=[lambda: seen[0]], started_at=100.0, armed_at_start=False)
    assert dog.check(1000.0) is None  # never alive: not armed (a default timeout spares silent commands)
    seen[0] = 1000.0
    assert dog.check(1002.0) is None
    assert dog.check(1003.5) == pytest.approx(3.5)
    seen[0] = 1003.4  # a late sign of life is read again before a hang is called
    assert dog.check(1004.0) is None

    armed = HangWatchdog(timeout_s=3.0, probes=[lambda: None], started_at=100.0, armed_at_start=True)
    assert armed.check(102.0) is None and armed.check(103.5) == pytest.approx(3.5)

    def broken() -> float:
        raise OSError("gone")

    sturdy = HangWatchdog(timeout_s=1.0, probes=[broken, lambda: 50.0], started_at=0.0, armed_at_start=False)
    assert sturdy.check(50.5) is None and sturdy.check(52.0) == pytest.approx(2.0)


def test_heartbeat_beats_only_when_the_watched_thread_moves(tmp_path: Path) -> None:
    first, second, done = threading.Event(), threading.Event(), threading.Event()
    parked = threading.Event()

    def training() -> None:
        parked.set()
        first.wait()
        second.set()
        done.wait()

    thread = threading.Thread(target=training, daemon=True)
    thread.start()
    parked.wait()
    path = tmp_path / "heartbeats" / "attempt-0" / "rank-0"
    beat = MainThreadHeartbeat(path, thread_id=thread.ident)
    path.parent.mkdir(parents=True)
    path.touch()
    os.utime(path, (1.0, 1.0))
    assert beat.sample() is True  # the first look is news
    os.utime(path, (1.0, 1.0))
    assert beat.sample() is False and beat.sample() is False  # blocked in first.wait(): no beat
    assert latest_heartbeat(tmp_path, 0) == 1.0
    first.set()
    second.wait()
    while not beat.sample():  # it moved on to done.wait(); a sample sees it once it is parked there
        pass
    assert latest_heartbeat(tmp_path, 0) > 1.0
    done.set()
    thread.join()
    assert latest_heartbeat(tmp_path, 7) is None


# -- books ------------------------------------------------------------------------------------------------
def _sup(kind: EventKind, ts: float, attempt: int = 0, **data: object) -> Event:
    return Event(kind, ts, attempt, SUPERVISOR_RANK, data=data or None)


def test_closing_the_books_a_killed_supervisor_left_open() -> None:
    events = [
        _sup(EventKind.SUPERVISOR_START, 1.0, job_id="j"),
        _sup(EventKind.ATTEMPT_START, 2.0, 0),
        Event(EventKind.STEP, 3.0, 0, 0, step=1),
        _sup(EventKind.ATTEMPT_END, 4.0, 0, outcome="failed"),
        _sup(EventKind.ATTEMPT_START, 5.0, 1),
        Event(EventKind.STEP, 7.5, 1, 1, step=2),
        Event(EventKind.STEP, 7.0, 1, 0, step=2),
    ]
    closing = books.closing_events(events)
    assert len(closing) == 1
    end = closing[0]
    assert (end.kind, end.attempt, end.rank, end.ts) == (EventKind.ATTEMPT_END, 1, SUPERVISOR_RANK, 7.5)
    assert end.data is not None and end.data["outcome"] == "failed" and end.data["closed_from_ledger"]
    assert books.next_attempt(events) == 2 and books.next_attempt([]) == 0
    assert recorded_job_id(events) == "j" and recorded_job_id([]) is None
    assert books.closing_events(events + closing) == []


def test_a_live_supervisor_is_told_from_a_dead_one_and_from_a_reused_pid() -> None:
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as other:
        try:
            ticks = start_ticks(other.pid)
            host = os.uname().nodename
            alive = [_sup(EventKind.SUPERVISOR_START, 1.0, pid=other.pid, host=host, pid_start_ticks=ticks)]
            assert books.live_supervisor(alive) == other.pid
            reused = [_sup(EventKind.SUPERVISOR_START, 1.0, pid=other.pid, host=host, pid_start_ticks=-5)]
            assert books.live_supervisor(reused) is None
            elsewhere = [_sup(EventKind.SUPERVISOR_START, 1.0, pid=other.pid, host="node-xyz")]
            assert books.live_supervisor(elsewhere) is None
            assert books.live_supervisor(alive + [_sup(EventKind.JOB_END, 2.0, exit_status=0)]) is None
        finally:
            other.kill()


# -- Slurm ------------------------------------------------------------------------------------------------
def test_job_id_and_times_from_slurm() -> None:
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_START_TIME": "1700000100"}
    assert default_job_id(env) == "4242"
    assert default_job_id({"SLURM_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "3"}) == "7_3"
    assert default_job_id({}).startswith("job-")
    text = "JobId=4242 JobName=train SubmitTime=2026-11-29T10:00:00 EligibleTime=x StartTime=Unknown"
    parsed = parse_scontrol_times(text)
    assert parsed.allocated_at is None and parsed.submitted_at is not None
    asked: list[str] = []

    def scontrol(job: str) -> str:
        asked.append(job)
        return text

    times = job_times(submitted_at=None, allocated_at=None, environ=env, scontrol=scontrol)
    assert times.allocated_at == 1700000100.0 and times.submitted_at == parsed.submitted_at
    assert asked == ["4242"]
    given = job_times(submitted_at=1.0, allocated_at=2.0, environ=env, scontrol=scontrol)
    assert (given.submitted_at, given.allocated_at) == (1.0, 2.0) and asked == ["4242"]
    assert job_times(submitted_at=None, allocated_at=None, environ={}).submitted_at is None


# -- process tree -----------------------------------------------------------------------------------------
def test_attempt_process_keeps_the_stderr_tail_and_reaches_its_whole_tree(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    code = (
        "import subprocess, sys, time, pathlib\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
        "print('line one', file=sys.stderr); print('line two', file=sys.stderr, flush=True)\n"
        f"pathlib.Path({str(ready)!r}).write_text(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    proc = AttemptProcess([sys.executable, "-c", code], dict(os.environ))
    try:
        while not ready.exists() or not ready.read_text():
            assert proc.wait(0.05) is None
        grandchild = int(ready.read_text())
        assert grandchild in [pid for pid, _ in descendants(proc.pid)]
        proc.signal_tree(signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
        proc.finish()
        assert proc.stderr_tail() == ["line one", "line two"]
        # The grandchild, in a session of its own, got the signal too.
        for _ in range(600):
            if start_ticks(grandchild) is None or _is_zombie(grandchild):
                break
            threading.Event().wait(0.05)
        assert start_ticks(grandchild) is None or _is_zombie(grandchild)
    finally:
        proc.signal_tree(signal.SIGKILL)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_python_options_before_the_torchrun_module_are_kept() -> None:
    command = ["python3", "-u", "-X", "faulthandler", "-mtorch.distributed.run", "--nproc-per-node=2", "t.py"]
    assert detect_launcher(command) is Launcher.TORCHRUN
    assert torchrun_command(command, 3) == [
        "python3", "-u", "-X", "faulthandler", "-mtorch.distributed.run", "--nproc-per-node=2",
        "--max-restarts=0", "--master-port=3", "t.py",
    ]  # fmt: skip
    assert detect_launcher(["python3", "-c", "import x", "-m", "torch.distributed.run"]) is Launcher.PYTHON


# -- signals ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGINT])
def test_a_signal_before_the_first_attempt_ends_the_job_with_its_books_closed(
    tmp_path: Path, sig: int, capsys: pytest.CaptureFixture[str]
) -> None:
    from ettr.ledger import read_run_events
    from ettr.supervisor.supervise import Supervisor

    marker = tmp_path / "never-ran"
    supervisor = Supervisor(RunConfig(command=("touch", str(marker)), run_dir=str(tmp_path / "run")))
    supervisor.signals._on_signal(sig, None)  # arrived while `ettr run` was starting
    status = supervisor.run()
    assert status == (130 if sig == signal.SIGINT else 143) and not marker.exists()
    events = read_run_events(tmp_path / "run")
    assert [e.kind for e in events] == [EventKind.SUPERVISOR_START, EventKind.JOB_END]
    assert events[-1].data == {"exit_status": status, "num_attempts": 0, "outcome": None}
    assert "Traceback" not in capsys.readouterr().err


def test_hangups_and_quits_reach_the_job_as_sigterm() -> None:
    from ettr.supervisor.signals import HANDLED, forwarded_signal

    assert {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP, signal.SIGQUIT} <= set(HANDLED)
    assert [forwarded_signal(s) for s in (signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGTERM)] == [
        signal.SIGTERM
    ] * 4
    assert forwarded_signal(signal.SIGINT) == signal.SIGINT
