"""The ledger survives its own corruption and its disk (issue 12 items 3-4): bad rows are skipped (fuzzed),
`ettr run` continues or refuses in one line after any single-bit flip, a read-only ledger is reported, a
deleted write-ahead log is detected and the ledger reopened, and a full disk loses no batch whole.

Full disks are simulated two ways: a ledger wrapper that raises OSError(ENOSPC) (everywhere), and, as root
where mounting is allowed, a 1 MB tmpfs filled to the brim (`full_tmpfs`)."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ettr.accounting import compute
from ettr.cli import main as cli_main
from ettr.events import SUPERVISOR_RANK, Event, EventKind
from ettr.ledger import MemoryLedger, open_ledger, read_run_events
from ettr.recorder import MAX_BATCH, Recorder
from ettr.supervisor.books import JobBooks
from ettr.supervisor.config import RunConfig

T0 = 1_700_000_000.0


def killed_job(run_dir: Path, num_steps: int = 30) -> None:
    """The ledger a SIGKILLed supervisor leaves: an attempt started, steps, no end; its pid long gone."""
    ledger = open_ledger(run_dir)
    events = [
        Event(EventKind.SUPERVISOR_START, T0, 0, SUPERVISOR_RANK, data={"job_id": "flip", "pid": 2**22 + 17}),
        Event(EventKind.ATTEMPT_START, T0 + 1, 0, SUPERVISOR_RANK, data={"pid": 2**22 + 18}),
        *[Event(EventKind.STEP, T0 + 2 + i, 0, 0, step=i + 1) for i in range(num_steps)],
        Event(EventKind.CHECKPOINT_COMMIT, T0 + 20, 0, 0, step=18, data={"path": "/ckpt/step_18"}),
    ]
    ledger.append(events)
    ledger.close()


def _one_line_or_none(err: str) -> None:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("ettr run:")]
    assert len(lines) <= 1, err


# -- bad rows ------------------------------------------------------------------------------------------
_CELL = (
    st.none()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats()
    | st.text(max_size=30)
    | st.binary(max_size=16)
    | st.sampled_from(["step", "attempt_end", "phase_begin", "{}", '{"a": [1]}', "[[[[", "1e400"])
)


@pytest.mark.parametrize("column", ["kind", "phase", "data"])
def test_a_text_cell_that_is_not_utf8_is_one_skipped_row_not_an_unreadable_ledger(
    tmp_path, capsys, caplog, column
):
    """One TEXT cell whose bytes are not UTF-8 (a bit flip in the file, a forged row) made sqlite3 fail the
    whole read: `ettr report` exited 2 "cannot be read" and `ettr fleet` left the job out."""
    run_dir = tmp_path / "run"
    killed_job(run_dir, num_steps=5)
    conn = sqlite3.connect(run_dir / "ledger.db")
    bad = {"kind": "'step'", "phase": "NULL", "data": "NULL", column: "CAST(X'7b2261ff227d' AS TEXT)"}
    conn.execute(
        "INSERT INTO events (ts, kind, attempt, rank, phase, step, value, data) "
        f"VALUES ({T0 + 3.5}, {bad['kind']}, 0, 0, {bad['phase']}, 99, NULL, {bad['data']})"
    )
    if column == "data":  # and the record `job_id()` reads
        conn.execute(f"UPDATE events SET data = {bad['data']} WHERE kind = 'supervisor_start'")
    conn.commit()
    conn.close()
    steps = [e.step for e in read_run_events(run_dir) if e.kind is EventKind.STEP]
    assert steps == [1, 2, 3, 4, 5]  # the damaged row skipped, every other one read
    assert open_ledger(run_dir, create=False).job_id() in ("flip", None)
    assert cli_main(["report", str(run_dir), "--json"]) == 0
    assert f"skipped {2 if column == 'data' else 1} unreadable ledger records" in caplog.text
    assert '"job_id"' in capsys.readouterr().out
    assert cli_main(["fleet", str(run_dir), "--json"]) == 0
    assert '"job_id"' in capsys.readouterr().out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.tuples(*[_CELL] * 8), min_size=1, max_size=6))
def test_fuzz_rows_never_break_reading_accounting_or_the_report(tmp_path_factory, rows, capsys):
    run_dir = tmp_path_factory.mktemp("fuzz")
    killed_job(run_dir, num_steps=3)
    conn = sqlite3.connect(run_dir / "ledger.db")
    for row in rows:
        with contextlib.suppress(sqlite3.IntegrityError):  # NOT NULL columns refuse some rows: fine
            conn.execute(
                "INSERT INTO events (ts, kind, attempt, rank, phase, step, value, data) VALUES (?,?,?,?,?,?,?,?)",
                row,
            )
    conn.commit()
    conn.close()
    events = read_run_events(run_dir)
    compute(events, max((e.ts for e in events), default=T0))
    for argv in (["report", str(run_dir)], ["report", str(run_dir), "--json"]):
        assert cli_main(argv) in (0, 2)
        _one_line_or_none(capsys.readouterr().err)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_after_any_single_bit_flip_ettr_run_continues_the_job_or_refuses_in_one_line(tmp_path, capsys):
    pristine = tmp_path / "pristine"
    killed_job(pristine)
    size = (pristine / "ledger.db").stat().st_size
    rng = random.Random(12)
    outcomes: dict[int, int] = {}
    for trial in range(100):
        run_dir = tmp_path / f"flip-{trial}"
        shutil.copytree(pristine, run_dir)
        data = bytearray((run_dir / "ledger.db").read_bytes())
        bit = rng.randrange(size * 8)
        data[bit // 8] ^= 1 << (bit % 8)
        (run_dir / "ledger.db").write_bytes(bytes(data))
        status = cli_main(["run", "--run-dir", str(run_dir), "--max-restarts", "0", "--", "true"])
        err = capsys.readouterr().err
        assert status in (0, 2), (trial, bit, err)
        _one_line_or_none(err)
        if status == 2:
            assert len(err.strip().splitlines()) == 1, (trial, bit, err)
        outcomes[status] = outcomes.get(status, 0) + 1
    assert outcomes.get(0, 0) > 0  # most flips land in data the ledger can still use or skip


# -- a ledger the reader cannot write -------------------------------------------------------------------
def _mount(*args: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    path.mkdir(parents=True, exist_ok=True)
    if not _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)):
        pytest.skip("needs root and mount(8) for a tmpfs")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_a_ledger_on_a_read_only_mount_is_reported(tmp_path, capsys):
    with tmpfs(tmp_path / "ro", "4m") as mount:
        killed_job(mount / "run")
        # A live writer's WAL and -shm stay beside it, as on a snapshot of a running job.
        assert _mount("-o", "remount,ro", str(mount))
        assert cli_main(["report", str(mount / "run"), "--json"]) == 0
        out = capsys.readouterr().out
        # Its supervisor was SIGKILLed: the report is read, and says so (no failure counted until a requeue).
        assert '"state": "supervisor_lost"' in out and '"num_failures": 0' in out
        ledger = open_ledger(mount / "run", create=False)
        assert ledger.read_only and len(ledger.read()) == 33
        ledger.close()


def test_a_ledger_in_a_directory_without_write_permission_is_reported(tmp_path, capsys):
    run_dir = tmp_path / "run"
    killed_job(run_dir)
    for name in ("ledger.db-wal", "ledger.db-shm"):
        with contextlib.suppress(FileNotFoundError):
            (run_dir / name).unlink()
    os.chmod(run_dir / "ledger.db", 0o444)
    os.chmod(run_dir, 0o555)
    try:
        if os.geteuid() == 0:
            # root writes anyway; what root cannot do is create files on a read-only mount (test above)
            assert cli_main(["report", str(run_dir), "--json"]) == 0
        else:
            assert cli_main(["report", str(run_dir), "--json"]) == 0
        assert '"state": "supervisor_lost"' in capsys.readouterr().out
    finally:
        os.chmod(run_dir, 0o755)


# -- a deleted write-ahead log ------------------------------------------------------------------------
def test_a_deleted_wal_is_detected_and_every_writer_keeps_recording(tmp_path):
    supervisor = open_ledger(tmp_path)  # holds the log from the start, as `ettr run` does
    supervisor.append([Event(EventKind.SUPERVISOR_START, T0, 0, SUPERVISOR_RANK)])
    trainer = open_ledger(tmp_path)
    trainer.append([Event(EventKind.STEP, T0 + 1, 0, 0, step=1)])
    (tmp_path / "ledger.db-wal").unlink()
    trainer.append([Event(EventKind.STEP, T0 + 2, 0, 0, step=2)])
    supervisor.append([Event(EventKind.ATTEMPT_END, T0 + 3, 0, SUPERVISOR_RANK)])
    later = open_ledger(tmp_path)  # a restarted attempt opens it afresh
    later.append([Event(EventKind.STEP, T0 + 4, 1, 0, step=3)])
    trainer.append([Event(EventKind.STEP, T0 + 5, 0, 0, step=4)])
    for ledger in (later, trainer, supervisor):
        ledger.close()
    steps = [e.step for e in read_run_events(tmp_path) if e.kind is EventKind.STEP]
    assert sorted(steps) == [1, 2, 3, 4]
    assert trainer.num_reopened + supervisor.num_reopened >= 1


# -- a full disk ----------------------------------------------------------------------------------------
class FullDiskLedger(MemoryLedger):
    """Refuses appends with ENOSPC while `full`, and any transaction bigger than `room` events."""

    def __init__(self) -> None:
        super().__init__()
        self.full = True
        self.room = MAX_BATCH
        self.batch_sizes: list[int] = []

    def append(self, events: Sequence[Event]) -> None:
        self.batch_sizes.append(len(events))
        if self.full or len(events) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        super().append(events)


def test_a_large_backlog_goes_in_bounded_batches_once_the_disk_has_room(tmp_path):
    ledger = FullDiskLedger()
    recorder = Recorder(ledger, flush_interval_s=3600)
    for step in range(1, 58_001):
        recorder.step(step)
    recorder.flush()
    assert ledger.read() == []  # full: nothing written, nothing lost
    ledger.full = False
    recorder.close()
    assert [e.step for e in ledger.read()] == list(range(1, 58_001))
    assert max(ledger.batch_sizes) <= MAX_BATCH


def test_close_gives_up_on_a_ledger_that_stays_full_within_a_bounded_time():
    ledger = FullDiskLedger()
    recorder = Recorder(ledger, flush_interval_s=3600)
    recorder.step(1)
    began = time.monotonic()
    recorder.close()
    assert time.monotonic() - began < 10


@pytest.mark.parametrize("stays_full", [False, True])
def test_the_supervisor_retries_its_end_events_until_written(tmp_path, capsys, stays_full):
    ledger = FullDiskLedger()
    ledger.full = False
    ledger.room = 0  # every append fails ...
    config = RunConfig(command=("true",), run_dir=str(tmp_path), end_retry_s=1.0)
    books = JobBooks(config, run_dir=tmp_path, job_id="j", family="f", ledger=ledger)
    if not stays_full:  # ... until space is freed a moment later
        import threading

        threading.Timer(0.3, lambda: setattr(ledger, "room", 10)).start()
    books.append(EventKind.JOB_END, attempt=0, exit_status=0)
    written = [e.kind for e in ledger.read()]
    err = capsys.readouterr().err
    if stays_full:
        assert written == [] and "ENOSPC" in err and "job_end" in err
        assert len(err.strip().splitlines()) == 1
    else:
        assert written == [EventKind.JOB_END] and len(ledger.batch_sizes) > 1


def test_the_supervisor_waits_out_one_end_retry_per_outage_not_one_per_end_event(tmp_path, capsys):
    # On a full disk the job's end waited end_retry_s (60 s) for its ATTEMPT_END, then as long again for its
    # JOB_END: 2 minutes after training was done. Once one end event gave up, the next is tried once, until a
    # write goes in again. (Counted in tries, not timed.)
    ledger = FullDiskLedger()  # full: every append fails
    config = RunConfig(command=("true",), run_dir=str(tmp_path), end_retry_s=0.5)
    books = JobBooks(config, run_dir=tmp_path, job_id="j", family="f", ledger=ledger)
    books.append(EventKind.ATTEMPT_END, attempt=0, exit_status=0)
    assert len(ledger.batch_sizes) > 1  # retried
    tries = len(ledger.batch_sizes)
    books.append(EventKind.JOB_END, attempt=0, exit_status=0)
    assert len(ledger.batch_sizes) == tries + 1  # one try: the outage already had its wait
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 2
        and "gave up after 0.5 s" in err[0]
        and "job_end" in err[1]
        and "gave up after 0 s" in err[1]
    )
    ledger.full = False
    books.append(EventKind.MARK, attempt=1, name="x")  # a write goes in: the next outage is waited out again
    ledger.full = True
    tries = len(ledger.batch_sizes)
    books.append(EventKind.JOB_END, attempt=1, exit_status=0)
    assert len(ledger.batch_sizes) > tries + 1


def test_a_recorder_on_a_real_full_disk_loses_nothing_once_space_frees(tmp_path):
    with tmpfs(tmp_path / "small", "2m") as mount:
        ledger = open_ledger(mount / "run")
        filler = mount / "filler"
        with contextlib.suppress(OSError), open(filler, "wb") as f:
            while True:
                f.write(b"\0" * 65536)
        recorder = Recorder(ledger, flush_interval_s=3600)
        for step in range(1, 20_001):
            recorder.step(step)
        recorder.flush()
        filler.unlink()
        recorder.close()
        ledger.close()
        steps = [e.step for e in read_run_events(mount / "run") if e.kind is EventKind.STEP]
        assert steps == list(range(1, 20_001))


def test_ettr_run_continues_a_job_whose_ledger_has_rows_of_the_wrong_type(tmp_path, capsys):
    run_dir = tmp_path / "run"
    killed_job(run_dir)
    conn = sqlite3.connect(run_dir / "ledger.db")
    bad = [
        (T0 + 5, "step", "zero", 0, None, "seven", None, None),  # text where integers belong
        (T0 + 6, "attempt_start", 0, 0, "no-such-phase", None, None, "[1, 2]"),
        (b"\x00" * 3, "step", 0, 0, None, 2**62, None, "{"),
        (T0 + 7, "step", 0, 0, None, 3, "not a number", '{"x": 1e999}'),
    ]
    conn.executemany(
        "INSERT INTO events (ts, kind, attempt, rank, phase, step, value, data) VALUES (?,?,?,?,?,?,?,?)", bad
    )
    conn.commit()
    conn.close()
    assert cli_main(["report", str(run_dir), "--json"]) == 0
    capsys.readouterr()
    assert cli_main(["run", "--run-dir", str(run_dir), "--max-restarts", "0", "--", "true"]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "continuing job flip" in err
    events = read_run_events(run_dir)
    assert [e.attempt for e in events if e.kind is EventKind.ATTEMPT_START] == [0, 1]


def test_a_ledger_with_a_non_integer_schema_version_is_refused_in_one_line(tmp_path, capsys):
    run_dir = tmp_path / "run"
    killed_job(run_dir)
    conn = sqlite3.connect(run_dir / "ledger.db")
    conn.execute("UPDATE meta SET value = 'one' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    for argv in (["report", str(run_dir)], ["run", "--run-dir", str(run_dir), "--", "true"]):
        assert cli_main(argv) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "schema" in err, err


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_job_that_fills_the_ledgers_disk_is_still_recorded_as_completed(tmp_path):
    """The probe's case: the run directory's disk is full when the attempt ends; space comes back a moment
    later (retention, an operator). The end events wait for it instead of being dropped."""
    import json
    import sys
    import threading

    with tmpfs(tmp_path / "small", "3m") as mount:
        filled = tmp_path / "filled"
        script = f"head -c 100000000 /dev/zero > {mount}/filler 2>/dev/null; touch {filled}; exit 0"

        def free_space_later() -> None:
            deadline = time.monotonic() + 60
            while not filled.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1.5)
            (mount / "filler").unlink(missing_ok=True)

        helper = threading.Thread(target=free_space_later, daemon=True)
        helper.start()
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
        done = subprocess.run(
            [sys.executable, "-m", "ettr.cli", "run", "--run-dir", str(mount / "run"), "--max-restarts", "0",
             "--", "bash", "-c", script],
            capture_output=True, text=True, timeout=90, env=env,
        )  # fmt: skip
        helper.join(5)
        assert done.returncode == 0, done.stderr[-2000:]
        rep = json.loads(
            subprocess.run(
                [sys.executable, "-m", "ettr.cli", "report", str(mount / "run"), "--json"],
                capture_output=True, text=True, timeout=60, env=env, check=True,
            ).stdout
        )  # fmt: skip
        assert [a["outcome"] for a in rep["attempts"]] == ["completed"]
        assert rep["job_exit_status"] == 0 and not rep["in_progress"]


def test_a_supervisor_record_nested_too_deep_is_skipped_when_the_ledger_names_its_job(tmp_path, capsys):
    """The first supervisor's record nested 100,000 levels deep (damage or a forgery) raised RecursionError
    out of the ledger's job id: `ettr run --ledger`, `ettr report --ledger` and `ettr fleet --ledger` gave
    a traceback. It is skipped as the readers skip it; a later supervisor's record still names the job."""
    run_dir = tmp_path / "run"
    killed_job(run_dir)
    conn = sqlite3.connect(run_dir / "ledger.db")
    conn.execute(
        "UPDATE events SET data = ? WHERE kind = 'supervisor_start'",
        ('{"job_id": "flip", "a": ' + "[" * 100_000 + "]" * 100_000 + "}",),
    )
    conn.execute(
        "INSERT INTO events (ts, kind, attempt, rank, data) VALUES (?, 'supervisor_start', 0, ?, ?)",
        (T0 + 30, SUPERVISOR_RANK, '{"job_id": "flip"}'),
    )
    conn.commit()
    conn.close()
    url = f"sqlite:///{run_dir / 'ledger.db'}"
    assert cli_main(["report", "--ledger", url]) == 0
    assert "flip" in capsys.readouterr().out
    argv = ["run", "--ledger", url, "--job-id", "other", "--run-dir", str(tmp_path / "other"), "--", "true"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "holds job 'flip'" in err, err


@pytest.mark.parametrize(
    "forged",
    ["flip\x1b]52;c;ZXZpbA==\x07\x1b[2J", "../../x/$(touch pwned)", 'flip"}\nETT 99.9% | idle 0.0%', "", 7],
)
def test_a_job_id_the_books_hold_that_ettr_run_would_refuse_is_never_taken(tmp_path, capsys, forged):
    """`ettr run --continue-job` took the id a forged ledger held as the job's own: an id `ettr run --job-id`
    refuses (`../../x/$(...)`, a newline, OSC 52 / ESC sequences) became every process's `ETTR_JOB_ID`, the
    id it wrote to the books, and `ettr report` printed its newline as report lines of the forger's. Such an
    id is not a recorded one: the report names the job by its directory, a continued job gets a fresh id."""
    run_dir = tmp_path / "run"
    killed_job(run_dir)
    conn = sqlite3.connect(run_dir / "ledger.db")
    conn.execute(
        "UPDATE events SET data = json_set(data, '$.job_id', ?) WHERE kind = 'supervisor_start'", (forged,)
    )
    conn.commit()
    conn.close()
    assert cli_main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("job run ") and "99.9" not in out and "pwned" not in out, out[:200]
    argv = ["run", "--run-dir", str(run_dir), "--continue-job", "--max-restarts", "0", "--"]
    script = "import os, sys; sys.exit(0 if os.environ['ETTR_JOB_ID'].startswith('job-') else 9)"
    assert cli_main([*argv, sys.executable, "-c", script]) == 0
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err and "pwned" not in err and "99.9" not in err, err


def test_a_read_only_reader_waits_briefly_for_another_programs_exclusive_lock(tmp_path, monkeypatch):
    """A program holding the ledger in SQLite's exclusive locking mode keeps every reader off it. The fleet's
    read-only open waited the writer's 30 s before it read without locking: one such run directory made
    `ettr fleet` take 36 s and every `ettr serve` scrape outlive Prometheus' scrape timeout."""
    from ettr.ledger import sqlite as sqlite_ledger

    path = tmp_path / "ledger.db"
    with contextlib.closing(open_ledger(tmp_path)) as ledger:
        ledger.append([Event(ts=1.7e9, kind=EventKind.SUPERVISOR_START, attempt=0, rank=SUPERVISOR_RANK)])
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("PRAGMA locking_mode = EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")
    holder.execute("INSERT INTO meta (key, value) VALUES ('held', '1')")
    waits: list[float] = []
    real_connect = sqlite3.connect

    def connect(*args, **kwargs):
        waits.append(kwargs["timeout"])
        return real_connect(*args, **kwargs)

    monkeypatch.setattr(sqlite_ledger.sqlite3, "connect", connect)
    try:
        reader = sqlite_ledger.SqliteLedger(path, create=False, read_only=True)
        try:
            assert [e.kind for e in reader.read()] == [EventKind.SUPERVISOR_START]
        finally:
            reader.close()
    finally:
        holder.close()
    assert waits and max(waits) == sqlite_ledger.READ_ONLY_BUSY_TIMEOUT_S <= 1.0
    writer = sqlite_ledger.SqliteLedger(path, create=False)  # a writer still waits as long as before
    writer.close()
    assert waits[-1] == sqlite_ledger.WRITER_BUSY_TIMEOUT_S == 30.0


_FORGED_SCHEMAS = {
    # `events` a view: over an endless recursive query it held `ettr report`, a whole `ettr fleet` and every
    # `ettr serve` read for ever; here over three made-up rows, which were read as the job's books
    "view": [
        "ALTER TABLE events RENAME TO events_real",
        "CREATE VIEW events AS WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 3) "
        "SELECT x AS id, 1700000000.0 + x AS ts, 'mark' AS kind, 0 AS attempt, -1 AS rank, NULL AS phase, "
        "NULL AS step, NULL AS value, NULL AS data FROM c",
    ],
    # a trigger runs on every write of `ettr run` continuing the job
    "trigger": ["CREATE TRIGGER t AFTER INSERT ON events BEGIN DELETE FROM events; END"],
    # a computed column is computed on every read (a forged one of zeroblob(900 MB): 900 MB a row)
    "computed": [
        "ALTER TABLE events ADD COLUMN junk INTEGER GENERATED ALWAYS AS (length(zeroblob(1000))) VIRTUAL"
    ],
}


@pytest.mark.parametrize("forged", sorted(_FORGED_SCHEMAS))
def test_a_ledger_whose_schema_runs_code_is_refused_in_one_line(tmp_path, capsys, forged):
    run_dir = tmp_path / "run"
    killed_job(run_dir)
    conn = sqlite3.connect(run_dir / "ledger.db")
    for statement in _FORGED_SCHEMAS[forged]:
        conn.execute(statement)
    conn.commit()
    conn.close()
    for argv in (["report", str(run_dir)], ["run", "--run-dir", str(run_dir), "--", "true"]):
        assert cli_main(argv) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "is not a readable ettr ledger" in err, err


def test_a_ledger_whose_every_record_is_unreadable_is_not_said_to_hold_no_events(tmp_path, capsys):
    """Every row damaged (or forged): `ettr report` said `the ledger holds no events yet`, which was not so."""
    run_dir = tmp_path / "run"
    killed_job(run_dir)
    conn = sqlite3.connect(run_dir / "ledger.db")
    conn.execute("UPDATE events SET data = '{{'")
    conn.commit()
    conn.close()
    assert cli_main(["report", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "none of the ledger's 33 records could be read" in err[-1] and "no events yet" not in err[-1], err
    assert cli_main(["fleet", str(run_dir), "--json"]) == 2
    err = capsys.readouterr().err
    assert "none of the ledger's 33 records could be read" in err, err
