"""The script's own destroy_process_group holds the groups it destroys until the exit handlers
(`ettr.bootstrap.group_teardown`): a DDP model dropped after it must not release a gloo group last, in the
main thread with the GIL held (its destructor's join of a worker that needs the GIL never returned)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from ettr.bootstrap import group_teardown  # noqa: E402
from ettr.bootstrap.hooks import Guard  # noqa: E402
from ettr.patcher import Patcher  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


@pytest.fixture
def wrapped() -> Iterator[Any]:
    patcher = Patcher()
    original = dist.destroy_process_group
    group_teardown.install(torch, patcher, Guard())
    try:
        yield dist.destroy_process_group
    finally:
        group_teardown.release()
        if dist.is_initialized():
            original()
        patcher.undo()
        assert dist.destroy_process_group is original


def _init() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def test_the_scripts_destroy_holds_its_groups_until_the_exit_handler(wrapped: Any) -> None:
    from torch.distributed import destroy_process_group  # as the script imports it: the wrapped one

    assert destroy_process_group is wrapped
    _init()
    sub = dist.new_group([0])
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    model(torch.randn(2, 4)).sum().backward()
    world = dist.group.WORLD
    destroy_process_group()
    assert not dist.is_initialized()
    del model  # the reducer's reference is not the last: the groups are held
    held = list(group_teardown._held)
    assert any(g is world for g in held) and any(g is sub for g in held)
    del held
    group_teardown.release()  # what the exit handler does: the groups go, with the GIL free
    assert not group_teardown._held


def test_a_single_group_destroyed_is_held_and_ettrs_own_teardown_is_not(wrapped: Any) -> None:
    _init()
    sub = dist.new_group([0])
    wrapped(sub)
    assert [g for g in group_teardown._held] == [sub]
    # ettr's in-place teardown wants the connections closed at once: nothing held
    exec("destroy()", {"__name__": "ettr.inplace.rendezvous", "destroy": wrapped})
    assert not dist.is_initialized() and len(group_teardown._held) == 1


def test_the_in_place_teardown_lets_go_of_the_groups_the_script_destroyed(wrapped: Any) -> None:
    """A `train` that destroys its group in a `finally:` must not keep its connections open through an in-place
    recovery (a peer blocked on this rank fails when they close)."""
    from ettr.inplace import rendezvous

    _init()
    wrapped()
    assert group_teardown._held
    rendezvous.leave("gloo")
    assert not group_teardown._held
