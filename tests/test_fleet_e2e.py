"""ettr fleet over real `ettr run` jobs: a family whose compile time doubles from one job on is flagged with
the compile metric and its first changed job while a stable family is not; `--preempt-order` puts a live
job that just committed before a live one that never did."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = str(Path(__file__).parent / "scripts" / "train_phases.py")
ETTR = [sys.executable, "-m", "ettr.cli"]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """`ettr fleet` caches summaries under $XDG_CACHE_HOME: keep each test's to itself."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}


def _run_job(runs: Path, job_id: str, compile_s: float, *family: str) -> None:
    done = subprocess.run(
        [*ETTR, "run", "--run-dir", str(runs / job_id), "--job-id", job_id, *family, "--",
         sys.executable, SCRIPT, "--compile-s", str(compile_s), "--steps", "8"],
        capture_output=True, text=True, timeout=120, env=_env(), check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]


def _fleet(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ETTR, "fleet", *args], capture_output=True, text=True, timeout=120, env=_env())


def test_real_runs_compile_doubling_is_flagged_and_a_stable_family_is_not(tmp_path):
    runs = tmp_path / "runs"
    # Two families side by side (one named, one derived from the script's name), each job after the other.
    steady = threading.Thread(
        target=lambda: [_run_job(runs, f"steady-{i}", 1.0, "--family", "steady") for i in range(5)]
    )
    steady.start()
    for i in range(6):
        _run_job(runs, f"grow-{i}", 1.0 if i < 4 else 2.5)
    steady.join()
    done = _fleet(str(runs), "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert {j["family"] for j in out["jobs"]} == {"steady", "train_phases"}
    flagged = {(r["family"], r["metric"]): r for r in out["regressions"]}
    compile_ = flagged[("train_phases", "compile")]
    assert compile_["job_id"] == "grow-4"
    assert compile_["baseline"] == pytest.approx(1.0, abs=0.3) and compile_["value"] == pytest.approx(
        2.5, abs=0.5
    )
    assert all(r["family"] == "train_phases" for r in out["regressions"]), out["regressions"]
    assert all(r["job_id"] == "grow-4" for r in out["regressions"])
    assert _fleet(str(runs), "--check").returncode == 1
    assert _fleet(*(str(runs / f"steady-{i}") for i in range(5)), "--check").returncode == 0


def test_real_runs_preempt_order_prefers_the_job_that_just_committed(tmp_path):
    runs = tmp_path / "runs"
    jobs = {}
    for job_id, commit_every in (("uncommitted", "0"), ("committed", "10")):
        ready = tmp_path / f"{job_id}.ready"
        jobs[job_id] = (
            subprocess.Popen(
                [*ETTR, "run", "--run-dir", str(runs / job_id), "--job-id", job_id, "--",
                 sys.executable, SCRIPT, "--compile-s", "0.2", "--steps", "10", "--step-s", "0.1",
                 "--commit-every", commit_every, "--hold-s", "120", "--ready-file", str(ready)],
                env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ),
            ready,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while not all(ready.exists() for _, ready in jobs.values()):
            assert time.monotonic() < deadline, "the jobs did not get ready"
            assert all(proc.poll() is None for proc, _ in jobs.values())
            time.sleep(0.2)
        done = _fleet(str(runs), "--preempt-order", "--need-gpus", "1", "--json")
        assert done.returncode == 0, done.stderr
        order = json.loads(done.stdout)["preempt_order"]
        assert [o["job_id"] for o in order["order"]] == ["committed", "uncommitted"]
        assert order["victims"] == ["committed"]
        committed, uncommitted = order["order"]
        assert committed["unsaved_s"] < uncommitted["unsaved_s"]
        assert committed["gpus"] == 1 and committed["recovery_source"] in ("tts", "family_tts")
        assert all(ready.read_text() == "train_phases" for _, ready in jobs.values())  # ETTR_FAMILY
    finally:
        for proc, _ in jobs.values():
            proc.send_signal(signal.SIGTERM)
        for proc, _ in jobs.values():
            proc.wait(timeout=60)
