"""The console while an attempt starts: what it waits for once a second has passed without a training step,
again at growing intervals, and when the first step came (pure, on a fake clock; the end-to-end line is
checked in test_supervisor_e2e.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ettr.supervisor.startwait import LATER_LINES_S, StartupWait


def _lines(
    wait: StartupWait, times: list[float], *, trained_from: float = float("inf")
) -> list[tuple[float, str]]:
    said = []
    for now in times:
        if wait.due(now):
            line = wait.check(now, trained=now >= trained_from)
            if line is not None:
                said.append((now, line))
    return said


def test_a_quick_start_says_nothing() -> None:
    wait = StartupWait(1, 100.0, path="warm")
    assert _lines(wait, [100.2, 100.5, 100.9, 101.5], trained_from=100.8) == []
    assert wait.done and not wait.due(200.0)


def test_a_slow_cold_start_says_what_it_waits_for_then_when_it_trained() -> None:
    wait = StartupWait(2, 0.0, path="cold")
    ticks = [i * 0.5 for i in range(1, 60)]  # polls every 0.5 s up to 29.5 s; first step at 14 s
    said = _lines(wait, ticks, trained_from=14.0)
    assert said == [
        (
            1.0,
            "attempt 2: waiting for its first training step (cold start: interpreter, imports, model build, restore)",
        ),
        (
            10.0,
            "attempt 2: still no training step after 10 s (cold start: interpreter, imports, model build, restore)",
        ),
        (14.0, "attempt 2: first training step 14.0 s after its start"),
    ]


def test_a_start_that_never_trains_is_said_at_growing_intervals() -> None:
    wait = StartupWait(0, 0.0, path="promoted")
    said = _lines(wait, [float(t) for t in range(1, 1500)])
    assert [t for t, _ in said] == [1.0, *LATER_LINES_S, LATER_LINES_S[-1] * 2, LATER_LINES_S[-1] * 3, 1200.0]
    assert "standby promoted from its warm-up" in said[0][1]


def test_a_late_look_skips_the_lines_it_missed() -> None:
    wait = StartupWait(1, 0.0, path="in_place")
    assert wait.check(45.0, trained=False) == (
        "attempt 1: waiting for its first training step (restart in place: rejoining the process group, restore)"
    )
    assert not wait.due(45.0) or wait.check(45.0, trained=False) is None  # next at 60 s, not 10 s and 30 s
    assert wait.check(60.0, trained=False) is not None


def test_an_unknown_path_still_says_start_up() -> None:
    wait = StartupWait(3, 0.0, path="requeue")
    assert wait.check(2.0, trained=False) == "attempt 3: waiting for its first training step (start-up)"


SLOW_START = """
import time

import ettr

time.sleep(2.5)  # the start-up: past the first second without a step
ettr.step(1)
time.sleep(3.0)  # room for the supervisor to see the step before the job ends
ettr.step(2)
"""


@pytest.mark.slow
def test_ettr_run_says_what_a_slow_start_waits_for(tmp_path: Path) -> None:
    script = tmp_path / "slow_start.py"
    script.write_text(SLOW_START)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    done = subprocess.run(
        [sys.executable, "-m", "ettr.cli", "run", "--run-dir", str(tmp_path / "run"), "--", sys.executable,
         str(script)],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("ettr: attempt 0: ")]
    assert lines[0] == (
        "ettr: attempt 0: waiting for its first training step (cold start: interpreter, imports, model build, "
        "restore)"
    ), done.stderr
    assert any(line.startswith("ettr: attempt 0: first training step ") for line in lines), done.stderr


def test_a_rank_started_without_the_bootstrap_is_named_once() -> None:
    # A wrapper's `export PYTHONPATH=$PWD` ran the ranks without ettr: the console said "still no training
    # step after 60 s (cold start: ...)" about a job that had trained 80 steps and hung, for ever.
    asked = []

    def unbooted() -> str | None:
        asked.append(1)
        return "pid 7 (python3) runs without ettr's bootstrap" if len(asked) >= 2 else None

    wait = StartupWait(0, 0.0, path="cold", unbooted=unbooted)
    said = [line for _, line in _lines(wait, [1.0, 10.0, 30.0, 60.0, 120.0])]
    assert said == [
        "attempt 0: waiting for its first training step (cold start: interpreter, imports, model build, restore)",
        "attempt 0: still no training step after 10 s (cold start: interpreter, imports, model build, restore)",
        "attempt 0: still no training step after 30 s: pid 7 (python3) runs without ettr's bootstrap",
        "attempt 0: still no training step after 60 s (a process runs without ettr's bootstrap: its steps are "
        "not seen)",
        "attempt 0: still no training step after 120 s (a process runs without ettr's bootstrap: its steps are "
        "not seen)",
    ]
    assert len(asked) == 2  # not asked before 10 s, nor once it said it


def test_unbooted_python_finds_a_python_child_whose_pythonpath_was_replaced(tmp_path: Path) -> None:
    from ettr.run_env import RUN_DIR_ENV, heartbeat_path
    from ettr.supervisor.startwait import unbooted_python

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {**os.environ, RUN_DIR_ENV: str(run_dir), "PYTHONPATH": str(tmp_path)}
    code = "import sys; sys.stdin.read()"
    replaced = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE)
    try:
        said = None
        while said is None:  # until the child runs Python (its exe is the interpreter)
            said = unbooted_python(run_dir, 0)
        assert said.startswith(f"pid {replaced.pid} (python") and f"PYTHONPATH={tmp_path};" in said
        beat = heartbeat_path(run_dir, 0, 0, pid=1)
        beat.parent.mkdir(parents=True)
        beat.touch()
        assert unbooted_python(run_dir, 0) is None  # a rank beats: something reports
        assert unbooted_python(run_dir, 1) is not None
    finally:
        replaced.communicate(b"")


def test_a_long_start_names_the_phases_its_ranks_are_in(tmp_path: Path) -> None:
    # nanoGPT's first torch.compile took 379 s at load 40; every line said `cold start: interpreter, imports,
    # model build, restore`. The ranks' pulses say they compile.
    from ettr.run_env import heartbeat_path

    for rank, phases in ((0, ["compile"]), (1, ["compile", "other"])):
        path = heartbeat_path(tmp_path, 0, rank, pid=100 + rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        pulse = path.with_name(path.name + ".pulse")
        doc = {"v": 1, "steps": 0, "step_s": None, "intervals": 0, "phases": phases}
        pulse.write_text(json.dumps(doc))
    wait = StartupWait(0, 0.0, path="cold", run_dir=tmp_path, unbooted=lambda: None)
    said = _lines(wait, [1.0, 10.0])
    assert said[0][1] == (
        "attempt 0: waiting for its first training step (cold start: interpreter, imports, model build, restore)"
    )
    assert said[1][1] == (
        "attempt 0: still no training step after 10 s (cold start: interpreter, imports, model build, restore; "
        "now: compile on ranks 0, 1; other on rank 1)"
    )


def test_processes_that_train_without_being_ranks_are_named_once() -> None:
    # pytorch/examples' mnist_hogwild: its processes stepped, joined no group, and every line said "cold start".
    answers = [[], [4711, 4712]]
    wait = StartupWait(0, 0.0, path="cold", unrecorded=lambda: answers.pop(0) if answers else [4711, 4712])
    said = [line for _, line in _lines(wait, [1.0, 10.0, 30.0, 60.0])]
    assert said[1] == (
        "attempt 0: still no training step after 10 s (cold start: interpreter, imports, model build, restore)"
    )
    assert said[2] == (
        "attempt 0: no training step recorded after 30 s: processes 4711, 4712, started by the script itself, "
        "step an optimizer but joined no process group (Hogwild-style training): they are no ranks, so ettr "
        "does not count their steps and this job's ETT will be unknown"
    )
    assert said[3] == "attempt 0: still no training step after 60 s (its processes train unrecorded)"


def test_a_failing_diagnosis_never_stops_the_watch() -> None:
    def broken() -> list[int]:
        raise OSError("gone")

    wait = StartupWait(0, 0.0, path="cold", unrecorded=broken)
    said = [line for _, line in _lines(wait, [1.0, 10.0])]
    assert said[1].startswith("attempt 0: still no training step after 10 s (cold start")
