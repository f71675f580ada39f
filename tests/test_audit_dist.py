"""The init communication audit on a real 2-process gloo group: what it counts, where, and that it lets go."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ettr.audit import CommAudit
from ettr.events import EventKind, Phase
from ettr.ledger import MemoryLedger
from ettr.recorder import Recorder
from ettr.report.audit import render
from ettr.supervisor.launch import free_port

WORLD_SIZE = 2


# Not ettr.testing.spawn.run_ranks: it initialises the process group before the body runs, and here the
# audit must be installed first to see init_process_group itself.
def _rank_main(rank: int, port: int, out_dir: str) -> None:
    rec = Recorder(MemoryLedger(), rank=rank, world_size=WORLD_SIZE, flush_interval_s=60)
    audit = CommAudit(rec).install()
    with rec.phase(Phase.PROCESS_GROUP_INIT):
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE
        )
    with rec.phase(Phase.TRAIN_MODULE_CREATION):
        plan = [{"tables": 12} if rank == 0 else None]
        dist.broadcast_object_list(plan, src=0)  # inside: broadcast x2, not counted on their own
        gathered: list[object] = [None] * WORLD_SIZE
        dist.all_gather_object(gathered, rank)
        side = dist.new_group([0, 1])
        dist.barrier(group=side)
        torch.manual_seed(rank)
        torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))  # verifies and broadcasts params
    with rec.phase(Phase.PRE_TRAIN):
        dist.barrier()
    rec.training_started()
    # The loop: nothing is audited any more, and the function is torch's own again.
    dist.all_reduce(torch.ones(1))
    result = {
        "audit_ended": not audit.active,
        "plan": plan[0],
        "gathered": gathered,
        "all_reduce_is_torch_own": dist.all_reduce is torch.distributed.distributed_c10d.all_reduce
        and getattr(dist.all_reduce, "__ettr_audit_original__", None) is None,
    }
    rec.flush()
    dist.destroy_process_group()
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump({"events": rec._ledger.read(), **result}, f)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_audit_counts_start_up_collectives_of_a_real_gloo_group(tmp_path):
    mp.start_processes(_rank_main, args=(free_port(), str(tmp_path)), nprocs=WORLD_SIZE, start_method="spawn")
    results = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(WORLD_SIZE)]
    for rank, result in enumerate(results):
        assert result["plan"] == {"tables": 12} and result["gathered"] == [0, 1]  # the calls really worked
        assert result["audit_ended"] and result["all_reduce_is_torch_own"]
        marks = [e for e in result["events"] if e.kind is EventKind.MARK]
        assert len(marks) == 1 and marks[0].rank == rank
        summary = marks[0].data
        stages = summary["stages"]
        assert set(stages["process_group_init"]) == {"init_process_group"}
        counts = {op: s["num_calls"] for op, s in stages["train_module_creation"].items()}
        assert counts == {
            "broadcast_object_list": 1,
            "all_gather_object": 1,
            "new_group": 1,
            "barrier": 1,
            "_verify_params_across_processes": 1,
            "_broadcast_coalesced": 1,
        }
        assert {op: s["num_calls"] for op, s in stages["pre_train"].items()} == {"barrier": 1}
        assert summary["num_calls"] == 8  # and not the all_reduce of the loop
        assert summary["num_groups_created"] == 2  # the world and the side group
        assert summary["total_s"] > 0
    text = render([e for result in results for e in result["events"]])
    assert "2 rank(s)" in text and "broadcast_object_list" in text and "rank 1: 8 calls" in text
