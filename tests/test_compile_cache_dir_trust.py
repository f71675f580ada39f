"""The inductor cache directory autoinstall picks: its predictable place is used only when it is private."""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import tempfile
from pathlib import Path

import pytest

from ettr.compile.autoinstall import inductor_cache_dir
from ettr.compile.config import private_cache_dir, private_cache_parts
from ettr.compile.safety import check_private_dir

KEY = "/jobs/train.py"


@pytest.fixture
def places(tmp_path, monkeypatch):
    """A hermetic `$TMPDIR` and `$XDG_CACHE_HOME`; returns both."""
    tmp, cache = tmp_path / "tmp", tmp_path / "cache"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    return tmp, cache


def _mode(path: Path | str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_predictable_directory_is_made_private_and_used(places):
    tmp, cache = places
    chosen = inductor_cache_dir(KEY)
    assert chosen == private_cache_dir(KEY) and Path(chosen).parent.parent == tmp
    assert _mode(chosen) == _mode(Path(chosen).parent) == 0o700
    assert inductor_cache_dir(KEY) == chosen  # the next attempt finds it again
    assert not cache.exists()


def _planted_by_another_user(tmp: Path, how: str) -> Path:
    user_dir, workload_dir = private_cache_parts(KEY)
    planted = tmp / user_dir / workload_dir
    planted.mkdir(parents=True)
    if how == "world-writable":
        os.chmod(planted.parent, 0o777)
        os.chmod(planted, 0o777)
    elif how == "owned by another uid":
        if os.geteuid() != 0:
            pytest.skip("only root can give a directory to another uid")
        os.chown(planted, 65534, 65534)
    else:
        planted.rmdir()
        (tmp / "elsewhere").mkdir(mode=0o700)
        planted.symlink_to(tmp / "elsewhere")
    return planted


@pytest.mark.parametrize("how", ["world-writable", "owned by another uid", "a symlink"])
def test_a_directory_another_user_made_first_is_not_used(places, caplog, how):
    tmp, cache = places
    planted = _planted_by_another_user(tmp, how)
    with caplog.at_level(logging.WARNING, logger="ettr"):
        chosen = Path(inductor_cache_dir(KEY))
    assert chosen == cache / "ettr" / "inductor" / planted.name
    for directory in (chosen, chosen.parent, chosen.parent.parent):
        check_private_dir(directory)
        assert _mode(directory) == 0o700
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(chosen) in warnings[0] and str(planted) in warnings[0]


def test_with_no_private_place_at_all_a_fresh_directory_is_made(places, caplog):
    tmp, cache = places
    planted = _planted_by_another_user(tmp, "world-writable")
    (cache / "ettr").mkdir(parents=True)
    os.chmod(cache / "ettr", 0o777)
    with caplog.at_level(logging.WARNING, logger="ettr"):
        chosen = Path(inductor_cache_dir(KEY))
    assert chosen.parent == tmp and chosen != planted.parent and _mode(chosen) == 0o700
    check_private_dir(chosen)
    assert not (cache / "ettr" / "inductor").exists()


def test_a_script_whose_path_is_not_utf8_keeps_compile_support(places):
    """The workload key is the main script's path, bytes: one under a directory named `scr\\xff` raised
    UnicodeEncodeError from the key's digest, and the job ran with "compile support off"."""
    from ettr.compile.config import pgo_job_id

    key = os.fsdecode(b"/jobs/scr\xff/train.py")
    chosen = inductor_cache_dir(key)
    assert chosen == private_cache_dir(key) and chosen != private_cache_dir(KEY)
    assert pgo_job_id(key).startswith("ettr-") and pgo_job_id(key) != pgo_job_id(KEY)
    assert pgo_job_id(KEY) == "ettr-" + hashlib.sha256(KEY.encode()).hexdigest()[:16]  # unchanged for UTF-8
