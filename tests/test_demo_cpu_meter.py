"""The demo's look at what else ran on each side's CPUs (`ettr.demo.cpu_meter`) and the line it gives."""

from __future__ import annotations

import os

import pytest

from ettr import procs
from ettr.demo.cpu_meter import CpuSample, share_between


def _looks(root: int | None, *rows: tuple[float, float, float]) -> list[CpuSample]:
    return [CpuSample(ts=ts, busy_s=busy, own_s=own, root=root) for ts, busy, own in rows]


def test_the_share_counts_only_pairs_of_looks_inside_the_stretch_at_the_same_job():
    """10 s of one CPU: the side's processes used 6 s, the CPU was busy 9 s, so others had 3 s (30%). A look
    outside the stretch, and the pair across a requeue (another `ettr run`), are not counted."""
    looks = _looks(100, (0.0, 0.0, 0.0), (10.0, 5.0, 5.0), (15.0, 9.0, 8.0), (20.0, 14.0, 11.0))
    looks += _looks(200, (25.0, 16.0, 0.5), (30.0, 20.0, 3.0))
    looks += _looks(200, (90.0, 80.0, 50.0))
    share = share_between(looks, 10.0, 30.0, num_cpus=1)
    assert share is not None
    assert share.covered_s == pytest.approx(15.0)  # 10-15, 15-20, 25-30 (not 20-25: two jobs)
    assert share.own_s == pytest.approx(3.0 + 3.0 + 2.5)
    assert share.others_s == pytest.approx((9.0 - 5.0) + (14.0 - 9.0) + (20.0 - 16.0) - 8.5)
    assert share.others_pct == pytest.approx(share.others_s / 15.0 * 100.0)
    # Two CPUs: the same seconds are half the share.
    two = share_between(looks, 10.0, 30.0, num_cpus=2)
    assert two is not None and two.others_pct == pytest.approx(share.others_pct / 2)


def test_no_share_without_a_usable_pair_and_never_below_zero():
    assert share_between([], 0.0, 10.0, num_cpus=1) is None
    assert share_between(_looks(None, (1.0, 1.0, 1.0), (2.0, 2.0, 2.0)), 0.0, 10.0, num_cpus=1) is None
    unknown = [
        CpuSample(ts=1.0, busy_s=None, own_s=0.0, root=7),
        CpuSample(ts=2.0, busy_s=1.0, own_s=1.0, root=7),
    ]
    assert share_between(unknown, 0.0, 10.0, num_cpus=1) is None
    # The side's own count moved more than the CPU's (ticks are sampled apart): others are 0, not negative.
    share = share_between(_looks(7, (1.0, 1.0, 1.0), (2.0, 1.5, 2.0)), 0.0, 10.0, num_cpus=1)
    assert share is not None and share.others_s == 0.0


def test_this_process_tree_and_its_cpus_read_from_proc():
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc")
    sum(i * i for i in range(200_000))  # some CPU of our own
    own = procs.tree_cpu_seconds(os.getpid())
    assert own is not None and own > 0
    cpus = os.sched_getaffinity(0)
    busy = procs.cpus_busy_seconds(cpus)
    assert busy is not None and busy > 0
    assert procs.cpus_busy_seconds({10_000}) is None  # no such CPU
    assert procs.tree_cpu_seconds(2**22 + 12345) is None  # no such process
