"""The checkpoint manager on TorchRec's sharded model: `TrainState(model=DistributedModelParallel(...),
optimizer=CombinedOptimizer([...]))` on two real gloo ranks saves (the tables and their fused optimizer
state are ShardedTensors) and resumes bit-identical, the way a TorchRec user writes it."""

from __future__ import annotations

import warnings
import zlib

import pytest
import torch

from ettr.checkpoint import CheckpointConfig, CheckpointManager, IntervalConfig, TrainState
from ettr.recorder import Recorder
from ettr.testing.spawn import run_ranks

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

pytestmark = pytest.mark.slow

KEYS = ["f0", "f1", "f2"]
ROWS = 1000
"""Rows per table: enough for the planner to shard the tables and run them with the fused kernel (with 50
it left them unsharded, plain weights stepped by the dense optimizer: no ShardedTensor, no fused state)."""


def _build(seed: int) -> TrainState:
    from torch.distributed.optim import _apply_optimizer_in_backward
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.manual_seed(seed)  # a different seed: only a real restore makes the runs agree
    tables = [
        EmbeddingBagConfig(name=f"t_{k}", embedding_dim=8, num_embeddings=ROWS, feature_names=[k])
        for k in KEYS
    ]
    model = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        dense_in_features=4,
        dense_arch_layer_sizes=[8],
        over_arch_layer_sizes=[8, 1],
    )
    _apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(), {"lr": 0.1})
    dmp = DistributedModelParallel(
        model, device=torch.device("cpu"), sharders=[EmbeddingBagCollectionSharder()]
    )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda ps: torch.optim.Adagrad(ps, lr=0.1)
    )
    return TrainState(model=dmp, optimizer=CombinedOptimizer([dmp.fused_optimizer, dense]))


def _step(state: TrainState, rank: int, step: int) -> None:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(1000 * rank + step)
    lengths = torch.randint(0, 3, (len(KEYS) * 4,), generator=g)
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=KEYS, values=values, lengths=lengths)
    loss = state.model(torch.rand(4, 4, generator=g), kjt).pow(2).mean()
    state.optimizer.zero_grad()
    loss.backward()
    state.optimizer.step()


def _digest(state: TrainState) -> str:
    """This rank's model and optimizer state: local shards of the tables and their momenta included."""

    def tensors(value):
        if hasattr(value, "local_shards"):
            return [shard.tensor for shard in value.local_shards()]
        if isinstance(value, dict):
            return [t for k in sorted(value) for t in tensors(value[k])]
        return [value] if isinstance(value, torch.Tensor) else []

    crc = 0
    found = tensors(state.model.state_dict()) + tensors(state.optimizer.state_dict())
    for tensor in found:
        crc = zlib.crc32(tensor.detach().contiguous().numpy().tobytes(), crc)
    return f"{crc:08x}/{len(found)}"


def _manager(root: str, state: TrainState) -> CheckpointManager:
    config = CheckpointConfig(root=root, interval=IntervalConfig(every_steps=3), mode="thread")
    return CheckpointManager.create(config, state, recorder=Recorder(None))


def _first_run(rank: int, world_size: int, root: str) -> dict:
    from ettr.checkpoint.persist import unguarded_changes

    state = _build(seed=0)
    with _manager(root, state) as manager:
        for step in range(1, 6):  # on at once after the save of step 3, as a training loop goes on
            _step(state, rank, step)
            manager.after_step(step)
        assert manager.wait()
        # The fused optimizer updates the tables inside step 4's backward, before the optimizer step that
        # guards an overlapped copy: with 3M-row tables the copy of step 3 took rows of step 4 (the run
        # resumed to another state). So the save copies everything before it returns.
        why = unguarded_changes(state)
        overlapping = manager.overlapping
    return {"final": _digest(state), "why": why, "overlapping": overlapping}


def _second_run(rank: int, world_size: int, root: str) -> dict:
    state = _build(seed=1)
    before = _digest(state)
    with _manager(root, state) as manager:
        restored = manager.restore()
        for step in range(4, 6):
            _step(state, rank, step)
    return {"restored": restored, "before": before, "final": _digest(state)}


def test_a_torchrec_sharded_model_and_its_fused_optimizer_resume_bit_identical(tmp_path):
    root = str(tmp_path / "ckpt")
    first = run_ranks(_first_run, 2, root, timeout_s=300)
    second = run_ranks(_second_run, 2, root, timeout_s=300)
    for rank in (0, 1):
        assert "fused optimizer" in first[rank]["why"] and first[rank]["overlapping"] is False
        assert second[rank]["restored"] == 3
        assert second[rank]["before"] != first[rank]["final"]
        assert second[rank]["final"] == first[rank]["final"], f"rank {rank} resumed to a different state"
