"""Ledger URLs without a server: sqlite:/// files, schemes, and `ettr run/report --ledger sqlite:///...`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ettr.errors import UsageError
from ettr.events import SUPERVISOR_RANK, Event, EventKind
from ettr.ledger.url import list_jobs, open_url, scheme_of, sqlite_path


def test_schemes():
    assert scheme_of("sqlite:///x.db") == "sqlite"
    assert scheme_of("postgresql://h/d") == scheme_of("postgres://h/d") == "postgresql"
    for bad in ("mysql://h/d", "/just/a/path", "", "http://x"):
        with pytest.raises(UsageError, match="unknown scheme"):
            scheme_of(bad)


def test_sqlite_paths(tmp_path):
    assert sqlite_path(f"sqlite:///{tmp_path}/books.db") == tmp_path / "books.db"
    assert sqlite_path(f"sqlite:///{tmp_path}") == tmp_path / "ledger.db"  # a run directory
    assert sqlite_path("sqlite:///runs/j/books.db").as_posix() == "runs/j/books.db"  # relative
    for bad in ("sqlite://", "sqlite:///", "sqlite://otherhost/x.db"):
        with pytest.raises(UsageError):
            sqlite_path(bad)


def test_a_sqlite_path_under_a_regular_file_is_bad_input(tmp_path):
    (tmp_path / "afile").write_text("x")
    for url in (f"sqlite:///{tmp_path}/afile/x.db", f"sqlite:///{tmp_path}/afile/sub/x.db"):
        with pytest.raises(UsageError, match="afile is not a directory"):
            sqlite_path(url)
    with pytest.raises(UsageError, match="afile is not a directory"):
        open_url(f"sqlite:///{tmp_path}/afile/x.db", job_id="j", create=True)
    assert (tmp_path / "afile").read_text() == "x"


def test_a_sqlite_file_holds_one_job(tmp_path):
    url = f"sqlite:///{tmp_path}/books.db"
    with pytest.raises(UsageError, match="no such file"):
        open_url(url, job_id="a")
    with pytest.raises(UsageError, match="no such file"):
        list_jobs(url)
    ledger = open_url(url, job_id="a", create=True)
    assert list_jobs(url) == []
    ledger.append([Event(EventKind.SUPERVISOR_START, 1.0, 0, SUPERVISOR_RANK, data={"job_id": "a"})])
    ledger.close()
    assert list_jobs(url) == ["a"]
    assert len(open_url(url, job_id="a").read()) == 1
    with pytest.raises(UsageError, match="holds job 'a', not 'b'"):
        open_url(url, job_id="b")
    (tmp_path / "junk.db").write_bytes(b"not sqlite" * 100)
    with pytest.raises(UsageError):
        open_url(f"sqlite:///{tmp_path}/junk.db", job_id="a")


def _ettr(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    return subprocess.run(
        [sys.executable, "-m", "ettr.cli", *argv], capture_output=True, text=True, timeout=120, env=env
    )


def test_run_and_report_through_a_sqlite_url(tmp_path):
    url = f"sqlite:///{tmp_path}/books/job7.db"
    script = "import ettr\nfor i in range(3): ettr.step(i + 1)\nimport os; print(os.environ['ETTR_LEDGER'])"
    done = _ettr("run", "--run-dir", str(tmp_path / "run"), "--job-id", "job7", "--ledger", url,
                 "--", sys.executable, "-c", script)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == url  # the children got ETTR_LEDGER
    assert not (tmp_path / "run" / "ledger.db").exists()  # the books went to the URL
    rep = _ettr("report", "--ledger", url, "--job-id", "job7", "--json")
    assert rep.returncode == 0, rep.stderr
    report = json.loads(rep.stdout)
    assert report["job_id"] == "job7" and [a["outcome"] for a in report["attempts"]] == ["completed"]
    assert report["attempts"][0]["last_step"] == 3
    via_dir = _ettr("report", str(tmp_path / "run"), "--json")  # the run dir points at its books
    assert via_dir.returncode == 0, via_dir.stderr
    assert json.loads(via_dir.stdout)["attempts"] == report["attempts"]
    listed = _ettr("report", "--ledger", url)  # no --job-id: the jobs it holds, and how to report one
    assert listed.returncode == 0 and "job7" in listed.stdout, listed.stderr
    fleet = _ettr("fleet", str(tmp_path), "--json")  # found by its pointer, read from its URL
    assert fleet.returncode == 0, fleet.stderr
    assert [j["job_id"] for j in json.loads(fleet.stdout)["jobs"]] == ["job7"]
    for argv in (
        ["report", "--ledger", url, "--job-id", "other"],
        ["report", "--job-id", "job7"],
        ["report", str(tmp_path / "run"), "--ledger", url, "--job-id", "job7"],
        ["run", "--run-dir", str(tmp_path / "r2"), "--ledger", url, "--job-id", "other", "--", "true"],
    ):
        bad = _ettr(*argv)
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, (argv, bad.stderr)
        assert bad.stderr.startswith("ettr"), bad.stderr


def test_no_postgres_skips_outside_ci_and_fails_under_ci(monkeypatch):
    import pg_server as pg
    from conftest import start_postgres_or_skip

    class Unavailable:
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise pg.PostgresUnavailable("no PostgreSQL server binaries (initdb, pg_ctl) found")

    monkeypatch.setattr(pg, "PostgresServer", Unavailable)
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception, match="no PostgreSQL server can be started here"):
        start_postgres_or_skip()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true but no PostgreSQL server could be started"):
        start_postgres_or_skip()


def test_one_rule_finds_a_run_directorys_books(tmp_path, monkeypatch):
    """`ettr.ledger.locate`: the environment's URL inside the job, else RUN_DIR/ledger.db, else the pointer."""
    from ettr.ledger import LedgerError, is_run_dir, locate, open_ledger
    from ettr.ledger.url import write_pointer

    for name in ("ETTR_RUN_DIR", "ETTR_LEDGER", "ETTR_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(LedgerError, match="not an ettr run directory"):
        locate(run)
    assert not is_run_dir(run)
    url = f"sqlite:///{tmp_path}/books.db"
    write_pointer(run, url, job_id="j")
    books = locate(run)
    assert is_run_dir(run) and books.url == f"sqlite:///{tmp_path}/books.db" and books.job_id == "j"
    own = open_ledger(run)  # a run directory's own file comes before its pointer
    own.close()
    assert locate(run).url is None
    env = {"ETTR_RUN_DIR": str(run), "ETTR_LEDGER": url, "ETTR_JOB_ID": "j"}
    assert locate(run, environ=env).url == url  # inside the job: the environment's URL
    with pytest.raises(LedgerError):  # ...for that very directory only
        locate(tmp_path, environ=env)
    other = tmp_path / "other"
    other.mkdir()
    (other / "ledger-url.json").write_text('{"url": 5}')
    with pytest.raises(LedgerError, match="ledger-url.json is not readable"):
        locate(other)
    bad = _ettr("report", str(other))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_a_forged_pointer_never_gets_the_password_in_clear_text(tmp_path, monkeypatch):
    """A run directory's ledger-url.json names the server its books are on; anyone who can write there can
    name their own. ettr report/fleet of such a directory sent PGPASSWORD to it in clear text (libpq answers
    a server's cleartext-password request with it): a URL read from disk now requires !password."""
    import socket
    import struct
    import threading

    from ettr.ledger.locate import read_pointer
    from ettr.report.load import read_run

    server = socket.create_server(("127.0.0.1", 0))
    got: list[bytes] = []

    def serve() -> None:  # asks for the password in clear text, like a forged server would
        conn, _ = server.accept()
        conn.settimeout(10)
        with conn:
            while True:
                size = struct.unpack("!I", conn.recv(4))[0]
                if struct.unpack("!I", conn.recv(size - 4)[:4])[0] not in (80877103, 80877104):
                    break  # the startup message (SSL and GSS requests answered "N")
                conn.sendall(b"N")
            conn.sendall(b"R" + struct.pack("!II", 8, 3))
            got.append(conn.recv(4096))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    port = server.getsockname()[1]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    forged = f"postgresql://victim@127.0.0.1:{port}/db?require_auth=password"
    (run_dir / "ledger-url.json").write_text(json.dumps({"url": forged, "job_id": "j"}))
    assert read_pointer(run_dir) == (f"postgresql://victim@127.0.0.1:{port}/db?require_auth=!password", "j")
    monkeypatch.setenv("PGPASSWORD", "the-operators-secret")
    monkeypatch.setenv("PGCONNECT_TIMEOUT", "5")
    with pytest.raises(UsageError, match="cleartext password"):
        read_run(run_dir)
    thread.join(10)
    server.close()
    assert not any(b"the-operators-secret" in data for data in got)


def test_a_folder_of_runs_given_as_a_run_directory_says_how_to_read_them(tmp_path):
    from ettr.ledger.base import LedgerError
    from ettr.ledger.locate import locate

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "ledger-url.json").write_text(
            json.dumps({"url": "sqlite:///x.db", "job_id": name})
        )
    with pytest.raises(
        LedgerError, match=r"holds 2 run directories: give one, or see them all with ettr fleet"
    ):
        locate(tmp_path)
    with pytest.raises(LedgerError, match=r"inside\)$"):
        locate(tmp_path / "a" / "missing")


@pytest.mark.parametrize(
    ("forged", "read"),
    [
        (  # an OpenSSL engine is a shared library: libpq would load it, its constructor run in `ettr report`
            "postgresql://u@10.0.0.1:5432/db?sslmode=require&sslcert=/run/x/c.pem&sslkey=/run/x/evil.so:k",
            "postgresql://u@10.0.0.1:5432/db?sslmode=require&require_auth=!password",
        ),
        (  # TLS secrets appended to any file the reader can write
            "postgresql://u@h/db?sslkeylogfile=/etc/precious&connect_timeout=3",
            "postgresql://u@h/db?connect_timeout=3&require_auth=!password",
        ),
        (
            "postgres://u@h/db?passfile=/dev/zero&service=x&options=-c%20a%3Db&sslrootcert=/fifo&sslcrl=/f",
            "postgres://u@h/db?require_auth=!password",
        ),
        ("postgresql:///db", "postgresql:///db?require_auth=!password"),  # the local socket: no host
        (
            "postgresql://u@h/db?host=/var/run/postgresql&port=5433&application_name=a&target_session_attrs=any",
            "postgresql://u@h/db?host=%2Fvar%2Frun%2Fpostgresql&port=5433&application_name=a"
            "&target_session_attrs=any&require_auth=!password",
        ),
    ],
)
def test_a_forged_pointer_names_no_file_of_this_machine_to_libpq(tmp_path, forged, read):
    from ettr.ledger.locate import read_pointer

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "ledger-url.json").write_text(json.dumps({"url": forged, "job_id": "j"}))
    assert read_pointer(run_dir) == (read, "j")


def test_a_ledgers_job_gets_its_html_report(tmp_path, capsys):
    # `ettr report --ledger URL --job-id ID --html FILE` gave a traceback (ValueError: 0 labels for 1
    # reports): the page was labelled by run directories, and a ledger's jobs have none.
    from ettr.cli import main
    from ettr.testing.fleet import JobSpec, write_job

    write_job(tmp_path / "run", JobSpec(job_id="j7", family="f", start_ts=1_700_000_000.0))
    url = f"sqlite:///{tmp_path / 'run' / 'ledger.db'}"
    page = tmp_path / "j7.html"
    assert main(["report", "--ledger", url, "--job-id", "j7", "--html", str(page)]) == 0
    assert "j7" in page.read_text() and "wrote" in capsys.readouterr().err


def test_redact_gives_a_url_without_a_password_back_as_given():
    """Rebuilding every URL (to take a `?password=` out) turned `sqlite:////abs/l.db` into `sqlite://abs/l.db`
    (urlunsplit drops an empty host), a relative path: `ettr run`'s `to continue it` command and its report
    line named another ledger."""
    from ettr.ledger.postgres import redact

    for url in ("sqlite:////tmp/x/l.db", "sqlite:///rel/l.db", "postgresql://u@h:5/d?sslmode=require"):
        assert redact(url) == url and redact(url, mask=None) == url
    assert redact("postgresql://u@h/d?password=s") == "postgresql://u@h/d?password=***"
