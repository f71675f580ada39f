"""The one process helper: start ticks, the liveness policy (pid + start ticks), descendants, PDEATHSIG."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from ettr import procs

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_start_ticks_tell_a_process_from_a_later_one_with_its_pid():
    me = procs.start_ticks(os.getpid())
    assert isinstance(me, int) and me > 0
    assert procs.pid_alive(os.getpid(), me)
    assert not procs.pid_alive(os.getpid(), me + 1)  # the pid, reused by someone else
    assert procs.start_ticks(_dead_pid()) is None


def test_unknown_start_ticks_mean_the_pid_exists():
    assert procs.pid_alive(os.getpid(), None)
    assert not procs.pid_alive(_dead_pid(), None)
    assert not procs.pid_alive(0, None) and not procs.pid_alive(-1, 5)


def test_recorded_ticks_of_a_gone_process_are_dead():
    pid = _dead_pid()
    assert not procs.pid_alive(pid, 12345)


def test_process_start_time_is_before_now():
    start = procs.process_start_time()
    assert start <= time.time() and time.time() - start < 3600


def test_descendants_and_the_parent_death_signal():
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); time.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        for _ in range(200):
            found = procs.descendants(proc.pid)
            if found:
                break
            time.sleep(0.05)
        assert len(found) == 1 and found[0][1] == procs.start_ticks(found[0][0])
    finally:
        for pid, _ticks in procs.descendants(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()
    calls = []
    assert procs.set_parent_death_signal(signal.SIGTERM, prctl=lambda *a: calls.append(a) or 0)
    assert calls == [(1, int(signal.SIGTERM), 0, 0, 0)]
    assert not procs.set_parent_death_signal(prctl=lambda *a: -1)
