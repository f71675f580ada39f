"""Process-group coordination of checkpointing: which ranks take part, and how they agree.

A `Coordinator` is made once per process, explicitly, before the checkpoint manager: `Coordinator.create`
is collective (every rank calls it: it makes the checkpoint's own gloo groups, so that a background persist
never shares a communicator with training collectives) and, for the process persist mode in a process
without torch.distributed, makes the single-rank default group DCP's checkpoint process needs.
`Coordinator.single()` is a lone process that coordinates with nobody. The manager then only calls the
three collectives below (`barrier`, `broadcast_from_0`, `agree`), each a no-op for a single rank, and agrees
the step loop's decisions through a `StepAgreement` (asynchronous: no step waits for it).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ettr import torch_compat
from ettr.checkpoint.base import PersistMode
from ettr.run_env import group_form_timeout_s


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
        group = process_group if process_group is not None else _gloo_group()
        control = _gloo_group() if world_size > 1 else None
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

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's `value` (picklable), in rank order (a list of one for one rank)."""
        if self.process_group is None or self.world_size <= 1:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.process_group)
        return gathered

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


class StepAgreement:
    """The save and preempt decisions of the step loop, agreed across ranks without making a step wait.

    A blocking all-reduce at every step boundary is one more point per step where each rank sleeps and must
    be woken: nothing on a quiet node, but on a busy one each wake-up waits for a core (measured here under
    CPU-bound load: the demo's steps 2-3x slower than the same steps without it). Instead the flags go out
    in an asynchronous all-reduce at an exchange step and are acted on at the next exchange step, when the
    reduction has long completed; exchanges are `gap` step boundaries apart, a gap every rank learns from
    the previous reduction (the smallest any rank proposed: about `period_s` of its own steps), so every rank
    exchanges, and acts, at the same step boundaries. A decision is acted on within two gaps of it being
    taken (~2 x `period_s`, at least a step): a preemption's save comes that much later than the signal.

        if agreement.due():                   # every rank: the same boundaries
            save, preempt = agreement.take()  # what was proposed at the previous exchange, by any rank
            ...act on it...
            agreement.propose(save_now, preempt_requested, step_s=...)
    """

    def __init__(self, coordinator: Coordinator, *, period_s: float = 0.25, max_gap: int = 64) -> None:
        self._group = coordinator.control_group
        self.period_s = period_s
        self.max_gap = max_gap
        self._countdown = 1  # the first exchange is at the first step boundary
        self._gap = 1
        self._pending: tuple[Any, torch.Tensor] | None = None

    @property
    def collective(self) -> bool:
        """Whether there are other ranks to agree with (alone: decide at once, without it)."""
        return self._group is not None

    def due(self) -> bool:
        """Count one step boundary; True at an exchange (the same boundaries on every rank)."""
        self._countdown -= 1
        return self._countdown <= 0

    def take(self) -> tuple[bool, bool]:
        """The flags proposed at the previous exchange, each true if any rank proposed it (False, False at
        the first exchange). Waits for that reduction (normally long complete); raises what the group raises."""
        save, preempt, _ = self.take_all()
        return save, preempt

    def take_all(self) -> tuple[bool, bool, bool]:
        """`take`, and the third flag: a memory-tier save (`propose(memory=)`)."""
        if self._pending is None:
            return False, False, False
        work, tensor = self._pending
        self._pending = None
        work.wait()
        save, preempt, negative_gap, memory = (int(v) for v in tensor.tolist())
        self._gap = max(1, min(self.max_gap, -negative_gap))
        return bool(save), bool(preempt), bool(memory)

    def propose(self, save: bool, preempt: bool, *, step_s: float | None, memory: bool = False) -> None:
        """Send this rank's flags, and its gap (`period_s` of steps of `step_s`), for the next exchange;
        `memory`: a memory-tier save (`ettr.checkpoint.memory_tier`)."""
        if self._group is None:
            raise RuntimeError("StepAgreement.propose with no other rank to agree with")
        self._countdown = self._gap
        gap = 1 if not step_s or step_s <= 0 else int(self.period_s / step_s)  # unknown: again next step
        flags = [int(save), int(preempt), -max(1, min(self.max_gap, gap)), int(memory)]
        tensor = torch.tensor(flags, dtype=torch.int64)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._pending = (work, tensor)

    def drain(self) -> None:
        """Wait for the reduction in flight, if any (every rank posted it: it completes). Never raises."""
        if self._pending is None:
            return
        work, _ = self._pending
        self._pending = None
        try:
            work.wait()
        except Exception:  # a peer gone: its group fails; nothing to agree on any more
            pass


def _shutdown_checkpoint_process() -> None:
    """Stop DCP's checkpoint process (it is bound to the process group we are about to destroy)."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    process = executor._CHECKPOINT_PROCESS
    if process is not None:
        executor._CHECKPOINT_PROCESS = None
        del process


def _gloo_group() -> dist.ProcessGroup:
    """A new gloo group of all ranks (collective). Inside a generation of `ettr.resilient` it forms under the
    generation's rendezvous bound (`run_env.group_form_timeout_s`), then runs its collectives under the
    default group's timeout: a peer killed while the group forms leaves this rank waiting that bound, then
    failing into the next recovery, not gloo's default 30 minutes (a survivor of in-place SIGKILL trials sat
    in this `new_group` until its harness killed it). Elsewhere: torch's default, as before."""
    form_s = group_form_timeout_s()
    if form_s is None:  # a generation of `ettr.resilient` forms its groups over a store of its own
        _forget_earlier_launch()
    collective_s = torch_compat.group_timeout_s() if form_s is not None else None
    if form_s is None or collective_s is None or form_s >= collective_s:
        timeout = None if collective_s is None else datetime.timedelta(seconds=collective_s)
        return dist.new_group(backend="gloo", timeout=timeout)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=form_s))
    # Where torch cannot set it, neither could the wrapper: the default group then kept its forming bound
    # too, and the branch above was taken.
    torch_compat.set_group_timeout(collective_s, group)
    return group


def _forget_earlier_launch(environ: Mapping[str, str] = os.environ) -> None:
    """Before the next gloo group forms under torchrun's agent store (`TORCHELASTIC_USE_AGENT_STORE=True`):
    each rank deletes its own key of that group's rendezvous, then waits on the default group until every
    rank has. The agent keeps one store for the whole job, and a group's keys are named by its name alone:
    a restarted launch found the previous launch's keys, and a rank that read its peer's old address before
    the peer wrote its new one connected to a dead port (`Gloo connectFullMesh failed ... Connection
    refused`) or waited for a connection that never came (docs/inplace.md). No rank of this launch writes
    its key before all have deleted theirs, so only an earlier launch's key is ever deleted. (The barrier is
    the default group's, formed in this launch: a store barrier would need a launch number every rank
    agrees on, and torchrun's agents count their restarts each for itself.) Collective; a no-op elsewhere."""
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not dist.is_initialized():
        return
    name = torch_compat.next_group_name()
    if name is None:
        return
    store = torch_compat.default_store()
    for key in torch_compat.gloo_rendezvous_keys(name, dist.get_rank()):
        store.delete_key(key)
    dist.barrier()
