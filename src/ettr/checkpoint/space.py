"""Room for the next save on a short disk: delete the oldest checkpoints before a save, not only after.

Retention after a commit cannot help once `keep_last` checkpoints fill the disk: every later save fails
before it commits, so nothing is ever deleted again. Before each save the manager asks `make_room`: the
save's size is estimated from the newest committed checkpoint (its manifest's byte count, plus a margin),
and while the free space of the root is short of that, the oldest committed checkpoint is deleted — never
the newest one that verifies (one good checkpoint always stays), never a leased or protected one.
Storage whose free space cannot be asked (object stores) is left alone.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Iterable

from ettr.checkpoint.base import CheckpointError, CheckpointStorage, ReadableStorage
from ettr.checkpoint.commit import Manifest, is_leased, list_checkpoints, read_manifest_bytes, verify

logger = logging.getLogger("ettr")

MARGIN = 1.10
"""The estimate of a save's size is the previous one's times this (metadata, small growth)."""

FreeBytes = Callable[[CheckpointStorage], int | None]


def local_free_bytes(storage: ReadableStorage) -> int | None:
    """Free bytes on the file system of a local root (None: not a local root, or unknown)."""
    root = getattr(storage, "root", None)
    if not isinstance(root, str):
        return None
    try:
        return shutil.disk_usage(root).free
    except OSError:
        return None


def estimate_save_bytes(storage: ReadableStorage) -> int | None:
    """The expected size of the next save: the newest committed checkpoint's, with a margin."""
    for ckpt in reversed(list_checkpoints(storage)):
        if not ckpt.has_manifest:
            continue
        try:
            manifest = Manifest.from_json(read_manifest_bytes(storage, ckpt.name))
        except (OSError, CheckpointError):
            continue
        return int(manifest.num_bytes * MARGIN)
    return None


def out_of_space_hint(
    storage: CheckpointStorage, description: str, free_bytes: FreeBytes | None = None
) -> str:
    """What to add to a failed save's description that names no errno when the disk is what failed it:
    a write cut short on a full disk can surface as a torch error with no OSError under it (torch's zip
    writer: `unexpected pos 704 vs 598`). Says the free space when it is short of a checkpoint's size;
    "" otherwise (the cause then stays as it was said, never guessed)."""
    if "ENOSPC" in description or "EDQUOT" in description:
        return ""
    free = (free_bytes or local_free_bytes)(storage)
    needed = estimate_save_bytes(storage)
    if free is None or needed is None or free >= needed:
        return ""
    return f" (the disk of {storage.url} has {free} bytes free, a checkpoint needs ~{needed}: out of space?)"


def make_room(
    storage: CheckpointStorage,
    *,
    protected_steps: Iterable[int] = (),
    lease_ttl_s: float = 3600.0,
    free_bytes: FreeBytes = local_free_bytes,
) -> list[str]:
    """Delete the oldest committed checkpoints while the free space is short of the next save's
    estimated size, keeping the newest one that verifies. Returns the names deleted."""
    free = free_bytes(storage)
    if free is None:
        return []  # an object store: nothing to ask, nothing read
    needed = estimate_save_bytes(storage)
    if needed is None or free >= needed:
        return []
    protected = set(protected_steps)
    committed = [c for c in list_checkpoints(storage) if c.has_manifest]
    newest_good = None
    for ckpt in reversed(committed):
        try:
            verify(storage, ckpt.name, checksums=False)
        except (OSError, CheckpointError):
            continue
        newest_good = ckpt.step
        break
    removed: list[str] = []
    for ckpt in committed:
        if free >= needed or newest_good is None or ckpt.step >= newest_good:
            break
        if ckpt.step in protected or is_leased(storage, ckpt.name, ttl_s=lease_ttl_s):
            continue
        try:
            storage.remove_tree(ckpt.name)
        except OSError as exc:
            logger.warning("ettr: cannot delete checkpoint %s to make room (%s)", ckpt.name, exc)
            continue
        removed.append(ckpt.name)
        free = free_bytes(storage) or 0
    if removed:
        logger.warning(
            "ettr: the disk of %s is short of the next save (~%d bytes): deleted %s first",
            storage.url,
            needed,
            ", ".join(removed),
        )
    return removed
