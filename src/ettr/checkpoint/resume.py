"""The choice of the checkpoint to resume from: the newest that verifies, and the clean-up of what cannot be.

Pure over storage (no torch.distributed, no process group): the manager runs `choose_checkpoint` on rank 0
and broadcasts the result. Newer directories that do not verify are dealt with on the way: an incomplete
one (no manifest: a crash mid-persist) is deleted, a corrupt one (a manifest that does not verify) is moved
aside for inspection; each is recorded as a `checkpoint_skipped` mark naming it and the reason. An intact
one the job's `admission.Admission` refuses (unsigned in a signed root, a key the ring lacks, another
root's) is left where it is, with a `checkpoint_refused` mark and a warning saying how to ask for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ettr.checkpoint.base import CheckpointStorage, describe_error, step_dir_name
from ettr.checkpoint.commit import Manifest, find_latest, list_checkpoints, quarantine
from ettr.recorder import EventSink

logger = logging.getLogger("ettr")


@dataclass(frozen=True, kw_only=True)
class ResumeChoice:
    """What to resume from, and what is left in the root after the clean-up."""

    step: int | None
    """The step to load (None: nothing usable; with an exact step asked for, that step did not verify)."""
    existing_steps: tuple[int, ...]
    """Steps of every checkpoint directory under the root afterwards, oldest first."""
    manifest: Manifest | None = None
    """The chosen checkpoint's manifest, as admitted (None: nothing chosen)."""
    verdict: Any = None
    """What the admission said of it (`admission.Verdict`; None without one)."""
    refused_steps: tuple[int, ...] = ()
    """Steps of the intact checkpoints the admission refused (another job's, unauthenticated): left in place,
    never deleted by this run (`CheckpointManager` keeps them out of retention)."""


def choose_checkpoint(
    storage: CheckpointStorage,
    *,
    recorder: EventSink,
    step: int | None = None,
    at_most: int | None = None,
    checksums: bool = True,
    secret: bytes | None = None,
    admit: Callable[[Manifest], Any] | None = None,
) -> ResumeChoice:
    """The newest checkpoint that verifies (or exactly `step`), after removing newer unusable ones.

    Args:
        storage: the checkpoint root.
        recorder: where each skipped directory is recorded (`checkpoint_skipped` marks).
        step: resume exactly from this step (None: the newest that verifies).
        at_most: consider only steps <= this (a fallback after a newer one failed to load).
        checksums: re-read every file and check its CRC-32 (else sizes only; pickled files always).
        secret: HMAC key the manifest must be signed with (None: not checked).
        admit: the job's `admission.Admission` (None: every intact checkpoint is admitted).
    """
    limit = step if at_most is None else at_most if step is None else min(step, at_most)
    resolution = find_latest(storage, checksums=checksums, at_most=limit, secret=secret, admit=admit)
    chosen = resolution.latest.step if resolution.latest is not None else None
    if step is not None and chosen != step:
        chosen = None
    for name, reason in resolution.skipped:
        set_aside(storage, name, reason, recorder=recorder)
    for name, reason in resolution.refused:
        recorder.mark("checkpoint_refused", checkpoint=name, reason=reason)
    verdict = resolution.verdict
    if chosen is not None and verdict is not None and not getattr(verdict, "authenticated", True):
        logger.warning(
            "ettr: resuming from %s without authentication: %s", step_dir_name(chosen), verdict.note
        )
        recorder.mark("checkpoint_unauthenticated", checkpoint=step_dir_name(chosen), reason=verdict.note)
    remaining = list_checkpoints(storage)
    refused_names = {name for name, _ in resolution.refused}
    return ResumeChoice(
        step=chosen,
        existing_steps=tuple(c.step for c in remaining),
        refused_steps=tuple(c.step for c in remaining if c.name in refused_names),
        manifest=resolution.latest if chosen is not None else None,
        verdict=verdict if chosen is not None else None,
    )


def set_aside(storage: CheckpointStorage, name: str, reason: str, *, recorder: EventSink) -> None:
    """Record a `checkpoint_skipped` mark for `name`; move it aside if it has a manifest (corrupt or
    unloadable: kept for inspection), else delete it (incomplete)."""
    recorder.mark("checkpoint_skipped", checkpoint=name, reason=reason)
    if any(c.name == name and c.has_manifest for c in list_checkpoints(storage)):
        moved = quarantine(storage, name)
        if moved is not None:
            logger.warning("ettr: moved checkpoint %s aside to %s (%s)", name, moved, reason)
        return
    try:
        storage.remove_tree(name)
    except (
        OSError
    ) as exc:  # a read-only root (a restore-only job): the skip is what matters, not the clean-up
        logger.warning(
            "ettr: cannot delete incomplete checkpoint %s (%s); left in place, never loaded",
            name,
            describe_error(exc),
        )
