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
