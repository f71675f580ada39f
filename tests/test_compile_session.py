"""The compile session without compiling: save, restore onto a fresh node, skip what a node still has,
refuse a tampered entry, save only what changed, and never raise."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from compile_node import CountingBackend, node_dirs  # noqa: E402
from ettr.compile import artifacts  # noqa: E402
from ettr.compile.backend import MemoryBackend  # noqa: E402
from ettr.compile.hooks import CompileRecord  # noqa: E402
from ettr.compile.key import StoreKey  # noqa: E402
from ettr.compile.session import STORE_MARK, CompileConfig, CompileSession  # noqa: E402
from ettr.compile.store import CompileStore, blob_path  # noqa: E402
from ettr.events import EventKind  # noqa: E402
from ettr.ledger import MemoryLedger  # noqa: E402
from ettr.recorder import Recorder  # noqa: E402

KEY = StoreKey(
    torch_version="t", python_version="p", platform="x", device_type="cpu", inductor_config="c", user_key="u"
)


@pytest.fixture
def node(tmp_path, monkeypatch):
    """Point inductor's cache and header directories at folders of a "node" that tests can switch."""
    yield from node_dirs(tmp_path, monkeypatch)


def _session(store, tmp_path, **config):
    rec = Recorder(MemoryLedger(), run_dir=tmp_path / "run", flush_interval_s=60)
    settings = {"store": "memory", "include_megacache": False, "save_at_exit": False, **config}
    return CompileSession(rec, CompileConfig(**settings), store=store, key=KEY), rec


def _compiled_something(session):
    session.hooks.records.append(
        CompileRecord(begin_ts=1.0, end_ts=2.0, compile_id="0/0", trigger="dynamo", recompile_reason=None)
    )


def _node_with_kernel(node: Any, name: str) -> tuple[Path, Path]:
    """A node's inductor cache holding one kernel (100 B) and its header directory one header (1,000 B)."""
    cache, headers = node(name)
    (cache / "ab").mkdir(parents=True)
    (cache / "ab" / "kernel.so").write_bytes(b"k" * 100)
    headers.mkdir(parents=True)
    (headers / "prefix.h.gch").write_bytes(b"h" * 1000)
    return cache, headers


def _saved_first(node: Any, store: CompileStore, tmp_path: Path) -> None:
    """Node "first" compiled one kernel and saved it (and the build's header) to `store`."""
    _node_with_kernel(node, "first")
    first, rec = _session(store, tmp_path)
    _compiled_something(first)
    assert first.save() is True
    rec.close()


def test_save_on_one_node_restore_on_a_fresh_one_skip_on_the_same_one(node, tmp_path):
    backend = CountingBackend()
    store = CompileStore(backend)
    cache, headers = _node_with_kernel(node, "first")
    first, rec = _session(store, tmp_path)
    _compiled_something(first)
    assert first.save() is True
    assert first.save() is False  # nothing new since
    rec.close()

    cache2, headers2 = node("fresh")
    fresh, rec = _session(store, tmp_path)
    fresh.prepare()
    assert fresh.last_restore["status"] == "hit"
    assert set(fresh.last_restore["restored"]) == {artifacts.INDUCTOR_ARCHIVE, artifacts.HEADERS_ARCHIVE}
    assert (cache2 / "ab" / "kernel.so").read_bytes() == b"k" * 100
    assert (headers2 / "prefix.h.gch").read_bytes() == b"h" * 1000
    _compiled_something(fresh)
    assert fresh.save() is False  # restored, compiled from the cache: nothing to save again
    fresh.close()  # emits the pending store marks
    marks = [e.data for e in rec._ledger.read() if e.kind is EventKind.MARK]
    assert [m["action"] for m in marks] == ["restore"] and marks[0]["name"] == STORE_MARK
    rec.close()

    backend.reads.clear()
    same, rec = _session(store, tmp_path)  # a restart on the node that has the files
    same.prepare()
    assert same.last_restore["status"] == "hit" and same.last_restore["restored"] == []
    assert same.last_restore["already_present"] == sorted(
        [artifacts.HEADERS_ARCHIVE, artifacts.INDUCTOR_ARCHIVE]
    )
    assert all(path.endswith(("manifest.json", "used")) for path in backend.reads)
    rec.close()


def test_files_an_unsaved_attempt_left_on_the_node_are_saved_by_the_next_one(node, tmp_path):
    """Attempt 0 restores, compiles new kernels and dies before its save; attempt 1 on the same node
    restores (the entry's files are there), finds the new kernels in the cache and compiles nothing new.
    Its save must still store them: before, it compared the directory with itself after the restore,
    saw nothing new, and every later job on a fresh node compiled them again (nanoGPT under torchrun:
    66 s)."""
    store = CompileStore(MemoryBackend())
    cache, headers = _node_with_kernel(node, "n")
    first, rec = _session(store, tmp_path)
    _compiled_something(first)
    assert first.save() is True
    rec.close()

    (cache / "cd").mkdir()
    (cache / "cd" / "ddp_kernel.so").write_bytes(b"d" * 50)  # an attempt's kernels, never saved

    restart, rec = _session(store, tmp_path)
    restart.prepare()
    assert restart.last_restore["status"] == "hit"
    _compiled_something(restart)  # cache hits only
    assert restart.save() is True
    assert restart.save() is False  # now the entry holds them
    rec.close()
    assert "cd/ddp_kernel.so" in store.head(KEY).artifacts[artifacts.INDUCTOR_ARCHIVE]


def test_a_save_only_session_leaves_its_artifacts_and_restores_nothing(node, tmp_path):
    store = CompileStore(MemoryBackend())
    cache, _headers = node("first")
    (cache / "ab").mkdir(parents=True)
    (cache / "ab" / "kernel.so").write_bytes(b"k" * 100)
    first, rec = _session(store, tmp_path)
    _compiled_something(first)
    assert first.save() is True
    rec.close()

    cache2, _ = node("fresh")
    seeding, rec = _session(store, tmp_path, restore=False)
    seeding.prepare()
    assert seeding.last_restore is None and not (cache2 / "ab" / "kernel.so").exists()  # compiles cold
    cache2.mkdir(parents=True)
    (cache2 / "cd.so").write_bytes(b"c" * 10)
    _compiled_something(seeding)
    assert seeding.save() is True  # ... and leaves what it compiled for the jobs after it
    rec.close()

    cache3, _ = node("third")
    later, rec = _session(store, tmp_path)
    later.prepare()
    assert later.last_restore["status"] == "hit" and (cache3 / "cd.so").read_bytes() == b"c" * 10
    rec.close()


def test_a_tampered_entry_is_refused_and_nothing_is_unpacked(node, tmp_path):
    backend = MemoryBackend()
    store = CompileStore(backend)
    cache, _headers = node("first")
    cache.mkdir(parents=True)
    (cache / "kernel.so").write_bytes(b"good")
    first, rec = _session(store, tmp_path)
    first.save()
    rec.close()
    stored = store.head(KEY).artifacts[artifacts.INDUCTOR_ARCHIVE]["kernel.so"]
    backend.write(blob_path(stored.sha256, compressed=backend.compress), gzip.compress(b"evil"))

    cache2, _ = node("fresh")
    fresh, rec = _session(store, tmp_path)
    fresh.prepare()
    assert fresh.last_restore["status"] == "refused"
    assert not (cache2 / "kernel.so").exists()
    rec.close()


def test_a_new_workload_restores_its_builds_precompiled_headers(node, tmp_path):
    # The header is the same for every model of one torch/compiler build: it is saved once, under the
    # build's key, and a workload that never ran before gets it (inductor does not build it again).
    backend = CountingBackend()
    store = CompileStore(backend)
    cache, headers = node("first")
    cache.mkdir(parents=True)
    (cache / "a.so").write_bytes(b"a" * 10)
    headers.mkdir(parents=True)
    (headers / "prefix.h.gch").write_bytes(b"h" * 1000)
    first, rec = _session(store, tmp_path)
    _compiled_something(first)
    assert first.save() is True
    assert first.last_save["headers"] == "saved"
    rec.close()

    other = StoreKey(**{**{k: v for k, v in KEY.components().items() if k != "key_version"}, "user_key": "b"})
    cache2, headers2 = node("second")
    session = CompileSession(
        Recorder(MemoryLedger(), run_dir=tmp_path / "run2", flush_interval_s=60),
        CompileConfig(store="memory", include_megacache=False, save_at_exit=False),
        store=store,
        key=other,
    )
    session.prepare()
    assert session.last_restore["status"] == "miss"  # no entry of its own yet ...
    assert session.last_restore["restored"] == [artifacts.HEADERS_ARCHIVE]  # ... but the build's header
    assert (headers2 / "prefix.h.gch").read_bytes() == b"h" * 1000
    cache2.mkdir(parents=True, exist_ok=True)
    (cache2 / "b.so").write_bytes(b"b" * 10)
    _compiled_something(session)
    backend.reads.clear()
    assert session.save() is True
    assert session.last_save["headers"] == "shared"  # listed already: not read, not written again
    assert not any("prefix" in path for path in backend.reads)
    usage = store.usage()
    assert usage.num_entries == 3 and usage.stored_bytes == 10 + 10 + 1000


def test_learned_sources_go_to_the_run_directory_and_the_store(node, tmp_path):
    store = CompileStore(MemoryBackend())
    cache, _ = node("first")
    cache.mkdir(parents=True)
    (cache / "kernel.so").write_bytes(b"k")
    first, rec = _session(store, tmp_path)
    first.hooks.records.append(
        CompileRecord(
            begin_ts=1.0,
            end_ts=2.0,
            compile_id="0/1",
            trigger="dynamo",
            recompile_reason="0/0: tensor 'x' size mismatch at index 0. expected 4, actual 6",
        )
    )
    assert first.save() is True
    saved = json.loads((tmp_path / "run" / "compile" / "dynamic.json").read_text())
    assert saved["sources"] == ["L['x']:0"]
    assert store.head(KEY).meta["dynamic_sources"] == ["L['x']:0"]
    rec.close()

    with torch.compiler.config.patch(dynamic_sources=""):
        node("fresh")
        later, rec = _session(store, tmp_path / "other-job")  # another job: learns from the store
        later.prepare()
        assert torch.compiler.config.dynamic_sources == "L['x']:0"
        rec.close()


def test_a_broken_store_is_reported_not_raised(node, tmp_path):
    class Broken(MemoryBackend):
        def read(self, path: str) -> bytes:
            raise OSError("disk on fire")

        def write(self, path: str, data: bytes) -> None:
            raise OSError("disk on fire")

    node("first")
    session, rec = _session(CompileStore(Broken()), tmp_path)
    session.prepare()
    assert session.last_restore["status"] == "error"
    _compiled_something(session)
    artifacts.inductor_cache_dir().mkdir(parents=True)
    (artifacts.inductor_cache_dir() / "k.so").write_bytes(b"k")
    assert session.save() is False
    assert session.last_save["status"] == "error"
    rec.close()


def test_config_from_env(caplog):
    assert CompileConfig.from_env({"ETTR_COMPILE": "0"}) is None
    config = CompileConfig.from_env(
        {
            "ETTR_COMPILE_STORE": "off",
            "ETTR_COMPILE_KEY": "model-a",
            "ETTR_COMPILE_SETTLE_S": "2.5",
            "ETTR_COMPILE_STORE_MAX_BYTES": "nonsense",
            "ETTR_COMPILE_STORE_SECRET": "k",
        }
    )
    assert config.store is None and config.user_key == "model-a" and config.settle_s == 2.5
    assert config.max_store_bytes == 8 * 1024**3 and config.secret == b"k"
    # a malformed number falls back to its default, and says so (before: silently; `2GB` gave 8 GiB)
    assert [r.getMessage() for r in caplog.records] == [
        "ettr: ETTR_COMPILE_STORE_MAX_BYTES='nonsense' is not a whole number of bytes; using 8589934592"
    ]
    caplog.clear()
    assert CompileConfig.from_env({"ETTR_COMPILE_SETTLE_S": "nan"}).settle_s == 10.0
    assert [r.getMessage() for r in caplog.records] == [
        "ettr: ETTR_COMPILE_SETTLE_S='nan' is not a number of seconds >= 0; using 10.0"
    ]
    assert CompileConfig.from_env({}).store == "~/.cache/ettr/compile"
    assert CompileConfig.from_env({}).restore is True
    assert CompileConfig.from_env({"ETTR_COMPILE_RESTORE": "0"}).restore is False
    with pytest.raises(ValueError, match="settle_s"):
        CompileConfig(settle_s=-1)


def test_the_first_batch_spec_travels_to_later_jobs_through_the_store(node, tmp_path, monkeypatch):
    import importlib

    from ettr.compile import fastbatch
    from ettr.compile.startup import fast_start

    autoinstall = importlib.import_module("ettr.compile.autoinstall")  # the package re-exports the function

    store = CompileStore(MemoryBackend())
    node("first")
    first, rec = _session(store, tmp_path / "job-1")
    real = {"x": torch.zeros(4, 3)}
    monkeypatch.setattr(autoinstall, "_session", first)
    fast_start(lambda batch: None, lambda: real, rec=rec)  # no spec anywhere: waits for the real batch
    assert first.save() is True  # nothing compiled, but the spec is new to the store
    rec.close()

    node("fresh")
    later, rec = _session(store, tmp_path / "job-2")
    monkeypatch.setattr(autoinstall, "_session", later)
    shapes = []
    result = fast_start(lambda batch: shapes.append(batch["x"].shape), lambda: real, rec=rec)
    assert result.spec_source == "store" and shapes == [(4, 3)]
    assert fastbatch.load_spec(fastbatch.job_file(tmp_path / "job-2" / "run")) == fastbatch.spec_of(real)
    rec.close()


def test_ranks_restoring_into_one_directory_take_turns(tmp_path):
    import threading
    import time

    cache = tmp_path / "inductor"
    order: list[str] = []
    held = threading.Event()

    def first() -> None:
        with artifacts.restore_lock(cache):
            held.set()
            time.sleep(0.3)
            order.append("first done")

    thread = threading.Thread(target=first)
    thread.start()
    held.wait(5)
    with artifacts.restore_lock(cache):  # a second process (here: descriptor) waits for the first
        order.append("second in")
    thread.join()
    assert order == ["first done", "second in"]
    assert oct(cache.stat().st_mode & 0o777) == oct(0o700)
    (tmp_path / "a-file").write_text("")
    with artifacts.restore_lock(tmp_path / "a-file" / "x", timeout_s=0.1):  # no place for a lock: goes on
        order.append("unlocked")
    assert order[-1] == "unlocked"


def test_the_settle_save_runs_as_nice_as_a_thread_gets_and_the_exit_raises_it_back(node, tmp_path):
    # On a busy node the settle save takes only what training leaves (nice +19: a fifteenth of nice +10's
    # weight beside a training thread); a process that exits while it runs does not wait behind a save the node
    # gives almost no CPU: close gives the thread its priority back first, where the process may.
    import os
    import threading
    import time

    own = os.getpriority(os.PRIO_PROCESS, 0)
    if own >= 19:
        pytest.skip("already at the lowest CPU priority")
    node("n")
    session, rec = _session(CompileStore(MemoryBackend()), tmp_path, settle_s=0.0)
    seen: dict[str, int] = {}
    in_save, release = threading.Event(), threading.Event()

    def save(*, reason: str = "explicit") -> bool:
        tid = threading.get_native_id()
        seen["during"] = os.getpriority(os.PRIO_PROCESS, tid)
        in_save.set()
        release.wait(60)
        seen["at_close"] = os.getpriority(os.PRIO_PROCESS, tid)
        return False

    session.save = save  # type: ignore[method-assign]
    record = CompileRecord(
        begin_ts=1.0, end_ts=2.0, compile_id="0/0", trigger="dynamo", recompile_reason=None
    )
    session.hooks.last_end_ts = record.end_ts
    session._after_compile(record)
    assert in_save.wait(60), "the settle save did not start"
    assert seen["during"] == 19
    assert os.getpriority(os.PRIO_PROCESS, 0) == own  # the training thread keeps its priority
    closer = threading.Thread(target=session.close)
    closer.start()
    tid = session._thread_nice[0]
    privileged = os.geteuid() == 0
    deadline = time.monotonic() + 60
    while privileged and os.getpriority(os.PRIO_PROCESS, tid) != own and time.monotonic() < deadline:
        time.sleep(0.01)
    release.set()
    closer.join(60)
    rec.close()
    assert seen["at_close"] == (own if privileged else 19)


def test_at_the_first_torch_compile_templates_are_deferred_the_isa_probe_shared_then_run_after_the_restore(
    node, tmp_path, monkeypatch
):
    # The probe's libraries (and its remembered answer) come with the entry: it runs after the restore, on the
    # same helper thread, and only where the first compile would run it (no accelerator). Shared first, on
    # the calling thread; shared without a store too (no restore, no helper).
    import dataclasses
    import threading

    from ettr import torch_compat
    from ettr.compile import isa_probe, lazy_templates

    node("n")
    order: list[str] = []
    monkeypatch.setattr(lazy_templates, "defer", lambda patcher: order.append("deferred") or True)
    monkeypatch.setattr(
        torch_compat, "prefetch_inductor_torch_key", lambda: order.append("torch_key") or True
    )
    monkeypatch.setattr(isa_probe, "share", lambda patcher, memo_dir=None: order.append("shared") or True)
    monkeypatch.setattr(isa_probe, "run", lambda: order.append(f"probe on {threading.current_thread().name}"))
    session, rec = _session(CompileStore(MemoryBackend()), tmp_path)
    restore_once = session._restorer.restore_once
    monkeypatch.setattr(
        session._restorer, "restore_once", lambda dirs: order.append("restore") or restore_once(dirs)
    )
    session._on_torch_compile()
    for thread in threading.enumerate():
        if thread.name == "ettr-compile-restore":
            thread.join(60)
    assert order == ["deferred", "shared", "torch_key", "restore", "probe on ettr-compile-restore"]

    order.clear()
    storeless = CompileSession(rec, CompileConfig(store=None), key=KEY)
    storeless._on_torch_compile()
    assert order == ["deferred", "shared", "torch_key"]

    order.clear()
    gpu_key = dataclasses.replace(KEY, device_type="cuda-12.4-H100-sm90")
    gpu = CompileSession(rec, CompileConfig(store="memory"), store=CompileStore(MemoryBackend()), key=gpu_key)
    monkeypatch.setattr(gpu._restorer, "restore_once", lambda dirs: order.append("restore"))
    gpu._on_torch_compile()
    for thread in threading.enumerate():
        if thread.name == "ettr-compile-restore":
            thread.join(60)
    # An accelerator's process: no probe ahead (its first compile probes if it needs to).
    assert order == ["deferred", "shared", "torch_key", "restore"]
    rec.close()


def test_callers_of_the_shared_isa_probe_wait_for_one_run_and_see_its_cache(monkeypatch):
    import functools
    import threading
    import types

    from ettr import torch_compat
    from ettr.compile import isa_probe
    from ettr.patcher import Patcher

    entered, release = threading.Event(), threading.Event()
    callers: list[str] = []

    @functools.cache
    def valid_vec_isa_list() -> list[str]:
        callers.append(threading.current_thread().name)
        entered.set()
        release.wait(60)
        return ["avx2"]

    module = types.SimpleNamespace(valid_vec_isa_list=valid_vec_isa_list)
    monkeypatch.setattr(torch_compat, "inductor_vec_isa_module", lambda: module)
    patcher = Patcher()
    assert isa_probe.share(patcher, lambda: None) is True  # (nowhere to remember the answer)
    assert isa_probe.share(patcher, lambda: None) is True  # already ours: not wrapped twice
    assert module.valid_vec_isa_list.__ettr_original__ is valid_vec_isa_list
    results: list[list[str]] = []
    first = threading.Thread(target=lambda: results.append(module.valid_vec_isa_list()), name="helper")
    first.start()
    assert entered.wait(60)
    second = threading.Thread(target=lambda: results.append(module.valid_vec_isa_list()), name="compiling")
    second.start()  # holds on the lock (without it, it would run a probe of its own)
    release.set()
    first.join(60)
    second.join(60)
    assert callers == ["helper"] and results == [["avx2"], ["avx2"]]
    # What tells a trained attempt's standby that inductor probed (its cache) still reads through the wrapper.
    assert torch_compat.inductor_probed_vec_isa({"torch._inductor.cpu_vec_isa": module}) is True
    patcher.undo()
    assert module.valid_vec_isa_list is valid_vec_isa_list

    def moved() -> types.ModuleType:
        raise ImportError("inductor moved it")

    monkeypatch.setattr(torch_compat, "inductor_vec_isa_module", moved)
    assert isa_probe.share(Patcher()) is False


def test_the_real_isa_probe_can_be_shared_and_run_ahead(monkeypatch):
    # torch's own probe function, wrapped (and put back); running it is the first compile's work, not done here.
    from ettr import torch_compat
    from ettr.compile import isa_probe
    from ettr.patcher import Patcher

    module = torch_compat.inductor_vec_isa_module()
    original = module.valid_vec_isa_list
    patcher = Patcher()
    assert isa_probe.share(patcher) is True
    assert module.valid_vec_isa_list.cache_info == original.cache_info
    patcher.undo()
    assert module.valid_vec_isa_list is original
    monkeypatch.setattr(
        torch_compat, "probe_vec_isa", lambda: (_ for _ in ()).throw(RuntimeError("no compiler"))
    )
    isa_probe.run()  # never raises: the first compile then probes, as it would have


def test_the_isa_probe_answer_is_remembered_and_taken_only_under_the_same_key(tmp_path, monkeypatch):
    # A later process of the same CPU, compiler, torch and probe takes the remembered answer instead of
    # loading libtorch six times; any difference in the key, or a damaged file, and it probes again.
    import functools
    import types

    from ettr import torch_compat
    from ettr.compile import isa_probe
    from ettr.patcher import Patcher

    key = {"cpu_isa": "avx2 avx512", "compiler": "g++ 12", "torch": "2.x", "probe": "p"}
    monkeypatch.setattr(torch_compat, "inductor_vec_isa_memo_key", lambda: dict(key))

    def described(isa: str) -> dict[str, object]:
        return {"name": isa, "flags": f"-m{isa}", "state": {"_is_bf16_supported": isa == "avx512"}}

    monkeypatch.setattr(torch_compat, "inductor_vec_isa_described", described)
    restored: list[list[dict[str, object]]] = []
    monkeypatch.setattr(
        torch_compat,
        "inductor_vec_isas_restored",
        lambda valid: restored.append(valid) or [f"isa:{d['name']}" for d in valid],
    )
    probes: list[int] = []

    def new_process() -> types.SimpleNamespace:
        @functools.cache
        def valid_vec_isa_list() -> list[str]:
            probes.append(1)
            return ["avx512", "avx2"]

        module = types.SimpleNamespace(valid_vec_isa_list=valid_vec_isa_list)
        monkeypatch.setattr(torch_compat, "inductor_vec_isa_module", lambda: module)
        assert isa_probe.share(Patcher(), lambda: tmp_path)
        return module

    assert new_process().valid_vec_isa_list() == ["avx512", "avx2"] and len(probes) == 1
    memo = tmp_path / isa_probe.MEMO_NAME
    assert json.loads(memo.read_text()) == {
        "schema": isa_probe.MEMO_SCHEMA,
        "key": key,
        "valid": [described("avx512"), described("avx2")],
    }
    module = new_process()
    assert module.valid_vec_isa_list() == ["isa:avx512", "isa:avx2"] and len(probes) == 1  # remembered
    assert module.valid_vec_isa_list() == ["isa:avx512", "isa:avx2"] and len(probes) == 1  # one answer
    assert restored == [[described("avx512"), described("avx2")]]  # with what the probe set on each ISA

    key["compiler"] = "g++ 13"  # another compiler: probed again, and that answer kept
    assert new_process().valid_vec_isa_list() == ["avx512", "avx2"] and len(probes) == 2
    assert json.loads(memo.read_text())["key"]["compiler"] == "g++ 13"
    assert isa_probe.recall(memo, {**key, "compiler": "g++ 12"}) is None

    for damaged in (
        "{",
        json.dumps({"schema": "other", "key": key, "valid": []}),
        json.dumps({"schema": isa_probe.MEMO_SCHEMA, "key": key, "valid": "avx2"}),
        json.dumps({"schema": isa_probe.MEMO_SCHEMA, "key": key, "valid": [described("x")] * 100}),
        # schema 1 (names only): an AVX-512 ISA recalled by name compiled without -mavx512bf16
        json.dumps({"schema": "ettr.vec-isa/1", "key": key, "valid": ["avx512", "avx2"]}),
        json.dumps({"schema": isa_probe.MEMO_SCHEMA, "key": key, "valid": ["avx512", "avx2"]}),
        json.dumps(
            {"schema": isa_probe.MEMO_SCHEMA, "key": key, "valid": [{**described("avx2"), "flags": 1}]}
        ),
        json.dumps(
            {
                "schema": isa_probe.MEMO_SCHEMA,
                "key": key,
                "valid": [{**described("avx2"), "state": {"a": "yes"}}],
            }
        ),
        json.dumps(
            {"schema": isa_probe.MEMO_SCHEMA, "key": key, "valid": [{**described("avx2"), "run": "x"}]}
        ),
    ):
        memo.write_text(damaged)
        assert isa_probe.recall(memo, key) is None
        assert new_process().valid_vec_isa_list() == ["avx512", "avx2"]  # probed again
    assert len(probes) == 11

    monkeypatch.setattr(
        torch_compat, "inductor_vec_isas_restored", lambda valid: None
    )  # no longer inductor's
    assert new_process().valid_vec_isa_list() == ["avx512", "avx2"] and len(probes) == 12
    monkeypatch.setattr(torch_compat, "inductor_vec_isa_memo_key", lambda: None)  # the probe does not decide
    memo.unlink()
    assert new_process().valid_vec_isa_list() == ["avx512", "avx2"] and len(probes) == 13
    assert not memo.exists()


def test_the_real_isa_probe_key_names_what_the_answer_depends_on(monkeypatch):
    import platform
    import sys

    from ettr import torch_compat

    key = torch_compat.inductor_vec_isa_memo_key()
    if sys.platform != "linux" or platform.machine() != "x86_64":
        assert key is None
        return
    assert key is not None
    assert set(key) == {"cpu_isa", "compiler", "torch", "libtorch", "python", "ld_library_path", "probe"}
    assert key == torch_compat.inductor_vec_isa_memo_key()  # the same, read again
    assert (
        torch_compat.inductor_vec_isas_restored([{"name": "no-such-isa", "flags": "", "state": {}}]) is None
    )
    from torch._inductor import cpu_vec_isa

    names = [str(isa) for isa in cpu_vec_isa.supported_vec_isa_list]
    for isa in cpu_vec_isa.supported_vec_isa_list:  # each as it is now comes back as it is (no probe run)
        described = torch_compat.inductor_vec_isa_described(isa)
        if names.count(str(isa)) > 1:  # (NEON and SVE are both "asimd": never taken by name)
            assert torch_compat.inductor_vec_isas_restored([described]) is None
            continue
        assert torch_compat.inductor_vec_isas_restored([described]) == [isa]
        assert isa.build_arch_flags() == described["flags"]
        for name in described["state"]:  # what a probe sets on the ISA does not change the key read after it
            monkeypatch.setattr(isa, name, not described["state"][name])
    assert key == torch_compat.inductor_vec_isa_memo_key()


def test_a_recalled_isa_compiles_with_the_flags_the_probe_gave_it(monkeypatch):
    # What inductor's probe sets on an ISA object beside its answer (avx512_bf16 builds here) is part of
    # the flags every C++ kernel compiles with, so of every kernel's cache key and of the precompiled
    # header's name: a recalled ISA must come back with it, else the kernels a probing process compiled
    # (and the store holds) are all compiled again. On fake ISA classes shaped like inductor's.
    import dataclasses
    import sys
    import types

    import torch._inductor

    from ettr import torch_compat

    @dataclasses.dataclass
    class VecAVX512:
        _arch_flags = "-mavx512f"
        _is_avx512_bf16_supported = False

        def __str__(self) -> str:
            return "avx512"

        def build_arch_flags(self) -> str:
            return self._arch_flags + (" -mavx512bf16" if self._is_avx512_bf16_supported else "")

    @dataclasses.dataclass
    class VecAVX2:
        _arch_flags = "-mavx2"

        def __str__(self) -> str:
            return "avx2"

        def build_arch_flags(self) -> str:
            return self._arch_flags

    probed, fresh = VecAVX512(), VecAVX512()
    probed._is_avx512_bf16_supported = True  # as the probe's check of avx512_bf16 leaves it
    described = [
        torch_compat.inductor_vec_isa_described(probed),
        torch_compat.inductor_vec_isa_described(VecAVX2()),
    ]
    assert described == [
        {"name": "avx512", "flags": "-mavx512f -mavx512bf16", "state": {"_is_avx512_bf16_supported": True}},
        {"name": "avx2", "flags": "-mavx2", "state": {}},
    ]
    avx2 = VecAVX2()
    module = types.SimpleNamespace(
        supported_vec_isa_list=[fresh, avx2], x86_isa_checker=lambda: ["avx2", "avx512"]
    )
    monkeypatch.setitem(sys.modules, "torch._inductor.cpu_vec_isa", module)
    monkeypatch.setattr(torch._inductor, "cpu_vec_isa", module, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert fresh.build_arch_flags() == "-mavx512f"  # recalled by name alone: no -mavx512bf16 (the bug)
    assert torch_compat.inductor_vec_isas_restored(json.loads(json.dumps(described))) == [fresh, avx2]
    assert fresh.build_arch_flags() == probed.build_arch_flags() == "-mavx512f -mavx512bf16"

    other = VecAVX512()
    module.supported_vec_isa_list = [other, avx2]
    for wrong in (
        [{**described[0], "flags": "-mavx512f -mfoo"}],  # this torch would compile it otherwise: probe
        [{**described[0], "state": {"_is_amx_fp16_supported": True}}],  # a state its class does not have
        [{**described[0], "state": {"__class__": True}}],
        [described[1], {"name": "avx1024", "flags": "", "state": {}}],  # no longer inductor's
    ):
        assert torch_compat.inductor_vec_isas_restored(wrong) is None
        assert vars(other) == {} and other.build_arch_flags() == "-mavx512f"  # left as it was

    # A forged memo (whoever could write the cache directory or a store entry) under the right key: it may not
    # switch on what this CPU cannot run, or every kernel compiled with those flags dies of SIGILL.
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert torch_compat.inductor_vec_isas_restored([described[0]]) is None  # bf16 the CPU lacks
    assert vars(other) == {} and other.build_arch_flags() == "-mavx512f"
    module.x86_isa_checker = lambda: ["avx2"]
    no_bf16 = {**described[0], "flags": "-mavx512f", "state": {"_is_avx512_bf16_supported": False}}
    assert torch_compat.inductor_vec_isas_restored([no_bf16]) is None  # an ISA the CPU lacks
    assert torch_compat.inductor_vec_isas_restored([described[1]]) == [avx2]  # what it has: taken


def test_inductors_torch_key_is_prefetched_on_torchs_own_thread_and_read_once():
    from torch._inductor import codecache

    from ettr import torch_compat

    assert torch_compat.prefetch_inductor_torch_key() is True
    key = codecache.torch_key()  # the prefetched value (or the one computed before): the same bytes
    assert isinstance(key, bytes) and codecache.torch_key() == key


@pytest.mark.parametrize("damaged", [artifacts.INDUCTOR_ARCHIVE, artifacts.HEADERS_ARCHIVE])
def test_a_damaged_stored_file_is_refused_once_and_the_next_save_repairs_the_store(node, tmp_path, damaged):
    """A stored kernel or header damaged on disk (a bit flip, a file cut short) is refused at the restore.
    Before, it stayed in the store: a save writes only missing files, so every later save named the same
    bad file again (the build's header entry was not even saved again: it listed the header with its size)
    and every later job was refused, for good (nanoGPT: compiled cold, 45 s to its first step instead of 5 s)."""
    backend = MemoryBackend()
    store = CompileStore(backend)
    _saved_first(node, store, tmp_path)
    if damaged == artifacts.INDUCTOR_ARCHIVE:
        stored = store.head(KEY).artifacts[damaged]["ab/kernel.so"]
        bad = b"K" * 100  # same size, other bytes
    else:
        stored = store.head(KEY.headers_key()).artifacts[damaged]["prefix.h.gch"]
        bad = b"h" * 999  # cut short
    backend.write(blob_path(stored.sha256, compressed=backend.compress), gzip.compress(bad))

    node("second")
    second, rec = _session(store, tmp_path)
    second.prepare()
    if damaged == artifacts.INDUCTOR_ARCHIVE:
        assert second.last_restore["status"] == "refused"
        assert second.last_restore["error"].endswith(
            "does not match its checksum; removed it, the next save stores it again"
        )
        assert second.last_restore["restored"] == [artifacts.HEADERS_ARCHIVE]  # the build's: not refused
    else:
        assert second.last_restore["status"] == "hit"
        assert "removed it, the next save stores it again" in second.last_restore["headers_error"]
    cache2, headers2 = node("second")  # what its compilation wrote
    for path, data in ((cache2 / "ab" / "kernel.so", b"k" * 100), (headers2 / "prefix.h.gch", b"h" * 1000)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    _compiled_something(second)
    assert second.save() is True
    assert second.last_save["headers"] == ("saved" if damaged == artifacts.HEADERS_ARCHIVE else "shared")
    rec.close()

    cache3, headers3 = node("third")
    third, rec = _session(store, tmp_path)
    third.prepare()
    assert third.last_restore["status"] == "hit" and "headers_error" not in third.last_restore
    assert set(third.last_restore["restored"]) == {artifacts.INDUCTOR_ARCHIVE, artifacts.HEADERS_ARCHIVE}
    assert (cache3 / "ab" / "kernel.so").read_bytes() == b"k" * 100
    assert (headers3 / "prefix.h.gch").read_bytes() == b"h" * 1000
    rec.close()


def test_a_workload_entry_written_for_another_key_is_refused_and_the_builds_headers_still_restored(
    node, tmp_path
):
    """An entry refused as a whole (another torch, a forged key, a bad signature) is not used, but the build's
    precompiled headers are an entry of their own: before, the refusal skipped them too, inductor built its
    header again (seconds) and the save stored another 156 MB copy of it (a header is not the same byte for
    byte from one build to the next)."""
    backend = MemoryBackend()
    store = CompileStore(backend)
    _saved_first(node, store, tmp_path)
    path = f"{KEY.digest}/manifest.json"
    manifest = json.loads(backend.read(path))
    manifest["key"]["torch_version"] = "2.12.0"  # as if made by another torch
    backend.write(path, json.dumps(manifest).encode())

    cache2, headers2 = node("second")
    second, rec = _session(store, tmp_path)
    second.prepare()
    assert second.last_restore["status"] == "refused"
    assert second.last_restore["error"] == (
        f"entry {KEY.digest} was written for another key (torch_version '2.12.0' here 't')"
    )
    assert second.last_restore["restored"] == [artifacts.HEADERS_ARCHIVE]
    assert (headers2 / "prefix.h.gch").read_bytes() == b"h" * 1000
    assert not (cache2 / "ab" / "kernel.so").exists()
    rec.close()


class FullBackend(MemoryBackend):
    """A store on a small file system: the header (`_node_with_kernel`'s) does not fit."""

    def write(self, path: str, data: bytes) -> None:
        if hashlib.sha256(b"h" * 1000).hexdigest() in path:
            raise OSError(28, "No space left on device")
        super().write(path, data)


def test_a_store_too_small_for_the_header_keeps_the_kernels_and_does_not_retry(node, tmp_path):
    """The kernels (small) fit, the build's header (156 MB on CPU) does not (a store on a small tmpfs).
    Before, the whole save was an error ("the next start compiles again", although the workload's entry
    was saved) and the exit save wrote the header again, to fail again."""
    from ettr.report.compile_text import _store_line

    store = CompileStore(FullBackend())
    _node_with_kernel(node, "first")
    first, rec = _session(store, tmp_path)
    _compiled_something(first)
    assert first.save() is True
    assert first.last_save["status"] == "saved" and first.last_save["headers"] == "error"
    assert "No space left on device" in first.last_save["headers_error"]
    assert first.save() is False  # nothing new: the header is not tried again by this process
    line = _store_line(first.last_save)
    assert line.startswith("save saved (") and "precompiled headers: OSError: [Errno 28]" in line
    rec.close()

    cache2, _ = node("second")
    second, rec = _session(store, tmp_path)
    second.prepare()
    assert second.last_restore["status"] == "hit"
    assert (cache2 / "ab" / "kernel.so").read_bytes() == b"k" * 100
    rec.close()


def test_a_secret_against_an_unsigned_store_is_one_warning_for_both_entries(node, tmp_path, caplog):
    """ETTR_COMPILE_STORE_SECRET set against a store saved without it refuses the workload's entry and the
    build's precompiled headers for one cause. Before, that was two warnings (one per entry) for one cause;
    now one line says both were refused and why, and `last_restore` keeps each entry's own status."""
    backend = MemoryBackend()
    _saved_first(node, CompileStore(backend), tmp_path)

    cache2, headers2 = node("second")
    second, rec = _session(CompileStore(backend, secret=b"k"), tmp_path)
    caplog.clear()
    with caplog.at_level("WARNING", logger="ettr"):
        second.prepare()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        "ettr: compile store refused the workload's entry and the build's precompiled headers: "
        "manifest not signed (ETTR_COMPILE_STORE_SECRET is set); compiling from scratch"
    ]
    restore = second.last_restore
    assert restore["status"] == "refused"
    assert restore["error"] == f"entry {KEY.digest}: manifest not signed (ETTR_COMPILE_STORE_SECRET is set)"
    assert restore["headers_error"] == (
        f"entry {KEY.headers_key().digest}: manifest not signed (ETTR_COMPILE_STORE_SECRET is set)"
    )
    assert not (cache2 / "ab" / "kernel.so").exists() and not (headers2 / "prefix.h.gch").exists()
    rec.close()
