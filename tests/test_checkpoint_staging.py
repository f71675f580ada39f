"""ReusedStager: a complete, independent copy into buffers allocated once."""

from __future__ import annotations

import pickle
from concurrent.futures import ThreadPoolExecutor

import torch

from ettr.checkpoint.staging import ReusedStager


def _state() -> dict:
    model = torch.nn.Linear(16, 8)
    return {
        "model": model.state_dict(),
        "optim": {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(8, 16)}}, "lr": 0.1},
        "list": [torch.arange(4), "text", None],
        "blob": b"\x00\x01",
    }


def test_staged_copy_equals_and_is_independent():
    state = _state()
    stager = ReusedStager()
    staged = stager.stage(state)
    assert torch.equal(staged["model"]["weight"], state["model"]["weight"])
    assert (
        staged["optim"]["lr"] == 0.1
        and staged["blob"] == b"\x00\x01"
        and staged["list"][1:] == ["text", None]
    )
    before = staged["model"]["weight"].clone()
    state["model"]["weight"].add_(1.0)  # training goes on after staging
    state["optim"]["state"]["w"]["step"].add_(1)
    assert torch.equal(staged["model"]["weight"], before)
    assert staged["optim"]["state"]["w"]["step"].item() == 3.0
    assert not staged["model"]["weight"].requires_grad


def test_buffers_are_allocated_once_and_reused():
    state = _state()
    stager = ReusedStager()
    first = stager.stage(state)
    pointers = [first["model"]["weight"].data_ptr(), first["optim"]["state"]["w"]["exp_avg"].data_ptr()]
    num_bytes = stager.num_bytes
    state["model"]["weight"].mul_(2.0)
    second = stager.stage(state)
    assert [
        second["model"]["weight"].data_ptr(),
        second["optim"]["state"]["w"]["exp_avg"].data_ptr(),
    ] == pointers
    assert stager.num_bytes == num_bytes
    assert torch.equal(second["model"]["weight"], state["model"]["weight"])


def test_a_changed_shape_gets_a_new_buffer():
    stager = ReusedStager()
    stager.stage({"t": torch.zeros(3)})
    staged = stager.stage({"t": torch.ones(5)})
    assert torch.equal(staged["t"], torch.ones(5))


def test_other_objects_are_deep_copied():
    class Holder:
        def __init__(self) -> None:
            self.tensor = torch.ones(2)

    holder = Holder()
    staged = ReusedStager().stage({"h": holder})
    holder.tensor.add_(1)
    assert torch.equal(staged["h"].tensor, torch.ones(2))


def test_views_and_non_contiguous_tensors():
    base = torch.arange(12.0).reshape(3, 4)
    staged = ReusedStager().stage({"view": base[:, 1], "t": base.t()})
    assert torch.equal(staged["view"], base[:, 1]) and torch.equal(staged["t"], base.t())


def test_shared_memory_buffers_for_the_process_mode():
    staged = ReusedStager(share_memory=True).stage({"t": torch.randn(64)})
    assert staged["t"].is_shared()
    # what DCP's checkpoint process receives: a handle to the same memory, not a copy of the bytes
    assert len(pickle.dumps(staged["t"])) > 0


def test_buffers_made_ahead_are_the_ones_the_first_copy_uses() -> None:
    """`prepare` allocates (and faults in) in the background what `stage` then copies into: the same buffers,
    the right values, nothing more allocated by the copy."""
    state = _state()
    state["big"] = torch.randn(1 << 19)  # 2 MiB: its own page-aligned buffer, faulted in ahead
    state["pair"] = (
        torch.ones(3),
        [torch.zeros(2)],
    )  # a tuple and a list inside: keys as `_stage` makes them
    stager = ReusedStager()
    with ThreadPoolExecutor(max_workers=1) as executor:
        stager.prepare(state, executor)
        stager._wait_prepared()
        prepared = {key: buffer.data_ptr() for key, buffer in stager._buffers.items()}
        staged = stager.stage(state)  # waits for the preparation first
    assert isinstance(staged, dict)
    made = {key: buffer.data_ptr() for key, buffer in stager._buffers.items()}
    assert made == prepared  # `allocate` walks the state as `_stage` does: the copy made no buffer of its own
    assert made and stager.allocate(state) == 1 << 21  # nothing new: the same keys, the same buffers
    assert {key: buffer.data_ptr() for key, buffer in stager._buffers.items()} == made
    assert staged["big"].data_ptr() == made["big"] and torch.equal(staged["big"], state["big"])
    assert torch.equal(staged["model"]["weight"], state["model"]["weight"])
    stager.close()


def test_lend_lets_go_of_the_last_copy() -> None:
    """The buffers `lend` replaces are freed where it runs (the persist's thread), not by the next `stage`."""
    stager = ReusedStager()
    stager.stage({"t": torch.ones(4)})
    assert stager.last_staged is not None
    stager.lend({})
    assert stager.last_staged is None
    stager.close()
