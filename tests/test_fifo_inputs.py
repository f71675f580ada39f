"""A FIFO (or directory, device) where ettr expects a file it reads is refused with one line, never waited in:
opening a FIFO for reading blocks until a writer comes, which for a file nobody writes is for ever. Each test
has a short timeout so that a regression fails here instead of holding the suite."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ettr.cli import main
from ettr.untrusted import loads_bounded, not_regular, open_regular

pytestmark = pytest.mark.timeout(120)


def _fifo(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


def test_open_regular_refuses_a_fifo_without_blocking_and_says_what_it_is(tmp_path):
    fifo = _fifo(tmp_path / "f")
    with pytest.raises(OSError) as refused:
        open_regular(fifo)
    assert refused.value.errno == errno.EINVAL and "a FIFO" in str(refused.value)
    with pytest.raises(OSError):  # for writing, with no reader: refused too (ENXIO), never a wait
        open_regular(fifo, os.O_WRONLY)
    with pytest.raises(OSError) as refused:
        open_regular(tmp_path)
    assert "a directory" in str(refused.value)
    assert not_regular(fifo) == "a FIFO" and not_regular(tmp_path) == "a directory"
    assert not_regular(tmp_path / "missing") is None
    regular = tmp_path / "r"
    regular.write_bytes(b"x")
    assert not_regular(regular) is None
    fd = open_regular(regular)
    try:
        assert os.get_blocking(fd) and os.read(fd, 10) == b"x"
    finally:
        os.close(fd)


def test_a_fifo_named_ledger_db_is_one_clear_line_not_a_silent_non_run_dir(tmp_path, capsys):
    from ettr.testing.fleet import JobSpec, write_job

    good = write_job(tmp_path / "good", JobSpec(job_id="good-job"))
    _fifo(tmp_path / "bad" / "ledger.db")
    assert main(["report", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert (
        len(err.strip().splitlines()) == 1 and "is a FIFO" in err and "not an ettr run directory" not in err
    )

    assert main(["fleet", str(good), str(tmp_path / "bad"), "--json"]) == 0  # the rest of the fleet goes on
    err = capsys.readouterr().err
    assert "skipped" in err and "is a FIFO" in err

    assert main(["report", str(good), str(tmp_path / "bad"), "--json"]) == 2
    err = capsys.readouterr().err
    assert "is a FIFO" in err


@pytest.mark.parametrize("suffix", ["-journal", "-wal", "-shm"])
def test_a_fifo_beside_the_ledger_where_sqlite_keeps_its_files_is_one_line(tmp_path, capsys, suffix):
    """SQLite opens its journal, log and index by name: a FIFO `ledger.db-journal` held `ettr report` (and
    so a whole `ettr fleet`, and `ettr run` in that directory) for ever."""
    from ettr.testing.fleet import JobSpec, write_job

    good = write_job(tmp_path / "good", JobSpec(job_id="good-job"))
    bad = write_job(tmp_path / "bad", JobSpec(job_id="bad-job"))
    (bad / f"ledger.db{suffix}").unlink(missing_ok=True)  # SQLite may have left its own file there
    _fifo(bad / f"ledger.db{suffix}")
    # In a process of its own first: SQLite waits in a FIFO in C, where the test's timeout cannot end it.
    report = subprocess.run(
        [sys.executable, "-m", "ettr", "report", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert report.returncode == 2, report.stderr
    lines = report.stderr.strip().splitlines()
    assert len(lines) == 1 and f"ledger.db{suffix} is a FIFO" in lines[0]

    # the rest of the fleet goes on (the bad job may still be read from its summary, never waited in)
    assert main(["fleet", str(good), str(bad), "--json"]) == 0
    assert "good-job" in capsys.readouterr().out

    assert main(["run", "--run-dir", str(bad), "--", sys.executable, "-c", "pass"]) == 2
    err = capsys.readouterr().err
    assert f"ledger.db{suffix} is a FIFO" in err and "Traceback" not in err


def test_a_fifo_as_a_ledger_url_file_is_one_line(tmp_path, capsys):
    fifo = _fifo(tmp_path / "shared.db")
    assert main(["report", "--ledger", f"sqlite:///{fifo}", "--job-id", "j"]) == 2
    assert "is a FIFO" in capsys.readouterr().err


def test_a_fifo_named_like_a_checkpoint_manifest_is_refused_not_waited_in(tmp_path):
    from ettr.checkpoint.storage import LocalStorage

    _fifo(tmp_path / "step-00000010" / "manifest.json")
    with pytest.raises(OSError, match="a FIFO"):
        LocalStorage(str(tmp_path)).read_bytes("step-00000010/manifest.json")


def test_a_fifo_in_a_compile_cache_is_refused_not_waited_in(tmp_path):
    from ettr.compile.safety import UnsafeLocation, read_no_follow

    with pytest.raises(UnsafeLocation, match="a FIFO"):
        read_no_follow(_fifo(tmp_path / "artifact"))


def test_run_dir_files_that_are_fifos_read_as_missing(tmp_path):
    from ettr.compile import dynamic, fastbatch
    from ettr.inplace.generations import AgentGenerations
    from ettr.run_env import inplace_next_path
    from ettr.steptail import read_tails, tail_path
    from ettr.supervisor.launch import is_shell_command

    _fifo(dynamic.job_file(tmp_path))
    assert dynamic.load(dynamic.job_file(tmp_path)) == ((), [])
    os.unlink(dynamic.job_file(tmp_path))
    _fifo(fastbatch.job_file(tmp_path))
    assert fastbatch.load_spec(fastbatch.job_file(tmp_path)) is None
    _fifo(tail_path(tmp_path, 0, pid=1234))
    assert read_tails(tmp_path, 0) == {}
    _fifo(inplace_next_path(tmp_path))
    assert AgentGenerations(tmp_path, 0).next_attempt() is None
    assert is_shell_command([str(_fifo(tmp_path / "train.sh"))]) is False


def test_a_fifo_named_like_a_published_artifacts_manifest_is_no_manifest(tmp_path):
    from ettr.publish.artifact import MANIFEST_FILE, read_manifest

    _fifo(tmp_path / "artifact" / MANIFEST_FILE)
    assert read_manifest(tmp_path / "artifact") is None


def test_a_fifo_named_like_a_pulse_is_skipped_not_waited_in(tmp_path):
    """The supervisor's watch loop reads every `rank-R-pid-P.pulse` of the attempt: a FIFO by that name held
    it in open() for ever (no restart, no hang detection, SIGTERM unheard; found with `ettr run` on a job
    that made one). The others are still read."""
    from ettr.heartbeat import read_pulses
    from ettr.run_env import heartbeat_dir

    good = '{"v": 1, "steps": 3, "step_s": 0.5, "intervals": 2, "phases": []}'
    directory = heartbeat_dir(tmp_path, 0)
    _fifo(directory / "rank-0-pid-1.pulse")
    (directory / "rank-1-pid-2.pulse").write_text(good)
    (tmp_path / "elsewhere.pulse").write_text(good)
    (directory / "rank-2-pid-3.pulse").symlink_to(tmp_path / "elsewhere.pulse")
    assert [(p.rank, p.steps) for p in read_pulses(tmp_path, 0)] == [(1, 3)]


def test_a_fifo_planted_where_a_pulse_is_written_aside_is_never_waited_in(tmp_path):
    """A pulse was written aside at the fixed name `.rank-R-pid-P.pulse.tmp`: a FIFO planted there (by whoever
    may write the run directory) held the heartbeat thread in open() for ever, its touches stopped and the
    job was killed as hung. The aside name is random now (`atomic_write`)."""
    import threading

    from ettr.heartbeat import _write_pulse, read_pulses
    from ettr.run_env import heartbeat_path

    pulse = heartbeat_path(tmp_path, 0, 0, pid=7).with_name("rank-0-pid-7.pulse")
    _fifo(pulse.with_name(f".{pulse.name}.tmp"))
    done = threading.Event()

    def write() -> None:
        _write_pulse(pulse, {"v": 1, "steps": 3, "step_s": 0.5, "intervals": 2, "phases": []})
        done.set()

    threading.Thread(target=write, daemon=True).start()
    assert done.wait(20), "the pulse writer waits in a planted FIFO"
    assert [(p.rank, p.steps) for p in read_pulses(tmp_path, 0)] == [(0, 3)]


@pytest.mark.parametrize("text", ['{"ts": 1e400}', '{"ts": -1e400}', '{"ts": 1' + "0" * 400 + "}"])
def test_a_number_past_a_floats_range_is_refused_as_not_json_ettr_writes(text):
    """`1e400` parsed as infinity and a 400-digit integer parsed whole; a reader's float() of the latter
    raised OverflowError, which readers that expect ValueError from a forged file let through (a traceback
    out of `ettr compile-report`, a restore that failed every attempt)."""
    with pytest.raises(ValueError, match="not a number ettr writes"):
        loads_bounded(text)
    assert loads_bounded('{"ts": 1' + "0" * 299 + ', "f": 1.5e300}')["f"] == 1.5e300
