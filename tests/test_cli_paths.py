"""Path-like arguments of every command: an empty path, a file where a directory is expected, a place that
cannot be written are one line and exit status 2, before any work starts (no job launched, no server, no
run directory or pointer left behind)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ettr.cli import main

PROGRAM = ["--", sys.executable, "-c", "raise SystemExit('must not run')"]


def _cases(tmp: Path) -> list[list[str]]:
    afile = str(tmp / "afile")
    unmakeable = "/proc/ettr-no-such/dir"  # /proc: no directory can be made there, even by root
    return [
        ["run", "--run-dir", "", *PROGRAM],
        ["run", "--run-dir", afile, *PROGRAM],
        ["run", "--run-dir", "/proc/1", *PROGRAM],  # a directory no one may write in, root included
        ["run", "--ledger", "", *PROGRAM],
        ["run", "--run-dir", str(tmp / "r1"), "--ledger", f"sqlite:///{afile}/x.db", *PROGRAM],
        ["report", ""],
        ["report", str(tmp), "--html", ""],
        ["report", str(tmp), "--trace", ""],
        ["report", str(tmp), "--tensorboard", ""],
        ["report", "--ledger", ""],
        ["compile-report", ""],
        ["demo", "--out", ""],
        ["publish", ""],
        ["publish", str(tmp / "queue"), "--root", ""],
        ["publish", str(tmp / "queue"), "--root", afile],
        ["publish", str(tmp / "queue"), "--allow-pythonpath", afile],
        ["publish", str(tmp / "queue"), "--max-attempts", "0"],
        ["simulate", "--from", ""],
        ["simulate", "--runs", "2", "--html", ""],
        ["fleet", ""],
        ["fleet", "--ledger", ""],
        ["fleet", str(tmp), "--html", ""],
        ["fleet", str(tmp), "--cache-dir", ""],
        ["fleet", str(tmp), "--cache-dir", unmakeable],
        ["serve", ""],
        ["serve", afile, "--port", "0"],
    ]


@pytest.mark.parametrize("index", range(len(_cases(Path("/x")))))
def test_bad_paths_are_one_line_and_status_2(index, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("not a directory\n")
    (tmp_path / "queue" / "requests").mkdir(parents=True)
    argv = _cases(tmp_path)[index]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == before, f"{argv} left files behind"


def test_publish_checks_its_arguments_before_importing_torch(tmp_path):
    code = (
        "import sys; from ettr.cli import main; status = main(sys.argv[1:]); "
        "print(status, 'torch' in sys.modules)"
    )
    for argv in (["publish", str(tmp_path / "nothing")], ["publish", str(tmp_path), "--root", ""]):
        done = subprocess.run(
            [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120
        )
        assert done.stdout.split() == ["2", "False"], (argv, done.stdout, done.stderr)


def test_the_lazy_publish_facade_names_each_export_once():
    import ettr.publish as facade

    assert sorted(facade.__all__) == sorted(facade._WHERE)  # the static list and the table agree
    for name in facade.__all__:
        assert getattr(facade, name).__name__ == name, name
