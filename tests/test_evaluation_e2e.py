"""Evaluation inside an unmodified training loop, under `ettr run` as a new user would run it
(`tests/scripts/train_eval.py`, shaped like nanoGPT's train.py), checked against the script's own clock.

The zero-code span of an evaluation lies between the script's `eval()` and `train()` calls and covers its
forward passes, so the report's `evaluation` must lie between the sum of the kept evaluations' passes and
the sum of their whole calls, as the script timed them: exact inequalities, whatever the machine's load.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from framework_truth import SCRIPTS, report, run_ettr, summary

pytest.importorskip("torch")
SCRIPT = str(SCRIPTS / "train_eval.py")
EPS = 1e-6


def _seen(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _evaluations(seen: list[dict[str, Any]], kept: dict[int, float]) -> tuple[float, float, float]:
    """(passes, whole calls) of the evaluations of kept state, and the passes of the others; `kept`: attempt
    -> the highest step of it that was kept."""
    inner = {(s["attempt"], s["step"]): s["t1"] - s["t0"] for s in seen if s["what"] == "eval_passes"}
    outer = {(s["attempt"], s["step"]): s["t1"] - s["t0"] for s in seen if s["what"] == "eval"}
    kept_inner = math.fsum(v for (a, step), v in inner.items() if step <= kept[a])
    kept_outer = math.fsum(v for (a, step), v in outer.items() if step <= kept[a])
    lost_inner = math.fsum(v for (a, step), v in inner.items() if step > kept[a])
    return kept_inner, kept_outer, lost_inner


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eval_mode", "train_mode"])
def test_a_crash_keeps_the_evaluations_of_kept_steps_and_wastes_the_others(tmp_path: Path, mode: str) -> None:
    """`train_mode`: the evaluation never calls `eval()`; it runs a validation DataLoader through the training model
    under `torch.set_grad_enabled(False)` (pytorch/examples' minGPT-ddp; `ettr.bootstrap.loader_eval`)."""
    import torch

    run_dir, observe, data = tmp_path / "run", tmp_path / "seen.jsonl", tmp_path / "inputs.pt"
    torch.save(torch.randn(256, 16), data)  # a data set the script loads at start: start-up, not a restore
    done = run_ettr(
        "run", "--run-dir", str(run_dir), "--inject", "crash@step=17", "--",
        sys.executable, SCRIPT, "--ckpt", str(tmp_path / "ckpt.pt"), "--observe", str(observe),
        "--num-steps", "20", "--eval-every", "5", "--save-every", "10", "--data", str(data),
        *(["--eval-in-train-mode"] if mode == "train_mode" else []),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rep = report(run_dir)
    # Saved at 10 (after its evaluation); crashed at 17; evaluations at 0, 5, 10, 15, then 10 again after the
    # resume, 15 and the final one at 20.
    assert summary(rep) == [("failed", None, 17, 7), ("completed", 10, 20, 0)]
    kept_inner, kept_outer, lost_inner = _evaluations(_seen(observe), {0: 10, 1: 20})
    evaluation = rep["buckets_s"]["evaluation"]
    assert kept_inner - EPS <= evaluation <= kept_outer + EPS, (kept_inner, evaluation, kept_outer)
    assert rep["attempts"][0]["buckets_s"]["wasted_progress"] >= lost_inner  # the evaluation of step 15
    assert rep["attempts"][1]["buckets_s"]["evaluation"] > 0  # the one the resume repeated, and the final one
    assert rep["phases_s"]["eval"] >= kept_inner + lost_inner - EPS
    # The data set's load is start-up work in both attempts; only the checkpoint's is a restore.
    assert "restore" not in rep["attempts"][0]["phases_s"] and rep["attempts"][0]["buckets_s"]["restore"] == 0
    assert rep["attempts"][1]["buckets_s"]["restore"] > 0


@pytest.mark.slow
def test_a_final_evaluation_left_in_eval_mode_ends_with_its_last_pass(tmp_path: Path) -> None:
    run_dir, observe = tmp_path / "run", tmp_path / "seen.jsonl"
    done = run_ettr(
        "run", "--run-dir", str(run_dir), "--",
        sys.executable, SCRIPT, "--ckpt", str(tmp_path / "ckpt.pt"), "--observe", str(observe),
        "--num-steps", "10", "--eval-every", "5", "--save-every", "5", "--final-eval-in-eval-mode",
        "--save-model", str(tmp_path / "model.pt"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]  # the whole model pickled in mid-evaluation
    import torch

    saved = torch.load(tmp_path / "model.pt", weights_only=False)
    assert not saved.training and not saved._forward_pre_hooks and not saved._forward_hooks
    rep = report(run_dir)
    assert summary(rep) == [("completed", None, 10, 0)]
    seen = _seen(observe)
    kept_inner, kept_outer, _ = _evaluations(seen, {0: 10})
    evaluation = rep["buckets_s"]["evaluation"]
    assert kept_inner - EPS <= evaluation <= kept_outer + EPS, (kept_inner, evaluation, kept_outer)
    final = [s for s in seen if s["what"] == "eval_passes" and s["step"] == 10]
    assert final and evaluation >= final[0]["t1"] - final[0]["t0"]  # booked although after the last step
