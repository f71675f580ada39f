"""Events a ledger outage left in a run directory: counted for `ettr fleet` / `ettr report`, delivered once by
`ettr deliver` (with the in-memory server of test_ledger_spill; no PostgreSQL)."""

from __future__ import annotations

import json
import logging
import os

import pytest

from ettr.cli import main
from ettr.ledger import open_ledger
from ettr.ledger.spill import SpillingLedger, spill_dir
from ettr.ledger.spill_file import MAX_LINE_BYTES, SpillUnreadable, read_spill
from ettr.ledger.undelivered import count_undelivered, deliver_undelivered, undelivered_note
from test_ledger_spill import FakeServer, _steps
from test_report_tensorboard import job_events


def _run_dir_with_orphans(tmp_path, server: FakeServer, num_events: int = 5):
    """A run directory of job `server.job_id` on a server that went away: a writer spilled and exited."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "ledger-url.json").write_text(
        json.dumps({"url": "postgresql://x@h/db", "job_id": server.job_id})
    )
    server.up = False
    writer = SpillingLedger(lambda: server, job_id=server.job_id, spill_dir=spill_dir(run_dir), node="n")
    writer.append(_steps(0, num_events))
    writer.close()  # the server is still away: its file stays, an orphan
    return run_dir


def test_the_waiting_events_are_counted_and_named_with_the_command(tmp_path):
    run_dir = _run_dir_with_orphans(tmp_path, FakeServer(), num_events=5)
    assert count_undelivered(run_dir).num_events == 5
    note = undelivered_note(run_dir)
    assert note is not None and "5 event(s)" in note and f"ettr deliver {run_dir}" in note
    assert undelivered_note(tmp_path) is None  # no spill: nothing said


def test_deliver_stores_every_event_once_and_leaves_nothing(tmp_path):
    server = FakeServer()
    run_dir = _run_dir_with_orphans(tmp_path, server, num_events=7)
    assert not deliver_undelivered(run_dir, connect=lambda: server).complete  # still away: nothing lost
    assert count_undelivered(run_dir).num_events == 7 and not server.rows
    server.up = True
    done = deliver_undelivered(run_dir, connect=lambda: server)
    assert done.complete and done.num_delivered == 7 and done.left.num_events == 0
    assert sorted(e.step for e in server.read()) == list(range(7))
    again = deliver_undelivered(run_dir, connect=lambda: server)  # a second delivery stores nothing
    assert again.complete and again.num_delivered == 0 and len(server.rows) == 7
    assert undelivered_note(run_dir) is None


def test_a_running_writers_file_is_left_to_it(tmp_path):
    server = FakeServer()
    run_dir = _run_dir_with_orphans(tmp_path, server, num_events=3)
    live = SpillingLedger(lambda: server, job_id=server.job_id, spill_dir=spill_dir(run_dir), node="n")
    live.append(_steps(10, 2))  # the server is away: spilled, and the file stays locked by `live`
    waiting = count_undelivered(run_dir)
    assert (waiting.num_events, waiting.num_files, waiting.num_live_files) == (3, 1, 1)
    server.up = True
    done = deliver_undelivered(run_dir, connect=lambda: server)
    assert done.num_delivered == 3 and done.left.num_live_files == 1
    assert sorted(e.step for e in server.read()) == [0, 1, 2]
    live.close()


def test_ettr_deliver_refuses_what_is_not_a_run_directory(tmp_path, capsys):
    assert main(["deliver", str(tmp_path)]) == 2
    assert main(["deliver", str(tmp_path / "nope")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 2


def test_ettr_deliver_says_each_run_directory_on_one_line_whatever_its_name(tmp_path, capsys):
    # `ettr deliver runs/*` of a shared folder: a directory named `x\nruns/y: delivered 9 ...` printed raw
    # added a line of its own to what a person reads
    from ettr.testing.fleet import JobSpec, write_job

    forged = tmp_path / "x\nruns/y: delivered 9 spilled event(s) to the ledger"
    write_job(forged, JobSpec(job_id="forged"))
    assert main(["deliver", str(forged)]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.endswith(": nothing to deliver\n") and "x\\nruns/y" in out


def test_ettr_deliver_with_the_server_away_exits_1_and_keeps_the_events(tmp_path, capsys, caplog):
    run_dir = _run_dir_with_orphans(tmp_path, FakeServer(), num_events=4)
    # the pointer names a server no one runs (port 1): the delivery fails at once, the events stay
    (run_dir / "ledger-url.json").write_text(
        json.dumps({"url": "postgresql://x@127.0.0.1:1/db", "job_id": "j"})
    )
    caplog.clear()  # the writer that spilled them said so; the delivery has nothing to add
    with caplog.at_level(logging.WARNING, logger="ettr"):
        assert main(["deliver", str(run_dir)]) == 1
    err = capsys.readouterr().err
    assert "4 event(s) stay" in err and len(err.strip().splitlines()) == 1
    # and why, as the server's client said it ('did not answer; try again later' hid a refusal waiting never
    # mends: a pointer's URL holds no password, and without PGPASSWORD every try failed the same way)
    assert "did not answer (ledger postgresql://x@127.0.0.1:1/db" in err and "connection" in err.lower()
    assert count_undelivered(run_dir).num_events == 4
    # One line, not two: the adopter spills nothing, so "events spill to RUN_DIR/ledger-spill until it is
    # back" (a writer's outage warning) said something untrue beside it.
    assert not [r for r in caplog.records if "spill to" in r.getMessage()]


def _sparse_spill(run_dir, size: int = 3 << 30):
    """A spill file with a good header and then `size` bytes of holes (cheap on disk): it once made `ettr
    report` and `ettr fleet` raise MemoryError, and the good job beside it went unreported."""
    path = spill_dir(run_dir) / "w-sparse.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"spill": 1, "job_id": "j", "writer": "w-sparse", "node": "n"}) + "\n")
    os.truncate(path, size)
    return path


def _job(tmp_path, name: str):
    run_dir = tmp_path / name
    run_dir.mkdir()
    ledger = open_ledger(run_dir, create=True)
    try:
        ledger.append(job_events(name))
    finally:
        ledger.close()
    return run_dir


def test_a_spill_file_too_large_to_read_is_one_line_and_is_never_loaded(tmp_path):
    run_dir = tmp_path / "run"
    path = _sparse_spill(run_dir)
    with pytest.raises(SpillUnreadable, match="more than"):
        read_spill(path)
    waiting = count_undelivered(run_dir)
    assert waiting.num_events == 0 and len(waiting.unreadable) == 1
    note = undelivered_note(run_dir)
    assert note is not None and "\n" not in note and str(path) in note


@pytest.mark.parametrize("command", ["report", "fleet"])
def test_report_and_fleet_go_on_past_a_sparse_spill_file(tmp_path, capsys, command):
    bad, good = _job(tmp_path, "bad"), _job(tmp_path, "good")
    _sparse_spill(bad)
    assert main([command, str(bad), str(good), "--json"]) == 0  # both jobs read: a note is no failure
    out, err = capsys.readouterr()
    assert "good" in out and "Traceback" not in err
    (line,) = [line for line in err.splitlines() if "w-sparse.jsonl" in line]
    assert "not read" in line


def test_overlong_and_torn_lines_are_skipped_and_the_rest_read(tmp_path):
    path = tmp_path / "w.jsonl"
    good = lambda seq: json.dumps([seq, 1000.0, "step", 0, 0, None, seq, None, None])  # noqa: E731
    header = json.dumps({"spill": 1, "job_id": "j", "writer": "w", "node": "n"})
    overlong = "[" + " " * (MAX_LINE_BYTES + 10) + "]"
    path.write_text("\n".join([header, good(1), overlong, good(2), good(3)[:-4]]))
    _header, records = read_spill(path)
    assert [r.seq for r in records] == [1, 2]


def test_ettr_deliver_goes_on_past_a_bad_directory_and_exits_2(tmp_path, capsys, monkeypatch):
    server = FakeServer()
    first, second = tmp_path / "a", tmp_path / "b"
    for run_dir in (first, second):
        run_dir.mkdir()
        (run_dir / "ledger-url.json").write_text(json.dumps({"url": "postgresql://x@h/db", "job_id": "j"}))
        server.up = False
        writer = SpillingLedger(lambda: server, job_id="j", spill_dir=spill_dir(run_dir), node="n")
        writer.append(_steps(0, 3))
        writer.close()
    server.up = True
    import ettr.ledger.undelivered as undelivered

    real = undelivered.deliver_undelivered
    monkeypatch.setattr(undelivered, "deliver_undelivered", lambda d: real(d, connect=lambda: server))
    not_one = tmp_path / "not-a-run"
    not_one.mkdir()
    assert main(["deliver", str(first), str(not_one), str(tmp_path / "nope"), str(second)]) == 2
    out, err = capsys.readouterr()
    assert out.count("delivered 3 spilled event(s)") == 2  # both run directories, around the bad ones
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err  # one line naming both bad ones
    assert "skipped 2 of 4 run directories" in err and "not-a-run" in err and "nope" in err
    assert count_undelivered(first).num_events == count_undelivered(second).num_events == 0
