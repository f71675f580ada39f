"""A process's compile session: restore before the first compile, record compiles, save once they settle.

`CompileSession` ties the pieces together for one process:

1. before Dynamo traces the first frame, it applies the dynamic sources learned by earlier attempts of
   this job (`<run_dir>/compile/dynamic.json`) and by earlier jobs (the store entry's metadata), sets
   `torch.compiler.config.job_id` so that PGO profiles are written, and restores the store entry
   (inductor cache directory, precompiled headers, else the megacache archive);
2. it records every compilation as a COMPILE span and every recompile with its reason (`CompileHooks`),
   and at each recompile writes the dynamic sources learned so far to the run directory;
3. once no compilation has run for `settle_s`, a background thread saves the artifacts to the store
   (again at exit if anything new was compiled since). The training thread never waits for a save.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from ettr.compile import artifacts, dynamic
from ettr.compile.backend import LocalBackend
from ettr.compile.config import CompileConfig, default_user_key, pgo_job_id
from ettr.compile.hooks import CompileHooks, CompileRecord
from ettr.compile.key import StoreKey, current_key
from ettr.compile.store import CompileStore, EntryRefused, StoreConfig
from ettr.events import EventKind

logger = logging.getLogger("ettr")

STORE_MARK = "compile_store"
"""`Recorder.mark` name of store actions (data: action = restore | save, status, digest, sizes, time)."""


class CompileSession:
    """Compile recording, restoring and saving for one process (see the module docstring).

    Args:
        rec: this process's Recorder (`run_dir`, `rank`, `attempt`, `span`, `record`, `add_step_listener`).
        config: what to do.
        store: the store to use (default: opened from `config.store`); tests pass a fake-backed one.
        key: the store key (default: `current_key` of `config.user_key`, computed at first compile).
    """

    def __init__(
        self,
        rec: Any,
        config: CompileConfig,
        *,
        store: CompileStore | None = None,
        key: StoreKey | None = None,
    ) -> None:
        self.rec = rec
        self.config = config
        self.user_key = config.user_key or default_user_key()
        self._store = store
        self._key = key
        self.hooks = CompileHooks(rec, before_first_compile=self.prepare, after_compile=self._after_compile)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._prepared = False
        self._restore_lock = threading.Lock()
        self._restored = False
        self._megacache: bytes | None = None
        self._num_reasons_written = 0
        self._sources_written: tuple[dynamic.DynamicSource, ...] = ()
        self._pending_marks: list[tuple[float, dict[str, Any]]] = []
        self._saved_state: tuple[str, tuple[str, ...], str] | None = None
        """What the store holds (files, sources, batch spec): a save with nothing new is skipped."""
        self._dirty = False
        self._started = False
        self.store_meta: dict[str, Any] = {}
        """Metadata of the restored store entry (learned sources, batch spec), empty if none."""
        self.applied_sources: tuple[dynamic.DynamicSource, ...] = ()
        self.last_restore: dict[str, Any] | None = None
        self.last_save: dict[str, Any] | None = None
        self.batch_spec: Mapping[str, Any] | None = None
        """A fast-batch spec to keep with the entry (set by `fast_start`)."""

    # -- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> None:
        """Install the Dynamo hooks, the step listener and the exit save (imports `torch._dynamo`)."""
        if self._started:
            return
        self._started = True
        self.hooks.install()
        try:
            self.rec.add_step_listener(self._on_step)
        except Exception as exc:  # a recorder without listeners: the background thread emits instead
            logger.debug("ettr: no step listener: %s", exc)
        atexit.register(self.close)
        if self.config.store is None:
            return
        # Restore on a helper thread from now on, so the unpacking overlaps whatever the program does
        # before its first compilation (which waits for it). Key and directories are looked up here, on
        # the importing thread: the helper only reads, checks and writes files.
        try:
            digest = self.key.digest
            dirs = (artifacts.inductor_cache_dir(), artifacts.headers_dir())
        except Exception as exc:
            logger.debug("ettr: restoring at the first compilation instead (%s)", exc)
            return
        logger.debug("ettr: restoring compile artifacts of entry %s in the background", digest)
        threading.Thread(
            target=self._restore_once, args=(dirs,), name="ettr-compile-restore", daemon=True
        ).start()

    def close(self) -> None:
        """Emit what is pending and, with `save_at_exit`, save what was compiled since the last save."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=60.0)
        self._emit()
        if self.config.save_at_exit and self._dirty:
            self.save(reason="exit")
        self._emit()
        try:
            self.rec.flush()
        except Exception:
            pass

    @property
    def store(self) -> CompileStore | None:
        if self._store is None and self.config.store is not None:
            self._store = CompileStore.open(
                StoreConfig(
                    location=os.path.expanduser(self.config.store),
                    max_bytes=self.config.max_store_bytes,
                    secret=self.config.secret,
                )
            )
        return self._store

    @property
    def key(self) -> StoreKey:
        if self._key is None:
            self._key = current_key(user_key=self.user_key)
        return self._key

    @property
    def _saves_here(self) -> bool:
        rank = getattr(self.rec, "rank", 0)
        return self.config.save_rank is None or rank == self.config.save_rank

    # -- before the first compile ------------------------------------------------------------------------
    def prepare(self) -> None:
        """Set the PGO job id, apply learned dynamic sources and restore the store entry. Runs once, at the
        start of the first compilation (or earlier when called directly); never raises."""
        with self._lock:
            if self._prepared:
                return
            self._prepared = True
        try:
            import torch

            if torch.compiler.config.job_id is None:
                torch.compiler.config.job_id = pgo_job_id(self.user_key)
        except Exception as exc:
            logger.debug("ettr: cannot set the PGO job id: %s", exc)
        self._restore_once(None, timeout_s=self.config.restore_timeout_s)
        if self._megacache is not None:
            try:
                artifacts.load_megacache(self._megacache)
            except Exception as exc:
                logger.warning("ettr: cannot load the megacache archive (%s); compiling from scratch", exc)
            self._megacache = None
        if self.config.learn_dynamic:
            try:
                sources = dynamic.merge(
                    self._job_sources(), dynamic.parse_many(self.store_meta.get("dynamic_sources", []))
                )
                if sources:
                    dynamic.apply(sources)
                self.applied_sources = sources
            except Exception as exc:
                logger.warning("ettr: cannot apply learned dynamic sources (%s); compiling without them", exc)

    def _job_sources(self) -> tuple[dynamic.DynamicSource, ...]:
        run_dir = getattr(self.rec, "run_dir", None)
        if run_dir is None:
            return ()
        return dynamic.load(dynamic.job_file(run_dir))[0]

    def _restore_once(self, dirs: tuple[Any, Any] | None, *, timeout_s: float = -1) -> None:
        # Whoever comes first restores; the first compilation waits (bounded) for a helper thread's restore.
        if not self._restore_lock.acquire(timeout=timeout_s):
            logger.warning(
                "ettr: compile store restore still running after %.0f s; compiling without it", timeout_s
            )
            return
        try:
            if not self._restored:
                self._restored = True
                self._restore(dirs)
        finally:
            self._restore_lock.release()

    def _restore(self, dirs: tuple[Any, Any] | None) -> None:
        store = self.store
        if store is None:
            return
        begin = time.time()
        info: dict[str, Any] = {"action": "restore", "location": store.backend.describe(), "begin_ts": begin}
        try:
            info["digest"] = self.key.digest
            head = store.load(self.key, names=set())  # the verified manifest alone
            if head is None:
                info["status"] = "miss"
            else:
                cache_dir, header_dir = dirs if dirs is not None else (None, None)
                listing = head.meta.get("archives", {})
                targets = {
                    artifacts.INDUCTOR_ARCHIVE: cache_dir or artifacts.inductor_cache_dir(),
                    artifacts.HEADERS_ARCHIVE: header_dir or artifacts.headers_dir(),
                }
                # Archives whose files are all still here (a restart on the same node) are not even read.
                skipped = {
                    n
                    for n, d in targets.items()
                    if n in head.available and artifacts.present(listing.get(n), d)
                }
                wanted = set(head.available) - skipped
                if artifacts.INDUCTOR_ARCHIVE in head.available:
                    wanted.discard(artifacts.MEGACACHE)
                entry = store.load(self.key, names=wanted)
                if entry is None:
                    raise EntryRefused("entry vanished while it was read")
                result = artifacts.restore(entry.files, cache_dir=cache_dir, header_dir=header_dir)
                restored = list(result.restored)
                if dirs is not None and artifacts.needs_megacache(entry.files):
                    self._megacache = entry.files[artifacts.MEGACACHE]  # loaded on the compiling thread
                    restored.append(artifacts.MEGACACHE)
                info["already_present"] = sorted(skipped)
                self.store_meta = dict(entry.meta)
                info.update(
                    status="hit",
                    restored=restored,
                    num_files=result.num_files,
                    loaded_bytes=entry.size_bytes,
                )
                stored = dynamic.parse_many(self.store_meta.get("dynamic_sources", []))
                self._saved_state = (
                    artifacts.collect_fingerprint(*dirs) if dirs else artifacts.collect_fingerprint(),
                    tuple(s.render() for s in stored),
                    json.dumps(self.store_meta.get("batch_spec"), sort_keys=True),
                )
        except EntryRefused as exc:
            info.update(status="refused", error=str(exc))
            logger.warning("ettr: compile store entry refused: %s", exc)
        except Exception as exc:
            info.update(status="error", error=f"{type(exc).__name__}: {exc}")
            logger.warning("ettr: compile store restore failed (%s); compiling from scratch", exc)
        info["duration_s"] = time.time() - begin
        self.last_restore = info
        self._mark(begin, info)

    # -- during the run ----------------------------------------------------------------------------------
    def _after_compile(self, record: CompileRecord) -> None:
        self._dirty = True
        if record.recompile_reason is not None and self.config.learn_dynamic:
            # At once, on the compiling thread (a small JSON write): a crash or SIGKILL before the settle
            # save must not cost the next attempt this recompile again.
            try:
                self._persist_learned()
            except Exception as exc:
                logger.debug("ettr: cannot keep learned dynamic sources: %s", exc)
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._background, name="ettr-compile", daemon=True)
            self._thread.start()
        self._wake.set()

    def _on_step(self, step: int) -> None:
        if self.hooks.num_pending or self._pending_marks:
            self._emit()

    def _background(self) -> None:
        while not self._closed:
            self._wake.wait(0.5)
            self._wake.clear()
            if self._closed:
                break
            self._emit()
            last = self.hooks.last_end_ts
            if (
                self._dirty
                and last is not None
                and not self.hooks.in_flight
                and time.time() - last >= self.config.settle_s
            ):
                self.save(reason="settled")

    def _emit(self) -> None:
        self.hooks.emit_pending()
        if not self._pending_marks or not self.hooks.quiet():
            return
        with self._lock:
            marks, self._pending_marks = self._pending_marks, []
        for ts, data in marks:
            try:
                self.rec.record(EventKind.MARK, ts=ts, data={"name": STORE_MARK, **data})
            except Exception as exc:
                logger.debug("ettr: cannot record a store mark: %s", exc)

    def _mark(self, ts: float, data: dict[str, Any]) -> None:
        with self._lock:
            self._pending_marks.append((ts, data))
        self._wake.set()

    # -- saving ------------------------------------------------------------------------------------------
    def learned_sources(self) -> tuple[dynamic.DynamicSource, ...]:
        """Dynamic sources learned in this process (PGO profile and recompile reasons) plus applied ones."""
        from_reasons = [s for reason in self.hooks.recompile_reasons for s in dynamic.from_reason(reason)]
        return dynamic.merge(self.applied_sources, dynamic.from_pgo(), from_reasons)

    def _persist_learned(self) -> tuple[dynamic.DynamicSource, ...]:
        """Write the learned sources and the recompile reasons not written yet to the job's file
        (`save_rank` only). Returns the learned sources."""
        sources = self.learned_sources()
        run_dir = getattr(self.rec, "run_dir", None)
        with self._lock:
            records = [r for r in self.hooks.records if r.recompile_reason][self._num_reasons_written :]
            if not self._saves_here or run_dir is None or (sources == self._sources_written and not records):
                return sources
            attempt = getattr(self.rec, "attempt", 0)
            reasons = [
                {
                    "ts": r.begin_ts,
                    "reason": r.recompile_reason,
                    "compile_id": r.compile_id,
                    "attempt": attempt,
                }
                for r in records
            ]
            dynamic.save(dynamic.job_file(run_dir), sources, reasons)
            self._num_reasons_written += len(records)
            self._sources_written = sources
        return sources

    def save(self, *, reason: str = "explicit") -> bool:
        """Learn dynamic sources, write them to the run directory, and save the artifacts to the store if
        anything changed since the last save or restore. Never raises; returns True when it saved."""
        if self.hooks.in_flight:
            return False
        self._dirty = False
        begin = time.time()
        saved = False
        try:
            sources = self._persist_learned()
            store = self.store
            if store is None or not self._saves_here:
                return False
            spec = self.batch_spec if self.batch_spec is not None else self.store_meta.get("batch_spec")
            state = (
                artifacts.collect_fingerprint(),
                tuple(s.render() for s in sources),
                json.dumps(spec, sort_keys=True),
            )
            if state == self._saved_state:
                return False
            collected = artifacts.collect(
                include_megacache=self.config.include_megacache,
                compress=not isinstance(store.backend, LocalBackend),
            )
            files = collected.files
            meta = {
                "archives": collected.listing,
                "dynamic_sources": [
                    s.render()
                    for s in dynamic.merge(
                        sources, dynamic.parse_many(self.store_meta.get("dynamic_sources", []))
                    )
                ],
                "job_id": getattr(self.rec, "job_id", ""),
                "attempt": getattr(self.rec, "attempt", 0),
                "num_compiles": len(self.hooks.records),
                "num_recompiles": len(self.hooks.recompile_reasons),
            }
            if spec is not None:
                meta["batch_spec"] = spec
            size = store.save(self.key, files, meta=meta)
            self._saved_state = state
            saved = True
            info = {
                "action": "save",
                "status": "saved",
                "reason": reason,
                "digest": self.key.digest,
                "entry_bytes": size,
                "artifacts": sorted(files),
                "location": store.backend.describe(),
                "duration_s": time.time() - begin,
            }
        except Exception as exc:
            info = {
                "action": "save",
                "status": "error",
                "reason": reason,
                "error": f"{type(exc).__name__}: {exc}",
            }
            logger.warning("ettr: saving compile artifacts failed (%s); the next start compiles again", exc)
        self.last_save = info
        self._mark(begin, info)
        return saved
