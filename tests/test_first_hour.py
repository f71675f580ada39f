"""A new user's first hour, replayed from the user's side: each finding of that hour as the command and
its output (issue "A user's first hour"). Real processes where the finding was about `ettr run`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ettr.accounting import compute
from ettr.events import SUPERVISOR_RANK, Event, EventKind, Outcome, Phase
from ettr.ledger import open_ledger
from ettr.ledger.sqlite import SqliteLedger
from ettr.recorder import Recorder

ETTR = [sys.executable, "-m", "ettr.cli"]
K = EventKind


def ettr(*args: str, timeout: float = 180, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    return subprocess.run(
        [*ETTR, *args], capture_output=True, text=True, timeout=timeout, env=env, check=False, cwd=cwd
    )


def report_json(run_dir: Path) -> dict[str, Any]:
    done = ettr("report", str(run_dir), "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


# -- 1. nothing a user passes can break the books ---------------------------------------------------------
def test_numpy_and_tensor_steps_are_step_numbers_and_bad_ones_are_dropped(tmp_path: Path, caplog) -> None:
    rec = Recorder(SqliteLedger(tmp_path / "ledger.db"), run_dir=tmp_path, job_id="np")
    for value in (1, np.int64(2), torch.tensor(3), 4.5, "x", torch.tensor(5.0), np.int32(6), True):
        rec.step(value)  # type: ignore[arg-type]
    rec.resumed_from(np.int64(2))  # type: ignore[arg-type]
    rec.close()
    steps = [e.step for e in open_ledger(tmp_path, create=False).read() if e.kind is K.STEP]
    assert steps == [1, 2, 3, 6]
    assert all(type(s) is int for s in steps)
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1  # one warning
    assert report_json(tmp_path)["attempts"][0]["last_step"] == 6


def test_one_bad_event_never_poisons_its_batch(tmp_path: Path) -> None:
    ledger = SqliteLedger(tmp_path / "ledger.db")
    good = [Event(K.STEP, 1.0 + i, step=i) for i in range(1, 4)]
    bad = Event(K.STEP, float("nan"), step=9)
    ledger.append([good[0], bad, good[1], Event(K.MARK, 5.0, data={"x": object()}), good[2]])
    got = ledger.read()
    assert [e.step for e in got if e.kind is K.STEP] == [1, 2, 3]
    assert got[-2].data == {"x": got[-2].data["x"]}  # unserializable data stored as text, event kept


def test_a_ledger_with_rows_ettr_cannot_use_still_reports(tmp_path: Path) -> None:
    ledger = SqliteLedger(tmp_path / "ledger.db")
    ledger.append([Event(K.STEP, 100.0 + i, step=i) for i in range(1, 6)])
    ledger.close()
    import sqlite3

    conn = sqlite3.connect(tmp_path / "ledger.db")
    rows = [  # what older ettr versions, bit flips and other writers left
        (101.5, "step", 0, 0, None, np.int64(7).tobytes(), None, None),  # a numpy step stored as bytes
        ("soon", "step", 0, 0, None, 8, None, None),
        (102.5, "step", 0, 0, None, "nine", None, None),
        (103.5, "mark", 0, 0, None, None, None, "[1, 2]"),
        (104.5, "mark", 0, 0, None, None, None, "{not json"),
        (105.5, "no_such_kind", 0, 0, None, None, None, None),
    ]
    conn.executemany(
        "INSERT INTO events (ts, kind, attempt, rank, phase, step, value, data) VALUES (?,?,?,?,?,?,?,?)",
        rows,
    )
    conn.commit()
    conn.close()
    rep = report_json(tmp_path)
    assert rep["attempts"][0]["last_step"] == 7  # the bytes step is recovered; the rest skipped
    assert ettr("report", str(tmp_path)).returncode == 0


def test_a_resume_inside_the_scripts_own_restore_phase_is_still_recorded(tmp_path: Path) -> None:
    train = script(
        tmp_path,
        "train.py",
        """
        import os, sys, torch, ettr
        ckpt = sys.argv[1]
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        start = 0
        if os.path.exists(ckpt):
            with ettr.phase(ettr.Phase.RESTORE):  # as the README suggests: mark your phases
                state = torch.load(ckpt)
            model.load_state_dict(state["model"]); start = state["step"]
        for step in range(start, 12):
            opt.zero_grad(); model(torch.randn(2, 4)).sum().backward(); opt.step()
            if (step + 1) % 5 == 0:
                torch.save({"model": model.state_dict(), "step": step + 1}, ckpt + ".tmp")
                os.replace(ckpt + ".tmp", ckpt)
        """,
    )
    run_dir = tmp_path / "run"
    cmd = ["run", "--run-dir", str(run_dir), "--inject", "crash@step=7", "--", sys.executable, train]
    done = ettr(*cmd, str(tmp_path / "ckpt.pt"))
    assert done.returncode == 0, done.stderr
    attempts = report_json(run_dir)["attempts"]
    assert [(a["resumed_from_step"], a["lost_steps"]) for a in attempts] == [(None, 2), (5, 0)]
    assert attempts[1]["last_step"] == 12


# -- 2. run directories, ids, times, injections, signals --------------------------------------------------
def test_a_second_job_into_a_run_dir_is_said_and_a_conflicting_job_id_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = ettr("run", "--run-dir", str(run_dir), "--job-id", "first", "--", sys.executable, "-c", "pass")
    assert first.returncode == 0, first.stderr
    again = ettr("run", "--run-dir", str(run_dir), "--", sys.executable, "-c", "pass")
    # a finished job is not run again into its own books (they would read its steps as lost, the gap as a
    # restart): one line, exit 2, unless asked
    assert again.returncode == 2 and again.stderr.count("\n") == 1, again.stderr
    assert "job 'first'" in again.stderr and "completed" in again.stderr and "--continue-job" in again.stderr
    again = ettr("run", "--run-dir", str(run_dir), "--continue-job", "--", sys.executable, "-c", "pass")
    assert again.returncode == 0, again.stderr
    assert f"continuing job first in {run_dir} (attempt 1)" in again.stderr
    other = ettr("run", "--run-dir", str(run_dir), "--job-id", "second", "--", sys.executable, "-c", "pass")
    assert other.returncode == 2
    assert other.stderr.count("\n") == 1 and "holds job 'first', not 'second'" in other.stderr
    assert report_json(run_dir)["job_id"] == "first"


@pytest.mark.parametrize("job_id", [".", "..", "a/b", "x\ny", "-rf", "$(whoami);rm", "a" * 129, ""])
def test_unsafe_job_ids_are_refused(tmp_path: Path, job_id: str) -> None:
    done = ettr("run", "--job-id", job_id, "--", sys.executable, "-c", "pass", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.startswith("ettr run: ") and done.stderr.count("\n") == 1
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_printed_commands_are_shell_quoted(tmp_path: Path) -> None:
    run_dir = tmp_path / "my run $(touch pwned)"
    done = ettr("run", "--run-dir", str(run_dir), "--", sys.executable, "-c", "pass")
    assert done.returncode == 0
    line = next(x for x in done.stderr.splitlines() if "report: " in x)
    command = line.split("report: ", 1)[1]
    shell = tmp_path / "shell"
    shell.mkdir()
    out = subprocess.run(
        ["bash", "-c", f"printf %s {command.split(' ', 2)[2]}"], capture_output=True, text=True, cwd=shell
    )
    assert out.stdout == str(run_dir)
    assert not (shell / "pwned").exists()


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--submitted-at", "2999-01-01T00:00:00Z"], "in the future"),
        (["--submitted-at", "2000", "--allocated-at", "1000"], "before --submitted-at"),
        (["--allocated-at", "nan"], "not a time"),
        # recorded, then skipped on every read as damage (`skipped 1 unreadable ledger records`): the time lost
        (["--allocated-at", "0"], "--allocated-at 0 is "),
        (["--submitted-at", "2015-01-01T00:00:00Z"], "years before now"),
    ],
)
def test_impossible_times_are_refused(tmp_path: Path, flags: list[str], said: str) -> None:
    done = ettr("run", "--run-dir", str(tmp_path / "r"), *flags, "--", sys.executable, "-c", "pass")
    assert done.returncode == 2 and said in done.stderr and done.stderr.count("\n") == 1


def test_an_injection_that_never_fired_is_said_and_a_hang_without_timeout_too(tmp_path: Path) -> None:
    done = ettr(
        "run", "--run-dir", str(tmp_path / "r"), "--inject", "crash@step=999", "--inject", "hang@step=998",
        "--", sys.executable, "-c", "pass",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (
        "injected fault crash@step=999,attempt=0,rank=0 never fired (attempt 0 completed no training step"
        in done.stderr
    )
    assert "injected fault hang@step=998,attempt=0,rank=0 never fired (attempt 0 completed" in done.stderr
    assert (
        "a hang is injected without --hang-timeout: once steps run it is detected after 10 step times"
        in done.stderr
    )
    assert "300" in ettr("run", "--help").stdout


@pytest.mark.slow
def test_sigint_is_an_interruption_delivered_once_with_status_130(tmp_path: Path) -> None:
    counts = tmp_path / "sigints"
    train = script(
        tmp_path,
        "train.py",
        """
        import signal, sys, time
        path = sys.argv[1]
        def on_int(signum, frame):
            with open(path, "a") as f:
                f.write("x")
            time.sleep(1.0)  # a second SIGINT would land here
            sys.exit(130)
        signal.signal(signal.SIGINT, on_int)
        open(path + ".ready", "w").close()
        while True:
            time.sleep(0.05)
        """,
    )
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    proc = subprocess.Popen(
        [*ETTR, "run", "--run-dir", str(run_dir), "--no-auto", "--", sys.executable, train, str(counts)],
        stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
    )  # fmt: skip
    deadline = time.time() + 60
    while not Path(str(counts) + ".ready").exists() and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)  # the whole process group, as a CI runner or `kill -INT -PGID` does
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert counts.read_text() == "x"  # once, not twice
    assert "Traceback" not in stderr
    assert f"to continue it (a requeue): ettr run --run-dir {run_dir}" in stderr
    rep = report_json(run_dir)
    assert [a["outcome"] for a in rep["attempts"]] == ["interrupted"]


# -- 3. truthful small numbers ----------------------------------------------------------------------------
def _job(outcome: str, *, steps: int, commit: int | None, duplicate_first: bool = False) -> list[Event]:
    sup = SUPERVISOR_RANK
    events = [
        Event(K.SUPERVISOR_START, 0.0, 0, sup),
        Event(K.ATTEMPT_START, 0.0, 0, sup),
        Event(K.PHASE_END, 1.0, 0, 0, Phase.INIT, value=0.0),
        Event(K.TRAINING_START, 1.0, 0, 0),
    ]
    if duplicate_first:
        events.append(Event(K.STEP, 2.0, 0, 0, step=1))
    events += [Event(K.STEP, 1.0 + s, 0, 0, step=s) for s in range(1, steps + 1)]
    if commit is not None:
        events.append(Event(K.CHECKPOINT_COMMIT, 1.5 + steps, 0, 0, step=commit, data={"path": "c"}))
    end = 3.0 + steps
    events += [
        Event(K.ATTEMPT_END, end, 0, sup, data={"outcome": outcome, "exit_code": 143}),
        Event(K.JOB_END, end, 0, sup),
    ]
    return events


def test_a_clean_preemption_that_saved_everything_books_its_teardown_as_shutdown() -> None:
    clean = compute(_job(Outcome.PREEMPTED, steps=10, commit=10), now=100.0)
    assert clean.buckets_s["wasted_progress"] == 0
    assert clean.buckets_s["shutdown"] == pytest.approx(2.0)
    lossy = compute(_job(Outcome.PREEMPTED, steps=10, commit=8), now=100.0)
    assert lossy.buckets_s["wasted_progress"] == pytest.approx(2.0 + 2.0)  # 2 steps lost + the tail
    assert lossy.attempts[0].lost_steps == 2


def test_the_teardown_after_a_signal_the_scripts_handler_ended_the_job_on_is_restart() -> None:
    """Lightning's ddp behind `bash run.sh`, SIGTERMed by a scheduler (not through `ettr run`): its handler
    ended the job, which took 8.6 s to exit on a loaded machine, and all of it was booked as wasted progress
    (8.9 s for 12 lost steps of 18 ms), as if training had gone on until the command's exit. The signal's
    time (ATTEMPT_END `signalled_ts`) is the failure instant: after it, the teardown is `restart`."""
    sup = SUPERVISOR_RANK

    def job(signalled: dict[str, float]) -> list[Event]:
        events = _job(Outcome.PREEMPTED, steps=10, commit=8)[:-2]  # steps 1..10 at 2..11, commit of 8
        return [
            *events,
            Event(K.MARK, 29.0, 0, sup, data={"name": "failure_detected", "returncode": 0}),  # the exit
            Event(K.ATTEMPT_END, 29.0, 0, sup, data={"outcome": "preempted", "exit_code": 0, **signalled}),
            Event(K.ATTEMPT_START, 30.0, 1, sup),
            Event(K.PHASE_END, 31.0, 1, 0, Phase.INIT, value=30.0),
            *(Event(K.STEP, 31.0 + s, 1, 0, step=8 + s) for s in range(1, 4)),
            Event(K.ATTEMPT_END, 35.0, 1, sup, data={"outcome": "completed", "exit_code": 0}),
            Event(K.JOB_END, 35.0, 1, sup),
        ]

    known = compute(job({"signalled_ts": 11.5}), now=100.0)
    assert known.attempts[0].lost_steps == 2
    assert known.buckets_s["wasted_progress"] == pytest.approx(2.0 + 0.5)  # steps 9, 10 + up to the signal
    assert known.buckets_s["restart"] == pytest.approx(29.0 - 11.5 + 1.0)  # the teardown and the gap
    unknown = compute(job({}), now=100.0)  # an older ettr's books: the command's exit, as before
    assert unknown.buckets_s["wasted_progress"] == pytest.approx(2.0 + 18.0)


def test_a_step_recorded_twice_is_one_step() -> None:
    rep = compute(_job(Outcome.FAILED, steps=50, commit=None, duplicate_first=True), now=100.0)
    assert rep.attempts[0].num_steps == 50 and rep.attempts[0].lost_steps == 50


# -- 5. messages ------------------------------------------------------------------------------------------
def test_version_module_entry_point_and_examples_in_every_help() -> None:
    from ettr import __version__
    from ettr.cli import _COMMANDS

    assert ettr("--version").stdout.strip() == f"ettr {__version__}"
    top = subprocess.run([sys.executable, "-m", "ettr", "--help"], capture_output=True, text=True)
    assert top.returncode == 0 and "report ETT% and" in top.stdout and "{" not in top.stdout
    for name in _COMMANDS:
        assert "examples:" in ettr(name, "--help").stdout, name
    assert ettr("run", "--help").stdout.startswith("usage: ettr run [options] -- COMMAND [ARGS...]")


def test_the_text_report_shows_the_exception_and_the_last_stderr_lines(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    code = "import sys; print('loading shard 3', file=sys.stderr); raise ValueError('bad batch at row 17')"
    done = ettr("run", "--run-dir", str(run_dir), "--max-restarts", "0", "--", sys.executable, "-c", code)
    assert done.returncode == 1
    text = ettr("report", str(run_dir)).stdout
    assert "ValueError: bad batch at row 17" in text
    assert "last stderr lines:" in text and "loading shard 3" not in text.split("last stderr lines:")[0]
    html = tmp_path / "r.html"
    written = ettr("report", str(run_dir), "--html", str(html))
    assert written.returncode == 0 and f"wrote {html}" in written.stderr and html.is_file()
