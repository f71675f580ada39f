"""Process-group coordination of checkpointing: which ranks take part, and how they agree.

A `Coordinator` is made once per process, explicitly, before the checkpoint manager: `Coordinator.create`
is collective (every rank calls it: it makes the checkpoint's own gloo groups, so that a background persist
never shares a communicator with training collectives) and, for the process persist mode in a process
without torch.distributed, makes the single-rank default group DCP's checkpoint process needs.
`Coordinator.single()` is a lone process that coordinates with nobody. The manager then only calls the
three collectives below (`barrier`, `broadcast_from_0`, `agree`), each a no-op for a single rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ettr.checkpoint.base import PersistMode


@dataclass(kw_only=True)
class Coordinator:
    """The ranks of one checkpoint and the groups they talk over (see the module docstring)."""

    rank: int = 0
    world_size: int = 1
    process_group: dist.ProcessGroup | None = None
    """The group DCP saves and loads over (None: a single process, `no_dist`)."""
    control_group: dist.ProcessGroup | None = None
    """The group the save/preempt decisions are agreed over (None for a single rank)."""
    owns_default_group: bool = False
    """Whether `create` made the default group (then `close` destroys it)."""
    _closed: bool = False

    @classmethod
    def single(cls) -> Coordinator:
        """A lone process: no groups, nothing collective."""
        return cls()

    @classmethod
    def create(
        cls, *, mode: PersistMode | str = PersistMode.THREAD, process_group: dist.ProcessGroup | None = None
    ) -> Coordinator:
        """The coordinator of this process's job. Collective when torch.distributed is initialized: every
        rank calls it, in the same order relative to other group creations.

        Args:
            mode: the persist mode; `process` in a process without torch.distributed makes a single-rank
                default group (over a HashStore), which `close` destroys.
            process_group: the group to checkpoint over (default: a new gloo group of all ranks).
        """
        owns = False
        if PersistMode(mode) is PersistMode.PROCESS and not dist.is_initialized():
            # DCP's checkpoint process is set up over a process group; a single process gets its own.
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            owns = True
        if not (dist.is_available() and dist.is_initialized()):
            return cls.single()
        world_size = dist.get_world_size()
        group = process_group if process_group is not None else dist.new_group(backend="gloo")
        control = dist.new_group(backend="gloo") if world_size > 1 else None
        return cls(
            rank=dist.get_rank(),
            world_size=world_size,
            process_group=group,
            control_group=control,
            owns_default_group=owns,
        )

    @property
    def distributed(self) -> bool:
        """Whether DCP runs over a process group (False: `no_dist`)."""
        return self.process_group is not None

    def barrier(self) -> None:
        """Wait until every rank has reached this point (no-op for one rank)."""
        if self.process_group is not None and self.world_size > 1:
            dist.barrier(group=self.process_group)

    def broadcast_from_0(self, values: list[Any]) -> list[Any]:
        """Rank 0's `values` on every rank (picklable objects; no-op for one rank)."""
        if self.process_group is not None and self.world_size > 1:
            dist.broadcast_object_list(values, src=0, group=self.process_group)
        return values

    def agree(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag true on every rank when it is true on any rank (no-op for one rank)."""
        if self.control_group is None:
            return tuple(flags)
        tensor = torch.tensor([int(f) for f in flags], dtype=torch.int32)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.control_group)
        return tuple(bool(v) for v in tensor.tolist())

    def close(self) -> None:
        """Destroy the default group if `create` made it (stopping DCP's checkpoint process bound to it)."""
        if self._closed:
            return
        self._closed = True
        if self.owns_default_group:
            _shutdown_checkpoint_process()
            dist.destroy_process_group()


def _shutdown_checkpoint_process() -> None:
    """Stop DCP's checkpoint process (it is bound to the process group we are about to destroy)."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    process = executor._CHECKPOINT_PROCESS
    if process is not None:
        executor._CHECKPOINT_PROCESS = None
        del process
