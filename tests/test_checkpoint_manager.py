"""CheckpointManager in one process: what it records, when it commits, and how it fails safely."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from ettr.checkpoint import (
    PREEMPTED_EXIT_STATUS,
    CheckpointConfig,
    CheckpointError,
    CheckpointManager,
    IntervalConfig,
    TrainState,
    find_latest,
    list_checkpoints,
    read_failure_history,
    root_lock,
    step_dir_name,
    verify,
)
from ettr.checkpoint.base import MANIFEST_NAME
from ettr.checkpoint.root_lock import LOCK_NAME
from ettr.checkpoint.storage import open_storage
from ettr.events import SUPERVISOR_RANK, Event, EventKind, Outcome, Phase
from ettr.ledger import MemoryLedger, open_ledger
from ettr.recorder import Recorder

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class ProbeRecorder(Recorder):
    """A real Recorder over a MemoryLedger that also checks what the manager tells it, when it tells it."""

    def __init__(self, root: str | os.PathLike[str], **kwargs) -> None:
        super().__init__(MemoryLedger(), **kwargs)
        self.storage = open_storage(root)
        self.commit_checks: list[tuple[int, bool]] = []
        self.wait_started = threading.Event()

    def checkpoint_committed(self, step, path):
        try:  # the manifest must already be durable and valid when the commit is announced
            verify(self.storage, step_dir_name(step))
            self.commit_checks.append((step, True))
        except Exception:
            self.commit_checks.append((step, False))
        super().checkpoint_committed(step, path)

    def phase(self, phase, *, step=None, **data):
        if phase == Phase.CHECKPOINT_WAIT:
            self.wait_started.set()
        return super().phase(phase, step=step, **data)

    def events(self) -> list[Event]:
        self.flush()
        return self._ledger.read()


def _model_state() -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return TrainState(model=model, optimizer=optimizer)


def _train(state: TrainState, num_steps: int = 1) -> None:
    for _ in range(num_steps):
        loss = state.model(torch.randn(8, 32)).pow(2).mean()
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()


def _config(root, **kwargs) -> CheckpointConfig:
    kwargs.setdefault("interval", IntervalConfig(every_steps=1))
    return CheckpointConfig(root=root, **kwargs)


def _params(state: TrainState) -> list[torch.Tensor]:
    return [p.detach().clone() for p in state.model.parameters()]


class Gate:
    """A fault hook that holds the persist at `point` until released (thread mode: runs in-process)."""

    def __init__(self, point: str) -> None:
        self.point = point
        self.reached = threading.Event()
        self.release = threading.Event()

    def __call__(self, point: str) -> None:
        if point == self.point and not self.release.is_set():
            self.reached.set()
            assert self.release.wait(60), "the test never released the gate"


def test_save_records_blocking_persist_and_a_truthful_commit(tmp_path):
    rec = ProbeRecorder(tmp_path)
    state = _model_state()
    with CheckpointManager(_config(tmp_path), state, recorder=rec) as manager:
        _train(state)
        assert manager.save(1)
        assert manager.wait()
        assert manager.last_committed_step == 1
    assert rec.commit_checks == [(1, True)]
    events = [(e.kind, e.phase, e.step) for e in rec.events()]
    blocking_end = events.index((EventKind.PHASE_END, Phase.CHECKPOINT_BLOCKING, 1))
    persist = events.index((EventKind.PHASE_END, Phase.CHECKPOINT_PERSIST, 1))
    commit = events.index((EventKind.CHECKPOINT_COMMIT, None, 1))
    assert (
        events.index((EventKind.PHASE_BEGIN, Phase.CHECKPOINT_BLOCKING, 1)) < blocking_end < persist < commit
    )
    persist_event = rec.events()[persist]
    blocking_event = rec.events()[blocking_end]
    assert persist_event.value >= blocking_event.ts  # the persist span starts where the blocking part ended


def test_a_save_waits_for_the_previous_one_and_records_the_wait(tmp_path):
    gate = Gate("data_written")
    rec = ProbeRecorder(tmp_path)
    state = _model_state()
    with CheckpointManager(_config(tmp_path, fault_hook=gate), state, recorder=rec) as manager:
        manager.save(1)
        assert gate.reached.wait(30)
        releaser = threading.Thread(target=lambda: (rec.wait_started.wait(30), gate.release.set()))
        releaser.start()
        _train(state)
        assert manager.save(2, wait=True)  # blocks in CHECKPOINT_WAIT until step 1's persist finishes
        releaser.join()
    kinds = [(e.kind, e.phase, e.step) for e in rec.events()]
    wait_end = kinds.index((EventKind.PHASE_END, Phase.CHECKPOINT_WAIT, 2))
    assert kinds.index((EventKind.CHECKPOINT_COMMIT, None, 1)) < wait_end
    assert wait_end < kinds.index((EventKind.PHASE_BEGIN, Phase.CHECKPOINT_BLOCKING, 2))
    assert rec.commit_checks == [(1, True), (2, True)]


def test_the_staged_copy_is_what_gets_saved(tmp_path):
    """Parameters changed while the persist is still running do not leak into the checkpoint."""
    gate = Gate("data_written")
    state = _model_state()
    with CheckpointManager(
        _config(tmp_path, fault_hook=Gate("metadata_written")), state, recorder=Recorder(None)
    ):
        pass
    with CheckpointManager(_config(tmp_path, fault_hook=gate), state, recorder=Recorder(None)) as manager:
        _train(state)
        saved = _params(state)
        manager.save(1)
        _train(state, 3)  # mutate while step 1 is being persisted
        gate.release.set()
        assert manager.wait()
    fresh = _model_state()
    with CheckpointManager(_config(tmp_path), fresh, recorder=Recorder(None)) as manager:
        assert manager.restore() == 1
    assert all(torch.equal(a, b) for a, b in zip(saved, _params(fresh), strict=True))


class FailAt:
    def __init__(self, point: str, error: Exception) -> None:
        self.point, self.error, self.armed = point, error, True

    def __call__(self, point: str) -> None:
        if point == self.point and self.armed:
            self.armed = False
            raise self.error


def test_a_failed_persist_is_recorded_and_training_continues(tmp_path, caplog):
    rec = ProbeRecorder(tmp_path)
    state = _model_state()
    hook = FailAt("manifest_begin", OSError(errno.EIO, "injected I/O error"))
    with CheckpointManager(_config(tmp_path), state, recorder=rec) as manager:
        _train(state)
        assert manager.save(1, wait=True)
        manager.config.__dict__["fault_hook"] = hook  # frozen config: arm the fault for the next save only
        _train(state)
        with caplog.at_level(logging.WARNING, logger="ettr"):
            assert manager.save(2)  # the save starts; its persist fails in the background
            assert not manager.wait()
        assert "checkpoint of step 2 failed" in caplog.text
        assert manager.last_committed_step == 1
        assert [c.step for c in list_checkpoints(manager.storage)] == [1]  # the failed one was cleared away
        _train(state)
        assert manager.save(3, wait=True)  # and the next save works
    errors = [e for e in rec.events() if e.kind is EventKind.CHECKPOINT_ERROR]
    assert [e.step for e in errors] == [2] and "injected I/O error" in errors[0].data["error"]
    assert rec.commit_checks == [(1, True), (3, True)]


def test_a_persist_that_fails_after_its_commit_is_booked_as_the_commit_it_is(tmp_path, caplog):
    # DCP's save ends with a collective after rank 0's finish (the commit): a peer killed then fails the save
    # on rank 0 although the manifest is durable, and the next restore resumes from that step. The books must
    # hold its commit (the resume point of the attempt), not an error that says training went on without it.
    rec = ProbeRecorder(tmp_path)
    state = _model_state()
    hook = FailAt("manifest_renamed", RuntimeError("Connection reset by peer"))
    with CheckpointManager(_config(tmp_path, fault_hook=hook), state, recorder=rec) as manager:
        _train(state)
        with caplog.at_level(logging.WARNING, logger="ettr"):
            assert manager.save(1, wait=True)
        assert "checkpoint of step 1 committed; the save failed after its commit" in caplog.text
        assert "training continues from the previous one" not in caplog.text
        assert manager.last_committed_step == 1
        assert [c.step for c in list_checkpoints(manager.storage)] == [1]  # kept, not cleared away
    kinds = [(e.kind, e.step) for e in rec.events() if e.kind.name.startswith("CHECKPOINT_")]
    assert (EventKind.CHECKPOINT_COMMIT, 1) in kinds and (EventKind.CHECKPOINT_ERROR, 1) not in kinds
    assert rec.commit_checks == [(1, True)]
    with CheckpointManager(_config(tmp_path), _model_state(), recorder=ProbeRecorder(tmp_path)) as again:
        assert again.restore() == 1


def test_a_failed_save_on_a_full_disk_that_names_no_errno_says_the_free_space(tmp_path, monkeypatch):
    # A write cut short by a full disk can reach DCP as torch's zip writer error, no OSError under it
    # (seen on a real tmpfs: "unexpected pos 704 vs 598"); the books must point at the disk.
    from ettr.checkpoint import space

    rec = ProbeRecorder(tmp_path)
    state = _model_state()
    hook = FailAt(
        "data_written", RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    )
    with CheckpointManager(_config(tmp_path), state, recorder=rec) as manager:
        _train(state)
        assert manager.save(1, wait=True)
        manager.config.__dict__["fault_hook"] = hook
        monkeypatch.setattr(space, "local_free_bytes", lambda storage: 100)
        _train(state)
        assert not manager.save(2, wait=True)
        monkeypatch.setattr(space, "local_free_bytes", lambda storage: 1 << 40)  # a plenty disk: no guess
        hook.armed = True
        _train(state)
        assert not manager.save(3, wait=True)
    errors = {e.step: e.data["error"] for e in rec.events() if e.kind is EventKind.CHECKPOINT_ERROR}
    assert (
        "unexpected pos" in errors[2] and "has 100 bytes free" in errors[2] and "out of space?" in errors[2]
    )
    assert "unexpected pos" in errors[3] and "free" not in errors[3]


def _register_full_memory_filesystem() -> tuple[str, dict[str, float]]:
    """An fsspec memory filesystem that fails writes with ENOSPC beyond `disk["capacity"]` bytes in total."""
    import fsspec
    from fsspec.implementations.memory import MemoryFile, MemoryFileSystem

    state = {"used": 0, "capacity": float("inf")}

    class FullFile(MemoryFile):
        def write(self, data):
            if state["used"] + len(data) > state["capacity"]:
                raise OSError(errno.ENOSPC, "No space left on device (simulated)")
            state["used"] += len(data)
            return super().write(data)

    class FullMemoryFileSystem(MemoryFileSystem):
        protocol = "ettrfull"

        def _open(self, path, mode="rb", **kwargs):
            if mode == "wb":
                file = FullFile(self, self._strip_protocol(path))
                file.commit()  # visible at once, as MemoryFileSystem does it
                return file
            return super()._open(path, mode, **kwargs)

    fsspec.register_implementation("ettrfull", FullMemoryFileSystem, clobber=True)
    return f"ettrfull://full-{uuid.uuid4().hex}", state


def test_a_full_disk_during_persist_keeps_the_previous_checkpoint(tmp_path):
    state = _model_state()
    root, disk = _register_full_memory_filesystem()
    rec = ProbeRecorder(root)
    with CheckpointManager(_config(root), state, recorder=rec) as manager:
        _train(state)
        assert manager.save(1, wait=True)
        saved = _params(state)
        disk["capacity"] = disk["used"] * 1.5  # the disk fills up: room for half a checkpoint more
        _train(state)
        assert manager.save(2)
        assert not manager.wait()
        _train(state)  # training goes on
    assert [e.step for e in rec.events() if e.kind is EventKind.CHECKPOINT_ERROR] == [2]
    assert (
        "No space left" in next(e for e in rec.events() if e.kind is EventKind.CHECKPOINT_ERROR).data["error"]
    )
    assert find_latest(open_storage(root)).latest.step == 1
    fresh = _model_state()
    with CheckpointManager(_config(root), fresh, recorder=Recorder(None)) as manager:
        assert manager.restore() == 1
    assert all(torch.equal(a, b) for a, b in zip(saved, _params(fresh), strict=True))


@contextlib.contextmanager
def _tiny_tmpfs(path: Path, size: str):
    path.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            check=True,
            capture_output=True,
        )
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {exc}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


@pytest.mark.slow
def test_a_real_full_disk_during_persist(tmp_path):
    """ENOSPC from a real (tiny tmpfs) filesystem: error recorded, training on, previous checkpoint intact."""
    with _tiny_tmpfs(tmp_path / "disk", "4m") as disk:
        state = _model_state()
        rec = ProbeRecorder(disk / "ckpt")
        with CheckpointManager(_config(disk / "ckpt"), state, recorder=rec) as manager:
            _train(state)
            assert manager.save(1, wait=True)
            saved = _params(state)
            ballast = disk / "ballast"
            with open(
                ballast, "wb", buffering=0
            ) as stream:  # fill the disk (unbuffered: close flushes nothing)
                with contextlib.suppress(OSError):
                    while True:
                        stream.write(b"\0" * 65536)
                        stream.flush()
            _train(state)
            assert manager.save(2)
            assert not manager.wait()
            _train(state)
        errors = [e for e in rec.events() if e.kind is EventKind.CHECKPOINT_ERROR]
        assert [e.step for e in errors] == [2] and "No space left" in errors[0].data["error"]
        assert find_latest(open_storage(disk / "ckpt")).latest.step == 1
        fresh = _model_state()
        with CheckpointManager(_config(disk / "ckpt"), fresh, recorder=Recorder(None)) as manager:
            assert manager.restore() == 1
        assert all(torch.equal(a, b) for a, b in zip(saved, _params(fresh), strict=True))


def test_save_and_restore_through_an_fsspec_url():
    root = f"memory://ettr-{uuid.uuid4().hex}/job"
    state = _model_state()
    with CheckpointManager(_config(root), state, recorder=Recorder(None)) as manager:
        _train(state)
        assert manager.save(1, wait=True)
    saved = _params(state)
    fresh = _model_state()
    with CheckpointManager(_config(root), fresh, recorder=Recorder(None)) as manager:
        assert manager.restore() == 1
    assert all(torch.equal(a, b) for a, b in zip(saved, _params(fresh), strict=True))


def _flip_a_data_byte(root: Path, step: int) -> None:
    shard = root / step_dir_name(step) / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))


def test_restore_skips_corrupt_and_incomplete_newer_checkpoints(tmp_path, caplog):
    state = _model_state()
    snapshots = {}
    with CheckpointManager(_config(tmp_path, keep_last=5), state, recorder=Recorder(None)) as manager:
        for step in (1, 2, 3):
            _train(state)
            manager.save(step, wait=True)
            snapshots[step] = _params(state)
    _flip_a_data_byte(tmp_path, 3)  # bit rot in the newest
    (tmp_path / step_dir_name(4)).mkdir()  # a crash mid-persist of step 4
    (tmp_path / step_dir_name(4) / "__0_0.distcp").write_bytes(b"partial")
    rec = ProbeRecorder(tmp_path)
    fresh = _model_state()
    with caplog.at_level(logging.WARNING, logger="ettr"):
        # storage's checks (a valid memory copy of step 3 would be restored instead: test_checkpoint_memory)
        with CheckpointManager(_config(tmp_path, memory_copy=False), fresh, recorder=rec) as manager:
            assert manager.restore() == 2
    assert step_dir_name(3) in caplog.text and "CRC-32" in caplog.text
    assert step_dir_name(4) in caplog.text and "no manifest" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(snapshots[2], _params(fresh), strict=True))
    # the incomplete one is gone, the corrupt one moved aside for inspection (its step can be saved again)
    names = sorted(os.listdir(tmp_path))
    assert step_dir_name(4) not in names and step_dir_name(3) not in names
    assert any(n.startswith(step_dir_name(3) + ".bad-") for n in names)
    resumed = [e.step for e in rec.events() if e.kind is EventKind.RESUMED]
    assert resumed == [2]
    skipped = [e.data["checkpoint"] for e in rec.events() if e.kind is EventKind.MARK]
    assert skipped == [step_dir_name(4), step_dir_name(3)]  # recorded, for the report's post-mortem
    assert [e.step for e in rec.events() if e.kind is EventKind.PHASE_END and e.phase is Phase.RESTORE] == [2]


def test_restore_of_nothing_records_a_fresh_start(tmp_path):
    rec = ProbeRecorder(tmp_path)
    with CheckpointManager(_config(tmp_path), _model_state(), recorder=rec) as manager:
        assert manager.restore() is None
    assert [(e.kind, e.step) for e in rec.events()] == [(EventKind.RESUMED, None)]


def test_restore_an_explicit_step(tmp_path):
    state = _model_state()
    with CheckpointManager(_config(tmp_path, keep_last=3), state, recorder=Recorder(None)) as manager:
        for step in (1, 2, 3):
            _train(state)
            manager.save(step, wait=True)
            if step == 2:
                at_two = _params(state)
    fresh = _model_state()
    with CheckpointManager(_config(tmp_path), fresh, recorder=Recorder(None)) as manager:
        assert manager.restore(step=2) == 2
        assert all(torch.equal(a, b) for a, b in zip(at_two, _params(fresh), strict=True))
        with pytest.raises(CheckpointError, match="step 7"):
            manager.restore(step=7)


def test_a_step_already_saved_is_not_saved_again(tmp_path):
    rec = ProbeRecorder(tmp_path)
    state = _model_state()
    with CheckpointManager(_config(tmp_path), state, recorder=rec) as manager:
        _train(state)
        manager.save(1)
        manager.save(1, wait=True)  # e.g. the final save right after a periodic one
    with CheckpointManager(_config(tmp_path), _model_state(), recorder=rec) as manager:
        assert manager.restore() == 1
        assert manager.save(1, wait=True)  # a save right after restoring that step
    assert [e.step for e in rec.events() if e.kind is EventKind.CHECKPOINT_COMMIT] == [1]


def test_the_final_save_marks_the_end_of_training_unless_a_failure_is_on_its_way_out(tmp_path):
    from ettr.constants import TRAINING_ENDED_MARK

    rec = ProbeRecorder(tmp_path)
    state = _model_state()
    with CheckpointManager(_config(tmp_path), state, recorder=rec) as manager:
        _train(state)
        manager.finish(1)
        with contextlib.suppress(ValueError):
            try:
                raise ValueError("the loop failed")
            finally:
                manager.finish(1)  # a `finally:` around a failed loop: no end of training
    ended = [
        e.step for e in rec.events() if e.kind is EventKind.MARK and e.data["name"] == TRAINING_ENDED_MARK
    ]
    assert ended == [1]


def test_retention_through_the_manager(tmp_path):
    state = _model_state()
    with CheckpointManager(_config(tmp_path, keep_last=2), state, recorder=Recorder(None)) as manager:
        for step in range(1, 6):
            _train(state)
            manager.after_step(step)
        manager.wait()
    assert sorted(os.listdir(tmp_path)) == [step_dir_name(4), step_dir_name(5)]


@pytest.mark.parametrize("with_manifest", [True, False])
def test_a_directory_left_by_an_earlier_run_is_replaced(tmp_path, caplog, with_manifest):
    stale = tmp_path / step_dir_name(1)
    stale.mkdir(parents=True)
    (stale / "__0_0.distcp").write_bytes(b"old junk")
    if with_manifest:
        (stale / MANIFEST_NAME).write_text("{}")
    state = _model_state()
    with caplog.at_level(logging.WARNING, logger="ettr"):
        with CheckpointManager(_config(tmp_path), state, recorder=Recorder(None)) as manager:
            _train(state)
            assert manager.save(1, wait=True)
    assert verify(open_storage(tmp_path), step_dir_name(1)).step == 1
    aside = [p for p in tmp_path.iterdir() if p.name.startswith(f"{step_dir_name(1)}.replaced-")]
    if with_manifest:  # committed (or meant to be): someone's data, moved aside whole, never deleted
        assert "moved checkpoint step_000000001, left by an earlier run, aside" in caplog.text
        assert len(aside) == 1 and (aside[0] / "__0_0.distcp").read_bytes() == b"old junk"
    else:  # a save that never committed: nothing to keep
        assert "replacing incomplete checkpoint directory step_000000001" in caplog.text and not aside


def test_preemption_saves_at_the_step_boundary_and_exits_143(tmp_path):
    rec = ProbeRecorder(tmp_path)
    state = _model_state()
    config = _config(tmp_path, interval=IntervalConfig(every_steps=100), handle_preemption=True)
    manager = CheckpointManager.create(config, state, recorder=rec)
    try:
        for step in range(1, 4):
            _train(state)
            assert not manager.after_step(step)
        manager.request_preemption()  # what the SIGTERM handler does
        _train(state)
        with pytest.raises(SystemExit) as exited:
            manager.after_step(4)
        assert exited.value.code == PREEMPTED_EXIT_STATUS
    finally:
        manager.close()
    assert find_latest(open_storage(tmp_path)).latest.step == 4
    marks = [e.data for e in rec.events() if e.kind is EventKind.MARK]
    assert marks == [{"name": "preempted", "step": 4, "saved": True}]
    assert rec.commit_checks == [(4, True)]


def test_a_real_sigterm_preempts_at_the_next_boundary_and_the_handler_is_restored(tmp_path):
    previous = signal.getsignal(signal.SIGTERM)
    state = _model_state()
    config = _config(tmp_path, interval=IntervalConfig(every_steps=100), handle_preemption=True)
    manager = CheckpointManager.create(config, state, recorder=Recorder(None))
    try:
        _train(state)
        assert not manager.after_step(1)
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs on this (the main) thread before kill returns
        _train(state)
        with pytest.raises(SystemExit) as exited:
            manager.after_step(2)
        assert exited.value.code == PREEMPTED_EXIT_STATUS
    finally:
        manager.close()
    assert signal.getsignal(signal.SIGTERM) is previous
    assert find_latest(open_storage(tmp_path)).latest.step == 2


def test_request_preemption_needs_the_handler(tmp_path):
    with CheckpointManager(_config(tmp_path), _model_state(), recorder=Recorder(None)) as manager:
        with pytest.raises(CheckpointError, match="handle_preemption"):
            manager.request_preemption()


def test_auto_interval_reads_the_job_failures_from_the_ledger(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ledger = open_ledger(run_dir)
    now = time.time()
    ledger.append(
        [Event(EventKind.SUPERVISOR_START, ts=now - 3600, rank=SUPERVISOR_RANK)]
        + [
            Event(
                EventKind.ATTEMPT_END,
                ts=now - 600 * i,
                rank=SUPERVISOR_RANK,
                data={"outcome": str(Outcome.FAILED)},
            )
            for i in range(1, 5)
        ]
    )
    ledger.close()
    config = _config(
        tmp_path / "ckpt", interval=IntervalConfig(auto=True, failures_per_day=1.0, prior_days=1.0)
    )
    rec = Recorder(open_ledger(run_dir), run_dir=run_dir)
    try:
        history = read_failure_history(run_dir)  # the caller's ledger read, handed to the manager
        with CheckpointManager(
            config, _model_state(), recorder=rec, failure_history=history, clock=lambda: 100.0
        ) as manager:
            rate = manager.policy.failures_per_day(100.0)
    finally:
        rec.close()
    # four failures over about an hour on top of a prior of one a day worth one day
    assert 4.5 < rate < 5.0


def test_auto_interval_without_a_ledger_uses_the_prior(tmp_path):
    config = _config(tmp_path, interval=IntervalConfig(auto=True, failures_per_day=3.0))
    with CheckpointManager(config, _model_state(), recorder=Recorder(None)) as manager:
        assert manager.policy.failures_per_day(0.0) == 3.0


def test_config_validation(tmp_path):
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointConfig(root=tmp_path, keep_last=0)
    with pytest.raises(ValueError, match="mode"):
        CheckpointConfig(root=tmp_path, mode="fork")
    with pytest.raises(ValueError, match="root"):
        CheckpointConfig(root="")


def test_closed_manager_refuses_to_save(tmp_path):
    manager = CheckpointManager(_config(tmp_path), _model_state(), recorder=Recorder(None))
    manager.close()
    manager.close()  # idempotent
    with pytest.raises(CheckpointError):
        manager.save(1)


_PROCESS_MODE_SCRIPT = """
import os, sys, warnings, torch
warnings.filterwarnings("ignore")
from ettr.checkpoint import CheckpointConfig, CheckpointManager, IntervalConfig, TrainState
from ettr.recorder import Recorder


class WherePersisted:
    # a picklable fault hook that notes which process writes the manifest
    def __init__(self, path):
        self.path = path

    def __call__(self, point):
        if point == "manifest_begin":
            with open(self.path, "a") as stream:
                stream.write(f"{os.getpid()}\\n")


if __name__ == "__main__":
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    config = CheckpointConfig(
        root=sys.argv[1], interval=IntervalConfig(every_steps=1), mode="process", fault_hook=WherePersisted(sys.argv[3])
    )
    with CheckpointManager.create(config, TrainState(model=model, optimizer=opt), recorder=Recorder(None)) as m:
        assert m.save(1, wait=True)
        model.weight.data.add_(1.0)
        opt.step()
        assert m.save(2, wait=True)
    torch.save(model.state_dict(), sys.argv[2])
    print(os.getpid())
"""


@pytest.mark.slow
def test_process_mode_persists_in_dcp_checkpoint_process(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(_PROCESS_MODE_SCRIPT)
    pids = tmp_path / "pids.txt"
    done = subprocess.run(
        [os.sys.executable, str(script), str(tmp_path / "ckpt"), str(tmp_path / "final.pt"), str(pids)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    trainer_pid = int(done.stdout.split()[-1])
    persist_pids = {int(line) for line in pids.read_text().split()}
    assert (
        len(persist_pids) == 1 and trainer_pid not in persist_pids
    )  # one checkpoint process, not the trainer
    final = torch.load(tmp_path / "final.pt")
    model = torch.nn.Linear(64, 64)
    with CheckpointManager(_config(tmp_path / "ckpt"), TrainState(model=model), recorder=Recorder(None)) as m:
        assert m.restore() == 2
    assert torch.equal(model.weight, final["weight"])


class HeldStaging:
    """Holds the background copy of every save until the training loop is seen waiting for it."""

    def __init__(self, monkeypatch, rec: ProbeRecorder) -> None:
        from ettr.checkpoint.staging import ReusedStager

        self.release = threading.Event()
        self.copied = threading.Event()
        original = ReusedStager._stage_later

        def held(stager, *args):
            assert self.release.wait(60), "nobody waited for the copy"
            result = original(stager, *args)
            self.copied.set()
            return result

        monkeypatch.setattr(ReusedStager, "_stage_later", held)
        # release the copy once the loop records that it waits for it (the hook's CHECKPOINT_BLOCKING)
        self.releaser = threading.Thread(target=lambda: (rec.overlap_wait.wait(60), self.release.set()))
        self.releaser.start()


class OverlapProbe(ProbeRecorder):
    def __init__(self, root) -> None:
        super().__init__(root)
        self.overlap_wait = threading.Event()

    def phase(self, phase, *, step=None, **data):
        if phase == Phase.CHECKPOINT_BLOCKING and data.get("overlapped"):
            self.overlap_wait.set()
        return super().phase(phase, step=step, **data)


def test_an_overlapped_copy_is_waited_for_before_the_next_optimizer_step(tmp_path, monkeypatch):
    rec = OverlapProbe(tmp_path)
    held = HeldStaging(monkeypatch, rec)
    state = _model_state()
    with CheckpointManager(_config(tmp_path), state, recorder=rec) as manager:
        _train(state)
        saved = _params(state)
        assert manager.save(1)  # returns while the copy is still held
        assert not held.copied.is_set()
        loss = state.model(torch.randn(8, 32)).pow(2).mean()  # forward and backward overlap the copy
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()  # the pre-hook waits for the copy before the step changes the parameters
        assert held.copied.is_set()
        assert manager.wait()
    held.releaser.join()
    fresh = _model_state()
    with CheckpointManager(_config(tmp_path), fresh, recorder=Recorder(None)) as manager:
        assert manager.restore() == 1
    assert all(torch.equal(a, b) for a, b in zip(saved, _params(fresh), strict=True))
    waits = [
        e for e in rec.events() if e.phase is Phase.CHECKPOINT_BLOCKING and (e.data or {}).get("overlapped")
    ]
    assert [(e.kind, e.step) for e in waits] == [(EventKind.PHASE_BEGIN, 1), (EventKind.PHASE_END, 1)]


def test_a_model_with_running_statistics_waits_before_its_next_forward(tmp_path, monkeypatch):
    rec = OverlapProbe(tmp_path)
    held = HeldStaging(monkeypatch, rec)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with CheckpointManager(_config(tmp_path), state, recorder=rec) as manager:
        model(torch.randn(8, 4))
        running_mean = model[1].running_mean.clone()
        manager.save(1)
        model(torch.randn(8, 4) + 5.0)  # updates the running statistics: the forward pre-hook waits first
        assert not torch.equal(model[1].running_mean, running_mean)
        assert manager.wait()
    held.releaser.join()
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    with CheckpointManager(_config(tmp_path), TrainState(model=fresh), recorder=Recorder(None)) as manager:
        assert manager.restore() == 1
    assert torch.equal(fresh[1].running_mean, running_mean)


def test_a_trainable_parameter_another_optimizer_steps_makes_saves_copy_everything(tmp_path):
    """A GAN's generator and discriminator in one model, the `TrainState` holding the generator's optimizer:
    the discriminator's step is no hook's, so an overlapped copy could take its next step's values."""
    from ettr.checkpoint.persist import unguarded_changes

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"g": torch.nn.Linear(4, 4), "d": torch.nn.Linear(4, 1)})
    state = TrainState(model=model, optimizer=torch.optim.SGD(model["g"].parameters(), lr=0.1))
    assert "d.weight" in (unguarded_changes(state) or "")
    model["d"].requires_grad_(False)  # frozen, not stepped: nothing unguarded
    assert unguarded_changes(state) is None
    model["d"].requires_grad_(True)
    d_optimizer = torch.optim.SGD(model["d"].parameters(), lr=0.1)
    with CheckpointManager(_config(tmp_path), state, recorder=Recorder(None)) as manager:
        assert not manager.overlapping
        saved = model["d"].weight.detach().clone()
        manager.save(1)
        model["d"](torch.randn(2, 4)).sum().backward()
        d_optimizer.step()  # the discriminator's step, right after the save
        assert manager.wait()
    fresh = torch.nn.ModuleDict({"g": torch.nn.Linear(4, 4), "d": torch.nn.Linear(4, 1)})
    fresh_state = TrainState(model=fresh, optimizer=torch.optim.SGD(fresh["g"].parameters(), lr=0.1))
    with CheckpointManager(_config(tmp_path), fresh_state, recorder=Recorder(None)) as manager:
        assert manager.restore() == 1
    assert torch.equal(fresh["d"].weight, saved)


@pytest.mark.parametrize("api", ["parametrizations", "hook"])
def test_spectral_norm_power_iteration_waits_before_the_next_forward_too(tmp_path, api):
    from torch.nn.utils import parametrizations, spectral_norm

    from ettr.checkpoint.persist import _updates_buffers_in_forward

    assert not _updates_buffers_in_forward(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()))
    normed = (parametrizations.spectral_norm if api == "parametrizations" else spectral_norm)(
        torch.nn.Linear(4, 4)
    )
    model = torch.nn.Sequential(normed, torch.nn.GELU())
    assert _updates_buffers_in_forward(model)
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with CheckpointManager(_config(tmp_path), state, recorder=Recorder(None)) as manager:
        assert manager.overlapping and len(manager._hooks) == 2  # the optimizer's step and the forward


@pytest.mark.parametrize("overlap", [False, True])
def test_in_place_changes_after_the_copy_do_not_reach_the_checkpoint(tmp_path, overlap):
    """Without overlap a save returns with the copy complete; with it, `wait_staged()` gives the same."""
    state = _model_state()
    config = _config(tmp_path, overlap_staging=overlap)
    with CheckpointManager(config, state, recorder=Recorder(None)) as manager:
        _train(state)
        saved = _params(state)
        manager.save(1)
        if overlap:
            manager.wait_staged()
        with torch.no_grad():
            for p in state.model.parameters():
                p.add_(100.0)  # outside any optimizer step: no hook protects this
        assert manager.wait()
    fresh = _model_state()
    with CheckpointManager(_config(tmp_path), fresh, recorder=Recorder(None)) as manager:
        assert manager.restore() == 1
    assert all(torch.equal(a, b) for a, b in zip(saved, _params(fresh), strict=True))


@pytest.mark.parametrize("in_backward", ["applied", "hook"])
def test_an_optimizer_in_backward_makes_saves_copy_everything_before_they_return(tmp_path, in_backward):
    """The overlapped copy is guarded at the optimizer's step; an optimizer applied in backward changes the
    tensors before it (torch's `_apply_optimizer_in_backward`, the tutorials' post-accumulate-grad hook;
    TorchRec's fused optimizers: tests/test_checkpoint_torchrec.py), so such a save does not overlap."""
    from ettr.checkpoint.persist import unguarded_changes

    state = _model_state()
    assert unguarded_changes(state) is None
    with CheckpointManager(_config(tmp_path / "plain"), state, recorder=Recorder(None)) as manager:
        assert manager.overlapping
    if in_backward == "applied":
        from torch.distributed.optim import _apply_optimizer_in_backward

        _apply_optimizer_in_backward(torch.optim.SGD, state.model.parameters(), {"lr": 0.1})
    else:
        for p in state.model.parameters():
            p.register_post_accumulate_grad_hook(lambda param: None)
    why = unguarded_changes(state)
    assert why is not None and ("backward" in why or "gradient" in why)
    with CheckpointManager(_config(tmp_path), state, recorder=Recorder(None)) as manager:
        assert not manager.overlapping
        saved = _params(state)
        manager.save(1)
        with torch.no_grad():
            for p in state.model.parameters():
                p.add_(100.0)  # as an optimizer in the next backward would, before any optimizer step
        assert manager.wait()
    fresh = _model_state()
    with CheckpointManager(_config(tmp_path), fresh, recorder=Recorder(None)) as manager:
        assert manager.restore() == 1
    assert all(torch.equal(a, b) for a, b in zip(saved, _params(fresh), strict=True))


def test_without_an_optimizer_to_guard_a_save_does_not_overlap(tmp_path):
    model = torch.nn.Linear(8, 8)
    with CheckpointManager(_config(tmp_path), TrainState(model=model), recorder=Recorder(None)) as manager:
        assert not manager.overlapping
        saved = model.weight.detach().clone()
        manager.save(1)
        with torch.no_grad():
            model.weight.add_(1.0)  # e.g. an optimizer the manager does not know stepped it
        assert manager.wait()
    fresh = torch.nn.Linear(8, 8)
    with CheckpointManager(_config(tmp_path), TrainState(model=fresh), recorder=Recorder(None)) as manager:
        assert manager.restore() == 1
    assert torch.equal(fresh.weight, saved)


# -- one writing job per root ----------------------------------------------------------------------------------
_HOLD = (
    "import sys; from ettr.checkpoint import root_lock; "
    "held = root_lock.acquire(sys.argv[1], job_id=sys.argv[2]); print(type(held).__name__, flush=True); "
    "sys.stdin.read()"
)


def _holder(root: Path, job_id: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(root), job_id],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "Held"
    return proc


def _let_go(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait()


def test_a_root_another_running_job_writes_is_refused_with_one_line(tmp_path: Path) -> None:
    # Two jobs pointed at one root by mistake: the second resumed the first one's newest step (from its
    # memory copy), moved its next commit aside as "left by an earlier run", and both went on silently.
    other = _holder(tmp_path, "job-a")
    try:
        config = _config(tmp_path, job_id="job-b")
        with pytest.raises(
            CheckpointError, match=r"in use by job job-a \(pid \d+ on .*give this job its own root"
        ):
            CheckpointManager(config, _model_state(), recorder=Recorder(None))
        assert not [n for n in os.listdir(tmp_path) if n.startswith("step_")]  # nothing touched
    finally:
        _let_go(other)
    with CheckpointManager(_config(tmp_path, job_id="job-b"), _model_state(), recorder=Recorder(None)) as m:
        assert m.save(1, wait=True)  # the other job is gone: the root is this job's now
    assert sorted(os.listdir(tmp_path)) == [step_dir_name(1)]  # the lock file goes with the job


def test_the_same_job_and_the_same_process_are_not_refused(tmp_path: Path) -> None:
    other = _holder(tmp_path, "job-a")  # e.g. a forked data loader worker of this job's killed rank 0
    try:
        with CheckpointManager(_config(tmp_path, job_id="job-a"), _model_state(), recorder=Recorder(None)):
            pass
    finally:
        _let_go(other)
    first = CheckpointManager(_config(tmp_path, job_id="j"), _model_state(), recorder=Recorder(None))
    second = CheckpointManager(_config(tmp_path, job_id="k"), _model_state(), recorder=Recorder(None))
    second.close()  # an in-place restart's new manager in the process that held the root: shared
    assert LOCK_NAME in os.listdir(tmp_path)
    first.close()
    assert LOCK_NAME not in os.listdir(tmp_path)


def test_a_root_where_no_lock_can_be_made_is_used_without_one(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")  # the root cannot be made: a restore-only job must not fail on it
    assert root_lock.acquire(str(tmp_path / "file" / "below"), job_id="j") is None


_LOST_PROCESS_SCRIPT = """
import sys

import torch

from ettr.checkpoint import CheckpointConfig, CheckpointManager, IntervalConfig, TrainState
from ettr.checkpoint.persist import _dcp_executor
from ettr.recorder import Recorder

if __name__ == "__main__":
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = CheckpointConfig(root=sys.argv[1], interval=IntervalConfig(every_steps=100), mode="process")
    with CheckpointManager.create(config, TrainState(model=model, optimizer=opt), recorder=Recorder(None)) as m:
        assert m.save(1, wait=True)
        process = _dcp_executor()._CHECKPOINT_PROCESS._save_process
        process.kill()  # the OOM killer, or a SIGKILL
        process.join()
        saved = [m.save(step, wait=True) for step in (2, 3)]
        print("saved", saved, "pid changed", _dcp_executor()._CHECKPOINT_PROCESS._save_process.pid != process.pid)
"""


@pytest.mark.slow
def test_a_lost_checkpoint_process_is_replaced_at_the_next_save(tmp_path):
    # Process mode: DCP keeps a dead checkpoint process, so one SIGKILL failed every later save of the
    # attempt (EPIPE) while training went on without checkpoints until the final save raised.
    script = tmp_path / "job.py"
    script.write_text(_LOST_PROCESS_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stderr
    assert "saved [True, True] pid changed True" in done.stdout
    assert "a checkpoint process is gone; the save of step 2 starts new ones" in done.stderr


def test_a_forged_lock_holder_is_another_job_not_a_recursion_error(tmp_path: Path) -> None:
    # Whoever writes the root writes the lock file: 5,000 brackets raised RecursionError out of the
    # manager's constructor (json.loads) instead of the one-line refusal.
    other = _holder(tmp_path, "job-a")
    try:
        (tmp_path / LOCK_NAME).write_text("[" * 5000)
        with pytest.raises(CheckpointError, match=r"in use by another job: two jobs writing one root"):
            CheckpointManager(_config(tmp_path, job_id="job-b"), _model_state(), recorder=Recorder(None))
    finally:
        _let_go(other)
