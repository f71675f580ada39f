"""The checkpoint manager's parts, each on its own: the resume choice over a dict storage (no process
group), the coordinator of a lone process, the explicit construction steps, the failure history, the
storage's own DCP writer, and the CUDA staging path (on a GPU only)."""

from __future__ import annotations

import signal
import time

import pytest
import torch

from ettr.checkpoint import (
    CheckpointConfig,
    CheckpointError,
    CheckpointManager,
    Coordinator,
    FailureHistory,
    IntervalConfig,
    PreemptionWatcher,
    TrainState,
    choose_checkpoint,
    list_checkpoints,
    step_dir_name,
    verify,
)
from ettr.checkpoint.commit import commit
from ettr.checkpoint.staging import ReusedStager
from ettr.checkpoint.storage import FsspecStorage, LocalStorage
from ettr.checkpoint.writer import CommittingWriter, make_writer
from ettr.events import SUPERVISOR_RANK, Event, EventKind, Outcome
from ettr.ledger import MemoryLedger
from ettr.recorder import Recorder
from ettr.testing.memory_storage import MemoryStorage

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state() -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


def _train(state: TrainState) -> None:
    loss = state.model(torch.randn(4, 8)).pow(2).mean()
    state.optimizer.zero_grad()
    loss.backward()
    state.optimizer.step()


def _config(**kwargs) -> CheckpointConfig:
    return CheckpointConfig(root="unused", interval=IntervalConfig(every_steps=2), **kwargs)


def _marks(rec: Recorder) -> list[dict]:
    rec.flush()
    return [e.data for e in rec._ledger.read() if e.kind is EventKind.MARK]


# -- the dict storage under the whole manager -----------------------------------------------------------
def test_the_manager_saves_and_restores_on_the_dict_storage():
    storage = MemoryStorage()
    state = _state()
    with CheckpointManager(_config(), state, recorder=Recorder(None), storage=storage) as manager:
        for step in range(1, 5):
            _train(state)
            manager.after_step(step)
        assert manager.wait() and manager.last_committed_step == 4
    assert [c.step for c in list_checkpoints(storage) if c.has_manifest] == [2, 4]
    assert verify(storage, step_dir_name(4)).step == 4
    fresh = _state()
    for p in fresh.model.parameters():
        p.data.zero_()
    with CheckpointManager(_config(), fresh, recorder=Recorder(None), storage=storage) as manager:
        assert manager.restore() == 4
    for a, b in zip(state.model.parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_dict_storage_refuses_the_process_mode():
    with pytest.raises(TypeError, match="one process"):
        import pickle

        pickle.dumps(MemoryStorage())


# -- the resume choice, pure over storage ---------------------------------------------------------------
def _checkpoint(storage: MemoryStorage, step: int, *, committed: bool = True) -> None:
    name = step_dir_name(step)
    storage.write_atomic(f"{name}/__0_0.distcp", bytes([step]) * 64)
    storage.write_atomic(f"{name}/.metadata", b"meta")
    if committed:
        commit(storage, step, ["__0_0.distcp", ".metadata"])


def test_the_choice_takes_the_newest_that_verifies_and_cleans_the_rest():
    storage = MemoryStorage()
    for step in (1, 2):
        _checkpoint(storage, step)
    storage.files[f"{step_dir_name(2)}/__0_0.distcp"] = b"\x00" * 64  # corrupt, same size
    _checkpoint(storage, 3, committed=False)  # a crash mid-persist
    rec = Recorder(MemoryLedger())
    choice = choose_checkpoint(storage, recorder=rec)
    assert choice.step == 1
    assert choice.existing_steps == (1,)  # 3 deleted; 2 moved aside (no longer a step directory)
    assert any(name.startswith(f"{step_dir_name(2)}.bad-") for name in storage.list_dir(""))
    skipped = {m["checkpoint"]: m["reason"] for m in _marks(rec)}
    assert set(skipped) == {step_dir_name(2), step_dir_name(3)}
    assert "CRC-32" in skipped[step_dir_name(2)] and "no manifest" in skipped[step_dir_name(3)]
    rec.close()


def test_an_exact_step_that_does_not_verify_is_no_choice():
    storage = MemoryStorage()
    _checkpoint(storage, 1)
    _checkpoint(storage, 2, committed=False)
    assert choose_checkpoint(storage, recorder=Recorder(None), step=2).step is None
    assert choose_checkpoint(storage, recorder=Recorder(None), step=1).step == 1


# -- coordination and construction ----------------------------------------------------------------------
def test_a_lone_coordinator_agrees_with_itself_and_owns_nothing():
    coordinator = Coordinator.single()
    assert not coordinator.distributed and (coordinator.rank, coordinator.world_size) == (0, 1)
    assert coordinator.agree(True, False) == (True, False)
    assert coordinator.broadcast_from_0([3, [1, 2]]) == [3, [1, 2]]
    coordinator.barrier()
    coordinator.close()
    coordinator.close()


def test_the_constructor_installs_no_signal_handler_and_says_what_is_missing():
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(CheckpointError, match=r"CheckpointManager\.create"):
        CheckpointManager(_config(handle_preemption=True), _state(), storage=MemoryStorage())
    with pytest.raises(CheckpointError, match="process persist mode needs a process group"):
        CheckpointManager(_config(mode="process"), _state(), storage=MemoryStorage())
    watcher = PreemptionWatcher()  # not installed: the caller decides
    config = _config(handle_preemption=True)
    with CheckpointManager(config, _state(), preemption=watcher, storage=MemoryStorage()) as manager:
        assert signal.getsignal(signal.SIGTERM) is previous
        manager.request_preemption()
        assert watcher.requested


def test_create_installs_the_handler_and_close_restores_it(tmp_path):
    previous = signal.getsignal(signal.SIGTERM)
    config = CheckpointConfig(root=tmp_path, handle_preemption=True)
    manager = CheckpointManager.create(config, _state(), recorder=Recorder(None))
    try:
        assert signal.getsignal(signal.SIGTERM) is not previous
    finally:
        manager.close()
    assert signal.getsignal(signal.SIGTERM) is previous


def test_the_failure_history_is_counted_from_events_alone():
    now = 10_000.0
    events = [Event(EventKind.SUPERVISOR_START, ts=now - 3600, rank=SUPERVISOR_RANK)]
    events += [
        Event(EventKind.ATTEMPT_END, ts=now - 60 * i, rank=SUPERVISOR_RANK, data={"outcome": str(outcome)})
        for i, outcome in enumerate((Outcome.FAILED, Outcome.PREEMPTED, Outcome.COMPLETED), start=1)
    ]
    history = FailureHistory.from_events(events, now_ts=now)
    assert history == FailureHistory(num_failures=2, job_age_s=3600.0)
    assert FailureHistory.from_events([], now_ts=now) == FailureHistory()
    with pytest.raises(ValueError, match="num_failures"):
        FailureHistory(num_failures=-1)
    config = CheckpointConfig(root="unused", interval=IntervalConfig(auto=True, failures_per_day=1.0))
    with CheckpointManager(
        config, _state(), recorder=Recorder(None), storage=MemoryStorage(), failure_history=history
    ) as manager:
        assert (
            manager.policy.failures_per_day(time.monotonic()) > 2.0
        )  # 2 failures in an hour, on a prior of 1


# -- the storage hands out its own DCP writer ------------------------------------------------------------
def test_each_storage_hands_out_its_dcp_writer_and_the_commit_wraps_it(tmp_path):
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    local = make_writer(LocalStorage(tmp_path), 3, world_size=1)
    assert isinstance(local, CommittingWriter) and isinstance(local.inner, FileSystemWriter)
    assert local.inner.sync_files  # a local file is fsync'd
    remote = make_writer(FsspecStorage("memory://ettr-parts"), 3, world_size=1)
    assert isinstance(remote.inner, FsspecWriter) and not remote.inner.sync_files  # durable at close


# -- the CUDA staging path -------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_state_is_staged_into_pinned_buffers_reused_across_saves():
    device = torch.device("cuda")
    model = torch.nn.Linear(256, 256).to(device)
    stager = ReusedStager(pin_memory=True, background_keys=("model",))
    try:
        first = stager.stage({"model": model.state_dict(), "step": 1})
        staged = first.result(timeout=60)
        weight = staged["model"]["weight"]
        assert weight.device.type == "cpu" and weight.is_pinned()
        assert torch.equal(weight, model.weight.detach().cpu())
        with torch.no_grad():
            model.weight.add_(1.0)  # after the copy completed: must not reach the staged copy...
        assert not torch.equal(weight, model.weight.detach().cpu())
        again = stager.stage({"model": model.state_dict(), "step": 2}).result(timeout=60)
        assert again["model"]["weight"].data_ptr() == weight.data_ptr()  # ...and the buffer is reused
        assert torch.equal(again["model"]["weight"], model.weight.detach().cpu())
    finally:
        stager.close()
