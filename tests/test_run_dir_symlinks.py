"""Nothing under a run directory is written through a symlinked subdirectory (field trial: with
`RUN_DIR/heartbeats -> /` a job's heartbeats were made at the file system's root, with `agent -> victim`
its marker files in the victim's directory). The one helper (`ettr.untrusted.open_dir_below` /
`make_dirs_below`), the training-side writers that skip quietly, and `ettr run`, which refuses such a run
directory in one line with exit status 2 before it starts anything."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ettr.untrusted import SymlinkRefused, make_dirs_below, open_dir_below, symlinked_dirs


def _tree(directory: Path) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(top, n), directory)
        for top, ds, fs in os.walk(directory)
        for n in ds + fs
    )


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A directory an intruder points a link at: nothing may appear in it."""
    path = tmp_path / "victim"
    path.mkdir()
    (path / "precious.json").write_text("{}")
    return path


# -- the helper ---------------------------------------------------------------------------------------------
def test_make_dirs_below_makes_the_missing_chain_and_returns_it(tmp_path):
    base = tmp_path / "run"
    made = make_dirs_below(base, base / "heartbeats" / "attempt-2", mode=0o750)
    assert made == base / "heartbeats" / "attempt-2" and made.is_dir()
    assert make_dirs_below(base, base / "heartbeats" / "attempt-2") == made  # idempotent
    assert make_dirs_below(base, base) == base


@pytest.mark.parametrize("where", ["top", "middle", "last"])
def test_a_symlinked_component_is_refused_and_nothing_made_behind_it(tmp_path, victim, where):
    base = tmp_path / "run"
    base.mkdir()
    chain = ["agent", "attempt-2", "0"]
    index = {"top": 0, "middle": 1, "last": 2}[where]
    real = base.joinpath(*chain[:index])
    real.mkdir(parents=True, exist_ok=True)
    (real / chain[index]).symlink_to(victim, target_is_directory=True)
    with pytest.raises(SymlinkRefused) as refused:
        make_dirs_below(base, base.joinpath(*chain))
    assert refused.value.filename == str(base.joinpath(*chain[: index + 1]))
    assert str(refused.value).endswith("is a symlink; ettr does not follow a symlink there")
    assert _tree(victim) == ["precious.json"]


def test_a_file_where_a_directory_belongs_is_refused(tmp_path):
    base = tmp_path / "run"
    base.mkdir()
    (base / "steps").write_text("")
    with pytest.raises(SymlinkRefused, match="steps is a regular file, not a directory"):
        make_dirs_below(base, base / "steps")


def test_the_base_itself_may_be_a_symlink(tmp_path):
    real = tmp_path / "real-run"
    real.mkdir()
    (tmp_path / "run").symlink_to(real, target_is_directory=True)
    made = make_dirs_below(tmp_path / "run", tmp_path / "run" / "heartbeats" / "attempt-0")
    assert made.is_dir() and (real / "heartbeats" / "attempt-0").is_dir()


def test_paths_not_below_the_base_are_refused(tmp_path):
    base = tmp_path / "run"
    with pytest.raises(ValueError, match="not below"):
        make_dirs_below(base, tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="not a path below"):
        open_dir_below(base, "../elsewhere", create=True)
    assert not (tmp_path / "elsewhere").exists()


def test_open_dir_below_without_create_finds_only_what_is_there(tmp_path, victim):
    base = tmp_path / "run"
    (base / "agent").mkdir(parents=True)
    fd = open_dir_below(base, "agent")
    try:
        assert os.path.samestat(os.fstat(fd), os.stat(base / "agent"))
    finally:
        os.close(fd)
    with pytest.raises(FileNotFoundError):
        open_dir_below(base, "heartbeats")
    assert not (base / "heartbeats").exists()
    (base / "steps").symlink_to(victim, target_is_directory=True)
    refused = symlinked_dirs(base, ["agent", "heartbeats", "steps"])
    assert [r.filename for r in refused] == [str(base / "steps")]


def test_symlinked_dirs_also_sees_links_directly_inside(tmp_path, victim):
    base = tmp_path / "run"
    (base / "heartbeats" / "attempt-0").mkdir(parents=True)
    (base / "heartbeats" / "attempt-1").symlink_to(victim, target_is_directory=True)
    (base / "heartbeats" / "attempt-0" / "rank-0-pid-1").write_text("")
    refused = symlinked_dirs(base, ["heartbeats"], inside=["heartbeats"])
    assert [r.filename for r in refused] == [str(base / "heartbeats" / "attempt-1")]
    assert symlinked_dirs(base, ["heartbeats", "agent"], inside=["heartbeats/attempt-0", "agent"]) == []


# -- the writers inside a training process: never raise, never write through ---------------------------------
@pytest.mark.parametrize("link", ["heartbeats", "heartbeats/attempt-2"])
def test_the_heartbeat_skips_a_symlinked_directory_with_one_line(tmp_path, victim, link, caplog):
    from ettr.heartbeat import MainThreadHeartbeat
    from ettr.run_env import heartbeat_path

    run = tmp_path / "run"
    (run / link).parent.mkdir(parents=True, exist_ok=True)
    (run / link).symlink_to(victim, target_is_directory=True)
    beat = MainThreadHeartbeat(heartbeat_path(run, 2, 0, pid=11302), run_dir=run)
    with caplog.at_level("WARNING", logger="ettr"):
        beat.start()  # never raises
    beat.stop()
    assert _tree(victim) == ["precious.json"]
    assert [r.getMessage() for r in caplog.records] == [
        f"ettr: this process writes no heartbeat: {run / link} is a symlink; ettr does not follow a symlink there"
    ]


def test_the_step_tail_turns_off_under_a_symlinked_steps_directory(tmp_path, victim, caplog):
    from ettr.steptail import StepTail, tail_path

    run = tmp_path / "run"
    run.mkdir()
    (run / "steps").symlink_to(victim, target_is_directory=True)
    tail = StepTail(tail_path(run, 0, pid=7), run_dir=run)
    with caplog.at_level("WARNING", logger="ettr"):
        for step in range(1, 4):
            tail.note(0, step)  # never raises
    assert _tree(victim) == ["precious.json"]
    assert len(caplog.records) == 1 and "steps is a symlink" in caplog.records[0].getMessage()


def test_the_launcher_and_first_step_markers_are_not_written_through_a_symlinked_agent(tmp_path, victim):
    from ettr.bootstrap.start import tell_launcher
    from ettr.run_env import RunEnv

    run = tmp_path / "run"
    run.mkdir()
    (run / "agent").symlink_to(victim, target_is_directory=True)
    tell_launcher(4242, b"torchrun", RunEnv(run_dir=run, job_id="j", attempt=2))  # never raises
    assert _tree(victim) == ["precious.json"]


def test_compile_job_files_and_spill_files_are_not_written_through_symlinks(tmp_path, victim):
    from ettr.compile import dynamic
    from ettr.ledger.spill import _SpillFile, spill_dir

    run = tmp_path / "run"
    run.mkdir()
    (run / "compile").symlink_to(victim, target_is_directory=True)
    with pytest.raises(SymlinkRefused):  # the caller (the compile session) logs it and goes on
        dynamic.save(dynamic.job_file(run), [])
    (run / "ledger-spill").symlink_to(victim, target_is_directory=True)
    with pytest.raises(SymlinkRefused):  # the spilling ledger says it cannot spill there
        _SpillFile(spill_dir(run), job_id="j", writer="w", node="n")
    assert _tree(victim) == ["precious.json"]


# -- `ettr run` on a run directory with a symlinked subdirectory: one line, exit 2, nothing started ----------
@pytest.mark.parametrize(
    "link",
    ["heartbeats", "agent", "steps", "ledger-spill", "compile", "heartbeats/attempt-2", "agent/attempt-2"],
)
def test_ettr_run_refuses_a_run_directory_with_a_symlinked_subdirectory(tmp_path, victim, link, capsys):
    import sys

    from ettr.cli import main as cli_main

    run = tmp_path / "run"
    (run / link).parent.mkdir(parents=True, exist_ok=True)
    (run / link).symlink_to(victim, target_is_directory=True)
    marker = tmp_path / "ran"
    command = [sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"]
    assert cli_main(["run", "--run-dir", str(run), "--max-restarts", "0", "--", *command]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert f"{run / link} is a symlink" in err
    assert not marker.exists()  # the job never started
    assert _tree(victim) == ["precious.json"]


def test_ettr_run_refuses_a_file_where_a_subdirectory_belongs(tmp_path, capsys):
    import sys

    from ettr.cli import main as cli_main

    run = tmp_path / "run"
    run.mkdir()
    (run / "heartbeats").write_text("")
    assert cli_main(["run", "--run-dir", str(run), "--", sys.executable, "-c", "pass"]) == 2
    assert "heartbeats is a regular file, not a directory" in capsys.readouterr().err
