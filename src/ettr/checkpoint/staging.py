"""Staging: the copy of the training state that a save makes before the state may change again.

`ReusedStager` copies every plain tensor of a state dict into a buffer of its own that is allocated on the
first save and reused by every later one — so a save costs one memory copy and no allocation or page
faults. It copies with `Tensor.copy_`, which spreads a large copy over the intra-op threads (DCP's
`DefaultStager` copies untyped storages, measured 1.1-1.8x slower here). Buffers are pinned memory where
the state lives on a GPU, and shared memory for the process persist mode (the checkpoint process maps them
instead of receiving a copy). A ShardedTensor (TorchRec's sharded tables and their optimizer state) is
staged the same way, shard by shard, into a ShardedTensor over the buffers with the same global metadata
(placements on the CPU; no collective) — DCP's stager cannot copy one (`data_ptr` is not supported for
ShardedTensor). Anything else — DTensor, Python objects holding tensors — goes through DCP's own
`StateDictStager`, which caches its buffers the same way. It implements DCP's
`AsyncStager` protocol, so `dcp.async_save` accepts it.

With `background_keys`, `stage` copies the other top-level entries at once and the named ones (the model
and optimizer tensors) in a background thread, returning a Future: the training loop runs its next
forward and backward meanwhile and must wait for the Future before anything changes those tensors (the
checkpoint manager does, in an optimizer step pre-hook). On a GPU the background copies run on a staging
stream that first waits for the work queued before the save.

The caller must not stage again before the persist of the previous copy has finished (the manager waits).

`lend` makes a memory copy's staging slot (`snapshot.Slot`: tensors over a shared-memory snapshot file) the
buffers of the next copy, so that the staged copy is already the memory copy's payload and no second copy
of the state is made after the commit (`memory.MemoryCopies`). Not with pinned or process-mode buffers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
from collections.abc import Collection, Mapping
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager

from ettr import torch_compat
from ettr.checkpoint import direct_io, prefault
from ettr.checkpoint.checksums import buffer_key

_IMMUTABLE = (int, float, bool, str, bytes, type(None), complex)


class ReusedStager(AsyncStager):
    """Copies state dicts into buffers allocated once (see the module docstring).

    Args:
        pin_memory: allocate page-locked buffers (for state on a GPU).
        share_memory: allocate buffers in shared memory (for the process persist mode).
        background_keys: top-level keys copied in a background thread (`stage` then returns a Future).
    """

    _synchronize_after_execute = False  # the copy is complete when `stage` (or its Future) returns

    def __init__(
        self, *, pin_memory: bool = False, share_memory: bool = False, background_keys: Collection[str] = ()
    ) -> None:
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.share_memory = share_memory
        self.background_keys = frozenset(background_keys)
        self._buffers: dict[str, torch.Tensor] = {}
        self._lent: set[str] = set()
        """Keys whose buffer is a view of a memory copy's staging slot (`lend`)."""
        self._fallback = torch_compat.state_dict_stager_class()(
            pin_memory=self.pin_memory, share_memory=share_memory
        )
        self._executor: ThreadPoolExecutor | None = None
        self._stream: Any = None
        self._preparing: Future[int] | None = None
        """`allocate` running in the background (`prepare`): `stage` waits for it."""
        self.last_staged: dict[str, Any] | None = None
        """The last complete copy (its tensors are the reused buffers: valid until the next `stage` or `lend`)."""

    @property
    def num_bytes(self) -> int:
        """Bytes held in staging buffers (the plain-tensor part)."""
        return sum(buffer.numel() * buffer.element_size() for buffer in self._buffers.values())

    def buffer_keys(self) -> frozenset[tuple[int, int]]:
        """(address, bytes) of every staging buffer (what `checksums.Sums.expect` takes)."""
        keys = (buffer_key(buffer) for buffer in self._buffers.values())
        return frozenset(key for key in keys if key is not None)

    def lend(self, views: Mapping[tuple[int, int], torch.Tensor]) -> int:
        """Use `views` (by the `buffer_key` of the buffer each replaces) as the staging buffers from the next
        `stage` on; every buffer lent before and not lent again is let go (the next copy allocates it): a
        view of a slot that became the committed memory copy must never be written again. Returns how many
        buffers are lent. Pinned and shared-memory stagers lend nothing."""
        if self.pin_memory or self.share_memory:
            views = {}
        lent: set[str] = set()
        for key, buffer in list(self._buffers.items()):
            found = buffer_key(buffer)
            view = views.get(found) if found is not None else None
            if view is not None and view.shape == buffer.shape and view.dtype == buffer.dtype:
                self._buffers[key] = view
                lent.add(key)
            elif key in self._lent:
                del self._buffers[key]
        self._lent = lent
        # The buffers replaced here (the first save's private ones) are freed now, on the persist's thread:
        # the last copy still held them, and the next `stage` let go of it (an unmap of the whole state
        # in the next save's blocking part). The manager reads the last copy before it lends.
        self.last_staged = None
        return len(lent)

    def allocate(self, state_dict: dict[str, Any]) -> int:
        """Allocate the buffers `stage` will copy `state_dict` into and fault their pages in (`prefault`:
        nothing written), so that the first copy runs as fast as a later one, which reuses them. Reads the
        tensors' shapes and dtypes only (any thread: `prepare` runs it in the background). Returns the bytes
        faulted in."""
        return sum(self._allocate(v, k) for k, v in state_dict.items())

    def _allocate(self, value: Any, key: str) -> int:
        # the keys and buffers `_stage` uses for the same values
        if isinstance(value, dict):
            return sum(self._allocate(v, f"{key}.{k}") for k, v in value.items())
        if isinstance(value, list) or type(value) is tuple:
            return sum(self._allocate(v, f"{key}.{i}") for i, v in enumerate(value))
        if type(value) in (torch.Tensor, torch.nn.Parameter) and value.layout is torch.strided:
            return _fault_in(self._buffer_for(key, value))
        if type(value).__name__ == "ShardedTensor" and _is_sharded_tensor(value):
            shards = value.local_shards()
            return sum(_fault_in(self._buffer_for(f"{key}#shard{i}", s.tensor)) for i, s in enumerate(shards))
        return 0

    def prepare(self, state_dict: dict[str, Any], executor: Executor) -> None:
        """`allocate` on `executor` (a background thread); the next `stage` waits for it first."""
        self._preparing = executor.submit(self.allocate, state_dict)

    def _wait_prepared(self) -> None:
        preparing, self._preparing = self._preparing, None
        if preparing is not None:
            with contextlib.suppress(Exception):  # the copy allocates what is missing, as without it
                preparing.result()

    def stage(self, state_dict: dict[str, Any], **kwargs: Any) -> dict[str, Any] | Future[dict[str, Any]]:
        """A copy of `state_dict` whose tensors live in the reused buffers.

        Without `background_keys` the copy is complete on return; with them, a Future of the whole copy.
        """
        self._wait_prepared()
        later = {k: v for k, v in state_dict.items() if k in self.background_keys}
        now_cuda: list[bool] = [False]
        staged = {
            k: self._stage(v, k, now_cuda) for k, v in state_dict.items() if k not in self.background_keys
        }
        if now_cuda[0]:
            torch.cuda.synchronize()  # the non-blocking device-to-host copies are done after this
        self.last_staged = None
        if not later:
            self.last_staged = staged
            return staged
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ettr-ckpt-stage")
        queued = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            queued = torch.cuda.Event()
            queued.record()  # the state as of the work queued so far (the optimizer step just done)
        return self._executor.submit(self._stage_later, staged, later, queued)

    def _stage_later(self, staged: dict[str, Any], later: dict[str, Any], queued: Any) -> dict[str, Any]:
        if queued is None:
            staged.update({k: self._stage(v, k, [False]) for k, v in later.items()})
        else:
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(queued)
                staged.update({k: self._stage(v, k, [False]) for k, v in later.items()})
            self._stream.synchronize()
        self.last_staged = staged
        return staged

    def _buffer_for(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = _empty_buffer(tensor, pin_memory=self.pin_memory, share_memory=self.share_memory)
            self._buffers[key] = buffer
        return buffer

    def _stage(self, value: Any, key: str, used_cuda: list[bool]) -> Any:
        if isinstance(value, dict):
            return {k: self._stage(v, f"{key}.{k}", used_cuda) for k, v in value.items()}
        if isinstance(value, list):
            return [self._stage(v, f"{key}.{i}", used_cuda) for i, v in enumerate(value)]
        if type(value) is tuple:
            return tuple(self._stage(v, f"{key}.{i}", used_cuda) for i, v in enumerate(value))
        if type(value) in (torch.Tensor, torch.nn.Parameter) and value.layout is torch.strided:
            buffer = self._buffer_for(key, value)
            used_cuda[0] |= value.is_cuda
            buffer.copy_(value.detach(), non_blocking=value.is_cuda and self.pin_memory)
            return buffer
        if isinstance(value, _IMMUTABLE):
            return value
        if type(value).__name__ == "ShardedTensor" and _is_sharded_tensor(value):
            return self._stage_sharded(value, key, used_cuda)
        # DTensor, other objects: DCP's deep copy with its own cached buffers
        return self._fallback.stage(value)

    def _stage_sharded(self, value: Any, key: str, used_cuda: list[bool]) -> Any:
        """A ShardedTensor whose local shards are copies in the reused buffers (same global metadata, every
        placement on the CPU where the buffers are)."""
        from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

        shards = []
        for i, shard in enumerate(value.local_shards()):
            tensor = shard.tensor
            buffer = self._buffer_for(f"{key}#shard{i}", tensor)
            used_cuda[0] |= tensor.is_cuda
            buffer.copy_(tensor.detach(), non_blocking=tensor.is_cuda and self.pin_memory)
            shards.append(Shard(tensor=buffer, metadata=_on_cpu(shard.metadata)))
        metadata = value.metadata()
        metadata = dataclasses.replace(
            metadata,
            shards_metadata=[_on_cpu(m) for m in metadata.shards_metadata],
            tensor_properties=dataclasses.replace(
                metadata.tensor_properties,
                requires_grad=False,
                pin_memory=self.pin_memory,
                memory_format=torch.contiguous_format,
            ),
        )
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, metadata, process_group=value._process_group
        )

    def synchronize_staging(self) -> None:
        """Nothing to do: the caller waits for `stage`'s Future (DCP's AsyncStager protocol)."""

    def close(self) -> None:
        """Stop the staging thread and release the buffers."""
        self._wait_prepared()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self.last_staged = None
        self._buffers.clear()
        self._lent.clear()
        self._fallback.close()


def _empty_buffer(tensor: torch.Tensor, *, pin_memory: bool, share_memory: bool) -> torch.Tensor:
    """An empty CPU tensor like `tensor`; one of `direct_io.MIN_BYTES` or more starts on a page
    (`direct_io.ALIGN`), so that the persist can write it past the page cache: its own anonymous mapping,
    exactly its size (a view into a larger storage would make DCP's own writer clone it). Pinned memory is
    page-aligned already; shared-memory buffers (process mode) are torch's."""
    nbytes = tensor.numel() * tensor.element_size()
    if pin_memory or share_memory or nbytes < direct_io.MIN_BYTES:
        buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin_memory)
        return buffer.share_memory_() if share_memory else buffer
    pages = mmap.mmap(-1, nbytes)  # held by the tensor (frombuffer keeps its buffer alive)
    return torch.frombuffer(pages, dtype=tensor.dtype, count=tensor.numel()).view(tensor.shape)


def _fault_in(buffer: torch.Tensor) -> int:
    """Fault a staging buffer's pages in (one that starts on a page; a small one is left to the copy)."""
    nbytes = buffer.numel() * buffer.element_size()
    return (
        nbytes if nbytes >= direct_io.MIN_BYTES and prefault.populate(int(buffer.data_ptr()), nbytes) else 0
    )


def _is_sharded_tensor(value: Any) -> bool:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(value, ShardedTensor)


def _on_cpu(metadata: Any) -> Any:
    """A ShardMetadata like `metadata` with its placement on the same rank's CPU."""
    rank = metadata.placement.rank() if metadata.placement is not None else 0
    return dataclasses.replace(metadata, placement=f"rank:{rank}/cpu")
