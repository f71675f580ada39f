"""Restoring a compile store entry onto this node, before the first compilation (part of `CompileSession`).

`StoreRestorer.restore_once` restores at most once per process, whoever calls first: the session's helper
thread at start-up (so the unpacking overlaps whatever the program does before it compiles), or the first
compilation itself, which waits for a running restore at most `restore_timeout_s`. Archives whose files are
all still on this node (a restart on the same node) are not even read. What the store holds afterwards is
kept in the shared `EntryView`, which the saver compares against so that an unchanged entry is not saved.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ettr.compile import artifacts, dynamic
from ettr.compile.key import StoreKey
from ettr.compile.store import CompileStore, EntryRefused

logger = logging.getLogger("ettr")

STORE_MARK = "compile_store"
"""`Recorder.mark` name of store actions (data: action = restore | save, status, digest, sizes, time)."""

MarkFn = Callable[[float, dict[str, Any]], None]
"""Where a store action is reported: (begin time, the action's data) -> recorded later as a MARK."""

SavedState = tuple[str, tuple[str, ...], str]
"""What a store entry holds, as compared between saves: (files fingerprint, sources, batch spec JSON)."""


@dataclass
class EntryView:
    """What this process knows of its store entry (shared by the restorer and the saver)."""

    meta: dict[str, Any] = field(default_factory=dict)
    """Metadata of the restored entry (learned sources, batch spec), empty if none."""
    saved_state: SavedState | None = None
    """What the store holds: a save with nothing new is skipped."""


class StoreRestorer:
    """Restores the store entry of `key()` from `store()` once (see the module docstring).

    Args:
        store: the store, opened on first use (None: no store configured).
        key: the entry's key (computed on first use).
        view: where the restored entry's metadata and state go.
        mark: where the restore is reported.
    """

    def __init__(
        self,
        *,
        store: Callable[[], CompileStore | None],
        key: Callable[[], StoreKey],
        view: EntryView,
        mark: MarkFn,
    ) -> None:
        self._store, self._key, self._view, self._mark = store, key, view, mark
        self._lock = threading.Lock()
        self._restored = False
        self._megacache: bytes | None = None
        self.last_restore: dict[str, Any] | None = None
        """The last restore's report (status hit | miss | refused | error, sizes, time); None before."""

    def restore_once(self, dirs: tuple[Path, Path] | None, *, timeout_s: float = -1) -> None:
        """Restore unless this process already has (or is): into `dirs` (cache, headers), else inductor's
        own directories. Waits at most `timeout_s` for a restore running elsewhere (-1: no limit)."""
        if not self._lock.acquire(timeout=timeout_s):
            logger.warning(
                "ettr: compile store restore still running after %.0f s; compiling without it", timeout_s
            )
            return
        try:
            if not self._restored:
                self._restored = True
                self._restore(dirs)
        finally:
            self._lock.release()

    def take_megacache(self) -> bytes | None:
        """The megacache archive a helper-thread restore left for the compiling thread to load (once)."""
        megacache, self._megacache = self._megacache, None
        return megacache

    def _restore(self, dirs: tuple[Path, Path] | None) -> None:
        store = self._store()
        if store is None:
            return
        begin = time.time()
        info: dict[str, Any] = {"action": "restore", "location": store.backend.describe(), "begin_ts": begin}
        try:
            key = self._key()
            info["digest"] = key.digest
            head = store.load(key, names=set())  # the verified manifest alone
            if head is None:
                info["status"] = "miss"
            else:
                info.update(self._restore_entry(store, key, head.available, head.meta, dirs))
        except EntryRefused as exc:
            info.update(status="refused", error=str(exc))
            logger.warning("ettr: compile store entry refused: %s", exc)
        except Exception as exc:
            info.update(status="error", error=f"{type(exc).__name__}: {exc}")
            logger.warning("ettr: compile store restore failed (%s); compiling from scratch", exc)
        info["duration_s"] = time.time() - begin
        self.last_restore = info
        self._mark(begin, info)

    def _restore_entry(
        self,
        store: CompileStore,
        key: StoreKey,
        available: Any,
        head_meta: Mapping[str, Any],
        dirs: tuple[Path, Path] | None,
    ) -> dict[str, Any]:
        cache_dir, header_dir = dirs if dirs is not None else (None, None)
        listing = head_meta.get("archives", {})
        targets = {
            artifacts.INDUCTOR_ARCHIVE: cache_dir or artifacts.inductor_cache_dir(),
            artifacts.HEADERS_ARCHIVE: header_dir or artifacts.headers_dir(),
        }
        # The ranks of a node restore into the same directories: one unpacks, the others wait for it and
        # then find the files there, rather than all reading and writing the same ~150 MB at once.
        with artifacts.restore_lock(targets[artifacts.INDUCTOR_ARCHIVE]):
            return self._restore_unless_present(store, key, available, listing, targets, dirs)

    def _restore_unless_present(
        self,
        store: CompileStore,
        key: StoreKey,
        available: Any,
        listing: Mapping[str, Any],
        targets: Mapping[str, Path],
        dirs: tuple[Path, Path] | None,
    ) -> dict[str, Any]:
        cache_dir, header_dir = dirs if dirs is not None else (None, None)  # None: the restore looks them up
        # Archives whose files are all still here (a restart on the same node) are not even read.
        skipped = {n for n, d in targets.items() if n in available and artifacts.present(listing.get(n), d)}
        wanted = set(available) - skipped
        if artifacts.INDUCTOR_ARCHIVE in available:
            wanted.discard(artifacts.MEGACACHE)
        entry = store.load(key, names=wanted)
        if entry is None:
            raise EntryRefused("entry vanished while it was read")
        result = artifacts.restore(entry.files, cache_dir=cache_dir, header_dir=header_dir)
        restored = list(result.restored)
        if dirs is not None and artifacts.needs_megacache(entry.files):
            self._megacache = entry.files[artifacts.MEGACACHE]  # loaded on the compiling thread
            restored.append(artifacts.MEGACACHE)
        self._view.meta = dict(entry.meta)
        stored = dynamic.parse_many(self._view.meta.get("dynamic_sources", []))
        self._view.saved_state = (
            artifacts.collect_fingerprint(*dirs) if dirs else artifacts.collect_fingerprint(),
            tuple(s.render() for s in stored),
            json.dumps(self._view.meta.get("batch_spec"), sort_keys=True),
        )
        return {
            "already_present": sorted(skipped),
            "status": "hit",
            "restored": restored,
            "num_files": result.num_files,
            "loaded_bytes": entry.size_bytes,
        }
