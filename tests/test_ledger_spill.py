"""SpillingLedger with an in-memory server that can go away: spill, deliver, exactly once, orphans."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ettr.events import Event, EventKind
from ettr.ledger import LedgerError, LedgerRejected
from ettr.ledger.rows import KeyedEvent
from ettr.ledger.spill import SpillingLedger, read_spill


class FakeServer:
    """A keyed server: `up` switches it; `commit_then_fail` stores the next insert and then raises."""

    def __init__(self, job_id: str = "j") -> None:
        self.job_id = job_id
        self.rows: dict[tuple[str, int], KeyedEvent] = {}
        self.up = True
        self.commit_then_fail = False
        self.num_inserts = 0
        self.lock = threading.Lock()

    def _check(self) -> None:
        if not self.up:
            raise LedgerError("server is down")

    def insert(self, records: Sequence[KeyedEvent], *, may_repeat: bool = True) -> None:
        with self.lock:
            self._check()
            self.num_inserts += 1
            for r in records:
                key = (r.writer, r.seq)
                assert may_repeat or key not in self.rows, "a first try must never repeat a key"
                self.rows.setdefault(key, r)
            if self.commit_then_fail:
                self.commit_then_fail = False
                raise LedgerError("connection lost after COMMIT")

    def read(self) -> list[Event]:
        self._check()
        return [r.event for r in self.rows.values()]

    def read_supervisor(self) -> list[Event]:
        return [e for e in self.read() if e.rank < 0]

    def read_attempt(self, attempt: int) -> list[Event]:
        return [e for e in self.read() if e.attempt == attempt and e.rank >= 0]

    def last_activity(self, attempt: int) -> float | None:
        self._check()
        found = [r.event.ts for r in self.rows.values() if r.event.attempt == attempt and r.event.rank >= 0]
        return max(found, default=None)

    def close(self) -> None:
        pass


def _steps(first: int, n: int, attempt: int = 0) -> list[Event]:
    return [Event(EventKind.STEP, 1000.0 + i, attempt, 0, step=i) for i in range(first, first + n)]


def _ledger(server: FakeServer, tmp_path, **kwargs) -> SpillingLedger:
    kwargs.setdefault("retry_interval_s", 0.05)
    return SpillingLedger(
        lambda: server, job_id=server.job_id, spill_dir=tmp_path / "spill", node="n", **kwargs
    )


def _wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_up_server_gets_events_directly_and_nothing_is_spilled(tmp_path):
    server = FakeServer()
    ledger = _ledger(server, tmp_path)
    ledger.append(_steps(0, 10))
    assert sorted(e.step for e in ledger.read()) == list(range(10))
    assert not (tmp_path / "spill").exists()
    ledger.close()


def test_an_outage_spills_and_the_return_delivers_every_event_once(tmp_path):
    server = FakeServer()
    ledger = _ledger(server, tmp_path)
    ledger.append(_steps(0, 5))
    server.up = False
    ledger.append(_steps(5, 5))  # fails on the server, goes to the spill file
    num_tries = server.num_inserts
    ledger.append(_steps(10, 5))  # while down: straight to the file, the server is not asked
    assert server.num_inserts == num_tries and ledger.backlog
    spilled = list((tmp_path / "spill").glob("*.jsonl"))
    assert len(spilled) == 1 and [r.event.step for r in read_spill(spilled[0])[1]] == list(range(5, 15))
    with pytest.raises(LedgerError, match="unreachable"):
        ledger.read()
    server.up = True
    _wait_for(lambda: not ledger.backlog)
    ledger.append(_steps(15, 5))
    assert sorted(e.step for e in ledger.read()) == list(range(20))
    ledger.close()
    assert not spilled[0].exists()  # delivered and removed at close


def test_a_batch_committed_before_the_connection_died_is_not_stored_twice(tmp_path):
    server = FakeServer()
    ledger = _ledger(server, tmp_path)
    server.commit_then_fail = True
    ledger.append(_steps(0, 10))  # stored, but the caller saw a failure: spilled with the same keys
    assert ledger.backlog
    _wait_for(lambda: not ledger.backlog)
    assert sorted(e.step for e in ledger.read()) == list(range(10))
    assert len(server.rows) == 10
    ledger.close()


def test_a_server_down_at_start_does_not_fail_the_writer(tmp_path):
    server = FakeServer()
    server.up = False
    calls = []

    def connect() -> FakeServer:
        calls.append(1)
        if not server.up:
            raise LedgerError("connection refused")
        return server

    ledger = SpillingLedger(
        connect, job_id="j", spill_dir=tmp_path / "spill", node="n", retry_interval_s=0.05
    )
    ledger.append(_steps(0, 3))
    assert ledger.server_down and ledger.backlog
    assert ledger.health().server_down and ledger.health().backlog and ledger.health().pending
    server.up = True
    _wait_for(lambda: not ledger.backlog)
    assert not ledger.health().pending
    assert sorted(e.step for e in server.read()) == [0, 1, 2] and len(calls) >= 2
    ledger.close()


def test_last_activity_reads_the_spill_files_during_an_outage(tmp_path):
    server = FakeServer()
    ledger = _ledger(server, tmp_path, retry_interval_s=60)
    ledger.append(_steps(0, 3, attempt=1))  # ts 1000..1002 on the server
    assert ledger.last_activity(1) == 1002.0
    server.up = False
    ledger.append([Event(EventKind.STEP, 2000.0, 1, 0, step=3), Event(EventKind.ATTEMPT_END, 3000.0, 1, -1)])
    assert ledger.last_activity(1) == 2000.0  # the supervisor's own event is no sign of life
    assert ledger.last_activity(0) is None
    ledger.close()


def test_undelivered_events_stay_on_disk_and_the_supervisor_adopts_them(tmp_path):
    server = FakeServer()
    server.up = False
    trainer = _ledger(server, tmp_path)
    trainer.append(_steps(0, 4))
    trainer.close()  # the server is still away: the file stays, unlocked (an orphan)
    (orphan,) = (tmp_path / "spill").glob("*.jsonl")
    other_job = FakeServer(job_id="other")
    assert _ledger(other_job, tmp_path, adopt_orphans=True).deliver()  # not its job: left alone
    assert orphan.exists() and not other_job.rows
    server.up = True
    supervisor = _ledger(server, tmp_path, adopt_orphans=True)
    assert supervisor.deliver()
    assert sorted(e.step for e in server.read()) == [0, 1, 2, 3] and not orphan.exists()
    supervisor.close()


def test_a_live_writers_file_is_not_adopted(tmp_path):
    server = FakeServer()
    server.up = False
    trainer = _ledger(server, tmp_path, retry_interval_s=60)
    trainer.append(_steps(0, 2))
    server.up = True
    supervisor = _ledger(server, tmp_path, adopt_orphans=True, retry_interval_s=60)
    supervisor.deliver()
    assert not server.rows  # the trainer is alive: it delivers its own file
    assert trainer.deliver()
    assert len(server.rows) == 2
    trainer.close()
    supervisor.close()


_KILLED = """
import sys
from ettr.events import Event, EventKind
from ettr.ledger.spill import SpillingLedger
from ettr.ledger import LedgerError, LedgerRejected

def connect():
    raise LedgerError("down")

ledger = SpillingLedger(connect, job_id="j", spill_dir=sys.argv[1], node="n", retry_interval_s=60)
for i in range(50):
    ledger.append([Event(EventKind.STEP, 1.0 + i, 0, 0, step=i)])
print("ready", flush=True)
sys.stdin.readline()
"""


def test_a_killed_writers_spill_is_complete_and_a_torn_line_is_skipped(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED, str(tmp_path / "spill")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    proc.kill()
    proc.wait(30)
    (path,) = (tmp_path / "spill").glob("*.jsonl")
    with open(path, "ab") as f:
        f.write(json.dumps([50, 99.0, "step", 0, 0, None, 50, None]).encode()[:-5])  # torn mid-write
    server = FakeServer()
    supervisor = _ledger(server, tmp_path, adopt_orphans=True)
    assert supervisor.deliver()
    assert sorted(e.step for e in server.read()) == list(range(50))
    supervisor.close()


def test_spill_write_failure_beyond_what_memory_holds_is_a_ledger_error(tmp_path):
    server = FakeServer()
    server.up = False
    blocker = tmp_path / "spill"
    blocker.write_text("a file where the spill directory should be")
    ledger = _ledger(server, tmp_path, max_held_events=3)
    ledger.append(_steps(0, 2))  # held in memory
    with pytest.raises(LedgerError, match="cannot spill"):
        ledger.append(_steps(2, 2))  # 4 > 3: refused whole, none of it held
    server.up = True
    _wait_for(lambda: not ledger.backlog)
    assert sorted(e.step for e in server.read()) == [0, 1]
    ledger.close()


def test_an_outage_on_a_full_disk_keeps_the_events_and_delivers_them_once(tmp_path, caplog):
    # A stalled server and a full run directory: the writer dropped every batch it could not spill ("62
    # events could not be written"), and the supervisor the steps it recorded after the attempt's end,
    # though the server came back while it still ran: the report had 4 of a job's 60 steps (ETT 5.2%).
    server = FakeServer()
    server.up = False
    blocker = tmp_path / "spill"
    blocker.write_text("a file where the spill directory should be")  # any spill write fails
    ledger = _ledger(server, tmp_path)
    for first in range(0, 30, 10):
        ledger.append(_steps(first, 10))
    assert ledger.backlog and caplog.text.count("keeping them in memory") == 1
    server.up = True
    _wait_for(lambda: not ledger.backlog)
    ledger.append(_steps(30, 5))
    assert sorted(e.step for e in ledger.read()) == list(range(35))
    assert len(server.rows) == 35
    ledger.close()


def test_held_events_move_to_the_spill_file_when_the_disk_is_back_first(tmp_path):
    server = FakeServer()
    server.up = False
    blocker = tmp_path / "spill"
    blocker.write_text("a file where the spill directory should be")
    ledger = _ledger(server, tmp_path)
    ledger.append(_steps(0, 5))
    blocker.unlink()  # space again; the server is still away
    _wait_for(lambda: any(blocker.glob("*.jsonl")) and not ledger._held)
    ledger.append(_steps(5, 5))
    ledger.close()  # the server is away: what is pending stays on disk for the supervisor
    (spilled,) = blocker.glob("*.jsonl")
    assert sorted(r.event.step for r in read_spill(spilled)[1]) == list(range(10))


def test_held_events_that_nothing_takes_by_the_close_are_said_lost(tmp_path, caplog):
    server = FakeServer()
    server.up = False
    (tmp_path / "spill").write_text("a file where the spill directory should be")
    ledger = _ledger(server, tmp_path)
    ledger.append(_steps(0, 7))
    ledger.close()
    assert "7 ledger event(s) are lost" in caplog.text


def test_background_connect_never_makes_the_constructor_wait(tmp_path):
    server = FakeServer()
    gate = threading.Event()
    connecting = threading.Event()

    def connect() -> FakeServer:
        connecting.set()
        if not gate.wait(30):
            raise LedgerError("never let through")
        return server

    ledger = SpillingLedger(
        connect, job_id="j", spill_dir=tmp_path / "spill", node="n", background_connect=True
    )
    assert connecting.wait(10) and not gate.is_set()  # constructed while the connection is still pending
    writer = threading.Thread(target=ledger.append, args=(_steps(0, 3),))
    writer.start()  # the Recorder's writer thread: waits for the pending connection
    gate.set()
    writer.join(30)
    assert sorted(e.step for e in server.read()) == [0, 1, 2] and not ledger.backlog
    ledger.close()


_ops = st.lists(
    st.sampled_from(["append", "append", "append", "down", "up", "ambiguous", "deliver", "crash"]),
    min_size=1,
    max_size=30,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_ops)
def test_any_mix_of_outages_and_crashes_stores_every_event_exactly_once(tmp_path_factory, ops):
    """Writers come and go (a crash drops one without closing it), the server goes away and comes back, a
    commit's answer gets lost: once the server is up and the supervisor has delivered, every event appended
    is stored exactly once."""
    tmp_path = tmp_path_factory.mktemp("spill")
    server = FakeServer()
    writers = [_ledger(server, tmp_path, retry_interval_s=3600)]
    num_appended = 0
    for op in ops:
        if op == "append":
            writers[-1].append(_steps(num_appended, 3))
            num_appended += 3
        elif op == "down":
            server.up = False
        elif op == "up":
            server.up = True
        elif op == "ambiguous":
            server.commit_then_fail = True
        elif op == "deliver":
            writers[-1].deliver()
        elif op == "crash":  # the process dies: its flock goes, its file stays; a new writer takes over
            crashed = writers[-1]
            crashed._closed = True
            if crashed._file is not None:
                os.close(crashed._file._fd)
                crashed._file = None
            writers.append(_ledger(server, tmp_path, retry_interval_s=3600))
    server.up, server.commit_then_fail = True, False
    for writer in writers:
        writer.close()
    supervisor = _ledger(server, tmp_path, adopt_orphans=True, retry_interval_s=3600)
    assert supervisor.deliver()
    supervisor.close()
    steps = sorted(r.event.step for r in server.rows.values())
    assert steps == list(range(num_appended))


class PickyServer(FakeServer):
    """Refuses, as data it cannot store, any batch holding an event with step 13 (the whole transaction)."""

    def insert(self, records: Sequence[KeyedEvent], *, may_repeat: bool = True) -> None:
        if any(r.event.step == 13 for r in records):
            raise LedgerRejected("invalid input value")
        super().insert(records, may_repeat=may_repeat)


def test_an_event_the_server_refuses_holds_back_nothing_else_and_is_kept(tmp_path):
    server = PickyServer()
    ledger = _ledger(server, tmp_path)
    ledger.append(_steps(0, 20))  # a first try, refused as a whole: split until only step 13 is left
    assert not ledger.server_down and not ledger.backlog
    server.up = False
    ledger.append(_steps(20, 5))
    server.up = True
    assert ledger.deliver()
    assert sorted(e.step for e in server.read()) == [s for s in range(25) if s != 13]
    (kept,) = (tmp_path / "spill").glob("*.rejected")
    assert [json.loads(line)[6] for line in kept.read_text().splitlines()] == [13]
    ledger.close()


# -- other jobs' and damaged spill files (issue 25 item 3) ---------------------------------------------------
def _plant(directory, name: str, header: object, lines: list) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    text = json.dumps(header) + "\n" + "".join(json.dumps(line) + "\n" for line in lines)
    (directory / name).write_text(text)


def test_another_jobs_spill_file_is_no_sign_of_life_and_is_not_delivered(tmp_path):
    """A spill file of another job in this run directory (a reused directory, a copy, a forgery): its
    times say nothing of this job (one of 1970 read as 'no progress for 1.8e9 s'; one of 2286 would hide a
    hang for ever), and its events are not this job's to deliver."""
    server = FakeServer("mine")
    ledger = _ledger(server, tmp_path, adopt_orphans=True)
    try:
        header = {"spill": 1, "job_id": "theirs", "writer": "w-theirs", "node": "n"}
        step = lambda ts: [7, ts, "step", 0, 0, None, 1, None, None]  # noqa: E731
        _plant(tmp_path / "spill", "w-old.jsonl", header, [step(1.0)])
        _plant(tmp_path / "spill", "w-new.jsonl", header, [step(9.9e9)])
        server.up = False
        assert ledger.last_activity(0) is None
        ledger.append(_steps(0, 3))
        assert ledger.last_activity(0) == 1002.0
        server.up = True
        _wait_for(ledger.deliver)
        assert {r.writer for r in server.rows.values()} == {ledger.writer}
        assert (tmp_path / "spill" / "w-old.jsonl").exists()  # left to its own job
    finally:
        ledger.close()


@pytest.mark.parametrize(
    "damage",
    ["no_writer", "bad_header", "bad_seq", "not_rows", "nested", "fifo", "sparse"],
)
def test_a_damaged_orphan_is_set_aside_once_and_never_holds_the_job_end(tmp_path, damage):
    """A malformed orphan spill file of this job is delivered as far as it can be read, or renamed aside
    (`.bad`) once; closing the ledger then has nothing left to wait for (it waited its whole drain time,
    60 s, at every job end)."""
    server = FakeServer("j")
    spill = tmp_path / "spill"
    good = [3, 1000.0, "step", 0, 0, None, 1, None, None]
    header = {"spill": 1, "job_id": "j", "writer": "w-dead", "node": "n"}
    if damage == "no_writer":
        _plant(spill, "w-dead.jsonl", {"spill": 1, "job_id": "j"}, [good])
    elif damage == "bad_header":
        _plant(spill, "w-dead.jsonl", {"spill": 1, "job_id": "j", "writer": ["w"] * 40}, [good])
    elif damage == "bad_seq":
        _plant(spill, "w-dead.jsonl", header, [["x", *good[1:]], [10**400, *good[1:]], good])
    elif damage == "not_rows":
        _plant(spill, "w-dead.jsonl", header, [{"a": 1}, 5, "x", good])
    elif damage == "nested":
        spill.mkdir(parents=True)
        (spill / "w-dead.jsonl").write_text(json.dumps(header) + "\n" + "[" * 100_000 + "\n")
    elif damage == "sparse":  # a good header, then GBs of holes: never loaded
        _plant(spill, "w-dead.jsonl", header, [good])
        os.truncate(spill / "w-dead.jsonl", 3 << 30)
    else:
        spill.mkdir(parents=True)
        os.mkfifo(spill / "w-dead.jsonl")
    ledger = _ledger(server, tmp_path, adopt_orphans=True)
    start = time.monotonic()
    assert ledger.deliver()
    ledger.close(drain_timeout_s=60.0)
    assert time.monotonic() - start < 30.0  # nothing waited for the drain's 60 s
    left = sorted(p.name for p in spill.iterdir())
    if damage == "fifo":  # names no job: left alone, and never opened in a way that blocks
        assert left == ["w-dead.jsonl"]
    elif damage in ("no_writer", "bad_header", "sparse"):  # cannot be read at all: kept aside for a person
        assert left == ["w-dead.jsonl.bad"]
    else:  # its readable records delivered, its damaged lines skipped
        assert left == []
    if damage in ("bad_seq", "not_rows"):
        assert [r.seq for r in server.rows.values()] == [3]


@pytest.mark.parametrize("planted", ["symlink", "hardlink", "fifo", "dir_symlink"])
def test_refused_events_are_never_written_through_a_planted_link(tmp_path, caplog, planted):
    """Anyone who can write the run directory may plant `<writer>.rejected -> ~/.bashrc`: the refused events
    must not be appended there (they were: shell code run at the next login). The warning says where they
    could not be kept and carries them instead."""
    victim = tmp_path / "bashrc"
    victim.write_text("# mine\n")
    spill = tmp_path / "spill"
    server = PickyServer()
    ledger = _ledger(server, tmp_path)
    rejected = spill / f"{ledger.writer}.rejected"
    if planted == "dir_symlink":
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        spill.symlink_to(elsewhere)
    else:
        spill.mkdir()
        if planted == "symlink":
            rejected.symlink_to(victim)
        elif planted == "hardlink":
            os.link(victim, rejected)
        else:
            os.mkfifo(rejected)  # opened for writing it would wait for a reader for ever
    with caplog.at_level("WARNING", logger="ettr"):
        ledger.append(_steps(12, 3))  # step 13 refused
    ledger.close()
    assert victim.read_text() == "# mine\n"
    if planted == "dir_symlink":
        assert list((tmp_path / "elsewhere").iterdir()) == []
    assert sorted(e.step for e in server.read()) == [12, 14]
    (line,) = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert "could not be kept" in line and '"step",0,0,null,13' in line
