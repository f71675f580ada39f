"""Compile store trust: no symlink followed, private directories, bounded unpacking, robust eviction."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from ettr.compile.artifacts import restore_tree, tree
from ettr.compile.backend import LocalBackend, MemoryBackend
from ettr.compile.config import CompileConfig, default_store
from ettr.compile.key import StoreKey
from ettr.compile.safety import UnpackLimits, UnsafeLocation, check_private_dir
from ettr.compile.store import CompileStore, EntryRefused, StoredFile, blob_path


def _key(user_key: str) -> StoreKey:
    return StoreKey(
        torch_version="t",
        python_version="p",
        platform="x",
        device_type="cpu",
        inductor_config="c",
        user_key=user_key,
    )


def _stored(tmp_path: Path, files: dict[str, bytes]) -> tuple[CompileStore, dict[str, StoredFile]]:
    store = CompileStore(MemoryBackend())
    store.save(_key("t"), {"a": files})
    return store, dict(store.head(_key("t")).artifacts["a"])


def test_limits_are_checked_before_anything_is_written(tmp_path):
    store, files = _stored(tmp_path, {"a": b"x" * 1000, "b": b"y" * 1000})
    with pytest.raises(ValueError, match="'a'"):
        restore_tree(files, tmp_path / "d1", store.read, limits=UnpackLimits(max_file_bytes=500))
    with pytest.raises(ValueError, match="2000 bytes"):
        restore_tree(files, tmp_path / "d2", store.read, limits=UnpackLimits(max_total_bytes=1500))
    assert not (tmp_path / "d1").exists() and not (tmp_path / "d2").exists()
    assert restore_tree(files, tmp_path / "d3", store.read).num_written == 2
    assert UnpackLimits.from_env({"ETTR_COMPILE_UNPACK_MAX_BYTES": "10"}).max_total_bytes == 10


def test_a_compressed_bomb_is_refused(tmp_path):
    store = CompileStore(MemoryBackend())  # compresses, as a remote store does
    store.save(_key("t"), {"a": {"k.so": b"small"}})
    stored = store.head(_key("t")).artifacts["a"]["k.so"]
    bomb = gzip.compress(bytes(200 * 1024**2))
    assert len(bomb) < 300 * 1024  # ~200 KB packed
    store.backend.write(blob_path(stored.sha256, compressed=True), bomb)
    with pytest.raises(EntryRefused, match="expands"):
        store.read(stored)


def test_restoring_never_follows_a_symlink_in_the_cache_dir(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "cache"
    dest.mkdir()
    (dest / "sub").symlink_to(outside)
    store, files = _stored(tmp_path, {"sub/kernel.py": b"print('x')"})
    with pytest.raises(UnsafeLocation):
        restore_tree(files, dest, store.read)
    assert not any(outside.iterdir())
    # a symlink at a file's own name is refused too; its target is untouched
    target = outside / "victim"
    target.write_bytes(b"keep")
    (dest / "k.py").symlink_to(target)
    store, files = _stored(tmp_path, {"k.py": b"new"})
    with pytest.raises(UnsafeLocation):
        restore_tree(files, dest, store.read)
    assert target.read_bytes() == b"keep"


def test_collecting_skips_symlinks(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"private key")
    root = tmp_path / "cache"
    root.mkdir()
    (root / "real.py").write_bytes(b"code")
    (root / "link.py").symlink_to(secret)
    assert list(tree(root)) == ["real.py"]


def test_the_store_root_is_created_private_and_others_refused(tmp_path):
    root = tmp_path / "store"
    backend = LocalBackend(root)
    backend.write("d/x", b"1")
    assert (root.stat().st_mode & 0o777) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(UnsafeLocation, match="writable"):
        LocalBackend(shared).write("d/x", b"1")
    with pytest.raises(UnsafeLocation, match="writable"):
        check_private_dir(shared)
    link = tmp_path / "link"
    link.symlink_to(root)
    with pytest.raises(UnsafeLocation, match="symlink"):
        LocalBackend(link).read("d/x")


def test_a_store_below_a_folder_others_may_write_is_refused_unless_that_folder_is_sticky(tmp_path):
    # The store's own folder was checked, not the one above it: whoever may write that can rename the checked
    # store away and put theirs (kernels: code this job runs) in its place between the check and the read.
    # A sticky folder (/tmp) lets only an entry's owner rename it.
    above = tmp_path / "team"
    above.mkdir()
    LocalBackend(above / "store").write("d/x", b"1")  # (private all the way: taken)
    os.chmod(above, 0o777)
    with pytest.raises(UnsafeLocation, match="without the sticky bit"):
        LocalBackend(above / "store").read("d/x")
    with pytest.raises(UnsafeLocation, match="without the sticky bit"):
        check_private_dir(above / "store" / "d")  # (any folder further up counts)
    os.chmod(above, 0o1777)
    assert LocalBackend(above / "store").read("d/x") == b"1"


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to chown a folder")
def test_a_private_folder_below_a_folder_another_user_owns_is_refused(tmp_path):
    # `/tmp/x` made first by another user (mode 755: not writable by us or others), then
    # ETTR_MEMORY_DIR=/tmp/x/mine or a store there: `mine` is ours, 0700, and passed every check, yet the
    # owner of `x` can rename it away between a check and a use and put theirs (kernels, a memory copy) there.
    from ettr.run_env import memory_root, private_dir_problem

    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    LocalBackend(theirs / "store").write("d/x", b"1")  # (ours all the way: taken)
    os.chown(theirs, 4242, 4242)
    with pytest.raises(UnsafeLocation, match="owned by uid 4242"):
        LocalBackend(theirs / "store").read("d/x")
    mine = memory_root({"ETTR_MEMORY_DIR": str(theirs / "mine")})
    assert mine is not None
    mine.mkdir(mode=0o700)
    assert "owned by uid 4242, neither this user nor root" in (private_dir_problem(mine) or "")
    # sticky too: the sticky bit lets a folder's owner rename any entry (`/tmp/torchinductor_$USER` made first by
    # another user with mode 1777 passed, and precompiled headers were restored into a folder they could swap)
    os.chmod(theirs, 0o1777)
    with pytest.raises(UnsafeLocation, match="owned by uid 4242"):
        check_private_dir(theirs / "store")
    os.chmod(theirs, 0o755)
    os.chown(theirs, 0, 0)
    assert private_dir_problem(mine) is None


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to chown a folder")
def test_a_folder_above_the_users_home_is_trusted_whoever_owns_it(tmp_path, monkeypatch):
    # A cluster's /home/<group> owned by its admin: its owner could swap the home itself (~/.bashrc and all),
    # so refusing ~/.cache/ettr/compile below it would only cost every job its compile store.
    from ettr.run_env import private_dir_problem

    group = tmp_path / "group"
    (group / "alice" / ".cache").mkdir(parents=True, mode=0o700)
    os.chown(group, 4242, 4242)
    assert "owned by uid 4242" in (private_dir_problem(group / "alice" / ".cache") or "")
    monkeypatch.setenv("HOME", str(group / "alice"))
    assert private_dir_problem(group / "alice" / ".cache") is None


def test_the_store_never_reads_through_a_planted_symlink(tmp_path):
    root = tmp_path / "store"
    backend = LocalBackend(root)
    backend.write("d/x", b"1")
    (tmp_path / "elsewhere").write_bytes(b"foreign")
    os.remove(root / "d" / "x")
    (root / "d" / "x").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafeLocation):
        backend.read("d/x")


def test_default_store_is_under_the_users_cache():
    assert default_store({"XDG_CACHE_HOME": "/home/u/.cache"}) == "/home/u/.cache/ettr/compile"
    assert default_store({}).startswith("~/.cache/")
    config = CompileConfig.from_env({"XDG_CACHE_HOME": "/x/cache"})
    assert config is not None and config.store == "/x/cache/ettr/compile"


def test_a_nested_corrupt_or_absurd_manifest_never_breaks_eviction(tmp_path):
    store = CompileStore(LocalBackend(tmp_path / "store"), max_bytes=1500)
    keys = [_key(f"job{i}") for i in range(3)]
    for k in keys[:2]:
        store.save(k, {"a": {"a": k.user_key.encode().ljust(600, b".")}})
    root = tmp_path / "store"
    bad = {
        "nested": b"[" * 100_000 + b"]" * 100_000,
        "corrupt": gzip.compress(b"not json"),
        "absurd": json.dumps(
            {
                "schema": "ettr.compile-store/2",
                "digest": f"{2:032x}",  # its own folder's: refused for the size alone
                "key": {},
                "created_ts": 1.0,
                "artifacts": {"a": {"a": {"sha256": "0" * 64, "size": 10**400, "mode": 420, "mtime": 0}}},
            }
        ).encode(),
    }
    for index, body in enumerate(bad.values()):
        digest = f"{index:032x}"  # looks like an entry: the store must read, refuse and remove it
        (root / digest).mkdir()
        (root / digest / "manifest.json").write_bytes(body)
    store.save(keys[2], {"a": {"a": b"job2".ljust(600, b".")}})  # evicts past 1500 bytes: must not raise
    names = set(os.listdir(root))
    assert not any(f"{index:032x}" in names for index in range(len(bad)))
    assert store.head(keys[2]) is not None
    assert sum(1 for k in keys if (root / k.digest).exists()) == 2


def test_config_paths(tmp_path):
    assert Path(default_store({"XDG_CACHE_HOME": "relative"})) == Path("~/.cache/ettr/compile")
