"""The supervisor's parts in isolation: command lines, environment, classification, watchdog, books, Slurm."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import CodeType

import pytest

from ettr.bootstrap import pythonpath_dir
from ettr.causes import Detail, diagnose
from ettr.closing import recorded_job_id
from ettr.constants import SIGNALLED_MARK
from ettr.events import SUPERVISOR_RANK, Event, EventKind, Outcome, Phase
from ettr.heartbeat import MainThreadHeartbeat, Progress, latest_heartbeat, read_pulses
from ettr.inject import parse_spec
from ettr.procs import descendants, start_ticks
from ettr.run_env import INSTRUMENTED_ENV, Launcher, heartbeat_path, signalled_path
from ettr.supervisor import books, messages
from ettr.supervisor.classify import classify
from ettr.supervisor.command_output import exception_from_stderr
from ettr.supervisor.config import RunConfig
from ettr.supervisor.jobinfo import default_job_id, job_times, parse_scontrol_times
from ettr.supervisor.launch import attempt_launch, detect_launcher, free_port, torchrun_command
from ettr.supervisor.messages import ended_line, relay_stderr, say
from ettr.supervisor.process import AttemptProcess
from ettr.supervisor.watchdog import (
    STARTUP,
    HangBounds,
    HangWatchdog,
    JobProgress,
    learned_bounds,
    training_ended,
)


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


def test_a_free_port_is_one_no_outgoing_connection_can_hold(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import socket

    import ettr.supervisor.launch as launch

    # A port the OS gave an outgoing connection keeps a listener off it (Linux's bind conflict, even with
    # SO_REUSEADDR): the hazard of a bind(0) port that a script or a restart binds again later.
    with (
        socket.create_server(("127.0.0.1", 0)) as server,
        socket.create_connection(server.getsockname()) as out,
    ):
        with socket.socket() as listener, pytest.raises(OSError):
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", out.getsockname()[1]))
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(20000 <= p < low and p not in (29400, 29500) for p in ports) or low <= 20000
    # A port something is bound to is passed over; torchrun's defaults are never handed out.
    spare = free_port()
    with socket.create_server(("127.0.0.1", 0)) as held:
        taken = held.getsockname()[1]
        picks = iter([29500, taken, spare])
        monkeypatch.setattr(launch._RANDOM, "randrange", lambda a, b: next(picks))
        monkeypatch.setattr(launch, "_EPHEMERAL_RANGE", tmp_path / "range")
        (tmp_path / "range").write_text(f"{max(taken, spare) + 1}\t60999\n")
        assert free_port() == spare
    # No room below the range, or no range to read: the OS picks.
    for text in ("1024\t65535\n", "garbled"):
        (tmp_path / "range").write_text(text)
        with socket.socket() as again:
            again.bind(("127.0.0.1", free_port()))


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


def test_a_raise_recovered_in_place_is_booked_with_no_exit_status() -> None:
    """Under `ettr.resilient` the wrapper catches a rank's exception and its process lives on: nothing
    exited (before: "exit status 1 (rank 0): RuntimeError", exit_code 1). The cause stays the code's."""
    failure = Event(
        EventKind.FAILURE, 1.0, rank=0, data={"exception": "RuntimeError", "message": "bad batch"}
    )
    started = [Event(EventKind.PROCESS_START, 0.5, rank=r, data={"pid": 70 + r}) for r in (0, 1)]
    end = classify(
        returncode=1, events=[*started, failure], failed_pids=[[70]], raised_in_place=True, wrapper=False
    )
    assert (end.outcome, end.exit_code, end.signal) == (Outcome.FAILED, None, None)
    assert end.exception == "RuntimeError" and end.message == "bad batch"
    assert end.reason == "rank 0 raised an exception: RuntimeError; recovered in place (its process lived on)"
    assert ended_line(1, end, "continuing").startswith(
        "attempt 1 failed: rank 0 raised an exception: RuntimeError: bad batch; recovered in place"
    )
    diagnosis = diagnose(outcome=end.outcome, failure=end.to_data(), trained=True)
    assert (diagnosis.cause.value, diagnosis.detail) == ("user", Detail.EXCEPTION)
    nothing_known = classify(returncode=1, raised_in_place=True)
    assert nothing_known.reason == "a rank raised an exception; recovered in place (its process lived on)"
    assert nothing_known.exit_code is None


def test_a_rank_that_left_on_its_own_and_was_replaced_in_place_is_a_failure_not_a_completion() -> None:
    """A rank's `sys.exit(0)` inside a resilient job's `train` while its peers trained: the attempt goes on in
    place with a replacement (`InPlace.left`). Its exit status 0 read as `completed` would end the job."""
    started = [Event(EventKind.PROCESS_START, 0.5, rank=r, data={"pid": 70 + r}) for r in (0, 1)]
    end = classify(returncode=0, events=started, failed_pids=[[71]], left_in_place=True)
    assert (end.outcome, end.exit_code, end.signal) == (Outcome.FAILED, 0, None)
    assert end.reason == (
        "rank 1 exited 0 while the others still trained (it left on its own); replaced in place"
    )
    assert classify(returncode=0, left_in_place=True).reason.startswith("a rank exited 0")
    handled = classify(
        returncode=0, events=started, failed_pids=[[71]], left_in_place=True, signalled=[(1.0, 1, "SIGTERM")]
    )  # an outside SIGTERM ran its handler: a preemption of that rank alone
    assert handled.outcome is Outcome.PREEMPTED and handled.reason == (
        "rank 1 received SIGTERM, not asked of the supervisor (a scheduler or an operator), and its handler "
        "ended its process; replaced in place; exit status 0"
    )
    assert classify(returncode=0, events=started, failed_pids=[[71]]).outcome is Outcome.COMPLETED


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


def test_silence_after_every_training_process_exited_is_not_a_hang() -> None:
    """A two-node job's last step: its workers exit 0 and torchrun's agent waits for the other node (its exit
    barrier); that silence is the launcher's, not a hang to kill (and restart a completed job over)."""
    ended = [False]
    dog = HangWatchdog(
        timeout_s=3.0, probes=[lambda: 1000.0], started_at=100.0, armed_at_start=False, ended=lambda: ended[0]
    )
    assert dog.check(1005.0) == pytest.approx(5.0)
    ended[0] = True
    assert dog.check(1010.0) is None
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert training_ended([child.pid]) and not training_ended([]) and not training_ended([os.getpid()])


def test_hang_bounds_follow_what_the_job_does() -> None:
    bounds = HangBounds()
    assert bounds.bound(JobProgress()) == (300.0, "the start-up bound")
    fast = JobProgress(settled=True, step_s=0.05)
    assert bounds.bound(fast)[0] == 10.0  # the floor: 10 x 0.05 s is too little for a loaded machine
    assert bounds.bound(JobProgress(settled=True, step_s=3.0))[0] == 30.0
    in_eval = JobProgress(settled=True, step_s=0.05, phases=frozenset({"eval"}))
    assert bounds.bound(in_eval) == (300.0, "the bound of phase eval")
    learned = HangBounds(learned_s={"eval": 900.0, STARTUP: 450.0}, override_s=6.0)
    assert learned.bound(in_eval)[0] == 900.0 and learned.bound(JobProgress())[0] == 450.0
    assert learned.bound(fast) == (6.0, "--hang-timeout")  # it replaces the step bound, not the others
    assert HangBounds(override_s=600.0).bound(JobProgress())[0] == 600.0
    # --hang-timeout needs no step time: it holds from the first step, not from the fifth interval (a job of 10
    # slow steps hung at step 5 waited the 300 s start-up bound under --hang-timeout 15)
    first_steps = JobProgress(stepped=True)
    assert HangBounds(override_s=15.0).bound(first_steps) == (15.0, "--hang-timeout")
    assert bounds.bound(first_steps) == (300.0, "the start-up bound")  # the step bound needs its median
    assert (
        HangBounds(override_s=15.0).bound(JobProgress(stepped=True, phases=frozenset({"eval"})))[0] == 300.0
    )
    with pytest.raises(ValueError, match="floor_s"):
        HangBounds(floor_s=0.0)


def test_bounds_are_learned_from_the_jobs_own_books() -> None:
    events = [
        Event(EventKind.PROCESS_START, 100.0, 0, 0),
        Event(EventKind.STEP, 160.0, 0, 0, step=1),  # 60 s start-up
        Event(EventKind.STEP, 161.0, 0, 0, step=2),
        Event(EventKind.PHASE_END, 400.0, 0, 0, phase=Phase.EVAL, value=200.0),  # 200 s evaluation
        Event(EventKind.PHASE_END, 500.0, 0, 0, phase=Phase.EVAL, value=float("nan")),  # damaged: ignored
        Event(EventKind.PHASE_END, 500.0, 0, -1, phase=Phase.RESTORE, value=0.0),  # not a training process
    ]
    assert learned_bounds(events) == {STARTUP: 180.0, "eval": 600.0}


def test_silence_while_the_job_waited_for_a_cpu_is_not_counted() -> None:
    waited = {7: 5.0}
    dog = HangWatchdog(
        probes=[lambda: 100.0],
        started_at=100.0,
        armed_at_start=False,
        bounds=HangBounds(),
        progress=lambda: JobProgress(settled=True, step_s=0.1),
        starved=lambda: dict(waited),
        min_interval_s=0.0,
    )
    assert dog.check(100.0) is None
    waited.update({7: 12.0, 8: 50.0})  # 7 s of the next 12 s in the run queue; a process seen late
    assert dog.check(112.0) is None
    waited.update({7: 12.5, 8: 50.5})
    assert dog.check(118.0) == pytest.approx(10.5)  # 18 s of silence, 7.5 s of them starved


def test_pulses_are_written_by_the_sampler_and_read_back_validated(tmp_path: Path) -> None:
    progress = Progress()
    for i in range(8):
        progress.observe(Event(EventKind.STEP, 10.0 + 0.5 * i, 0, 0, step=i + 1))
    progress.observe(Event(EventKind.PHASE_BEGIN, 15.0, 0, 0, phase=Phase.EVAL))
    progress.observe(
        Event(EventKind.PHASE_BEGIN, 15.0, 0, 0, phase=Phase.CHECKPOINT_PERSIST)
    )  # beside training
    progress.observe(Event(EventKind.PHASE_END, 15.0, 0, 0, phase=Phase.RESTORE, value=1.0))  # a whole span
    path = heartbeat_path(tmp_path, 0, 0, pid=4242)
    path.parent.mkdir(parents=True)
    beat = MainThreadHeartbeat(path, progress=progress)
    assert beat.pulse() and not beat.pulse()  # once per change
    (read,) = read_pulses(tmp_path, 0)
    assert (read.rank, read.steps, read.step_s, read.num_intervals, read.phases) == (0, 8, 0.5, 7, {"eval"})
    progress.observe(Event(EventKind.PHASE_END, 16.0, 0, 0, phase=Phase.EVAL, value=15.0))
    assert beat.pulse() and read_pulses(tmp_path, 0)[0].phases == frozenset()
    forged = path.parent
    (forged / "rank-1-pid-1.pulse").write_text(
        '{"v": 1, "steps": -1, "step_s": 1, "intervals": 1, "phases": []}'
    )
    (forged / "rank-2-pid-2.pulse").write_text(
        '{"v": 1, "steps": 1, "step_s": NaN, "intervals": 1, "phases": []}'
    )
    (forged / "rank-3-pid-3.pulse").write_text("x" * 10_000)
    (forged / "rank-x-pid-4.pulse").write_text(
        '{"v": 1, "steps": 1, "step_s": 1, "intervals": 1, "phases": []}'
    )
    assert [p.rank for p in read_pulses(tmp_path, 0)] == [0]
    assert JobProgress.of(read_pulses(tmp_path, 0)) == JobProgress(settled=True, step_s=0.5, stepped=True)


def test_a_hang_says_what_each_rank_was_doing(tmp_path: Path) -> None:
    # A 2-rank job with rank 1 stopped (SIGSTOP) after step 80 was "hung: no progress and no heartbeat for
    # 10.1 s" and nothing more: which rank, and in what state, was left to guess.
    from ettr.procs import run_state
    from ettr.run_env import launcher_parent_path
    from ettr.supervisor.watchdog import describe_ranks

    asleep = subprocess.Popen(["sleep", "300"])
    stopped = subprocess.Popen(["sleep", "300"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        while run_state(asleep.pid) != "S" or run_state(stopped.pid) != "T":
            pass
        beats = heartbeat_path(tmp_path, 0, 0, pid=asleep.pid).parent
        beats.mkdir(parents=True)
        gone = subprocess.Popen(["true"])
        gone.wait()  # a rank that finished (its pid free again: nothing by it runs, or not ours)
        for rank, pid, mtime in (
            (0, asleep.pid, 95.0),
            (1, stopped.pid, 90.0),
            (2, gone.pid, 97.0),
            (3, os.getppid(), 98.0),  # one that runs, not the supervisor's: its state says nothing
        ):
            path = beats / f"rank-{rank}-pid-{pid}"
            path.touch()
            os.utime(path, (mtime, mtime))
        (beats / "rank-0-pid-4").touch()  # a Python program that started torchrun: no rank
        launcher_parent_path(tmp_path, 0, 4).parent.mkdir(parents=True, exist_ok=True)
        launcher_parent_path(tmp_path, 0, 4).touch()
        (beats / f"rank-1-pid-{stopped.pid}.pulse").write_text(
            '{"v": 1, "steps": 80, "step_s": 0.04, "intervals": 32, "phases": ["eval"]}'
        )
        said = describe_ranks(tmp_path, 0, 100.0, local={asleep.pid, stopped.pid})
    finally:
        for child in (asleep, stopped):
            child.kill()
            child.wait()
    assert said == (
        f"rank 1 (pid {stopped.pid}) quiet 10.0 s, at least 80 steps done, in eval, stopped (SIGSTOP or SIGTSTP); "
        f"rank 0 (pid {asleep.pid}) quiet 5.0 s, asleep (waiting: a collective, a lock, a sleep, I/O); "
        f"rank 2 (pid {gone.pid}) quiet 3.0 s, not running here (exited, or on another host); "
        f"rank 3 (pid {os.getppid()}) quiet 2.0 s, state unknown"  # not this supervisor's process
    )
    assert describe_ranks(tmp_path, 7, 100.0) == ""
    hung = classify(returncode=-signal.SIGTERM, hung_after_s=10.0, hung_ranks=said)
    assert hung.reason.endswith(said)
    dog = HangWatchdog(
        probes=[lambda: 100.0],
        started_at=100.0,
        armed_at_start=True,
        timeout_s=5.0,
        describe=lambda t: f"at {t}",
    )
    assert dog.check(104.0) is None and dog.ranks == ""
    assert dog.check(110.0) == 10.0 and dog.ranks == "at 110.0"


def test_a_hang_names_an_async_save_still_persisting(tmp_path: Path) -> None:
    # A DDP script calling dcp.async_save on its training process group (gloo) hung at step 31: the save's
    # collectives in its background thread and the step's all-reduce waited on each other. The hang read
    # "at least 30 steps done, asleep (waiting: a collective, ...)" on both ranks, the save unmentioned.
    from ettr.supervisor.watchdog import describe_ranks

    progress = Progress()
    progress.observe(Event(EventKind.STEP, 10.0, 0, 0, step=30))
    staged = {"path": "/c/step_30", "persist": "async"}  # the bootstrap's dcp.async_save staging span
    progress.observe(
        Event(
            EventKind.PHASE_END, 11.0, 0, 0, phase=Phase.CHECKPOINT_BLOCKING, step=30, value=10.5, data=staged
        )
    )
    sync = {"path": "/c/step_20"}  # a save that blocked for all of it: nothing in the background
    progress.observe(
        Event(
            EventKind.PHASE_END, 11.0, 0, 0, phase=Phase.CHECKPOINT_BLOCKING, step=20, value=10.5, data=sync
        )
    )
    path = heartbeat_path(tmp_path, 0, 0, pid=os.getpid())
    path.parent.mkdir(parents=True)
    beat = MainThreadHeartbeat(path, progress=progress)
    assert beat.pulse()
    (read,) = read_pulses(tmp_path, 0)
    assert read.persisting == ((30, 11.0),) and read.phases == frozenset()
    path.touch()  # the heartbeat, last beaten at 15
    os.utime(path, (15.0, 15.0))
    said = describe_ranks(tmp_path, 0, 25.0)
    assert said.startswith(f"rank 0 (pid {os.getpid()}) quiet 10.0 s, at least 1 step done, ")
    assert "an async checkpoint save of step 30 persisting for 14.0 s" in said
    assert said.endswith("give dcp.async_save a process group of its own)")
    # its future completed: the persist span of the same step and path ends it
    progress.observe(
        Event(
            EventKind.PHASE_END,
            12.0,
            0,
            0,
            phase=Phase.CHECKPOINT_PERSIST,
            step=30,
            value=11.0,
            data={"path": "/c/step_30"},
        )
    )
    assert beat.pulse() and read_pulses(tmp_path, 0)[0].persisting == ()
    assert "persisting" not in describe_ranks(tmp_path, 0, 25.0)
    # an older ettr's pulse has none; a malformed one is read as none, the pulse kept
    (path.parent / "rank-1-pid-1.pulse").write_text(
        '{"v": 1, "steps": 1, "step_s": 1, "intervals": 1, "phases": [], "persisting": [[true, 1]]}'
    )
    assert {p.rank: p.persisting for p in read_pulses(tmp_path, 0)} == {0: (), 1: ()}


def _wait_in_site(release: threading.Event) -> None:
    release.wait()


def test_a_wait_site_on_the_training_stack_opens_its_phase_in_the_pulse(tmp_path: Path) -> None:
    # A healthy job whose DataLoader workers took 15 s to start at an epoch was killed after 10 step times:
    # the wait for the workers' batch is a data wait, told by the stack (nothing recorded, nothing hooked).
    progress = Progress()
    for i in range(8):
        progress.observe(Event(EventKind.STEP, 10.0 + 0.05 * i, 0, 0, step=i + 1))
    progress.add_wait_site(_wait_in_site.__code__, Phase.DATA_WAIT.value)
    release, parked = threading.Event(), threading.Event()

    def training() -> None:
        parked.set()
        _wait_in_site(release)

    thread = threading.Thread(target=training, daemon=True)
    thread.start()
    parked.wait()
    path = heartbeat_path(tmp_path, 0, 0, pid=4242)
    path.parent.mkdir(parents=True)
    beat = MainThreadHeartbeat(path, thread_id=thread.ident, progress=progress)
    while _wait_in_site.__code__ not in _codes_on(thread):
        pass
    beat.sample()
    assert beat.pulse()
    (read,) = read_pulses(tmp_path, 0)
    assert read.phases == {"data_wait"}
    progress_now = JobProgress.of(read_pulses(tmp_path, 0))
    assert HangBounds().bound(progress_now) == (300.0, "the bound of phase data_wait")
    release.set()
    thread.join()
    beat_after = MainThreadHeartbeat(path, thread_id=threading.get_ident(), progress=progress)
    beat_after.sample()  # this thread's stack holds no wait site
    assert beat_after.pulse() and read_pulses(tmp_path, 0)[0].phases == frozenset()


def _codes_on(thread: threading.Thread) -> set[object]:
    frame = sys._current_frames().get(thread.ident or 0)
    codes = set()
    while frame is not None:
        codes.add(frame.f_code)
        frame = frame.f_back
    return codes


def _pulsed_phases(
    tmp_path: Path, thread: threading.Thread, progress: Progress, *, once_in: CodeType | None = None
) -> frozenset[str]:
    """The phases one heartbeat sample and pulse of `thread`'s stack read (first waiting, without a clock,
    until `once_in` is on that stack)."""
    path = heartbeat_path(tmp_path, 0, 0, pid=4242)
    path.parent.mkdir(parents=True)
    beat = MainThreadHeartbeat(path, thread_id=thread.ident, progress=progress)
    while once_in is not None and once_in not in _codes_on(thread):
        pass
    beat.sample()
    beat.pulse()
    return read_pulses(tmp_path, 0)[0].phases


def _worker_waits_for(path: str, worker_id: int) -> None:
    import time

    while not os.path.exists(path):
        time.sleep(0.05)


def test_a_training_thread_waiting_for_dataloader_workers_pulses_a_data_wait(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import functools

    import torch.utils.data.dataloader as dataloader

    from ettr.bootstrap.long_calls import innermost_code, watch_long_calls
    from ettr.post_import import when_imported

    assert innermost_code(getattr(object(), "_get_data", None)) is None  # a torch without the wait: no site
    progress = Progress()
    watch_long_calls(progress, when_imported)  # torch's DataLoader is imported: registered at once
    gate = tmp_path / "workers-may-start"
    loader = torch.utils.data.DataLoader(
        list(range(4)),
        batch_size=2,
        num_workers=1,
        worker_init_fn=functools.partial(_worker_waits_for, str(gate)),
    )
    got: list[object] = []
    thread = threading.Thread(target=lambda: got.extend(loader), daemon=True)
    thread.start()
    site = dataloader._MultiProcessingDataLoaderIter._get_data.__code__
    # its workers are starting: it waits for their first batch
    assert _pulsed_phases(tmp_path, thread, progress, once_in=site) == {"data_wait"}
    gate.touch()
    thread.join()
    assert len(got) == 2


class _SlowFile:
    """A file-like whose writes wait until released (slow storage, without a clock)."""

    def __init__(self) -> None:
        self.release, self.writing, self.data = threading.Event(), threading.Event(), bytearray()

    def write(self, data: bytes) -> int:
        self.writing.set()
        self.release.wait()
        self.data += data
        return len(data)

    def flush(self) -> None:
        pass


def test_a_training_thread_in_a_long_torch_save_pulses_a_checkpoint(tmp_path: Path) -> None:
    # 50 ms steps, then a synchronous 100 MB torch.save to slow storage: killed as hung after 10 s (the hooks
    # book the save's span once it returned; nothing told the pulse while it ran). Wrapped as ettr's hooks
    # wrap it (functools.wraps): the library's own code is the site.
    torch = pytest.importorskip("torch")
    import functools

    from ettr.bootstrap.long_calls import innermost_code, watch_long_calls
    from ettr.post_import import when_imported

    original = torch.serialization.save

    @functools.wraps(original)
    def wrapped(*args: object, **kwargs: object) -> object:
        return original(*args, **kwargs)

    assert innermost_code(wrapped) is original.__code__ and innermost_code(object()) is None
    progress = Progress()
    watch_long_calls(progress, when_imported)
    slow = _SlowFile()
    thread = threading.Thread(target=lambda: wrapped({"w": torch.zeros(4)}, slow), daemon=True)
    thread.start()
    slow.writing.wait()
    assert _pulsed_phases(tmp_path, thread, progress) == {"checkpoint_blocking"}
    slow.release.set()
    thread.join()
    assert torch.load(io.BytesIO(bytes(slow.data)))["w"].shape == (4,)


def test_a_training_thread_waiting_for_a_child_process_pulses_other(tmp_path: Path) -> None:
    # 20 ms steps, then `subprocess.run([... upload ...])` for 20 s after a save: killed as hung after 10 s.
    from ettr.bootstrap.long_calls import watch_long_calls
    from ettr.post_import import when_imported

    progress = Progress()
    watch_long_calls(progress, when_imported)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    thread = threading.Thread(target=child.wait, daemon=True)
    thread.start()
    assert _pulsed_phases(tmp_path, thread, progress, once_in=subprocess.Popen.wait.__code__) == {"other"}
    child.communicate(b"")
    thread.join()


def test_a_teardown_that_waits_for_its_peers_pulses_shutdown() -> None:
    # pytorch/examples' distributed/rpc/ddp_rpc: the trainers' main threads sit in `rpc.shutdown` (graceful:
    # it waits for every worker) while the master drives their loops; after their 4,000th step it took over
    # 10 s at load 18 and the job was killed as hung in every attempt. `destroy_process_group` waits too.
    pytest.importorskip("torch")
    import torch.distributed.distributed_c10d as c10d
    import torch.distributed.rpc.api as rpc_api

    from ettr.bootstrap.long_calls import innermost_code, watch_long_calls
    from ettr.post_import import when_imported

    sites: dict[object, str] = {}

    class Sites:
        def add_wait_site(self, code: object, phase: str) -> None:
            sites[code] = phase

    watch_long_calls(Sites(), when_imported)  # type: ignore[arg-type]
    for function in (rpc_api.shutdown, c10d.destroy_process_group):
        assert sites[innermost_code(function)] == Phase.SHUTDOWN.value


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


def test_an_attempt_being_stopped_when_its_supervisor_was_killed_is_closed_as_preempted(
    tmp_path: Path,
) -> None:
    # Slurm's requeue/preemption/time limit: SIGTERM to the whole job, SIGKILL `KillWait` later. A supervisor
    # killed while the job still saved had the stop on record; the requeued run closed the attempt as a lost
    # node (a failure of the infrastructure, a restart spent) instead.
    events = [
        _sup(EventKind.SUPERVISOR_START, 1.0, job_id="j"),
        _sup(EventKind.ATTEMPT_START, 2.0, 0),
        Event(EventKind.STEP, 3.0, 0, 0, step=1),
        _sup(EventKind.MARK, 3.5, 0, name=SIGNALLED_MARK, signal="SIGTERM"),
        Event(EventKind.STEP, 4.0, 0, 0, step=2),
    ]
    (end,) = books.closing_events(events, tmp_path)
    assert end.data is not None and end.data["outcome"] == "preempted" and end.data["closed_from_ledger"]
    assert "got SIGTERM" in end.data["reason"] and end.data["exit_code"] is None and end.ts == 4.0
    assert diagnose(outcome=Outcome.PREEMPTED, failure=end.data, trained=True).detail is Detail.PREEMPTED
    interrupted = [*events[:3], _sup(EventKind.MARK, 3.5, 0, name=SIGNALLED_MARK, signal="SIGINT")]
    (end,) = books.closing_events(interrupted, tmp_path)
    assert end.data is not None and end.data["outcome"] == "interrupted"
    # A mark of another attempt says nothing of this one.
    other = [*events[:3], _sup(EventKind.MARK, 3.5, 1, name=SIGNALLED_MARK, signal="SIGTERM")]
    (end,) = books.closing_events(other, tmp_path)
    assert end.data is not None and end.data["outcome"] == "failed"


def test_an_attempt_whose_ranks_took_a_schedulers_signal_is_closed_as_preempted(tmp_path: Path) -> None:
    # The script's own handler took Slurm's SIGTERM (noted by `ettr.bootstrap.outside_signals`) and the rank
    # stopped training; its supervisor was killed before the job ended (it never saw the signal itself: an
    # `scancel --signal=TERM` of the step's tasks, then the kill).
    steps = [Event(EventKind.STEP, 3.0 + i, 0, 0, step=i + 1) for i in range(3)]
    events = [
        _sup(EventKind.SUPERVISOR_START, 1.0, job_id="j"),
        _sup(EventKind.ATTEMPT_START, 2.0, 0),
        *steps,
    ]
    (end,) = books.closing_events(events)  # no run directory: nothing to read
    assert end.data is not None and end.data["outcome"] == "failed"
    note = signalled_path(tmp_path, 0, 4242, "SIGTERM")
    note.parent.mkdir(parents=True)
    note.write_text("0 4.5")
    (end,) = books.closing_events(events, tmp_path)
    assert end.data is not None and end.data["outcome"] == "preempted"
    assert "rank 0 received SIGTERM" in end.data["reason"]
    # A rank that failed before it: the signal was the failure's teardown (torchrun's), not a scheduler's.
    crashed = Event(EventKind.FAILURE, 4.2, 0, 1, data={"exception": "ValueError"})
    (end,) = books.closing_events([*events, crashed], tmp_path)
    assert end.data is not None and end.data["outcome"] == "failed"
    # A rank that trained on well after the signal was not stopped by it: a lost node, as before.
    more = [Event(EventKind.STEP, 6.0 + i, 0, 0, step=4 + i) for i in range(10)]
    (end,) = books.closing_events([*events, *more], tmp_path)
    assert end.data is not None and end.data["outcome"] == "failed"


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
    started = float(int(time.time()) - 100)  # a start time is refused years ago: one of this era
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_START_TIME": str(int(started))}
    assert default_job_id(env) == "4242"
    assert default_job_id({"SLURM_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "3"}) == "7_3"  # an older Slurm
    # Field trial: `sbatch --array=0-1` as job 12: task 0 ran as job 13 and was booked as "13_0"; Slurm calls
    # it 12_0 (squeue, sacct, the output file's %A_%a).
    task = {"SLURM_JOB_ID": "13", "SLURM_ARRAY_JOB_ID": "12", "SLURM_ARRAY_TASK_ID": "0"}
    assert default_job_id(task) == "12_0"
    assert default_job_id({}).startswith("job-")
    text = "JobId=4242 JobName=train SubmitTime=2026-11-29T10:00:00 EligibleTime=x StartTime=Unknown"
    parsed = parse_scontrol_times(text)
    assert parsed.allocated_at is None and parsed.submitted_at is not None
    asked: list[str] = []

    def scontrol(job: str) -> str:
        asked.append(job)
        return text

    times = job_times(submitted_at=None, allocated_at=None, environ=env, scontrol=scontrol)
    assert times.allocated_at == started and times.submitted_at == parsed.submitted_at
    assert asked == ["4242"]
    given = job_times(submitted_at=1.0, allocated_at=2.0, environ=env, scontrol=scontrol)
    assert (given.submitted_at, given.allocated_at) == (1.0, 2.0) and asked == ["4242"]
    assert job_times(submitted_at=None, allocated_at=None, environ={}).submitted_at is None


@pytest.mark.parametrize("value", ["0", "-1", "nan", "1e400", "abc", "99999999999"])
def test_a_slurm_start_time_that_is_none_is_booked_unknown_in_one_line(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # SLURM_JOB_START_TIME=0 (Slurm's unknown: scontrol prints a start time of 0 as StartTime=Unknown) was
    # recorded as the allocation and skipped on every read of the books ("skipped 1 unreadable ledger
    # records"); -1, nan, 1e400 were dropped with a ledger line, "abc" silently.
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_START_TIME": value}
    times = job_times(submitted_at=None, allocated_at=None, environ=env, scontrol=lambda job: "")
    assert times.allocated_at is None
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"ettr: SLURM_JOB_START_TIME={value} is ") and line.endswith("booked unknown")
    assert ("Slurm's unknown start time" in line) == (value == "0")


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


# -- what the failure line says ---------------------------------------------------------------------------
def _rank_start(rank: int, pid: int) -> Event:
    return Event(EventKind.PROCESS_START, 1.0, 0, rank, data={"pid": pid})


def test_a_worker_that_went_on_in_place_is_named_when_it_dies_in_the_next_attempt() -> None:
    # Attempt 1 after an in-place recovery: rank 0's worker (pid 100) went on from attempt 0 and recorded no
    # PROCESS_START in attempt 1; rank 1's replacement (pid 201) did. Rank 0 is SIGKILLed while the group
    # re-forms, and the replacement's rendezvous then fails on the broken connection.
    lost_peer = Event(
        EventKind.FAILURE, 2.0, 1, 1,
        data={"exception": "DistBackendError", "message": "Connection closed by peer [127.0.0.1]:29500"},
    )  # fmt: skip
    events = [_rank_start(1, 201), lost_peer]
    end = classify(returncode=-signal.SIGKILL, events=events, failed_pids=[[100]], ranks={100: 0, 201: 1})
    assert end.reason == "killed by SIGKILL (rank 0)" and end.exception is None
    # the replacement killed: named too, though it is the only rank with a PROCESS_START
    own = classify(returncode=-signal.SIGKILL, events=[_rank_start(1, 201)], failed_pids=[[201]],
                   ranks={100: 0, 201: 1})  # fmt: skip
    assert own.reason == "killed by SIGKILL (rank 1)"


def test_a_ddp_kill_of_rank_1_blames_rank_1_not_rank_0s_connection_error() -> None:
    lost_peer = Event(
        EventKind.FAILURE, 2.0, 0, 0,
        data={"exception": "DistBackendError", "message": "Connection closed by peer [127.0.0.1]:29500"},
    )  # fmt: skip
    events = [_rank_start(0, 100), _rank_start(1, 101), lost_peer]
    # ettr's agent: rank 1's worker exited first (SIGKILL); its status is the attempt's.
    agent = classify(returncode=-signal.SIGKILL, events=events, failed_pids=[[101]])
    assert agent.reason == "killed by SIGKILL (rank 1)" and agent.exception is None
    # The real torchrun: the supervisor saw rank 1's process die first; torchrun's summary has its status.
    summary = [
        "Root Cause (first observed failure):", "[0]:", "  time      : 2026-12-02_07:00:00",
        "  rank      : 1 (local_rank: 1)", "  exitcode  : -9 (pid: 101)",
        "  traceback : Signal 9 (SIGKILL) received by PID 101",
    ]  # fmt: skip
    torchrun = classify(returncode=1, events=events, failed_pids=[[77], [101, 100]], stderr_tail=summary)
    assert torchrun.signal == "SIGKILL" and torchrun.exception is None
    assert torchrun.reason == "killed by SIGKILL (rank 1; the launcher exited 1)"
    # Without knowing who died first, the recorded failure is all there is (as before).
    unknown = classify(returncode=1, events=events)
    assert unknown.exception == "DistBackendError" and unknown.reason == "exit status 1: DistBackendError"
    # The failed rank's own exception wins over the peer's.
    own = Event(EventKind.FAILURE, 1.5, 0, 1, data={"exception": "ValueError", "message": "bad batch"})
    crashed = classify(returncode=1, events=[*events, own], failed_pids=[[101]])
    assert (crashed.exception, crashed.message) == (
        "ValueError",
        "bad batch",
    ) and "(rank 1)" in crashed.reason


def test_ranks_gone_in_one_look_are_ordered_by_what_they_recorded() -> None:
    starts = [_rank_start(0, 100), _rank_start(1, 101), _rank_start(2, 102)]
    crash = Event(
        EventKind.FAILURE, 3.0, 0, 0, data={"exception": "InjectedCrash", "message": "crash@step=300"}
    )
    # mp.spawn: rank 0 raised, its spawner terminated rank 1 (no FAILURE); both gone before the next look,
    # which lists them in process-tree order.
    spawned = classify(returncode=1, events=[*starts, crash], failed_pids=[[101, 100]])
    assert spawned.exception == "InjectedCrash" and "(rank 0)" in spawned.reason
    # A rank killed outright comes before one that died of the broken collective it left behind.
    reset = Event(
        EventKind.FAILURE,
        2.0,
        0,
        0,
        data={"exception": "RuntimeError", "message": "[gloo] Connection closed by peer"},
    )
    killed = classify(returncode=1, events=[*starts, reset], failed_pids=[[100, 101]])
    assert "(rank 1)" in killed.reason and killed.exception is None
    # Two ranks that raised on their own: the earlier one.
    later = Event(EventKind.FAILURE, 4.0, 0, 2, data={"exception": "ValueError", "message": "bad batch"})
    both = classify(returncode=1, events=[*starts, later, crash], failed_pids=[[102, 100]])
    assert both.exception == "InjectedCrash" and "(rank 0)" in both.reason
    # Looks keep their order: a rank seen gone in an earlier look failed first, whatever it recorded.
    earlier = classify(returncode=1, events=[*starts, reset, later], failed_pids=[[101], [102, 100]])
    assert "(rank 1)" in earlier.reason and earlier.exception is None


def test_a_rank_sigkilled_under_torchrun_behind_a_shell_wrapper_is_a_kill_not_the_peers_reset() -> None:
    # pytorch/examples FSDP2's run_example.sh: rank 1 SIGKILLed, rank 0 died of the reset, torchrun exited 1
    # and so did the shell; torchrun's summary names rank 1's signal.
    reset = Event(
        EventKind.FAILURE,
        2.0,
        0,
        0,
        data={"exception": "RuntimeError", "message": "Connection reset by peer"},
    )
    events = [_rank_start(0, 100), _rank_start(1, 101), reset]
    summary = ["Root Cause (first observed failure):", "[0]:", "  rank      : 1 (local_rank: 1)",
               "  exitcode  : -9 (pid: 101)  (SIGKILL)", "Connection reset by peer"]  # fmt: skip
    end = classify(returncode=1, wrapper=True, events=events, failed_pids=[[101]], stderr_tail=summary)
    assert end.signal == "SIGKILL" and end.reason == "killed by SIGKILL (rank 1; the launcher exited 1)"
    assert diagnose(outcome=end.outcome, failure=end.to_data(), trained=True).detail is Detail.PROCESS_LOST


def test_a_sigkill_behind_a_shell_wrapper_is_said_as_such() -> None:
    wrapped = classify(returncode=137, wrapper=True, oom_killed=True)
    assert wrapped.signal == "SIGKILL" and wrapped.exit_code == 137 and wrapped.oom
    assert wrapped.reason.startswith("killed by SIGKILL (behind its shell wrapper, which exited 137)")
    terminated = classify(returncode=143, wrapper=True)
    assert terminated.outcome is Outcome.PREEMPTED  # a SIGTERM nobody asked the supervisor for
    assert classify(returncode=137).reason == "exit status 137"  # a program's own status stays one
    assert classify(returncode=3, wrapper=True).reason == "exit status 3"


def test_a_failure_a_shell_wrapper_hides_by_exiting_0_is_a_failure() -> None:
    # pytorch/examples word_language_model behind `bash run.sh` (`python main.py ...; echo done`): the
    # injected crash at step 50 ended the script, the wrapper exited 0, and the job read "completed".
    crashed = [
        Event(EventKind.STEP, 10.0, 0, 0, step=50),
        Event(EventKind.FAILURE, 10.1, 0, 0, data={"exception": "InjectedCrash", "message": "at step 50"}),
    ]
    hidden = classify(returncode=0, events=crashed, wrapper=True)
    assert hidden.outcome is Outcome.FAILED and hidden.exit_code == 0
    assert (hidden.exception, hidden.message) == ("InjectedCrash", "at step 50")
    assert "shell wrapper" in hidden.reason and "rank 0 died of InjectedCrash" in hidden.reason
    # A program that starts its ranks (Lightning's DDP as `python train.py`, mp.Process) and exits 0 while one
    # of them died of its exception without stepping again hides the failure just the same.
    launched = classify(returncode=0, events=crashed)
    assert launched.outcome is Outcome.FAILED and "its launcher hid the failure" in launched.reason
    # A rank that stepped after its FAILURE survived it (restart in place) or was started again.
    survived = [*crashed, Event(EventKind.STEP, 12.0, 0, 0, step=46)]
    assert classify(returncode=0, events=survived, wrapper=True).outcome is Outcome.COMPLETED
    assert classify(returncode=0, wrapper=True).outcome is Outcome.COMPLETED


def test_shell_commands_are_told_from_programs(tmp_path: Path) -> None:
    from ettr.supervisor.launch import is_shell_command

    script, env_script, python_script = tmp_path / "a.sh", tmp_path / "b", tmp_path / "c"
    script.write_text("#!/bin/bash\npython train.py\n")
    env_script.write_text("#!/usr/bin/env sh\n")
    python_script.write_text("#!/usr/bin/env python3\n")
    assert is_shell_command(["bash", "-c", "x"]) and is_shell_command(["/bin/sh", "run.sh"])
    assert is_shell_command([str(script)]) and is_shell_command([str(env_script)])
    assert not is_shell_command([str(python_script)]) and not is_shell_command(["python", "t.py"])
    assert not is_shell_command([str(tmp_path / "missing")]) and not is_shell_command([])


def test_the_failure_line_carries_the_exception_message() -> None:
    from ettr.supervisor.classify import AttemptEnd
    from ettr.supervisor.messages import ended_line

    end = classify(
        returncode=1,
        events=[
            Event(EventKind.FAILURE, 1.0, 0, 0, data={"exception": "ValueError", "message": "bad\nbatch"})
        ],
    )
    assert ended_line(2, end, "restarting in 0 s (1 of 3)") == (
        "attempt 2 failed: exit status 1: ValueError: bad; restarting in 0 s (1 of 3)"
    )
    long = AttemptEnd(
        outcome=Outcome.FAILED, exit_code=1, reason="exit status 1: E", exception="E", message="x" * 999
    )
    assert len(ended_line(0, long, "no restarts left")) < 300


def test_the_failure_line_keeps_ettrs_note_after_a_long_exception_message() -> None:
    """torch's `PytorchStreamReader failed reading zip archive` message is over 300 characters: shortened, it
    cut off the note ettr's load hook added naming the torn checkpoint file."""
    from ettr.events import failure_message
    from ettr.supervisor.messages import ended_line

    note = "ettr: /ckpt/out.pt (0 bytes) is none of the checkpoints this job saved there (steps 50, 100)"
    message = failure_message("PytorchStreamReader failed " + "x" * 600 + "\nsecond line", [note, "a user's"])
    end = classify(
        returncode=1,
        events=[Event(EventKind.FAILURE, 1.0, 1, 0, data={"exception": "RuntimeError", "message": message})],
    )
    assert end.message is not None and end.message.endswith(f"[{note}]") and "a user's" not in end.message
    line = ended_line(1, end, "restarting in 0 s (1 of 3)")
    assert "RuntimeError: PytorchStreamReader failed xxx" in line and "second line" not in line
    assert f"... [{note}]; restarting in 0 s" in line


def test_during_a_ledger_outage_the_attempts_failure_is_read_from_the_spill_files(tmp_path: Path) -> None:
    import json

    from ettr.ledger import LedgerError, MemoryLedger
    from ettr.ledger.rows import to_row
    from ettr.ledger.spill import spill_dir

    class Away(MemoryLedger):
        def read(self) -> list[Event]:
            raise LedgerError("the ledger server is unreachable")

    failure = Event(
        EventKind.FAILURE, 5.0, 3, 0, data={"exception": "InjectedCrash", "message": "crash@step=7"}
    )
    directory = spill_dir(tmp_path)
    directory.mkdir()
    for job, name in (("j", "w1.jsonl"), ("other", "w2.jsonl")):
        header = {"spill": 1, "job_id": job, "writer": name, "node": "h"}
        (directory / name).write_text(json.dumps(header) + "\n" + json.dumps([0, *to_row(failure)]) + "\n")
    job_books = books.JobBooks(
        RunConfig(command=("true",)), run_dir=tmp_path, job_id="j", family="f", ledger=Away()
    )
    assert job_books.attempt_events(3) == [failure]  # this job's file only
    assert job_books.failure_recorded(3) and not job_books.failure_recorded(4)


# -- the job's end ----------------------------------------------------------------------------------------
def test_the_job_end_hook_runs_once_after_the_books_close_and_a_failing_one_changes_nothing(
    tmp_path: Path,
) -> None:
    from ettr.ledger import read_run_events
    from ettr.supervisor.supervise import Supervisor

    calls: list[tuple[Path, str | None, str, list[EventKind]]] = []

    def hook(run_dir: Path, *, ledger_url: str | None, job_id: str) -> None:
        calls.append((run_dir, ledger_url, job_id, [e.kind for e in read_run_events(run_dir)]))
        raise RuntimeError("a broken hook")

    config = RunConfig(command=("true",), run_dir=str(tmp_path / "run"), job_id="j1", max_restarts=0)
    assert Supervisor(config, at_job_end=hook).run() == 0
    ((run_dir, ledger_url, job_id, kinds),) = calls
    assert (run_dir, ledger_url, job_id) == ((tmp_path / "run").absolute(), None, "j1")
    assert kinds[-1] is EventKind.JOB_END  # the books were complete when it ran


def test_a_signal_from_outside_that_the_scripts_own_handler_ended_the_job_on_is_a_preemption() -> None:
    # A scheduler signals the training processes, not `ettr run`; the script's handler saves and exits 0
    # (Lightning's SIGTERMException is a SystemExit), or 1: the job stopped early, it did not complete.
    stepped = [Event(EventKind.STEP, 10.0, 0, 0, step=20)]
    signalled = [(10.5, 0, "SIGTERM")]
    for code in (0, 1):
        end = classify(returncode=code, events=stepped, signalled=signalled)
        assert end.outcome is Outcome.PREEMPTED and end.signal == "SIGTERM" and end.exit_code == code
        assert end.reason.startswith("rank 0 received SIGTERM, not asked of the supervisor")
    usr1 = classify(returncode=0, events=stepped, signalled=[(10.5, 1, "SIGUSR1")])  # Slurm's --signal
    assert usr1.outcome is Outcome.PREEMPTED and "rank 1 received SIGUSR1" in usr1.reason
    # Rank 1 died of its own exception first; rank 0 got a SIGTERM from an operator after: a failure.
    crashed = [*stepped, Event(EventKind.FAILURE, 10.2, 0, 1, data={"exception": "KeyError", "message": "k"})]
    assert classify(returncode=1, events=crashed, signalled=signalled).outcome is Outcome.FAILED
    # Lightning DDP: rank 0 exits 0 on the SIGTERM, rank 1 then dies of the broken connection.
    reset = {"exception": "RuntimeError", "message": "Connection closed by peer"}
    broken = [*stepped, Event(EventKind.FAILURE, 11.0, 0, 1, data=reset)]
    preempted = classify(returncode=0, events=broken, signalled=signalled)
    assert (
        preempted.outcome is Outcome.PREEMPTED and preempted.exception is None
    )  # the reset: its consequence
    assert classify(returncode=0, events=stepped).outcome is Outcome.COMPLETED  # nothing noted: completed
    # A handler that saved and went on training (a SIGUSR1 "save now"), or let the job finish: completed.
    went_on = [*stepped, *(Event(EventKind.STEP, 11.0 + i, 0, 0, step=21 + i) for i in range(6))]
    assert classify(returncode=0, events=went_on, signalled=signalled).outcome is Outcome.COMPLETED
    assert classify(returncode=0, events=went_on[:6], signalled=signalled).outcome is Outcome.PREEMPTED
    # When the signal came is the preemption's onset (the accounting's failure instant), kept in the books.
    from ettr.supervisor.classify import AttemptEnd

    end = classify(returncode=0, events=stepped, signalled=signalled)
    assert end.signalled_ts == 10.5 and AttemptEnd.from_data(end.to_data()).signalled_ts == 10.5
    assert "signalled_ts" not in classify(returncode=0, events=stepped).to_data()


def test_torchruns_own_word_that_it_got_a_signal_is_read() -> None:
    from ettr.supervisor.command_output import torchrun_signal

    tail = [
        '    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)',
        "torch.distributed.elastic.multiprocessing.api.SignalException: Process 25627 got signal: 15",
    ]
    assert torchrun_signal(tail) == signal.SIGTERM and torchrun_signal(["exit status 1"]) is None
    end = classify(returncode=1, stderr_tail=tail)  # `exec torchrun` behind a wrapper, its group signalled
    assert end.outcome is Outcome.PREEMPTED and end.signal == "SIGTERM"
    assert end.reason.startswith("SIGTERM to torchrun, which stopped its workers and exited 1")
    # The launcher noted when the signal reached it: that is the preemption's onset (the accounting's failure
    # instant; the workers' stop after it is the restart's), and the launcher, no rank, got it.
    from ettr.run_env import LAUNCHER_SIGNAL_RANK

    noted = classify(returncode=1, stderr_tail=tail, signalled=[(10.5, LAUNCHER_SIGNAL_RANK, "SIGTERM")])
    assert noted.outcome is Outcome.PREEMPTED and noted.signal == "SIGTERM" and noted.signalled_ts == 10.5
    assert noted.reason.startswith("its launcher received SIGTERM, not asked of the supervisor"), noted.reason
    assert noted.reason.endswith("SIGTERM to torchrun, which stopped its workers and exited 1")


def test_signals_the_scripts_handlers_saw_are_noted_and_their_handlers_kept(tmp_path: Path) -> None:
    from ettr.run_env import signals_received

    code = (
        "import os, signal, sys\n"
        "from ettr.bootstrap.outside_signals import install\n"
        f"install({str(tmp_path)!r}, 3, 1)\n"
        "from ettr.bootstrap.outside_signals import stop_received\n"
        "def mine(s, f): print('handled', s, 'stop received', stop_received(), flush=True); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, mine)\n"
        "assert signal.getsignal(signal.SIGTERM) is mine\n"  # Lightning checks what is installed
        "assert signal.signal(signal.SIGTERM, mine) is mine\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"  # not watched: left as it is
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "import time; time.sleep(10)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "handled 15" in done.stdout, done.stderr
    assert "stop received True" in done.stdout  # ettr.resilient lets what it raises now through
    found = signals_received(tmp_path, 3)
    assert [(rank, name) for _, rank, name in found] == [(1, "SIGTERM")]
    assert signals_received(tmp_path, 3, before=found[0][0]) == []  # only those before the command ended


def test_a_signal_again_while_the_scripts_handler_for_it_runs_is_not_delivered_inside_it() -> None:
    # Slurm's requeue SIGTERMs every process of the job and `ettr run` forwards its own: a handler that saved
    # and exited ran again inside itself (field trial: "saving at step 51" twice, the first save abandoned).
    from ettr.bootstrap.outside_signals import noting

    calls: list[str] = []
    noted: list[int] = []

    def mine(signum: int, frame: object) -> str:
        calls.append("enter")
        assert wrapped(signum, None) is None  # the same stop again, within its own handling: dropped
        calls.append("leave")
        return "done"

    wrapped = noting(mine, noted.append)
    assert wrapped(signal.SIGTERM, None) == "done"
    assert calls == ["enter", "leave"] and noted == [signal.SIGTERM]
    assert wrapped(signal.SIGTERM, None) == "done" and calls.count("enter") == 2  # later: delivered as ever


def test_a_real_second_sigterm_during_the_scripts_handler_is_dropped(tmp_path: Path) -> None:
    code = (
        "import os, signal, sys\n"
        "from ettr.bootstrap.outside_signals import install\n"
        f"install({str(tmp_path)!r}, 0, 0)\n"
        "calls = []\n"
        "def save_and_exit(s, f):\n"
        "    calls.append(s)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)  # the supervisor's forward, during the save\n"
        "    for _ in range(100000):  # Python checks for signals between bytecodes: here it ran again\n"
        "        pass\n"
        "    print('saved', len(calls), flush=True); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, save_and_exit)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "import time; time.sleep(10)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.split() == ["saved", "1"], (done.stdout, done.stderr)


def test_a_launchers_word_that_its_child_was_killed_is_a_kill_not_the_codes_exception() -> None:
    # `accelerate launch` of one process (and any program that runs the training with subprocess.run(check=
    # True)): its traceback says its child died of SIGKILL; that is no exception of the training code.
    tail = [
        "Traceback (most recent call last):",
        '  File "/venv/bin/accelerate", line 8, in <module>',
        "subprocess.CalledProcessError: Command '['/venv/bin/python', 'train.py']' died with <Signals.SIGKILL: 9>.",
    ]
    end = classify(returncode=1, stderr_tail=tail)
    assert (end.outcome, end.signal, end.exception) == (Outcome.FAILED, "SIGKILL", None)
    assert end.reason == "killed by SIGKILL (the launcher exited 1)"
    assert diagnose(outcome=end.outcome, failure=end.to_data(), trained=True).detail is Detail.PROCESS_LOST
    exited = [*tail[:2], "subprocess.CalledProcessError: Command 'x' returned non-zero exit status 1."]
    assert classify(returncode=1, stderr_tail=exited).exception == "CalledProcessError"


def test_the_report_names_no_peers_exception_for_a_killed_rank() -> None:
    from ettr.report.text import _failure_lines

    failure = {
        "reason": "killed by SIGKILL (rank 1)",
        "signal": "SIGKILL",
        "process_failure": {"exception": "RuntimeError", "message": "Connection closed by peer", "rank": 0},
    }
    assert not any("RuntimeError" in line for line in _failure_lines(0, "failed", failure))
    failure.pop("signal")
    assert any(
        "RuntimeError: Connection closed by peer (rank 0)" in line
        for line in _failure_lines(0, "failed", failure)
    )


def test_an_injected_kill_that_a_wrapper_exiting_0_hid_is_a_failure() -> None:
    # `python run_clm.py ...; echo` behind `bash run.sh`: ettr's own --inject kill@step=40 SIGKILLed the
    # training process (no FAILURE can be written), the wrapper exited 0, and the job read "completed".
    fired = {"name": "inject", "spec": "kill@step=40,attempt=0,rank=0", "at": "step 40"}
    killed = [Event(EventKind.STEP, 10.0, 0, 0, step=40), Event(EventKind.MARK, 10.1, 0, 0, data=fired)]
    end = classify(returncode=0, events=killed, wrapper=True)
    assert (end.outcome, end.signal, end.exception) == (Outcome.FAILED, "SIGKILL", None)
    assert "rank 0 died of SIGKILL" in end.reason
    assert diagnose(outcome=end.outcome, failure=end.to_data(), trained=True).detail is Detail.PROCESS_LOST
    crash = {**fired, "spec": "crash@step=40,attempt=0,rank=0"}  # a crash writes its FAILURE itself
    assert (
        classify(
            returncode=0, events=[killed[0], Event(EventKind.MARK, 10.1, 0, 0, data=crash)], wrapper=True
        ).outcome
        is Outcome.COMPLETED
    )


def test_a_death_the_wrapper_reported_while_exiting_0_is_a_failure() -> None:
    # `python train.py ...; echo done` behind bash, the training process OOM-killed: bash says so on stderr
    # (`line 3:   731 Killed   python ...`) and exits with the echo's 0.
    from ettr.supervisor.command_output import shell_reported_deaths

    tail = ["./run.sh: line 3:   731 Killed                  python run_clm.py --output_dir out", "done"]
    assert shell_reported_deaths(tail) == {731: signal.SIGKILL}
    assert shell_reported_deaths(
        ["run.sh: line 9: 12 Segmentation fault      (core dumped) python t.py"]
    ) == {12: signal.SIGSEGV}
    started = [
        Event(EventKind.PROCESS_START, 1.0, 0, 0, data={"pid": 731}),
        Event(EventKind.STEP, 10.0, 0, 0, step=40),
    ]
    end = classify(returncode=0, events=started, stderr_tail=tail, wrapper=True)
    assert (end.outcome, end.signal, end.exception) == (Outcome.FAILED, "SIGKILL", None)
    assert "rank 0 died of SIGKILL" in end.reason
    other = ["./run.sh: line 3:   99 Killed   sleep 100"]  # a process of the script that is no rank
    assert (
        classify(returncode=0, events=started, stderr_tail=other, wrapper=True).outcome is Outcome.COMPLETED
    )
    assert classify(returncode=0, events=started, stderr_tail=tail).outcome is Outcome.COMPLETED  # no shell


def test_srun_s_status_names_the_signal_its_task_died_of() -> None:
    from ettr.supervisor.launch import is_shell_command

    assert is_shell_command(["srun", "-n", "1", "python", "train.py"])
    assert is_shell_command(["/usr/bin/srun", "python", "train.py"])
    # `scancel --signal=TERM` reaches the step's task, not `ettr run`: srun exits 143
    end = classify(returncode=143, wrapper=is_shell_command(["srun", "python", "train.py"]))
    assert end.outcome is Outcome.PREEMPTED and end.signal == "SIGTERM"


def test_srun_is_named_srun_not_a_shell_wrapper() -> None:
    # Field trial: `ettr run -- srun python train.py` under B:USR1 said "killed by SIGKILL (behind its shell
    # wrapper, which exited 137)": there is no shell, srun ran the task.
    from ettr.supervisor.launch import wrapper_name

    assert wrapper_name(["/usr/bin/srun", "python", "train.py"]) == "srun"
    assert wrapper_name(["bash", "-c", "python train.py"]) == "shell wrapper"
    assert wrapper_name(["python", "train.py"]) == ""
    end = classify(returncode=137, wrapper=wrapper_name(["srun", "python", "train.py"]), preempted_by=10)
    assert end.reason.endswith("killed by SIGKILL (its srun task; srun exited 137)"), end.reason
    assert "shell" not in end.reason and end.outcome is Outcome.PREEMPTED
    shell = classify(returncode=137, wrapper=wrapper_name(["bash", "-c", "python train.py"]))
    assert shell.reason.startswith("killed by SIGKILL (behind its shell wrapper, which exited 137)")


def test_a_second_different_signal_is_no_insistence() -> None:
    from ettr.supervisor.signals import SupervisorSignals

    signals = SupervisorSignals()
    signals._on_signal(signal.SIGUSR1, None)  # Slurm's warning, then its SIGTERM of a requeue
    signals._on_signal(signal.SIGTERM, None)
    assert signals.count == 2 and not signals.insisted
    signals._on_signal(signal.SIGUSR1, None)  # asked again
    assert signals.insisted
    operator = SupervisorSignals()
    operator._on_signal(signal.SIGTERM, None)
    operator._on_signal(signal.SIGINT, None)  # a person's Ctrl-C after it
    assert operator.insisted


def test_what_a_process_or_a_forged_ledger_wrote_is_printed_without_its_escape_sequences() -> None:
    from ettr.family import valid_family
    from ettr.supervisor.classify import AttemptEnd
    from ettr.supervisor.messages import ended_line
    from ettr.untrusted import printable

    osc52 = "\x1b]52;c;cm0gLXJmIH4=\x07"  # sets the clipboard in some terminals
    end = AttemptEnd(
        outcome=Outcome.FAILED, exit_code=1, reason="exit status 1: E", exception="E", message=osc52
    )
    line = ended_line(0, end, "no restarts left")
    assert "\x1b" not in line and "\x07" not in line and "\\x1b]52" in line
    assert printable("a\nb\x1b[2J") == "a\nb\\x1b[2J" and printable("plain 🏖") == "plain 🏖"
    # styling is dropped, not escaped: torch.load's weights_only error, bold in the middle of a failure's line
    assert (
        printable("two options, \x1b[1mdo those steps\x1b[0m.\n\t(1)") == "two options, do those steps.\n (1)"
    )
    assert printable("\x1b[1m\x1b]52;c;x\x07") == "\\x1b]52;c;x\\x07"
    assert valid_family("evil\x1b[2J") == "must not hold control characters" and valid_family("gpt-2") is None


def test_a_rank_sigkilled_under_mp_spawn_is_a_kill_not_the_peers_reset() -> None:
    # imagenet-style `ettr run -- bash run.sh` -> `python main.py` -> mp.spawn(2): rank 1 SIGKILLed, rank 0
    # died of the reset (its FAILURE), the spawning process raised ProcessExitedException and exited 1.
    reset = Event(
        EventKind.FAILURE,
        2.0,
        0,
        0,
        data={"exception": "RuntimeError", "message": "[gloo] Read error: Connection reset by peer"},
    )
    events = [_rank_start(0, 100), _rank_start(1, 101), reset]
    tail = ["RuntimeError: [gloo] Read error: Connection reset by peer",
            '  File ".../torch/multiprocessing/spawn.py", line 192, in join',
            "torch.multiprocessing.spawn.ProcessExitedException: process 1 terminated with signal SIGKILL"]  # fmt: skip
    end = classify(
        returncode=1,
        wrapper=True,
        events=events,
        failed_pids=[[101]],
        stderr_tail=tail,
        stopped_after_rank_failure=True,  # ettr saw rank 0's FAILURE and stopped what was left
    )
    assert end.signal == "SIGKILL" and end.reason == "killed by SIGKILL (rank 1; the launcher exited 1)"
    assert diagnose(outcome=end.outcome, failure=end.to_data(), trained=True).detail is Detail.PROCESS_LOST
    # The rank that failed first raised: its exception is the failure, whatever signal mp.spawn names after.
    crash = Event(EventKind.FAILURE, 1.0, 0, 1, data={"exception": "ValueError", "message": "bad batch"})
    raised = classify(returncode=1, events=[*events, crash], failed_pids=[[101]], stderr_tail=tail)
    assert raised.signal is None and raised.exception == "ValueError"


def test_a_handler_that_saves_some_steps_after_the_signal_then_stops_ended_the_job() -> None:
    # transformers' JIT checkpoint (`enable_jit_checkpoint=True`, trainer_jit_checkpoint.py): its SIGTERM handler
    # waits 3 s, then the Trainer saves at the next step boundary and stops. At 0.2 s a step that is 15 steps
    # after the signal: field trial, tiny GPT-2, SIGTERM to the trainer at step 45, checkpoint-60, last step 61,
    # exit 0: booked `completed` at step 61 of 120, `ettr run` exited 0 and the scheduler never requeued it.
    signalled = [(10.5, 0, "SIGTERM")]
    before = [Event(EventKind.STEP, 10.0, 0, 0, step=45)]
    after = [Event(EventKind.STEP, 10.6 + 0.2 * i, 0, 0, step=46 + i) for i in range(15)]  # steps 46..60
    commit = Event(EventKind.CHECKPOINT_COMMIT, 13.7, 0, 0, step=60)
    last = Event(EventKind.STEP, 13.9, 0, 0, step=61)
    jit = [*before, *after, commit, last]
    end = classify(returncode=0, events=jit, signalled=signalled)
    assert end.outcome is Outcome.PREEMPTED and end.signalled_ts == 10.5
    assert end.reason.startswith("rank 0 received SIGTERM, not asked of the supervisor")
    # A handler that saved at once and went on training to the job's end ("save now"): completed, as before.
    went_on = [*before, Event(EventKind.CHECKPOINT_COMMIT, 10.7, 0, 0, step=45), *after, last]
    assert classify(returncode=0, events=went_on, signalled=signalled).outcome is Outcome.COMPLETED
    # A signal the handler did not act on, then the job's regular saves to its end: completed.
    regular = [*before, *after[:7], Event(EventKind.CHECKPOINT_COMMIT, 11.9, 0, 0, step=52), *after[7:], last]
    assert classify(returncode=0, events=regular, signalled=signalled).outcome is Outcome.COMPLETED


def test_the_sigterm_torchrun_sends_the_rest_after_a_rank_was_killed_is_no_preemption() -> None:
    # Field trial: a DDP script with its own SIGTERM handler (save, sys.exit) behind `bash run.sh` -> torchrun;
    # rank 1 SIGKILLed mid-evaluation. torchrun saw it die and sent SIGTERM to rank 0, whose handler saved and
    # exited: booked "preempted: rank 0 received SIGTERM, not asked of the supervisor (a scheduler or an
    # operator)", a restart not counted, the SIGKILL no failure at all.
    events = [_rank_start(0, 100), _rank_start(1, 101), Event(EventKind.STEP, 10.0, 0, 0, step=75)]
    summary = ["Root Cause (first observed failure):", "[0]:", "  rank      : 1 (local_rank: 1)",
               "  exitcode  : -9 (pid: 101)  (SIGKILL)"]  # fmt: skip
    signalled = [(10.5, 0, "SIGTERM")]
    end = classify(returncode=1, wrapper=True, events=events, failed_pids=[[101]], stderr_tail=summary,
                   signalled=signalled)  # fmt: skip
    assert end.outcome is Outcome.FAILED and end.signal == "SIGKILL"
    assert diagnose(outcome=end.outcome, failure=end.to_data(), trained=True).detail is Detail.PROCESS_LOST
    # The scheduler signalled every rank; rank 1 had no handler and died of the SIGTERM itself: a preemption.
    termed = [*summary[:3], "  exitcode  : -15 (pid: 101)  (SIGTERM)"]
    end = classify(returncode=1, wrapper=True, events=events, failed_pids=[[101]], stderr_tail=termed,
                   signalled=signalled)  # fmt: skip
    assert end.outcome is Outcome.PREEMPTED
    # Rank 1 noted the signal too (its handler was slow, the scheduler's SIGKILL came after its grace).
    both = [*signalled, (10.5, 1, "SIGTERM")]
    end = classify(returncode=1, wrapper=True, events=events, failed_pids=[[101]], stderr_tail=summary,
                   signalled=both)  # fmt: skip
    assert end.outcome is Outcome.PREEMPTED


def test_the_sigterm_ettr_sent_torchrun_after_a_rank_failed_is_no_preemption() -> None:
    # `bash run.sh` -> torchrun, rank 1 raised; ettr stopped the rest, torchrun among them, which said
    # `SignalException: Process N got signal: 15` and exited 1 (bash then exits 1, not 143): it read "preempted:
    # SIGTERM to torchrun ..., not asked of the supervisor", not counted (tests/test_nested_launcher.py, at times).
    crash = {"exception": "InjectedCrash", "message": "crash@step=6"}
    events = [_rank_start(0, 100), _rank_start(1, 101), Event(EventKind.FAILURE, 2.0, 0, 1, data=crash)]
    tail = ["torch.distributed.elastic.multiprocessing.api.SignalException: Process 99 got signal: 15"]
    end = classify(returncode=1, wrapper=True, events=events, failed_pids=[[101]], stderr_tail=tail,
                   stopped_after_rank_failure=True)  # fmt: skip
    assert end.outcome is Outcome.FAILED and end.exception == "InjectedCrash"
    # Without ettr's stop, torchrun's word that it got a SIGTERM is a scheduler's (as before).
    assert classify(returncode=1, wrapper=True, stderr_tail=tail).outcome is Outcome.PREEMPTED


def _site_then_deep(release: threading.Event, parked: threading.Event, depth: int) -> None:
    _descend(release, parked, depth)


def _descend(release: threading.Event, parked: threading.Event, depth: int) -> None:
    if depth > 0:
        _descend(release, parked, depth - 1)
        return
    parked.set()
    release.wait()


def test_a_wait_site_far_below_the_top_of_the_stack_still_opens_its_phase(tmp_path: Path) -> None:
    # Dynamo's `_compile` sat up to 121 frames below the top during an inductor compile: the sampler looked
    # at 64 and never saw it.
    progress = Progress()
    progress.add_wait_site(_site_then_deep.__code__, Phase.COMPILE.value)
    release, parked = threading.Event(), threading.Event()
    thread = threading.Thread(target=_site_then_deep, args=(release, parked, 150), daemon=True)
    thread.start()
    parked.wait()
    assert _pulsed_phases(tmp_path, thread, progress) == {"compile"}
    release.set()
    thread.join()


def test_a_training_thread_inside_a_torch_compile_pulses_a_compile(tmp_path: Path) -> None:
    # nanoGPT with compile=True: 379 s of compilation at load 40 before its first step, booked as `compile`
    # only once it returned; meanwhile its pulse said nothing (the console: `cold start: interpreter, imports,
    # model build, restore`; after training began, the step bound applied to a recompile). The backend here
    # runs inside Dynamo's frame compilation, as inductor does, and waits there.
    torch = pytest.importorskip("torch")

    from ettr.bootstrap.long_calls import watch_long_calls
    from ettr.post_import import when_imported

    progress = Progress()
    watch_long_calls(progress, when_imported)
    release, parked = threading.Event(), threading.Event()

    def backend(gm: object, example_inputs: object) -> object:
        parked.set()
        release.wait()
        return gm.forward  # type: ignore[attr-defined]

    compiled = torch.compile(lambda x: x * 2 + 1, backend=backend)
    got: list[object] = []
    thread = threading.Thread(target=lambda: got.append(compiled(torch.ones(3))), daemon=True)
    thread.start()
    assert parked.wait(600)
    assert "compile" in _pulsed_phases(tmp_path, thread, progress)
    release.set()
    thread.join()
    assert got and got[0].tolist() == [3.0, 3.0, 3.0]  # type: ignore[attr-defined]


def test_a_line_of_ettr_after_a_progress_bar_starts_on_a_line_of_its_own(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Lightning Fabric's build_your_own_trainer draws tqdm bars on stderr (`\rEpoch 0:  42%|...]`, no newline):
    # ettr's lines were glued to the bar (`...train_accuracy: 0.094]ettr: attempt 0: first training step ...`).
    code = "import sys; sys.stderr.write('\\rEpoch 0:  42%|####'); sys.stderr.flush()"
    proc = AttemptProcess([sys.executable, "-c", code], dict(os.environ))
    assert proc.wait(60) == 0
    proc.finish()
    say("attempt 0: first training step 5.7 s after its start")
    err = capsys.readouterr().err
    assert err.endswith("\rEpoch 0:  42%|####\nettr: attempt 0: first training step 5.7 s after its start\n")
    # After a line the job ended, and after a line of ettr's, no empty line.
    relay_stderr(b"step 1\n", None)
    say("one")
    say("two")
    assert capsys.readouterr().err == "step 1\nettr: one\nettr: two\n"
    relay_stderr(b"bar\r", None)  # a carriage return leaves the bar on the line
    say("three")
    assert capsys.readouterr().err == "bar\r\nettr: three\n"


def test_a_line_of_ettr_from_the_jobs_side_after_a_progress_bar_starts_on_a_line_of_its_own(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # `ettr run --inject kill@step=30` over a tqdm loop: the injector's line, written inside the job, was glued
    # to the bar (`... 27/60 [00:00<00:00, 39.53it/s]ettr: injecting kill at step 30 (...)`): only the tee sees
    # the stream, so the job marks where its line starts and the tee starts it on a line of its own.
    log = tmp_path / "own.log"
    code = (
        "import logging, sys; from ettr.warn import mark_line_starts, say\n"
        "assert not logging.getLogger('ettr').filters  # importing ettr changes no logger\n"
        "mark_line_starts(); mark_line_starts()  # as the bootstrap's start does; once is enough\n"
        "assert len(logging.getLogger('ettr').filters) == 1\n"
        "sys.stderr.write('\\rEpoch 0:  45%|####'); sys.stderr.flush()\n"
        "say('ettr: injecting kill at step 30')\n"
        "sys.stderr.write('\\rEpoch 0:  46%|####'); sys.stderr.flush()\n"
        "logging.getLogger('ettr').warning('ettr: a warning of the job side')\n"
        "say('ettr: after a line of its own')\n"
        f"with open({str(log)!r}, 'w') as sys.stderr: say('ettr: to a file')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(messages.__file__).parents[2])}
    proc = AttemptProcess([sys.executable, "-c", code], env)
    assert proc.wait(60) == 0
    proc.finish()
    err = capsys.readouterr().err
    assert err.endswith(
        "\rEpoch 0:  45%|####\nettr: injecting kill at step 30\n"
        "\rEpoch 0:  46%|####\nettr: a warning of the job side\nettr: after a line of its own\n"
    ), repr(err)
    assert "\x1f" not in "".join(proc.stderr_tail())
    assert log.read_text() == "ettr: to a file\n"  # a file of the job's own: no mark in it


def test_the_tee_finds_a_line_mark_split_between_two_reads(capsys: pytest.CaptureFixture[str]) -> None:
    from ettr.supervisor.messages import MarkCarry
    from ettr.warn import LINE_MARK

    mark = LINE_MARK.encode()
    carry = MarkCarry()
    stream = b"\rbar 1" + mark + b"ettr: one\n" + mark + b"ettr: two\n\rbar 2" + mark[:1]
    for chunk in (stream[:7], stream[7:], mark[1:] + b"ettr: three\n"):
        relay_stderr(carry.take(chunk), None)
    relay_stderr(carry.rest(), None)
    assert capsys.readouterr().err == "\rbar 1\nettr: one\nettr: two\n\rbar 2\nettr: three\n"
    relay_stderr(carry.take(b"\rbar 3\x1f"), None)
    relay_stderr(carry.rest(), None)  # the stream ended: what was held is the job's
    assert capsys.readouterr().err == "\rbar 3\x1f"
