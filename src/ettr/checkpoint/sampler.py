"""The data position: a sampler that knows how far it got and can start again from there.

`ResumableSampler` yields the indices of one rank's share of a dataset, reshuffled every epoch from
`seed + epoch`, and counts what it has handed out. Its `state_dict()` is (epoch, offset), so a job restored
from a checkpoint continues with exactly the batches the uninterrupted job would have seen. It is exact with
a `DataLoader` that has `num_workers=0` (indices are drawn as batches are consumed). With worker processes
the loader prefetches indices ahead of the training step; use torchdata's `StatefulDataLoader` and pass the
loader itself as `TrainState(data=...)` instead.

Give the DataLoader its own `generator=torch.Generator()`: a DataLoader draws a base seed from the *global*
torch RNG every time an iterator is created, and a resumed job creates one at a different point than the
uninterrupted job did.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler


class ResumableSampler(Sampler[int]):
    """Indices of rank `rank`'s share of `num_samples` items, epoch after epoch, resumable mid-epoch.

    Args:
        num_samples: the dataset's length.
        shuffle: reshuffle every epoch (from `seed + epoch`); else in order.
        seed: the shuffle seed (the same on every rank).
        rank, world_size: this rank's share is every `world_size`-th index starting at `rank`.
        drop_last: drop the tail that does not divide evenly among ranks (else pad it by repeating
            indices from the start, as `DistributedSampler` does).
    """

    def __init__(
        self,
        num_samples: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
    ) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank {rank} of {world_size}")
        if drop_last and num_samples < world_size:
            raise ValueError(f"drop_last with {num_samples} samples leaves nothing for {world_size} ranks")
        self.num_samples = num_samples
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self.epoch = 0
        self.offset = 0
        """Indices of the current epoch already handed out."""

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_samples // self.world_size
        return -(-self.num_samples // self.world_size)

    def _epoch_indices(self, epoch: int) -> list[int]:
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + epoch)
            order = torch.randperm(self.num_samples, generator=generator).tolist()
        else:
            order = list(range(self.num_samples))
        per_rank = len(self)
        total = per_rank * self.world_size
        if total > len(order):
            order += (order * (-(-total // len(order))))[: total - len(order)]
        return order[:total][self.rank :: self.world_size]

    def __iter__(self) -> Iterator[int]:
        indices = self._epoch_indices(self.epoch)
        while self.offset < len(indices):
            index = indices[self.offset]
            self.offset += 1
            yield index
        self.epoch += 1
        self.offset = 0

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` from its beginning (for loops that count epochs themselves)."""
        if epoch != self.epoch:
            self.epoch, self.offset = epoch, 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position. Raises ValueError if the dataset or the rank count changed."""
        for key in ("num_samples", "world_size", "seed"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"the saved data position is for {key}={state.get(key)}, this sampler has "
                    f"{getattr(self, key)}: it cannot continue from there"
                )
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
