"""Lightning under `ettr run`, as a new user would run it: an ordinary script (`tests/scripts/train_lightning.py`,
ModelCheckpoint every 10 steps with save_last, `fit(ckpt_path="last")`), faults injected, and the report
checked against what the script itself saw. Zero code (the bootstrap adds the callback) and the one-line
explicit callback must give the same report; a 2-rank DDP run (gloo, torchrun) too."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from framework_truth import SCRIPTS, check_against_truth, report, run_ettr, summary

pytest.importorskip("lightning")
pytestmark = pytest.mark.slow

SCRIPT = str(SCRIPTS / "train_lightning.py")


def lightning(tmp_path: Path, *extra: str) -> list[str]:
    return [
        sys.executable, SCRIPT, "--ckpt-dir", str(tmp_path / "ckpt"), "--observe", str(tmp_path / "seen.jsonl"),
        "--num-steps", "60", "--save-every", "10", "--val-every", "20", "--step-s", "0.03", *extra,
    ]  # fmt: skip


@pytest.mark.parametrize("explicit", [False, True], ids=["zero-code", "explicit-callback"])
def test_crash_between_checkpoints_resumes_from_the_last_one(tmp_path: Path, explicit: bool) -> None:
    run_dir = tmp_path / "run"
    extra = ["--explicit"] if explicit else []
    done = run_ettr(
        "run", "--run-dir", str(run_dir), "--inject", "crash@step=35", "--", *lightning(tmp_path, *extra)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rep = report(run_dir)
    # The case: resumed from 30 (not from nothing), 5 steps lost (not 35), ended at 60 (not 30).
    assert summary(rep) == [("failed", None, 35, 5), ("completed", 30, 60, 0)]
    check_against_truth(rep, tmp_path / "seen.jsonl", ["failed", "completed"])
    assert len(rep["checkpoint_commits"]) == 6  # steps 10..60, each once although save_last writes two files
    assert rep["buckets_s"]["other"] > 0  # the validation loops
    phases = rep["attempts"][1]["phases_s"]
    assert phases["restore"] > 0 and phases["eval"] > 0 and phases["train_module_creation"] > 0


def test_preemption_then_requeue(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = run_ettr(
        "run", "--run-dir", str(run_dir), "--inject", "preempt@step=25", "--", *lightning(tmp_path)
    )
    assert done.returncode == 143, done.stderr[-3000:]
    again = run_ettr("run", "--run-dir", str(run_dir), "--", *lightning(tmp_path))
    assert again.returncode == 0, again.stderr[-3000:]
    rep = report(run_dir)
    assert [a["outcome"] for a in rep["attempts"]] == ["preempted", "completed"]
    assert rep["attempts"][1]["resumed_from_step"] == 20
    check_against_truth(rep, tmp_path / "seen.jsonl", ["preempted", "completed"])


def test_async_checkpoint_io_is_blocking_plus_persist(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = run_ettr("run", "--run-dir", str(run_dir), "--", *lightning(tmp_path, "--async-save"))
    assert done.returncode == 0, done.stderr[-3000:]
    rep = report(run_dir)
    check_against_truth(rep, tmp_path / "seen.jsonl", ["completed"])
    phases = rep["attempts"][0]["phases_s"]
    assert phases["checkpoint_blocking"] > 0 and phases["checkpoint_persist"] > 0


def test_ddp_on_two_cpu_ranks(tmp_path: Path) -> None:
    from mp_util import free_port

    run_dir = tmp_path / "run"
    torchrun = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
        *lightning(tmp_path, "--strategy", "ddp")[1:],
    ]  # fmt: skip
    done = run_ettr("run", "--run-dir", str(run_dir), "--inject", "crash@step=15,rank=1", "--", *torchrun)
    assert done.returncode == 0, done.stderr[-3000:]
    rep = report(run_dir)
    assert summary(rep)[1] == ("completed", 10, 60, 0)
    check_against_truth(rep, tmp_path / "seen.jsonl", ["failed", "completed"])
    ranks = {c["rank"] for c in rep["checkpoint_commits"]}
    assert ranks == {0}  # rank 0 writes Lightning's checkpoints and commits them, once
