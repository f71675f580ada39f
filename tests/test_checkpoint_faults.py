"""Faults with real processes: SIGKILL at random moments and mid-persist, crashes and preemption through
`ettr run`, and bit rot between runs. A resume must never load an incomplete or corrupt checkpoint, and a
job that was killed and resumed must end bit-identical to an uninterrupted run of the same job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ettr.checkpoint.writer import FAULT_POINTS
from ettr.events import EventKind
from ettr.ledger import open_ledger
from ettr.testing.faults import TrialRunner
from ettr.testing.toyjob import ToyJob, reference_digests

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

ETTR = [sys.executable, "-m", "ettr.cli"]
TOYJOB = [sys.executable, "-m", "ettr.testing.toyjob"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    env["PYTHONWARNINGS"] = "ignore"
    return env


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(args), capture_output=True, text=True, timeout=timeout, env=_env(), check=False
    )


def _report(run_dir: Path) -> dict[str, Any]:
    done = _run(*ETTR, "report", str(run_dir), "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _commits(run_dir: Path) -> list[int]:
    ledger = open_ledger(run_dir, create=False)
    try:
        return [e.step for e in ledger.read() if e.kind is EventKind.CHECKPOINT_COMMIT]
    finally:
        ledger.close()


def test_a_job_crashed_twice_ends_bit_identical_to_an_uninterrupted_run(tmp_path):
    """SIGKILL after step 13, then SIGKILL while a checkpoint is being written; `ettr run` restarts it."""
    num_steps = 30
    expected = reference_digests(ToyJob(root="-", num_steps=num_steps))[num_steps]
    run_dir, out = tmp_path / "run", tmp_path / "final.txt"
    done = _run(
        *ETTR, "run", "--run-dir", str(run_dir),
        "--inject", "kill@step=13", "--inject", "kill@checkpoint,attempt=1",
        "--", *TOYJOB, "--root", str(tmp_path / "ckpt"), "--steps", str(num_steps), "--every", "5", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert out.read_text().strip() == expected
    report = _report(run_dir)
    attempts = [(a["outcome"], a["exit_code"], a["resumed_from_step"]) for a in report["attempts"]]
    assert [a[:2] for a in attempts] == [("failed", 137), ("failed", 137), ("completed", 0)]
    assert (
        attempts[1][2] is not None and attempts[2][2] is not None
    )  # both restarts resumed from a checkpoint
    assert report["attempts"][2]["last_step"] == num_steps
    # the resume point of each restart is one the ledger saw committed before the failure
    commits = _commits(run_dir)
    assert attempts[1][2] in commits and attempts[2][2] in commits
    # each save is recorded once (the bootstrap's DCP hooks leave ettr's own saves alone)
    assert len(commits) == len(set(commits)), commits


def test_preemption_saves_at_the_step_boundary_and_a_requeued_run_loses_nothing(tmp_path):
    """SIGTERM to `ettr run` (as a scheduler sends it) while the job trains: the job saves at its next step
    boundary and exits 143 within the grace period; the requeued run resumes from exactly that step."""
    num_steps = 20
    expected = reference_digests(ToyJob(root="-", num_steps=num_steps))[num_steps]
    run_dir, ckpt, out = tmp_path / "run", tmp_path / "ckpt", tmp_path / "final.txt"
    job = [*TOYJOB, "--root", str(ckpt), "--steps", str(num_steps), "--every", "100", "--preemptible"]
    supervisor = subprocess.Popen(
        [*ETTR, "run", "--run-dir", str(run_dir), "--", *job, "--step-delay-s", "0.05"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        for line in supervisor.stdout:  # the job prints "step N" after each step
            if line.strip() == "step 5":
                supervisor.send_signal(signal.SIGTERM)
                break
        _, stderr = supervisor.communicate(timeout=120)
    finally:
        supervisor.kill()
    assert supervisor.returncode == 143, stderr
    first = _report(run_dir)["attempts"][0]
    assert first["outcome"] == "preempted" and first["exit_code"] == 143, stderr
    # the step interval (100) never saved: the preemption save did, at the step the loop had reached
    assert _commits(run_dir) == [first["last_step"]] and first["last_step"] >= 5
    assert first["lost_steps"] == 0
    again = _run(*ETTR, "run", "--run-dir", str(run_dir), "--", *job, "--out", str(out))
    assert again.returncode == 0, again.stderr
    second = _report(run_dir)["attempts"][1]
    assert second["resumed_from_step"] == first["last_step"]
    assert out.read_text().strip() == expected


def test_a_bit_flipped_shard_is_skipped_and_the_job_still_ends_exact(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "final.txt"
    first = _run(*TOYJOB, "--root", str(ckpt), "--steps", "20", "--every", "5")
    assert first.returncode == 0, first.stderr
    shard = ckpt / "step_000000020" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x04
    shard.write_bytes(bytes(data))
    second = _run(*TOYJOB, "--root", str(ckpt), "--steps", "30", "--every", "5", "--out", str(out))
    assert second.returncode == 0, second.stderr
    assert "skipping checkpoint step_000000020" in second.stderr and "CRC-32" in second.stderr
    assert out.read_text().strip() == reference_digests(ToyJob(root="-", num_steps=30))[30]


def test_sigkill_trials_never_resume_from_a_bad_checkpoint(tmp_path):
    """A modest number of trials here; `benchmarks/checkpoint_faults.py` runs hundreds."""
    runner = TrialRunner(tmp_path, hidden=256, num_steps=16, seed=1)
    runner.calibrate()
    results = [runner.run_trial(i) for i in range(8)]
    results += [runner.run_trial(100 + i, point=point, nth_save=2) for i, point in enumerate(FAULT_POINTS)]
    problems = [r for r in results if r.bad or r.stale]
    assert not problems, problems
    assert sum(r.exit_code == -9 for r in results) >= len(FAULT_POINTS)  # the point trials always kill
    # every point before the manifest rename leaves the save incomplete, and the resume skips it
    for result in results[-len(FAULT_POINTS) :]:
        if result.kill != "manifest_renamed":
            assert result.num_incomplete == 1, result
