"""The compile artifact store: keyed entries, atomic commits, refusal of foreign or tampered entries, LRU."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from ettr.compile import artifacts
from ettr.compile.backend import FsspecBackend, LocalBackend, MemoryBackend, open_backend
from ettr.compile.key import StoreKey, current_key
from ettr.compile.store import CompileStore, EntryRefused, StoreConfig


def _key(user_key: str = "job", torch_version: str = "2.13.0") -> StoreKey:
    return StoreKey(
        torch_version=torch_version,
        python_version="cpython-3.11.7",
        platform="linux-x86_64",
        device_type="cpu",
        inductor_config="abc",
        user_key=user_key,
    )


@pytest.fixture(params=["memory", "local", "fsspec-memory"])
def backend(request, tmp_path):
    if request.param == "memory":
        return MemoryBackend()
    if request.param == "local":
        return LocalBackend(tmp_path / "store")
    pytest.importorskip("fsspec")
    return FsspecBackend(f"memory://ettr-test-{tmp_path.name}")


def test_save_then_load_returns_the_same_artifacts_and_meta(backend):
    store = CompileStore(backend)
    files = {"a.bin": b"kernel" * 100, "b.tar.gz": b"\x00\x01" * 10}
    size = store.save(_key(), files, meta={"dynamic_sources": ["L['x']:0"]})
    entry = store.load(_key())
    assert entry is not None
    assert dict(entry.files) == files and size == entry.size_bytes
    assert entry.meta == {"dynamic_sources": ["L['x']:0"]}
    assert store.load(_key(), names={"a.bin"}).files == {"a.bin": files["a.bin"]}


def test_other_keys_miss(backend):
    store = CompileStore(backend)
    store.save(_key(), {"a": b"1"})
    assert store.load(_key(user_key="other")) is None
    assert store.load(_key(torch_version="2.12.0")) is None


def test_an_entry_written_for_another_key_is_refused():
    backend = MemoryBackend()
    store = CompileStore(backend)
    store.save(_key(torch_version="2.12.0"), {"a": b"old kernels"})
    # Someone copies the entry under the digest of our key (a foreign entry in our slot).
    foreign, ours = _key(torch_version="2.12.0").digest, _key().digest
    for path, data in list(backend.objects.items()):
        backend.objects[path.replace(foreign, ours)] = data.replace(foreign.encode(), ours.encode())
    with pytest.raises(EntryRefused, match="another key"):
        store.load(_key())


def test_a_tampered_artifact_is_refused(backend):
    store = CompileStore(backend)
    store.save(_key(), {"a": b"good kernel"})
    manifest = json.loads(backend.read(f"{_key().digest}/manifest.json"))
    blob = manifest["files"]["a"]["blob"]
    backend.write(f"{_key().digest}/{blob}", b"evil kernel")
    with pytest.raises(EntryRefused, match="checksum"):
        store.load(_key())


def test_a_missing_artifact_or_garbled_manifest_is_refused():
    backend = MemoryBackend()
    store = CompileStore(backend)
    store.save(_key(), {"a": b"x"})
    digest = _key().digest
    manifest = json.loads(backend.read(f"{digest}/manifest.json"))
    backend.delete(f"{digest}/{manifest['files']['a']['blob']}")
    with pytest.raises(EntryRefused, match="missing"):
        store.load(_key())
    backend.write(f"{digest}/manifest.json", b"{not json")
    with pytest.raises(EntryRefused, match="unreadable"):
        store.load(_key())


def test_with_a_secret_only_entries_signed_with_it_load():
    backend = MemoryBackend()
    CompileStore(backend).save(_key(), {"a": b"unsigned"})
    signed = CompileStore(backend, secret=b"s3cret")
    with pytest.raises(EntryRefused, match="signature"):
        signed.load(_key())
    signed.save(_key(), {"a": b"signed"})
    assert signed.load(_key()).files["a"] == b"signed"
    with pytest.raises(EntryRefused, match="signature"):
        CompileStore(backend, secret=b"another").load(_key())
    # Editing the manifest (say, to match a swapped artifact) breaks its signature.
    digest = _key().digest
    manifest = json.loads(backend.read(f"{digest}/manifest.json"))
    manifest["files"]["a"]["size_bytes"] = 4
    backend.write(f"{digest}/manifest.json", json.dumps(manifest).encode())
    with pytest.raises(EntryRefused, match="signature"):
        signed.load(_key())


def test_saving_again_replaces_the_entry_and_drops_its_old_blobs():
    backend = MemoryBackend()
    store = CompileStore(backend)
    store.save(_key(), {"a": b"v1", "b": b"only in v1"})
    store.save(_key(), {"a": b"v2"})
    assert store.load(_key()).files == {"a": b"v2"}
    assert sorted(backend.list(_key().digest)) == sorted(
        [
            "manifest.json",
            "used",
            json.loads(backend.read(f"{_key().digest}/manifest.json"))["files"]["a"]["blob"],
        ]
    )


def test_least_recently_used_entries_are_evicted_past_the_size_bound(backend, monkeypatch):
    clock = iter(range(1000, 2000))
    monkeypatch.setattr("ettr.compile.store.time.time", lambda: float(next(clock)))
    store = CompileStore(backend, max_bytes=250)
    for name in ("one", "two", "three"):
        store.save(_key(name), {"a": b"x" * 80})
    store.load(_key("one"))  # "one" is now the most recently used
    store.save(_key("four"), {"a": b"x" * 80})
    remaining = {e.user_key for e in store.entries()}
    assert remaining == {"one", "three", "four"}
    assert store.load(_key("two")) is None
    assert sum(e.size_bytes for e in store.entries()) <= 250


def test_an_entry_bigger_than_the_bound_is_kept_alone():
    store = CompileStore(MemoryBackend(), max_bytes=10)
    store.save(_key("small"), {"a": b"x" * 5})
    store.save(_key("big"), {"a": b"x" * 50})
    assert [e.user_key for e in store.entries()] == ["big"]


def test_local_backend_leaves_no_temporary_files(tmp_path):
    backend = LocalBackend(tmp_path)
    backend.write("d/obj", b"1")
    backend.write("d/obj", b"2")
    assert backend.read("d/obj") == b"2"
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["obj"]
    with pytest.raises(ValueError):
        backend.write("../escape", b"x")
    with pytest.raises(FileNotFoundError):
        backend.read("d/none")


def test_open_backend_picks_local_for_paths_and_fsspec_for_urls(tmp_path):
    assert isinstance(open_backend(tmp_path), LocalBackend)
    assert isinstance(open_backend(f"file://{tmp_path}"), LocalBackend)
    pytest.importorskip("fsspec")
    assert isinstance(open_backend("memory://x"), FsspecBackend)


def test_store_config_is_validated():
    with pytest.raises(ValueError, match="location"):
        StoreConfig(location="")
    with pytest.raises(ValueError, match="max_bytes"):
        StoreConfig(location="/x", max_bytes=0)
    assert "s3cret" not in repr(StoreConfig(location="/x", secret=b"s3cret"))


def test_key_digest_is_stable_and_depends_on_every_component():
    base = _key()
    assert base.digest == _key().digest and len(base.digest) == 32
    for field in (
        "torch_version",
        "python_version",
        "platform",
        "device_type",
        "inductor_config",
        "user_key",
    ):
        changed = StoreKey(
            **{**{k: v for k, v in base.components().items() if k != "key_version"}, field: "z"}
        )
        assert changed.digest != base.digest, field


def test_current_key_names_this_torch_and_python():
    import sys

    import torch

    key = current_key(user_key="u", device_type="cpu")
    assert key.torch_version.startswith(torch.__version__)
    assert key.python_version.endswith(".".join(map(str, sys.version_info[:3])))
    assert key.device_type == "cpu" and key.user_key == "u"
    assert current_key(user_key="u", device_type="cpu") == key


def test_archives_round_trip_and_skip_locks(tmp_path):
    src = tmp_path / "src"
    (src / "ab").mkdir(parents=True)
    (src / "ab" / "kernel.so").write_bytes(b"\x7fELF" * 10)
    (src / "locks").mkdir()
    (src / "locks" / "x.lock").write_text("")
    (src / "fxgraph.tmp").write_text("partial")
    for compress in (True, False):
        data, listing = artifacts.pack_dir(src, compress=compress)
        assert listing == {"ab/kernel.so": 40}
        dest = tmp_path / f"dest-{compress}"
        assert not artifacts.present(listing, dest)
        result = artifacts.unpack_dir(data, dest)
        assert (dest / "ab" / "kernel.so").read_bytes() == b"\x7fELF" * 10
        assert not (dest / "locks").exists() and not (dest / "fxgraph.tmp").exists()
        assert result.num_written == 1 and artifacts.present(listing, dest)
        assert artifacts.unpack_dir(data, dest).num_present == 1  # already there: left alone
        assert artifacts.fingerprint(src) == artifacts.fingerprint(dest)


def test_a_grown_pgo_profile_alone_is_nothing_new_to_save_but_is_packed(tmp_path):
    # torch adds an entry to the PGO profile in every process: a warm job that compiled nothing new must
    # not save its whole entry again; a new kernel file does change the digest, and the profile is packed.
    root = tmp_path / "cache"
    (root / "dynamo").mkdir(parents=True)
    (root / "fxgraph").mkdir()
    (root / "fxgraph" / "g1").write_bytes(b"graph")
    profile = root / "dynamo" / "code_state_ettr-abc_None_.pkl"
    profile.write_bytes(b"p" * 300)
    before = artifacts.fingerprint(root)
    profile.write_bytes(b"p" * 500)
    assert artifacts.fingerprint(root) == before
    (root / "fxgraph" / "g2").write_bytes(b"new graph")
    assert artifacts.fingerprint(root) != before
    _, listing = artifacts.pack_dir(root, compress=False)
    assert listing["dynamo/code_state_ettr-abc_None_.pkl"] == 500


@pytest.mark.parametrize("name", ["../evil.so", "/abs/evil.so"])
def test_archives_with_escaping_paths_are_refused(tmp_path, name):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo(name)
        info.size = 3
        tar.addfile(info, io.BytesIO(b"bad"))
    with pytest.raises(ValueError, match="plain relative"):
        artifacts.unpack_dir(buffer.getvalue(), tmp_path / "dest")
    assert not (tmp_path / "evil.so").exists()


def test_archives_with_links_are_refused(tmp_path):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo("link")
        info.type = tarfile.SYMTYPE
        info.linkname = "/etc/passwd"
        tar.addfile(info)
    with pytest.raises(ValueError):
        artifacts.unpack_dir(buffer.getvalue(), tmp_path / "dest")
