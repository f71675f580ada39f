"""A real `ettr run` job writing to a real PostgreSQL that is stopped mid-run and started again.

The job crashes once (so it has two attempts and a resume); the server is away for seconds while it trains.
Afterwards the shared ledger holds every step of every attempt exactly once, and `ettr report --ledger`
gives the complete report.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from ettr.events import EventKind
from ettr.ledger.url import open_url

pytestmark = pytest.mark.slow

PLAIN = str(Path(__file__).parent / "scripts" / "train_plain.py")
ETTR = [sys.executable, "-m", "ettr.cli"]
NUM_STEPS = 60


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}


def _num_steps_on_server(url: str, job_id: str) -> int:
    try:
        ledger = open_url(url, job_id=job_id)
    except Exception:
        return 0
    try:
        return sum(1 for e in ledger.read() if e.kind is EventKind.STEP)
    finally:
        ledger.close()


def test_stopping_postgres_mid_run_loses_no_event_and_stores_none_twice(private_postgres, tmp_path):
    server = private_postgres
    url, job_id, run_dir = server.url, "outage", tmp_path / "run"
    command = [
        *ETTR, "run", "--run-dir", str(run_dir), "--job-id", job_id, "--ledger", url,
        "--inject", "crash@step=25", "--",
        sys.executable, PLAIN, "--ckpt-dir", str(tmp_path / "ckpt"), "--num-steps", str(NUM_STEPS),
        "--save-every", "10", "--step-s", "0.1", "--init-s", "0.1", "--first-batch-s", "0.1",
    ]  # fmt: skip
    job = subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while _num_steps_on_server(url, job_id) < 5:
            assert job.poll() is None, job.communicate()
            assert time.monotonic() < deadline, "the job never reached step 5"
            time.sleep(0.2)
        server.stop()  # mid-run: attempt 0 is training; its crash at step 25 falls inside the outage
        time.sleep(4.0)
        spilled = list((run_dir / "ledger-spill").glob("*.jsonl"))
        server.start()
        out, err = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, err
    assert spilled, "nothing was spilled: the outage did not overlap the run"
    assert not list((run_dir / "ledger-spill").glob("*.jsonl")), "spill files left after delivery"

    events = open_url(url, job_id=job_id).read()
    steps = Counter((e.attempt, e.step) for e in events if e.kind is EventKind.STEP)
    assert all(n == 1 for n in steps.values()), [k for k, n in steps.items() if n > 1]
    assert sorted(s for a, s in steps if a == 0) == list(range(1, 26))
    resumed = sorted(s for a, s in steps if a == 1)
    assert resumed == list(range(21, NUM_STEPS + 1)), (resumed[:3], err[-3000:])  # resumed from step 20
    supervisor = Counter(e.kind for e in events if e.rank < 0)
    assert supervisor[EventKind.ATTEMPT_START] == 2 and supervisor[EventKind.ATTEMPT_END] == 2
    assert supervisor[EventKind.JOB_END] == 1

    done = subprocess.run(
        [*ETTR, "report", "--ledger", url, "--job-id", job_id, "--json"],
        capture_output=True, text=True, timeout=120, env=_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rep = json.loads(done.stdout)
    assert rep["job_id"] == job_id
    assert [(a["outcome"], a["resumed_from_step"], a["last_step"]) for a in rep["attempts"]] == [
        ("failed", None, 25),
        ("completed", 20, NUM_STEPS),
    ]
    assert math.fsum(rep["buckets_s"].values()) == pytest.approx(rep["wall_s"], rel=1e-6)
    # The run directory points at its books (the URL without its password: libpq takes it from PGPASSWORD).
    assert server.password not in (run_dir / "ledger-url.json").read_text()
    via_dir = subprocess.run(
        [*ETTR, "report", str(run_dir), "--json"], capture_output=True, text=True, timeout=120,
        env={**_env(), "PGPASSWORD": server.password},
    )  # fmt: skip
    assert via_dir.returncode == 0, via_dir.stderr
    assert json.loads(via_dir.stdout)["attempts"] == rep["attempts"]
