"""The Recorder: cheap appends, background writing, urgent flushes, never raising into training."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

import ettr
from ettr import runtime
from ettr.events import Event, EventKind, Phase
from ettr.ledger import MemoryLedger, open_ledger
from ettr.procs import process_start_time
from ettr.recorder import NullRecorder, Recorder, RecorderProtocol
from ettr.runtime import recorder_from_env, set_recorder


def test_phase_step_and_spans_reach_the_ledger():
    ledger = MemoryLedger()
    rec = Recorder(ledger, attempt=2, rank=1, flush_interval_s=10)
    with rec.phase(Phase.COMPILE, step=0):
        pass
    rec.span("restore", 1.0, 2.0, step=5)
    rec.step(6)
    rec.resumed_from(5)
    rec.flush()
    events = ledger.read()
    assert [e.kind for e in events] == [
        EventKind.PHASE_BEGIN,
        EventKind.PHASE_END,
        EventKind.PHASE_END,
        EventKind.STEP,
        EventKind.RESUMED,
    ]
    begin, end = events[0], events[1]
    assert end.value == begin.ts and end.phase is Phase.COMPILE
    assert events[2].value == 1.0 and events[2].ts == 2.0 and events[2].phase is Phase.RESTORE
    assert all(e.attempt == 2 and e.rank == 1 for e in events)
    rec.close()


def test_unknown_phase_name_is_recorded_as_other_not_raised():
    ledger = MemoryLedger()
    rec = Recorder(ledger)
    with rec.phase("warmup_my_cache"):
        pass
    rec.flush()
    end = ledger.read()[-1]
    assert end.phase is Phase.OTHER and end.data == {"name": "warmup_my_cache"}
    rec.close()


def test_phase_end_is_recorded_when_the_block_raises():
    ledger = MemoryLedger()
    rec = Recorder(ledger)
    with pytest.raises(ZeroDivisionError), rec.phase(Phase.INIT):
        raise ZeroDivisionError("boom")
    rec.flush()
    assert ledger.read()[-1].data == {"error": "ZeroDivisionError"}
    rec.close()


def test_writer_thread_flushes_within_the_interval():
    ledger = MemoryLedger()
    rec = Recorder(ledger, flush_interval_s=0.05)
    rec.step(1)
    deadline = time.time() + 5
    while not ledger.read() and time.time() < deadline:
        time.sleep(0.01)
    assert [e.step for e in ledger.read()] == [1]
    rec.close()


class _BrokenLedger:
    def __init__(self) -> None:
        self.fail = True
        self.events: list = []

    def append(self, events):
        if self.fail:
            raise OSError("disk full")
        self.events.extend(events)

    def read(self):
        return list(self.events)

    def close(self):
        pass


def test_a_broken_ledger_never_raises_and_keeps_events_for_later():
    ledger = _BrokenLedger()
    rec = Recorder(ledger, flush_interval_s=10)
    rec.step(1)
    rec.flush()  # fails inside, logged, not raised
    rec.step(2)
    ledger.fail = False
    rec.flush()
    assert [e.step for e in ledger.events] == [1, 2]
    rec.close()


def test_explicit_steps_win_over_automatic_ones():
    ledger = MemoryLedger()
    rec = Recorder(ledger)
    rec.step(1, auto=True)
    rec.step(10)
    rec.step(2, auto=True)  # ignored: user code counts steps itself
    rec.flush()
    assert [e.step for e in ledger.read()] == [1, 10]
    rec.close()


def test_step_listeners_run_after_the_step_and_errors_do_not_escape():
    ledger = MemoryLedger()
    rec = Recorder(ledger)
    seen: list[int] = []
    rec.add_step_listener(seen.append)
    rec.add_step_listener(lambda s: 1 / 0)
    rec.step(3)
    assert seen == [3] and rec.last_step == 3
    rec.close()


def test_thread_safety_of_concurrent_recording():
    ledger = MemoryLedger()
    rec = Recorder(ledger, flush_interval_s=0.01)

    def work(offset: int) -> None:
        for i in range(2000):
            rec.mark("m", i=offset + i)

    threads = [threading.Thread(target=work, args=(k * 10_000,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rec.close()
    assert len(ledger.read()) == 8000


def test_null_recorder_records_nothing():
    rec = NullRecorder()
    rec.step(1)
    with rec.phase(Phase.COMPILE):
        pass
    rec.flush()
    assert not rec.enabled


def test_recorder_from_env_reads_rank_attempt_and_run_dir(tmp_path):
    env = {
        "ETTR_RUN_DIR": str(tmp_path),
        "ETTR_ATTEMPT": "3",
        "ETTR_JOB_ID": "j",
        "RANK": "1",
        "WORLD_SIZE": "2",
    }
    rec = recorder_from_env(env)
    assert (rec.attempt, rec.rank, rec.world_size, rec.job_id) == (3, 1, 2, "j")
    rec.close()
    (event,) = open_ledger(tmp_path).read()
    assert event.kind is EventKind.PROCESS_START and event.rank == 1 and event.attempt == 3
    assert event.ts <= time.time() and event.data["pid"] == os.getpid()


def test_process_start_time_is_before_now_and_recent():
    """This (long-lived: a test session under load runs for over an hour) process started before now; a
    process started now says it started between the moment it was spawned and its answer (to a clock tick)."""
    assert process_start_time() <= time.time()
    before = time.time()
    code = "from ettr.procs import process_start_time; print(repr(process_start_time()))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    after = time.time()
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    assert before - 2 * tick <= float(out.stdout) <= after


def test_facade_is_a_no_op_without_a_run(monkeypatch):
    monkeypatch.delenv("ETTR_RUN_DIR", raising=False)
    set_recorder(None)
    try:
        ettr.step(1)
        with ettr.phase(ettr.Phase.INIT):
            pass
        assert not ettr.get_recorder().enabled
    finally:
        set_recorder(None)


_KILLED = """
import os, signal, sys, time
import ettr
rec = ettr.get_recorder()
rec.flush_interval_s = 0.2
for i in range(1, 1000000):
    ettr.step(i)
    if i == 50:
        ettr.checkpoint_committed(50, "/ckpt/50")   # urgent: written at once
    time.sleep(0.001)
    if i == 800:
        time.sleep(1.0)  # every step before this one is older than a flush interval
        os.kill(os.getpid(), signal.SIGKILL)
"""


def test_sigkill_loses_at_most_the_last_second(tmp_path):
    env = {**os.environ, "ETTR_RUN_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", _KILLED], env=env, timeout=60)
    assert proc.returncode == -9
    events = open_ledger(tmp_path).read()
    steps = [e.step for e in events if e.kind is EventKind.STEP]
    assert steps == list(range(1, 801))
    assert any(e.kind is EventKind.CHECKPOINT_COMMIT for e in events)


_STANDALONE = """
import sys, ettr
ettr.init(sys.argv[1], job_id="solo")
for i in range(1, 4):
    ettr.step(i)
if sys.argv[2] == "fail":
    raise RuntimeError("boom")
"""


def test_init_without_supervisor_records_attempts(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    run = tmp_path / "solo"
    first = subprocess.run(
        [sys.executable, "-c", _STANDALONE, str(run), "fail"], env=env, capture_output=True
    )
    assert first.returncode == 1
    second = subprocess.run([sys.executable, "-c", _STANDALONE, str(run), "ok"], env=env, capture_output=True)
    assert second.returncode == 0, second.stderr
    events = open_ledger(run).read()
    ends = [(e.attempt, e.data["outcome"]) for e in events if e.kind is EventKind.ATTEMPT_END]
    assert ends == [(0, "failed"), (1, "completed")]
    assert [e.kind for e in events if e.rank == -1][-1] is EventKind.JOB_END
    assert any(e.kind is EventKind.FAILURE and e.data["exception"] == "RuntimeError" for e in events)


def test_recording_inside_compiled_code_is_skipped_but_other_threads_still_record():
    torch = pytest.importorskip("torch")
    ledger = MemoryLedger()
    rec = Recorder(ledger)

    def double(x):
        rec.mark("traced")  # under Dynamo: skipped, and no graph break (fullgraph would raise)
        return x * 2

    compiled = torch.compile(double, fullgraph=True, backend="eager")
    done = threading.Event()

    def other_thread() -> None:
        while not done.is_set():
            rec.mark("other")
            time.sleep(0.001)

    thread = threading.Thread(target=other_thread)
    thread.start()
    try:
        assert compiled(torch.ones(3)).tolist() == [2.0, 2.0, 2.0]
    finally:
        done.set()
        thread.join()
    rec.flush()
    names = [e.data["name"] for e in ledger.read()]
    assert "traced" not in names and "other" in names
    rec.close()


# -- listeners, the synchronous test recorder, process hooks ---------------------------------------------
def test_listeners_see_every_event_synchronously_and_never_break_recording(caplog):
    rec = Recorder(MemoryLedger(), attempt=1, rank=2, flush_interval_s=60)
    seen: list[Event] = []

    def broken(event: Event) -> None:
        raise RuntimeError("listener bug")

    rec.add_listener(seen.append)
    rec.add_listener(broken)
    with caplog.at_level("WARNING", logger="ettr"):
        with rec.phase(Phase.DATA_WAIT):
            assert [e.kind for e in seen] == [EventKind.PHASE_BEGIN]  # before the block runs
        rec.step(4)
        rec.step(5)
    assert [e.kind for e in seen] == [
        EventKind.PHASE_BEGIN,
        EventKind.PHASE_END,
        EventKind.STEP,
        EventKind.STEP,
    ]
    assert (seen[2].attempt, seen[2].rank, seen[2].step) == (1, 2, 4)
    assert sum("listener" in r.getMessage() for r in caplog.records) == 1  # logged once
    rec.remove_listener(seen.append)
    rec.remove_listener(broken)
    rec.remove_listener(broken)  # not registered any more: a no-op
    rec.mark("after")
    assert len(seen) == 4
    rec.flush()
    assert [e.kind for e in rec._ledger.read()][-1] is EventKind.MARK
    rec.close()


def test_a_recorder_that_writes_nothing_still_tells_its_listeners():
    rec = NullRecorder()
    seen: list[Event] = []
    rec.add_listener(seen.append)
    rec.training_started()
    assert [e.kind for e in seen] == [EventKind.TRAINING_START]


def test_sync_recorder_writes_before_returning_without_thread_or_hooks(monkeypatch):
    from ettr.testing.recorder import SyncRecorder

    registered: list[object] = []
    monkeypatch.setattr("ettr.recorder.atexit.register", registered.append)
    threads = threading.active_count()
    rec = SyncRecorder(rank=1, attempt=2)
    assert isinstance(rec, RecorderProtocol)
    rec.step(3)
    rec.checkpoint_committed(3, "/ckpt/3")
    assert [(e.kind, e.step, e.rank, e.attempt) for e in rec.events()] == [
        (EventKind.STEP, 3, 1, 2),
        (EventKind.CHECKPOINT_COMMIT, 3, 1, 2),
    ]
    rec.install_process_hooks()
    assert threading.active_count() == threads and registered == [] and not rec.has_process_hooks
    rec.close()


def test_only_the_default_recorder_takes_process_hooks_and_close_removes_them(monkeypatch, tmp_path):
    registered: list[object] = []
    unregistered: list[object] = []
    monkeypatch.setattr("ettr.recorder.atexit.register", registered.append)
    monkeypatch.setattr("ettr.recorder.atexit.unregister", unregistered.append)
    plain = Recorder(MemoryLedger(), flush_interval_s=60)
    assert registered == [] and not plain.has_process_hooks
    default = Recorder(MemoryLedger(), flush_interval_s=60)
    try:
        runtime.set_recorder(default)
        assert default.has_process_hooks and registered == [default.close]
        default.close()
        assert not default.has_process_hooks and unregistered == [default.close]
    finally:
        runtime.set_recorder(None)
        plain.close()


def test_an_exception_a_dataloader_worker_raised_is_recorded_in_the_workers_own_words():
    # Field trial: a Dataset raising in a DataLoader worker under `ettr run -- torchrun ...` was printed
    # `ValueError: Caught ValueError in DataLoader worker process 0.` (console and report): torch's frames
    # filled the 500 characters kept, and what the dataset said was lost. Text as torch 2.13 words it.
    frames = "".join(
        f'  File "/venv/torch/utils/data/_utils/f{i}.py", line 54, in fetch\n    x = y\n' for i in range(9)
    )
    text = (
        "Caught ValueError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
        f'{frames}  File "/tmp/datautils.py", line 15, in __getitem__\n    raise ValueError(...)\n'
        "ValueError: corrupt sample 1500: cannot decode record\n"
    )
    ledger = MemoryLedger()
    rec = Recorder(ledger, flush_interval_s=10)
    rec.failure(ValueError(text))
    rec.failure(KeyError("plain"))
    rec.close()
    said = [e.data["message"] for e in ledger.read() if e.kind is EventKind.FAILURE]
    assert said == [
        "corrupt sample 1500: cannot decode record (raised in DataLoader worker process 0)",
        "'plain'",
    ]


def test_the_end_of_training_is_marked_at_its_step_but_not_on_the_way_out_of_a_failure():
    from ettr.constants import TRAINING_ENDED_MARK
    from ettr.testing.recorder import SyncRecorder

    rec = SyncRecorder(rank=0)
    rec.resumed_from(80)
    rec.training_ended()  # the last step it reached: the one it resumed from
    rec.step(81)
    rec.training_ended(81)
    try:
        raise ValueError("boom")
    except ValueError:
        rec.training_ended(82)  # a `finally:` or `except:` of a failed loop: no end of training
    marks = [(e.step, e.data) for e in rec.events() if e.kind is EventKind.MARK]
    assert marks == [(80, {"name": TRAINING_ENDED_MARK}), (81, {"name": TRAINING_ENDED_MARK})]
