"""Summaries stored at job end (`ettr.fleet.stored`): equal to what `ettr report` says of the job, used only
while the ledger holds exactly the rows they were computed from, recomputed from the events otherwise."""

from __future__ import annotations

import json
import random
import shutil
import time
from dataclasses import replace

import pytest

from ettr.events import SUPERVISOR_RANK, Event, EventKind
from ettr.fleet.load import load_ledger_url, load_run_dir, load_run_dirs
from ettr.fleet.stored import load_stored, store_at_job_end, store_run_dir, summary_path
from ettr.ledger import open_ledger
from ettr.testing.fleet import JobSpec, write_job, write_job_url

T0 = 1_700_000_000.0


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _spec(i: int, rng: random.Random) -> JobSpec:
    return JobSpec(
        job_id=f"job-{i}",
        family=rng.choice(("a", "b")),
        start_ts=T0 + 1000 * i,
        world_size=rng.choice((1, 2, 4)),
        num_steps=rng.randrange(20, 120),
        ckpt_every=rng.choice((10, 25)),
        fail_at_steps=tuple(sorted(rng.sample(range(5, 20), rng.randrange(0, 3)))),
        failure_kind=rng.choice(("user", "infra", "preemption", "hang")),
    )


def _from_events(run_dir):
    summary = load_run_dir(run_dir, time.time(), use_stored=False)
    assert not isinstance(summary, str), summary
    return summary


@pytest.mark.parametrize("seed", range(8))
def test_a_stored_summary_equals_the_report_and_the_events(seed, tmp_path):
    from ettr.report.load import read_run

    rng = random.Random(seed)
    run_dir = write_job(tmp_path / "run", _spec(seed, rng))
    assert summary_path(run_dir).is_file()
    stored = load_stored(run_dir)
    assert stored is not None
    assert stored == _from_events(run_dir)
    _events, report = read_run(run_dir)  # what `ettr report RUN_DIR` shows
    assert stored.job_id == report.job_id
    assert stored.ett_pct == report.ett_pct and stored.wall_s == report.wall_s
    assert dict(stored.buckets_s) == dict(report.buckets_s)
    assert stored.tts_s == report.tts_s and stored.ttr_s == tuple(report.ttr_s)
    assert stored.num_failures == report.num_failures and stored.failures == tuple(report.failures)


def test_an_event_appended_after_the_summary_makes_it_stale(tmp_path):
    run_dir = write_job(tmp_path / "run", JobSpec(job_id="j", num_steps=40))
    before = load_stored(run_dir)
    assert before is not None and not before.in_progress
    ledger = open_ledger(run_dir)  # a requeue: a new supervisor starts the job again
    last = ledger.read()[-1].ts
    ledger.append([
        Event(EventKind.SUPERVISOR_START, last + 5, 1, SUPERVISOR_RANK, data={"pid": 2**22 + 7}),
        Event(EventKind.ATTEMPT_START, last + 6, 1, SUPERVISOR_RANK, data={"pid": 2**22 + 8}),
        Event(EventKind.STEP, last + 9, 1, 0, step=41),
    ])  # fmt: skip
    ledger.close()
    assert load_stored(run_dir) is None
    now = time.time()
    fleet = load_run_dir(run_dir, now)
    assert fleet == _from_events(run_dir) and fleet != before
    assert not isinstance(fleet, str) and fleet.in_progress and fleet.wall_end_ts > before.wall_end_ts


def test_a_row_added_with_an_older_id_is_caught_by_the_count(tmp_path):
    from ettr.ledger import Books

    run_dir = write_job(tmp_path / "run", JobSpec(job_id="j", num_steps=30))
    mark = Books(run_dir).mark()
    import sqlite3

    with sqlite3.connect(run_dir / "ledger.db") as conn:  # a gap in the ids, filled later
        low = conn.execute("SELECT min(id) FROM events").fetchone()[0]
        conn.execute("DELETE FROM events WHERE id = ?", (low,))
    store_run_dir(run_dir)
    with sqlite3.connect(run_dir / "ledger.db") as conn:
        conn.execute(
            "INSERT INTO events (id, ts, kind, attempt, rank) VALUES (?, ?, 'supervisor_start', 0, -1)",
            (low, T0),
        )
    assert Books(run_dir).mark() == mark  # same count and last id as at the first store...
    assert load_stored(run_dir) is None  # ...but not as at the summary's: recomputed


def test_a_summary_of_another_accounting_or_malformed_is_not_used(tmp_path):
    run_dir = write_job(tmp_path / "run", JobSpec(job_id="j", num_steps=30))
    path = summary_path(run_dir)
    data = json.loads(path.read_text())
    data["key"][1] += 1  # written by another accounting version (CACHE_VERSION)
    path.write_text(json.dumps(data))
    assert load_stored(run_dir) is None
    path.write_text("{not json")
    assert load_stored(run_dir) is None
    assert load_run_dir(run_dir, time.time()) == _from_events(run_dir)


def test_a_running_job_stores_nothing_and_storing_never_raises(tmp_path):
    run_dir = write_job(tmp_path / "run", JobSpec(job_id="j", num_steps=30, running=True))
    assert not summary_path(run_dir).exists()
    assert store_run_dir(run_dir) is None
    store_at_job_end(tmp_path / "nothing-here", ledger_url=None, job_id="x")  # no ledger: logged, no raise
    store_at_job_end(tmp_path, ledger_url="postgresql://nobody@127.0.0.1:1/x", job_id="x")


def test_the_fleet_uses_stored_summaries_and_names_jobs_as_the_report_does(tmp_path):
    from ettr.closing import recorded_job_id

    specs = [_spec(i, random.Random(i)) for i in range(4)]
    for spec in specs:
        write_job(tmp_path / spec.job_id, spec)
    dirs = sorted(tmp_path.glob("job-*"))
    stored, problems = load_run_dirs(dirs, now=time.time())
    events, _ = load_run_dirs(dirs, now=time.time(), use_stored=False)
    assert not problems and stored == events
    # Moved: the source is where the fleet found it now.
    moved = tmp_path / "moved"
    shutil.move(str(dirs[0]), moved)
    summary = load_stored(moved)
    assert summary is not None and summary.source == str(moved) and summary.job_id == specs[0].job_id
    # A job whose supervisor recorded no job id is named after its directory, as `ettr report` names it.
    anon = tmp_path / "anon"
    ledger = open_ledger(anon)
    from ettr.testing.fleet import job_events

    plain = [replace(e, data={k: v for k, v in e.data.items() if k != "job_id"}) if e.data else e
             for e in job_events(JobSpec(job_id="ignored", num_steps=20))]  # fmt: skip
    assert recorded_job_id(plain) is None
    ledger.append(plain)
    ledger.close()
    store_run_dir(anon)
    renamed = tmp_path / "renamed"
    anon.rename(renamed)
    summary = load_stored(renamed)
    assert summary is not None and summary.job_id == "renamed" == _from_events(renamed).job_id


def test_postgres_stored_summaries_equal_the_events_and_go_stale(postgres_url):
    from ettr.ledger.url import open_url

    rng = random.Random(3)
    specs = [_spec(i, rng) for i in range(5)]
    write_job_url(postgres_url, specs[0], close=False)  # finished, but its supervisor stored nothing
    for spec in specs[1:]:
        write_job_url(postgres_url, spec)
    from ettr.ledger.postgres import read_summaries

    assert sorted(read_summaries(postgres_url)) == sorted(s.job_id for s in specs[1:])
    stored, problems = load_ledger_url(postgres_url, now=time.time())
    events, _ = load_ledger_url(postgres_url, now=time.time(), use_stored=False)
    assert not problems and _ranks_unread(stored) == _ranks_unread(events) and len(stored) == 5
    assert stored[1:] == events[1:]  # the stored ones saw every rank's steps, as the audit read does
    ledger = open_url(postgres_url, job_id=specs[1].job_id)  # a late delivered spill
    last = max(e.ts for e in ledger.read())
    ledger.append([Event(EventKind.MARK, last + 1.0, 0, 0, data={"late": True})])
    ledger.close()
    assert specs[1].job_id not in read_summaries(postgres_url)
    again, _ = load_ledger_url(postgres_url, now=time.time())
    assert _ranks_unread(again) == _ranks_unread(
        load_ledger_url(postgres_url, now=time.time(), use_stored=False)[0]
    )


def _ranks_unread(summaries):
    """The summaries as a read of only the reference rank's steps gives them: the slow-rank check unknown
    (a job read from its events without its stored summary; an audit reads every rank's steps)."""
    return [replace(s, stragglers=None, straggler_lost_s=None) for s in summaries]


def test_the_servers_filtered_read_gives_the_same_report_as_the_full_ledger(postgres_url):
    """PostgreSQL leaves out the rows the accounting does not use (`ettr.ledger.accounted`): the report
    is the full read's, with rows of a newer ettr and shuffled append order among them."""
    import psycopg

    from ettr.accounting import compute
    from ettr.ledger.postgres import PostgresLedger
    from ettr.report.json import to_dict
    from test_fleet import _random_job

    reduced = 0
    for seed in range(12):
        rng = random.Random(seed)
        ledger = PostgresLedger(postgres_url, job_id=f"r{seed}", create=True)
        events = _random_job(rng)
        ledger.append(events[: len(events) // 2])
        with psycopg.connect(postgres_url, autocommit=True) as conn:  # a kind this ettr does not know
            conn.execute(
                "INSERT INTO ettr.events (job_id, node, writer, seq, ts, kind, attempt, rank)"
                " VALUES (%s, 'n', 'newer', %s, %s, 'from_the_future', 0, 0)",
                (f"r{seed}", seed, T0 - 50),
            )
        ledger.append(events[len(events) // 2 :])
        full = ledger.read()
        fewer, mark = ledger.read_marked(for_accounting=True)
        ledger.close()
        assert mark.num_rows == len(full) + 1 and len(fewer) <= len(full)
        reduced += len(fewer) < len(full)
        now = max(e.ts for e in full) + 5
        few, whole = to_dict(compute(fewer, now, job_id="j")), to_dict(compute(full, now, job_id="j"))
        # The slow-rank check needs every rank's steps: the fewer rows say they cannot tell (never "none").
        assert not few["rank_speed"]["checked"] or few["rank_speed"] == whole["rank_speed"], seed
        for data in (few, whole):
            del data["rank_speed"], data["slow_steps"]["straggler_s"]
        assert few == whole, seed
    assert reduced > 0  # the filter did leave rows out


def test_unchanged_ledger_files_are_trusted_without_opening_the_database(tmp_path, monkeypatch):
    from ettr.ledger.locate import Books

    run_dir = write_job(tmp_path / "run", JobSpec(job_id="j", num_steps=30))
    expected = _from_events(run_dir)

    def no_open(_books):
        raise AssertionError("the database was opened")

    monkeypatch.setattr(Books, "mark", no_open)
    assert load_stored(run_dir) == expected
    ledger = open_ledger(run_dir)  # anything appended changes the files: the rows are counted again
    ledger.append([Event(EventKind.MARK, T0 + 1e5, 0, 0, data={"late": True})])
    ledger.close()
    with pytest.raises(AssertionError, match="opened"):
        load_stored(run_dir)
    monkeypatch.undo()
    assert load_stored(run_dir) is None


def _ettr_run(tmp_path, *flags: str, status: int = 0) -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = str(Path(__file__).parent / "scripts" / "train_phases.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    done = subprocess.run(
        [sys.executable, "-m", "ettr.cli", "run", "--run-dir", str(tmp_path / "run"), "--job-id", "real",
         *flags, "--", sys.executable, script, "--compile-s", "0.2", "--steps", "6"],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == status, done.stderr[-2000:]


@pytest.mark.slow
def test_a_real_job_stores_its_summary_at_its_end(tmp_path):
    from ettr.report.json import to_dict
    from ettr.report.load import read_run

    _ettr_run(tmp_path)
    run_dir = tmp_path / "run"
    stored = load_stored(run_dir)
    assert stored is not None and stored == _from_events(run_dir)
    report = to_dict(read_run(run_dir)[1])  # `ettr report --json`
    assert stored.job_id == report["job_id"] == "real"
    assert stored.ett_pct == pytest.approx(report["ett_pct"])


@pytest.mark.slow
def test_a_preempted_job_stores_no_summary_its_requeue_would_make_stale(tmp_path):
    """A preempted job (exit 143) ends to be requeued: its summary is not computed on the way out (it
    stood between the preemption and the requeue); the fleet reads its events, as for any job without one."""
    _ettr_run(tmp_path, "--inject", "preempt@step=3", status=143)
    run_dir = tmp_path / "run"
    assert not summary_path(run_dir).exists()
    assert load_stored(run_dir) is None
    assert _from_events(run_dir).job_id == "real"


@pytest.mark.slow
def test_a_real_job_on_postgres_stores_its_summary_there(tmp_path, postgres_url):
    from ettr.ledger.postgres import read_summaries

    _ettr_run(tmp_path, "--ledger", postgres_url)
    assert "real" in read_summaries(postgres_url)
    assert not summary_path(tmp_path / "run").exists()
    stored, _ = load_ledger_url(postgres_url, now=time.time())
    assert stored == load_ledger_url(postgres_url, now=time.time(), use_stored=False)[0]


def test_the_fleet_of_a_postgres_ledger_never_prints_its_password(postgres_url, capsys, monkeypatch):
    """`ettr fleet --ledger URL --json` goes to CI logs and dashboards: each job's `source` and every
    problem line name the ledger without its password (they printed the URL as given, password and all)."""
    from urllib.parse import urlsplit

    import ettr.fleet.load as fleet_load
    from ettr.cli import main
    from ettr.ledger.postgres import redact

    password = urlsplit(postgres_url).password
    assert password
    rng = random.Random(5)
    write_job_url(postgres_url, replace(_spec(0, rng), job_id="stored"))
    write_job_url(postgres_url, replace(_spec(1, rng), job_id="from-events"), close=False)
    import psycopg

    with psycopg.connect(postgres_url) as conn:  # every reader of the ledger reads what is stored
        (body,) = conn.execute("SELECT body FROM ettr.summaries WHERE job_id = 'stored'").fetchone()
    assert password not in body and redact(postgres_url) in body  # the supervisor stored the URL whole
    assert main(["fleet", "--ledger", postgres_url, "--json"]) == 0
    out, err = capsys.readouterr()
    assert password not in out and password not in err
    jobs = json.loads(out)["jobs"]
    assert sorted(j["job_id"] for j in jobs) == ["from-events", "stored"]
    assert {j["source"] for j in jobs} == {redact(postgres_url)}

    def damaged(*_args, **_kwargs):
        raise ValueError("damaged")

    monkeypatch.setattr(fleet_load, "summarize_events", damaged)  # the job read from its events: a problem
    assert main(["fleet", "--ledger", postgres_url, "--json"]) == 0
    out, err = capsys.readouterr()
    assert password not in out and password not in err
    assert "from-events: cannot be accounted" in err and redact(postgres_url) in err
