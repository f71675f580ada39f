"""Checkpointing of the reference job behind one small seam, so the ettr checkpoint manager can slot in.

`sync` is the baseline a plain trainer has: every rank `torch.save`s its whole local state (its shards of
the TorchRec tables as `ShardedTensor`s, the replicated dense part, the optimizer state) while training
waits. It still commits properly — rank files first, then a marker renamed into place by rank 0 after
all ranks wrote — so a crash mid-save never destroys the previous checkpoint. `ettr` hands the same state
to `ettr.checkpoint` (another engineer's module) once it exists.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

COMMIT_MARKER = "COMMITTED"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class Stateful(Protocol):
    """What a checkpointer saves and restores (the shape of `torch.distributed.checkpoint.stateful`)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class Checkpointer(Protocol):
    """Saves and restores the training state by global step. All methods are collective (every rank calls)."""

    def latest_step(self) -> int | None:
        """The newest committed step, the same on every rank; None if there is none."""
        ...

    def load(self, step: int, state: Stateful) -> None:
        """Restore `state` from the checkpoint of `step` (raises if it is missing or unreadable)."""
        ...

    def save(self, step: int, state: Stateful) -> str | None:
        """Checkpoint `state` as of after `step`; returns the committed path (on rank 0), else None.

        Returns once the training loop may go on; for `sync` that is after the commit.
        """
        ...

    def close(self) -> None:
        """Finish or abandon background work (none for `sync`)."""
        ...


class TorchSaveCheckpointer:
    """`torch.save` per rank into `ckpt_dir/step_NNNNNNNN/rank_RRRRR.pt`, committed by a marker file.

    Restoring needs the same world size and sharding plan (the rank files hold that rank's shards). The
    newest `keep` committed checkpoints are kept; older ones are removed by rank 0 after a commit.
    """

    def __init__(
        self, ckpt_dir: str | os.PathLike[str], *, rank: int, world_size: int, keep: int = 2
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.ckpt_dir = Path(ckpt_dir)
        self.rank = rank
        self.world_size = world_size
        self.keep = keep

    def step_dir(self, step: int) -> Path:
        return self.ckpt_dir / f"step_{step:08d}"

    def committed_steps(self) -> list[int]:
        """Committed steps on disk, oldest first (local look, not collective)."""
        if not self.ckpt_dir.is_dir():
            return []
        steps = []
        for child in self.ckpt_dir.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and (child / COMMIT_MARKER).is_file():
                steps.append(int(match.group(1)))
        return sorted(steps)

    def latest_step(self) -> int | None:
        steps = self.committed_steps()
        found = [steps[-1] if steps else None]
        # Rank 0 decides, so that ranks never resume from different steps (e.g. a slow file system view).
        if dist.is_initialized() and self.world_size > 1:
            dist.broadcast_object_list(found, src=0)
        return found[0]

    def load(self, step: int, state: Stateful) -> None:
        path = self.step_dir(step) / f"rank_{self.rank:05d}.pt"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing: the checkpoint of step {step} was written by a different world size"
            )
        # weights_only=False: the file holds ShardedTensors, and it is our own file from this job.
        state.load_state_dict(torch.load(path, weights_only=False))

    def save(self, step: int, state: Stateful) -> str | None:
        step_dir = self.step_dir(step)
        step_dir.mkdir(parents=True, exist_ok=True)
        path = step_dir / f"rank_{self.rank:05d}.pt"
        tmp = path.with_suffix(".pt.tmp")
        with open(tmp, "wb") as f:
            torch.save(state.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier()  # every rank's file is durable before the marker says so
        if self.rank != 0:
            return None
        _write_durably(step_dir / COMMIT_MARKER, f"{step}\n".encode())
        self._retire_old()
        return str(step_dir)

    def close(self) -> None:
        pass

    def _retire_old(self) -> None:
        for old in self.committed_steps()[: -self.keep]:
            # Marker first: a half-deleted directory must never look committed.
            (self.step_dir(old) / COMMIT_MARKER).unlink(missing_ok=True)
            shutil.rmtree(self.step_dir(old), ignore_errors=True)


def _write_durably(path: Path, payload: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def make_checkpointer(
    mode: str, ckpt_dir: str | os.PathLike[str], *, rank: int, world_size: int
) -> Checkpointer:
    """The checkpointer of `--ckpt-mode`. Raises `ettr.errors.UsageError` for a mode this build lacks."""
    from ettr.errors import UsageError

    if mode == "sync":
        return TorchSaveCheckpointer(ckpt_dir, rank=rank, world_size=world_size)
    if mode == "ettr":
        # The seam for round two: an adapter from `ettr.checkpoint`'s manager to `Checkpointer` goes here.
        raise UsageError(
            "--ckpt-mode ettr is not wired yet (the ettr checkpoint manager is still being written); "
            "use --ckpt-mode sync"
        )
    raise UsageError(f"--ckpt-mode must be sync or ettr, got {mode!r}")
