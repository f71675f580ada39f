"""Async checkpointing on torch.distributed.checkpoint that never blocks long and never resumes from a bad
checkpoint. See `docs/checkpointing.md`; `CheckpointManager` is the entry point."""

from ettr.checkpoint.base import (
    CheckpointConfig,
    CheckpointError,
    CheckpointInvalid,
    CheckpointStorage,
    PersistMode,
    ReadableStorage,
    WritableStorage,
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
from ettr.checkpoint.coordination import Coordinator
from ettr.checkpoint.history import FailureHistory, read_failure_history
from ettr.checkpoint.manager import CheckpointManager
from ettr.checkpoint.policy import IntervalConfig, IntervalPolicy
from ettr.checkpoint.preempt import PREEMPTED_EXIT_STATUS, PreemptionWatcher
from ettr.checkpoint.resume import ResumeChoice, choose_checkpoint
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
    "ReadableStorage",
    "WritableStorage",
    "Coordinator",
    "FailureHistory",
    "FsspecStorage",
    "IntervalConfig",
    "IntervalPolicy",
    "LocalStorage",
    "Manifest",
    "PersistMode",
    "PreemptionWatcher",
    "Resolution",
    "ResumeChoice",
    "ResumableSampler",
    "TrainState",
    "apply_retention",
    "capture_rng",
    "choose_checkpoint",
    "find_latest",
    "lease",
    "list_checkpoints",
    "open_storage",
    "read_failure_history",
    "restore_rng",
    "step_dir_name",
    "verify",
]
