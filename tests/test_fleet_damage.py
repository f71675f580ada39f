"""One bad input, one line, the rest goes on (issue 25 item 3): a fleet of good jobs beside run directories
damaged or forged in every way the probe tried. `ettr fleet` (text, JSON, HTML) and `ettr serve`'s /metrics
never raise, never hang, keep every good job, and never trust a summary that is forged, NaN or out of range:
the job is accounted from its events (or listed as not read), the same figures `--from-events` gives."""

from __future__ import annotations

import json
import os
import random
import shutil
import sqlite3
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from ettr.cli import main
from ettr.fleet.load import load_run_dir
from ettr.fleet.stored import REJECTED_SUFFIX, load_stored, summary_path
from ettr.testing.fleet import JobSpec, write_job

T0 = 1_700_000_000.0
DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _summary(run_dir: Path) -> dict:
    return json.loads(summary_path(run_dir).read_text())


def _forge(run_dir: Path) -> None:
    """A consistent forgery: ETT 99.9% with buckets that add up, signed by no key of the reader."""
    data = _summary(run_dir)
    s = data["summary"]
    s["buckets_s"] = {b: 0.0 for b in s["buckets_s"]}
    s["buckets_s"]["effective_training"] = s["wall_s"] * 0.999
    s["buckets_s"]["other"] = s["wall_s"] * 0.001
    s["ett_pct"], s["idleness_pct"], s["failure_pct"] = 99.9, 0.1, 0.0
    data.pop("signature", None)
    summary_path(run_dir).write_text(json.dumps(data))


def _resign_forgery(run_dir: Path) -> None:
    """The same forgery with the signature's key id kept and its hmac left as it was: it does not verify."""
    signature = _summary(run_dir)["signature"]
    _forge(run_dir)
    data = _summary(run_dir)
    data["signature"] = signature
    summary_path(run_dir).write_text(json.dumps(data))


def _text_edit(old: str, new: str):
    def edit(run_dir: Path) -> None:
        text = summary_path(run_dir).read_text()
        assert old in text
        summary_path(run_dir).write_text(text.replace(old, new, 1))

    return edit


def _replace_summary(content: bytes):
    def edit(run_dir: Path) -> None:
        summary_path(run_dir).write_bytes(content)

    return edit


def _summary_node(make):
    def edit(run_dir: Path) -> None:
        summary_path(run_dir).unlink()
        make(summary_path(run_dir))

    return edit


def _rows(sql: str, *params):
    def edit(run_dir: Path) -> None:
        summary_path(run_dir).unlink()
        with sqlite3.connect(run_dir / "ledger.db") as db:
            db.execute(sql, params)
        db.close()

    return edit


def _ledger_file(content: bytes):
    def edit(run_dir: Path) -> None:
        summary_path(run_dir).unlink()
        (run_dir / "ledger.db").write_bytes(content)

    return edit


def _pointer(run_dir: Path) -> None:
    summary_path(run_dir).unlink()
    (run_dir / "ledger.db").unlink()
    (run_dir / "ledger-url.json").write_text(DEEP)


DAMAGE = {
    # the stored summary
    "forged": _forge,
    "forged_signed": _resign_forgery,
    "nan": _text_edit('"ett_pct":', '"ett_pct":NaN,"x":'),
    "huge_gpus": _text_edit('"gpus":1,', '"gpus":1' + "0" * 400 + ","),
    "negative": _text_edit('"wall_s":', '"wall_s":-5,"x":'),
    "nested": _replace_summary(DEEP.encode()),
    "nested_inside": _text_edit('"files":', '"x":' + DEEP + ',"files":'),
    "binary": _replace_summary(bytes(range(256)) * 4),
    "empty": _replace_summary(b""),
    "fifo": _summary_node(os.mkfifo),
    "dev_zero": _summary_node(lambda p: os.symlink("/dev/zero", p)),
    "directory": _summary_node(os.mkdir),
    # the ledger's rows (no stored summary: the events are read)
    "row_gpus": _rows(
        "update events set data=? where kind='process_start'", '{"world_size":1' + "0" * 400 + "}"
    ),
    "row_nested": _rows("update events set data=? where kind='process_start'", '{"world_size":' + DEEP + "}"),
    "row_attempt": _rows("update events set attempt=9223372036854775807 where kind='step' and step=60"),
    "row_ts": _rows("update events set ts=1e300 where kind='step' and step=61"),
    "row_nan_ts": _rows("update events set ts='NaN' where kind='step' and step=62"),
    # the ledger file and the pointer
    "not_a_db": _ledger_file(b"SQLite format 3\0" + bytes(4000)),
    "empty_db": _ledger_file(b""),
    "pointer": _pointer,
}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Two good jobs and a failed job to damage (copied, then damaged, by each test)."""
    root = tmp_path_factory.mktemp("fleet")
    write_job(root / "good0", JobSpec(job_id="good0", start_ts=T0))
    write_job(root / "good1", JobSpec(job_id="good1", start_ts=T0 + 1000, fail_at_steps=(30,)))
    template = write_job(root / "template", JobSpec(job_id="x", start_ts=T0 + 2000, fail_at_steps=(50, 80)))
    truth = load_run_dir(template, time.time(), use_stored=False)
    return root, truth


def _damaged(root: Path, dest: Path, names=tuple(DAMAGE)) -> Path:
    """A copy of the template job per damage in `names`, each damaged, under `dest`; with the good jobs."""
    for good in ("good0", "good1"):
        shutil.copytree(root / good, dest / good)
    for name in names:
        shutil.copytree(root / "template", dest / "damaged" / name)
        DAMAGE[name](dest / "damaged" / name)
    return dest


def _fleet_json(*argv: str, capsys) -> tuple[dict, str]:
    assert main(["fleet", *argv, "--json", "--no-cache"]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return json.loads(captured.out), captured.err


@pytest.mark.parametrize("name", sorted(DAMAGE))
def test_one_damaged_run_directory_is_one_problem_and_the_others_go_on(fleet, name, tmp_path, capsys):
    root, truth = fleet
    run_dir = _damaged(root, tmp_path, (name,)) / "damaged" / name
    out, err = _fleet_json(str(root / "good0"), str(root / "good1"), str(run_dir), capsys=capsys)
    jobs = {j["job_id"]: j for j in out["jobs"]}
    assert {"good0", "good1"} <= set(jobs)
    others = [j for j in out["jobs"] if j["job_id"] not in ("good0", "good1")]
    if others:  # accounted from its events: never the forged or damaged figures
        (job,) = others
        assert job["ett_pct"] < 99 and job["gpus"] < 1000
        if name not in ("row_attempt", "row_ts", "row_nan_ts"):  # a damaged row is left out of the figures
            assert job["ett_pct"] == pytest.approx(truth.ett_pct)
    else:
        assert len(out["problems"]) == 1 and str(run_dir) in out["problems"][0]
    assert all(len(line) < 1000 for line in err.splitlines())
    # Quarantined once: a second read meets no bad summary, and says nothing more of it.
    if summary_path(run_dir).with_name(summary_path(run_dir).name + REJECTED_SUFFIX).exists():
        assert not os.path.lexists(summary_path(run_dir))
    again, _err = _fleet_json(str(root / "good0"), str(root / "good1"), str(run_dir), capsys=capsys)
    assert again["jobs"] == out["jobs"]


def test_text_and_html_of_the_whole_damaged_fleet(fleet, tmp_path, capsys):
    root, _truth = fleet
    copy = _damaged(root, tmp_path / "copy")
    html = tmp_path / "fleet.html"
    assert main(["fleet", str(copy), "--no-cache", "--html", str(html)]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    read = len(DAMAGE) - captured.err.count("ettr fleet: skipped ")  # each one not read: one line
    assert captured.out.startswith(f"fleet: {2 + read} jobs,")
    assert "good0" in html.read_text() and "good1" in html.read_text()
    forged_ett = [line for line in captured.out.splitlines() if "99.9" in line]
    assert not forged_ett, forged_ett


def test_a_forged_summary_does_not_move_the_fleets_ett(fleet, tmp_path, capsys):
    root, _truth = fleet
    honest = tmp_path / "honest"
    write_job(honest, JobSpec(job_id="honest", start_ts=T0 + 3000, fail_at_steps=(20, 40, 60)))
    before, _ = _fleet_json(str(root / "good0"), str(honest), capsys=capsys)
    _forge(honest)
    assert load_stored(honest) is None
    after, _ = _fleet_json(str(root / "good0"), str(honest), capsys=capsys)
    assert after["ett_pct"] == before["ett_pct"] < 99


@pytest.mark.parametrize("seed", range(40))
def test_fuzzed_summaries_never_raise_and_never_differ_from_the_events(fleet, seed, tmp_path):
    """Random byte edits of a signed summary: it is used only when it still verifies (then it is the
    events' figures), else the events are read: the result is always the truth."""
    root, _ = fleet
    run_dir = tmp_path / "run"
    write_job(run_dir, JobSpec(job_id="fuzz", start_ts=T0, fail_at_steps=(40,)))
    truth = load_run_dir(run_dir, time.time(), use_stored=False)
    rng = random.Random(seed)
    raw = bytearray(summary_path(run_dir).read_bytes())
    for _ in range(rng.randrange(1, 4)):
        at = rng.randrange(len(raw))
        choice = rng.randrange(3)
        if choice == 0:
            raw[at] = rng.randrange(256)
        elif choice == 1:
            del raw[at : at + rng.randrange(1, 20)]
        else:
            raw[at:at] = rng.choice([b"[" * 5000, b"NaN", b"1e999", b"9" * 500, b'"', b"{}"])
    summary_path(run_dir).write_bytes(bytes(raw))
    result = load_run_dir(run_dir, time.time())
    assert result == truth


def test_serve_scrapes_stay_200_beside_damaged_run_directories(fleet, tmp_path):
    pytest.importorskip("prometheus_client")
    from argparse import Namespace

    from ettr.fleet.serve import loader, start_server

    root, _truth = fleet
    copy = _damaged(root, tmp_path / "copy")
    args = Namespace(run_dirs=[str(copy)], ledger=None, workers=1, cache_dir=None, no_cache=True,
                     from_events=False, window=3600.0)  # fmt: skip
    server = start_server(loader(args), port=0)
    try:
        for _ in range(2):
            with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=120) as response:
                assert response.status == 200
                body = response.read().decode()
            assert 'job="good0"' in body and 'job="good1"' in body
    finally:
        server.close()


# -- ettr serve: where it listens, and what a client cannot do to it ------------------------------------------
def _serve(tmp_path, fleet):
    from argparse import Namespace

    from ettr.fleet.serve import loader, start_server

    root, _truth = fleet
    args = Namespace(run_dirs=[str(root / "good0")], ledger=None, workers=1, cache_dir=None, no_cache=True,
                     from_events=False, window=3600.0)  # fmt: skip
    return start_server(loader(args), port=0)


def test_serve_listens_on_localhost_unless_told(fleet, tmp_path):
    pytest.importorskip("prometheus_client")
    from ettr.cli import build_parser

    args = build_parser().parse_args(["serve", str(tmp_path)])
    assert args.addr == "127.0.0.1"
    server = _serve(tmp_path, fleet)
    try:
        assert server.httpd.server_address[0] == "127.0.0.1"
    finally:
        server.close()


def test_serve_cuts_off_clients_that_never_finish_and_is_bounded(fleet, tmp_path, monkeypatch):
    """A slowloris (a byte now and then, never a whole request), an HTTP/0.9 request line without its end,
    and more idle connections than it serves at once: each is closed by the server, and a real scrape
    still gets its metrics afterwards."""
    pytest.importorskip("prometheus_client")
    import socket

    from ettr.fleet import serve

    monkeypatch.setattr(serve._QuietHandler, "timeout", 0.5)
    monkeypatch.setattr(serve, "REQUEST_DEADLINE_S", 2.0)
    server = _serve(tmp_path, fleet)
    try:
        idle = [
            socket.create_connection(("127.0.0.1", server.port)) for _ in range(serve.MAX_CONNECTIONS + 8)
        ]
        for sock in idle[:2]:
            sock.sendall(b"GET /metrics")  # HTTP/0.9 style, and never the line's end
        slow = idle[2]
        slow.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        for sock in idle:
            sock.settimeout(60)
        # Every connection is closed by the server (refused at once when over the bound, or timed out):
        # the read returns (b"" or a reset) instead of waiting for ever.
        for sock in idle:
            try:
                while sock.recv(4096):
                    pass
            except ConnectionResetError:
                pass
            sock.close()
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=120) as response:
            assert response.status == 200 and 'job="good0"' in response.read().decode()
    finally:
        server.close()


@pytest.mark.parametrize("cmd", ["fleet", "serve"])
@pytest.mark.parametrize("given", ["", "/dev/zero", "fifo", "file"])
def test_a_cache_dir_that_is_not_a_directory_is_one_line(fleet, tmp_path, capsys, cmd, given):
    root, _truth = fleet
    if given == "fifo":
        os.mkfifo(tmp_path / "fifo")
    if given == "file":
        (tmp_path / "file").write_text("x")
    if given in ("fifo", "file"):
        given = str(tmp_path / given)
    assert (
        main([cmd, str(root / "good0"), "--cache-dir", given, "--port", "0"][: 4 if cmd == "fleet" else 6])
        == 2
    )
    err = capsys.readouterr().err
    # the empty path is argparse's to refuse ("argument --cache-dir: an empty path"): the flag is named either way
    assert err.startswith(f"ettr {cmd}: ") and "--cache-dir" in err and len(err.splitlines()) == 1


def test_serve_refuses_a_ledger_url_that_can_never_be_read(tmp_path, capsys):
    """`ettr serve --ledger` with a path under a regular file (or an unknown scheme) is bad input at start,
    one line and exit 2, not a server that answers every scrape with nothing."""
    (tmp_path / "afile").write_text("x")
    for url in (f"sqlite:///{tmp_path}/afile/x.db", "mysql://h/db"):
        assert main(["serve", "--ledger", url, "--port", "0"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("ettr serve: "), err


def _lock_out(monkeypatch, locked: Path) -> None:
    """Make `locked` behave as another user's mode-0700 directory does for this one: nothing inside can be
    looked up or listed (EACCES), whatever user runs the test (root reads through real modes)."""
    real_lstat, real_scandir = os.lstat, os.scandir

    def inside(path) -> bool:
        return isinstance(path, (str, os.PathLike)) and Path(os.path.abspath(path)).is_relative_to(locked)

    def lstat(path, *args, **kwargs):
        if inside(path) and Path(os.path.abspath(path)) != locked:
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_lstat(path, *args, **kwargs)

    def scandir(path=".", *args, **kwargs):
        if inside(path):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_scandir(path, *args, **kwargs)

    monkeypatch.setattr(os, "lstat", lstat)
    monkeypatch.setattr(os, "scandir", scandir)


def test_a_run_directory_this_user_cannot_enter_is_said_not_passed_over(tmp_path, monkeypatch, capsys):
    """`ettr fleet` of another user's 0700 run directory (given, or in a folder of runs) counted the other
    jobs and said nothing of it; `ettr report`/`deliver` called it "not an ettr run directory"."""
    write_job(tmp_path / "runs" / "a", JobSpec(job_id="job-a"))
    write_job(tmp_path / "runs" / "b", JobSpec(job_id="job-b"))
    locked = (tmp_path / "runs" / "b").absolute()
    _lock_out(monkeypatch, locked)

    assert main(["fleet", str(tmp_path / "runs"), "--json", "--no-cache"]) == 0
    out, err = capsys.readouterr()
    assert [j["job_id"] for j in json.loads(out)["jobs"]] == ["job-a"]
    assert any(str(locked) in p and "permission denied" in p.lower() for p in json.loads(out)["problems"])
    assert err.count("\n") == 1 and f"skipped {locked}: cannot be searched (Permission denied)" in err

    assert main(["fleet", str(locked), "--no-cache"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "permission denied" in err.lower()

    for argv in (["report", str(locked)], ["compile-report", str(locked)], ["deliver", str(locked)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "permission denied" in err and "not an ettr run directory" not in err


def test_a_copied_run_directory_is_the_same_job_counted_once(tmp_path, capsys):
    # `cp -r runs/exp1 backup/exp1` (or a synced mirror): six copies of an mnist run were six jobs in the
    # fleet, six times its GPU-hours. Two jobs of one id started at other instants stay two.
    runs = tmp_path / "runs"
    write_job(runs / "exp1", JobSpec(job_id="exp1", num_steps=40))
    shutil.copytree(runs / "exp1", runs / "exp1-copy")
    write_job(runs / "teamB-exp1", JobSpec(job_id="exp1", start_ts=1_700_100_000.0, num_steps=40))
    assert main(["fleet", str(runs), "--json"]) == 0
    out, err = capsys.readouterr()
    fleet = json.loads(out)
    names = sorted(job["job_id"] for job in fleet["jobs"])
    assert names == ["exp1", "exp1"], names  # the copy is not a third
    assert "a copy of the books of" in err and "counted once" in err


def test_a_forged_copy_claiming_a_jobs_id_never_replaces_the_job(tmp_path, capsys, caplog):
    # A copy of exp1's books that reaches further (`runs/aa-evil`, its end moved an hour on) was the one
    # counted, and the job's own directory skipped as "a copy of the books of runs/aa-evil". The job's own
    # run directory is the one its books name; books rewritten to name their own directory too are a
    # conflict: both counted, one warning line.
    runs = tmp_path / "runs"
    own = str(runs / "exp1")
    write_job(runs / "exp1", JobSpec(job_id="exp1", num_steps=40, run_dir=own))
    write_job(runs / "aa-evil", JobSpec(job_id="exp1", num_steps=400, run_dir=own))
    fleet, err = _fleet_json(str(runs), capsys=capsys)
    assert [(job["job_id"], job["name"]) for job in fleet["jobs"]] == [("exp1", "exp1")]
    assert f"aa-evil: a copy of the books of {own} (job exp1" in err
    shutil.rmtree(runs / "aa-evil")
    write_job(runs / "aa-evil", JobSpec(job_id="exp1", num_steps=400, run_dir=str(runs / "aa-evil")))
    with caplog.at_level("WARNING", logger="ettr"):
        fleet, err = _fleet_json(str(runs), capsys=capsys)
    assert sorted(job["name"] for job in fleet["jobs"]) == ["aa-evil", "exp1"]  # neither replaces the other
    warned = [r.getMessage() for r in caplog.records if "is claimed by" in r.getMessage()]
    assert len(warned) == 1 and "aa-evil and " in warned[0] and own in warned[0], warned


def test_a_scrape_is_served_while_slow_clients_hold_every_slot(fleet, tmp_path):
    """Clients that open connections and send a request head a line at a time (a slowloris) held every
    one of the 16 slots for 120 s each, and reconnected: every scrape meanwhile was closed unanswered
    (`RemoteDisconnected`), the fleet's metrics gone for as long as the clients kept at it. A connection
    whose request head is still arriving is the one given up when all slots are taken: the scrape is served,
    the oldest slow client cut."""
    pytest.importorskip("prometheus_client")
    import socket

    from ettr.fleet import serve

    server = _serve(tmp_path, fleet)
    slow = []
    try:
        for _ in range(serve.MAX_CONNECTIONS):
            sock = socket.create_connection(("127.0.0.1", server.port))
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # the head's end never comes
            slow.append(sock)
        # each slow connection has its thread (and slot) once the server answers a byte of it: a scrape
        # sent after all of them were accepted finds every slot taken
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=60) as response:
            assert response.status == 200 and 'job="good0"' in response.read().decode()
        slow[0].settimeout(60)
        try:
            assert slow[0].recv(4096) == b""  # the oldest slow client was the one cut
        except ConnectionResetError:
            pass
    finally:
        for sock in slow:
            sock.close()
        server.close()


def test_a_folder_nested_deep_is_not_searched_and_the_rest_is_read(fleet, tmp_path, capsys):
    # The search was recursive (os.walk): a folder nested 3,000 deep beside the run directories ended
    # `ettr fleet` (and `ettr serve`) with a RecursionError traceback, no job shown. Here 150 levels under a
    # recursion limit that leaves the search 100 frames (a tree 3,000 deep would outlast pytest's clean-up,
    # which recurses as os.walk did).
    import inspect
    import sys

    from ettr.fleet.load import find_run_dirs

    root, _truth = fleet
    dest = tmp_path / "fleet"
    shutil.copytree(root / "good0", dest / "good0")
    (dest / "deep" / Path(*["d"] * 150)).mkdir(parents=True)
    (dest / "loop").symlink_to(".")  # a link is never entered
    unsearched: list[str] = []
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack()) + 100)
    try:
        found = find_run_dirs([dest], unsearched)
    finally:
        sys.setrecursionlimit(limit)
    assert found == [dest / "good0"]
    assert len(unsearched) == 1 and "cannot be searched (more than 64 folders deep)" in unsearched[0]
    fleet_json, err = _fleet_json(str(dest), capsys=capsys)
    assert [job["job_id"] for job in fleet_json["jobs"]] == ["good0"]
    assert "cannot be searched (more than 64 folders deep)" in err and len(err.splitlines()) == 1, err


def test_a_scrape_is_served_while_slow_readers_hold_every_slot(monkeypatch):
    """Clients that send their request and then read the response a byte a second held every slot while
    their response was written (the socket's 10 s timeout, again at each reconnection): with a 7.6 MB
    exposition and 16 such clients, scrapes were closed unanswered. A connection writing its response for
    longer than WRITE_GRACE_S is given up for a new one when every slot is taken."""
    import socket

    from ettr.fleet import serve

    monkeypatch.setattr(serve, "WRITE_GRACE_S", 0.5)  # well inside the socket's 10 s write timeout
    body = b"x" * (8 << 20)  # more than the kernel buffers of a connection whose reader holds back

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
        return [body]

    httpd = serve.BoundedServer(("127.0.0.1", 0), serve._QuietHandler)
    httpd.set_app(app)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    slow = []
    try:
        for _ in range(serve.MAX_CONNECTIONS):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            sock.connect(("127.0.0.1", httpd.server_port))
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")  # then reads next to nothing
            slow.append(sock)
        time.sleep(2.0)  # every slot's response is being written, for longer than the grace
        with urllib.request.urlopen(f"http://127.0.0.1:{httpd.server_port}/metrics", timeout=60) as response:
            assert response.status == 200 and len(response.read()) == len(body)
    finally:
        for sock in slow:
            sock.close()
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize("pid", [2**31, 10**20])
def test_a_forged_supervisor_pid_is_a_job_not_running_never_a_traceback(tmp_path, capsys, pid):
    """Books naming a supervisor pid no process can have on this host (os.kill raised OverflowError out
    of ettr report and ettr simulate --from, and ettr fleet skipped the job): the job is not running."""
    run = write_job(tmp_path / "r", JobSpec(job_id="j", running=True, supervisor_pid=pid), close=False)
    assert main(["report", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["job_id"] == "j"
    assert main(["fleet", str(run), "--json", "--no-cache"]) == 0
    assert [job["job_id"] for job in json.loads(capsys.readouterr().out)["jobs"]] == ["j"]
    assert main(["simulate", "--from", str(run), "--json", "--runs", "2"]) == 0
