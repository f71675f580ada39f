"""The PostgreSQL ledger and ledger URLs against a real server (see tests/conftest.py)."""

from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
import sys
import time

import psycopg
import pytest

from ettr.errors import UsageError
from ettr.events import SUPERVISOR_RANK, Event, EventKind, Phase
from ettr.ledger import LedgerError
from ettr.ledger.postgres import PostgresLedger, redact
from ettr.ledger.rows import KeyedEvent
from ettr.ledger.url import list_jobs, open_url


def _events() -> list[Event]:
    return [
        Event(EventKind.SUPERVISOR_START, 1.5, 0, SUPERVISOR_RANK, data={"pid": 7, "job_id": "a"}),
        Event(EventKind.PHASE_END, 2.25, 1, 3, Phase.COMPILE, 10, 2.0, {"reason": "x", "nan": float("nan")}),
        Event(EventKind.STEP, 3.0, 1, 3, step=11),
    ]


def test_round_trip_keeps_every_field_and_jobs_stay_apart(postgres_url):
    a = open_url(postgres_url, job_id="a", create=True)
    b = open_url(postgres_url, job_id="b", create=True)
    a.append(_events())
    b.append([Event(EventKind.STEP, 9.0, 0, 0, step=1)])
    got = open_url(postgres_url, job_id="a").read()
    assert [e.kind for e in got] == [e.kind for e in _events()]
    assert got[0] == _events()[0] and got[2] == _events()[2]
    assert (
        got[1].data is not None and got[1].data["reason"] == "x" and got[1].data["nan"] != got[1].data["nan"]
    )
    assert [e.step for e in b.read()] == [1]
    assert list_jobs(postgres_url) == ["a", "b"]
    for ledger in (a, b):
        ledger.close()


def test_the_same_keys_are_stored_once(postgres_url):
    ledger = PostgresLedger(postgres_url, job_id="j", create=True)
    records = [KeyedEvent("w1", i, "node", Event(EventKind.STEP, float(i), step=i)) for i in range(100)]
    ledger.insert(records[:60], may_repeat=False)
    ledger.insert(records, may_repeat=True)  # a redelivery overlapping what is stored
    ledger.insert(records[50:], may_repeat=True)
    assert sorted(e.step for e in ledger.read()) == list(range(100))
    ledger.close()


def test_last_activity_sees_only_training_processes(postgres_url):
    ledger = PostgresLedger(postgres_url, job_id="j", create=True)
    assert ledger.last_activity(0) is None
    ledger.append(
        [Event(EventKind.STEP, 5.0, 0, 0, step=1), Event(EventKind.ATTEMPT_END, 9.0, 0, SUPERVISOR_RANK)]
    )
    ledger.append([Event(EventKind.STEP, 7.0, 1, 2, step=2)])
    assert ledger.last_activity(0) == 5.0
    assert ledger.last_activity(1) == 7.0
    assert [e.step for e in ledger.read_attempt(0)] == [1] and [e.step for e in ledger.read_attempt(1)] == [2]
    assert PostgresLedger(postgres_url, job_id="other", create=True).read_attempt(0) == []  # its job's only
    ledger.close()


def test_reading_needs_an_existing_schema_and_job(postgres_url):
    with pytest.raises(UsageError, match="no ettr ledger"):
        open_url(postgres_url, job_id="j")
    open_url(postgres_url, job_id="j", create=True).close()
    with pytest.raises(UsageError, match="no job 'other'"):
        open_url(postgres_url, job_id="other")


def test_newer_schema_is_refused(postgres_url):
    open_url(postgres_url, job_id="j", create=True).close()
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("UPDATE ettr.meta SET value = '999' WHERE key = 'schema_version'")
    with pytest.raises(UsageError, match="schema version 999 is not supported"):
        open_url(postgres_url, job_id="j")
    with pytest.raises(UsageError, match="schema version 999"):
        list_jobs(postgres_url)


def test_wrong_password_and_unreachable_server_are_one_clear_line(postgres_server):
    with pytest.raises(UsageError, match="password authentication failed") as info:
        open_url(postgres_server.url_with_password("wrong"), job_id="j")
    assert "wrong" not in str(info.value) and "***" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(UsageError, match="Connection refused"):
        open_url("postgresql://ettr:pw@127.0.0.1:1/x", job_id="j")
    with pytest.raises(UsageError, match="unknown scheme 'mysql'"):
        open_url("mysql://h/x", job_id="j")
    assert redact("postgresql://u:secret@h:5/d") == "postgresql://u:***@h:5/d"
    assert redact("postgresql://u:secret@h:5/d", mask=None) == "postgresql://u@h:5/d"
    # libpq also takes the password in the query (it was printed, and written to ledger-url.json, as given)
    assert (
        redact("postgresql://u@h/d?sslmode=require&password=secret")
        == "postgresql://u@h/d?sslmode=require&password=***"
    )
    assert (
        redact("postgresql://u@h/d?password=secret&sslmode=require", mask=None)
        == "postgresql://u@h/d?sslmode=require"
    )


def test_cli_bad_ledger_urls_exit_2_with_one_line(postgres_server, tmp_path):
    bad = {
        "report-scheme": ["report", "--ledger", "ftp://x/y", "--job-id", "j"],
        "report-password": ["report", "--ledger", postgres_server.url_with_password("nope"), "--job-id", "j"],
        "report-down": ["report", "--ledger", "postgresql://ettr@127.0.0.1:1/x", "--job-id", "j"],
        "report-no-job-id": ["report", "--ledger", postgres_server.url],
        "run-down": [
            "run",
            "--run-dir",
            str(tmp_path / "r"),
            "--ledger",
            "postgresql://ettr@127.0.0.1:1/x",
            "--",
            sys.executable,
            "-c",
            "pass",
        ],  # fmt: skip
        "run-scheme": ["run", "--run-dir", str(tmp_path / "r"), "--ledger", "redis://x", "--", "true"],
    }
    for name, argv in bad.items():
        done = subprocess.run(
            [sys.executable, "-m", "ettr.cli", *argv], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 2, (name, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ettr"), (name, done.stderr)
        assert "Traceback" not in done.stderr and "nope" not in done.stderr


def _writer(url: str, rank: int, num_batches: int) -> None:
    ledger = PostgresLedger(url, job_id="many", create=True)
    for i in range(num_batches):
        ledger.append([Event(EventKind.STEP, time.time(), 0, rank, step=i * 10 + j) for j in range(10)])
    ledger.close()


def test_several_processes_create_and_append_at_once(postgres_url):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(postgres_url, r, 20)) for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    events = open_url(postgres_url, job_id="many").read()
    for rank in range(4):
        assert sorted(e.step for e in events if e.rank == rank) == list(range(200))


def test_a_dead_connection_is_reopened(postgres_url):
    ledger = PostgresLedger(postgres_url, job_id="j", create=True)
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'ettr'")
    with pytest.raises(LedgerError):
        ledger.append([Event(EventKind.STEP, 1.0, step=1)])
    ledger.append([Event(EventKind.STEP, 2.0, step=2)])
    assert [e.step for e in ledger.read()] == [2]


def test_a_row_the_server_refuses_is_kept_aside_and_the_rest_stored(postgres_url, tmp_path):
    from ettr.ledger.spill import SpillingLedger

    ledger = SpillingLedger(
        lambda: PostgresLedger(postgres_url, job_id="j", create=True),
        job_id="j",
        spill_dir=tmp_path / "spill",
        node="n",
    )
    ledger.append([Event(EventKind.STEP, 0.5, step=0)])  # the schema exists now
    with psycopg.connect(postgres_url, autocommit=True) as conn:  # a server rule ettr does not know of
        conn.execute("ALTER TABLE ettr.events ADD CONSTRAINT no_step_4 CHECK (step IS DISTINCT FROM 4)")
    events = [Event(EventKind.STEP, float(i), step=i) for i in range(1, 10)]
    events.append(Event(EventKind.STEP, 10.0, step=2**70))  # no step number: dropped before the server
    ledger.append(events)
    assert not ledger.server_down
    assert sorted(e.step for e in ledger.read()) == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    rejected = list((tmp_path / "spill").glob("*.rejected"))
    assert len(rejected) == 1 and [r.event.step for r in read_spill_lines(rejected[0])] == [4]
    ledger.close()


def read_spill_lines(path):
    from ettr.ledger.rows import KeyedEvent, from_row

    out = []
    for line in path.read_bytes().splitlines():
        seq, *row = json.loads(line)
        out.append(KeyedEvent("w", seq, "n", from_row(*row)))
    return out


@pytest.mark.parametrize(
    "alter",
    [
        "ALTER TABLE ettr.events DROP COLUMN node",
        "ALTER TABLE ettr.events ADD COLUMN owner text NOT NULL",
        "ALTER TABLE ettr.events ADD CONSTRAINT no_steps CHECK (kind <> 'step')",
        "REVOKE_INSERT",
    ],
)
def test_an_events_table_that_takes_no_events_is_refused_before_the_job_starts(postgres_url, alter):
    # A writer takes a failed insert for an outage: with a column dropped by hand, `ettr run` said "ledger
    # server unreachable", ran the whole job into spill files no delivery could store, and exited 0.
    from urllib.parse import urlsplit

    open_url(postgres_url, job_id="j", create=True).close()
    url = postgres_url
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        if alter == "REVOKE_INSERT":  # a DBA granted reading only
            conn.execute("CREATE ROLE ettr_reader LOGIN PASSWORD 'pw'")
            conn.execute("GRANT USAGE ON SCHEMA ettr TO ettr_reader")
            conn.execute("GRANT SELECT ON ALL TABLES IN SCHEMA ettr TO ettr_reader")
            conn.execute("GRANT INSERT ON ettr.jobs TO ettr_reader")
            parts = urlsplit(postgres_url)
            url = parts._replace(netloc=f"ettr_reader:pw@{parts.hostname}:{parts.port}").geturl()
        else:
            conn.execute(alter)
    with pytest.raises(UsageError, match="table ettr.events does not take this ettr's events") as info:
        open_url(url, job_id="k", create=True)
    assert "\n" not in str(info.value) and ":pw@" not in str(info.value)
    open_url(url, job_id="j").close()  # reading is not refused
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM ettr.events").fetchone()[0] == 0  # the probe left nothing


def test_a_schema_version_that_is_no_number_does_not_say_upgrade(postgres_url):
    open_url(postgres_url, job_id="j", create=True).close()
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("UPDATE ettr.meta SET value = 'banana' WHERE key = 'schema_version'")
    with pytest.raises(UsageError, match="schema version banana .*ettr.meta was altered"):
        open_url(postgres_url, job_id="j")


def test_two_jobs_of_a_ledger_are_compared(postgres_url, capsys):
    # `ettr report --ledger URL --job-id A --job-id B` gave a traceback (ValueError: 0 labels for 2 reports):
    # the comparison was labelled by run directories, and a ledger's jobs have none.
    from ettr.cli import main
    from ettr.testing.fleet import JobSpec, job_events

    for job_id in ("a", "b"):
        ledger = open_url(postgres_url, job_id=job_id, create=True)
        ledger.append(job_events(JobSpec(job_id=job_id, family="f", start_ts=1_700_000_000.0)))
        ledger.close()
    assert main(["report", "--ledger", postgres_url, "--job-id", "a", "--job-id", "b"]) == 0
    out = capsys.readouterr().out
    assert "ETT %" in out and " a " in out and " b " in out
