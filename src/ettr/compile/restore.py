"""Restoring a compile store entry onto this node, before the first compilation (part of `CompileSession`).

`StoreRestorer.restore_once` restores at most once per process, whoever calls first: the session's helper
thread at start-up (so the writing overlaps whatever the program does before it compiles), or the first
compilation itself, which waits for a running restore at most `restore_timeout_s`. Two entries are
restored: the workload's (inductor's cache directory, else the megacache archive) and the build's
precompiled headers (`StoreKey.headers_key`), which a workload's first job gets too. Artifacts whose files
are all still on this node (a restart on the same node) are not even read, nor are those of a newer version of
the entry (another job's save) where an earlier restore of this process (a promoted spare's, done ahead) left a
complete version in the same directories whose files are as it left them (`in_place`). What the store holds afterwards
is kept in the shared `EntryView`, which the saver compares against so that an unchanged entry is not saved.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ettr.compile import artifacts, dynamic, in_place
from ettr.compile.in_place import FileId, InPlace
from ettr.compile.key import StoreKey
from ettr.compile.store import CompileStore, EntryRefused, StoredFile, StoreEntry

logger = logging.getLogger("ettr")

STORE_MARK = "compile_store"
"""`Recorder.mark` name of store actions (data: action = restore | save, status, digest, sizes, time)."""

WantedHeaders = Callable[[Path, Path], "Collection[str] | None"]
"""(cache directory, header directory) -> the header variants this process will use, None when unknown."""

MarkFn = Callable[[float, dict[str, Any]], None]
"""Where a store action is reported: (begin time, the action's data) -> recorded later as a MARK."""

BeforeFn = Callable[[tuple[Path, Path], str], dict[str, Any]]
"""Called once a restore has its key, before it looks at the store's files: ((cache, headers) directories,
the entry's key digest) -> fields for the restore's report (a parked spare's `ahead.Ahead.settle`)."""

EarlierFn = Callable[[], "InPlace | None"]
"""Called once a restore has its key, after `BeforeFn`: the versions an earlier restore of this process left in
the same directories (`in_place.InPlace`), which this one takes where the store's entry was saved again since
and they are still as that restore left them; None: none."""

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
        wanted_headers: the precompiled-header variants this process's inductor will look up, given the
            restored cache directory and the header directory (`pch_memo.wanted_headers`); None (or an
            answer of None): unknown, every stored variant is restored.
        before: called before the restore reads the store (`BeforeFn`); may wait.
        earlier: the versions an earlier restore left in place (`EarlierFn`), called after `before`.
        remember: keep what a complete restore made present (`in_place`), for a later restore's `earlier`.
    """

    def __init__(
        self,
        *,
        store: Callable[[], CompileStore | None],
        key: Callable[[], StoreKey],
        view: EntryView,
        mark: MarkFn,
        wanted_headers: WantedHeaders | None = None,
        before: BeforeFn | None = None,
        earlier: EarlierFn | None = None,
        remember: bool = False,
    ) -> None:
        self._store, self._key, self._view, self._mark = store, key, view, mark
        self._wanted_headers = wanted_headers
        self._before = before
        self._earlier = earlier
        self._remember = remember
        self.in_place: InPlace | None = None
        """With `remember`: the versions this restore made present, when it was complete (status hit, nothing
        refused); None otherwise."""
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
            if self._before is not None:
                resolved = dirs or (artifacts.inductor_cache_dir(), artifacts.headers_dir())
                info.update(self._before(resolved, key.digest))
            earlier = self._earlier() if self._earlier is not None else None
            refused: EntryRefused | None = None
            try:
                entry = store.head(key)
            except EntryRefused as exc:  # the build's headers, an entry of their own, are still restored
                entry, refused = None, exc
            headers = _headers_entry(store, key, info)
            if entry is None and headers is None:
                info["status"] = "miss"
            else:
                info.update(self._restore_entry(store, entry, headers, dirs, earlier))
            refused = refused or info.pop("refused", None)
            if refused is not None:
                raise refused
        except EntryRefused as exc:
            info.update(status="refused", error=str(exc))
        except Exception as exc:
            info.update(status="error", error=f"{type(exc).__name__}: {exc}")
            logger.warning("ettr: compile store restore failed (%s); compiling from scratch", exc)
        _warn_refused(info)
        info["duration_s"] = time.time() - begin
        self.last_restore = info
        self._mark(begin, info)

    def _headers_wanted(
        self,
        store: CompileStore,
        headers: StoreEntry,
        stored: Mapping[str, StoredFile],
        targets: Mapping[str, Path],
        extra: dict[str, Any],
    ) -> Mapping[str, StoredFile]:
        """The files of the stored header variants this process will use (all of them when unknown, or
        when the wanted ones are not all stored), and their use recorded in the store (`touch_part`), so
        that a save keeps them (`save.save_headers` drops a variant no process used for a while)."""
        wanted: Collection[str] | None = None
        if self._wanted_headers is not None:
            try:
                wanted = self._wanted_headers(
                    targets[artifacts.INDUCTOR_ARCHIVE], targets[artifacts.HEADERS_ARCHIVE]
                )
            except Exception as exc:  # unknown: every variant, as before
                logger.debug("ettr: precompiled-header variants unknown (%s)", exc)
        stored_variants = {artifacts.header_variant(rel) for rel in stored}
        if not wanted or not set(wanted) <= stored_variants:
            return stored
        chosen = artifacts.header_files(stored, wanted)
        now = time.time()
        for variant in sorted(wanted):
            store.touch_part(headers.digest, variant, now)
        extra["header_variants"] = f"{len(set(wanted))} of {len(stored_variants)}"
        return chosen

    def _restore_entry(
        self,
        store: CompileStore,
        entry: StoreEntry | None,
        headers: StoreEntry | None,
        dirs: tuple[Path, Path] | None,
        earlier: InPlace | None = None,
    ) -> dict[str, Any]:
        cache_dir, header_dir = dirs if dirs is not None else (None, None)
        targets = {
            artifacts.INDUCTOR_ARCHIVE: cache_dir or artifacts.inductor_cache_dir(),
            artifacts.HEADERS_ARCHIVE: header_dir or artifacts.headers_dir(),
        }
        # The ranks of a node restore into the same directories: one writes, the others wait for it and
        # then find the files there, rather than all reading and writing the same ~150 MB at once.
        with artifacts.restore_lock(targets[artifacts.INDUCTOR_ARCHIVE]), store.reading():
            return self._restore_unless_present(store, entry, headers, targets, dirs, earlier)

    def _restore_unless_present(
        self,
        store: CompileStore,
        entry: StoreEntry | None,
        headers: StoreEntry | None,
        targets: Mapping[str, Path],
        dirs: tuple[Path, Path] | None,
        earlier: InPlace | None,
    ) -> dict[str, Any]:
        trees: dict[str, Mapping[str, StoredFile]] = dict(entry.artifacts) if entry is not None else {}
        if headers is not None and artifacts.HEADERS_ARCHIVE in headers.artifacts:
            trees[artifacts.HEADERS_ARCHIVE] = headers.artifacts[artifacts.HEADERS_ARCHIVE]
        skipped: set[str] = set()
        restored: list[str] = []
        num_files = num_bytes = 0
        extra: dict[str, Any] = {}
        kept: list[str] = []
        not_kept: list[str] = []
        ids: dict[str, dict[str, FileId]] = {}
        for name in (artifacts.INDUCTOR_ARCHIVE, artifacts.HEADERS_ARCHIVE):
            if name not in trees:
                continue
            if name == artifacts.HEADERS_ARCHIVE and headers is not None:
                # After the cache directory: its header memo names the variants this process will use.
                trees[name] = self._headers_wanted(store, headers, trees[name], targets, extra)
            if earlier is not None and earlier.saved_again(name, entry, headers, trees[name]):
                # The store's entry was saved again since an earlier restore of this process made a complete
                # version of it present here: that version counts while its files are as it left them.
                why = earlier.usable(name, targets[name], trees[name])
                if why is None:
                    trees[name] = earlier.trees[name]
                    kept.append(name)
                    skipped.add(name)
                    continue
                not_kept.append(why)
            # Artifacts whose files are all still here (a restart on the same node) are not even read.
            if artifacts.present(trees[name], targets[name]):
                skipped.add(name)
                self._identify(ids, name, trees[name], targets[name])
                continue
            try:
                missing = store.missing(trees[name])
                if missing:
                    raise EntryRefused(f"{name}: {len(missing)} stored files are missing (e.g. {missing[0]})")
                result = artifacts.restore_tree(trees[name], targets[name], store.read, copy=store.copy_into)
            except EntryRefused as exc:
                if name != artifacts.HEADERS_ARCHIVE:
                    # The workload's entry: refused (said by the caller) and not used; the build's headers,
                    # an entry of their own, are still restored (inductor would build them again: seconds,
                    # and the save would store another 156 MB copy, a header is not the same byte for byte).
                    extra["refused"], entry = exc, None
                    continue
                extra["headers_error"] = str(exc)  # the build's headers: inductor builds them again
                continue
            restored.append(name)
            num_files, num_bytes = num_files + result.num_written, num_bytes + result.bytes_written
            self._identify(ids, name, trees[name], targets[name])
        if artifacts.INDUCTOR_ARCHIVE in kept and earlier is not None:
            entry = earlier.entry  # its metadata and listing: what this process compiles from
        if entry is not None and artifacts.INDUCTOR_ARCHIVE not in trees and artifacts.MEGACACHE in trees:
            stored = trees[artifacts.MEGACACHE].get(artifacts.MEGACACHE)
            try:
                data = store.read(stored) if stored is not None else None
            except EntryRefused as exc:
                extra["refused"], entry, data = exc, None, None
            if data is not None:
                if dirs is not None:
                    self._megacache = data  # loaded on the compiling thread
                else:
                    artifacts.load_megacache(data)
                restored.append(artifacts.MEGACACHE)
                num_bytes += len(data)
        if entry is not None:
            self._view.meta = dict(entry.meta)
            stored_sources = dynamic.parse_many(self._view.meta.get("dynamic_sources", []))
            # What the entry holds, not what the directory holds: an earlier attempt on this node may have
            # compiled files it never saved (killed before its save); this process finds them there and
            # must still save them, or every later job on a fresh node compiles them again.
            cached = entry.artifacts.get(artifacts.INDUCTOR_ARCHIVE, {})
            header_dir = dirs[1] if dirs is not None else artifacts.headers_dir()
            self._view.saved_state = (
                artifacts.listing_fingerprint({rel: f.size for rel, f in cached.items()})
                + artifacts.fingerprint(header_dir),
                tuple(s.render() for s in stored_sources),
                json.dumps(self._view.meta.get("batch_spec"), sort_keys=True),
            )
        if entry is not None and "refused" not in extra and artifacts.INDUCTOR_ARCHIVE in ids:
            self.in_place = InPlace(
                entry=entry,
                headers=headers if artifacts.HEADERS_ARCHIVE in ids else None,
                trees={name: trees[name] for name in ids},
                targets={name: targets[name] for name in ids},
                ids=ids,
            )
        if earlier is not None:
            extra["version"] = "earlier" if kept else "latest"
            if kept:
                extra["earlier_artifacts"] = kept
            if not_kept:
                extra["earlier_unused"] = "; ".join(not_kept)
        return {
            "already_present": sorted(skipped),
            "status": "hit" if entry is not None else "miss",
            "restored": restored,
            "num_files": num_files,
            "loaded_bytes": num_bytes,
            **extra,
        }

    def _identify(
        self, ids: dict[str, dict[str, FileId]], name: str, files: Mapping[str, StoredFile], dest: Path
    ) -> None:
        """With `remember`: each file of artifact `name` as it is now in `dest` (under the restore lock)."""
        if self._remember:
            found = in_place.identify(files, dest)
            if found is not None:
                ids[name] = found


def _headers_entry(store: CompileStore, key: StoreKey, info: dict[str, Any]) -> StoreEntry | None:
    """The build's precompiled-header entry (None when there is none or it is refused: said in `info`)."""
    try:
        return store.head(key.headers_key())
    except EntryRefused as exc:
        info["headers_error"] = str(exc)
        return None


_ENTRY_PREFIX = re.compile(r"^entry [0-9a-f]+: ")


def _warn_refused(info: Mapping[str, Any]) -> None:
    """One warning for what a restore refused. The workload's entry and the build's headers refused for one
    cause (a secret against an unsigned store, a store of another torch) are one line, not one per entry;
    `info` keeps each entry's own message (`error`, `headers_error`)."""
    refused = str(info["error"]) if info.get("status") == "refused" else None
    headers = info.get("headers_error")
    if refused is None and headers is None:
        return
    if refused is None:
        logger.warning("ettr: compile store precompiled headers not restored: %s", headers)
    elif headers is None:
        logger.warning("ettr: compile store entry refused: %s", refused)
    else:
        cause, headers_cause = _ENTRY_PREFIX.sub("", refused), _ENTRY_PREFIX.sub("", str(headers))
        why = cause if cause == headers_cause else f"{refused}; precompiled headers: {headers}"
        logger.warning(
            "ettr: compile store refused the workload's entry and the build's precompiled headers: %s; "
            "compiling from scratch",
            why,
        )
