"""Compile store trust: no symlink followed, private directories, bounded unpacking, robust eviction."""

from __future__ import annotations

import gzip
import io
import os
import tarfile
from pathlib import Path

import pytest

from ettr.compile.artifacts import pack_dir, unpack_dir
from ettr.compile.backend import LocalBackend
from ettr.compile.config import CompileConfig, default_store
from ettr.compile.key import StoreKey
from ettr.compile.safety import UnpackLimits, UnsafeLocation, check_private_dir
from ettr.compile.store import CompileStore


def _key(user_key: str) -> StoreKey:
    return StoreKey(
        torch_version="t",
        python_version="p",
        platform="x",
        device_type="cpu",
        inductor_config="c",
        user_key=user_key,
    )


def _tar(members: dict[str, bytes], *, compress: bool = False) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz" if compress else "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_a_bomb_is_refused_before_anything_is_written(tmp_path):
    bomb = _tar({"k.so": bytes(200 * 1024**2)}, compress=True)
    assert len(bomb) < 300 * 1024  # ~200 KB packed
    dest = tmp_path / "cache"
    with pytest.raises(ValueError, match="expands"):
        unpack_dir(bomb, dest)
    assert not dest.exists() or not any(dest.iterdir())


def test_per_file_and_total_limits_are_configurable(tmp_path):
    archive = _tar({"a": b"x" * 1000, "b": b"y" * 1000})
    with pytest.raises(ValueError, match="member 'a'"):
        unpack_dir(archive, tmp_path / "d1", limits=UnpackLimits(max_file_bytes=500))
    with pytest.raises(ValueError, match="2000 bytes"):
        unpack_dir(archive, tmp_path / "d2", limits=UnpackLimits(max_total_bytes=1500))
    assert unpack_dir(archive, tmp_path / "d3").num_written == 2
    assert UnpackLimits.from_env({"ETTR_COMPILE_UNPACK_MAX_BYTES": "10"}).max_total_bytes == 10


def test_unpacking_never_follows_a_symlink_in_the_cache_dir(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "cache"
    dest.mkdir()
    (dest / "sub").symlink_to(outside)
    with pytest.raises(UnsafeLocation):
        unpack_dir(_tar({"sub/kernel.py": b"print('x')"}), dest)
    assert not any(outside.iterdir())
    # a symlink at a file's own name is refused too; its target is untouched
    target = outside / "victim"
    target.write_bytes(b"keep")
    (dest / "k.py").symlink_to(target)
    with pytest.raises(UnsafeLocation):
        unpack_dir(_tar({"k.py": b"new"}), dest)
    assert target.read_bytes() == b"keep"


def test_packing_skips_symlinks(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"private key")
    root = tmp_path / "cache"
    root.mkdir()
    (root / "real.py").write_bytes(b"code")
    (root / "link.py").symlink_to(secret)
    data, listing = pack_dir(root, compress=False)
    assert list(listing) == ["real.py"]
    assert b"private key" not in data


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


def test_a_nested_or_corrupt_manifest_never_breaks_eviction(tmp_path):
    store = CompileStore(LocalBackend(tmp_path / "store"), max_bytes=1500)
    keys = [_key(f"job{i}") for i in range(3)]
    for k in keys[:2]:
        store.save(k, {"a": b"x" * 600})
    root = tmp_path / "store"
    (root / "nested").mkdir()
    (root / "nested" / "manifest.json").write_bytes(b"[" * 100_000 + b"]" * 100_000)
    (root / "corrupt").mkdir()
    (root / "corrupt" / "manifest.json").write_bytes(gzip.compress(b"not json"))
    store.save(keys[2], {"a": b"x" * 600})  # evicts past 1500 bytes: must not raise
    names = set(os.listdir(root))
    assert "nested" not in names and "corrupt" not in names
    assert store.load(keys[2]) is not None
    assert sum(1 for k in keys if (root / k.digest).exists()) == 2


def test_config_paths(tmp_path):
    assert Path(default_store({"XDG_CACHE_HOME": "relative"})) == Path("~/.cache/ettr/compile")
