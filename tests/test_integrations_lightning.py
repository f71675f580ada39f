"""Lightning under `ettr run`, as a new user would run it: an ordinary script (`tests/scripts/train_lightning.py`,
ModelCheckpoint every 10 steps with save_last, `fit(ckpt_path="last")`), faults injected, and the report
checked against what the script itself saw. Zero code (the bootstrap adds the callback) and the one-line
explicit callback must give the same report; a 2-rank DDP run (gloo, torchrun) too."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ettr.bootstrap.frameworks import FrameworkHooks
from ettr.bootstrap.hooks import Guard, Patcher
from ettr.constants import TRAINING_ENDED_MARK
from ettr.events import EventKind, Phase
from ettr.integrations._commits import CHECKPOINT_FILE_MARK
from ettr.ledger import MemoryLedger
from ettr.recorder import Recorder
from framework_truth import SCRIPTS, check_against_truth, report, run_ettr, summary

pl = pytest.importorskip("lightning.pytorch")
torch = pytest.importorskip("torch")
slow = pytest.mark.slow

SCRIPT = str(SCRIPTS / "train_lightning.py")


def lightning(tmp_path: Path, *extra: str) -> list[str]:
    return [
        sys.executable, SCRIPT, "--ckpt-dir", str(tmp_path / "ckpt"), "--observe", str(tmp_path / "seen.jsonl"),
        "--num-steps", "60", "--save-every", "10", "--val-every", "20", "--step-s", "0.03", *extra,
    ]  # fmt: skip


def _check_checkpoints_and_phases(rep: dict) -> None:
    """What both ways of adding ettr (zero code, the explicit callback) must record the same way."""
    assert len(rep["checkpoint_commits"]) == 6  # steps 10..60, each once although save_last writes two files
    assert rep["buckets_s"]["evaluation"] > 0  # the validation loops
    phases = rep["attempts"][1]["phases_s"]
    assert phases["restore"] > 0 and phases["eval"] > 0 and phases["train_module_creation"] > 0


# Zero code here, the explicit callback in the preemption test: each way of adding ettr through a failure and
# a resume, and the same checks of both (one job each instead of the crash twice).
@slow
def test_crash_between_checkpoints_resumes_from_the_last_one(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = run_ettr("run", "--run-dir", str(run_dir), "--inject", "crash@step=35", "--", *lightning(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    rep = report(run_dir)
    # The case: resumed from 30 (not from nothing), 5 steps lost (not 35), ended at 60 (not 30).
    assert summary(rep) == [("failed", None, 35, 5), ("completed", 30, 60, 0)]
    check_against_truth(rep, tmp_path / "seen.jsonl", ["failed", "completed"])
    _check_checkpoints_and_phases(rep)
    assert rep["buckets_s"]["other"] == 0


@slow
def test_a_crash_while_a_checkpoint_is_written_loses_that_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = run_ettr(
        "run", "--run-dir", str(run_dir), "--inject", "crash@checkpoint", "--", *lightning(tmp_path)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rep = report(run_dir)
    assert summary(rep) == [("failed", None, 10, 10), ("completed", None, 60, 0)]
    assert [c["attempt"] for c in rep["checkpoint_commits"]] == [1] * 6


@slow
def test_preemption_then_requeue_with_the_explicit_callback(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job = lightning(tmp_path, "--explicit")
    done = run_ettr("run", "--run-dir", str(run_dir), "--inject", "preempt@step=25", "--", *job)
    assert done.returncode == 143, done.stderr[-3000:]
    again = run_ettr("run", "--run-dir", str(run_dir), "--", *job)
    assert again.returncode == 0, again.stderr[-3000:]
    rep = report(run_dir)
    assert [a["outcome"] for a in rep["attempts"]] == ["preempted", "completed"]
    assert rep["attempts"][1]["resumed_from_step"] == 20
    check_against_truth(rep, tmp_path / "seen.jsonl", ["preempted", "completed"])
    _check_checkpoints_and_phases(rep)


@slow
def test_async_checkpoint_io_is_blocking_plus_persist(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = run_ettr("run", "--run-dir", str(run_dir), "--", *lightning(tmp_path, "--async-save"))
    assert done.returncode == 0, done.stderr[-3000:]
    rep = report(run_dir)
    check_against_truth(rep, tmp_path / "seen.jsonl", ["completed"])
    phases = rep["attempts"][0]["phases_s"]
    assert phases["checkpoint_blocking"] > 0 and phases["checkpoint_persist"] > 0


@slow
def test_ddp_on_two_cpu_ranks(tmp_path: Path) -> None:
    from ettr.testing.spawn import free_port

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


# -- in process: the callback on a real Trainer, and the bootstrap's installation -----------------------------
class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(tmp_path: Path, callbacks: list, ckpt_path: str | None = None, max_steps: int = 6) -> pl.Trainer:
    from lightning.pytorch.callbacks import ModelCheckpoint

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 4)), batch_size=4)
    every = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_last=True, save_top_k=-1)
    trainer = pl.Trainer(
        max_steps=max_steps, accelerator="cpu", callbacks=[every, *callbacks], logger=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(_Tiny(), data, ckpt_path=ckpt_path)
    return trainer


def test_the_callback_records_the_framework_step_resume_and_one_commit_per_checkpoint(tmp_path: Path) -> None:
    from ettr.integrations.lightning import EttrCallback

    ledger = MemoryLedger()
    rec = Recorder(ledger, attempt=0)
    _fit(tmp_path, [EttrCallback(rec)])
    rec.flush()
    events = ledger.read()
    assert [e.step for e in events if e.kind is EventKind.STEP] == [1, 2, 3, 4, 5, 6]
    assert [e.step for e in events if e.kind is EventKind.CHECKPOINT_COMMIT] == [3, 6]  # + last.ckpt as marks
    marks = [e for e in events if e.kind is EventKind.MARK]
    assert [e.data["step"] for e in marks if e.data["name"] == CHECKPOINT_FILE_MARK] == [3, 6]
    assert [e.step for e in marks if e.data["name"] == TRAINING_ENDED_MARK] == [6]  # the fit loop's end
    assert [e.step for e in events if e.kind is EventKind.RESUMED] == [None]

    rec = Recorder(ledger, attempt=1)
    _fit(tmp_path, [EttrCallback(rec)], ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"), max_steps=9)
    rec.flush()
    events = [e for e in ledger.read() if e.attempt == 1]
    assert [e.step for e in events if e.kind is EventKind.RESUMED] == [6]
    assert [e.step for e in events if e.kind is EventKind.STEP] == [7, 8, 9]
    restores = [e for e in events if e.kind is EventKind.PHASE_END and e.phase is Phase.RESTORE]
    assert {e.data["stage"] for e in restores} == {"modules", "training_state"}
    assert [e.data.get("source") for e in restores if e.data["stage"] == "modules"] == ["storage"]
    assert all(e.ts >= e.value for e in restores)


def test_the_bootstrap_gives_every_trainer_exactly_one_callback(tmp_path: Path) -> None:
    import lightning.pytorch.trainer.trainer as trainer_module

    from ettr.integrations.lightning import EttrCallback

    rec = Recorder(MemoryLedger())
    patcher = Patcher()
    FrameworkHooks(rec, guard=Guard(), patcher=patcher).on_import(trainer_module)
    try:
        mine = EttrCallback(rec)
        explicit = pl.Trainer(callbacks=[mine], logger=False)
        plain = pl.Trainer(logger=False)
        assert [c for c in explicit.callbacks if isinstance(c, EttrCallback)] == [mine]
        assert sum(isinstance(c, EttrCallback) for c in plain.callbacks) == 1
    finally:
        patcher.undo()
    assert not any(isinstance(c, EttrCallback) for c in pl.Trainer(logger=False).callbacks)


def test_a_save_begin_is_in_the_ledger_before_lightning_writes_the_file(tmp_path: Path) -> None:
    # A kill -9 inside `save_checkpoint` leaves a torn file that `ckpt_path="last"` may pick next; the report
    # can only name it if the save's begin was written before the process died.
    from ettr.integrations.lightning import EttrCallback

    ledger = MemoryLedger()
    rec = Recorder(ledger, attempt=0, flush_interval_s=3600.0)  # the writer thread never writes by itself
    seen: list[list] = []

    class Look(pl.Callback):
        def on_save_checkpoint(
            self, trainer, pl_module, checkpoint
        ) -> None:  # inside the save, before the write
            begins = [e for e in ledger.read() if e.kind is EventKind.PHASE_BEGIN]
            seen.append([e.step for e in begins if e.phase is Phase.CHECKPOINT_BLOCKING])

    try:
        _fit(tmp_path, [Look(), EttrCallback(rec)], max_steps=3)
    finally:
        rec.close()
    assert seen and seen[0] == [3]
