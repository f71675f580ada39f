"""The checkpoint manager on two real gloo ranks (spawned processes): DDP save and exact resume with
per-rank RNG and data positions, both persist modes, and preemption agreed across ranks."""

from __future__ import annotations

import random
import warnings
import zlib

import numpy as np
import pytest
import torch

from ettr.checkpoint import (
    PREEMPTED_EXIT_STATUS,
    CheckpointConfig,
    CheckpointManager,
    IntervalConfig,
    ResumableSampler,
    TrainState,
    find_latest,
    open_storage,
)
from ettr.recorder import Recorder
from ettr.testing.spawn import run_ranks, start_ranks

pytestmark = pytest.mark.slow

NUM_SAMPLES = 64
BATCH = 4


def _build(rank: int, world_size: int, seed: int) -> tuple[TrainState, ResumableSampler, torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same initial parameters everywhere (DDP would broadcast them anyway)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    sampler = ResumableSampler(NUM_SAMPLES, seed=0, rank=rank, world_size=world_size)
    # each rank has its own random streams (dropout masks and noise differ by rank)
    torch.manual_seed(seed + rank)
    np.random.seed(seed + rank)
    random.seed(seed + rank)
    data = torch.randn(NUM_SAMPLES, 8, generator=torch.Generator().manual_seed(7))
    state = TrainState(model=ddp, optimizer=optimizer, lr_scheduler=scheduler, data=sampler)
    return state, sampler, data


def _step(state: TrainState, indices: list[int], data: torch.Tensor) -> None:
    x = data[indices]
    noise = float(np.random.randn()) * 1e-2 + random.random() * 1e-2
    loss = (state.model(x) + noise - x.sum(dim=1, keepdim=True)).pow(2).mean()
    state.optimizer.zero_grad()
    loss.backward()
    state.optimizer.step()
    state.lr_scheduler.step()


def _digest(state: TrainState) -> str:
    crc = 0
    for tensor in state.model.state_dict().values():
        crc = zlib.crc32(tensor.numpy().tobytes(), crc)
    for param_state in state.optimizer.state_dict()["state"].values():
        crc = zlib.crc32(param_state["exp_avg_sq"].numpy().tobytes(), crc)
    return f"{crc:08x}"


def _run(
    state: TrainState, sampler: ResumableSampler, data: torch.Tensor, manager, first: int, last: int
) -> None:
    it = iter(sampler)
    for step in range(first, last + 1):
        _step(state, [next(it) for _ in range(BATCH)], data)
        manager.after_step(step)


def _manager(root: str, state: TrainState, mode: str, **kwargs) -> CheckpointManager:
    config = CheckpointConfig(root=root, interval=IntervalConfig(every_steps=3), mode=mode, **kwargs)
    return CheckpointManager.create(config, state, recorder=Recorder(None))


def _first_run(rank: int, world_size: int, root: str) -> dict:
    """Thread mode: train 5 steps, saving at step 3."""
    state, sampler, data = _build(rank, world_size, seed=100)
    with _manager(root, state, "thread") as manager:
        _run(state, sampler, data, manager, 1, 3)
        assert manager.wait()
        _run(state, sampler, data, manager, 4, 5)  # no save: 6 would be the next
    return {"final": _digest(state), "sampler": sampler.state_dict(), "draw": random.random()}


def _second_run(rank: int, world_size: int, root: str) -> dict:
    """Process mode: restore step 3 with the wrong random streams, continue to 5, then save step 6."""
    state, sampler, data = _build(rank, world_size, seed=555)
    with _manager(root, state, "process") as manager:
        restored = manager.restore()
        _run(state, sampler, data, manager, restored + 1, 5)
        result = {"restored": restored, "final": _digest(state), "sampler": sampler.state_dict()}
        result["draw"] = random.random()
        _run(state, sampler, data, manager, 6, 6)
        assert manager.wait()
    result["at_6"] = _digest(state)
    return result


def _third_run(rank: int, world_size: int, root: str, expected_at_6: str) -> None:
    """Thread mode: restore step 6 (saved by the process mode), then a preemption that only rank 0 sees."""
    state, sampler, data = _build(rank, world_size, seed=1)
    manager = _manager(root, state, "thread", handle_preemption=True)
    assert manager.restore() == 6
    assert _digest(state) == expected_at_6, "restored state differs on this rank"
    it = iter(sampler)
    for step in range(7, 20):
        _step(state, [next(it) for _ in range(BATCH)], data)
        if step == 7 and rank == 0:
            manager.request_preemption()  # what SIGTERM does; rank 1 never got one
        manager.after_step(step)  # every rank must leave at the same step boundary (exit 143)
    raise AssertionError("not preempted")


def test_two_ranks_through_both_persist_modes_and_a_preemption(tmp_path):
    root = str(tmp_path / "ckpt")
    first = run_ranks(_first_run, 2, root, timeout_s=180)
    manifest = find_latest(open_storage(root)).latest
    assert manifest is not None and manifest.step == 3 and manifest.world_size == 2
    assert any(name.startswith("__1_") for name in manifest.files)  # rank 1 wrote its own shard

    second = run_ranks(_second_run, 2, root, timeout_s=180)
    for rank in range(2):
        assert second[rank]["restored"] == 3
        assert second[rank]["final"] == first[rank]["final"]  # bit-identical to the uninterrupted run
        assert second[rank]["sampler"] == first[rank]["sampler"]  # each rank's own data position
        assert second[rank]["draw"] == first[rank]["draw"]  # each rank's own Python RNG stream
    assert first[0]["draw"] != first[1]["draw"]
    assert find_latest(open_storage(root)).latest.step == 6

    # rank-specific expectations: DDP keeps parameters equal, optimizer state too, so one digest fits both
    assert second[0]["at_6"] == second[1]["at_6"]
    third = start_ranks(_third_run, 2, root, second[0]["at_6"], timeout_s=180)
    third.wait(expect_exit=PREEMPTED_EXIT_STATUS)
    manifest = find_latest(open_storage(root)).latest
    # requested before step 7's boundary: proposed there, acted on by both ranks at the next exchange (8)
    assert manifest is not None and manifest.step == 8 and manifest.world_size == 2


def _agreeing(rank: int, world_size: int) -> list[tuple[int, bool, bool]]:
    """Each rank proposes its own flags and step time at the exchanges; returns (boundary, save, preempt)
    for each boundary at which it acted on something."""
    from ettr.checkpoint.coordination import Coordinator, StepAgreement

    agreement = StepAgreement(Coordinator.create(), period_s=0.25)
    acted = []
    for boundary in range(1, 40):
        if agreement.due():
            save, preempt = agreement.take()
            if save or preempt:
                acted.append((boundary, save, preempt))
            # rank 0 wants a save at boundary 1 only, rank 1 sees a preemption from boundary 20 on; their
            # steps take 0.05 s and 0.1 s: the gap both use is the smaller one (0.25 / 0.1 = 2)
            agreement.propose(
                rank == 0 and boundary == 1, rank == 1 and boundary >= 20, step_s=0.05 * (rank + 1)
            )
    agreement.drain()
    return acted


def test_the_step_agreement_acts_on_any_ranks_flags_at_the_same_boundaries_on_every_rank():
    acted = run_ranks(_agreeing, 2, timeout_s=180)
    assert acted[0] == acted[1]
    # exchanges at 1, 2 (gap 1 until the first step times are known), then every 2: 4, 6, ...; rank 0's save
    # proposed at 1 is acted on at 2; rank 1's preemption (from 20) is proposed at 20, acted on at 22
    assert acted[0][0] == (2, True, False)
    assert acted[0][1] == (22, False, True)


def _forming_under_the_generation_bound(rank: int, world_size: int) -> tuple[str, float | None, float | None]:
    """Inside a generation of `ettr.resilient` (its bound in the environment, the default group's timeout
    raised to the collective one): then rank 1 never makes a second pair of groups, as a peer killed there."""
    import os

    import torch.distributed as dist

    from ettr import torch_compat
    from ettr.checkpoint.coordination import Coordinator
    from ettr.run_env import GROUP_FORM_TIMEOUT_ENV

    os.environ[GROUP_FORM_TIMEOUT_ENV] = "2"
    torch_compat.set_group_timeout(600.0)
    both = Coordinator.create()  # every rank: formed under 2 s, its collectives then get the default's 600 s
    timeouts = (
        torch_compat.group_timeout_s(both.process_group),
        torch_compat.group_timeout_s(both.control_group),
    )
    dist.barrier()
    if rank == 1:
        return ("skipped", *timeouts)
    try:
        Coordinator.create()  # rank 0 alone: before, gloo's 30 minutes; now the generation's 2 s
    except Exception as exc:  # gloo's connect or the store barrier, whichever gives up first
        return (type(exc).__name__, *timeouts)
    return ("formed", *timeouts)


def test_the_checkpoint_groups_of_a_generation_form_under_its_rendezvous_bound() -> None:
    """A peer killed while the next generation's CheckpointManager made its groups left the survivor in
    gloo's `new_group` for its default 30 minutes (in-place SIGKILL trials: the harness killed it as hung).
    Inside a generation the groups form under the generation's bound and fail with it; their collectives
    still get the default group's timeout."""
    results = run_ranks(_forming_under_the_generation_bound, 2, timeout_s=240.0)
    assert results[0][0] != "formed"
    assert results[0][1:] == (600.0, 600.0) and results[1] == ("skipped", 600.0, 600.0)


def _a_large_value(rank: int, world_size: int, num_bytes: int) -> bytes:
    return bytes([rank]) * num_bytes


def test_run_ranks_returns_values_larger_than_the_result_pipe() -> None:
    """The harness reads the ranks' results while they run: a value over the pipe's ~64 KiB used to keep its
    rank from exiting until `wait` gave up at the timeout (the join came before the read)."""
    values = run_ranks(_a_large_value, 2, 1 << 20, timeout_s=60.0)
    assert [len(v) for v in values] == [1 << 20, 1 << 20]
    assert values[0][:1] == b"\x00" and values[1][:1] == b"\x01"
