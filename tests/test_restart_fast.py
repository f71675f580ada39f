"""The fast restart path (`ettr.supervisor.restart`): wake on exit, a dead rank's failure, the back-off rule."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from ettr.causes import Detail, diagnose
from ettr.events import Event, EventKind, Outcome
from ettr.procs import start_ticks
from ettr.supervisor import restart
from ettr.supervisor.classify import AttemptEnd, classify, first_failed_rank
from ettr.supervisor.policy import backoff_wait_s
from ettr.supervisor.restart import ExitWaker, PeerFailureWatch, trained


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
        # Found: what dies next is the supervisor's stop of the rest, no sign of who failed first.
        later = subprocess.Popen([sys.executable, "-c", "pass"])
        later.wait()
        assert not watch.check({**tree, later.pid: start_ticks(later.pid) or 1})
        assert watch.died == [[dead.pid], [live.pid]] and asked == [1, 1]
    finally:
        live.kill()
        live.wait()


def test_the_time_of_the_look_that_first_saw_a_rank_gone_reaches_the_attempt_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `bash -c 'exec torchrun ...'`: rank 1 SIGKILLed, no FAILURE; torchrun notices and exits 1 seconds later.
    # The look that first saw a rank's pid gone is when it had died by: the ATTEMPT_END's rank_gone_ts.
    gone: set[int] = set()
    monkeypatch.setattr(restart, "running", lambda pid, ticks: pid not in gone)
    times = iter([10.0, 12.0, 13.0])
    watch = PeerFailureWatch(lambda: False, clock=lambda: next(times))
    tree = {100: 1, 101: 2, 102: 3, 103: 4}  # torchrun, rank 0, rank 1, rank 0's data loader worker
    gone.add(103)
    assert not watch.check(tree)  # a data loader worker (not a rank) seen gone at 10
    assert not watch.check(tree)  # nothing new: no look recorded
    gone.add(102)
    assert not watch.check(tree)  # rank 1 seen gone at 12: no FAILURE on record, left to torchrun
    gone.update((100, 101))
    assert not watch.check(tree)
    assert watch.died == [[103], [102], [100, 101]]
    assert watch.gone == [(10.0, [103]), (12.0, [102]), (13.0, [100, 101])]
    starts = [Event(EventKind.PROCESS_START, 5.0, 0, r, data={"pid": 101 + r}) for r in (0, 1)]
    end = classify(returncode=1, events=starts, failed_pids=watch.died, seen_gone=watch.gone, wrapper="shell")
    assert end.outcome is Outcome.FAILED and end.rank_gone_ts == 12.0
    assert AttemptEnd.from_data(end.to_data()).rank_gone_ts == 12.0
    # A completed attempt's ranks are seen gone too: no failure instant; nor without the looks' times.
    done = classify(returncode=0, events=starts, failed_pids=watch.died, seen_gone=watch.gone)
    assert done.rank_gone_ts is None and "rank_gone_ts" not in done.to_data()
    assert classify(returncode=1, events=starts, failed_pids=watch.died).rank_gone_ts is None


def test_a_rank_that_finished_first_is_not_when_the_attempt_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 1 done (its clean exit marked, `run_env.exited_path`) at 10 while rank 0 saved the final model and
    # was SIGKILLed (the OOM killer) before 20: the failure is rank 0's death, not rank 1's end.
    gone: set[int] = set()
    monkeypatch.setattr(restart, "running", lambda pid, ticks: pid not in gone)
    times = iter([10.0, 20.0])
    watch = PeerFailureWatch(lambda: False, clock=lambda: next(times), exited_cleanly=lambda pid: pid == 102)
    tree = {100: 1, 101: 2, 102: 3}
    gone.add(102)
    assert not watch.check(tree)
    gone.update((101, 100))
    assert not watch.check(tree)
    assert watch.gone == [(10.0, []), (20.0, [100, 101])]  # in the order of the tree
    starts = [Event(EventKind.PROCESS_START, 5.0, 0, r, data={"pid": 101 + r}) for r in (0, 1)]
    end = classify(returncode=1, events=starts, failed_pids=watch.died, seen_gone=watch.gone)
    assert end.rank_gone_ts == 20.0


def test_a_stop_after_a_rank_failure_is_that_ranks_failure_not_a_signal_or_a_preemption():
    starts = [Event(EventKind.PROCESS_START, 1.0, 0, r, data={"pid": 100 + r}) for r in (0, 1)]
    crash = Event(
        EventKind.FAILURE, 2.0, 0, 1, data={"exception": "InjectedCrash", "message": "crash@step=120"}
    )
    # `bash run.sh` around torchrun: ettr saw rank 1 die and stopped the rest; torchrun died of that SIGTERM,
    # its shell exited 143.
    end = classify(returncode=143, wrapper=True, events=[*starts, crash], failed_pids=[[101]],
                   stopped_after_rank_failure=True)  # fmt: skip
    assert end.outcome is Outcome.FAILED and end.signal is None and end.exit_code == 143
    assert end.exception == "InjectedCrash" and end.reason.startswith(
        "rank 1 failed: InjectedCrash; ettr stopped"
    )
    cause = diagnose(outcome=end.outcome, failure=end.to_data(), trained=True)
    assert (
        cause.detail is Detail.EXCEPTION
    )  # the rank's exception, not "killed by SIGTERM (a signal from outside)"
    # The same exit without ettr's stop: a SIGTERM nobody asked the supervisor for (a scheduler's).
    outside = classify(returncode=143, wrapper=True, events=[*starts, crash], failed_pids=[[101]])
    assert outside.outcome is Outcome.PREEMPTED and outside.signal == "SIGTERM"
    # A launcher that exited on its own after the stop keeps its own status.
    own = classify(
        returncode=1, events=[*starts, crash], failed_pids=[[101]], stopped_after_rank_failure=True
    )
    assert own.outcome is Outcome.FAILED and own.reason == "exit status 1 (rank 1): InjectedCrash"
    # Rank 1 SIGKILLed, rank 0 died of the reset, ettr stopped the rest, the shell exited 143: the kill that
    # torchrun's summary names for rank 1 is the failure, not ettr's SIGTERM.
    reset = Event(
        EventKind.FAILURE,
        2.0,
        0,
        0,
        data={"exception": "RuntimeError", "message": "Connection reset by peer"},
    )
    summary = ["  rank      : 1 (local_rank: 1)", "  exitcode  : -9 (pid: 101)  (SIGKILL)"]
    killed = classify(returncode=143, wrapper=True, events=[*starts, reset], failed_pids=[[101]],
                      stderr_tail=summary, stopped_after_rank_failure=True)  # fmt: skip
    assert killed.signal == "SIGKILL" and killed.reason.startswith(
        "rank 1 failed (killed by SIGKILL); ettr stopped"
    )
    assert (
        diagnose(outcome=killed.outcome, failure=killed.to_data(), trained=True).detail is Detail.PROCESS_LOST
    )
    # `accelerate launch` (torch elastic's agent in its own process): rank 1 raised and was still tearing down
    # when ettr stopped the rest; the agent says both died of that SIGTERM and exits 1. The rank's exception
    # is the failure (it was booked a preemption by a scheduler, and not counted: a bad batch restarted forever).
    terms = ["  rank      : 0 (local_rank: 0)", "  exitcode  : -15 (pid: 100)  (SIGTERM)",
             "  rank      : 1 (local_rank: 1)", "  exitcode  : -15 (pid: 101)  (SIGTERM)"]  # fmt: skip
    for wrapped in (False, True):
        raised = classify(returncode=1, wrapper=wrapped, events=[*starts, crash], failed_pids=[[101]],
                          stderr_tail=terms, stopped_after_rank_failure=True)  # fmt: skip
        assert raised.outcome is Outcome.FAILED and raised.signal is None and raised.exit_code == 1, raised
        assert raised.reason.startswith("rank 1 failed: InjectedCrash; ettr stopped the rest"), raised.reason
        assert (
            diagnose(outcome=raised.outcome, failure=raised.to_data(), trained=True).detail
            is Detail.EXCEPTION
        )
    # A launcher that exits 0 on ettr's SIGTERM (DeepSpeed's, before it saw the rank die) did not complete.
    zero = classify(
        returncode=0, events=[*starts, crash], failed_pids=[[101]], stopped_after_rank_failure=True
    )
    assert zero.outcome is Outcome.FAILED
    assert (
        zero.reason == "rank 1 failed: InjectedCrash; ettr stopped the rest (the command exited 0 after it)"
    )
    # A forwarded preemption stays a preemption.
    preempted = classify(
        returncode=-15, preempted_by=15, events=[*starts, crash], stopped_after_rank_failure=True
    )
    assert preempted.outcome is Outcome.PREEMPTED


def test_a_rank_whose_data_loader_worker_was_killed_is_the_failed_rank_not_a_peer_ettr_stopped():
    # accelerate's checkpointing.py, kill -9 of rank 1's DataLoader worker: rank 1 raised "DataLoader worker
    # (pid 359) is killed by signal: Killed."; the supervisor saw the worker gone with that FAILURE on record
    # and stopped the rest; rank 0 died of the SIGTERM first (torchrun's root cause), rank 1 after its teardown.
    # The books said "rank 0 failed (no exception recorded)".
    starts = [Event(EventKind.PROCESS_START, 1.0, 0, r, data={"pid": 100 + r}) for r in (0, 1)]
    killed = {
        "exception": "RuntimeError",
        "message": "DataLoader worker (pid 359) is killed by signal: Killed. ",
    }
    raised = Event(EventKind.FAILURE, 2.0, 0, 1, data=killed)
    summary = [  # torchrun's: the other failures, then the root cause
        "  rank      : 1 (local_rank: 1)",
        "  exitcode  : -15 (pid: 101)  (SIGTERM)",
        "  rank      : 0 (local_rank: 0)",
        "  exitcode  : -15 (pid: 100)  (SIGTERM)",
    ]
    end = classify(returncode=1, events=[*starts, raised], failed_pids=[[359]], stderr_tail=summary,
                   stopped_after_rank_failure=True)  # fmt: skip
    assert end.outcome is Outcome.FAILED and end.exception == "RuntimeError", end
    assert end.reason.startswith("rank 1 failed: RuntimeError; ettr stopped the rest"), end.reason
    assert not end.oom, end
    # The same while the cgroup's OOM-kill counter rose: the kernel's OOM killer took the worker (it read
    # `process_lost`, as a kill -9 does).
    oom = classify(returncode=1, events=[*starts, raised], failed_pids=[[359]], stderr_tail=summary,
                   stopped_after_rank_failure=True, oom_killed=True)  # fmt: skip
    assert oom.oom and oom.outcome is Outcome.FAILED, oom
    alone = classify(returncode=1, events=[*starts, raised], oom_killed=True)  # no stop of the rest by ettr
    assert alone.oom, alone
    # A rank's own RuntimeError while some other process of the cgroup was OOM-killed is not the worker's.
    other = Event(EventKind.FAILURE, 2.0, 0, 1, data={"exception": "RuntimeError", "message": "boom"})
    assert not classify(returncode=1, events=[*starts, other], oom_killed=True).oom
    # A rank seen gone still decides; a broken collective alone names nobody.
    assert first_failed_rank([[359], [100]], {100: 0, 101: 1}, [raised]) == 0
    reset = Event(
        EventKind.FAILURE,
        2.0,
        0,
        0,
        data={"exception": "RuntimeError", "message": "Connection reset by peer"},
    )
    assert first_failed_rank([[359]], {100: 0, 101: 1}, [reset]) is None
    assert first_failed_rank([[359]], {100: 0, 101: 1}, [reset, raised]) == 1


def test_a_rank_that_ended_without_an_exception_before_its_peers_broke_is_the_failure(tmp_path) -> None:
    # Field trial: rank 1 of pytorch/examples' DDP tutorial called sys.exit(0) mid-epoch; rank 0 then died of
    # gloo's "Connection closed by peer": printed as rank 0's RuntimeError, booked `infra (collective)`, and
    # all 4 attempts ran at once. Its clean-exit mark (run_env.exited_path) came before rank 0's FAILURE.
    import os

    from ettr.run_env import exited_path
    from ettr.supervisor.gone import exited_early
    from ettr.untrusted import make_dirs_below

    gloo = "[pair.cc:553] Connection closed by peer [127.0.0.1]:33695. This is typically caused by a remote worker"
    events = [
        Event(EventKind.PROCESS_START, 1.0, 0, 0, data={"pid": 101}),
        Event(EventKind.PROCESS_START, 1.0, 0, 1, data={"pid": 102}),
        Event(EventKind.FAILURE, 20.0, 0, 0, data={"exception": "RuntimeError", "message": gloo}),
    ]
    assert exited_early(tmp_path, 0, {}, events) is None  # no rank marked an exit: the collective it is
    mark = exited_path(tmp_path, 0, 102)
    make_dirs_below(tmp_path, mark.parent)
    mark.write_bytes(b"")
    os.utime(mark, (19.0, 19.0))
    early = exited_early(tmp_path, 0, {}, events)
    assert early is not None and early.startswith("rank 1 exited without an exception")
    end = classify(returncode=1, stderr_tail=[f"RuntimeError: {gloo}"], events=events)
    end = AttemptEnd.from_data({**end.to_data(), "reason": f"{early}: {end.reason}"})
    found = diagnose(outcome=end.outcome, failure=end.to_data(), trained=True)
    assert found.detail is Detail.UNKNOWN and "rank 1 exited" in found.evidence
    os.utime(mark, (21.0, 21.0))  # rank 1 finished after rank 0 had failed: not the cause
    assert exited_early(tmp_path, 0, {}, events) is None
    os.utime(mark, (19.0, 19.0))
    own = [
        *events[:2],
        Event(EventKind.FAILURE, 20.0, 0, 0, data={"exception": "ValueError", "message": "bad"}),
    ]
    assert exited_early(tmp_path, 0, {}, own) is None  # rank 0's own error: its own failure


def test_a_hang_after_a_handler_took_a_signal_from_outside_says_so() -> None:
    # Field trial: rank 1 of the DDP tutorial caught a SIGTERM not sent by the supervisor and its handler never
    # returned; the watchdog's line said only that both ranks were quiet.
    end = classify(
        returncode=-15, hung_after_s=10.0, signalled=[(5.0, 1, "SIGTERM")], hung_ranks="rank 1 quiet"
    )
    assert end.outcome is Outcome.HUNG
    assert "rank 1 quiet; rank 1 received SIGTERM before it, not asked of the supervisor" in end.reason
    assert "received" not in classify(returncode=-15, hung_after_s=10.0).reason
