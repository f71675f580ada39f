"""`ettr demo`: its parts on scripted inputs, then the whole `ettr demo --quick` for real (two supervised
2-rank DLRM jobs with a preemption and a crash each, compared in the terminal and in report.html)."""

from __future__ import annotations

import dataclasses
import io
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ettr.accounting import compute
from ettr.demo import app as demo
from ettr.errors import UsageError
from ettr.events import SUPERVISOR_RANK, Bucket, Event, EventKind, Outcome, Phase
from ettr.report.load import load_report

T0 = 1_700_000_000.0


def _events(*rows: tuple) -> list[Event]:
    """Events from (kind, t, attempt, rank, fields) rows, t an offset from T0."""
    return [Event(kind, T0 + t, attempt, rank, **fields) for kind, t, attempt, rank, fields in rows]


# -- the workload ----------------------------------------------------------------------------------------
def test_both_shipped_workloads_are_valid_and_fail_where_each_side_loses_work():
    for workload in (demo.QUICK, demo.DEFAULT):
        assert 0 < workload.preempt_step % workload.ckpt_every  # the baseline loses the steps since
        assert 0 < workload.crash_step % workload.ckpt_every  # its last checkpoint, both times
    assert not demo.QUICK.compile and demo.DEFAULT.compile


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"preempt_step": 245}, "preempt_step .* < crash_step"),
        ({"crash_step": 300}, "crash_step .* < steps"),
        ({"preempt_step": 100}, "preempt_step must not be a multiple"),
        ({"num_rows": 0}, "num_rows"),
    ],
)
def test_a_workload_that_tells_no_story_is_refused(changes, message):
    fields = dict(
        steps=250,
        ckpt_every=50,
        num_rows=10,
        compile=False,
        worker_startup_s=0.0,
        preempt_step=170,
        crash_step=240,
        publish=False,
    )
    with pytest.raises(ValueError, match=message):
        demo.Workload(**{**fields, **changes})


def test_each_side_gets_the_same_job_and_failures_but_its_own_features(tmp_path):
    script = Path("train.py")
    base, opt = (
        demo.Job(side=s, run_dir=tmp_path / s.name, work_dir=tmp_path / "w")
        for s in (demo.BASELINE, demo.OPTIMIZED)
    )
    b, o = base.command(demo.DEFAULT, script), opt.command(demo.DEFAULT, script)
    shared = b[: b.index("--ckpt-mode")]
    assert [x.replace("optimized", "baseline") for x in o[: o.index("--ckpt-mode")]] == shared
    assert f"preempt@step={demo.DEFAULT.preempt_step},attempt=0" in b and "--compile-cache" in b
    assert f"crash@step={demo.DEFAULT.crash_step},attempt=1" in b
    assert b[b.index("--ckpt-mode") :] == [
        "--ckpt-mode",
        "sync",
        "--no-overlap-startup",
        "--publish",
        "inside",
    ]
    assert o[o.index("--ckpt-mode") :] == [
        "--ckpt-mode",
        "ettr",
        "--ckpt-auto",
        "--failures-per-day",
        "1440",
        "--failure-prior-days",
        f"{60 / 86400:.9g}",
        "--overlap-startup",
        "--plan-cache",
        str(tmp_path / "w" / "plan-cache"),
        "--fast-exit",
        "--inplace",
        "--publish",
        "standalone",
    ]
    tiered = dataclasses.replace(demo.OPTIMIZED, memory_tier=True)  # off in the demo: docs/demo.md
    assert tiered.train_args(publish=False, work_dir=tmp_path)[-4:] == [
        "--memory-interval",
        "auto",
        "--publish",
        "none",
    ]
    # The baseline compiles cold in every attempt and leaves its artifacts for the optimized side.
    assert base.environment()["ETTR_COMPILE_STORE"] == str(tmp_path / "w" / "compile-store")
    assert base.environment()["ETTR_COMPILE_RESTORE"] == "0"
    assert opt.environment()["ETTR_COMPILE_STORE"] == str(tmp_path / "w" / "compile-store")
    assert "ETTR_COMPILE_RESTORE" not in opt.environment()
    quick = base.command(demo.QUICK, script)
    assert "--no-compile" in quick and quick[-2:] == ["--publish", "none"]
    stored = demo.Job(
        side=demo.OPTIMIZED, run_dir=tmp_path / "o", work_dir=tmp_path / "w", store_dir=tmp_path / "s"
    )
    assert stored.environment()["ETTR_COMPILE_STORE"] == str(tmp_path / "s")


# -- what the demo needs of the reference job (examples/dlrm/train.py) ------------------------------------
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

_TRAINER = """
import multiprocessing, sys, time
sys.path.insert(0, sys.argv[1])
from dlrm.train import leave_sigterm_to_the_trainer

def work(ready):
    leave_sigterm_to_the_trainer(0)
    ready.set()
    while True:
        time.sleep(0.05)

def start():
    ready = ctx.Event()
    worker = ctx.Process(target=work, args=(ready,), daemon=True)
    worker.start()
    assert ready.wait(30)
    print(worker.pid, flush=True)
    return worker

ctx = multiprocessing.get_context("fork")
first = start()
sys.stdin.readline()
first.terminate()  # what the DataLoader and multiprocessing do to stop a worker
first.join(10)
print(first.exitcode, flush=True)
start()
time.sleep(300)  # until the test kills this trainer
"""


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")  # a zombie is gone
    except (FileNotFoundError, IndexError):
        return True


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.timeout(120)
def test_loader_workers_outlive_a_schedulers_sigterm_but_not_their_trainers(tmp_path):
    trainer = subprocess.Popen(
        [sys.executable, "-c", _TRAINER, str(EXAMPLES)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        first = int(trainer.stdout.readline())
        os.kill(first, signal.SIGTERM)  # from someone else: a scheduler signalling the whole job
        assert not _wait_gone(first, 1.5), "a foreign SIGTERM stopped the worker"
        trainer.stdin.write("terminate\n")
        trainer.stdin.flush()
        assert trainer.stdout.readline().strip() == "0"  # the trainer's own SIGTERM ends it at once

        second = int(trainer.stdout.readline())
        trainer.kill()  # the trainer dies without stopping its worker
        trainer.wait(10)
        assert _wait_gone(second, 10), "an orphaned worker kept running"
    finally:
        trainer.kill()


_EXIT_NOW = """
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from torch.utils.data import DataLoader
import dlrm.train as train

class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 1000
    def __getitem__(self, index):
        time.sleep(0.01)
        return index

batches = iter(DataLoader(Slow(), num_workers=2))  # installs the DataLoader's SIGCHLD handler
next(batches)
real_exit = os._exit

def seen_exit(status):  # what exit_now leaves in place when it ends the process
    print(signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL, flush=True)
    real_exit(status)

os._exit = seen_exit
train.exit_now(0)
"""


@pytest.mark.timeout(120)
def test_the_fast_exit_kills_loader_workers_without_the_dataloaders_sigchld_handler(tmp_path):
    # The DataLoader's handler raises in the trainer when a worker dies of a signal: exit_now's kills of the
    # workers ended a completed job with status 1 (after its final commit) when the signal came in time.
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_NOW, str(EXAMPLES)], capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "True"


def test_each_attempt_compiles_into_fresh_local_caches(tmp_path):
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from dlrm.train import use_attempt_compile_cache; d = use_attempt_compile_cache(sys.argv[2]);"
        "import torch._inductor.codecache as codecache;"
        "from torch._inductor.runtime.cache_dir_utils import cache_dir;"
        "print(d); print(cache_dir()); print(codecache._HEADER_DIR)"
    )
    env = {k: v for k, v in os.environ.items() if k != "ETTR_SUPERVISOR_PID"}
    for invocation, name in (("", "attempt-2"), ("4242", "attempt-2-4242")):
        if invocation:
            env["ETTR_SUPERVISOR_PID"] = invocation  # a requeue (another `ettr run`) gets fresh caches too
        out = subprocess.run(
            [sys.executable, "-c", code, str(EXAMPLES), str(tmp_path / "cc")],
            capture_output=True,
            text=True,
            env={**env, "ETTR_ATTEMPT": "2"},
            timeout=120,
            check=True,
        ).stdout.split()
        attempt_dir = tmp_path / "cc" / name
        assert out[0] == str(attempt_dir) and out[1] == str(attempt_dir / "inductor")
        assert out[2].startswith(str(attempt_dir / "tmp"))  # the precompiled headers move with it


def test_a_compile_cache_too_long_for_the_loaders_sockets_is_one_clear_line_and_the_demo_takes_a_short_one(
    tmp_path, monkeypatch
):
    # Its per-attempt TMPDIR holds multiprocessing's AF_UNIX sockets (107 bytes at most): a demo whose --out
    # was a few characters longer than a helper's failed in the loader with "AF_UNIX path too long".
    long_root = tmp_path / ("x" * 80)
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "dlrm" / "train.py"), "--compile-cache", str(long_root)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "too long" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert demo.cache_root_for(Path("/o/optimized-work"), "optimized") is None
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = set(tmp_path.iterdir())
    assert all(job.cache_root is None for job in demo.prepare(long_root))  # made by a run only: removed by it
    assert set(tmp_path.iterdir()) == before | {long_root}  # (suite runs had left one per side behind each)
    short = demo.cache_root_for(long_root / "optimized-work", "optimized")
    assert short is not None and short.parent == tmp_path and (short.stat().st_mode & 0o777) == 0o700
    job = demo.Job(side=demo.OPTIMIZED, run_dir=long_root / "o", work_dir=long_root / "w", cache_root=short)
    assert job.compile_cache == short
    (short / "attempt-1" / "tmp").mkdir(parents=True)
    demo.drop_bulk([job])
    assert not short.exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_job_publishes_its_model_inside_when_asked(tmp_path):
    # The default demo's baseline ends this way (the optimized side leaves the build to `ettr publish`).
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += [str(EXAMPLES / "dlrm" / "train.py"), "--steps", "4", "--no-compile", "--no-resume"]
    command += ["--num-rows", "1000", "--num-workers", "0", "--publish", "inside"]
    command += ["--publish-dir", str(tmp_path / "pub"), "--ckpt-dir", str(tmp_path / "ckpt")]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "publish (inside)" in proc.stdout and "artifact built in" in proc.stdout
    done = list((tmp_path / "pub" / "queue" / "done").glob("*-step000000004-*.json"))
    assert done and (tmp_path / "pub" / "anchors" / "step_000000004").is_dir()


# -- paths -----------------------------------------------------------------------------------------------
def test_the_reference_job_is_found_in_the_source_checkout():
    script = demo.find_train_script()
    assert script.name == "train.py" and script.parent.name == "dlrm" and script.is_file()
    assert script.resolve() == (EXAMPLES / "dlrm" / "train.py").resolve()  # one copy: the example


def test_an_install_without_the_reference_job_says_so(monkeypatch, tmp_path):
    import ettr.demo._examples

    monkeypatch.setattr(
        ettr.demo._examples,
        "__file__",
        str(tmp_path / "site-packages" / "ettr" / "demo" / "_examples" / "x.py"),
    )
    with pytest.raises(UsageError, match="the reference job is missing from this install of ettr"):
        demo.find_train_script()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_wheel_ships_the_reference_job(tmp_path):
    """`ettr demo` from a wheel: the job's files are inside it, where `find_train_script` looks."""
    import shutil
    import zipfile

    root = Path(__file__).resolve().parents[1]
    source = tmp_path / "src-copy"  # a copy: the build leaves build/ and egg-info beside the sources
    for part in ("src", "examples"):
        shutil.copytree(
            root / part, source / part, symlinks=True, ignore=shutil.ignore_patterns("__pycache__")
        )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, source / name)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)]
        + [str(source)],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("ettr-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    job = {p.name for p in (EXAMPLES / "dlrm").glob("*.py")}
    assert {"train.py", "checkpointing.py", "data.py", "model.py"} <= job
    assert {f"ettr/demo/_examples/dlrm/{name}" for name in job} <= names
    assert "ettr/demo/_examples/__init__.py" in names and "ettr/demo/app.py" in names


def test_prepare_clears_an_earlier_demo_but_refuses_a_directory_it_did_not_make(tmp_path):
    (tmp_path / "baseline").mkdir()
    (tmp_path / "baseline" / "ledger.db").write_text("old")
    (tmp_path / "optimized-work" / "checkpoints").mkdir(parents=True)
    (tmp_path / "keep.txt").write_text("mine")
    (tmp_path / "compile-store" / "abc").mkdir(parents=True)
    (tmp_path / "compile-store" / "abc" / "manifest.json").write_text("{}")
    jobs = demo.prepare(tmp_path)
    assert [j.run_dir.name for j in jobs] == ["baseline", "optimized"]
    assert not (tmp_path / "baseline").exists() and (tmp_path / "keep.txt").read_text() == "mine"
    assert demo.store_entries(tmp_path / "compile-store") == 1  # kept for the next demo
    assert (tmp_path / "optimized-work").is_dir() and not any((tmp_path / "optimized-work").iterdir())

    (tmp_path / "optimized").mkdir()
    (tmp_path / "optimized" / "notes.md").write_text("not a run")
    with pytest.raises(UsageError, match="is not an ettr run directory"):
        demo.prepare(tmp_path)
    assert (tmp_path / "optimized" / "notes.md").exists()


def test_prepare_clears_a_deep_earlier_run_directory_without_recursion_or_says_one_line(tmp_path):
    # shutil.rmtree recursed once per level: a folder 1,200 deep in baseline/ (beside its ledger.db) raised
    # RecursionError out of `ettr demo` (a traceback, status 1). Here under a recursion limit that leaves the
    # clearing 60 frames (a tree 1,200 deep would outlast pytest's own clean-up, which recurses as rmtree does).
    import inspect
    import sys

    from ettr.untrusted import MAX_REMOVE_DEPTH

    def plant(depth: int) -> None:
        (tmp_path / "baseline").mkdir(exist_ok=True)
        (tmp_path / "baseline" / "ledger.db").write_text("old")
        (tmp_path / "baseline" / Path(*["d"] * depth)).mkdir(parents=True)

    def prepare_with_few_frames() -> None:
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(len(inspect.stack()) + 60)
        try:
            demo.prepare(tmp_path)
        finally:
            sys.setrecursionlimit(limit)

    plant(MAX_REMOVE_DEPTH - 8)
    prepare_with_few_frames()
    assert not (tmp_path / "baseline").exists()
    plant(MAX_REMOVE_DEPTH + 20)
    with pytest.raises(UsageError, match=f"nested more than {MAX_REMOVE_DEPTH} folders deep"):
        prepare_with_few_frames()


def test_prepare_refuses_a_run_directory_a_live_supervisor_still_writes(tmp_path):
    import socket

    from ettr.ledger import open_ledger
    from ettr.procs import start_ticks

    ledger = open_ledger(tmp_path / "baseline")
    pid = os.getppid()  # a live process that is not this one, standing in for an earlier demo's `ettr run`
    data = {"pid": pid, "host": socket.gethostname(), "pid_start_ticks": start_ticks(pid)}
    ledger.append([Event(EventKind.SUPERVISOR_START, T0, 0, SUPERVISOR_RANK, data=data)])
    ledger.close()
    with pytest.raises(UsageError, match=f"still in use by a running `ettr run` \\(pid {pid}\\)"):
        demo.prepare(tmp_path)
    assert (tmp_path / "baseline" / "ledger.db").is_file()


def test_a_sigterm_stops_the_demo_through_its_finally_blocks():
    with pytest.raises(SystemExit) as stopped:
        demo._exit_on_sigterm(signal.SIGTERM, None)
    assert stopped.value.code == 143


def test_a_bad_out_is_one_line_and_exit_status_2(tmp_path, capsys):
    from ettr.cli import main

    (tmp_path / "file").write_text("")
    assert main(["demo", "--quick", "--out", str(tmp_path / "file")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot use" in err


# -- progress --------------------------------------------------------------------------------------------
def test_job_state_follows_the_latest_attempt_of_rank_0():
    events = _events(
        (EventKind.ATTEMPT_START, 0, 0, SUPERVISOR_RANK, {}),
        (EventKind.PHASE_BEGIN, 1, 0, 0, {"phase": Phase.TRAIN_MODULE_CREATION}),
        (EventKind.STEP, 2, 0, 0, {"step": 5}),
        (EventKind.ATTEMPT_END, 3, 0, SUPERVISOR_RANK, {"data": {"outcome": "preempted"}}),
        (EventKind.ATTEMPT_START, 4, 1, SUPERVISOR_RANK, {}),
        (EventKind.PHASE_BEGIN, 5, 1, 0, {"phase": Phase.RESTORE}),
        (EventKind.PHASE_BEGIN, 5.5, 1, 1, {"phase": Phase.COMPILE}),  # rank 1 is not shown
    )
    assert demo.JobState.of([]).stage == "starting"
    state = demo.JobState.of(events)
    assert (state.attempt, state.stage, state.step, state.num_failures) == (1, "restore", 0, 1)
    events += _events(
        (EventKind.PHASE_END, 6, 1, 0, {"phase": Phase.RESTORE, "value": T0 + 5}),
        (EventKind.STEP, 7, 1, 0, {"step": 9}),
    )
    state = demo.JobState.of(events)
    assert (state.stage, state.step) == ("training", 9)
    assert "attempt 1" in state.text(100) and "9/100" in state.text(100)


def test_progress_is_one_rewritten_line_on_a_terminal_and_plain_lines_otherwise():
    training = demo.JobState(attempt=0, stage="training", step=10, num_failures=0)
    later = demo.JobState(attempt=0, stage="training", step=20, num_failures=0)
    tty = io.StringIO()
    display = demo.ProgressDisplay(tty, tty=True, columns=200)
    display.show("baseline", training, 100, 3.0)
    display.show("optimized", later, 100, 3.0)
    display.note("baseline: preempting")
    text = tty.getvalue()
    assert text.count("\r") == 2 and "baseline: attempt 0 training step 10/100" in text
    assert "| optimized: attempt 0 training step 20/100" in text and text.endswith("baseline: preempting\n")

    plain = io.StringIO()
    display = demo.ProgressDisplay(plain, tty=False, plain_every_s=3600)
    for state in (training, later, later, demo.JobState(attempt=1, stage="init", step=0, num_failures=1)):
        display.show("baseline", state, 100, 1.0)
    lines = plain.getvalue().splitlines()
    assert "\r" not in plain.getvalue() and len(lines) == 2  # a step change alone waits plain_every_s
    assert "attempt 0" in lines[0] and "attempt 1" in lines[1]


# -- the story -------------------------------------------------------------------------------------------
def _report(*, blocking_s: float, recovery_compile_s: float, job_id: str):
    """A job: attempt 0 preempted after 10 s, attempt 1 recovers (compile) and completes."""
    events = _events(
        (EventKind.ATTEMPT_START, 0, 0, SUPERVISOR_RANK, {}),
        (EventKind.STEP, 2, 0, 0, {"step": 1}),
        (EventKind.STEP, 6, 0, 0, {"step": 2}),
        (EventKind.PHASE_BEGIN, 6, 0, 0, {"phase": Phase.CHECKPOINT_BLOCKING, "step": 2}),
        (EventKind.PHASE_END, 6 + blocking_s, 0, 0, {"phase": Phase.CHECKPOINT_BLOCKING, "value": T0 + 6}),
        (EventKind.CHECKPOINT_COMMIT, 6 + blocking_s, 0, 0, {"step": 2, "data": {"path": "p"}}),
        (EventKind.ATTEMPT_END, 10, 0, SUPERVISOR_RANK, {"data": {"outcome": Outcome.PREEMPTED}}),
        (EventKind.ATTEMPT_START, 11, 1, SUPERVISOR_RANK, {}),
        (EventKind.RESUMED, 11.5, 1, 0, {"step": 2}),
        (EventKind.PHASE_BEGIN, 12, 1, 0, {"phase": Phase.COMPILE}),
        (EventKind.PHASE_END, 12 + recovery_compile_s, 1, 0, {"phase": Phase.COMPILE, "value": T0 + 12}),
        (EventKind.STEP, 13 + recovery_compile_s, 1, 0, {"step": 3}),
        (
            EventKind.ATTEMPT_END,
            14 + recovery_compile_s,
            1,
            SUPERVISOR_RANK,
            {"data": {"outcome": "completed"}},
        ),
    )
    return compute(events, max(e.ts for e in events), job_id=job_id)


def test_the_explanation_reads_every_difference_from_the_reports():
    baseline = _report(blocking_s=2.0, recovery_compile_s=30.0, job_id="b")
    optimized = _report(blocking_s=0.1, recovery_compile_s=3.0, job_id="o")
    text = demo.explain(baseline, optimized)
    assert f"ETT {optimized.ett_pct:.1f}% vs {baseline.ett_pct:.1f}%" in text
    assert re.search(r"checkpoint_blocking +2\.0 s -> +0\.1 s +async saves", text)
    assert re.search(r"compile in recoveries +30\.0 s -> +3\.0 s +artifacts restored", text)
    assert "not higher" not in text
    assert re.search(r"effective_training +\d+\.\d s -> +\d+\.\d s +the same steps", text)
    worse = demo.explain(optimized, baseline)
    assert "(not lower this time)" in worse and "ETT% is not higher this time" in worse


# -- the real thing --------------------------------------------------------------------------------------
QUICK_MARGIN_POINTS = 5.0
"""How much higher the quick demo's optimized ETT% must be (see docs/demo.md for the margins measured)."""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ettr_demo_quick_end_to_end(tmp_path):
    out = tmp_path / "demo"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    proc = subprocess.run(
        [sys.executable, "-m", "ettr.cli", "demo", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=880,
    )
    logs = "\n".join(p.read_text()[-4000:] for p in out.glob("*-work/job.log"))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{logs}"

    baseline, optimized = load_report(out / "baseline"), load_report(out / "optimized")
    for report in (baseline, optimized):
        outcomes = [a.outcome for a in report.attempts]
        failures = [str(a.failure)[:300] for a in report.attempts]
        assert outcomes == [Outcome.PREEMPTED, Outcome.FAILED, Outcome.COMPLETED], (report.job_id, failures)
        assert report.num_failures >= 2
        assert "InjectedCrash" in str(report.attempts[1].failure)
        # Both recoveries resumed from a checkpoint, and both failures cost the baseline real work.
        assert all(a.resumed_from_step and a.resumed_from_step > 0 for a in report.attempts[1:])
        assert report.attempts[-1].last_step == demo.QUICK.steps
    assert all(a.lost_steps > 0 for a in baseline.attempts[:2])
    assert optimized.attempts[0].lost_steps == 0, "the optimized run saves when it is preempted"
    # The crash is recovered in place (the other rank keeps its process); the requeue cannot be.
    assert [p.kind for p in optimized.ttr_parts] == ["requeue", "in_place"], optimized.ttr_parts

    # The margin: in runs here the quick demo's optimized side came out QUICK_MARGIN_POINTS+ points higher.
    assert optimized.ett_pct > baseline.ett_pct + QUICK_MARGIN_POINTS, proc.stdout
    # The auto interval saves more often than the baseline's fixed one, and its saves persist beside training
    # (the loop waits only for the copy). How long each save blocked is a figure the demo prints, not a check:
    # two jobs run minutes apart on a shared machine can come out either way (at load ~15: 0.77 vs 0.87 s).
    assert optimized.slowdown is not None and optimized.slowdown.saves, optimized.slowdown
    assert len(optimized.checkpoint_commits) > len(baseline.checkpoint_commits)
    assert optimized.buckets_s[Bucket.DATA_WAIT] < baseline.buckets_s[Bucket.DATA_WAIT]
    assert sum(a.lost_steps for a in optimized.attempts) < sum(a.lost_steps for a in baseline.attempts)
    # The bulk is gone, the books are not.
    assert not any((out / "baseline-work" / name).exists() for name in demo.BULK)
    assert (out / "optimized-work" / "job.log").is_file()

    html = (out / "report.html").read_text()
    assert "demo-baseline" in html and "demo-optimized" in html
    # The comparison printed is the one of these run directories.
    assert f"{baseline.ett_pct:.1f}" in proc.stdout and f"{optimized.ett_pct:.1f}" in proc.stdout
    assert "optimized vs baseline: ETT" in proc.stdout and "requeueing the job" in proc.stdout
    assert "what each technique bought" in proc.stdout and "replay" in proc.stdout
    assert 'id="story"' in html


@pytest.mark.parametrize("name", ["baseline", "optimized-work"])
def test_a_symlink_where_the_demo_puts_a_side_is_refused_and_its_target_untouched(tmp_path, name):
    """`ettr demo --out DIR` with `DIR/baseline -> another run`: rmtree left the link (ignore_errors) and the
    demo's job was supervised into the other run's directory, appending to its books."""
    from ettr.testing.fleet import JobSpec, write_job

    other = write_job(tmp_path / "other-run", JobSpec(job_id="precious"))
    before = sorted(p.name for p in other.iterdir())
    out = tmp_path / "out"
    out.mkdir()
    (out / name).symlink_to(other)
    with pytest.raises(UsageError, match="is a symlink"):
        demo.prepare(out)
    assert (out / name).is_symlink() and sorted(p.name for p in other.iterdir()) == before
    assert not (out / "baseline-work").exists()  # nothing made or removed before the refusal


CHILD = """
import pathlib, signal, sys, time
here = pathlib.Path(sys.argv[1])
signal.signal(signal.SIGTERM, lambda *_: (here.joinpath("terminated").write_text("1"), sys.exit(0)))
here.joinpath("ready").write_text("1")
time.sleep(120)
"""

PARENT = """
import os, sys, time
from ettr.demo.app import start_child
start_child([sys.executable, "-c", sys.argv[1], sys.argv[2]], open(os.devnull, "wb"), dict(os.environ))
time.sleep(120)
"""


def test_a_killed_demo_stops_the_jobs_it_started(tmp_path):
    # A SIGKILLed `ettr demo` left its `ettr run` children training, re-parented to init (field trial).
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(tmp_path)])
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "ready").exists(), "the child never started"
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 120
        while not (tmp_path / "terminated").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "terminated").read_text() == "1"
    finally:
        parent.kill()


def test_the_cpus_split_into_two_equal_disjoint_halves():
    assert demo.split_cpus({0, 1}) == (frozenset({0}), frozenset({1}))
    assert demo.split_cpus({7, 1, 5, 3}) == (frozenset({1, 3}), frozenset({5, 7}))
    assert demo.split_cpus({0, 1, 2}) == (frozenset({0}), frozenset({1}))  # the odd one out unused
    assert demo.split_cpus({4}) is None and demo.split_cpus(set()) is None


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_a_job_started_on_cpus_and_its_children_stay_on_them(tmp_path):
    cpu = min(os.sched_getaffinity(0))
    out = tmp_path / "out"
    code = (
        "import os, subprocess, sys; print(sorted(os.sched_getaffinity(0)));"
        "subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'])"
    )
    with open(out, "wb") as log:
        proc = demo.start_child([sys.executable, "-c", code], log, dict(os.environ), cpus=frozenset({cpu}))
        assert proc.wait(timeout=120) == 0
    assert out.read_text().split("\n")[:2] == [f"[{cpu}]", f"[{cpu}]"]


class FakeRun:
    """A JobRun's surface for run_jobs: ends after `ticks_to_end` ticks once launched."""

    def __init__(self, name: str, ticks_to_end: int, log: list[str], on_tick=None) -> None:
        self.name, self.ticks_left, self.log, self.on_tick = name, ticks_to_end, log, on_tick
        self.status: int | None = None
        self.launched = False
        self.exited = False

    def launch(self) -> None:
        self.launched = True
        self.log.append(f"launch {self.name}")

    def tick(self, display) -> None:
        if not self.launched or self.status is not None:
            return
        self.ticks_left -= 1
        if self.on_tick is not None:
            self.on_tick(self)
        if self.ticks_left <= 0:
            self.status = 0
            self.log.append(f"end {self.name}")

    def stop(self) -> None:
        self.log.append(f"stop {self.name}")


def test_side_by_side_the_optimized_side_starts_once_the_store_holds_the_baselines_artifacts(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(demo, "wait_any", lambda runs, timeout_s: None)
    store, log = tmp_path / "store", []

    def compile_once(run: FakeRun) -> None:  # the baseline's first compile lands in the store
        if run.ticks_left == 3:
            (store / "entry").mkdir(parents=True)
            (store / "entry" / "manifest.json").write_text("{}")

    first = FakeRun("baseline", 6, log, on_tick=compile_once)
    later = FakeRun("optimized", 4, log)
    seen_at_launch = []
    launch = later.launch
    later.launch = lambda: (seen_at_launch.append(demo.store_entries(store)), launch())  # type: ignore[method-assign]
    demo.run_jobs([first, later], display=None, side_by_side=True, store=store)
    assert seen_at_launch == [1]  # not before the baseline's artifacts were there
    assert log[:2] == ["launch baseline", "launch optimized"] and first.status == later.status == 0
    # Both ran at once: the optimized side was launched while the baseline still trained.
    assert log.index("launch optimized") < log.index("end baseline")
    assert log[-2:] == ["stop baseline", "stop optimized"]
    # Without a compile store to wait for, both start at once; one after the other, each in turn.
    log.clear()
    demo.run_jobs([FakeRun("a", 2, log), FakeRun("b", 2, log)], display=None, side_by_side=True, store=None)
    assert log[:2] == ["launch a", "launch b"]
    log.clear()
    demo.run_jobs([FakeRun("a", 2, log), FakeRun("b", 2, log)], display=None, side_by_side=False, store=None)
    assert log == ["launch a", "end a", "launch b", "end b", "stop a", "stop b"]


def test_a_preempted_job_is_requeued_before_its_ledger_is_read(monkeypatch, tmp_path) -> None:
    # A read of a large ledger under load took seconds of the job's wall time between its preemption and its
    # requeue; and the side that exited is looked at first.
    order: list[str] = []

    class Proc:
        def poll(self) -> int:
            return demo.PREEMPTED_EXIT_STATUS

    class Display:
        def note(self, line: str) -> None:
            order.append("note")

        def show(self, *args: object) -> None:
            order.append("show")

    run = demo.JobRun.__new__(demo.JobRun)
    run.job = type("J", (), {"side": type("S", (), {"name": "optimized"})(), "run_dir": tmp_path})()
    run.status, run._proc, run._num_launches, run._began = None, Proc(), 1, 0.0
    run.launch = lambda: order.append("launch")  # type: ignore[method-assign]
    monkeypatch.setattr(demo, "read_events", lambda run_dir: order.append("read") or [])
    run.tick(Display())  # type: ignore[arg-type]
    assert order == ["launch", "note"]
    monkeypatch.setattr(demo, "wait_any", lambda runs, timeout_s: None)
    log: list[str] = []
    a, b = FakeRun("a", 2, log), FakeRun("b", 2, log)
    b.exited = True
    ticked = []
    for fake in (a, b):
        tick = fake.tick
        fake.tick = lambda display, fake=fake, tick=tick: (ticked.append(fake.name), tick(display))  # type: ignore[method-assign]
    demo.run_jobs([a, b], display=None, side_by_side=True, store=None)
    assert ticked[:2] == ["b", "a"]


class _Stop(Exception):
    pass


@pytest.mark.parametrize("one_after_the_other", [False, True])
def test_the_sides_run_side_by_side_unless_asked_one_after_the_other(
    tmp_path, monkeypatch, one_after_the_other
):
    import argparse

    seen = {}

    def run_jobs(runs, display, *, side_by_side, store):
        seen.update(side_by_side=side_by_side, cpus=[run.cpus for run in runs])
        raise _Stop

    monkeypatch.setattr(demo, "run_jobs", run_jobs)
    monkeypatch.setattr(demo, "usable_cpus", lambda: frozenset({0, 1}))
    args = argparse.Namespace(quick=True, out=str(tmp_path / "demo"), one_after_the_other=one_after_the_other)
    with pytest.raises(_Stop):
        demo.main(args)
    if one_after_the_other:
        assert seen == {"side_by_side": False, "cpus": [None, None]}
    else:
        assert seen == {"side_by_side": True, "cpus": [frozenset({0}), frozenset({1})]}
