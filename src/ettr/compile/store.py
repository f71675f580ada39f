"""The compile artifact store: files stored once by content, entries committed by a manifest, LRU-bounded.

Layout under the store root (any `StoreBackend`):

    blobs/<2 hex>/<sha256>    one file's bytes, named by the SHA-256 of its content (gzip'd on a store that
                              asks for compression: `<sha256>.gz`). A file that is the same in several
                              entries — inductor's precompiled header, the same for every model of one
                              torch/compiler build, or any identical kernel — is stored once.
    <digest>/manifest.json    an entry's commit marker, written last: its key, every file of each artifact
                              (relative path -> SHA-256, size, mode, mtime) and its metadata
    <digest>/used             Unix time of the last save or load (least-recently-used eviction)
    .lock                     a local store's lock: saves and restores hold it shared, eviction exclusive

An entry exists once its manifest does. Blobs are immutable: a save writes the blobs it needs that are
missing — each atomically under its final name, so two writers of one blob write the same bytes — and
then its manifest (an atomic replace: of two concurrent saves of one key, the last one's entry is the
entry, whole). Only eviction deletes, after a save (one that replaced no entry skips it when this store's
last pass was under a minute ago and left room, `EVICT_EVERY_S`): least recently used entries (manifest
first) until the store fits `max_bytes`, counting each blob once however many entries share it; then blobs
no remaining manifest names — on a local store only while no save or restore holds the lock, on a store without locks only
when older than `UNREFERENCED_GRACE_S`. A manifest that cannot be parsed never stops that: it is garbage,
removed on the way.

Loading reads the manifest, refuses it unless its key components equal the expected ones (and, with a
secret, unless its HMAC verifies); every blob read is checked against its SHA-256 and size. Artifacts
are compiled code, so anything that does not verify is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import hmac
import json
import logging
import math
import mmap
import os
import re
import stat
import threading
import time
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ettr.atomic import atomic_fill
from ettr.compile.backend import LocalBackend, StoreBackend, open_backend
from ettr.compile.key import StoreKey
from ettr.compile.safety import read_no_follow_stat
from ettr.constants import DEFAULT_STORE_MAX_BYTES
from ettr.untrusted import open_regular
from ettr.warn import WarnOnce

_UNSIGNED_REMOTE = WarnOnce(
    "ettr: the compile store is remote ({what}://) and has no ETTR_COMPILE_STORE_SECRET: its entries are code "
    "(kernels, pickled cache entries) and whoever can write it can plant some that this job runs; set the "
    "secret to load only entries signed with it (docs/compile.md)"
)

logger = logging.getLogger("ettr")

MANIFEST_SCHEMA = "ettr.compile-store/2"
MANIFEST = "manifest.json"
USED = "used"
USED_PART = "used."
"""`<digest>/used.<part>`: when a part of an entry (a precompiled-header variant) was last used."""
TOUCH_EVERY_S = 60.0
"""An entry's use (`used`, its LRU age) is written at most this often: a restore that finds a fresher record
(the ranks of a node, a spare's restore ahead and its check after the promotion) writes nothing (each write
is durable: two fsyncs, ~25 ms here, of a restore that has nothing else to write)."""
PART_TOUCH_EVERY_S = 3600.0
"""A part's use is written at most this often (a restore that finds a fresher record writes nothing)."""
_PART = re.compile(r"^[A-Za-z0-9_-]{1,128}\.h$")
BLOBS = "blobs"
UNREFERENCED_GRACE_S = 3600.0
"""On a store without locks (an object store), a blob no manifest names is deleted only when older than
this: a save in flight may have written it and not yet its manifest."""

EVICT_EVERY_S = 60.0
EVICT_HEADROOM = 0.9
"""A save skips its eviction pass when this store's last one was less than `EVICT_EVERY_S` ago and the store,
by that pass and this store's saves since, stays below `EVICT_HEADROOM` x `max_bytes` (`CompileStore._room_for`)."""

_DIGEST = re.compile(r"^[0-9a-f]{32}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_ARTIFACT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_GZIP_LEVEL = 1


class EntryRefused(Exception):
    """A stored entry exists but must not be loaded (foreign key, bad checksum, bad signature, missing blob)."""


class EntryUnreadable(EntryRefused):
    """A stored entry whose manifest cannot be parsed at all (corrupt, an older format, nested past any
    sane depth): garbage that eviction removes."""


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """Where the store lives and how big it may grow."""

    location: str
    """A directory path or an fsspec URL (`s3://bucket/prefix`)."""
    max_bytes: int = DEFAULT_STORE_MAX_BYTES
    """Bound on the store's size (each stored file counted once); least recently used entries are evicted
    past it."""
    secret: bytes | None = field(default=None, repr=False)
    """HMAC key: when set, manifests are signed on save and unsigned or mis-signed ones are refused."""

    def __post_init__(self) -> None:
        if not self.location:
            raise ValueError("StoreConfig.location must name a directory or URL")
        if self.max_bytes <= 0:
            raise ValueError(f"StoreConfig.max_bytes must be > 0, got {self.max_bytes}")
        if self.secret is not None and not self.secret:
            raise ValueError("StoreConfig.secret must be non-empty when given")


@dataclass(frozen=True, kw_only=True)
class StoredFile:
    """One file of an artifact, as its entry's manifest records it."""

    sha256: str
    size: int
    mode: int = 0o644
    mtime: float = 0.0


FileSource = bytes | Path | StoredFile
"""What a file to save is: its bytes, a path (read without following a symlink), or a file the store
already holds (referenced again, not read: its blob must exist)."""


@dataclass(frozen=True, kw_only=True)
class StoreEntry:
    """A verified entry's manifest: its artifacts' files (read them with `CompileStore.read`) and metadata."""

    digest: str
    artifacts: Mapping[str, Mapping[str, StoredFile]]
    """Artifact name -> relative path -> file."""
    meta: Mapping[str, Any]
    created_ts: float

    @property
    def size_bytes(self) -> int:
        """The entry's files in all (what restoring it everywhere would write)."""
        return sum(f.size for tree in self.artifacts.values() for f in tree.values())


@dataclass(frozen=True, kw_only=True)
class SaveResult:
    """What a save stored."""

    entry_bytes: int
    """The entry's files in all."""
    num_files: int
    written_bytes: int
    """Bytes of new content this save wrote (files the store did not hold yet)."""
    num_written: int


@dataclass(frozen=True, kw_only=True)
class EntryInfo:
    """One committed entry, as listed for eviction and reports."""

    digest: str
    size_bytes: int
    used_ts: float
    created_ts: float
    user_key: str
    blobs: Mapping[str, int] = field(default_factory=dict)
    """SHA-256 -> size of every file the entry names."""


@dataclass(frozen=True, kw_only=True)
class StoreUsage:
    """What the store holds (`CompileStore.usage`)."""

    location: str
    num_entries: int
    entries_bytes: int
    """The entries' files in all, as if each entry kept its own copy."""
    stored_bytes: int
    """What the store keeps: each distinct file once."""

    def describe(self) -> str:
        return (
            f"{_human(self.stored_bytes)} in {self.num_entries} "
            f"{'entry' if self.num_entries == 1 else 'entries'} "
            f"({_human(self.entries_bytes)} of files before sharing)"
        )


def _human(num_bytes: int) -> str:
    value = float(num_bytes)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} GB"  # pragma: no cover


def _canonical(manifest: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in manifest.items() if k != "hmac"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


class _NoKernelCopy(Exception):
    """The kernel cannot copy between these files (an old kernel, another file system): read instead."""


def _copy_checked(source: int, stored: StoredFile, target: Path, *, mode: int) -> bool:
    """`CompileStore.copy_into` from the open blob `source`: copied into a temporary beside `target` and
    checked there before the rename (`atomic_fill`); False (nothing left behind) when the kernel cannot copy
    between these files."""
    if os.fstat(source).st_size != stored.size:
        raise EntryRefused(f"stored file {stored.sha256[:16]} does not match its checksum")

    def fill(out: int) -> None:
        copied = 0
        while copied < stored.size:
            try:
                n = os.copy_file_range(source, out, stored.size - copied)
            except OSError as exc:
                if copied == 0 and exc.errno in (errno.ENOSYS, errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP):
                    raise _NoKernelCopy from None
                raise
            if n == 0:
                break
            copied += n
        if copied != stored.size or _sha256_of(out, stored.size) != stored.sha256:
            raise EntryRefused(f"stored file {stored.sha256[:16]} does not match its checksum")

    try:
        atomic_fill(target, fill, mode=mode, durable=False)  # only checked bytes ever appear at `target`
    except _NoKernelCopy:
        return False
    return True


def _sha256_of(fd: int, size: int) -> str:
    if size == 0:
        return hashlib.sha256(b"").hexdigest()
    with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as view:  # the file's pages, no copy in memory
        return hashlib.sha256(view).hexdigest()


def blob_path(sha256: str, *, compressed: bool) -> str:
    """Where the blob of content `sha256` lives in the store."""
    return f"{BLOBS}/{sha256[:2]}/{sha256}{'.gz' if compressed else ''}"


def safe_relative(rel: str) -> bool:
    """Whether `rel` is a plain relative path (no absolute, `.`, `..`, empty parts or NUL)."""
    if not isinstance(rel, str) or not rel or "\0" in rel or "\\" in rel or rel.startswith("/"):
        return False
    return all(part not in ("", ".", "..") for part in rel.split("/"))


class CompileStore:
    """Save and load compile artifacts by `StoreKey` (thread-safe as far as the backend is).

    Args:
        backend: where the bytes go.
        max_bytes: size bound enforced after every save (least recently used entries go first).
        secret: HMAC key; when given, only entries signed with it are loaded.
    """

    def __init__(
        self, backend: StoreBackend, *, max_bytes: int = DEFAULT_STORE_MAX_BYTES, secret: bytes | None = None
    ):
        self.backend = backend
        self.max_bytes = max_bytes
        self._secret = secret
        self._known = KnownFiles()
        self._stored_bytes: int | None = None
        """What the store held after this store's last eviction pass, plus what its saves wrote since."""
        self._evicted_at = 0.0
        self._lock = threading.Lock()
        self._manifests: dict[str, tuple[bytes, dict[str, Any]]] = {}
        """digest -> (a manifest's bytes, parsed and verified): a save's eviction lists every entry, and
        parses only those that changed since."""
        self._infos: dict[str, tuple[dict[str, Any], EntryInfo]] = {}
        """digest -> (the parsed manifest, its entry's listing, used_ts aside)."""

    @classmethod
    def open(cls, config: StoreConfig) -> CompileStore:
        """A store for `config` (fsspec is imported only for URLs). A remote store without a secret is
        warned about once: its entries are code, and no private-directory check guards a bucket."""
        backend = open_backend(config.location)
        if config.secret is None and not isinstance(backend, LocalBackend):
            _UNSIGNED_REMOTE(os.fspath(config.location).split("://", 1)[0])
        return cls(backend, max_bytes=config.max_bytes, secret=config.secret)

    # -- saving ------------------------------------------------------------------------------------------
    def save(
        self,
        key: StoreKey,
        artifacts: Mapping[str, Mapping[str, FileSource]],
        *,
        meta: Mapping[str, Any] | None = None,
    ) -> SaveResult:
        """Commit `artifacts` (artifact name -> relative path -> bytes or a file) as the entry of `key`,
        replacing the previous one atomically; then evict least recently used entries past `max_bytes`.
        Files the store already holds (by content) are not written again."""
        listing: dict[str, dict[str, dict[str, Any]]] = {}
        written = num_written = total = num_files = 0
        with self.backend.lock(exclusive=False, wait=True):
            for name, tree in sorted(artifacts.items()):
                if not _ARTIFACT_NAME.match(name):
                    raise ValueError(f"bad artifact name {name!r}")
                files: dict[str, dict[str, Any]] = {}
                for rel, source in sorted(tree.items()):
                    if not safe_relative(rel):
                        raise ValueError(f"bad file name {rel!r} in artifact {name}")
                    if isinstance(source, StoredFile):
                        if self.missing({rel: source}):
                            raise EntryRefused(f"{name}/{rel}: its stored file is missing")
                        sha, size, mode, mtime = source.sha256, source.size, source.mode, source.mtime
                    elif (known := self._known_blob(source)) is not None:
                        sha, size, mode, mtime = known  # hashed by an earlier save, unchanged, still stored
                    else:
                        hashed_at = time.time()
                        data, mode, mtime, st = _read_source(source)
                        sha, size = hashlib.sha256(data).hexdigest(), len(data)
                        if self._put_blob(sha, data):
                            written += size
                            num_written += 1
                        del data
                        if st is not None:
                            self._known.remember(st, sha, hashed_at=hashed_at)
                    files[rel] = {"sha256": sha, "size": size, "mode": mode, "mtime": mtime}
                    total += size
                    num_files += 1
                listing[name] = files
            now = time.time()
            manifest: dict[str, Any] = {
                "schema": MANIFEST_SCHEMA,
                "digest": key.digest,
                "key": key.components(),
                "created_ts": now,
                "artifacts": listing,
                "meta": dict(meta or {}),
            }
            if self._secret is not None:
                manifest["hmac"] = hmac.new(self._secret, _canonical(manifest), hashlib.sha256).hexdigest()
            replaced = self.backend.exists(f"{key.digest}/{MANIFEST}")
            self.backend.write(f"{key.digest}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
            self._touch(key.digest, now)
        if replaced or not self._room_for(written):  # a replaced entry's own files may be unnamed now
            self.evict(keep=key.digest)
        return SaveResult(
            entry_bytes=total, num_files=num_files, written_bytes=written, num_written=num_written
        )

    def _known_blob(self, source: FileSource) -> tuple[str, int, int, float] | None:
        """(sha256, size, mode, mtime) of a file an earlier save of this store hashed and that has not changed
        since (`KnownFiles`), when its blob is still stored; None: read and hash it."""
        if not isinstance(source, Path):
            return None
        try:
            st = os.lstat(source)
        except OSError:
            return None  # the read says why
        sha = self._known.lookup(st)
        if sha is None or not self.backend.exists(blob_path(sha, compressed=self.backend.compress)):
            return None
        return sha, st.st_size, st.st_mode & 0o7777, st.st_mtime

    def _put_blob(self, sha: str, data: bytes) -> bool:
        """Store `data` as blob `sha` unless the store holds it; whether it was written."""
        path = blob_path(sha, compressed=self.backend.compress)
        if self.backend.exists(path):
            return False
        payload = zlib.compress(data, _GZIP_LEVEL, wbits=31) if self.backend.compress else data
        self.backend.write(path, payload)
        return True

    # -- loading -----------------------------------------------------------------------------------------
    def head(self, key: StoreKey) -> StoreEntry | None:
        """The verified manifest of `key`'s entry (no file is read), or None when there is none. Raises
        `EntryRefused` when one exists but was written for another key or fails its signature."""
        digest = key.digest
        manifest = self._manifest(digest)
        if manifest is None:
            return None
        if manifest.get("key") != key.components():
            raise EntryRefused(
                f"entry {digest} was written for another key ({_key_difference(manifest['key'], key)})"
            )
        self._touch(digest, time.time())
        return _entry(digest, manifest)

    def read(self, stored: StoredFile) -> bytes:
        """The bytes of one file of a verified entry, checked against its SHA-256 and size. Raises
        `EntryRefused` when the blob is missing or does not match."""
        path = blob_path(stored.sha256, compressed=self.backend.compress)
        try:
            data = self.backend.read(path)
        except FileNotFoundError:
            raise EntryRefused(f"stored file {stored.sha256[:16]} is missing") from None
        try:
            if self.backend.compress:
                data = _gunzip(data, stored.size)
            if len(data) != stored.size or hashlib.sha256(data).hexdigest() != stored.sha256:
                raise EntryRefused(f"stored file {stored.sha256[:16]} does not match its checksum")
        except EntryRefused as exc:
            raise self._drop_bad_blob(path, exc) from None
        return data

    def _drop_bad_blob(self, path: str, exc: EntryRefused) -> EntryRefused:
        """Delete a blob whose bytes are not the content its name says (damaged on disk, cut short): a save
        writes only the blobs that are missing, so a bad one left in place would be named again by every
        later save of the same file, and its entry refused at every restore, for good. Returns `exc`, its
        message saying so, to raise."""
        try:
            self.backend.delete(path)
        except (OSError, ValueError) as error:  # a read-only store: refused all the same, and kept
            logger.debug("ettr: cannot delete the damaged stored file %s (%s)", path, error)
            return exc
        return EntryRefused(f"{exc}; removed it, the next save stores it again")

    def copy_into(self, stored: StoredFile, target: Path, mode: int) -> bool:
        """Write one file of a verified entry to `target` by a kernel copy from a local store's blob (no copy
        of it through this process's memory: for a 156 MB precompiled header here, ~0.15 s of CPU instead of
        ~0.95 s to read, check and write it), whole: into a new temporary file beside `target`, whose bytes
        are checked against the SHA-256 and size before it is renamed in place. Nothing unchecked is ever
        at `target`. False when this store cannot (not a local, uncompressed one, or the kernel copy is not
        supported here): `read` it instead. Raises `EntryRefused` when the blob is missing or what was
        copied does not match; OSError (EEXIST) when something that is not a regular file is at `target`."""
        local_file = getattr(self.backend, "local_file", None)
        if local_file is None or self.backend.compress or not hasattr(os, "copy_file_range"):
            return False
        try:
            source = open_regular(local_file(blob_path(stored.sha256, compressed=False)))
        except FileNotFoundError:
            raise EntryRefused(f"stored file {stored.sha256[:16]} is missing") from None
        try:
            return _copy_checked(source, stored, target, mode=mode)
        except EntryRefused as exc:
            raise self._drop_bad_blob(blob_path(stored.sha256, compressed=False), exc) from None
        finally:
            os.close(source)

    def missing(self, files: Mapping[str, StoredFile]) -> list[str]:
        """The names among `files` whose blob the store does not hold (checked before restoring)."""
        return [
            rel
            for rel, stored in files.items()
            if not self.backend.exists(blob_path(stored.sha256, compressed=self.backend.compress))
        ]

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Hold the store's shared lock while the block reads an entry's files (eviction waits)."""
        with self.backend.lock(exclusive=False, wait=True):
            yield

    def _manifest(self, digest: str) -> dict[str, Any] | None:
        try:
            raw = self.backend.read(f"{digest}/{MANIFEST}")
        except FileNotFoundError:
            return None
        with self._lock:
            known = self._manifests.get(digest)
        if known is not None and known[0] == raw:
            return known[1]  # the same bytes, parsed, checked and verified before
        manifest = self._parse_manifest(digest, raw)
        with self._lock:
            self._manifests[digest] = (raw, manifest)
        return manifest

    def _parse_manifest(self, digest: str, raw: bytes) -> dict[str, Any]:
        try:
            manifest = json.loads(raw)
            _check_manifest(manifest, digest)
        except Exception as exc:  # anything at all in a damaged manifest: garbage, never a crash
            raise EntryUnreadable(f"entry {digest}: unreadable manifest ({type(exc).__name__})") from None
        if self._secret is not None:
            expected = hmac.new(self._secret, _canonical(manifest), hashlib.sha256).hexdigest()
            if "hmac" not in manifest:  # saved without a secret: say so, it is the usual cause
                raise EntryRefused(f"entry {digest}: manifest not signed (ETTR_COMPILE_STORE_SECRET is set)")
            if not hmac.compare_digest(str(manifest.get("hmac", "")), expected):
                raise EntryRefused(f"entry {digest}: manifest signature does not verify")
        return manifest

    # -- LRU ---------------------------------------------------------------------------------------------
    def parts_used(self, digest: str) -> dict[str, float]:
        """When each part of entry `digest` (a precompiled-header variant of the build's entry, by name) was
        last used, as `touch_part` recorded it; parts never recorded are absent. Never raises: a marker that
        cannot be read is left out."""
        used: dict[str, float] = {}
        try:
            names = self.backend.list(digest)
        except (OSError, ValueError):
            return used
        for name in names:
            part = name.removeprefix(USED_PART)
            if part == name or not _PART.match(part):
                continue
            try:
                ts = float(self.backend.read(f"{digest}/{name}")[:64])
            except (OSError, ValueError):
                continue
            if math.isfinite(ts):
                used[part] = ts
        return used

    def touch_part(self, digest: str, part: str, now: float, *, every_s: float = PART_TOUCH_EVERY_S) -> None:
        """Record that `part` of entry `digest` is used now (`<digest>/used.<part>`), unless a record less
        than `every_s` old says so already. Never raises (a read-only store keeps its old record)."""
        if not _PART.match(part):
            return
        try:
            try:
                if now - float(self.backend.read(f"{digest}/{USED_PART}{part}")[:64]) < every_s:
                    return
            except (OSError, ValueError):
                pass
            self.backend.write(f"{digest}/{USED_PART}{part}", repr(now).encode())
        except Exception as exc:
            logger.debug("ettr: cannot record use of %s in %s: %s", part, digest, exc)

    def _touch(self, digest: str, now: float, *, every_s: float = TOUCH_EVERY_S) -> None:
        try:
            try:
                if 0 <= now - float(self.backend.read(f"{digest}/{USED}")[:64]) < every_s:
                    return
            except (OSError, ValueError):
                pass
            self.backend.write(f"{digest}/{USED}", repr(now).encode())
        except Exception as exc:  # the entry is fine; only its LRU age is stale
            logger.debug("ettr: cannot record use of %s: %s", digest, exc)

    def _digests(self) -> list[str]:
        return [name for name in self.backend.list("") if _DIGEST.match(name)]

    def entries(self, *, unreadable: list[str] | None = None) -> list[EntryInfo]:
        """All committed entries that can be read (refused or half-written ones are skipped; the digests
        of those whose manifest cannot be parsed are appended to `unreadable`). Never raises for one
        entry."""
        infos = []
        digests = self._digests()
        with self._lock:  # forget what is gone
            for cache in (self._manifests, self._infos):
                for gone in set(cache) - set(digests):
                    del cache[gone]
        for digest in digests:
            try:
                manifest = self._manifest(digest)
                if manifest is None:
                    continue
                with self._lock:
                    known = self._infos.get(digest)
                if known is not None and known[0] is manifest:
                    info = known[1]
                else:
                    info = _listing(digest, manifest)
                    with self._lock:
                        self._infos[digest] = (manifest, info)
                try:
                    used_ts = float(self.backend.read(f"{digest}/{USED}"))
                    if not math.isfinite(used_ts):
                        raise ValueError("not finite")
                except (OSError, ValueError):
                    used_ts = info.created_ts
                infos.append(dataclasses.replace(info, used_ts=used_ts))
            except EntryUnreadable:
                if unreadable is not None:
                    unreadable.append(digest)
            except Exception as exc:  # refused, unreadable file, anything: skip this one, keep going
                logger.debug("ettr: compile store entry %s skipped: %s", digest, exc)
        return infos

    def usage(self) -> StoreUsage:
        """The entries and what the store keeps for them (each distinct file once)."""
        infos = self.entries()
        stored: dict[str, int] = {}
        for info in infos:
            stored.update(info.blobs)
        return StoreUsage(
            location=self.backend.describe(),
            num_entries=len(infos),
            entries_bytes=sum(i.size_bytes for i in infos),
            stored_bytes=sum(stored.values()),
        )

    def _room_for(self, num_bytes: int) -> bool:
        """Whether a save that wrote `num_bytes` of new files may skip its eviction pass: this store's last
        pass (which reads every manifest and lists every stored file: most of a small save's CPU in a big
        store) was less than `EVICT_EVERY_S` ago and, counting what its saves wrote since, the store stays
        below `EVICT_HEADROOM` of `max_bytes`. Other processes' saves evict after themselves."""
        with self._lock:
            if self._stored_bytes is None or time.monotonic() - self._evicted_at >= EVICT_EVERY_S:
                return False
            if self._stored_bytes + num_bytes > EVICT_HEADROOM * self.max_bytes:
                return False
            self._stored_bytes += num_bytes
            return True

    def evict(self, *, keep: str | None = None) -> list[str]:
        """Delete least recently used entries until the store (each file once) fits `max_bytes` (never
        `keep`), unreadable entries, and blobs no remaining entry names. Returns the digests deleted.
        Skipped (returns []) while another process saves or restores on a local store: the next save
        evicts."""
        with self.backend.lock(exclusive=True, wait=False) as held:
            if held is False:
                return []
            unreadable: list[str] = []
            infos = sorted(self.entries(unreadable=unreadable), key=lambda e: e.used_ts)
            evicted = []
            for digest in unreadable:  # garbage: never loadable, and it must not stop the rest
                if digest != keep and self._delete_quietly(digest):
                    evicted.append(digest)
            counts: dict[str, int] = {}
            sizes: dict[str, int] = {}
            for info in infos:
                for sha, size in info.blobs.items():
                    counts[sha] = counts.get(sha, 0) + 1
                    sizes[sha] = size
            total = sum(sizes.values())
            for info in infos:
                if total <= self.max_bytes:
                    break
                if info.digest == keep or not self._delete_quietly(info.digest):
                    continue
                evicted.append(info.digest)
                for sha in info.blobs:
                    counts[sha] -= 1
                    if counts[sha] == 0:
                        total -= sizes[sha]
            live = {sha for sha, count in counts.items() if count > 0}
            self._collect_garbage(live, locked=held is True)
            with self._lock:
                self._stored_bytes, self._evicted_at = total, time.monotonic()
            return evicted

    def _collect_garbage(self, live: set[str], *, locked: bool) -> None:
        """Delete the blobs no entry names (under the exclusive lock: all of them; without locks: those
        older than `UNREFERENCED_GRACE_S`)."""
        suffix = ".gz" if self.backend.compress else ""
        remove_temporaries = getattr(self.backend, "remove_temporaries", None)
        if locked and remove_temporaries is not None:  # what writers killed mid-write left (a local store)
            for folder in [*self._digests(), BLOBS, *(f"{BLOBS}/{s}" for s in self.backend.list(BLOBS))]:
                try:
                    remove_temporaries(folder)
                except (OSError, ValueError) as exc:
                    logger.debug("ettr: cannot delete temporary files in %s (%s)", folder, exc)
        for shard in self.backend.list(BLOBS):
            for name in self.backend.list(f"{BLOBS}/{shard}"):
                sha = name.removesuffix(suffix) if suffix else name
                if sha in live and name == sha + suffix:
                    continue
                path = f"{BLOBS}/{shard}/{name}"
                try:
                    if not locked:
                        age = self.backend.age_s(path)
                        if age is None or age < UNREFERENCED_GRACE_S:
                            continue
                    self.backend.delete(path)
                except (OSError, ValueError) as exc:
                    logger.debug("ettr: cannot delete unreferenced blob %s (%s)", path, exc)

    def _delete_quietly(self, digest: str) -> bool:
        try:
            self.delete(digest)
        except (OSError, ValueError) as exc:
            logger.warning("ettr: cannot evict compile store entry %s (%s)", digest, exc)
            return False
        return True

    def delete(self, digest: str) -> None:
        """Remove an entry: the manifest first (it stops existing), then what else its folder holds (its
        blobs stay until no entry names them)."""
        self.backend.delete(f"{digest}/{MANIFEST}")
        for name in self.backend.list(digest):
            self.backend.delete(f"{digest}/{name}")
        self.backend.delete(digest)


def _read_source(source: FileSource) -> tuple[bytes, int, float, os.stat_result | None]:
    """(bytes, permission bits, mtime, the file's stat taken before it was read) of a file to save."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source), 0o644, 0.0, None
    if not isinstance(source, Path):
        raise TypeError(f"cannot save a {type(source).__name__} as a file")
    data, st = read_no_follow_stat(source)
    return data, st.st_mode & 0o7777, st.st_mtime, st


RACY_S = 2.0
"""A file whose status changed less than this before it was hashed is not remembered: a change within the same
tick of its file system's coarse timestamps would leave its stat as it was (git's "racy" index entries)."""


class KnownFiles:
    """The files a store's saves hashed, by identity: (device, inode) -> (size, mtime, ctime in ns, SHA-256).

    A later save of the same unchanged file (the exit save after the settle save, a save after a recompile:
    inductor's cache directory again, of which only the new kernels are new) takes its SHA-256 from here
    instead of reading and hashing it again. Any write to a file, in place or by rename, changes its ctime
    or its inode, so a file whose stat is as remembered has the bytes that were hashed, provided its ctime
    lay `RACY_S` before the hashing began (otherwise it is hashed again next time). A blob that is missing
    by then (evicted) is read and written again. Thread-safe; bounded to `max_files` (oldest forgotten)."""

    def __init__(self, *, max_files: int = 100_000) -> None:
        self._files: dict[tuple[int, int], tuple[int, int, int, str]] = {}
        self._max_files = max_files
        self._lock = threading.Lock()

    @staticmethod
    def _state(st: os.stat_result) -> tuple[int, int, int]:
        return st.st_size, st.st_mtime_ns, st.st_ctime_ns

    def remember(self, st: os.stat_result, sha256: str, *, hashed_at: float) -> bool:
        """Remember that the file of stat `st` (taken before its read began at `hashed_at`) has content
        `sha256`, unless it changed too shortly before; whether it was remembered."""
        if not stat.S_ISREG(st.st_mode) or st.st_ctime_ns > (hashed_at - RACY_S) * 1e9:
            return False
        with self._lock:
            self._files.pop((st.st_dev, st.st_ino), None)
            while len(self._files) >= self._max_files:
                del self._files[next(iter(self._files))]
            self._files[(st.st_dev, st.st_ino)] = (*self._state(st), sha256)
        return True

    def lookup(self, st: os.stat_result) -> str | None:
        """The SHA-256 of the file of stat `st` when it is as remembered; None otherwise."""
        if not stat.S_ISREG(st.st_mode):
            return None
        with self._lock:
            known = self._files.get((st.st_dev, st.st_ino))
        if known is None or known[:3] != self._state(st):
            return None
        return known[3]


def _gunzip(data: bytes, size: int) -> bytes:
    """A gzip'd blob's content, refusing one that expands past its recorded size (a bomb)."""
    try:
        inflater = zlib.decompressobj(wbits=31)
        out = inflater.decompress(data, size + 1)
    except zlib.error as exc:
        raise EntryRefused(f"a stored file cannot be decompressed ({exc})") from None
    if len(out) > size or not inflater.eof:
        raise EntryRefused("a stored file expands past its recorded size")
    return out


def _key_difference(stored: Mapping[str, str], key: StoreKey, *, max_chars: int = 80) -> str:
    """What differs between a stored entry's key and `key`, for the refusal's one line (`torch_version
    '2.12.0' here '2.13.0'`); each value cut to `max_chars` (a manifest is untrusted)."""
    expected = key.components()

    def shown(value: object) -> str:
        text = repr(value)
        return text if len(text) <= max_chars else text[: max_chars - 3] + "..."

    differ = [
        f"{name} {shown(stored.get(name))} here {shown(expected.get(name))}"
        for name in sorted(set(stored) | set(expected))
        if stored.get(name) != expected.get(name)
    ]
    return "; ".join(differ[:4]) + (f"; {len(differ) - 4} more" if len(differ) > 4 else "")


def _check_manifest(manifest: Any, digest: str) -> None:
    """Raise (anything) unless `manifest` is a well-formed schema-2 manifest of entry `digest`."""
    if not isinstance(manifest, dict):
        raise TypeError("not an object")
    if manifest.get("schema") != MANIFEST_SCHEMA or manifest.get("digest") != digest:
        raise ValueError("unknown schema or digest")
    key = manifest["key"]
    if not isinstance(key, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in key.items()
    ):
        raise TypeError("key is not an object of strings")
    created = manifest["created_ts"]
    if type(created) not in (int, float) or not math.isfinite(created):
        raise ValueError("bad created_ts")
    if not isinstance(manifest.get("meta", {}), dict):
        raise TypeError("meta is not an object")
    artifacts = manifest["artifacts"]
    if not isinstance(artifacts, dict):
        raise TypeError("artifacts is not an object")
    for name, files in artifacts.items():
        if not isinstance(name, str) or not _ARTIFACT_NAME.match(name) or not isinstance(files, dict):
            raise ValueError("bad artifact")
        for rel, info in files.items():
            if not safe_relative(rel) or not isinstance(info, dict):
                raise ValueError("bad file name")
            if not isinstance(info.get("sha256"), str) or not _SHA256.match(info["sha256"]):
                raise ValueError("bad sha256")
            size, mode, mtime = info.get("size"), info.get("mode", 0o644), info.get("mtime", 0.0)
            if type(size) is not int or size < 0 or type(mode) is not int or not 0 <= mode <= 0o7777:
                raise ValueError("bad size or mode")
            if type(mtime) not in (int, float) or not math.isfinite(mtime):
                raise ValueError("bad mtime")


def _listing(digest: str, manifest: Mapping[str, Any]) -> EntryInfo:
    """An entry's listing for eviction and reports (its `used_ts`: its creation)."""
    entry = _entry(digest, manifest)
    return EntryInfo(
        digest=digest,
        size_bytes=entry.size_bytes,
        used_ts=entry.created_ts,
        created_ts=entry.created_ts,
        user_key=str(manifest["key"].get("user_key", "")),
        blobs={f.sha256: f.size for tree in entry.artifacts.values() for f in tree.values()},
    )


def _entry(digest: str, manifest: Mapping[str, Any]) -> StoreEntry:
    artifacts = {
        name: {
            rel: StoredFile(
                sha256=info["sha256"],
                size=info["size"],
                mode=info.get("mode", 0o644),
                mtime=float(info.get("mtime", 0.0)),
            )
            for rel, info in files.items()
        }
        for name, files in manifest["artifacts"].items()
    }
    return StoreEntry(
        digest=digest,
        artifacts=artifacts,
        meta=dict(manifest.get("meta", {})),
        created_ts=float(manifest["created_ts"]),
    )
