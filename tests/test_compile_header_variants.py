"""Precompiled-header variants of the build's store entry: a restore copies only those the header memo names
for this build (`pch_memo.wanted_headers`), a save stores only those this process used, and a variant no
process used for `HEADER_VARIANT_TTL_S` is dropped by the next header save, never one in use."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ettr.compile import artifacts, pch_memo
from ettr.compile.backend import LocalBackend, MemoryBackend
from ettr.compile.key import StoreKey
from ettr.compile.restore import EntryView, StoreRestorer
from ettr.compile.save import HEADER_VARIANT_TTL_S, save_headers
from ettr.compile.store import USED_PART, CompileStore, blob_path

HEADER = "torch/csrc/inductor/cpp_prefix.h"
KEY = {"torch": "2.x", "compiler": "g++ 12"}
NEW, OLD = "cnew.h", "cold.h"


def _key(user_key: str = "job") -> StoreKey:
    return StoreKey(
        torch_version="2.13.0",
        python_version="cpython-3.11.7",
        platform="linux-x86_64",
        device_type="cpu",
        inductor_config="abc",
        user_key=user_key,
    )


def _memo(entries: list[dict[str, Any]]) -> bytes:
    return json.dumps({"schema": pch_memo.MEMO_SCHEMA, "entries": entries}).encode()


def _entry(header: str, *, key: dict[str, str] = KEY, cmd: str = "g++ -mavx512bf16") -> dict[str, Any]:
    return {"call": json.dumps([HEADER, cmd, []]), "key": key, "header": header}


def _variant(name: str, fill: bytes) -> dict[str, bytes]:
    return {name: f"#include <{name}>\n".encode(), f"{name}.gch": fill * 4096}


@pytest.fixture
def memo_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pch_memo, "memo_key", lambda header: dict(KEY) if header == HEADER else None)


def _store_with_two_variants(memo: bytes | None) -> tuple[CompileStore, StoreKey]:
    store = CompileStore(MemoryBackend())
    key = _key()
    cache = {"fxgraph/k": b"kernel"} | ({pch_memo.MEMO_NAME: memo} if memo is not None else {})
    store.save(key, {artifacts.INDUCTOR_ARCHIVE: cache})
    headers = _variant(NEW, b"n") | _variant(OLD, b"o")
    store.save(key.headers_key(), {artifacts.HEADERS_ARCHIVE: headers}, meta={"kind": "precompiled-headers"})
    return store, key


def _restore(store: CompileStore, key: StoreKey, tmp_path: Path, wanted: Any) -> dict[str, Any]:
    restorer = StoreRestorer(
        store=lambda: store, key=lambda: key, view=EntryView(), mark=lambda *_: None, wanted_headers=wanted
    )
    restorer.restore_once((tmp_path / "cache", tmp_path / "headers"))
    assert restorer.last_restore is not None
    return restorer.last_restore


def test_the_memo_names_the_variants_of_this_build_only(tmp_path: Path, memo_key: None) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / pch_memo.MEMO_NAME).write_bytes(
        _memo(
            [
                _entry(NEW),
                _entry(OLD, key={**KEY, "torch": "2.y"}),  # another build's answer
                _entry("../escape.h"),  # forged: outside the header directory
                _entry("/abs.h"),
                {"call": "not json", "key": KEY, "header": "x.h"},
                {"call": json.dumps([7]), "key": KEY, "header": "y.h"},
            ]
        )
    )
    assert pch_memo.wanted_headers(cache, tmp_path / "headers") == {NEW}


@pytest.mark.parametrize("memo", [None, b"{garbage", _memo([_entry(NEW, key={"torch": "other"})])])
def test_without_an_answer_of_this_build_the_variants_are_unknown(
    tmp_path: Path, memo_key: None, memo: bytes | None
) -> None:
    if memo is not None:
        (tmp_path / pch_memo.MEMO_NAME).write_bytes(memo)
    assert pch_memo.wanted_headers(tmp_path, tmp_path / "headers") is None


def test_with_the_memo_off_the_variants_are_unknown(
    tmp_path: Path, memo_key: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / pch_memo.MEMO_NAME).write_bytes(_memo([_entry(NEW)]))
    monkeypatch.setenv(pch_memo.MEMO_ENV, "0")
    assert pch_memo.wanted_headers(tmp_path, tmp_path / "headers") is None


def test_a_restore_copies_only_the_wanted_variant_and_records_its_use(tmp_path: Path, memo_key: None) -> None:
    store, key = _store_with_two_variants(_memo([_entry(NEW)]))
    info = _restore(store, key, tmp_path, pch_memo.wanted_headers)
    assert sorted(p.name for p in (tmp_path / "headers").iterdir()) == [NEW, f"{NEW}.gch"]
    assert info["header_variants"] == "1 of 2" and info["status"] == "hit"
    assert set(store.parts_used(key.headers_key().digest)) == {NEW}
    # The next restore on this node finds the wanted variant there: nothing is read.
    again = _restore(store, key, tmp_path, pch_memo.wanted_headers)
    assert again["already_present"] == [artifacts.INDUCTOR_ARCHIVE, artifacts.HEADERS_ARCHIVE]


@pytest.mark.parametrize(
    "memo",
    [
        None,  # no memo: unknown
        _memo([_entry("cgone.h")]),  # names a variant the store lacks: inductor may build any
    ],
)
def test_a_restore_copies_every_variant_when_the_wanted_ones_are_unknown_or_not_stored(
    tmp_path: Path, memo_key: None, memo: bytes | None
) -> None:
    store, key = _store_with_two_variants(memo)
    info = _restore(store, key, tmp_path, pch_memo.wanted_headers)
    assert len(list((tmp_path / "headers").iterdir())) == 4
    assert "header_variants" not in info


def test_a_failing_variant_lookup_restores_every_variant(tmp_path: Path) -> None:
    store, key = _store_with_two_variants(_memo([_entry(NEW)]))

    def broken(cache: Path, headers: Path) -> None:
        raise RuntimeError("inductor moved")

    info = _restore(store, key, tmp_path, broken)
    assert info["status"] == "hit" and len(list((tmp_path / "headers").iterdir())) == 4


def test_a_damaged_wanted_variant_is_refused_and_the_workload_entry_kept(
    tmp_path: Path, memo_key: None
) -> None:
    store, key = _store_with_two_variants(_memo([_entry(NEW)]))
    gch = store.head(key.headers_key()).artifacts[artifacts.HEADERS_ARCHIVE][f"{NEW}.gch"]  # type: ignore[union-attr]
    path = blob_path(gch.sha256, compressed=store.backend.compress)
    store.backend.write(path, b"forged" + store.backend.read(path)[6:])
    info = _restore(store, key, tmp_path, pch_memo.wanted_headers)
    assert info["status"] == "hit" and "removed it" in info["headers_error"]
    assert not (tmp_path / "headers" / f"{NEW}.gch").exists()
    assert (tmp_path / "cache" / "fxgraph" / "k").read_bytes() == b"kernel"


def test_a_save_stores_only_the_variants_this_process_used(tmp_path: Path) -> None:
    headers = tmp_path / "headers"
    headers.mkdir()
    for name, fill in ((NEW, b"n"), (OLD, b"o")):
        for rel, data in _variant(name, fill).items():
            (headers / rel).write_bytes(data)
    assert set(artifacts.header_files(artifacts.tree(headers), {NEW})) == {NEW, f"{NEW}.gch"}
    store = CompileStore(MemoryBackend())
    save_headers(store, _key(), artifacts.header_files(artifacts.tree(headers), {NEW}), used={NEW})
    stored = store.head(_key().headers_key()).artifacts[artifacts.HEADERS_ARCHIVE]  # type: ignore[union-attr]
    assert set(stored) == {NEW, f"{NEW}.gch"}


def test_a_variant_unused_past_the_bound_is_dropped_never_one_in_use(tmp_path: Path) -> None:
    store = CompileStore(LocalBackend(tmp_path / "store"))
    key = _key()
    build = key.headers_key()
    third = "cthird.h"
    headers = _variant(NEW, b"n") | _variant(OLD, b"o") | _variant(third, b"t")
    store.save(build, {artifacts.HEADERS_ARCHIVE: headers}, meta={"kind": "precompiled-headers"})
    created = store.head(build).created_ts  # type: ignore[union-attr]
    later = created + HEADER_VARIANT_TTL_S + 60
    store.touch_part(build.digest, third, later - 3600)  # another process restored it an hour ago
    # Before the bound nothing is dropped (and nothing new: the entry is not rewritten).
    assert save_headers(store, key, _variant(NEW, b"n"), used={NEW}, now=created + 60)["headers"] == "shared"
    # Past it: the old variant goes, the one this process uses and the recently used one stay.
    info = save_headers(store, key, _variant(NEW, b"n"), used={NEW}, now=later)
    assert info["headers"] == "saved" and info["headers_dropped"] == [OLD]
    stored = store.head(build).artifacts[artifacts.HEADERS_ARCHIVE]  # type: ignore[union-attr]
    assert {artifacts.header_variant(rel) for rel in stored} == {NEW, third}
    # Its stored files go with the eviction (no restore in flight), the others stay readable.
    store.evict()
    assert all(store.read(f) for f in stored.values())
    assert len([n for s in store.backend.list("blobs") for n in store.backend.list(f"blobs/{s}")]) == 4


def test_forged_or_odd_use_records_are_ignored(tmp_path: Path) -> None:
    store = CompileStore(LocalBackend(tmp_path / "store"))
    build = _key().headers_key()
    store.save(build, {artifacts.HEADERS_ARCHIVE: _variant(NEW, b"n")})
    store.backend.write(f"{build.digest}/{USED_PART}{NEW}", b"nan")
    store.backend.write(f"{build.digest}/{USED_PART}{OLD}", b"not a number")
    store.backend.write(f"{build.digest}/{USED_PART}..h", b"1.0")
    assert store.parts_used(build.digest) == {}
    store.touch_part(build.digest, "../x.h", 5.0)  # not a variant name: nothing written
    store.touch_part(build.digest, NEW, 5.0)
    assert store.parts_used(build.digest) == {NEW: 5.0}
    store.touch_part(build.digest, NEW, 6.0)  # fresh enough: not written again
    assert store.parts_used(build.digest) == {NEW: 5.0}
    store.delete(build.digest)  # an entry's use records go with it
    assert not (tmp_path / "store" / build.digest).exists()


@pytest.mark.parametrize(
    ("rel", "variant"),
    [("c1.h", "c1.h"), ("c1.h.gch", "c1.h"), ("c1.h.pch", "c1.h"), ("other.txt", "other.txt")],
)
def test_files_belong_to_their_header_variant(rel: str, variant: str) -> None:
    assert artifacts.header_variant(rel) == variant


def test_collect_takes_the_used_variants_else_every_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    headers, cache = tmp_path / "headers", tmp_path / "cache"
    headers.mkdir()
    cache.mkdir()
    for name, fill in ((NEW, b"n"), (OLD, b"o")):
        for rel, data in _variant(name, fill).items():
            (headers / rel).write_bytes(data)
    monkeypatch.setattr(artifacts, "headers_dir", lambda: headers)
    monkeypatch.setattr(artifacts, "inductor_cache_dir", lambda: cache)
    monkeypatch.setattr(artifacts, "used_precompiled_headers", lambda: True)
    used = artifacts.collect(include_megacache=False, headers_used={NEW}).headers
    assert set(used) == {NEW, f"{NEW}.gch"}
    # None of the used ones is in this directory (it moved): every header, as before.
    assert len(artifacts.collect(include_megacache=False, headers_used={"cgone.h"}).headers) == 4
    assert len(artifacts.collect(include_megacache=False).headers) == 4
