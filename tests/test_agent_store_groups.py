"""ettr's own gloo groups under plain torchrun's restarts: torchrun's agent keeps one TCPStore for the whole
job (torch >= 2.4 shares it with the workers, `TORCHELASTIC_USE_AGENT_STORE=True`), and a group's gloo
rendezvous keys are named by the group's name alone (`<name>//cpu//0/<rank>`), the same in every launch. The
restarted workers found the previous launch's keys: a rank that read its peer's old address before the peer
wrote its new one connected to a dead port (`Gloo connectFullMesh failed ... Connection refused`) or waited
for a connection that never came. The checkpoint manager's two groups (`Coordinator.create`) met that on
every restart, beside the job's own default group (docs/inplace.md)."""

from __future__ import annotations

import struct

import pytest

from ettr.testing.spawn import run_ranks

pytestmark = pytest.mark.slow


def _dead_address(value: bytes) -> bytes:
    """A gloo rank record (`transport::tcp::Rank::bytes`: hostname size and hostname, address size and
    address (a sockaddr first), the pair ids) with its port set to 0: nobody listens there, and every
    other port compares above it, so the rank that reads it connects (gloo's `Pair::connect`) and is
    refused, as one that read a dead process's port and chose to connect."""
    (host_size,) = struct.unpack_from("=Q", value, 0)
    port_at = 8 + host_size + 8 + 2  # after both sizes, the hostname and the sockaddr's family
    return value[:port_at] + b"\0\0" + value[port_at + 2 :]


def _restarted_launch(rank: int, world_size: int) -> tuple[str, bool]:
    """A launch of a restarted job under torchrun's agent store: the key of rank 1 for the next group is
    still there from before (a dead port); rank 1 comes to the group late, so rank 0 reads that key first."""
    import os
    import time

    import torch.distributed as dist

    from ettr import torch_compat
    from ettr.checkpoint.coordination import Coordinator

    store = torch_compat.default_store()
    name = str(dist.distributed_c10d._world.group_count)  # the name torch gives the next group
    if rank == 0:  # rank 1's record for the default group, as the next group's stale key
        store.set(f"{name}//cpu//0/1", _dead_address(bytes(store.get("cpu//0/1"))))
    dist.barrier()
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # as torchrun's agent sets it
    if rank == 1:
        time.sleep(1.0)
    try:
        coordinator = Coordinator.create()
    except Exception as exc:
        return (f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}", False)
    dist.barrier(group=coordinator.control_group)
    # the keys ettr forgets are those gloo writes (a torch that renamed them would leave them stale again)
    named = torch_compat.gloo_rendezvous_keys(name, rank)
    return ("formed", bool(named) and store.check(named))


def test_the_checkpoint_groups_form_where_an_earlier_launch_left_their_keys() -> None:
    results = run_ranks(_restarted_launch, 2, timeout_s=120.0)
    assert results == [("formed", True), ("formed", True)]
