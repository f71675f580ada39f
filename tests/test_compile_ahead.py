"""A parked spare's compile store restore, done ahead (`ettr.compile.ahead`): the files are there before the
promotion and nothing is booked until the session's MARK after it; directories moved after the park are
restored into as before; a spare killed mid-restore leaves nothing a later restore trusts."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from compile_node import CountingBackend, node_dirs  # noqa: E402
from ettr.compile import ahead, artifacts  # noqa: E402
from ettr.compile.backend import MemoryBackend  # noqa: E402
from ettr.compile.config import CompileConfig  # noqa: E402
from ettr.compile.hooks import CompileRecord  # noqa: E402
from ettr.compile.key import StoreKey  # noqa: E402
from ettr.compile.session import STORE_MARK, CompileSession  # noqa: E402
from ettr.compile.store import CompileStore, EntryRefused, StoreConfig  # noqa: E402
from ettr.events import EventKind  # noqa: E402
from ettr.ledger import MemoryLedger  # noqa: E402
from ettr.recorder import Recorder  # noqa: E402

KEY = StoreKey(
    torch_version="t", python_version="p", platform="x", device_type="cpu", inductor_config="c", user_key="u"
)
CONFIG = CompileConfig(store="memory", include_megacache=False, save_at_exit=False)


@pytest.fixture
def node(tmp_path, monkeypatch):
    """Inductor's cache and header directories under `tmp_path/<name>`, switched by `node(name)`."""
    monkeypatch.setattr(ahead, "_current", None)
    yield from node_dirs(tmp_path, monkeypatch)


def _session(store: CompileStore, tmp_path: Path, *, take: bool = True) -> tuple[CompileSession, Recorder]:
    rec = Recorder(MemoryLedger(), run_dir=tmp_path / "run", flush_interval_s=60)
    return CompileSession(rec, CONFIG, store=store, key=KEY, ahead=ahead.take() if take else None), rec


def _saved(
    node, store: CompileStore, tmp_path: Path, files: int = 1, *, name: str = "first", grow: int = 0
) -> None:
    """Node `name` compiled `files` kernels (100 B each, + `grow`) and used one header (1,000 B, + `grow`), and
    saved them (another job's save of the same key: `grow` stands for its paths in the files)."""
    cache, headers = node(name)
    for i in range(files):
        (cache / f"k{i}").mkdir(parents=True)
        (cache / f"k{i}" / "kernel.so").write_bytes(bytes([65 + i % 26]) * (100 + grow))
    headers.mkdir(parents=True)
    (headers / "prefix.h.gch").write_bytes(b"h" * (1000 + grow))
    first, rec = _session(store, tmp_path, take=False)
    first.hooks.records.append(
        CompileRecord(begin_ts=1.0, end_ts=2.0, compile_id="0/0", trigger="dynamo", recompile_reason=None)
    )
    assert first.save() is True
    rec.close()


def _marks(session: CompileSession, rec: Recorder) -> list:
    session.close()
    return [e for e in rec._ledger.read() if e.kind is EventKind.MARK and e.data["name"] == STORE_MARK]


def test_a_spare_restores_ahead_and_its_session_books_it_only_after_the_promotion(node, tmp_path):
    backend = CountingBackend()
    store = CompileStore(backend)
    _saved(node, store, tmp_path)
    cache, headers = node("spare")
    assert ahead.start(CONFIG, refix_headers=False, store=store, key=KEY) is True
    running = ahead.current()
    assert running is not None and running.done.wait(30)
    # Before the promotion: the files are where the promoted process will compile, and nothing is booked
    # (the ahead restore has no recorder; its report waits in this module).
    assert (cache / "k0" / "kernel.so").read_bytes() == b"A" * 100
    assert (headers / "prefix.h.gch").read_bytes() == b"h" * 1000
    assert running.info is not None and running.info["status"] == "hit" and running.info["num_files"] == 2

    promoted_at = time.time()
    backend.reads.clear()
    session, rec = _session(store, tmp_path)
    assert ahead.current() is None  # taken once
    session.prepare()
    assert session.last_restore["already_present"] == sorted(
        [artifacts.HEADERS_ARCHIVE, artifacts.INDUCTOR_ARCHIVE]
    )
    assert all(path.endswith(("manifest.json", "used")) for path in backend.reads)  # no file read again
    [mark] = _marks(session, rec)
    assert mark.ts >= promoted_at
    said = mark.data["ahead"]
    assert said["status"] == "hit" and said["num_files"] == 2 and said["loaded_bytes"] == 1100
    assert said["begin_ts"] < promoted_at and said["duration_s"] >= 0 and "unused" not in said
    assert mark.data["restored"] == [] and mark.data["num_files"] == 0
    assert mark.data["version"] == "latest" and "earlier_unused" not in mark.data  # nobody saved since
    from ettr.report.compile_text import _store_line

    assert "restored ahead by the spare before its promotion (0.0 MB, " in _store_line(mark.data)
    assert "already on the node" not in _store_line(mark.data)
    forged = _store_line({"action": "restore", "ahead": {"loaded_bytes": "x", "duration_s": float("nan")}})
    assert forged == "restore ? (restored ahead by the spare before its promotion)"
    rec.close()


def test_directories_moved_after_the_park_are_restored_into_as_without_a_spare(node, tmp_path):
    store = CompileStore(MemoryBackend())
    _saved(node, store, tmp_path)
    node("at-park")
    assert ahead.start(CONFIG, refix_headers=False, store=store, key=KEY)
    running = ahead.current()
    assert running is not None and running.done.wait(30)
    cache, headers = node("after-rendezvous")  # the script moved TORCHINDUCTOR_CACHE_DIR after its rendezvous
    session, rec = _session(store, tmp_path)
    session.prepare()
    assert set(session.last_restore["restored"]) == {artifacts.INDUCTOR_ARCHIVE, artifacts.HEADERS_ARCHIVE}
    assert (cache / "k0" / "kernel.so").read_bytes() == b"A" * 100
    assert (headers / "prefix.h.gch").read_bytes() == b"h" * 1000
    [mark] = _marks(session, rec)
    assert "cache directory moved" in mark.data["ahead"]["unused"]
    from ettr.report.compile_text import _store_line

    assert "the spare's restore ahead unused: the inductor cache directory moved" in _store_line(mark.data)
    rec.close()


def test_another_entry_at_the_promotion_is_restored_as_without_a_spare(node, tmp_path):
    store = CompileStore(MemoryBackend())
    _saved(node, store, tmp_path)
    node("spare")
    other = dataclasses.replace(KEY, inductor_config="changed")
    assert ahead.start(CONFIG, refix_headers=False, store=store, key=KEY)
    running = ahead.current()
    assert running is not None and running.done.wait(30)
    said = running.settle(running.dirs, other.digest, CONFIG.store)
    assert "another entry" in said["ahead"]["unused"]


def _parked_then_saved_again(node, store: CompileStore, tmp_path: Path) -> tuple[Path, Path]:
    """A spare restores ahead on node "spare"; then another job saves the same key again, its files of other
    sizes. Returns the spare's (cache, headers) directories, current again."""
    _saved(node, store, tmp_path)
    node("spare")
    assert ahead.start(CONFIG, refix_headers=False, store=store, key=KEY)
    running = ahead.current()
    assert running is not None and running.done.wait(30) and running.in_place is not None
    _saved(node, store, tmp_path, name="other", grow=20)
    latest = store.head(KEY)
    assert latest is not None and latest.artifacts[artifacts.INDUCTOR_ARCHIVE]["k0/kernel.so"].size == 120
    return node("spare")


def test_an_entry_saved_again_after_the_park_is_not_copied_over_the_version_in_place(node, tmp_path):
    backend = CountingBackend()
    store = CompileStore(backend)
    cache, headers = _parked_then_saved_again(node, store, tmp_path)
    backend.reads.clear()
    session, rec = _session(store, tmp_path)
    session.prepare()
    restore = session.last_restore
    assert restore["status"] == "hit" and restore["restored"] == [] and restore["num_files"] == 0
    both = sorted([artifacts.HEADERS_ARCHIVE, artifacts.INDUCTOR_ARCHIVE])
    assert restore["already_present"] == both
    assert restore["version"] == "earlier" and sorted(restore["earlier_artifacts"]) == both
    assert all(path.endswith(("manifest.json", "used")) for path in backend.reads)  # no file read
    # The process compiles from the version in place: the spare's, whole.
    assert (cache / "k0" / "kernel.so").read_bytes() == b"A" * 100
    assert (headers / "prefix.h.gch").read_bytes() == b"h" * 1000
    # Its view is that version: nothing compiled, nothing saved (it holds what the store held at the park) ...
    assert session.save() is False
    # ... and what it compiles next is saved, with the files it compiled from.
    (cache / "k9").mkdir()
    (cache / "k9" / "kernel.so").write_bytes(b"n" * 50)
    assert session.save() is True
    saved = store.head(KEY)
    assert saved is not None
    tree = saved.artifacts[artifacts.INDUCTOR_ARCHIVE]
    assert tree["k0/kernel.so"].size == 100 and tree["k9/kernel.so"].size == 50
    [mark] = [m for m in _marks(session, rec) if m.data["action"] == "restore"]
    from ettr.report.compile_text import _store_line

    line = _store_line(mark.data)
    assert "the store's entry was saved again since; the version in place counted" in line
    assert "nothing copied" in line
    rec.close()


@pytest.mark.parametrize("change", ["rewritten", "replaced", "removed"])
def test_a_file_changed_after_the_park_falls_back_to_the_ordinary_restore(node, tmp_path, change):
    store = CompileStore(MemoryBackend())
    cache, headers = _parked_then_saved_again(node, store, tmp_path)
    kernel = cache / "k0" / "kernel.so"
    if change == "rewritten":  # the same size, other bytes, in place
        with open(kernel, "r+b") as f:
            f.write(b"Z" * 100)
    elif change == "replaced":  # the same size and time, another file
        stat = kernel.stat()
        kernel.unlink()
        kernel.write_bytes(b"Z" * 100)
        os.utime(kernel, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    else:
        kernel.unlink()
    session, rec = _session(store, tmp_path)
    session.prepare()
    restore = session.last_restore
    assert restore["status"] == "hit" and restore["restored"] == [artifacts.INDUCTOR_ARCHIVE]
    assert restore["version"] == "earlier" and restore["earlier_artifacts"] == [artifacts.HEADERS_ARCHIVE]
    assert "inductor_cache: 1 of its 1 files changed or removed since" in restore["earlier_unused"]
    assert kernel.read_bytes() == b"A" * 120  # the store's latest, checked as it was copied
    assert store_meta_is_latest(session, store)
    [mark] = [m for m in _marks(session, rec) if m.data["action"] == "restore"]
    from ettr.report.compile_text import _store_line

    line = _store_line(mark.data)
    assert "the version in place counted (precompiled_headers: nothing copied)" in line
    assert "the version in place not used: inductor_cache: 1 of its 1 files changed or removed since" in line
    rec.close()


def store_meta_is_latest(session: CompileSession, store: CompileStore) -> bool:
    latest = store.head(KEY)
    return latest is not None and session.store_meta == dict(latest.meta)


def test_an_incomplete_restore_ahead_leaves_nothing_to_count(node, tmp_path):
    store = CompileStore(MemoryBackend())
    _saved(node, store, tmp_path)
    node("spare")
    read = store.read

    def refused(stored):
        raise EntryRefused("a damaged stored file")

    store.read = refused  # type: ignore[method-assign]
    store.copy_into = lambda *a: False  # type: ignore[method-assign]
    assert ahead.start(CONFIG, refix_headers=False, store=store, key=KEY)
    running = ahead.current()
    assert running is not None and running.done.wait(30)
    assert running.info is not None and running.info["status"] == "refused" and running.in_place is None
    store.read = read  # type: ignore[method-assign]
    _saved(node, store, tmp_path, name="other", grow=20)
    node("spare")
    session, rec = _session(store, tmp_path)
    session.prepare()
    restore = session.last_restore
    assert restore["status"] == "hit" and artifacts.INDUCTOR_ARCHIVE in restore["restored"]
    assert "version" not in restore  # nothing was offered
    rec.close()


KILLED = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from ettr.compile import ahead, artifacts
    from ettr.compile.config import CompileConfig
    from ettr.compile.key import StoreKey
    from ettr.compile.store import CompileStore, StoreConfig

    store = CompileStore.open(StoreConfig(location=sys.argv[1]))
    read = store.read
    def slow_read(stored):
        time.sleep(0.3)  # a slow restore, killed part way
        return read(stored)
    store.read = slow_read
    store.copy_into = lambda *a: False
    key = StoreKey(torch_version="t", python_version="p", platform="x", device_type="cpu",
                   inductor_config="c", user_key="u")
    cache, headers = Path(sys.argv[2]), Path(sys.argv[3])
    artifacts.inductor_cache_dir = lambda: cache
    artifacts.headers_dir = lambda: headers
    ahead.start(CompileConfig(store=sys.argv[1]), refix_headers=False, store=store, key=key)
    print("started", flush=True)
    time.sleep(600)
    """
)


def test_a_spare_killed_mid_restore_leaves_nothing_a_later_restore_trusts(node, tmp_path):
    location = tmp_path / "store"
    store = CompileStore.open(StoreConfig(location=str(location)))
    _saved(node, store, tmp_path, files=8)
    stored = store.head(KEY)
    assert stored is not None
    tree = stored.artifacts[artifacts.INDUCTOR_ARCHIVE]
    cache, headers = node("spare")
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(location), str(cache), str(headers)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if cache.exists() and sum(1 for p in cache.rglob("kernel.so")) >= 2:
                break
            time.sleep(0.02)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
        os.kill(proc.pid, signal.SIGKILL)  # mid-restore: holding the node's restore lock
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
    written = sorted(p for p in cache.rglob("kernel.so"))
    assert 2 <= len(written) < 8
    assert not artifacts.present(tree, cache)  # part of it: never taken as restored
    for path in written:  # what is there at its name is whole
        assert path.read_bytes() == stored_bytes(store, tree, path.relative_to(cache).as_posix())

    session, rec = _session(store, tmp_path, take=False)  # the promoted process's restore (or any later one)
    begin = time.monotonic()
    session.prepare()
    assert time.monotonic() - begin < artifacts.RESTORE_LOCK_TIMEOUT_S  # the dead spare's lock went with it
    assert session.last_restore["status"] == "hit"
    assert artifacts.INDUCTOR_ARCHIVE in session.last_restore["restored"]
    assert session.last_restore["num_files"] == 1 + 8 - len(written)  # the header and the missing kernels
    for rel in tree:
        assert (cache / rel).read_bytes() == stored_bytes(store, tree, rel)
    rec.close()


def stored_bytes(store: CompileStore, tree, rel: str) -> bytes:
    return store.read(tree[rel])


def test_a_spare_parks_after_starting_its_ahead_restore(monkeypatch, tmp_path):
    from ettr.bootstrap import spare

    autoinstall = importlib.import_module("ettr.compile.autoinstall")  # the package's name is its function
    order: list[str] = []
    monkeypatch.setattr(autoinstall, "restore_ahead", lambda: order.append("ahead") or True)
    monkeypatch.setattr(spare, "_say_parked", lambda fifo, at: order.append("parked"))
    monkeypatch.setattr(spare, "_wait", lambda fifo: None)
    monkeypatch.setattr(spare, "IMPORT_AHEAD", ())
    monkeypatch.setattr(spare, "_state", {})
    spare.hold(str(tmp_path / "fifo"))

    def ended(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", ended)
    with pytest.raises(SystemExit):
        spare.park()  # ended by its agent (EOF): exits
    assert order == ["ahead", "parked"]


def test_restore_ahead_is_off_without_a_store_or_for_a_script_that_does_not_compile(monkeypatch, tmp_path):
    monkeypatch.setattr(ahead, "_current", None)
    autoinstall = importlib.import_module("ettr.compile.autoinstall")
    monkeypatch.setitem(
        sys.modules, "torch._inductor.codecache", sys.modules.get("torch._inductor.codecache")
    )
    monkeypatch.setenv("ETTR_COMPILE_STORE", "off")
    assert autoinstall.restore_ahead() is False and ahead.current() is None
    monkeypatch.setenv("ETTR_COMPILE_STORE", str(tmp_path / "store"))
    monkeypatch.delitem(sys.modules, "torch._inductor.codecache")  # inductor's compile path never imported
    assert autoinstall.restore_ahead() is False and ahead.current() is None


JOB = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch._inductor.compile_fx  # as the zygote's warm-up imports it after an attempt that compiled
    import ettr.compile
    from ettr.compile import ahead
    from ettr.compile.autoinstall import restore_ahead
    # The spare's park: the top level chose the cache directory; the store's entry is restored ahead.
    spare = sys.argv[1] == "spare"
    if spare:
        assert restore_ahead()
        assert ahead.current().done.wait(300)
        if sys.argv[2:3] == ["resaved"]:  # another job saves the same key again, its files of other sizes
            from pathlib import Path
            from ettr.compile import artifacts
            from ettr.compile.config import CompileConfig
            from ettr.compile.key import current_key
            from ettr.compile.store import CompileStore, StoreConfig
            config = CompileConfig.from_env()
            key = current_key(user_key=config.user_key)
            assert key.digest == ahead.current().digest
            store = CompileStore.open(StoreConfig(location=config.store))
            other = Path(sys.argv[3])
            for rel, path in artifacts.tree(artifacts.inductor_cache_dir()).items():
                (other / rel).parent.mkdir(parents=True, exist_ok=True)
                (other / rel).write_bytes(path.read_bytes() + b"/another/job's/path")
            store.save(key, {artifacts.INDUCTOR_ARCHIVE: artifacts.tree(other)}, meta=store.head(key).meta)
        elif len(sys.argv) > 2:  # the script moves its cache directory after the rendezvous
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = sys.argv[2]
    ettr.compile.autoinstall()  # the promotion's bootstrap
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(4, 8)
    with torch.no_grad():
        got = torch.compile(model)(x)
        want = model(x)
    session = ettr.compile.current_session()
    from torch._dynamo.utils import counters
    print(json.dumps({
        "restore": session.last_restore,
        "equal": bool(torch.allclose(got, want)),
        "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"],
    }))
    """
)


def _job(tmp_path: Path, name: str, *args: str) -> dict:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    fresh = tmp_path / name
    (fresh / "tmp").mkdir(parents=True)
    env = {
        **os.environ,
        "ETTR_RUN_DIR": str(tmp_path / "run"),
        "ETTR_COMPILE_STORE": str(tmp_path / "store"),
        "ETTR_COMPILE_KEY": "tiny-mlp-ahead",
        "TMPDIR": str(fresh / "tmp"),
        "TORCHINDUCTOR_CACHE_DIR": str(fresh / "inductor"),
    }
    for name_ in ("TORCH_COMPILE_DYNAMIC_SOURCES", "TORCH_COMPILE_JOB_ID", "TORCH_LOGS"):
        env.pop(name_, None)
    out = subprocess.run(
        [sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a hang guard: compiling at a load of 10 takes minutes
def test_a_promoted_spare_compiles_from_what_it_restored_ahead_or_from_a_moved_directory(tmp_path):
    cold = _job(tmp_path, "cold", "cold")
    assert cold["equal"] and cold["restore"]["status"] == "miss" and cold["fxgraph_cache_miss"] >= 1
    stayed = _job(tmp_path, "stayed", "spare")
    assert stayed["equal"] and stayed["fxgraph_cache_hit"] >= 1 and stayed["fxgraph_cache_miss"] == 0
    assert stayed["restore"]["already_present"] and "unused" not in stayed["restore"]["ahead"]
    assert stayed["restore"]["ahead"]["status"] == "hit"
    moved = _job(tmp_path, "moved", "spare", str(tmp_path / "moved-after" / "inductor"))
    assert moved["equal"] and moved["fxgraph_cache_hit"] >= 1 and moved["fxgraph_cache_miss"] == 0
    assert "inductor_cache" in moved["restore"]["restored"]
    assert "moved" in moved["restore"]["ahead"]["unused"]
    assert any((tmp_path / "moved-after" / "inductor").rglob("*"))
    # Another job saved the entry again after the park, its files of other sizes (and bytes no compile could use:
    # had they been copied, this job would fail): the version in place is compiled from, nothing copied. Last: the
    # store's entry is that job's now.
    resaved = _job(tmp_path, "resaved", "spare", "resaved", str(tmp_path / "other-job"))
    assert resaved["equal"] and resaved["fxgraph_cache_hit"] >= 1 and resaved["fxgraph_cache_miss"] == 0
    assert resaved["restore"]["version"] == "earlier" and resaved["restore"]["restored"] == []
    assert artifacts.INDUCTOR_ARCHIVE in resaved["restore"]["earlier_artifacts"]


def test_a_version_in_place_is_weighed_only_against_another_version_of_its_entry(tmp_path):
    from ettr.compile.in_place import InPlace, identify
    from ettr.compile.store import StoredFile, StoreEntry

    def stored(size: int) -> StoredFile:
        return StoredFile(sha256=f"{size:064x}", size=size)

    def entry(size: int, created_ts: float) -> StoreEntry:
        tree = {"a.h": stored(10), "a.h.gch": stored(size), "b.h.gch": stored(7)}
        return StoreEntry(
            digest="d", artifacts={artifacts.HEADERS_ARCHIVE: tree}, meta={}, created_ts=created_ts
        )

    headers_dir = tmp_path / "headers"
    headers_dir.mkdir()
    (headers_dir / "a.h").write_bytes(b"x" * 10)
    (headers_dir / "a.h.gch").write_bytes(b"x" * 100)
    (headers_dir / "b.h.gch").write_bytes(b"x" * 7)
    then = entry(100, 1.0)
    tree = then.artifacts[artifacts.HEADERS_ARCHIVE]
    ids = identify(tree, headers_dir)
    assert ids is not None
    kept = InPlace(
        entry=entry(1, 1.0),
        headers=then,
        trees={artifacts.HEADERS_ARCHIVE: tree},
        targets={artifacts.HEADERS_ARCHIVE: headers_dir},
        ids={artifacts.HEADERS_ARCHIVE: ids},
    )
    wanted_a = {rel: f for rel, f in tree.items() if rel.startswith("a.")}
    # The same version, fewer variants wanted now: the ordinary check (every wanted file is there).
    assert not kept.saved_again(artifacts.HEADERS_ARCHIVE, None, then, wanted_a)
    # Saved again with another size of `a.h.gch`: the version in place stands for it, unchanged.
    later = entry(120, 2.0)
    wanted_later = {
        rel: f for rel, f in later.artifacts[artifacts.HEADERS_ARCHIVE].items() if rel.startswith("a.")
    }
    assert kept.saved_again(artifacts.HEADERS_ARCHIVE, None, later, wanted_later)
    assert kept.usable(artifacts.HEADERS_ARCHIVE, headers_dir, wanted_later) is None
    assert "another directory" in str(kept.usable(artifacts.HEADERS_ARCHIVE, tmp_path, wanted_later))
    wanted_c = {"c.h.gch": stored(5)}
    assert "a header variant it lacks is wanted (c.h)" in str(
        kept.usable(artifacts.HEADERS_ARCHIVE, headers_dir, wanted_c)
    )
    os.utime(headers_dir / "b.h.gch")  # touched: its status-change time moves
    assert "1 of its 3 files changed or removed since (e.g. b.h.gch)" in str(
        kept.usable(artifacts.HEADERS_ARCHIVE, headers_dir, wanted_later)
    )
