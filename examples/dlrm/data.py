"""Deterministic synthetic click data for the reference DLRM job.

Every batch is a pure function of `(seed, rank, batch index)`: a resumed job reads exactly the batches it
would have read, and two runs with the same seed see the same data. Sparse ids are Zipf-skewed (a few hot
ids per table, a long tail), as in real click logs. Labels come from a hidden model of the same family as
the DLRM (a scalar weight per id, mean-pooled per feature, plus a linear term on the dense features), so the
loss really falls as the model learns it. This module does not import TorchRec: DataLoader workers stay light.
"""

from __future__ import annotations

import math
import multiprocessing
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


@dataclass(frozen=True, kw_only=True)
class ClickDataConfig:
    """What the synthetic click stream looks like and how the loader behaves."""

    num_tables: int = 12
    """Number of sparse features (one per embedding table)."""
    num_rows: int = 4000
    """Ids of every feature are in [0, num_rows)."""
    num_dense: int = 13
    """Number of dense features per sample."""
    batch_size: int = 512
    """Samples per batch, per rank."""
    max_ids_per_feature: int = 3
    """Each sample has 1..max_ids_per_feature ids per feature (multi-hot bags)."""
    zipf_exponent: float = 1.1
    """Skew of the id distribution: P(k-th most frequent id) is proportional to 1 / k**zipf_exponent."""
    label_scale: float = 3.0
    """Standard deviation of the hidden logit; larger means cleaner labels and a lower reachable loss."""
    seed: int = 0
    """Seed of the hidden model and of every batch."""
    worker_startup_s: float = 1.5
    """Seconds a loader worker takes before its first batch (stands in for opening shards, reading an
    index, warming a cache). Spent once per worker, when it starts iterating."""

    def __post_init__(self) -> None:
        for name in ("num_tables", "num_rows", "num_dense", "batch_size", "max_ids_per_feature"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.zipf_exponent <= 0:
            raise ValueError(f"zipf_exponent must be positive, got {self.zipf_exponent}")
        if self.label_scale <= 0:
            raise ValueError(f"label_scale must be positive, got {self.label_scale}")
        if self.worker_startup_s < 0:
            raise ValueError(f"worker_startup_s must be >= 0, got {self.worker_startup_s}")

    @property
    def feature_names(self) -> list[str]:
        return [f"f{i}" for i in range(self.num_tables)]


@dataclass(frozen=True)
class ClickBatch:
    """One batch as plain tensors (cheap to send from a worker process).

    `values` and `lengths` are the KeyedJaggedTensor layout: feature-major, `lengths` has
    `num_tables * batch_size` entries, feature 0's bags first.
    """

    dense: torch.Tensor  # [B, num_dense] float32
    values: torch.Tensor  # [sum(lengths)] int64 ids
    lengths: torch.Tensor  # [num_tables * B] int32
    labels: torch.Tensor  # [B] float32 in {0, 1}
    index: int  # the batch index (global step - 1 that consumes it)


class HiddenClickModel:
    """The ground truth the labels are drawn from; built from the seed alone, identical in every process."""

    def __init__(self, config: ClickDataConfig) -> None:
        self.config = config
        g = torch.Generator().manual_seed(config.seed)
        num_tables, num_rows = config.num_tables, config.num_rows
        # Per-table permutation so that each table's hot ids are different ids, not always 0, 1, 2...
        self.id_of_rank = torch.stack([torch.randperm(num_rows, generator=g) for _ in range(num_tables)])
        ranks = torch.arange(1, num_rows + 1, dtype=torch.float64)
        probs = ranks.pow(-config.zipf_exponent)
        self.cdf = (probs.cumsum(0) / probs.sum()).float()
        self.id_weight = torch.randn(num_tables, num_rows, generator=g)
        self.dense_weight = torch.randn(config.num_dense, generator=g)
        # Sparse and dense parts contribute equally to the logit's variance.
        self.sparse_scale = config.label_scale / math.sqrt(2 * num_tables)
        self.dense_scale = config.label_scale / math.sqrt(2 * config.num_dense)

    def batch(self, *, rank: int, index: int) -> ClickBatch:
        """Batch number `index` of `rank`'s stream."""
        cfg = self.config
        g = torch.Generator().manual_seed(_mix(cfg.seed, rank, index))
        num_bags = cfg.num_tables * cfg.batch_size
        dense = torch.randn(cfg.batch_size, cfg.num_dense, generator=g)
        lengths = torch.randint(1, cfg.max_ids_per_feature + 1, (num_bags,), generator=g, dtype=torch.int32)
        num_values = int(lengths.sum())
        popularity = torch.searchsorted(self.cdf, torch.rand(num_values, generator=g)).clamp_(
            max=cfg.num_rows - 1
        )
        table = torch.repeat_interleave(torch.arange(num_bags), lengths) // cfg.batch_size
        values = self.id_of_rank[table, popularity]
        logit = self.logit(dense=dense, values=values, lengths=lengths)
        labels = torch.bernoulli(torch.sigmoid(logit), generator=g)
        return ClickBatch(dense=dense, values=values, lengths=lengths, labels=labels, index=index)

    def logit(self, *, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The true logit of each sample (the best any model can do is to learn it)."""
        cfg = self.config
        num_bags = cfg.num_tables * cfg.batch_size
        bag = torch.repeat_interleave(torch.arange(num_bags), lengths)
        table = bag // cfg.batch_size
        bag_sum = torch.zeros(num_bags).index_add_(0, bag, self.id_weight[table, values])
        bag_mean = (bag_sum / lengths).view(cfg.num_tables, cfg.batch_size)
        return bag_mean.sum(0) * self.sparse_scale + dense @ self.dense_weight * self.dense_scale


def _mix(seed: int, rank: int, index: int) -> int:
    # A fixed integer mix (not Python's salted hash()) so that every process derives the same seed.
    return ((seed * 1_000_003 + rank) * 1_000_000_007 + index) & 0x7FFF_FFFF_FFFF_FFFF


class ResumeGate:
    """The first batch index, given to already running loader workers once the trainer knows it.

    Lets the workers do their start-up while the trainer is still building the model and looking for a
    checkpoint. Create it before the workers start (they inherit it); `set` once; workers `wait`.
    """

    def __init__(self) -> None:
        self._start = multiprocessing.Value("q", -1, lock=False)
        self._ready = multiprocessing.Event()

    def set(self, start: int) -> None:
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        self._start.value = start
        self._ready.set()

    def wait(self, timeout_s: float | None = None) -> int:
        """The start index; blocks until `set` (raises TimeoutError after `timeout_s`)."""
        if not self._ready.wait(timeout_s):
            raise TimeoutError("the trainer never said where the data starts")
        return int(self._start.value)


class ClickStream(IterableDataset):
    """Batches `start, start+1, ...` (up to `stop`, exclusive, or forever) of one rank's stream.

    `start` may be a `ResumeGate`: the worker then does its start-up first and waits for the index after.
    With several loader workers, worker w produces the indices congruent to w (mod workers) from start; the
    DataLoader takes one batch from each worker in turn, so the order is the same as with one worker.
    """

    def __init__(
        self, config: ClickDataConfig, *, rank: int, start: int | ResumeGate = 0, stop: int | None = None
    ) -> None:
        super().__init__()
        if isinstance(start, int) and (start < 0 or (stop is not None and stop < start)):
            raise ValueError(f"need 0 <= start <= stop, got start={start} stop={stop}")
        self.config = config
        self.rank = rank
        self.start = start
        self.stop = stop

    def __iter__(self) -> Iterator[ClickBatch]:
        info = get_worker_info()
        worker_id, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        hidden = HiddenClickModel(self.config)
        # Simulated I/O at the start of a worker: a real reader opens files, fetches an index, fills a
        # buffer before its first batch. This is a stand-in for that cost, not a synchronisation.
        time.sleep(self.config.worker_startup_s)
        start = self.start.wait() if isinstance(self.start, ResumeGate) else self.start
        index = start + worker_id
        while self.stop is None or index < self.stop:
            yield hidden.batch(rank=self.rank, index=index)
            index += num_workers


def make_loader(
    config: ClickDataConfig,
    *,
    rank: int,
    start: int | ResumeGate = 0,
    stop: int | None = None,
    num_workers: int = 1,
) -> DataLoader:
    """A DataLoader over `ClickStream`: batches are already formed, so no collation (batch_size=None)."""
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    return DataLoader(
        ClickStream(config, rank=rank, start=start, stop=stop),
        batch_size=None,
        num_workers=num_workers,
        prefetch_factor=4 if num_workers > 0 else None,
        persistent_workers=False,
    )
