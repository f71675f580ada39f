"""The commit protocol: manifest last, "latest" verifies, corruption is detected, retention is safe."""

from __future__ import annotations

import json
import logging
import os
import uuid

import pytest

from ettr.checkpoint.base import MANIFEST_NAME, CheckpointInvalid, step_dir_name
from ettr.checkpoint.commit import (
    LEASE_PREFIX,
    Manifest,
    apply_retention,
    commit,
    find_latest,
    lease,
    list_checkpoints,
    verify,
)
from ettr.checkpoint.storage import FsspecStorage, LocalStorage, open_storage
from ettr.testing.memory_storage import MemoryStorage


def _write_checkpoint(
    storage, step: int, *, payload: bytes | None = None, committed: bool = True
) -> list[str]:
    """A fake checkpoint directory: two data files, then (if committed) the manifest."""
    name = step_dir_name(step)
    files = {"__0_0.distcp": payload or os.urandom(4096) + bytes([step % 256]), ".metadata": b"meta%d" % step}
    for file_name, data in files.items():
        storage.write_atomic(f"{name}/{file_name}", data)
    if committed:
        commit(storage, step, files)
    return list(files)


@pytest.fixture(params=["local", "memory", "dict"])
def storage(request, tmp_path):
    if request.param == "local":
        return LocalStorage(tmp_path / "ckpt")
    if request.param == "dict":
        return MemoryStorage()  # the fake of ettr.testing: no fsspec
    return FsspecStorage(f"memory://ettr-test-{uuid.uuid4().hex}")


def _flip_byte(storage, rel: str, offset: int) -> None:
    data = bytearray(storage.read_bytes(rel))
    data[offset] ^= 0x01
    storage.write_atomic(rel, bytes(data))


def test_commit_writes_a_manifest_that_verifies(storage):
    _write_checkpoint(storage, 10)
    manifest = verify(storage, step_dir_name(10))
    assert manifest.step == 10
    assert set(manifest.files) == {"__0_0.distcp", ".metadata"}
    assert manifest.files["__0_0.distcp"].size == 4097
    # no temporary file is left beside it
    assert sorted(storage.list_dir(step_dir_name(10))) == sorted([".metadata", "__0_0.distcp", MANIFEST_NAME])


def test_a_directory_without_manifest_is_incomplete(storage):
    _write_checkpoint(storage, 5, committed=False)
    with pytest.raises(CheckpointInvalid, match="no manifest"):
        verify(storage, step_dir_name(5))


def test_truncated_shard_is_detected_even_without_checksums(storage):
    _write_checkpoint(storage, 7)
    rel = f"{step_dir_name(7)}/__0_0.distcp"
    storage.write_atomic(rel, storage.read_bytes(rel)[:-100])
    for checksums in (True, False):
        with pytest.raises(CheckpointInvalid, match="truncated"):
            verify(storage, step_dir_name(7), checksums=checksums)


def test_bit_flipped_shard_is_detected(storage):
    _write_checkpoint(storage, 7)
    _flip_byte(storage, f"{step_dir_name(7)}/__0_0.distcp", 1234)
    with pytest.raises(CheckpointInvalid, match="CRC-32"):
        verify(storage, step_dir_name(7))
    # a size-only check cannot see a flipped bit: that is what the default full check is for
    assert verify(storage, step_dir_name(7), checksums=False).step == 7


def test_missing_shard_is_detected(storage):
    _write_checkpoint(storage, 3)
    storage.remove(f"{step_dir_name(3)}/__0_0.distcp")
    with pytest.raises(CheckpointInvalid, match="missing"):
        verify(storage, step_dir_name(3))


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "other_step"])
def test_corrupt_manifest_is_detected(storage, damage):
    _write_checkpoint(storage, 4)
    rel = f"{step_dir_name(4)}/{MANIFEST_NAME}"
    raw = storage.read_bytes(rel)
    if damage == "flip":
        body = json.loads(raw)
        body["files"]["__0_0.distcp"]["size"] += 1  # a plausible-looking edit: the self-checksum catches it
        storage.write_atomic(rel, json.dumps(body).encode())
    elif damage == "truncate":
        storage.write_atomic(rel, raw[: len(raw) // 2])
    elif damage == "garbage":
        storage.write_atomic(rel, b"\x00\xff" * 10)
    else:  # a whole valid manifest of another step copied over
        _write_checkpoint(storage, 9)
        storage.write_atomic(rel, storage.read_bytes(f"{step_dir_name(9)}/{MANIFEST_NAME}"))
    with pytest.raises(CheckpointInvalid):
        verify(storage, step_dir_name(4))


def test_a_manifest_with_a_number_past_a_floats_range_is_corrupt_not_an_exception(storage):
    """A created_ts of 10**400 with the CRC recomputed (anyone can: no key needed) raised OverflowError out
    of `verify`: every attempt's restore failed the same way, and `ettr run` gave up (exit 3)."""
    from ettr.checkpoint.commit import _body_crc

    _write_checkpoint(storage, 4)
    rel = f"{step_dir_name(4)}/{MANIFEST_NAME}"
    body = json.loads(storage.read_bytes(rel))
    body.pop("manifest_crc32")
    body["created_ts"] = 10**400
    body["manifest_crc32"] = _body_crc(body)
    storage.write_atomic(rel, json.dumps(body).encode())
    with pytest.raises(CheckpointInvalid, match="OverflowError"):
        verify(storage, step_dir_name(4))


def test_manifest_roundtrip():
    manifest = Manifest(step=3, files={}, created_ts=1.5, world_size=4, extra={"k": "v"})
    assert Manifest.from_json(manifest.to_json()) == manifest


def test_latest_skips_newer_bad_checkpoints_with_a_warning_naming_them(storage, caplog):
    for step in (10, 20, 30, 40):
        _write_checkpoint(storage, step)
    _flip_byte(storage, f"{step_dir_name(40)}/__0_0.distcp", 99)  # corrupt
    storage.remove(f"{step_dir_name(30)}/{MANIFEST_NAME}")  # incomplete
    _write_checkpoint(storage, 50, committed=False)  # a crash mid-persist
    with caplog.at_level(logging.WARNING, logger="ettr"):
        resolution = find_latest(storage)
    assert resolution.latest is not None and resolution.latest.step == 20
    assert [name for name, _ in resolution.skipped] == [step_dir_name(s) for s in (50, 40, 30)]
    for step in (50, 40, 30):
        assert any(step_dir_name(step) in record.getMessage() for record in caplog.records)


def test_latest_of_nothing_is_none(storage):
    assert find_latest(storage).latest is None
    _write_checkpoint(storage, 1, committed=False)
    assert find_latest(storage).latest is None


def test_latest_at_most(storage):
    for step in (1, 2, 3):
        _write_checkpoint(storage, step)
    assert find_latest(storage, at_most=2).latest.step == 2


def test_other_names_are_ignored(storage):
    _write_checkpoint(storage, 1)
    storage.write_atomic("step_000000009.bad-1/x", b"x")
    storage.write_atomic("notes.txt", b"x")
    assert [c.step for c in list_checkpoints(storage)] == [1]


def test_write_atomic_never_shows_a_partial_file(storage):
    class Boom(Exception):
        pass

    def explode() -> None:
        raise Boom

    with pytest.raises(Boom):
        storage.write_atomic("d/file", b"0123456789", on_partial=explode)
    assert "file" not in storage.list_dir("d")


def test_retention_keeps_the_newest_k_and_what_may_be_in_flight(storage):
    for step in (1, 2, 3, 4):
        _write_checkpoint(storage, step)
    _write_checkpoint(storage, 0, committed=False)  # abandoned, older than the newest committed
    _write_checkpoint(storage, 5, committed=False)  # newer than the newest committed: may be in flight
    removed = apply_retention(storage, keep_last=2)
    assert sorted(removed) == [step_dir_name(s) for s in (0, 1, 2)]
    assert [c.step for c in list_checkpoints(storage)] == [3, 4, 5]


def test_retention_never_deletes_the_newest_committed_even_if_newer_ones_are_broken(storage):
    _write_checkpoint(storage, 1)
    for step in (2, 3):
        _write_checkpoint(storage, step, committed=False)
    assert apply_retention(storage, keep_last=1) == []
    assert verify(storage, step_dir_name(1)).step == 1


def test_retention_spares_protected_and_leased_checkpoints(storage):
    for step in (1, 2, 3, 4):
        _write_checkpoint(storage, step)
    with lease(storage, step_dir_name(1)):
        assert any(e.startswith(LEASE_PREFIX) for e in storage.list_dir(step_dir_name(1)))
        removed = apply_retention(storage, keep_last=1, protected_steps=[2])
    assert removed == [step_dir_name(3)]
    assert not any(e.startswith(LEASE_PREFIX) for e in storage.list_dir(step_dir_name(1)))
    # the lease file does not make the checkpoint fail verification
    assert verify(storage, step_dir_name(1)).step == 1


def test_an_expired_lease_does_not_protect(storage):
    for step in (1, 2):
        _write_checkpoint(storage, step)
    storage.write_atomic(f"{step_dir_name(1)}/{LEASE_PREFIX}dead", json.dumps({"ts": 1000.0}).encode())
    assert apply_retention(storage, keep_last=1, lease_ttl_s=60.0, now_s=2000.0) == [step_dir_name(1)]


@pytest.mark.parametrize("ts", [32503680000.0, 1e300, "NaN", 10**400])
def test_a_lease_from_the_future_does_not_protect_for_ever(storage, ts):
    """A lease dated the year 3000 (or 1e300: damage, or forged by whoever writes the root) was live for
    ever: retention never deleted its checkpoint, and the root grew by one checkpoint per save."""
    for step in (1, 2):
        _write_checkpoint(storage, step)
    text = '{"ts": NaN}' if ts == "NaN" else json.dumps({"ts": ts})
    storage.write_atomic(f"{step_dir_name(1)}/{LEASE_PREFIX}forged", text.encode())
    storage.write_atomic(f"{step_dir_name(2)}/{LEASE_PREFIX}skewed", json.dumps({"ts": 2030.0}).encode())
    assert apply_retention(storage, keep_last=1, lease_ttl_s=60.0, now_s=2000.0) == [step_dir_name(1)]


def test_retention_rejects_zero():
    with pytest.raises(ValueError):
        apply_retention(LocalStorage("/nonexistent"), keep_last=0)


def test_open_storage_picks_the_backend(tmp_path):
    assert isinstance(open_storage(tmp_path), LocalStorage)
    assert isinstance(open_storage(f"file://{tmp_path}"), LocalStorage)
    assert open_storage(f"file://{tmp_path}").url == str(tmp_path)
    assert isinstance(open_storage("memory://x"), FsspecStorage)


def test_fsspec_storage_pickles():
    import pickle

    storage = FsspecStorage(f"memory://ettr-{uuid.uuid4().hex}")
    storage.write_atomic("a/b", b"hello")
    clone = pickle.loads(pickle.dumps(storage))
    assert clone.read_bytes("a/b") == b"hello"


@pytest.mark.parametrize("kind", ["directory", "fifo", "symlink", "deep", "huge"])
def test_a_damaged_lease_neither_stops_retention_nor_is_read_whole(tmp_path, kind):
    """A `.ettr-lease-*` that is a directory, a FIFO or a symlink, nests 100,000 levels, or is a 10 GB sparse
    file (anyone who writes the root can put one there) made retention raise (every older checkpoint kept,
    save after save) or read the whole file into the training rank's memory. It is damage: no lease."""
    storage = LocalStorage(tmp_path)
    for step in (1, 2, 3):
        _write_checkpoint(storage, step)
    bad = tmp_path / step_dir_name(1) / f"{LEASE_PREFIX}bad"
    if kind == "directory":
        bad.mkdir()
    elif kind == "fifo":
        os.mkfifo(bad)
    elif kind == "symlink":
        bad.symlink_to("/dev/zero")
    elif kind == "deep":
        bad.write_text("[" * 100_000 + "]" * 100_000)
    else:
        with open(bad, "wb") as f:
            f.truncate(10 << 30)
    assert apply_retention(storage, keep_last=1, lease_ttl_s=60.0, now_s=2000.0) == [
        step_dir_name(1),
        step_dir_name(2),
    ]


def test_a_huge_manifest_is_refused_without_being_read_whole(tmp_path):
    """A 10 GB sparse `manifest.json` in a forged `step_*` directory was read whole by `find_latest` (the
    newest is tried first): a resume allocated 10 GB before the manifest was found not to be JSON."""
    storage = LocalStorage(tmp_path)
    _write_checkpoint(storage, 1)
    forged = tmp_path / step_dir_name(2)
    forged.mkdir()
    with open(forged / MANIFEST_NAME, "wb") as f:
        f.truncate(10 << 30)
    with pytest.raises(CheckpointInvalid, match="larger than"):
        verify(storage, step_dir_name(2))
    assert find_latest(storage).latest.step == 1
