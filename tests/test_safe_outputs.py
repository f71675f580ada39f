"""Every output file is written through `ettr.atomic` (issue 12 item 7): `ettr report --html/--trace` never
writes through a planted symlink and never replaces a non-regular file (a device node, a FIFO, a directory)."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from ettr.cli import main as cli_main
from ettr.events import SUPERVISOR_RANK, Event, EventKind
from ettr.heartbeat import MainThreadHeartbeat
from ettr.ledger import open_ledger


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    ledger = open_ledger(run)
    t0 = 1_700_000_000.0
    ledger.append(
        [
            Event(EventKind.SUPERVISOR_START, t0, 0, SUPERVISOR_RANK, data={"job_id": "j", "pid": 1}),
            Event(EventKind.ATTEMPT_START, t0 + 1, 0, SUPERVISOR_RANK),
            Event(EventKind.STEP, t0 + 2, 0, 0, step=1),
            Event(
                EventKind.ATTEMPT_END,
                t0 + 3,
                0,
                SUPERVISOR_RANK,
                data={"outcome": "completed", "exit_code": 0},
            ),
            Event(EventKind.JOB_END, t0 + 3, 0, SUPERVISOR_RANK, data={"exit_status": 0}),
        ]
    )
    ledger.close()
    return run


def _refused(capsys, argv: list[str]) -> str:
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("flag", ["--html", "--trace"])
def test_a_symlink_planted_at_the_output_is_not_written_through(tmp_path, run_dir, capsys, flag):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "report.out"
    out.symlink_to(victim)
    _refused(capsys, ["report", str(run_dir), flag, str(out)])
    assert victim.read_text() == "precious" and out.is_symlink()


@pytest.mark.parametrize("flag", ["--html", "--trace"])
def test_symlinks_planted_at_temporary_names_are_never_followed(tmp_path, run_dir, capsys, flag):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "report.out"
    # The names a naive writer would use: none is what ettr writes to, and none is followed.
    for name in ("report.out.tmp", ".report.out.tmp", "report.out~", ".report.out.swp"):
        (tmp_path / name).symlink_to(victim)
    assert cli_main(["report", str(run_dir), flag, str(out)]) == 0
    assert victim.read_text() == "precious" and out.is_file() and not out.is_symlink()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp") and not p.is_symlink()]


def test_a_device_node_a_fifo_and_a_directory_at_the_output_are_refused(tmp_path, run_dir, capsys):
    fifo = tmp_path / "fifo.html"
    os.mkfifo(fifo)
    directory = tmp_path / "dir.html"
    directory.mkdir()
    targets = [fifo, directory]
    device = tmp_path / "null.html"
    try:
        os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # like /dev/null
        targets.append(device)
    except PermissionError:
        pass  # not root: the FIFO stands for every non-regular file
    for target in targets:
        before = os.lstat(target)
        err = _refused(capsys, ["report", str(run_dir), "--html", str(target)])
        assert "not a regular file" in err
        after = os.lstat(target)
        assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)


def test_the_heartbeat_never_touches_through_a_planted_symlink(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("x")
    old = time.time() - 1000
    os.utime(victim, (old, old))
    path = tmp_path / "hb" / "rank-0-pid-1"
    path.parent.mkdir()
    path.symlink_to(victim)
    beat = MainThreadHeartbeat(path)
    beat.start()
    beat.stop()
    beat.sample()
    assert victim.stat().st_mtime == pytest.approx(old)
    (tmp_path / "hb2").mkdir()
    missing = tmp_path / "hb2" / "rank-0-pid-2"
    second = MainThreadHeartbeat(missing)
    second.start()
    second.stop()
    assert missing.is_file()


def test_a_write_that_need_not_be_durable_is_still_whole_and_skips_fsync(tmp_path, monkeypatch):
    import os

    from ettr import atomic

    synced: list[int] = []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd))
    atomic.atomic_write(tmp_path / "cache.bin", memoryview(b"abcdef")[1:4], durable=False)
    assert (tmp_path / "cache.bin").read_bytes() == b"bcd" and synced == []
    assert [p.name for p in tmp_path.iterdir()] == ["cache.bin"]  # no temporary left behind
    atomic.atomic_write(tmp_path / "data.bin", b"x")
    assert len(synced) == 2  # the file and its directory


def test_atomic_fill_shows_only_what_its_fill_finished_and_leaves_nothing_when_it_raises(tmp_path):
    from ettr.atomic import atomic_fill, atomic_write

    target = tmp_path / "blob"
    atomic_write(target, b"old")

    def refuse(fd: int) -> None:
        os.write(fd, b"half")
        raise ValueError("does not match its checksum")

    with pytest.raises(ValueError):
        atomic_fill(target, refuse, durable=False)
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["blob"]
    atomic_fill(target, lambda fd: os.write(fd, b"new"), mode=0o600, durable=False)
    assert target.read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == ["blob"]
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(OSError):
        atomic_fill(tmp_path / "link", lambda fd: os.write(fd, b"x"))  # never through a symlink
    assert target.read_bytes() == b"new"
