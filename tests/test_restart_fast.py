"""The fast restart path (`ettr.supervisor.restart`): wake on exit, a dead rank's failure, the back-off rule."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from ettr.events import Event, EventKind, Outcome
from ettr.procs import start_ticks
from ettr.supervisor.classify import AttemptEnd
from ettr.supervisor.policy import backoff_wait_s
from ettr.supervisor.restart import ExitWaker, PeerFailureWatch, stopped_after_peer_failure, trained


def test_no_backoff_before_the_first_restart_after_progress_and_doubling_after():
    kw = {"backoff_s": 0.5, "max_backoff_s": 30.0}
    assert backoff_wait_s(0, outcome=Outcome.FAILED, made_progress=True, **kw) == 0.0
    assert backoff_wait_s(0, outcome=Outcome.HUNG, made_progress=True, **kw) == 0.0
    assert backoff_wait_s(0, outcome=Outcome.FAILED, made_progress=False, **kw) == 0.5  # cannot start
    assert backoff_wait_s(0, outcome=Outcome.PREEMPTED, made_progress=True, **kw) == 0.5
    assert backoff_wait_s(1, outcome=Outcome.FAILED, made_progress=True, **kw) == 1.0
    assert backoff_wait_s(10, outcome=Outcome.FAILED, made_progress=True, **kw) == 30.0


def test_trained_counts_training_steps_only():
    assert not trained([Event(EventKind.PROCESS_START, 1.0, 0, 0)])
    assert trained([Event(EventKind.STEP, 1.0, 0, 1, step=1)])


def test_exit_waker_wakes_on_exit():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    wake = threading.Event()
    waker = ExitWaker(proc.pid, wake)
    try:
        assert waker.active
        assert not wake.is_set()
        assert wake.wait(30.0)  # set by the exit, not by a tick
        assert proc.wait(5.0) == 0
    finally:
        waker.close()


def test_exit_waker_close_while_running_does_not_wake():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    wake = threading.Event()
    waker = ExitWaker(proc.pid, wake)
    waker.close()
    proc.kill()
    proc.wait()
    assert not wake.is_set()


def test_peer_failure_needs_a_dead_process_and_a_failure_record():
    recorded = {"failure": False}
    asked = []

    def failure_recorded() -> bool:
        asked.append(1)
        return recorded["failure"]

    watch = PeerFailureWatch(failure_recorded)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        tree = {live.pid: start_ticks(live.pid), dead.pid: start_ticks(dead.pid)}
        assert not watch.check({live.pid: tree[live.pid]})
        assert asked == []  # nothing died: the ledger is not read
        deadline = time.monotonic() + 30
        while dead.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not watch.check(tree)  # died, but no FAILURE: a clean exit changes nothing
        assert asked == [1]
        recorded["failure"] = True
        assert not watch.check(tree)  # that death was seen already
        live.kill()
        live.wait()
        assert watch.check(tree)
        assert watch.died == [[dead.pid], [live.pid]]  # one list per look that saw processes gone
    finally:
        live.kill()
        live.wait()


def test_a_stop_after_a_peer_failure_is_a_failure_not_a_preemption():
    end = AttemptEnd(outcome=Outcome.PREEMPTED, exit_code=143, signal="SIGTERM", reason="killed by SIGTERM",
                     exception="RuntimeError")  # fmt: skip
    fixed = stopped_after_peer_failure(end)
    assert fixed.outcome is Outcome.FAILED and "a rank failed: RuntimeError" in fixed.reason
    failed = AttemptEnd(outcome=Outcome.FAILED, exit_code=1, reason="exit status 1")
    assert stopped_after_peer_failure(failed) is failed
