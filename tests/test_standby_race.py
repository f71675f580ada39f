"""A restart never waits on a standby at idle priority (`ettr.supervisor.standby.Standby.take`): a warm one
takes the attempt at once, one still warming is promoted to normal priority (every thread) first, anything
else starts cold at once; each path is recorded with why (the `relaunch` MARK, the TTR's relaunch part).

The fast tests drive the supervisor's side with a stand-in standby (a small Python child that speaks the
status pipe: `w` when warm, `h` when it has the request); the end-to-end one runs `ettr run` with a standby
whose `import torch` is held until the test lets it go.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ettr.accounting.ttr import AttemptMilestones, recovery_parts
from ettr.constants import RELAUNCH_MARK
from ettr.events import SUPERVISOR_RANK, EventKind
from ettr.ledger import read_run_events
from ettr.procs import normal_scheduling, tasks
from ettr.supervisor.process import AttemptProcess
from ettr.supervisor.relaunch import Relaunch, WarmUpNotice
from ettr.supervisor.standby import Standby
from ettr.supervisor.standby_group import StandbyGroup

ROOT = Path(__file__).resolve().parent.parent

# A stand-in standby: idle priority (where it may leave it again), one extra thread, says `w` when the file
# WARM exists (or at once without one), reads the request, says `h`, writes what it saw to OUT.
STAND_IN = """
import json, os, sys, threading, time
request_fd, status_fd, warm_file, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
if sys.argv[5] == "idle":
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
while warm_file != "-" and not os.path.exists(warm_file):
    time.sleep(0.02)
try:
    os.write(status_fd, b"w")
except BrokenPipeError:  # the supervisor stopped listening (as ettr.bootstrap.standby, it goes on)
    pass
with os.fdopen(request_fd, "rb") as pipe:
    raw = pipe.read()
try:
    os.write(status_fd, b"h")
except BrokenPipeError:  # the supervisor stopped listening
    pass
policies = sorted({os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{os.getpid()}/task")})
with open(out, "w") as f:
    json.dump({"request": json.loads(raw) if raw else None, "policies": policies}, f)
"""


def _may_leave_idle() -> bool:
    """Whether a process here may go from SCHED_IDLE back to SCHED_OTHER (root, CAP_SYS_NICE, RLIMIT_NICE)."""
    probe = "import os; os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0)); os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def _stand_in(tmp_path: Path, *, warm_file: str, idle: bool) -> tuple[Standby, Path]:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    out = tmp_path / "seen.json"
    request_read, request_write = os.pipe()
    status_read, status_write = os.pipe()
    os.set_blocking(status_read, False)
    env = dict(os.environ)
    try:
        process = AttemptProcess(
            [sys.executable, str(script), str(request_read), str(status_write), warm_file, str(out),
             "idle" if idle else "normal"],
            env,
            pass_fds=[request_read, status_write],
        )  # fmt: skip
    finally:
        os.close(request_read)
        os.close(status_write)
    python = (os.path.abspath(sys.executable),)
    stable = {k: v for k, v in env.items() if not k.startswith("ETTR_")}  # as Standby.start keeps it
    standby = Standby(process, request_write, python, stable, os.getcwd(), status_fd=status_read)
    standby.idle = idle  # it goes idle itself (`Standby.start` would have put it there)
    return standby, out


def _attempt(tmp_path: Path) -> list[str]:
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    return [sys.executable, str(script)]


def test_a_warm_standby_takes_the_attempt_at_once(tmp_path: Path) -> None:
    standby, out = _stand_in(tmp_path, warm_file="-", idle=False)
    standby.poll_status(timeout_s=60)  # it says `w` at once
    assert standby.warm
    argv = _attempt(tmp_path)
    process, how = standby.take(argv, dict(os.environ))
    assert how.path == "warm" and how.why.startswith("standby ready (warm "), how
    assert process is standby.process
    assert process.wait(60) == 0
    assert json.loads(out.read_text())["request"]["argv"] == argv


def test_a_standby_still_warming_is_promoted_every_thread_and_then_takes_the_attempt(tmp_path: Path) -> None:
    if not _may_leave_idle():
        pytest.skip("no process here may leave SCHED_IDLE again: standbys warm up at normal priority")
    warm_file = tmp_path / "warm"
    standby, out = _stand_in(tmp_path, warm_file=str(warm_file), idle=True)
    deadline = time.monotonic() + 60
    while len(tasks(standby.process.pid)) < 2 or os.sched_getscheduler(standby.process.pid) != os.SCHED_IDLE:
        assert time.monotonic() < deadline, "the stand-in never went idle"
        time.sleep(0.02)
    assert not standby.warm
    argv = _attempt(tmp_path)
    process, how = standby.take(argv, dict(os.environ))
    assert process is standby.process and how.path == "promoted"
    assert "still warming" in how.why and "promoted to normal priority" in how.why
    assert {os.sched_getscheduler(t) for t in tasks(process.pid)} == {os.SCHED_OTHER}  # every thread
    warm_file.touch()  # its warm-up ends: it reads the request it was handed
    assert process.wait(60) == 0
    seen = json.loads(out.read_text())
    assert seen["request"]["argv"] == argv and seen["policies"] == [os.SCHED_OTHER]


def test_an_in_place_replacement_takes_its_rank_s_standby_still_warming_or_starts_cold_at_once(
    tmp_path: Path,
) -> None:
    """A rank that died in a restart in place (`StandbyGroup.take_rank`) never waits on a standby at idle
    priority: its standby still warming is promoted and takes the rank; a rank without one starts cold."""
    warm_file = tmp_path / "warm"
    standby, out = _stand_in(tmp_path, warm_file=str(warm_file), idle=False)
    group = StandbyGroup([standby, None])
    argv = _attempt(tmp_path)
    process, how, promoted = group.take_rank(0, argv, dict(os.environ))
    assert process is standby.process and how.path == "promoted" and "still warming" in how.why
    assert promoted is standby  # for the console's notice: the survivors wait for its warm-up
    assert group.standbys == [None, None]  # taken: `fill` starts the rank's next one
    cold, how, promoted = group.take_rank(1, argv, dict(os.environ))
    assert cold is not standby.process and (how.path, how.why) == ("cold", "no standby for this rank")
    assert promoted is None
    warm_file.touch()
    assert process.wait(60) == 0 and cold.wait(60) == 0
    assert json.loads(out.read_text())["request"]["argv"] == argv


def test_survivors_waiting_for_a_promoted_in_place_replacement_are_told_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """An in-place recovery whose replacement is a standby still warming: the survivors wait in the
    rendezvous for its warm-up, and the console says so, as for a process restart (it said nothing but the
    attempt's start: 20 s of silence on a busy node)."""
    from ettr.supervisor.agent import WorkerSpec
    from ettr.supervisor.attempt import AttemptPlan
    from ettr.supervisor.inplace import InPlace
    from ettr.supervisor.launch import AttemptLaunch
    from ettr.supervisor.worker_kind import WorkerGroupKind
    from ettr.supervisor.workers import WorkerGroup

    warm_file = tmp_path / "warm"
    standby, _ = _stand_in(tmp_path, warm_file=str(warm_file), idle=False)
    argv = _attempt(tmp_path)
    kind = WorkerGroupKind(
        WorkerSpec(nproc=2, argv=tuple(argv)), run_dir=tmp_path / "run", max_restarts=1, teardown_grace_s=1.0
    )
    kind._workers = ([argv, argv], [dict(os.environ), dict(os.environ)])
    kind._standbys = StandbyGroup([None, standby])
    monkeypatch.setattr(kind, "_env", lambda plan, rank, port: dict(os.environ))
    survivor = AttemptProcess([sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ))
    dead = AttemptProcess([sys.executable, "-c", "pass"], dict(os.environ))
    dead.wait(60)
    group = WorkerGroup([survivor, dead], flush_s=0.0, teardown_grace_s=1.0)
    group.continued = InPlace(failed_rank=1, returncode=-9, dead=(1,))
    plan = AttemptPlan(attempt=1, launch=AttemptLaunch(argv=tuple(argv), env=dict(os.environ)))
    try:
        kind.continue_in_place(group, plan)
        assert group.relaunch is not None and group.relaunch.path == "promoted"
        assert group.notice is not None
        deadline, err = time.monotonic() + 60, ""
        while "waiting for" not in err:
            assert time.monotonic() < deadline, err
            time.sleep(0.05)
            err += capsys.readouterr().err
        assert "attempt 1: waiting for the standby of rank 1 to finish its warm-up" in err
        warm_file.touch()
        assert standby.process.wait(60) == 0
        deadline = time.monotonic() + 60
        while "standby ready after" not in err:
            assert time.monotonic() < deadline, err
            time.sleep(0.05)
            err += capsys.readouterr().err
    finally:
        survivor.signal_tree(9)
        group.finish()


def test_a_standby_that_does_not_fit_is_dropped_and_says_why(tmp_path: Path) -> None:
    standby, _ = _stand_in(tmp_path, warm_file="-", idle=False)
    argv = _attempt(tmp_path)
    process, how = standby.take(argv, {**os.environ, "SOMETHING_NEW": "1"})
    assert process is None and how.path == "cold"
    assert how.why == "standby dropped: the environment changed (SOMETHING_NEW)"
    assert standby.process.poll() is not None  # discarded: it never runs the attempt


def test_the_console_says_what_a_relaunch_waits_for(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    warm_file = tmp_path / "warm"
    standby, _ = _stand_in(tmp_path, warm_file=str(warm_file), idle=False)
    process, how = standby.take(_attempt(tmp_path), dict(os.environ))
    assert process is not None and how.path == "promoted"
    notice = WarmUpNotice(4, [("rank 1", standby)], after_s=0.0)  # say it at the first look
    notice.start()
    deadline, err = time.monotonic() + 60, ""
    while "waiting for" not in err:
        assert time.monotonic() < deadline
        time.sleep(0.02)
        err += capsys.readouterr().err
    assert "attempt 4: waiting for the standby of rank 1 to finish its warm-up" in err
    warm_file.touch()
    assert process.wait(60) == 0
    notice.stop()
    assert "attempt 4: standby ready after" in capsys.readouterr().err


def test_several_ranks_relaunch_as_their_slowest_path() -> None:
    ranks = [
        Relaunch(path="warm", why="standby ready (2.0 s before)"),
        Relaunch(path="promoted", why="standby still warming"),
    ]
    both = Relaunch.of_ranks(ranks)
    assert (both.path, both.why) == ("promoted", "standby still warming (rank 1)")
    assert both.to_data()["ranks"] == [
        {"rank": 0, "path": "warm", "why": "standby ready (2.0 s before)"},
        {"rank": 1, "path": "promoted", "why": "standby still warming"},
    ]
    assert Relaunch.of_ranks([*ranks, Relaunch(path="cold", why="no standby for this rank")]).path == "cold"


def test_promoting_a_process_that_is_not_idle_changes_nothing() -> None:
    assert normal_scheduling(os.getpid())
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


def test_the_relaunch_part_of_the_ttr_says_which_path_ran_and_why() -> None:
    def attempt(index: int, start: float, end: float, **more: object) -> AttemptMilestones:
        fields: dict = dict(
            index=index, start_ts=start, end_ts=end, failure_ts=None, detected_ts=None, backoff_end_ts=None,
            process_start_ts=None, imports_ts=None, training_start_ts=None, first_step_ts=None, phases=(),
        )  # fmt: skip
        return AttemptMilestones(**{**fields, **more})

    failed = attempt(0, 0.0, 10.0, failure_ts=9.0, detected_ts=9.5)
    data = {"name": RELAUNCH_MARK, "path": "promoted", "why": "standby still warming (0.4 s of CPU in 3.0 s)"}
    recovered = attempt(
        1, 10.0, 30.0, process_start_ts=14.0, training_start_ts=20.0, first_step_ts=21.0, relaunch=data
    )
    parts = recovery_parts(failed, recovered)
    assert parts is not None and parts.parts_s["relaunch"] == 4.0
    assert (parts.relaunch_path, parts.relaunch_why) == ("promoted", data["why"])
    unknown = recovery_parts(failed, attempt(1, 10.0, 30.0, training_start_ts=20.0, first_step_ts=21.0))
    assert unknown is not None and unknown.relaunch_path is None


def test_the_supervisor_records_the_relaunch_of_every_attempt_and_the_report_shows_it(tmp_path: Path) -> None:
    """No standby here (`--no-auto`, a job that never steps): every attempt says it started cold, and why."""
    from ettr.report.load import read_run
    from ettr.report.ttr_parts import text_lines, to_json

    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys, ettr\nettr.step(1)\nsys.exit(3 if os.environ['ETTR_ATTEMPT'] == '0' else 0)\n"
    )
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "ETTR_STANDBY": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "ettr.cli", "run", "--run-dir", str(run_dir), "--max-restarts", "1", "--no-auto",
         "--", sys.executable, str(script)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    marks = [
        (e.attempt, e.data["path"], e.data["why"])
        for e in read_run_events(run_dir)
        if e.kind is EventKind.MARK and e.rank == SUPERVISOR_RANK and e.data.get("name") == RELAUNCH_MARK
    ]
    assert marks == [
        (0, "cold", "the first attempt this supervisor started"),
        (1, "cold", "standbys are off (ETTR_STANDBY=0)"),
    ]
    _, report = read_run(run_dir)
    (parts,) = report.ttr_parts
    assert to_json(parts)["relaunch_path"] == "cold"  # type: ignore[index]
    assert "  relaunch 0->1: cold (standbys are off (ETTR_STANDBY=0))" in text_lines(report)


# A stand-in `torch` whose import holds the standby in its warm-up until the file TORCH_RELEASE exists.
HELD_TORCH = """
import os, time, types
compiler = types.SimpleNamespace(is_compiling=lambda: False)  # what ettr's recorder asks of torch
while not os.path.exists(os.environ["TORCH_RELEASE"]):
    time.sleep(0.02)
"""
PROBE = """
import json, os, sys, time
import ettr
out = os.environ["PROBE_OUT"]
attempt = os.environ["ETTR_ATTEMPT"]
with open(out, "a") as f:
    f.write(json.dumps({"attempt": attempt, "pid": os.getpid(), "torch": "torch" in sys.modules,
                        "policy": os.sched_getscheduler(0)}) + "\\n")
ettr.step(1)  # the first step: the supervisor starts the next attempt's standby now
if attempt == "0":
    deadline = time.monotonic() + 120
    while not os.path.exists(os.environ["STANDBY_SEEN"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(3)
"""


def test_a_restart_promotes_a_standby_still_in_its_warm_up_and_says_what_it_waits_for(tmp_path: Path) -> None:
    held = tmp_path / "held"
    (held / "torch").mkdir(parents=True)
    (held / "torch" / "__init__.py").write_text(HELD_TORCH)
    script = tmp_path / "job.py"
    script.write_text(PROBE)
    release, seen, out = tmp_path / "release", tmp_path / "standby-seen", tmp_path / "probe.jsonl"
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{held}",
        "TORCH_RELEASE": str(release),
        "STANDBY_SEEN": str(seen),
        "PROBE_OUT": str(out),
    }
    env.pop("ETTR_STANDBY", None)
    job = subprocess.Popen(
        [sys.executable, "-m", "ettr.cli", "run", "--run-dir", str(run_dir), "--max-restarts", "1", "--no-auto",
         "--", sys.executable, str(script)],
        env=env, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    said: list[str] = []
    reader = threading.Thread(target=lambda: said.extend(iter(job.stderr.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        deadline = time.monotonic() + 240
        standby_pid = None
        while standby_pid is None:  # attempt 0 has stepped; its standby sits in its held `import torch`
            assert time.monotonic() < deadline and job.poll() is None
            time.sleep(0.05)
            standby_pid = _standby_of(job.pid)
        seen.touch()  # attempt 0 fails now; attempt 1 is handed to the standby still warming
        start = None
        while start is None:
            assert time.monotonic() < deadline and job.poll() is None
            time.sleep(0.05)
            start = _relaunch_mark(run_dir, 1)
        assert start["path"] == "promoted" and "still warming" in start["why"]
        assert {os.sched_getscheduler(t) for t in tasks(standby_pid)} == {os.SCHED_OTHER}
        waiting = "attempt 1: waiting for the standby of the attempt to finish its warm-up"
        while not any(waiting in line for line in said):  # the console says what the restart waits for
            assert time.monotonic() < deadline and job.poll() is None
            time.sleep(0.05)
        release.touch()
        job.wait(timeout=240)
        reader.join(60)
    finally:
        if job.poll() is None:
            job.kill()
    err = "".join(said)
    assert job.returncode == 0, err
    assert "attempt 1: standby ready after" in err
    first, second = (json.loads(line) for line in out.read_text().splitlines())
    assert second["attempt"] == "1" and second["pid"] == standby_pid and second["torch"]  # ran in the standby
    assert second["policy"] == os.SCHED_OTHER


def _standby_of(supervisor: int) -> int | None:
    """The supervisor's `ettr.bootstrap.standby` child, once it is there."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if b"ettr.bootstrap.standby" in cmdline and int(stat[1]) == supervisor:
            return int(name)
    return None


def _relaunch_mark(run_dir: Path, attempt: int) -> dict | None:
    try:
        events = read_run_events(run_dir)
    except Exception:
        return None
    for e in events:
        if e.kind is EventKind.MARK and e.attempt == attempt and (e.data or {}).get("name") == RELAUNCH_MARK:
            return dict(e.data)
    return None
