"""The reference DLRM job for real: torchrun, 2 ranks over gloo, checkpointed, resumed.

One uninterrupted run to step 60 (checkpoints at 20, 40, 60), then the step-60 checkpoint is taken away
and the job run again: it must resume at 40 and reproduce the uninterrupted run's losses for 41..60.
Once with the plain `sync` checkpoints and the compiled dense tower, once with the ettr checkpoint
manager and the loader workers started before the resume step is known (eager, to keep it short).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from ettr.audit import MARK_NAME
from ettr.events import EventKind, Phase
from ettr.ledger import open_ledger

TRAIN = Path(__file__).resolve().parents[1] / "examples" / "dlrm" / "train.py"


def run_job(tmp_path: Path, summary_name: str, *extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(TRAIN), "--steps", "60", "--ckpt-every", "20", "--log-every", "10", "--worker-startup-s", "0.3",
        "--ckpt-dir", str(tmp_path / "ckpt"), "--ettr-run-dir", str(tmp_path / "run"),
        "--summary-out", str(tmp_path / summary_name), *extra,
    ]  # fmt: skip
    proc = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=600
    )  # a hang guard: a compiled 2-rank job took >150 s at load 10
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[dlrm] done" in proc.stdout
    return json.loads((tmp_path / summary_name).read_text())


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_sync_checkpoints_two_ranks_compiled_train_record_and_resume_exactly(tmp_path):
    first = run_job(tmp_path, "first.json", "--ckpt-mode", "sync", "--compile")
    assert first["resumed_step"] == 0 and first["last_step"] == 60
    losses = first["window_losses"]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.08  # it learns the hidden model
    # The COMPILE phase compiled what the loop runs: no recompile at the first real step.
    assert first["num_compiled_graphs_after_warm_up"] >= 1
    assert first["num_compiled_graphs_at_end"] == first["num_compiled_graphs_after_warm_up"]
    assert first["audit"]["num_calls"] >= 4

    shutil.rmtree(tmp_path / "ckpt" / "step_00000060")  # as if the job had died before that save
    second = run_job(tmp_path, "second.json", "--ckpt-mode", "sync", "--compile")
    assert second["resumed_step"] == 40 and second["last_step"] == 60
    # Same data, same restored state: the same losses as the uninterrupted run (41-50, 51-60).
    assert second["window_losses"] == pytest.approx(losses[-2:], rel=1e-5, abs=1e-6)
    check_ledger(tmp_path, with_compile=True)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_ettr_checkpoints_two_ranks_resume_exactly(tmp_path):
    first = run_job(tmp_path, "first.json", "--ckpt-mode", "ettr", "--no-compile", "--overlap-startup")
    losses = first["window_losses"]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.08
    steps = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_"))
    assert steps == ["step_000000040", "step_000000060"]  # the manager keeps the newest two
    shutil.rmtree(tmp_path / "ckpt" / "step_000000060")
    second = run_job(tmp_path, "second.json", "--ckpt-mode", "ettr", "--no-compile", "--overlap-startup")
    assert second["resumed_step"] == 40 and second["last_step"] == 60
    assert second["window_losses"] == pytest.approx(losses[-2:], rel=1e-5, abs=1e-6)
    check_ledger(tmp_path, with_compile=False)


def check_ledger(tmp_path: Path, *, with_compile: bool) -> None:
    """Both attempts' steps, resumes, commits, init phases and audits are in the run's ledger."""
    events = open_ledger(tmp_path / "run").read()
    steps: dict[tuple[int, int], list[int]] = defaultdict(list)
    for e in events:
        if e.kind is EventKind.STEP:
            steps[(e.attempt, e.rank)].append(e.step)
    assert steps == {
        (0, 0): list(range(1, 61)),
        (0, 1): list(range(1, 61)),
        (1, 0): list(range(41, 61)),
        (1, 1): list(range(41, 61)),
    }
    resumed = {(e.attempt, e.rank): e.step for e in events if e.kind is EventKind.RESUMED}
    assert resumed == {(0, 0): None, (0, 1): None, (1, 0): 40, (1, 1): 40}
    commits = sorted((e.attempt, e.step) for e in events if e.kind is EventKind.CHECKPOINT_COMMIT)
    assert commits == [(0, 20), (0, 40), (0, 60), (1, 60)]
    phases = {(e.attempt, e.rank, e.phase) for e in events if e.kind is EventKind.PHASE_END}
    for attempt in (0, 1):
        for rank in (0, 1):
            for phase in (
                Phase.DEVICE_INIT,
                Phase.PROCESS_GROUP_INIT,
                Phase.PREPROC_CREATION,
                Phase.TRAIN_MODULE_CREATION,
                Phase.INIT_PLUGINS,
                Phase.PRE_TRAIN,
                Phase.GET_FIRST_BATCH_DATA,
                Phase.CHECKPOINT_BLOCKING,
                Phase.SHUTDOWN,
            ):
                assert (attempt, rank, phase) in phases
            assert ((attempt, rank, Phase.COMPILE) in phases) == with_compile
    assert {(1, 0, Phase.RESTORE), (1, 1, Phase.RESTORE)} <= phases  # attempt 0 had nothing to restore
    audits = [e for e in events if e.kind is EventKind.MARK and e.data.get("name") == MARK_NAME]
    assert sorted((e.attempt, e.rank) for e in audits) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for mark in audits:
        stages = mark.data["stages"]
        assert stages["process_group_init"]["init_process_group"]["num_calls"] == 1
        # TorchRec's planner plans on rank 0 and broadcasts the plan.
        assert stages["train_module_creation"]["broadcast_object_list"]["num_calls"] >= 1
        assert "barrier" in stages["pre_train"]
