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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

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
    seek: int = 0  # the `ResumeGate.set` it was made after (0: a stream with a fixed start)


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
    """Where already running loader workers start, given once the trainer knows it, and again when a job
    restarted in place goes back to its last checkpoint.

    Lets the workers do their start-up while the trainer is still building the model and looking for a
    checkpoint, and keep them across restarts in place (`KeptLoader`). Create it before the workers start
    (they inherit it). Each `set` is a new position, numbered 1, 2, ...: a worker moves to the newest one
    at its next batch, and tags every batch with the number of the position it was made for.
    """

    def __init__(self) -> None:
        self._start = multiprocessing.Value("q", -1, lock=False)
        self._seek = multiprocessing.Value("q", 0, lock=False)
        self._changed = multiprocessing.Condition()

    def set(self, start: int) -> int:
        """Start (again) at batch `start`; returns the number of this position."""
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        with self._changed:
            self._start.value = start
            self._seek.value += 1
            self._changed.notify_all()
            return int(self._seek.value)

    def position(self) -> tuple[int, int]:
        """The newest position: its number (0 before the first `set`) and its start."""
        with self._changed:
            return int(self._seek.value), int(self._start.value)

    def wait(self, timeout_s: float | None = None) -> int:
        """The start index; blocks until the first `set` (raises TimeoutError after `timeout_s`)."""
        return self.wait_position(timeout_s)[1]

    def wait_position(self, timeout_s: float | None = None) -> tuple[int, int]:
        """`position()` once there is one; blocks until the first `set` (TimeoutError after `timeout_s`)."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._seek.value > 0, timeout_s):
                raise TimeoutError("the trainer never said where the data starts")
            return int(self._seek.value), int(self._start.value)


class ClickStream(IterableDataset):
    """Batches `start, start+1, ...` (up to `stop`, exclusive, or forever) of one rank's stream.

    `start` may be a `ResumeGate`: the worker then does its start-up first and waits for the index after,
    and moves to each newer position the gate is given (`ClickBatch.seek` says which position a batch is of).
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
        if isinstance(self.start, ResumeGate):
            yield from self._follow(self.start, hidden, worker_id, num_workers)
            return
        index = self.start + worker_id
        while self.stop is None or index < self.stop:
            yield hidden.batch(rank=self.rank, index=index)
            index += num_workers

    def _follow(
        self, gate: ResumeGate, hidden: HiddenClickModel, worker_id: int, num_workers: int
    ) -> Iterator[ClickBatch]:
        seek, start = gate.wait_position()
        index = start + worker_id
        while True:
            newest = gate.position()
            if newest[0] != seek:  # the trainer went back to a checkpoint: from there on
                seek, start = newest
                index = start + worker_id
            if self.stop is not None and index >= self.stop:
                return
            yield replace(hidden.batch(rank=self.rank, index=index), seek=seek)
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


class KeptLoader:
    """Loader workers started once per process, before the trainer knows where to start, and kept when the
    job restarts in place: `batches(start)` moves them to a checkpoint's position, without their start-up.

        kept = KeptLoader(config, rank=rank, stop=steps)     # workers start now (their warm-up begins)
        ...                                                  # process group, model, restore
        batches = kept.batches(resumed_step)                 # batch resumed_step, resumed_step + 1, ...

    Batches already made for an earlier position (prefetched before a failure) are dropped. The stream is
    checked: when the first batch of a position is not the one asked for (several workers can move at
    different batches) or the workers have ended, a new loader takes over from where the stream was right,
    paying the workers' start-up again rather than giving a batch out of order.
    """

    def __init__(
        self,
        config: ClickDataConfig,
        *,
        rank: int,
        stop: int | None = None,
        num_workers: int = 1,
        worker_init_fn: Callable[[int], None] | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.stop = stop
        self.num_workers = num_workers
        self.worker_init_fn = worker_init_fn
        self.gate = ResumeGate()
        self.num_restarted = 0
        """How often the kept workers could not be used and a new loader took over."""
        self._iterator: Iterator[ClickBatch] | None = iter(self._loader(self.gate))  # the workers start

    def _loader(self, start: int | ResumeGate) -> DataLoader:
        loader = make_loader(
            self.config, rank=self.rank, start=start, stop=self.stop, num_workers=self.num_workers
        )
        loader.worker_init_fn = self.worker_init_fn
        return loader

    def batches(self, start: int) -> Iterator[ClickBatch]:
        """Batches `start`, `start + 1`, ... up to `stop` (exclusive). A later call supersedes this one."""
        seek = self.gate.set(start)
        return self._checked(seek, start)

    def _checked(self, seek: int, start: int) -> Iterator[ClickBatch]:
        expected = start
        restarted = False
        while self.stop is None or expected < self.stop:
            batch = self._next()
            if batch is not None and batch.seek < seek:
                continue  # made before the trainer went back: not this position's
            if batch is not None and batch.seek == seek and batch.index == expected:
                yield batch
                expected += 1
                continue
            if restarted:
                raise RuntimeError(f"loader workers started at batch {expected} gave {batch and batch.index}")
            # The kept workers cannot give batch `expected`: new ones, from there (a cold start of theirs).
            self.close()
            self.num_restarted += 1
            restarted = True
            self.gate = ResumeGate()
            self._iterator = iter(self._loader(self.gate))
            seek = self.gate.set(expected)

    def _next(self) -> ClickBatch | None:
        if self._iterator is None:
            return None
        try:
            return next(self._iterator)
        except StopIteration:  # the workers ended (their stream reached `stop`)
            return None

    def close(self) -> None:
        """Stop the workers (and wait for them). Idempotent."""
        iterator, self._iterator = self._iterator, None
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
