"""The publish anchor made from a committed checkpoint of the same step: hard links, nothing written twice.

At the end of training the job's final checkpoint (its `CheckpointManager`'s commit of step N) already holds
every byte of the model that the anchor of step N would hold. `link_anchor` makes the anchor from it:

1. rank 0 verifies the checkpoint (sizes, the CRC-32 of DCP's `.metadata`) and admits it as a restore would
   (its signature and root: `Admission` with the manager's own settings), holds a lease on it, and
   hard-links its data files into the anchor's `step_<N>/` (same names); its `.metadata` (never linked) is
   read within the manifest's size and CRC-32 and unpickled on every rank only from the exact allow-list
   (`trust.load_metadata_bytes`, what `trust.VerifiedReader` uses);
2. every rank plans the anchor as DCP's save would (`DefaultSavePlanner` over `{"model": plain state}`:
   the anchor's keys, its sharded tables' chunks with their global offsets), finds for each of its items
   the checkpoint's record of the *same live tensor* (the manager's state dict planned the same way,
   matched by memory: device, dtype, shape, stride and address; the checkpoint's keys — TorchRec's
   per-rank layout, `extra.*`, the optimizer's — never need to be spelled), reads that record back from
   the anchor's linked file (a raw record as `raw.read_record` does, a `torch.save` record with
   `weights_only=True`) and compares its bytes with the live tensor's: equal or no anchor;
3. rank 0 makes DCP's global plan and metadata from every rank's plan (as `dcp.save` would: replicated
   tensors once, every shard a chunk), points each item at the record found (file, offset, length, raw
   mark), writes that `.metadata` and the sample, removes links nothing points at, and commits with the
   checkpoint package's protocol: the manifest (each linked file's size and CRC-32 as the checkpoint's
   manifest has them, written last) signed for the anchor's root.

Anything that does not hold — another file system (EXDEV), an fsspec root on either side, a checkpoint that
does not verify or is not admitted, an item without a record, a record whose bytes differ (the state
changed after the save), a non-tensor entry, a plan DCP refuses — leaves the anchor directory removed and
returns the reason: the caller writes the anchor as before. A hard link is the same file: the checkpoint's
retention removes its name, not the anchor's bytes.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ettr.checkpoint.base import CommittedCheckpoint

logger = logging.getLogger("ettr")


@dataclass(frozen=True)
class LinkOutcome:
    """What `link_anchor` did (the same on every rank)."""

    linked: bool
    reason: str = ""
    """Why the anchor was not made from the checkpoint ("" when it was)."""
    num_files: int = 0
    """Data files of the checkpoint the anchor links."""
    num_tensors: int = 0
    """Tensor items compared, over all ranks."""
    num_bytes: int = 0
    """Bytes of those items compared, over all ranks."""


class _NotLinked(Exception):
    """Why the anchor cannot be made from the checkpoint (the message says)."""


def _identity(tensor: torch.Tensor) -> tuple[Any, ...]:
    return (str(tensor.device), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.data_ptr())


def _same_bytes(live: torch.Tensor, stored: torch.Tensor) -> bool:
    """Whether the two tensors hold the same bytes (not values: -0.0 is not 0.0, a NaN equals itself)."""
    import numpy as np

    if live.dtype != stored.dtype or tuple(live.shape) != tuple(stored.shape):
        return False
    a = live.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    b = stored.contiguous().reshape(-1).view(torch.uint8).numpy()
    return bool(np.array_equal(a, b))  # a vectorised compare: 7x torch.equal's speed on bytes here


def _read_item(stream: Any, index: Any, info: Any, metadata: Any) -> torch.Tensor:
    """The checkpoint's record of `index` from its data file (`stream`): nothing unpickled but with
    `weights_only=True`."""
    from ettr.checkpoint import raw
    from ettr.checkpoint.trust import load_pickled

    if raw.is_raw(info):
        return raw.read_record(stream, index, metadata)
    stream.seek(info.offset)
    data = stream.read(info.length)
    if len(data) != info.length:
        raise _NotLinked(f"{index.fqn}: its data file ends inside its record")
    loaded = load_pickled(io.BytesIO(data))
    if not isinstance(loaded, torch.Tensor):
        raise _NotLinked(f"{index.fqn}: its record holds a {type(loaded).__name__}, not a tensor")
    return loaded


def _candidates(source: CommittedCheckpoint, rank: int) -> dict[tuple[Any, ...], list[Any]]:
    """The checkpoint's storage indices of each live tensor it saved, by the tensor's identity."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    planner = DefaultSavePlanner()
    planner.set_up_planner(source.state_dict(), is_coordinator=rank == 0)
    found: dict[tuple[Any, ...], list[Any]] = defaultdict(list)
    for item in planner.create_local_plan().items:
        if item.type == WriteItemType.BYTE_IO:
            continue
        data = planner.resolve_data(item)
        if isinstance(data, torch.Tensor):
            found[_identity(data)].append(item.index)
    return found


def _local_part(
    state: dict[str, Any], *, source: CommittedCheckpoint, storage: Any, name: str, metadata: Any, rank: int
) -> tuple[Any, dict[Any, Any], int, int]:
    """This rank's anchor plan and, for each of its items, the checkpoint record proven equal to it.
    Returns (plan, {anchor index: storage info}, tensors compared, bytes compared). Raises _NotLinked."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType

    from ettr.publish.anchor import ANCHOR_STATE_KEY

    candidates = _candidates(source, rank)  # first: the state dict may be collective (every rank gets here)
    planner = DefaultSavePlanner()
    planner.set_up_planner({ANCHOR_STATE_KEY: state}, is_coordinator=rank == 0)
    plan = planner.create_local_plan()
    storage_data = metadata.storage_data
    wanted: dict[str, list[tuple[Any, torch.Tensor, list[Any]]]] = defaultdict(list)
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO:
            raise _NotLinked(f"{item.index.fqn} is not a tensor")
        live = planner.resolve_data(item)
        if not isinstance(live, torch.Tensor):
            raise _NotLinked(f"{item.index.fqn} is not a tensor")
        found = [i for i in candidates.get(_identity(live), ()) if i in storage_data]
        if not found:
            raise _NotLinked(f"{item.index.fqn}: the checkpoint holds no record of this tensor")
        wanted[storage_data[found[0]].relative_path].append((item.index, live, found))
    mapping: dict[Any, Any] = {}
    num_bytes = 0
    for file_name, items in wanted.items():
        with storage.open_read(f"{name}/{file_name}") as stream:
            for index, live, found in items:
                for ckpt_index in found:  # the first record whose bytes are the live tensor's
                    info = storage_data[ckpt_index]
                    if info.relative_path != file_name:
                        continue
                    if _same_bytes(live, _read_item(stream, ckpt_index, info, metadata)):
                        mapping[index] = _StorageInfo(
                            info.relative_path,
                            info.offset,
                            info.length,
                            transform_descriptors=info.transform_descriptors,
                        )
                        num_bytes += live.numel() * live.element_size()
                        break
                else:
                    raise _NotLinked(
                        f"{index.fqn} differs from the checkpoint's record {found[0].fqn} "
                        "(the state changed after the save?)"
                    )
    return plan, mapping, len(mapping), num_bytes


def _agree(value: list[Any], *, distributed: bool, world_size: int) -> list[Any]:
    if distributed and world_size > 1:
        dist.broadcast_object_list(value, src=0)
    return value


def link_anchor(
    state: dict[str, Any],
    *,
    step: int,
    storage: Any,
    source: CommittedCheckpoint,
    sample: bytes | None,
    extra: dict[str, Any],
    ring: Any,
    job_id: str | None,
) -> LinkOutcome:
    """Make the anchor of `step` in `storage` (its directory empty or absent) from `source`, the committed
    checkpoint of the same step (collective when torch.distributed is initialised; see the module
    docstring). `state` is this rank's plain-keyed model state (what `write_anchor` would save); `ring` the
    key ring rank 0 signs with. Returns LinkOutcome: linked, or why not (then the anchor directory is
    removed and the caller writes the anchor)."""
    from ettr.checkpoint.admission import Admission
    from ettr.checkpoint.base import MANIFEST_NAME, step_dir_name
    from ettr.checkpoint.checksums import crc32
    from ettr.checkpoint.commit import LEASE_PREFIX, lease, read_at_most, root_identity, verify
    from ettr.checkpoint.storage import LocalStorage
    from ettr.checkpoint.trust import METADATA_NAME, load_metadata_bytes

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world_size = dist.get_world_size() if distributed else 1
    name = step_dir_name(step)
    src = source.storage
    src_name = source.name
    created = False
    with contextlib.ExitStack() as stack:
        # 1. rank 0: verify and admit the checkpoint, link its data files, hand its metadata round.
        opening: list[Any] = ["", b"", {}, {}]
        if rank == 0:
            try:
                if source.step != step:
                    raise _NotLinked(f"the checkpoint is of step {source.step}, the anchor of step {step}")
                if not isinstance(src, LocalStorage) or not isinstance(storage, LocalStorage):
                    raise _NotLinked("an fsspec root (no hard links)")
                if os.path.realpath(src.path(src_name)) == os.path.realpath(storage.path(name)):
                    raise _NotLinked("the anchor root is the checkpoint root (keep them apart)")
                admit = Admission(
                    ring=ring,
                    root=root_identity(src.url),
                    allow_unsigned=source.allow_unsigned,
                    resume_foreign=source.resume_foreign,
                )
                stack.enter_context(lease(src, src_name))
                manifest = verify(src, src_name, checksums=False, admit=admit)
                entry = manifest.files.get(METADATA_NAME)
                if entry is None:
                    raise _NotLinked(f"the checkpoint lists no {METADATA_NAME}")
                # read as `trust.VerifiedReader` reads it: no more than the manifest says, then its CRC-32;
                # every rank unpickles it from the exact allow-list (`load_metadata_bytes`) below
                metadata_bytes = read_at_most(src, f"{src_name}/{METADATA_NAME}", entry.size)
                if len(metadata_bytes) != entry.size or crc32(metadata_bytes) != entry.crc32:
                    raise _NotLinked(f"{METADATA_NAME} does not match its manifest entry")
                data_files = {
                    f: e
                    for f, e in manifest.files.items()
                    if f not in (METADATA_NAME, MANIFEST_NAME) and not f.startswith(LEASE_PREFIX)
                }
                if storage.list_dir(name):
                    storage.remove_tree(name)
                created = True  # from here on the anchor directory is ours to remove
                for file_name in sorted(data_files):
                    storage.link_from(src, f"{src_name}/{file_name}", f"{name}/{file_name}")
                opening = [
                    "",
                    metadata_bytes,
                    {f: e.size for f, e in manifest.files.items()},
                    {f: (e.size, e.crc32) for f, e in data_files.items()},
                ]
            except Exception as exc:  # noqa: BLE001 - every rank must reach the broadcast below
                opening = [_why(exc), b"", {}, {}]
        reason, metadata_bytes, files, sums = _agree(opening, distributed=distributed, world_size=world_size)
        if reason:
            return _not_linked(
                storage, name, reason, created=created, distributed=distributed, world_size=world_size
            )

        # 2. every rank: plan its part of the anchor and prove each item equal to its checkpoint record.
        try:
            metadata = load_metadata_bytes(metadata_bytes, files)
            part: tuple[Any, ...] = (
                "",
                *_local_part(state, source=source, storage=storage, name=name, metadata=metadata, rank=rank),
            )
        except Exception as exc:  # noqa: BLE001 - any failure is a reason to write the anchor instead
            part = (f"rank {rank}: {_why(exc)}", None, {}, 0, 0)
        if distributed and world_size > 1:
            parts: list[Any] = [None] * world_size
            dist.all_gather_object(parts, part)
        else:
            parts = [part]

        # 3. rank 0: the anchor's metadata (DCP's global plan), the sample, the commit.
        closing: list[Any] = [next((p[0] for p in parts if p[0]), ""), 0]
        if rank == 0 and not closing[0]:
            try:
                made_from = {"checkpoint": src.path(src_name), "step": source.step}
                num_files = _commit_linked(
                    parts, storage=storage, name=name, step=step, files=files, sums=sums, sample=sample,
                    extra={**extra, "made_from": made_from}, ring=ring, job_id=job_id, world_size=world_size,
                )  # fmt: skip
                closing = ["", num_files]
            except Exception as exc:  # noqa: BLE001 - the anchor is written instead
                closing = [_why(exc), 0]
        reason, num_files = _agree(closing, distributed=distributed, world_size=world_size)
        if reason:
            return _not_linked(
                storage, name, reason, created=created, distributed=distributed, world_size=world_size
            )
    return LinkOutcome(
        linked=True,
        num_files=num_files,
        num_tensors=sum(p[3] for p in parts),
        num_bytes=sum(p[4] for p in parts),
    )


def _commit_linked(
    parts: list[Any],
    *,
    storage: Any,
    name: str,
    step: int,
    files: dict[str, int],
    sums: dict[str, tuple[int, int]],
    sample: bytes | None,
    extra: dict[str, Any],
    ring: Any,
    job_id: str | None,
    world_size: int,
) -> int:
    """Rank 0's part of `link_anchor` once every rank proved its items: returns the files linked."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from ettr.checkpoint.checksums import crc32
    from ettr.checkpoint.commit import commit, root_identity
    from ettr.checkpoint.trust import METADATA_NAME, check_metadata
    from ettr.publish.sample import SAMPLE_FILE

    global_plans, metadata = DefaultSavePlanner().create_global_plan([p[1] for p in parts])
    storage_data = {}
    for plan, part in zip(global_plans, parts, strict=True):
        for item in plan.items:
            storage_data[item.index] = part[2][item.index]
    try:
        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

        metadata.version = CURRENT_DCP_VERSION
    except ImportError:  # pragma: no cover - older torch: DCP's default
        pass
    metadata.storage_data = storage_data
    used = {info.relative_path for info in storage_data.values()}
    check_metadata(metadata, {f: size for f, size in files.items() if f in used})
    for file_name in set(sums) - used:  # linked, but no item of the anchor is in it
        storage.remove(f"{name}/{file_name}")
    data = pickle.dumps(metadata)
    storage.write_atomic(f"{name}/{METADATA_NAME}", data)
    written = {METADATA_NAME: (len(data), crc32(data))}
    if sample is not None:
        storage.write_atomic(f"{name}/{SAMPLE_FILE}", sample)
        written[SAMPLE_FILE] = (len(sample), crc32(sample))
    commit(
        storage,
        step,
        [*sorted(used), *written],
        world_size=world_size,
        extra={"kind": "publish-anchor", **extra},
        secret=ring.signing,
        job_id=job_id,
        sums={**{f: sums[f] for f in used}, **written},
    )
    if ring.signing is not None:
        ring.register_root(root_identity(storage.url))
    return len(used)


def _why(exc: BaseException) -> str:
    from ettr.checkpoint.base import describe_error

    text = str(exc) if isinstance(exc, _NotLinked) else describe_error(exc)
    return text[:500]


def _not_linked(
    storage: Any, name: str, reason: str, *, created: bool, distributed: bool, world_size: int
) -> LinkOutcome:
    """Remove what linking made (`created`: rank 0, once it began linking) and say why; every rank returns
    once it is gone. Nothing else is removed: an anchor root that is the checkpoint root stays untouched."""
    if created:
        try:
            if storage.list_dir(name):
                storage.remove_tree(name)
        except OSError as exc:  # the write after this replaces it (write_anchor clears an incomplete one)
            logger.warning("ettr: could not remove the partial anchor %s: %s", storage.path(name), exc)
    if not distributed or dist.get_rank() == 0:
        logger.info("ettr: anchor of %s written, not linked from the checkpoint: %s", name, reason)
    if distributed and world_size > 1:
        dist.barrier()
    return LinkOutcome(linked=False, reason=reason)
