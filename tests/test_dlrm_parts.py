"""The reference DLRM job's parts in one process: synthetic data, model, command line, checkpoint commit."""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

from dlrm.checkpointing import COMMIT_MARKER, TorchSaveCheckpointer  # noqa: E402
from dlrm.data import ClickDataConfig, HiddenClickModel, KeptLoader, ResumeGate, make_loader  # noqa: E402

SMALL = ClickDataConfig(num_tables=4, num_rows=500, batch_size=256, worker_startup_s=0.0)


def test_a_batch_is_a_pure_function_of_seed_rank_and_index():
    a, b = HiddenClickModel(SMALL), HiddenClickModel(SMALL)
    first, again = a.batch(rank=1, index=7), b.batch(rank=1, index=7)
    for name in ("dense", "values", "lengths", "labels"):
        assert torch.equal(getattr(first, name), getattr(again, name))
    assert not torch.equal(first.values, a.batch(rank=0, index=7).values)
    assert not torch.equal(first.values, a.batch(rank=1, index=8).values)


def test_batches_have_the_keyed_jagged_layout():
    batch = HiddenClickModel(SMALL).batch(rank=0, index=0)
    assert batch.dense.shape == (256, SMALL.num_dense)
    assert batch.lengths.shape == (SMALL.num_tables * 256,) and batch.lengths.dtype == torch.int32
    assert int(batch.lengths.min()) >= 1 and int(batch.lengths.max()) <= SMALL.max_ids_per_feature
    assert batch.values.numel() == int(batch.lengths.sum())
    assert int(batch.values.min()) >= 0 and int(batch.values.max()) < SMALL.num_rows
    assert set(batch.labels.unique().tolist()) <= {0.0, 1.0}


def test_ids_are_skewed_like_click_logs():
    batch = HiddenClickModel(SMALL).batch(rank=0, index=0)
    counts = torch.bincount(batch.values, minlength=SMALL.num_rows).sort(descending=True).values
    top_1_pct = counts[: SMALL.num_tables * SMALL.num_rows // 100].sum() / counts.sum()
    assert top_1_pct > 0.25  # uniform ids would give 1%


def test_labels_carry_signal_a_model_can_learn():
    hidden = HiddenClickModel(SMALL)
    batch = hidden.batch(rank=0, index=3)
    logit = hidden.logit(dense=batch.dense, values=batch.values, lengths=batch.lengths)
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    base_rate = batch.labels.mean().clamp(0.01, 0.99)
    best_constant = bce(torch.full_like(logit, float(torch.logit(base_rate))), batch.labels)
    assert bce(logit, batch.labels) < best_constant - 0.15


def test_several_workers_give_the_same_stream_as_one():
    def indices(num_workers: int) -> list[int]:
        loader = make_loader(SMALL, rank=0, start=3, stop=11, num_workers=num_workers)
        return [b.index for b in loader]

    one = indices(0)
    assert one == list(range(3, 11))
    assert indices(2) == one


@pytest.mark.timeout(60)
def test_workers_started_before_the_resume_step_is_known_start_there():
    gate = ResumeGate()
    batches = iter(make_loader(SMALL, rank=0, start=gate, stop=20, num_workers=2))  # workers start now
    gate.set(12)
    assert [next(batches).index for _ in range(3)] == [12, 13, 14]
    expected = HiddenClickModel(SMALL).batch(rank=0, index=15)
    assert torch.equal(next(batches).values, expected.values)


@pytest.mark.timeout(60)
def test_kept_workers_go_back_to_a_checkpoint_without_starting_again():
    # One worker whose start-up (simulated I/O) is done once: going back is a seek, not a new worker.
    kept = KeptLoader(SMALL, rank=1, stop=30, num_workers=1)
    batches = kept.batches(5)
    assert [next(batches).index for _ in range(4)] == [5, 6, 7, 8]  # and more prefetched meanwhile
    again = kept.batches(6)  # a restart in place resumed from step 6
    got = [next(again) for _ in range(3)]
    assert [b.index for b in got] == [6, 7, 8]
    assert torch.equal(got[0].values, HiddenClickModel(SMALL).batch(rank=1, index=6).values)
    assert kept.num_restarted == 0
    assert [b.index for b in kept.batches(27)] == [27, 28, 29]
    kept.close()


@pytest.mark.timeout(60)
def test_kept_workers_that_cannot_give_the_next_batch_are_replaced_not_trusted():
    kept = KeptLoader(SMALL, rank=0, stop=12, num_workers=2)
    assert [b.index for b in kept.batches(0)] == list(range(12))  # the workers' streams have ended
    assert [b.index for b in kept.batches(9)] == [9, 10, 11]
    assert kept.num_restarted == 1
    kept.close()
    assert [b.index for b in kept.batches(3)][:2] == [3, 4]  # closed: new workers again
    kept.close()


def test_data_config_is_validated():
    with pytest.raises(ValueError, match="batch_size"):
        ClickDataConfig(batch_size=0)
    with pytest.raises(ValueError, match="worker_startup_s"):
        ClickDataConfig(worker_startup_s=-1)


def test_the_model_gives_one_logit_per_sample_and_learns_on_one_process():
    from dlrm.model import Dlrm, DlrmConfig
    from torchrec import KeyedJaggedTensor

    config = DlrmConfig(
        num_tables=SMALL.num_tables, num_rows=SMALL.num_rows, embedding_dim=16, bottom_mlp=(32, 16)
    )
    torch.manual_seed(0)
    model = Dlrm(config)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    hidden = HiddenClickModel(SMALL)
    losses = []
    for index in range(30):
        batch = hidden.batch(rank=0, index=index)
        features = KeyedJaggedTensor(keys=config.feature_names, values=batch.values, lengths=batch.lengths)
        logits = model(batch.dense, features)
        assert logits.shape == (SMALL.batch_size,)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.05


def test_model_config_is_validated():
    from dlrm.model import DlrmConfig

    with pytest.raises(ValueError, match="bottom_mlp must end at embedding_dim"):
        DlrmConfig(embedding_dim=16, bottom_mlp=(64, 32))


class _State:
    def __init__(self, value: float) -> None:
        self.tensor = torch.full((3,), value)

    def state_dict(self) -> dict:
        return {"t": self.tensor}

    def load_state_dict(self, state_dict: dict) -> None:
        self.tensor = state_dict["t"].clone()


def test_sync_checkpoints_commit_with_a_marker_and_keep_the_newest(tmp_path):
    state = _State(0)
    ckpt = TorchSaveCheckpointer(tmp_path, state, every_steps=10, rank=0, world_size=1, keep=2)
    assert ckpt.restore() is None
    for step in range(1, 31):
        state.tensor = torch.full((3,), float(step))
        ckpt.after_step(step)  # saves at 10, 20, 30
    (tmp_path / "step_00000040").mkdir()  # a save that died before its marker
    (tmp_path / "step_00000040" / "rank_00000.pt").write_bytes(b"partial")
    assert ckpt.committed_steps() == [20, 30]
    assert ckpt.latest_step() == 30
    assert (tmp_path / "step_00000030" / COMMIT_MARKER).is_file()
    restored = _State(0)
    assert TorchSaveCheckpointer(tmp_path, restored, every_steps=10, rank=0, world_size=1).restore() == 30
    assert torch.equal(restored.tensor, torch.full((3,), 30.0))
    with pytest.raises(FileNotFoundError, match="different world size"):
        TorchSaveCheckpointer(tmp_path, restored, every_steps=10, rank=1, world_size=2).load(30)


def test_sync_checkpoints_restore_sharded_tensors_and_never_run_a_planted_rank_file(tmp_path):
    """The baseline restores without unpickling code: its ShardedTensors load with weights_only=True, and a
    rank file whose pickle calls os.system (a forged committed step) is refused before anything runs."""
    import torch.distributed as dist
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    from ettr.checkpoint.trust import UnsafePickle

    class Sharded:
        def __init__(self) -> None:
            self.table = sharded_tensor.zeros(ChunkShardingSpec(dim=0, placements=["rank:0/cpu"]), 4, 2)

        def state_dict(self) -> dict:
            return {"table": self.table, "step": 7}

        def load_state_dict(self, state_dict: dict) -> None:
            self.table, self.step = state_dict["table"], state_dict["step"]

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        saved = Sharded()
        saved.table.local_shards()[0].tensor.copy_(torch.arange(8.0).view(4, 2))
        TorchSaveCheckpointer(tmp_path / "ckpt", saved, every_steps=1, rank=0, world_size=1).save(1)
        restored = Sharded()
        assert (
            TorchSaveCheckpointer(tmp_path / "ckpt", restored, every_steps=1, rank=0, world_size=1).restore()
            == 1
        )
        assert torch.equal(restored.table.local_shards()[0].tensor, torch.arange(8.0).view(4, 2))
        assert restored.step == 7
    finally:
        dist.destroy_process_group()
    forged = tmp_path / "ckpt" / "step_00000001" / "rank_00000.pt"
    forged.write_bytes(pickle.dumps(_Forged(str(tmp_path / "PWNED"))))
    with pytest.raises(UnsafePickle, match="weights_only"):
        TorchSaveCheckpointer(tmp_path / "ckpt", _State(0), every_steps=1, rank=0, world_size=1).restore()
    assert not (tmp_path / "PWNED").exists()


def test_command_line_flags_are_frozen_for_the_demo():
    from dlrm.train import build_parser

    flags = {s for action in build_parser()._actions for s in action.option_strings}
    # `ettr demo` drives these; renaming one breaks it.
    assert {
        "--steps",
        "--ckpt-every",
        "--ckpt-mode",
        "--ckpt-dir",
        "--resume",
        "--no-resume",
        "--publish",
        "--compile",
        "--no-compile",
        "--compile-cache",
        "--overlap-startup",
        "--no-overlap-startup",
        "--ettr-run-dir",
        "--summary-out",
        "--ckpt-auto",
        "--failures-per-day",
        "--failure-prior-days",
        "--plan-cache",
        "--fast-exit",
    } <= flags


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "--steps must be at least 1"),
        (["--ckpt-mode", "bogus"], "invalid choice"),
        (["--ckpt-auto"], "--ckpt-auto needs --ckpt-mode ettr"),
        (["--ckpt-mode", "ettr", "--ckpt-auto", "--failures-per-day", "0"], "must be positive"),
        (["--steps", "ten"], "invalid int value"),
    ],
)
def test_bad_command_lines_exit_2_with_one_line(argv, message, capsys):
    from dlrm.train import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and err.startswith("train.py: ")


# -- the sharding plan, computed once (dlrm.plan_cache) ---------------------------------------------------
class _Forged:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _plan(ranks: list) -> object:
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ParameterSharding, ShardingPlan

    sharding = ParameterSharding(sharding_type="table_wise", compute_kernel="fused", ranks=ranks)
    return ShardingPlan(plan={"sparse_arch.ebc": EmbeddingModuleShardingPlan({"t0": sharding})})


def test_a_plan_is_read_back_by_key_and_a_damaged_or_missing_one_means_plan_again(tmp_path):
    pytest.importorskip("torchrec")
    from dlrm.plan_cache import PlanCache

    plan = _plan([0])
    cache = PlanCache(tmp_path / "plans", key="k1")
    assert cache.load_agreed(1) is None
    cache.store(plan, rank=1)  # only rank 0 writes
    assert cache.load_agreed(1) is None
    cache.store(plan, rank=0)
    assert cache.load_agreed(1) == plan and PlanCache(tmp_path / "plans", key="k1").load_agreed(1) == plan
    assert cache.path is not None and cache.path.stat().st_mode & 0o777 == 0o600
    assert PlanCache(tmp_path / "plans", key="k2").load_agreed(1) is None  # another model or world size
    cache.path.write_bytes(b"not a pickle")
    assert cache.load_agreed(1) is None
    # A forged file: its pickle names a function to call; nothing but a plan's classes is loaded.
    cache.path.write_bytes(pickle.dumps(_Forged(str(tmp_path / "PWNED"))))
    assert cache.load_agreed(1) is None and not (tmp_path / "PWNED").exists()
    # Files that unpickle, but to no plan of this world: planned again, never handed to the sharder.
    for forged in (5, "plan", _plan([1]), _plan([-1]), _plan([True]), {"sparse_arch.ebc": {}}):
        cache.path.write_bytes(pickle.dumps(forged))
        assert cache.load_agreed(1) is None, forged
    cache.path.write_bytes(pickle.dumps(_plan([1])))
    assert cache.load_agreed(2) == _plan([1])  # rank 1 of two
    off = PlanCache(None, key="k1")
    off.store(plan, rank=0)
    assert off.load_agreed(1) is None


def test_the_plan_key_changes_with_the_model_and_the_world_size():
    pytest.importorskip("torchrec")
    from dlrm.model import DlrmConfig
    from dlrm.plan_cache import plan_key

    small, big = DlrmConfig(num_rows=10), DlrmConfig(num_rows=20)
    assert plan_key(small, 2) == plan_key(DlrmConfig(num_rows=10), 2)
    assert len({plan_key(small, 2), plan_key(big, 2), plan_key(small, 4)}) == 3
