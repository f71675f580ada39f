"""The complete training state: RNGs, the data position, and an exact in-process resume."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from ettr.checkpoint import CheckpointConfig, CheckpointManager, IntervalConfig, ResumableSampler, TrainState
from ettr.checkpoint.state import capture_rng, restore_rng
from ettr.recorder import NullRecorder
from ettr.testing.toyjob import ToyJob, _batches, _build, _train_step, reference_digests, state_digest

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _draw() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_rng_roundtrip():
    torch.manual_seed(1)
    state = capture_rng()
    first = [_draw() for _ in range(3)]
    restore_rng(state)
    assert [_draw() for _ in range(3)] == first


def test_sampler_resumes_mid_epoch_exactly():
    reference = ResumableSampler(10, seed=3)
    uninterrupted = list(reference) + list(reference)  # two epochs
    sampler = ResumableSampler(10, seed=3)
    it = iter(sampler)
    head = [next(it) for _ in range(4)]
    saved = sampler.state_dict()
    resumed = ResumableSampler(10, seed=3)
    resumed.load_state_dict(saved)
    assert head + list(resumed) + list(resumed) == uninterrupted
    assert uninterrupted[:10] != uninterrupted[10:]  # reshuffled per epoch
    assert sorted(uninterrupted[:10]) == list(range(10))


def test_sampler_shards_cover_the_dataset():
    shards = [list(ResumableSampler(11, seed=0, rank=r, world_size=3)) for r in range(3)]
    assert all(len(s) == 4 for s in shards)  # padded to 12
    assert set().union(*map(set, shards)) == set(range(11))
    dropped = [list(ResumableSampler(11, seed=0, rank=r, world_size=3, drop_last=True)) for r in range(3)]
    flat = [i for s in dropped for i in s]
    assert len(flat) == 9 and len(set(flat)) == 9


def test_sampler_refuses_a_position_from_another_dataset():
    saved = ResumableSampler(10).state_dict()
    with pytest.raises(ValueError, match="num_samples"):
        ResumableSampler(11).load_state_dict(saved)


def test_sampler_with_a_dataloader_counts_consumed_batches():
    sampler = ResumableSampler(20, seed=1)
    loader = DataLoader(list(range(20)), batch_size=4, sampler=sampler, generator=torch.Generator())
    it = iter(loader)
    next(it), next(it)
    assert sampler.state_dict()["offset"] == 8


def _manager(root, state: TrainState) -> CheckpointManager:
    return CheckpointManager(
        CheckpointConfig(root=root, interval=IntervalConfig(every_steps=1000)), state, recorder=NullRecorder()
    )


@pytest.mark.parametrize("save_at", [0, 7, 13])
def test_resume_in_process_is_bit_identical(tmp_path, save_at):
    """Save after step `save_at`, rebuild everything from scratch, restore, finish: same digest as the
    uninterrupted run. Step 0 covers an optimizer that has no state yet (saving it must not change it)."""
    job = ToyJob(root=str(tmp_path), num_steps=20)
    reference = reference_digests(job)
    state, loader, _ = _build(job)
    batches = _batches(loader)
    with _manager(tmp_path, state) as manager:
        for _ in range(1, save_at + 1):
            _train_step(state, *next(batches))
        assert manager.save(save_at, wait=True)
        for _ in range(save_at + 1, 21):  # the original carries on, unaffected by the save
            _train_step(state, *next(batches))
    assert state_digest(state) == reference[20]

    # a new "process": fresh objects, fresh global RNG states
    torch.manual_seed(999)
    random.seed(999)
    np.random.seed(999)
    fresh, loader2, _ = _build(job)
    for _ in range(3):
        _draw()
    with _manager(tmp_path, fresh) as manager:
        assert manager.restore() == save_at
        assert state_digest(fresh) == reference[save_at]
        batches2 = _batches(loader2)
        for _ in range(save_at + 1, 21):
            _train_step(fresh, *next(batches2))
    assert state_digest(fresh) == reference[20]


def test_extra_statefuls_and_no_scheduler(tmp_path):
    class Counter:
        def __init__(self) -> None:
            self.n = torch.zeros(3)
            self.label = "a"

        def state_dict(self):
            return {"n": self.n, "label": self.label}

        def load_state_dict(self, state):
            self.n.copy_(state["n"])
            self.label = state["label"]

    model = torch.nn.Linear(2, 2)
    counter = Counter()
    counter.n += 5
    counter.label = "saved"
    with _manager(tmp_path, TrainState(model=model, extra={"counter": counter})) as manager:
        manager.save(1, wait=True)
    other = Counter()
    other_model = torch.nn.Linear(2, 2)
    with _manager(tmp_path, TrainState(model=other_model, extra={"counter": other})) as manager:
        assert manager.restore() == 1
    assert torch.equal(other.n, torch.full((3,), 5.0)) and other.label == "saved"
    assert torch.equal(other_model.weight, model.weight)


def test_a_part_that_cannot_be_saved_is_refused_at_construction():
    """torch's DistributedSampler (no state_dict) was accepted as `data`, then every save failed at run time
    ("could not start (AttributeError ...)") while training went on: a restart resumed from nothing."""
    from torch.utils.data import DistributedSampler

    model = torch.nn.Linear(2, 1)
    sampler = DistributedSampler(range(8), num_replicas=1, rank=0)
    with pytest.raises(TypeError, match="DistributedSampler has no state_dict.*ResumableSampler"):
        TrainState(model=model, data=sampler)
    with pytest.raises(TypeError, match=r"extra\['counter'\]"):
        TrainState(model=model, extra={"counter": object()})
    TrainState(model=model, data=ResumableSampler(8, seed=0, rank=0, world_size=1))  # accepted
