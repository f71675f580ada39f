"""The Hugging Face Trainer under `ettr run`, as a new user would run it: an ordinary script
(`tests/scripts/train_hf.py`: a one-layer GPT-2 built from its config, `save_steps=10`, evaluation every 20
steps, `train(resume_from_checkpoint=<newest>)`), faults injected, and the report checked against what the
script itself saw. Zero code (the bootstrap adds the callback) and the one-line explicit callback must give
the same report. Nothing is downloaded (HF_HUB_OFFLINE)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ettr.bootstrap.frameworks import FrameworkHooks
from ettr.bootstrap.hooks import Guard, Patcher
from ettr.constants import TRAINING_ENDED_MARK
from ettr.events import EventKind, Phase
from ettr.ledger import MemoryLedger
from ettr.recorder import Recorder
from framework_truth import SCRIPTS, check_against_truth, report, run_ettr, summary

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it
torch = pytest.importorskip("torch")
slow = pytest.mark.slow

SCRIPT = str(SCRIPTS / "train_hf.py")


def hf(tmp_path: Path, *extra: str) -> list[str]:
    return [
        sys.executable, SCRIPT, "--out-dir", str(tmp_path / "out"), "--observe", str(tmp_path / "seen.jsonl"),
        "--num-steps", "50", "--save-every", "10", "--eval-every", "20", "--step-s", "0.02", *extra,
    ]  # fmt: skip


def _check_checkpoints_and_buckets(rep: dict) -> None:
    """What both ways of adding ettr (zero code, the explicit callback) must record the same way."""
    # One commit per checkpoint directory (not one per torch.save of optimizer, scheduler, RNG, ...).
    assert [c["step"] for c in rep["checkpoint_commits"]] == [10, 20, 30, 40, 50]
    assert all(Path(c["path"]).name == f"checkpoint-{c['step']}" for c in rep["checkpoint_commits"])
    # The whole save is blocking: safetensors weights included (the span covers every file).
    assert rep["attempts"][0]["phases_s"]["checkpoint_blocking"] > 0
    assert rep["buckets_s"]["evaluation"] > 0  # the evaluations
    assert rep["attempts"][1]["phases_s"]["restore"] > 0  # weights, optimizer, RNG and data fast-forward


# Zero code here, the explicit callback in the preemption test: each way of adding ettr through a failure and
# a resume, and the same checks of both (one job each instead of the crash twice).
@slow
def test_crash_between_checkpoints_resumes_from_the_last_one(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = run_ettr("run", "--run-dir", str(run_dir), "--inject", "crash@step=35", "--", *hf(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    rep = report(run_dir)
    assert summary(rep) == [("failed", None, 35, 5), ("completed", 30, 50, 0)]
    check_against_truth(rep, tmp_path / "seen.jsonl", ["failed", "completed"])
    _check_checkpoints_and_buckets(rep)
    assert rep["buckets_s"]["other"] == 0


@slow
def test_preemption_then_requeue_with_the_explicit_callback(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job = hf(tmp_path, "--explicit")
    done = run_ettr("run", "--run-dir", str(run_dir), "--inject", "preempt@step=25", "--", *job)
    assert done.returncode == 143, done.stderr[-3000:]
    again = run_ettr("run", "--run-dir", str(run_dir), "--", *job)
    assert again.returncode == 0, again.stderr[-3000:]
    rep = report(run_dir)
    assert [a["outcome"] for a in rep["attempts"]] == ["preempted", "completed"]
    assert rep["attempts"][1]["resumed_from_step"] == 20
    check_against_truth(rep, tmp_path / "seen.jsonl", ["preempted", "completed"])
    _check_checkpoints_and_buckets(rep)


# -- in process: the callback on a real Trainer, and the bootstrap's installation -----------------------------
class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, 32, (n, 8), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer(tmp_path: Path, max_steps: int, callbacks: list) -> object:
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=8, vocab_size=32)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=max_steps, per_device_train_batch_size=4, save_steps=3,
        report_to="none", use_cpu=True, disable_tqdm=True, eval_strategy="steps", eval_steps=3,
    )  # fmt: skip
    return transformers.Trainer(
        model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=_Tokens(64),
        eval_dataset=_Tokens(4), callbacks=callbacks,
    )  # fmt: skip


def test_the_callback_records_the_trainer_step_resume_and_one_commit_per_checkpoint(tmp_path: Path) -> None:
    from ettr.integrations.huggingface import EttrCallback, install_on

    ledger = MemoryLedger()
    rec = Recorder(ledger, attempt=0)
    trainer = _trainer(tmp_path, 6, [EttrCallback(rec)])
    install_on(trainer, rec)  # what the bootstrap does: attaches the user's callback, adds none
    trainer.train()
    rec.flush()
    events = ledger.read()
    assert [e.step for e in events if e.kind is EventKind.STEP] == [1, 2, 3, 4, 5, 6]
    commits = [e for e in events if e.kind is EventKind.CHECKPOINT_COMMIT]
    assert [(e.step, Path(e.data["path"]).name) for e in commits] == [
        (3, "checkpoint-3"),
        (6, "checkpoint-6"),
    ]
    blocking = [e for e in events if e.kind is EventKind.PHASE_END and e.phase is Phase.CHECKPOINT_BLOCKING]
    assert [e.step for e in blocking] == [3, 6]  # one span per checkpoint, every file inside it
    assert sum(1 for e in events if e.kind is EventKind.PHASE_END and e.phase is Phase.EVAL) == 2
    ended = [e.step for e in events if e.kind is EventKind.MARK and e.data["name"] == TRAINING_ENDED_MARK]
    assert ended == [6]  # the training loop's end

    rec = Recorder(ledger, attempt=1)
    trainer = _trainer(tmp_path, 9, [])
    install_on(trainer, rec)
    trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))
    rec.flush()
    events = [e for e in ledger.read() if e.attempt == 1]
    assert [e.step for e in events if e.kind is EventKind.RESUMED] == [3]
    assert [e.step for e in events if e.kind is EventKind.STEP] == [4, 5, 6, 7, 8, 9]
    stages = {e.data["stage"] for e in events if e.kind is EventKind.PHASE_END and e.phase is Phase.RESTORE}
    assert {"from_checkpoint", "optimizer_and_scheduler", "data_fast_forward"} <= stages
    # Each restore of the checkpoint names it: the report can tell a restore of a save that never completed.
    read = {
        e.data.get("path") for e in events if e.kind is EventKind.PHASE_BEGIN and e.phase is Phase.RESTORE
    }
    assert read == {str(tmp_path / "out" / "checkpoint-3")}
    sources = {e.data.get("source") for e in events if e.phase is Phase.RESTORE and e.data.get("path")}
    assert sources == {"storage"}  # the report's "(restored from)", not "?"


def test_the_bootstrap_gives_every_trainer_exactly_one_callback(tmp_path: Path) -> None:
    import transformers.trainer as trainer_module

    from ettr.integrations.huggingface import EttrCallback

    rec = Recorder(MemoryLedger())
    patcher = Patcher()
    FrameworkHooks(rec, guard=Guard(), patcher=patcher).on_import(trainer_module)
    try:
        mine = EttrCallback(rec)
        explicit = _trainer(tmp_path, 1, [mine])
        plain = _trainer(tmp_path, 1, [])
        assert [c for c in explicit.callback_handler.callbacks if isinstance(c, EttrCallback)] == [mine]
        assert sum(isinstance(c, EttrCallback) for c in plain.callback_handler.callbacks) == 1
    finally:
        patcher.undo()
    assert not any(isinstance(c, EttrCallback) for c in _trainer(tmp_path, 1, []).callback_handler.callbacks)


def test_a_save_begin_is_in_the_ledger_before_the_trainer_writes_a_file(tmp_path: Path) -> None:
    # A kill -9 inside `_save_checkpoint` leaves a torn checkpoint-N that `get_last_checkpoint` picks next;
    # the report can only name it if the save's begin was written before the process died.
    from ettr.integrations.huggingface import install_on

    ledger = MemoryLedger()
    rec = Recorder(ledger, attempt=0, flush_interval_s=3600.0)  # the writer thread never writes by itself
    trainer = _trainer(tmp_path, 3, [])
    install_on(trainer, rec)
    seen: list[list] = []
    save_model = trainer.save_model

    def save_model_first(*args, **kwargs):  # the first file of the checkpoint
        seen.append(
            [
                e.step
                for e in ledger.read()
                if e.kind is EventKind.PHASE_BEGIN and e.phase is Phase.CHECKPOINT_BLOCKING
            ]
        )
        return save_model(*args, **kwargs)

    trainer.save_model = save_model_first
    try:
        trainer.train()
    finally:
        rec.close()
    assert seen == [[3]]


def test_a_user_callback_that_raises_in_on_step_end_does_not_hide_that_step(tmp_path: Path) -> None:
    # ettr's callback runs first: the optimizer step is recorded before the user's callback fails, so the
    # report's last step (and the steps lost since the last checkpoint) is the optimizer's.
    from ettr.integrations.huggingface import EttrCallback, install_on

    class Boom(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                raise RuntimeError("a user callback failed")

    ledger = MemoryLedger()
    rec = Recorder(ledger, attempt=0)
    mine = EttrCallback(rec)
    trainer = _trainer(tmp_path, 4, [mine, Boom()])  # listed before the user's: still first, still one
    install_on(trainer, rec)
    callbacks = trainer.callback_handler.callbacks
    assert callbacks[0] is mine and sum(isinstance(c, EttrCallback) for c in callbacks) == 1
    with pytest.raises(RuntimeError, match="a user callback failed"):
        trainer.train()
    rec.close()
    assert [e.step for e in ledger.read() if e.kind is EventKind.STEP] == [1, 2]
