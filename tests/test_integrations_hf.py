"""The Hugging Face Trainer under `ettr run`, as a new user would run it: an ordinary script
(`tests/scripts/train_hf.py`: a one-layer GPT-2 built from its config, `save_steps=10`, evaluation every 20
steps, `train(resume_from_checkpoint=<newest>)`), faults injected, and the report checked against what the
script itself saw. Zero code (the bootstrap adds the callback) and the one-line explicit callback must give
the same report. Nothing is downloaded (HF_HUB_OFFLINE)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from framework_truth import SCRIPTS, check_against_truth, report, run_ettr, summary

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it
pytestmark = pytest.mark.slow

SCRIPT = str(SCRIPTS / "train_hf.py")


def hf(tmp_path: Path, *extra: str) -> list[str]:
    return [
        sys.executable, SCRIPT, "--out-dir", str(tmp_path / "out"), "--observe", str(tmp_path / "seen.jsonl"),
        "--num-steps", "50", "--save-every", "10", "--eval-every", "20", "--step-s", "0.02", *extra,
    ]  # fmt: skip


@pytest.mark.parametrize("explicit", [False, True], ids=["zero-code", "explicit-callback"])
def test_crash_between_checkpoints_resumes_from_the_last_one(tmp_path: Path, explicit: bool) -> None:
    run_dir = tmp_path / "run"
    extra = ["--explicit"] if explicit else []
    done = run_ettr(
        "run", "--run-dir", str(run_dir), "--inject", "crash@step=35", "--", *hf(tmp_path, *extra)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rep = report(run_dir)
    assert summary(rep) == [("failed", None, 35, 5), ("completed", 30, 50, 0)]
    check_against_truth(rep, tmp_path / "seen.jsonl", ["failed", "completed"])
    # One commit per checkpoint directory (not one per torch.save of optimizer, scheduler, RNG, ...).
    assert [c["step"] for c in rep["checkpoint_commits"]] == [10, 20, 30, 40, 50]
    assert all(Path(c["path"]).name == f"checkpoint-{c['step']}" for c in rep["checkpoint_commits"])
    # The whole save is blocking: safetensors weights included (the span covers every file).
    assert rep["attempts"][0]["phases_s"]["checkpoint_blocking"] > 0
    assert rep["buckets_s"]["other"] > 0  # the evaluations
    assert rep["attempts"][1]["phases_s"]["restore"] > 0  # weights, optimizer, RNG and data fast-forward


def test_preemption_then_requeue(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = run_ettr("run", "--run-dir", str(run_dir), "--inject", "preempt@step=25", "--", *hf(tmp_path))
    assert done.returncode == 143, done.stderr[-3000:]
    again = run_ettr("run", "--run-dir", str(run_dir), "--", *hf(tmp_path))
    assert again.returncode == 0, again.stderr[-3000:]
    rep = report(run_dir)
    assert [a["outcome"] for a in rep["attempts"]] == ["preempted", "completed"]
    assert rep["attempts"][1]["resumed_from_step"] == 20
    check_against_truth(rep, tmp_path / "seen.jsonl", ["preempted", "completed"])
