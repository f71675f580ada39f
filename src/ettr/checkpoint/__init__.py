"""Async checkpointing on torch.distributed.checkpoint that never blocks long and never resumes from a bad
checkpoint. See `docs/checkpointing.md`; `CheckpointManager` is the entry point."""

from ettr.checkpoint.base import (
    CheckpointConfig,
    CheckpointError,
    CheckpointInvalid,
    CheckpointStorage,
    PersistMode,
    step_dir_name,
)
from ettr.checkpoint.commit import (
    Manifest,
    Resolution,
    apply_retention,
    find_latest,
    lease,
    list_checkpoints,
    verify,
)
from ettr.checkpoint.manager import CheckpointManager
from ettr.checkpoint.policy import IntervalConfig, IntervalPolicy
from ettr.checkpoint.preempt import PREEMPTED_EXIT_STATUS, PreemptionWatcher
from ettr.checkpoint.sampler import ResumableSampler
from ettr.checkpoint.state import TrainState, capture_rng, restore_rng
from ettr.checkpoint.storage import FsspecStorage, LocalStorage, open_storage

__all__ = [
    "PREEMPTED_EXIT_STATUS",
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointInvalid",
    "CheckpointManager",
    "CheckpointStorage",
    "FsspecStorage",
    "IntervalConfig",
    "IntervalPolicy",
    "LocalStorage",
    "Manifest",
    "PersistMode",
    "PreemptionWatcher",
    "Resolution",
    "ResumableSampler",
    "TrainState",
    "apply_retention",
    "capture_rng",
    "find_latest",
    "lease",
    "list_checkpoints",
    "open_storage",
    "restore_rng",
    "step_dir_name",
    "verify",
]
