"""A job id already in a shared ledger is continued only by a requeue of that job (the same run directory, the
same Slurm job) or on request (`--continue-job`); another run reusing it is refused in one line (exit 2), so
two unrelated jobs are never merged into one report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

from ettr.closing import foreign_run
from ettr.events import SUPERVISOR_RANK, Event, EventKind

ETTR = [sys.executable, "-m", "ettr.cli"]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("ETTR_", "SLURM_"))}


def _run(url: str, run_dir: Path, script: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*ETTR, "run", "--run-dir", str(run_dir), "--ledger", url, "--job-id", "J", "--max-restarts", "0",
         *extra, "--", sys.executable, str(script)],
        capture_output=True, text=True, timeout=180, env=_env(),
    )  # fmt: skip


def _attempts(url: str) -> list[str]:
    done = subprocess.run(
        [*ETTR, "report", "--ledger", url, "--job-id", "J", "--json"],
        capture_output=True, text=True, timeout=120, env=_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [a["outcome"] for a in json.loads(done.stdout)["attempts"]]


def _check_reuse(url: str, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import ettr\nfor n in range(1, 4):\n    ettr.step(n)\n")
    other = tmp_path / "other.py"
    other.write_text("print('another job')\n")
    first = _run(url, tmp_path / "a", script)
    assert first.returncode == 0, first.stderr

    reused = _run(url, tmp_path / "b", other)
    assert reused.returncode == 2, reused.stderr
    lines = reused.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in reused.stderr, reused.stderr
    assert "'J'" in lines[0] and str(tmp_path / "a") in lines[0] and "--continue-job" in lines[0], lines
    password = urlsplit(url).password  # the test server's own, random per server
    assert password is None or password not in lines[0]
    assert _attempts(url) == ["completed"]  # the refused run left no trace in the job's books

    finished = _run(url, tmp_path / "a", script)  # the same run directory, but the job completed
    assert finished.returncode == 2 and "completed" in finished.stderr, finished.stderr
    requeued = _run(url, tmp_path / "a", script, "--continue-job")  # asked: its attempts go on
    assert requeued.returncode == 0, requeued.stderr
    assert "continuing job J" in requeued.stderr
    asked = _run(url, tmp_path / "b", script, "--continue-job")
    assert asked.returncode == 0, asked.stderr
    assert _attempts(url) == ["completed"] * 3


def test_a_reused_job_id_in_a_sqlite_ledger_is_refused_unless_a_requeue_or_asked(tmp_path):
    _check_reuse(f"sqlite:///{tmp_path / 'shared.db'}", tmp_path)


def test_a_reused_job_id_in_postgres_is_refused_unless_a_requeue_or_asked(postgres_url, tmp_path):
    _check_reuse(postgres_url, tmp_path)


def _start(**data: object) -> Event:
    return Event(EventKind.SUPERVISOR_START, 1.0, 0, SUPERVISOR_RANK, data={"job_id": "J", **data})


def test_what_counts_as_the_same_run():
    here = {"run_dir": "/runs/a", "command": ["python", "train.py"]}
    same = {"run_dir": "/runs/a", "command": ("python", "train.py"), "environ": {}}
    assert foreign_run([], **same) is None  # a new job
    assert foreign_run([_start(**here)], **same) is None
    assert foreign_run([_start(**here)], **{**same, "run_dir": "/runs/b"}) == "run directory /runs/a"
    # The same Slurm job requeued onto another node's local run directory is the same job.
    slurm = [_start(**here, slurm_job_id="123")]
    assert foreign_run(slurm, **{**same, "run_dir": "/tmp/x", "environ": {"SLURM_JOB_ID": "123"}}) is None
    assert foreign_run(slurm, **{**same, "run_dir": "/tmp/x", "environ": {"SLURM_JOB_ID": "124"}}) is not None
    # Books from an ettr that recorded no run directory: the same command continues, another is refused.
    old = [_start(command=["python", "train.py"])]
    assert foreign_run(old, **{**same, "run_dir": "/elsewhere"}) is None
    assert foreign_run(old, **{**same, "command": ("python", "other.py")}) == "command python train.py"
    # The last run's start decides (a job continued on purpose elsewhere is requeued from there).
    moved = [_start(**here), _start(run_dir="/runs/b", command=["python", "train.py"])]
    assert foreign_run(moved, **{**same, "run_dir": "/runs/b"}) is None


def test_when_a_job_completed_and_whether_it_was_continued_since():
    from ettr.closing import completed_at

    def end(ts: float, status: int | None) -> Event:
        return Event(EventKind.JOB_END, ts, 0, SUPERVISOR_RANK, data={"exit_status": status})

    started = _start()
    assert completed_at([started]) is None  # still running, or killed: a requeue continues it
    assert completed_at([started, end(5.0, 0)]) == 5.0
    assert completed_at([started, end(5.0, 1)]) is None  # failed: running it again is a retry
    assert completed_at([started, end(5.0, None)]) is None
    later = Event(EventKind.SUPERVISOR_START, 9.0, 1, SUPERVISOR_RANK, data={"job_id": "J"})
    assert completed_at([started, end(5.0, 0), later]) is None  # continued (--continue-job) and not ended
    assert completed_at([started, end(5.0, 0), later, end(12.0, 0)]) == 12.0
    assert completed_at([started, end(5.0, 1), later, end(12.0, 0)]) == 12.0
