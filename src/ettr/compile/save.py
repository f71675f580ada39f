"""Saving what this process compiled and learned (part of `CompileSession`).

`StoreSaver.persist_learned` writes the dynamic sources learned so far and the recompile reasons not yet
written to the run directory (`<run_dir>/compile/dynamic.json`, for the next attempt); `save` does that
and then saves the artifacts to the store if anything changed since the last save or restore. Only the
`save_rank` process writes either. Neither raises.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

from ettr.compile import artifacts, dynamic, pch_memo
from ettr.compile.config import CompileConfig
from ettr.compile.hooks import CompileHooks
from ettr.compile.key import StoreKey
from ettr.compile.restore import EntryView, MarkFn
from ettr.compile.store import CompileStore, EntryRefused
from ettr.procs import lower_this_thread
from ettr.recorder import EventSink
from ettr.warn import say

logger = logging.getLogger("ettr")


class StoreSaver:
    """Writes learned sources to the run directory and artifacts to the store (see the module docstring).

    Args:
        rec: this process's recorder (`run_dir`, `rank`, `attempt`, `job_id`).
        config: `save_rank`, `include_megacache`.
        hooks: the compile records and recompile reasons seen so far.
        store: the store, opened on first use (None: no store configured).
        key: the entry's key.
        view: what the store holds (shared with the restorer).
        mark: where each save is reported.
    """

    def __init__(
        self,
        *,
        rec: EventSink,
        config: CompileConfig,
        hooks: CompileHooks,
        store: Callable[[], CompileStore | None],
        key: Callable[[], StoreKey],
        view: EntryView,
        mark: MarkFn,
    ) -> None:
        self._rec, self._config, self._hooks = rec, config, hooks
        self._store, self._key, self._view, self._mark = store, key, view, mark
        self._lock = threading.Lock()
        self._num_reasons_written = 0
        self._sources_written: tuple[dynamic.DynamicSource, ...] = ()
        self.last_save: dict[str, Any] | None = None
        """The last save's report (status saved | error, sizes, time); None before (and for a skipped one)."""

    @property
    def saves_here(self) -> bool:
        """Whether this process is the one that writes (`save_rank`, or every process when None)."""
        return self._config.save_rank is None or self._rec.rank == self._config.save_rank

    def learned_sources(
        self, applied: tuple[dynamic.DynamicSource, ...]
    ) -> tuple[dynamic.DynamicSource, ...]:
        """Dynamic sources learned in this process (PGO profile and recompile reasons) plus `applied`."""
        from_reasons = [s for reason in self._hooks.recompile_reasons for s in dynamic.from_reason(reason)]
        return dynamic.merge(applied, dynamic.from_pgo(), from_reasons)

    def persist_learned(
        self, applied: tuple[dynamic.DynamicSource, ...]
    ) -> tuple[dynamic.DynamicSource, ...]:
        """Write the learned sources and the recompile reasons not written yet to the job's file
        (`save_rank` only). Returns the learned sources."""
        sources = self.learned_sources(applied)
        run_dir = self._rec.run_dir
        with self._lock:
            records = [r for r in self._hooks.records if r.recompile_reason][self._num_reasons_written :]
            if not self.saves_here or run_dir is None or (sources == self._sources_written and not records):
                return sources
            attempt = self._rec.attempt
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

    def save(
        self,
        *,
        reason: str,
        applied: tuple[dynamic.DynamicSource, ...],
        batch_spec: Mapping[str, Any] | None,
    ) -> bool:
        """Persist what was learned, then save the artifacts if the entry would change. Returns True when
        it saved; never raises (a failure is logged, reported as an error mark, and False)."""
        begin = time.time()
        saved = False
        try:
            sources = self.persist_learned(applied)
            store = self._store()
            if store is None or not self.saves_here:
                return False
            spec = batch_spec if batch_spec is not None else self._view.meta.get("batch_spec")
            state = (
                artifacts.collect_fingerprint(),
                tuple(s.render() for s in sources),
                json.dumps(spec, sort_keys=True),
            )
            if state == self._view.saved_state:
                return False
            info = self._save_entry(store, sources, spec, reason)
            self._view.saved_state = state
            saved = True
            info["duration_s"] = time.time() - begin
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

    def _save_entry(
        self,
        store: CompileStore,
        sources: tuple[dynamic.DynamicSource, ...],
        spec: Any,
        reason: str,
    ) -> dict[str, Any]:
        used = pch_memo.used_headers()
        collected = artifacts.collect(include_megacache=self._config.include_megacache, headers_used=used)
        stored = dynamic.parse_many(self._view.meta.get("dynamic_sources", []))
        meta = {
            "dynamic_sources": [s.render() for s in dynamic.merge(sources, stored)],
            "job_id": self._rec.job_id,
            "attempt": self._rec.attempt,
            "num_compiles": len(self._hooks.records),
            "num_recompiles": len(self._hooks.recompile_reasons),
        }
        if spec is not None:
            meta["batch_spec"] = spec
        key = self._key()
        result = store.save(key, collected.artifacts, meta=meta)
        info: dict[str, Any] = {
            "action": "save",
            "status": "saved",
            "reason": reason,
            "digest": key.digest,
            "entry_bytes": result.entry_bytes,
            "written_bytes": result.written_bytes,
            "artifacts": sorted(collected.artifacts),
            "location": store.backend.describe(),
        }
        try:
            info.update(save_headers(store, key, collected.headers, used=used))
        except Exception as exc:  # the workload's entry is saved: the next job restores its kernels
            info.update(headers="error", headers_error=f"{type(exc).__name__}: {exc}")
            logger.warning(
                "ettr: saving the precompiled headers to the compile store failed (%s); the kernels were "
                "saved, the next job builds the header again",
                exc,
            )
        _say_store_once(store, info)
        return info


HEADER_VARIANT_TTL_S = 7 * 86400.0
"""A precompiled-header variant of the build's entry that no process has used for this long (restored, or
saved, `CompileStore.touch_part`; a variant never recorded counts from the entry's last save) is dropped by
the next save of a header of the build; the variant the saving process uses never is."""


def save_headers(
    store: CompileStore,
    key: StoreKey,
    headers: Mapping[str, Any],
    *,
    used: Collection[str] = (),
    now: float | None = None,
) -> dict[str, Any]:
    """Add this process's precompiled headers to its build's entry (`StoreKey.headers_key`), unless the
    entry already lists every one of them with its size: then nothing is read. Header variants other jobs
    added are kept while some process used them in the last `HEADER_VARIANT_TTL_S`; older ones are dropped
    (their stored files go with the store's next eviction, which waits for every restore in flight). `used`:
    the variants this process's inductor was given (never dropped, their use recorded). Returns what it did,
    for the save's report."""
    if not headers:
        return {}
    now = time.time() if now is None else now
    build = key.headers_key()
    try:
        existing = store.head(build)
    except EntryRefused:
        existing = None  # replaced by this save
    have = dict(existing.artifacts.get(artifacts.HEADERS_ARCHIVE, {})) if existing is not None else {}
    # A listed header whose stored file is gone (removed as damaged, or lost) is not had: saved again.
    have = {rel: stored for rel, stored in have.items() if not store.missing({rel: stored})}
    mine = set(used) | {artifacts.header_variant(rel) for rel in headers}
    for variant in sorted(set(used)):
        store.touch_part(build.digest, variant, now)
    dropped: set[str] = set()
    if existing is not None:
        last_use = store.parts_used(build.digest)
        for variant in {artifacts.header_variant(rel) for rel in have} - mine:
            if now - last_use.get(variant, existing.created_ts) > HEADER_VARIANT_TTL_S:
                dropped.add(variant)
        have = {rel: f for rel, f in have.items() if artifacts.header_variant(rel) not in dropped}
    local: dict[str, Any] = {}
    for rel, source in headers.items():
        try:
            size = os.lstat(source).st_size if isinstance(source, os.PathLike) else len(source)
        except OSError:
            continue  # removed since it was listed
        if rel not in have or have[rel].size != size:
            local[rel] = source
    if not local and not dropped:
        return {"headers": "shared", "headers_digest": build.digest}
    result = store.save(
        build, {artifacts.HEADERS_ARCHIVE: {**have, **local}}, meta={"kind": "precompiled-headers"}
    )
    return {
        "headers": "saved",
        **({"headers_dropped": sorted(dropped)} if dropped else {}),
        "headers_digest": build.digest,
        "headers_bytes": result.entry_bytes,
        "headers_written_bytes": result.written_bytes,
    }


SETTLE_NICE_STEP = 19
"""How much nicer than training the settle save's thread runs: as nice as a thread gets. Linux's scheduler
weighs a nice +19 thread 15 against training's 1024 (nice +10: 110), so where the save shares a core with a
training thread it takes about 1.5% of it instead of about 10% (benchmarks/training_yield.py)."""


def lower_save_thread() -> int | None:
    """Lower the calling thread for a background store save (`SETTLE_NICE_STEP`, the lowest best-effort I/O
    priority). Returns its nice value before, for `raise_save_thread`; None where it was not lowered."""
    tid = threading.get_native_id()
    try:
        before = os.getpriority(os.PRIO_PROCESS, tid)
    except (AttributeError, OSError):
        before = None
    return before if lower_this_thread(nice_step=SETTLE_NICE_STEP) else None


def raise_save_thread(tid: int, nice: int) -> bool:
    """Give thread `tid` (lowered by `lower_save_thread`) its nice value `nice` back, when someone waits on
    it: a process that exits must not wait behind a save that a busy node gives almost no CPU. Only where
    the process may (CAP_SYS_NICE, or an RLIMIT_NICE that allows it); whether it was raised. Never raises."""
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except (AttributeError, OSError) as exc:
        logger.debug("ettr: the compile store's save keeps its low priority (%s)", exc)
        return False
    return True


_said: set[str] = set()
_said_lock = threading.Lock()


def _say_store_once(store: CompileStore, info: dict[str, Any]) -> None:
    """Print the store's location and size once per process (the first save): a user learns where the
    artifacts go and how big the store is. Never raises."""
    where = store.backend.describe()
    with _said_lock:
        if where in _said:
            return
        _said.add(where)
    try:
        usage = store.usage()
        info["store_bytes"] = usage.stored_bytes
        say(
            f"ettr: compile store {where}: {usage.describe()}; bound {store.max_bytes / 1e9:.1f} GB "
            "(ETTR_COMPILE_STORE moves it, =off turns it off)"
        )
    except Exception as exc:  # a report line must not turn a save into an error
        logger.debug("ettr: cannot describe the compile store (%s)", exc)
