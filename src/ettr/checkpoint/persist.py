"""Async persist: the staged copy of a save, and the background write of it (a thread or DCP's process).

`AsyncPersister.launch` copies a state dict into the reused staging buffers (`staging.ReusedStager`) and
starts the persist, returning its future; the copy of the model and optimizer tensors may still be running
(`pending_staging`), and the staging hooks (`install_staging_hooks`) wait for it before the first thing
that changes those tensors. Thread mode is DCP's thread-mode async save composed here, so that the
persist's `dcp.save` is called by ettr (the bootstrap's hooks then leave it to us to record).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torch.distributed.checkpoint.storage import StorageWriter
from torch.utils.hooks import RemovableHandle

from ettr.checkpoint.base import PersistMode
from ettr.checkpoint.checksums import Sums
from ettr.checkpoint.coordination import Coordinator
from ettr.checkpoint.priority import lower_priority, lower_this_thread
from ettr.checkpoint.staging import ReusedStager
from ettr.checkpoint.state import TrainState

OVERLAPPED_KEYS = ("model", "optim")
"""Top-level `TrainState` entries whose copy may overlap the next forward and backward (the optimizer step
pre-hook protects them); the small pickled parts and user `extra` Statefuls are copied at once."""


class AsyncPersister:
    """Stages and persists saves of one process, one at a time (the manager waits for the previous one).

    Args:
        mode: where the persist runs.
        coordinator: the process group DCP writes over.
        overlap: let the copy of `OVERLAPPED_KEYS` run in the background (see `pending_staging`).
        pin_memory: stage into pinned memory (where the state lives on a GPU).
    """

    def __init__(
        self, *, mode: PersistMode, coordinator: Coordinator, overlap: bool, pin_memory: bool
    ) -> None:
        self.mode = mode
        self._coordinator = coordinator
        self.stager = ReusedStager(
            pin_memory=pin_memory,
            share_memory=mode is PersistMode.PROCESS,
            background_keys=OVERLAPPED_KEYS if overlap else (),
        )
        self._staging: tuple[Future[Any], int] | None = None
        # the persist thread (thread mode) runs nicer than training, from its first task on
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="ettr-ckpt-persist", initializer=lower_this_thread
        )
        self._lowered_pids: set[int] = set()

    def launch(self, state_dict: dict[str, Any], writer: StorageWriter, *, step: int) -> Future[Any]:
        """Copy `state_dict` into the reused staging buffers, then start the persist; returns its future.

        The copy of everything but the overlapped keys is complete when this returns (the blocking part).
        """
        coord = self._coordinator
        if self.mode is PersistMode.PROCESS:
            result = dcp.async_save(
                state_dict,
                storage_writer=writer,
                async_stager=self.stager,
                process_group=coord.process_group,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                no_dist=not coord.distributed,
            )
            self._lower_checkpoint_process()
            if isinstance(result, AsyncSaveResponse):  # an overlapped copy: DCP hands it over when done
                self._staging = (result.staging_completion, step)
                return result.upload_completion
            return result
        staged = self.stager.stage(state_dict)
        if isinstance(staged, Future):
            self._staging = (staged, step)
        return self._executor.submit(self._persist, staged, writer)

    def prepare(self, state_dict: dict[str, Any]) -> None:
        """Have the staging buffers of `state_dict` allocated and faulted in on the persist's thread (nicer
        than training), before the first save needs them (`ReusedStager.allocate`)."""
        self.stager.prepare(state_dict, self._executor)

    def _lower_checkpoint_process(self) -> None:
        """DCP's checkpoint process runs nicer than training once it exists (DCP starts it in a thread
        during the first save, so the first persist may still run at training's priority). Its pid comes
        from DCP's module state, which is private: where that changed, the process keeps its priority."""
        try:
            from torch.distributed.checkpoint import _async_process_executor as executor

            pid = executor._CHECKPOINT_PROCESS._save_process.pid  # type: ignore[union-attr]
        except (ImportError, AttributeError):
            return
        if isinstance(pid, int) and pid not in self._lowered_pids:
            self._lowered_pids.add(pid)
            lower_priority(pid, whole_process=True)

    def checkpoint_process_lost(self) -> bool:
        """Process mode: whether DCP's checkpoint process of this rank has died (SIGKILL, the OOM killer).
        DCP keeps the dead one: every later save failed (EPIPE here, the peers' processes' group broken), for
        the rest of the attempt. False in thread mode, before the first save, and where DCP's private module
        state is not as expected."""
        if self.mode is not PersistMode.PROCESS:
            return False
        process = getattr(getattr(_dcp_executor(), "_CHECKPOINT_PROCESS", None), "_save_process", None)
        is_alive = getattr(process, "is_alive", None)
        return callable(is_alive) and not is_alive()

    def restart_checkpoint_process(self) -> None:
        """Let go of DCP's checkpoint process (stopped where it still runs) so that the next save starts a new
        one. Every rank at the same save: DCP makes the new processes' group then, collectively."""
        executor = _dcp_executor()
        if executor is None:  # pragma: no cover - torch without it has no process mode
            return
        process = getattr(executor, "_CHECKPOINT_PROCESS", None)
        executor._CHECKPOINT_PROCESS = None
        save_process = getattr(process, "_save_process", None)
        if save_process is not None and save_process.is_alive():
            save_process.kill()  # its group is broken: a peer's process is gone
        if save_process is not None:
            save_process.join(timeout=30)

    def _persist(self, staged: dict[str, Any] | Future[dict[str, Any]], writer: StorageWriter) -> Any:
        """The background persist of thread mode: DCP writes the staged copy; the writer commits. The
        writer's streams also sum each staged buffer they write whole (the memory copy reuses those)."""
        if isinstance(staged, Future):
            staged = staged.result()
        sums = getattr(writer, "sums", None)
        if isinstance(sums, Sums):
            sums.expect = self.stager.buffer_keys()
        coord = self._coordinator
        return dcp.save(
            staged, storage_writer=writer, process_group=coord.process_group, no_dist=not coord.distributed
        )

    def pending_staging(self) -> tuple[Future[Any], int] | None:
        """The overlapped copy still to wait for (its future and step), handed over once; None if none."""
        pending, self._staging = self._staging, None
        return pending

    def close(self) -> None:
        """Wait for the persist thread and release the staging buffers."""
        self._executor.shutdown(wait=True)
        self.stager.close()


def _dcp_executor() -> Any:
    """DCP's process-mode executor module (its `_CHECKPOINT_PROCESS` is private module state), None in a
    torch without it."""
    try:
        from torch.distributed.checkpoint import _async_process_executor as executor
    except ImportError:  # pragma: no cover
        return None
    return executor


def install_staging_hooks(state: TrainState, wait_staged: Callable[[], None]) -> list[RemovableHandle]:
    """Call `wait_staged` before the first thing that changes the copied tensors: the optimizer's step
    (and, for models with running statistics, the forward). Returns the hooks, for `remove()`."""
    assert state.optimizer is not None, "overlapped staging needs an optimizer step to guard"
    hooks = [state.optimizer.register_step_pre_hook(lambda *args: wait_staged())]
    if _updates_buffers_in_forward(state.model):
        hooks.append(state.model.register_forward_pre_hook(lambda *args: wait_staged()))
    return hooks


def unguarded_changes(state: TrainState) -> str | None:
    """What changes the copied tensors other than the `TrainState` optimizer's step, which the overlapped copy
    is guarded by (then a save copies everything before it returns); None when nothing is seen to. Updates
    inside backward, before that step: TorchRec's fused optimizers (fbgemm's kernels update the tables and
    their state in backward: a `DistributedModelParallel`'s `fused_optimizer`, or one inside the `TrainState`'s
    `CombinedOptimizer`), torch's `_apply_optimizer_in_backward`, per-parameter hooks after gradient
    accumulation (the optimizer-in-backward recipe of PyTorch's tutorials); and trainable parameters that
    the optimizer does not hold (another optimizer steps them: a GAN's discriminator in the same model)."""
    fused = getattr(state.model, "fused_optimizer", None)
    with contextlib.suppress(Exception):  # a model's own `fused_optimizer` of another kind: not TorchRec's
        if fused is not None and len(getattr(fused, "params", {})) > 0:
            return "its model's fused optimizer (TorchRec) updates the tables in backward"
    pending = [state.optimizer]
    while pending:
        optimizer = pending.pop()
        if optimizer is None:
            continue
        if any(cls.__name__ == "FusedOptimizer" for cls in type(optimizer).__mro__):
            return f"its optimizer includes {type(optimizer).__name__}, which updates in backward"
        pending.extend(inner for _, inner in getattr(optimizer, "optimizers", None) or ())
    for name, param in state.model.named_parameters():
        if getattr(param, "_in_backward_optimizers", None):
            return f"parameter {name} has an optimizer applied in backward"
        if getattr(param, "_post_accumulate_grad_hooks", None):
            return (
                f"parameter {name} has a hook after its gradient is accumulated (an optimizer in backward?)"
            )
    held = {id(p) for group in getattr(state.optimizer, "param_groups", ()) for p in group.get("params", ())}
    for name, param in state.model.named_parameters():
        if param.requires_grad and id(param) not in held:
            return f"parameter {name} is trainable and not in the optimizer (another optimizer's step is unguarded)"
    return None


def _updates_buffers_in_forward(model: torch.nn.Module) -> bool:
    """Whether a forward pass changes the model's buffers: batch norm's running statistics, spectral norm's
    power iteration (its `u`/`v` vectors, in either of torch's two APIs). A buffer a model's own forward
    changes otherwise (an EMA codebook) is not seen: docs/checkpointing.md says to call `wait_staged()`."""
    from torch.nn.modules.batchnorm import _NormBase

    for module in model.modules():
        if isinstance(module, _NormBase) and module.track_running_stats:
            return True
        if any(type(hook).__name__ == "SpectralNorm" for hook in module._forward_pre_hooks.values()):
            return True
        parametrizations = getattr(module, "parametrizations", None)
        if isinstance(parametrizations, torch.nn.ModuleDict) and any(
            type(p).__name__ == "_SpectralNorm" for p in parametrizations.modules()
        ):
            return True
    return False
