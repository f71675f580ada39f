"""Concurrent writers and readers of one compile store entry, in real processes (issue 25 item 6): every
round ends with an entry that is one writer's whole save, and a reader never sees a broken one."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from ettr.compile.backend import LocalBackend
from ettr.compile.key import StoreKey
from ettr.compile.store import CompileStore

KEY = StoreKey(
    torch_version="t",
    python_version="p",
    platform="x",
    device_type="cpu",
    inductor_config="c",
    user_key="shared",
)
ROUNDS = 12
SHARED = b"H" * 300_000  # a file every writer saves (the build's header, say)


def _files(writer: int, round_: int) -> dict[str, bytes]:
    own = f"writer {writer} round {round_} ".encode()
    return {f"k{i}.so": own * (50 + i) for i in range(8)} | {"header.gch": SHARED}


def _writer(root: str, writer: int, barrier, errors) -> None:
    store = CompileStore(LocalBackend(root), max_bytes=10**9)
    for round_ in range(ROUNDS):
        barrier.wait()  # both save at once
        try:
            store.save(KEY, {"cache": _files(writer, round_)}, meta={"writer": writer, "round": round_})
        except Exception as exc:  # noqa: BLE001 - reported to the test
            errors.put(f"writer {writer} round {round_}: {type(exc).__name__}: {exc}")
        barrier.wait()  # then the parent checks the entry


def _reader(root: str, stop, errors, seen) -> None:
    store = CompileStore(LocalBackend(root), max_bytes=10**9)
    num = 0
    while not stop.is_set():
        try:
            with store.reading():
                entry = store.head(KEY)
                if entry is None:
                    continue
                files = {rel: store.read(f) for rel, f in entry.artifacts["cache"].items()}
            writer, round_ = entry.meta["writer"], entry.meta["round"]
            if files != _files(writer, round_):
                errors.put(f"reader: the entry of writer {writer} round {round_} mixes saves")
            num += 1
        except Exception as exc:  # noqa: BLE001
            errors.put(f"reader: {type(exc).__name__}: {exc}")
    seen.put(num)


@pytest.mark.timeout(300)
def test_two_writers_and_a_reader_never_break_a_shared_entry(tmp_path: Path):
    context = multiprocessing.get_context("spawn")
    root = str(tmp_path / "store")
    barrier = context.Barrier(3)
    errors, seen, stop = context.Queue(), context.Queue(), context.Event()
    writers = [context.Process(target=_writer, args=(root, w, barrier, errors)) for w in (1, 2)]
    reader = context.Process(target=_reader, args=(root, stop, errors, seen))
    for process in (*writers, reader):
        process.start()
    store = CompileStore(LocalBackend(root), max_bytes=10**9)
    winners = set()
    try:
        for round_ in range(ROUNDS):
            barrier.wait(timeout=120)  # start of the round
            barrier.wait(timeout=120)  # both writers done
            entry = store.head(KEY)
            assert entry is not None and entry.meta["round"] == round_
            files = {rel: store.read(f) for rel, f in entry.artifacts["cache"].items()}
            assert files == _files(entry.meta["writer"], round_), f"round {round_}: a broken entry"
            winners.add(entry.meta["writer"])
    finally:
        stop.set()
        for process in (*writers, reader):
            process.join(timeout=120)
    problems = []
    while not errors.empty():
        problems.append(errors.get())
    assert not problems, problems
    assert all(p.exitcode == 0 for p in (*writers, reader))
    assert seen.get(timeout=10) >= 0
    # Only the last round's entry is left: the blobs of every replaced save were collected, the shared one
    # is stored once.
    store.evict()
    usage = store.usage()
    assert usage.num_entries == 1 and usage.stored_bytes == store.head(KEY).size_bytes
    backend = store.backend
    num_blobs = sum(len(backend.list(f"blobs/{shard}")) for shard in backend.list("blobs"))
    assert num_blobs == len(store.head(KEY).artifacts["cache"])
