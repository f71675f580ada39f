"""The TorchRec sharding plan, computed once and reused: start-up work not repeated on every attempt.

`EmbeddingShardingPlanner.collective_plan` enumerates, estimates and partitions every table on rank 0 and
broadcasts the result; the plan depends only on the model's tables, the world size and the TorchRec
version, so a job's later attempts (and later jobs of the same model) get the same plan back. The cache
keeps it, one file per key, committed whole (`ettr.atomic.atomic_write`) by rank 0:

    cache = PlanCache(directory, key=plan_key(model_config, world_size))
    plan = cache.load_agreed(world_size)          # collective: one all_reduce, so every rank agrees
    if plan is None:
        plan = planner.collective_plan(model, sharders, group)
        cache.store(plan, rank=rank)

Every rank reads the file itself, so the directory must be one every rank sees (the job's own storage).
The ranks agree (one small all_reduce) whether all of them found it, so that a rank missing the file
never leaves its peers waiting in a different collective: then all of them plan again. The file is this
job's own, written by rank 0 with mode 0600 and read with `pickle` (a plan holds TorchRec's dataclasses)
restricted to the classes a plan is made of (`PLAN_CLASSES`): a forged file whose pickle names anything else
(`os.system` in a `__reduce__`) is refused, and the plan computed again; so is one that unpickles to no
sharding plan of this world size (`plan_problem`: a number, a dict, a shard on rank 7 of 2). It is read never through a
symlink. Still, do not point `--plan-cache` at a directory others can write.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ettr.atomic import atomic_write
from ettr.untrusted import read_small_file

logger = logging.getLogger("dlrm")


PLAN_CLASSES = frozenset(
    {
        ("torchrec.distributed.types", "ShardingPlan"),
        ("torchrec.distributed.types", "EmbeddingModuleShardingPlan"),
        ("torchrec.distributed.types", "ParameterSharding"),
        ("torch.distributed._shard.metadata", "ShardMetadata"),
        ("torch.distributed._shard.sharding_spec.api", "EnumerableShardingSpec"),
        ("torch.distributed.remote_device", "_remote_device"),
        ("torch", "device"),
    }
)
"""What a sharding plan's pickle is made of (TorchRec 1.8's row- and table-wise plans); nothing else loads."""
MAX_PLAN_BYTES = 64 << 20


class _PlanUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in PLAN_CLASSES:
            raise pickle.UnpicklingError(f"{module}.{name} is no part of a sharding plan")
        return super().find_class(module, name)


def plan_problem(plan: Any, world_size: int) -> str | None:
    """Why `plan` (what a plan file unpickled to) is not a sharding plan of `world_size` ranks, or None.

    The unpickler builds only a plan's classes, but any of them (or a number, a string) may stand at any
    place, with any attributes: checked here, so that a damaged or forged file is planned again instead of
    failing `DistributedModelParallel` in every attempt (a pickled `5` under the right key did: the job
    stopped as 'failed the same way before making progress')."""
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ParameterSharding, ShardingPlan

    if type(plan) is not ShardingPlan or not isinstance(vars(plan).get("plan"), dict):
        return f"{type(plan).__name__}, not a ShardingPlan"
    for module_path, module_plan in plan.plan.items():
        if not isinstance(module_path, str) or type(module_plan) is not EmbeddingModuleShardingPlan:
            return f"module {module_path!r}: not an EmbeddingModuleShardingPlan"
        for name, sharding in module_plan.items():
            fields = vars(sharding) if type(sharding) is ParameterSharding else {}
            if not isinstance(name, str) or not fields:
                return f"{module_path}.{name!r}: not a ParameterSharding"
            if not all(isinstance(fields.get(f), str) for f in ("sharding_type", "compute_kernel")):
                return f"{module_path}.{name}: no sharding type or compute kernel"
            ranks = list(fields.get("ranks") or [])
            spec = fields.get("sharding_spec")
            shards = getattr(spec, "shards", None) if spec is not None else []
            if not isinstance(shards, list):
                return f"{module_path}.{name}: a sharding spec without shards"
            for shard in shards:
                placement = getattr(shard, "placement", None)
                try:
                    ranks.append(placement.rank())  # type: ignore[union-attr]
                except Exception:
                    return f"{module_path}.{name}: a shard without a rank"
            if not all(type(r) is int and 0 <= r < world_size for r in ranks):
                return f"{module_path}.{name}: ranks {ranks[:8]} outside a world of {world_size}"
    return None


def plan_key(model_config: Any, world_size: int) -> str:
    """What the plan depends on: the model's dataclass config, the world size, the TorchRec version."""
    import torchrec

    fields = {
        "model": asdict(model_config),
        "world_size": world_size,
        "torchrec": getattr(torchrec, "__version__", "?"),
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


class PlanCache:
    """Plans by key in `directory` (None: a cache that never has one and stores nothing)."""

    def __init__(self, directory: str | os.PathLike[str] | None, *, key: str) -> None:
        self.path = None if directory is None else Path(directory) / f"plan-{key}.pickle"

    def _load(self, world_size: int) -> Any | None:
        if self.path is None or not os.path.lexists(self.path):
            return None
        try:
            plan = _PlanUnpickler(io.BytesIO(read_small_file(self.path, MAX_PLAN_BYTES))).load()
            problem = plan_problem(plan, world_size)
        except Exception as exc:  # a damaged or foreign file: plan again (and overwrite it)
            problem = str(exc)
        if problem is not None:
            logger.warning("dlrm: ignoring the sharding plan in %s (%s)", self.path, problem[:200])
            return None
        return plan

    def load_agreed(self, world_size: int) -> Any | None:
        """The cached plan when every rank has it, else None on every rank. Collective when
        `world_size > 1` and torch.distributed is initialized."""
        plan = self._load(world_size)
        if self.path is None or world_size == 1 or not dist.is_initialized():
            return plan
        found = torch.tensor([0 if plan is None else 1], dtype=torch.int32)
        dist.all_reduce(found, op=dist.ReduceOp.MIN)
        return plan if int(found.item()) == 1 else None

    def store(self, plan: Any, *, rank: int) -> None:
        """Rank 0 commits the plan (never raises: a plan not cached is computed again next time)."""
        if self.path is None or rank != 0:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path, pickle.dumps(plan), mode=0o600)
        except Exception as exc:
            logger.warning("dlrm: could not cache the sharding plan in %s (%s)", self.path, exc)
