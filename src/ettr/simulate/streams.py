"""Seeded streams of interruption times: when a job's nodes fail and when the scheduler preempts it.

A stream is a sorted sequence of wall times (seconds from the job's submission), drawn lazily in blocks
from a numpy `Generator`. Node failures do not depend on what the job is doing, so the same seed gives the
same failure times whatever the checkpoint policy: sweeps and policy comparisons use common random numbers.
Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np

from ettr.constants import SECONDS_PER_DAY


class IntervalSource(Protocol):
    """Draws the times of the next events after `start_s`, in order, covering at least `[start_s, end_s)`."""

    def draw(self, start_s: float, end_s: float) -> np.ndarray: ...


class PoissonSource:
    """Events at a constant rate (exponential gaps): a job-level preemption stream, or the superposition of
    many nodes with exponential lifetimes (a Poisson process of the summed rate)."""

    def __init__(self, rng: np.random.Generator, per_day: float) -> None:
        self._rng = rng
        self._rate_per_s = per_day / SECONDS_PER_DAY

    def draw(self, start_s: float, end_s: float) -> np.ndarray:
        if self._rate_per_s <= 0:
            return np.empty(0)
        expected = (end_s - start_s) * self._rate_per_s
        size = int(expected + 4.0 * math.sqrt(expected) + 16)
        gaps = self._rng.exponential(1.0 / self._rate_per_s, size)
        return start_s + np.cumsum(gaps)


class WeibullNodesSource:
    """Every node fails after a Weibull lifetime and is replaced at once by a fresh node (a renewal process
    per node, all fresh at the job's submission); the job sees the superposition of its nodes' failures."""

    def __init__(
        self, rng: np.random.Generator, *, num_nodes: int, per_node_day: float, shape: float
    ) -> None:
        self._rng = rng
        self._shape = shape
        # Mean lifetime scale * Gamma(1 + 1/k) = one day / rate.
        self._scale = SECONDS_PER_DAY / per_node_day / math.gamma(1.0 + 1.0 / shape)
        self._next = self._scale * rng.weibull(shape, num_nodes)

    def draw(self, start_s: float, end_s: float) -> np.ndarray:
        found: list[np.ndarray] = []
        # Nothing due in the window: cover up to the soonest failure at once, instead of one empty window
        # after another (a node that lives a thousand years is a million windows of a day away).
        soonest = float(self._next.min())
        if soonest >= end_s:
            end_s = math.nextafter(soonest, math.inf)
        while True:
            due = self._next < end_s
            if not due.any():
                break
            found.append(self._next[due].copy())
            self._next[due] += self._scale * self._rng.weibull(self._shape, int(due.sum()))
        if not found:
            return np.empty(0)
        times = np.sort(np.concatenate(found))
        return times[times > start_s]


class EventStream:
    """The next event strictly after a time, drawing more from its source as the job's clock runs on.

    The times come in blocks from the source; a block is drawn when every time of the last one has passed,
    from the last time drawn to the time asked plus the block length (so what is drawn depends only on the
    times asked, in order). `next_after` serves the scalar loop, `block_after` the batched one: both draw
    the same blocks for the same questions."""

    def __init__(self, source: IntervalSource | None, horizon_hint_s: float) -> None:
        self._source = source
        self._block: np.ndarray = np.empty(0)
        self._times: list[float] | None = []  # the block as a list, for the scalar loop (None: not made yet)
        self._index = 0
        self._covered_s = 0.0
        self._block_s = max(horizon_hint_s, 1.0)

    def _draw_after(self, t: float) -> None:
        """The next block (the current one has no time after `t`)."""
        assert self._source is not None
        block = self._block
        start = float(block[-1]) if len(block) else self._covered_s
        end = max(t, self._covered_s) + self._block_s
        self._block = self._source.draw(start, end)
        self._times = None
        self._covered_s = end
        self._index = 0

    def next_after(self, t: float) -> float:
        if self._source is None:
            return math.inf
        if self._times is None:
            self._times = self._block.tolist()
        times = self._times
        i = self._index
        while True:
            while i < len(times) and times[i] <= t:
                i += 1
            if i < len(times):
                self._index = i
                return times[i]
            # Exhausted: draw the next block (a block may cover less than asked, or be empty; loop again).
            self._draw_after(t)
            times = self._times = self._block.tolist()
            i = 0

    def block_after(self, t: float) -> np.ndarray | None:
        """The times already drawn after `t` (drawing the next block first when none is left, as
        `next_after(t)` would), in order; None for a stream with no source (never an event). Successive
        `next_after` calls with growing times return these until they run out (`ettr.simulate.batch`)."""
        if self._source is None:
            return None
        while True:
            i = int(np.searchsorted(self._block, t, side="right"))
            if i < len(self._block):
                self._index = i
                return self._block[i:]
            self._draw_after(t)


def failure_source(
    rng: np.random.Generator, *, num_nodes: int, per_node_day: float, shape: float
) -> IntervalSource | None:
    """Node failures of a job: Poisson when lifetimes are exponential, else per-node Weibull renewals."""
    if not _occurs(per_node_day):
        return None
    if shape == 1.0:
        return PoissonSource(rng, per_node_day * num_nodes)
    return WeibullNodesSource(rng, num_nodes=num_nodes, per_node_day=per_node_day, shape=shape)


def preemption_source(rng: np.random.Generator, per_day: float) -> IntervalSource | None:
    return PoissonSource(rng, per_day) if _occurs(per_day) else None


def _occurs(per_day: float) -> bool:
    """Whether events at `per_day` ever come: a rate so small that its mean gap is no finite number of
    seconds (5e-324 a day) is none at all."""
    return per_day > 0 and math.isfinite(SECONDS_PER_DAY / per_day)
