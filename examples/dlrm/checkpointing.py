"""Checkpointing of the reference job behind one small seam: the plain baseline, or ettr's manager.

`sync` is what a plain trainer does: every rank `torch.save`s its whole local state (its shards of the
TorchRec tables as `ShardedTensor`s, the replicated dense part, the optimizer state) while training waits.
It still commits properly — rank files first, then a marker renamed into place by rank 0 once all ranks
wrote — so a crash mid-save never destroys the previous checkpoint. It restores with
`torch.load(weights_only=True)` (`ettr.checkpoint.trust.load_pickled`), allowing only what a ShardedTensor is
made of (`sharded_tensor_globals`): a rank file planted in the checkpoint directory is refused, never run. `ettr` hands the same state to
`ettr.checkpoint.CheckpointManager`: async DCP saves that block only for a copy, verified restores, and a
save-then-exit-143 on SIGTERM. Each checkpointer records its own phases (RESTORE, CHECKPOINT_BLOCKING) and
commits through the ettr recorder.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

import ettr
from ettr.checkpoint.trust import load_pickled

COMMIT_MARKER = "COMMITTED"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def _nested_class(owner: type, name: str) -> type:
    """What a pickle of protocol 2 spells `getattr(owner, name)` for a class nested in another: only
    `ShardedTensor.ProcessGroupState` (builtins' own getattr would reach any attribute of an allowed class,
    its functions' globals included)."""
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor

    if owner is ShardedTensor and name == "ProcessGroupState":
        return ShardedTensor.ProcessGroupState
    raise pickle.UnpicklingError(f"{name!r} of {owner!r} is no part of a checkpoint")


def sharded_tensor_globals() -> tuple[Any, ...]:
    """What a `torch.save`d ShardedTensor (TorchRec's tables and their optimizer state) is made of, for
    `torch.load(weights_only=True)`: its classes, and `getattr` only for its nested `ProcessGroupState`."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        MEM_FORMAT_ENCODING,
        ShardedTensorMetadata,
        TensorProperties,
    )
    from torch.distributed._shard.sharded_tensor.shard import Shard
    from torch.distributed._shard.sharding_spec.api import EnumerableShardingSpec
    from torch.distributed._shard.sharding_spec.chunk_sharding_spec import ChunkShardingSpec
    from torch.distributed.remote_device import _remote_device

    return (
        ShardedTensor,
        ShardedTensor.ProcessGroupState,
        Shard,
        ShardMetadata,
        ShardedTensorMetadata,
        TensorProperties,
        MEM_FORMAT_ENCODING,
        EnumerableShardingSpec,
        ChunkShardingSpec,
        _remote_device,
        (_nested_class, "builtins.getattr"),
    )


class Stateful(Protocol):
    """What a checkpointer saves and restores (the shape of `torch.distributed.checkpoint.stateful`)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class Checkpointer(Protocol):
    """Saves and restores the job's state by global step. Every method is collective (all ranks call it)."""

    def restore(self) -> int | None:
        """Load the newest committed checkpoint; returns its step (None: none, start from scratch).

        Records the RESTORE phase and RESUMED.
        """
        ...

    def after_step(self, step: int) -> None:
        """Call after every optimizer step: saves when the interval says so (CHECKPOINT_BLOCKING, commit)."""
        ...

    def save(self, step: int) -> None:
        """Save now (unless `step` is already saved) and wait until it is committed: the final save."""
        ...

    def close(self) -> None:
        """Finish background work and release resources. Idempotent."""
        ...

    def committed(self, step: int) -> Any | None:
        """The committed checkpoint of `step` that holds the live state, for `publish_at_end(checkpoint=)`
        to make the anchor from (ettr's `CommittedCheckpoint`); None when there is none to offer."""
        ...


class TorchSaveCheckpointer:
    """`torch.save` per rank into `ckpt_dir/step_NNNNNNNN/rank_RRRRR.pt`, committed by a marker file.

    Restoring needs the same world size and sharding plan (a rank file holds that rank's shards). The
    newest `keep` committed checkpoints are kept; rank 0 removes older ones after a commit.
    """

    def __init__(
        self,
        ckpt_dir: str | os.PathLike[str],
        state: Stateful,
        *,
        every_steps: int,
        rank: int,
        world_size: int,
        keep: int = 2,
    ) -> None:
        if keep < 1 or every_steps < 0:
            raise ValueError(
                f"need keep >= 1 and every_steps >= 0, got keep={keep} every_steps={every_steps}"
            )
        self.ckpt_dir = Path(ckpt_dir)
        self.state = state
        self.every_steps = every_steps
        self.rank = rank
        self.world_size = world_size
        self.keep = keep
        self._last_saved: int | None = None

    def step_dir(self, step: int) -> Path:
        return self.ckpt_dir / f"step_{step:08d}"

    def committed_steps(self) -> list[int]:
        """Committed steps on disk, oldest first (a local look, not collective)."""
        if not self.ckpt_dir.is_dir():
            return []
        steps = []
        for child in self.ckpt_dir.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and (child / COMMIT_MARKER).is_file():
                steps.append(int(match.group(1)))
        return sorted(steps)

    def latest_step(self) -> int | None:
        """The newest committed step as rank 0 sees it, on every rank."""
        steps = self.committed_steps()
        found = [steps[-1] if steps else None]
        # Rank 0 decides, so that ranks never resume from different steps (a slow file system view).
        if dist.is_initialized() and self.world_size > 1:
            dist.broadcast_object_list(found, src=0)
        return found[0]

    def restore(self) -> int | None:
        with ettr.phase(ettr.Phase.RESTORE):
            step = self.latest_step()
            if step is not None:
                self.load(step)
        ettr.resumed_from(step)
        self._last_saved = step
        return step

    def load(self, step: int) -> None:
        """Load the checkpoint of `step` into the state (raises FileNotFoundError if this rank's is missing)."""
        path = self.step_dir(step) / f"rank_{self.rank:05d}.pt"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing: the checkpoint of step {step} was written by a different world size"
            )
        with open(path, "rb") as f:
            self.state.load_state_dict(load_pickled(f, allowed=sharded_tensor_globals()))

    def after_step(self, step: int) -> None:
        if self.every_steps and step % self.every_steps == 0:
            self.save(step)

    def save(self, step: int) -> None:
        if step == self._last_saved:
            return
        with ettr.phase(ettr.Phase.CHECKPOINT_BLOCKING, step=step):
            path = self.write(step)
        self._last_saved = step
        if path is not None:
            ettr.checkpoint_committed(step, path)

    def write(self, step: int) -> str | None:
        """Write and commit the checkpoint of `step`; returns its directory on rank 0, else None."""
        step_dir = self.step_dir(step)
        step_dir.mkdir(parents=True, exist_ok=True)
        path = step_dir / f"rank_{self.rank:05d}.pt"
        tmp = path.with_suffix(".pt.tmp")
        with open(tmp, "wb") as f:
            torch.save(self.state.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier()  # every rank's file is durable before the marker says so
        if self.rank != 0:
            return None
        _write_durably(step_dir / COMMIT_MARKER, f"{step}\n".encode())
        self._retire_old()
        return str(step_dir)

    def close(self) -> None:
        pass

    def committed(self, step: int) -> Any | None:
        return None  # torch.save rank files: the anchor is written

    def _retire_old(self) -> None:
        for old in self.committed_steps()[: -self.keep]:
            # Marker first: a half-deleted directory must never look committed.
            (self.step_dir(old) / COMMIT_MARKER).unlink(missing_ok=True)
            shutil.rmtree(self.step_dir(old), ignore_errors=True)


def _write_durably(path: Path, payload: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class RankLocalState:
    """A Stateful that shows TorchRec's state to DCP as plain tensors under this rank's own key.

    (`ettr.checkpoint.TrainState` now takes the DistributedModelParallel and its CombinedOptimizer directly,
    ShardedTensors and all; this example keeps its own layout so that its existing checkpoints restore.)
    Every ShardedTensor is replaced by the list of this rank's local shard tensors, and the whole dict goes
    under `rank_<r>` (plain tensors of the same name on every
    rank would otherwise be deduplicated as replicas). Like `sync`, such a checkpoint restores only at the
    same world size and sharding plan.
    """

    def __init__(self, inner: Stateful, *, rank: int) -> None:
        self.inner = inner
        self.key = f"rank_{rank}"

    def state_dict(self) -> dict[str, Any]:
        return {self.key: _localize(self.inner.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        target = self.inner.state_dict()
        self.inner.load_state_dict(_copy_into(target, state_dict[self.key]))


def _localize(value: Any) -> Any:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(value, ShardedTensor):
        return [shard.tensor for shard in value.local_shards()]
    if isinstance(value, dict):
        return {k: _localize(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_localize(v) for v in value]
    return value


def _copy_into(target: Any, loaded: Any) -> Any:
    """`target` (a fresh state_dict) with the values of `loaded` (its localized form) copied into it."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(target, ShardedTensor):
        shards = target.local_shards()
        if len(shards) != len(loaded):
            raise ValueError("the checkpoint was written with a different sharding plan")
        for shard, tensor in zip(shards, loaded, strict=True):
            shard.tensor.copy_(tensor)
        return target
    if isinstance(target, torch.Tensor):
        return target.copy_(loaded) if target.shape == loaded.shape else loaded
    if isinstance(target, dict):
        return {k: _copy_into(v, loaded[k]) for k, v in target.items()}
    if isinstance(target, list):
        return [_copy_into(t, v) for t, v in zip(target, loaded, strict=True)]
    return loaded


@dataclass(frozen=True, kw_only=True)
class AutoInterval:
    """The `auto` checkpoint interval's prior: how often jobs like this one fail (the job's own ledger
    updates it with the failures it has seen)."""

    failures_per_day: float
    """Failures per day of wall time."""
    prior_days: float
    """Days of observation the prior is worth."""

    def __post_init__(self) -> None:
        if not (self.failures_per_day > 0 and self.prior_days > 0):
            raise ValueError("failures_per_day and prior_days must be positive")


class EttrCheckpointer:
    """The `Checkpointer` seam over `ettr.checkpoint.CheckpointManager`.

    The manager records RESTORE, CHECKPOINT_BLOCKING/WAIT/PERSIST and the commits itself, and on SIGTERM
    saves at the next step boundary and exits with 143.
    """

    def __init__(
        self,
        ckpt_dir: str | os.PathLike[str],
        state: Stateful,
        *,
        dense: torch.nn.Module,
        every_steps: int,
        rank: int,
        auto: AutoInterval | None = None,
        memory_interval: str | None = None,
    ) -> None:
        from ettr.checkpoint import CheckpointConfig, CheckpointManager, IntervalConfig
        from ettr.checkpoint import TrainState as EttrTrainState
        from ettr.checkpoint.history import read_failure_history

        # The TorchRec state goes in as an `extra` Stateful in this example's own per-rank layout (older
        # checkpoints restore); `TrainState(model=sharded, optimizer=combined)` also works. `model` is then
        # the dense part (saved twice that way; a few hundred KB).
        ettr_state = EttrTrainState(model=dense, extra={"dlrm": RankLocalState(state, rank=rank)})
        history = None
        if auto is not None:  # the prior, updated with the failures this job's ledger has seen so far
            interval = IntervalConfig(
                auto=True, failures_per_day=auto.failures_per_day, prior_days=auto.prior_days
            )
            history = read_failure_history(ettr.get_recorder().run_dir)
        else:  # every_steps=0 (no periodic saves) still needs an interval: one that never comes in this job
            interval = IntervalConfig(every_steps=every_steps or 2**62)
        # raw_tensors: each tensor's bytes as they are, not DCP's torch.save per tensor (less CPU beside
        # training; the job restores with ettr, which reads them; a plain dcp.load would not)
        config = CheckpointConfig(
            root=ckpt_dir,
            interval=interval,
            keep_last=2,
            handle_preemption=True,
            raw_tensors=True,
            memory_interval=memory_interval,
        )
        self._manager = CheckpointManager.create(config, ettr_state, failure_history=history)  # collective

    def restore(self) -> int | None:
        return self._manager.restore()

    def after_step(self, step: int) -> None:
        self._manager.after_step(step)

    def save(self, step: int) -> None:
        self._manager.finish(step)  # raises CheckpointError (the job exits non-zero) if it fails

    def close(self) -> None:
        self._manager.close()

    def committed(self, step: int) -> Any | None:
        return self._manager.committed(step)  # the anchor is made from it (hard links), not written again


def make_checkpointer(
    mode: str,
    ckpt_dir: str | os.PathLike[str],
    state: Stateful,
    *,
    dense: torch.nn.Module,
    every_steps: int,
    rank: int,
    world_size: int,
    auto: AutoInterval | None = None,
    memory_interval: str | None = None,
) -> Checkpointer:
    """The checkpointer of `--ckpt-mode` (`sync` or `ettr`). Collective for `ettr` (it makes groups).

    `dense` is the replicated (not sharded) part of the model; only `ettr` needs it. `auto` (ettr only):
    the auto interval instead of every `every_steps`; `memory_interval` (ettr only): memory-tier commits.
    """
    if (auto is not None or memory_interval is not None) and mode != "ettr":
        raise ValueError("the auto interval and memory-tier commits need the ettr checkpoint mode")
    if mode == "sync":
        return TorchSaveCheckpointer(
            ckpt_dir, state, every_steps=every_steps, rank=rank, world_size=world_size
        )
    if mode == "ettr":
        return EttrCheckpointer(
            ckpt_dir,
            state,
            dense=dense,
            every_steps=every_steps,
            rank=rank,
            auto=auto,
            memory_interval=memory_interval,
        )
    raise ValueError(f"checkpoint mode must be sync or ettr, got {mode!r}")
