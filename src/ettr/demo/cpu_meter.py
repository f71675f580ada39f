"""What else ran on each side's CPUs while the demo's two jobs trained side by side.

Each side is pinned to CPUs of its own so that the machine's other load slows both alike; on a shared
machine it need not: the scheduler may put another user's processes (and the demo's own) on one side's CPU
more than on the other's, and that side's steps are then slower for a reason that is not ettr's. The demo
samples, about once a second, how busy each side's CPUs were (`/proc/stat`) and how much CPU the side's own
processes used (its `ettr run` and every descendant), and says, over the stretch in which both trained, how
many CPU seconds went to anything else on each side's CPUs.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from ettr.procs import cpus_busy_seconds, tree_cpu_seconds


@dataclass(frozen=True, kw_only=True)
class CpuSample:
    """One look at a side: when (Unix time), its CPUs' busy seconds since boot, its processes' CPU seconds
    so far, and which `ettr run` they hang from (a requeue starts a new tree, whose count starts again)."""

    ts: float
    busy_s: float | None
    own_s: float | None
    root: int | None


def sample(ts: float, cpus: Collection[int], root: int | None) -> CpuSample:
    """Look at one side now: `cpus` its CPUs, `root` the pid of its `ettr run` (None: none running)."""
    return CpuSample(
        ts=ts,
        busy_s=cpus_busy_seconds(cpus),
        own_s=tree_cpu_seconds(root) if root is not None else None,
        root=root,
    )


@dataclass(frozen=True, kw_only=True)
class CpuShare:
    """A side's CPUs over a stretch of wall time: how much of it the samples covered, the CPU seconds its
    own processes used and those that went to anything else on its CPUs."""

    covered_s: float
    own_s: float
    others_s: float
    num_cpus: int

    @property
    def others_pct(self) -> float:
        """`others_s` as a share of the CPU time its CPUs had in the stretch covered."""
        return self.others_s / (self.covered_s * self.num_cpus) * 100.0 if self.covered_s > 0 else 0.0


def share_between(
    samples: Sequence[CpuSample], begin_ts: float, end_ts: float, *, num_cpus: int
) -> CpuShare | None:
    """The share of the side's CPUs between `begin_ts` and `end_ts`, from consecutive samples both inside
    it that looked at the same `ettr run` (the CPU of a tree that ended between two looks is not known);
    None when no such pair exists. Pure."""
    covered = own = busy = 0.0
    for before, after in zip(samples, samples[1:], strict=False):
        if not (begin_ts <= before.ts and after.ts <= end_ts and after.ts > before.ts):
            continue
        if before.root is None or before.root != after.root:
            continue
        if None in (before.busy_s, after.busy_s, before.own_s, after.own_s):
            continue
        assert before.busy_s is not None and after.busy_s is not None
        assert before.own_s is not None and after.own_s is not None
        covered += after.ts - before.ts
        busy += after.busy_s - before.busy_s
        own += after.own_s - before.own_s
    if covered <= 0:
        return None
    return CpuShare(covered_s=covered, own_s=own, others_s=max(0.0, busy - own), num_cpus=num_cpus)
