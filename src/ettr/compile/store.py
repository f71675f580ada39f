"""The compile artifact store: keyed entries, written atomically, verified before loading, LRU-bounded.

Layout under the store root (any `StoreBackend`):

    <digest>/<name>-<sha16>   artifact blobs (content-named, so a new save never overwrites a live one)
    <digest>/manifest.json    the commit marker, written last: key components, blob names, SHA-256, sizes
    <digest>/used             Unix time of the last save or load (least-recently-used eviction)

An entry exists once its manifest does. Loading reads the manifest, refuses it unless its key
components equal the expected ones (and, with a secret, unless its HMAC verifies), then checks every
blob against its SHA-256. Artifacts are compiled code, so anything that does not verify is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ettr.compile.backend import StoreBackend, open_backend
from ettr.compile.key import StoreKey
from ettr.constants import DEFAULT_STORE_MAX_BYTES

logger = logging.getLogger("ettr")

MANIFEST_SCHEMA = "ettr.compile-store/1"
MANIFEST = "manifest.json"
USED = "used"


class EntryRefused(Exception):
    """A stored entry exists but must not be loaded (foreign key, bad checksum, bad signature)."""


class EntryUnreadable(EntryRefused):
    """A stored entry whose manifest cannot be parsed at all (corrupt, nested past any sane depth):
    garbage that eviction removes."""


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """Where the store lives and how big it may grow."""

    location: str
    """A directory path or an fsspec URL (`s3://bucket/prefix`)."""
    max_bytes: int = DEFAULT_STORE_MAX_BYTES
    """Bound on the total size of all entries; least recently used entries are evicted past it."""
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
class EntryInfo:
    """One committed entry, as listed for eviction and reports."""

    digest: str
    size_bytes: int
    used_ts: float
    created_ts: float
    user_key: str


@dataclass(frozen=True, kw_only=True)
class StoreEntry:
    """A verified entry: its artifacts by name, and the metadata saved with them."""

    digest: str
    files: Mapping[str, bytes]
    """The artifacts loaded (all of them, or those asked for)."""
    available: frozenset[str]
    """Names of every artifact in the entry, loaded or not."""
    meta: Mapping[str, Any]
    created_ts: float

    @property
    def size_bytes(self) -> int:
        return sum(len(b) for b in self.files.values())


def _canonical(manifest: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in manifest.items() if k != "hmac"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


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

    @classmethod
    def open(cls, config: StoreConfig) -> CompileStore:
        """A store for `config` (fsspec is imported only for URLs)."""
        return cls(open_backend(config.location), max_bytes=config.max_bytes, secret=config.secret)

    # -- saving ------------------------------------------------------------------------------------------
    def save(
        self, key: StoreKey, files: Mapping[str, bytes], *, meta: Mapping[str, Any] | None = None
    ) -> int:
        """Commit `files` (name -> bytes) as the entry of `key`, replacing the previous one atomically;
        then evict least recently used entries past `max_bytes`. Returns the entry's size in bytes."""
        digest = key.digest
        blobs: dict[str, dict[str, Any]] = {}
        for name, data in sorted(files.items()):
            if not name or "/" in name or name in (MANIFEST, USED):
                raise ValueError(f"bad artifact name {name!r}")
            sha = hashlib.sha256(data).hexdigest()
            blob = f"{name}-{sha[:16]}"
            self.backend.write(f"{digest}/{blob}", data)
            blobs[name] = {"blob": blob, "sha256": sha, "size_bytes": len(data)}
        now = time.time()
        manifest: dict[str, Any] = {
            "schema": MANIFEST_SCHEMA,
            "digest": digest,
            "key": key.components(),
            "created_ts": now,
            "files": blobs,
            "meta": dict(meta or {}),
        }
        if self._secret is not None:
            manifest["hmac"] = hmac.new(self._secret, _canonical(manifest), hashlib.sha256).hexdigest()
        self.backend.write(f"{digest}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
        self._touch(digest, now)
        # Blobs of the replaced manifest are garbage now; a reader still holding it fails its check (a miss).
        live = {b["blob"] for b in blobs.values()} | {MANIFEST, USED}
        for name in self.backend.list(digest):
            if name not in live:
                self.backend.delete(f"{digest}/{name}")
        self.evict(keep=digest)
        return sum(b["size_bytes"] for b in blobs.values())

    # -- loading -----------------------------------------------------------------------------------------
    def load(self, key: StoreKey, *, names: set[str] | None = None) -> StoreEntry | None:
        """The verified entry of `key` (only the artifacts in `names`, when given), or None when there is
        none. Raises `EntryRefused` when one exists but fails any check."""
        digest = key.digest
        manifest = self._manifest(digest)
        if manifest is None:
            return None
        if manifest.get("key") != key.components():
            raise EntryRefused(f"entry {digest} was written for another key: {manifest.get('key')}")
        wanted = (
            manifest["files"]
            if names is None
            else {n: manifest["files"][n] for n in names & set(manifest["files"])}
        )
        files: dict[str, bytes] = {}
        for name, info in wanted.items():
            try:
                data = self.backend.read(f"{digest}/{info['blob']}")
            except FileNotFoundError:
                raise EntryRefused(f"entry {digest}: artifact {name} is missing") from None
            if len(data) != info["size_bytes"] or hashlib.sha256(data).hexdigest() != info["sha256"]:
                raise EntryRefused(f"entry {digest}: artifact {name} does not match its checksum")
            files[name] = data
        self._touch(digest, time.time())
        return StoreEntry(
            digest=digest,
            files=files,
            available=frozenset(manifest["files"]),
            meta=manifest.get("meta", {}),
            created_ts=manifest["created_ts"],
        )

    def _manifest(self, digest: str) -> dict[str, Any] | None:
        try:
            raw = self.backend.read(f"{digest}/{MANIFEST}")
        except FileNotFoundError:
            return None
        try:
            manifest = json.loads(raw)
            if manifest.get("schema") != MANIFEST_SCHEMA or manifest.get("digest") != digest:
                raise ValueError("unknown schema or digest")
            for info in manifest["files"].values():
                if not isinstance(info["blob"], str) or "/" in info["blob"]:
                    raise ValueError("bad blob name")
                int(info["size_bytes"]), str(info["sha256"])
            float(manifest["created_ts"])
            if not isinstance(manifest.get("key", {}), dict):
                raise ValueError("key is not an object")
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise EntryUnreadable(f"entry {digest}: unreadable manifest ({type(exc).__name__})") from None
        if self._secret is not None:
            expected = hmac.new(self._secret, _canonical(manifest), hashlib.sha256).hexdigest()
            if not hmac.compare_digest(str(manifest.get("hmac", "")), expected):
                raise EntryRefused(f"entry {digest}: manifest signature does not verify")
        return manifest

    # -- LRU ---------------------------------------------------------------------------------------------
    def _touch(self, digest: str, now: float) -> None:
        try:
            self.backend.write(f"{digest}/{USED}", repr(now).encode())
        except Exception as exc:  # the entry is fine; only its LRU age is stale
            logger.debug("ettr: cannot record use of %s: %s", digest, exc)

    def entries(self, *, unreadable: list[str] | None = None) -> list[EntryInfo]:
        """All committed entries that can be read (refused or half-written ones are skipped; the digests
        of those whose manifest cannot be parsed are appended to `unreadable`)."""
        infos = []
        for digest in self.backend.list(""):
            try:
                manifest = self._manifest(digest)
            except EntryUnreadable:
                if unreadable is not None:
                    unreadable.append(digest)
                continue
            except (EntryRefused, OSError, ValueError) as exc:
                logger.debug("ettr: compile store entry %s skipped: %s", digest, exc)
                continue
            if manifest is None:
                continue
            try:
                used_ts = float(self.backend.read(f"{digest}/{USED}"))
            except (OSError, ValueError):
                used_ts = float(manifest["created_ts"])
            infos.append(
                EntryInfo(
                    digest=digest,
                    size_bytes=sum(int(f["size_bytes"]) for f in manifest["files"].values()),
                    used_ts=used_ts,
                    created_ts=float(manifest["created_ts"]),
                    user_key=str(manifest.get("key", {}).get("user_key", "")),
                )
            )
        return infos

    def evict(self, *, keep: str | None = None) -> list[str]:
        """Delete least recently used entries until the total is within `max_bytes` (never `keep`).
        Returns the digests deleted."""
        unreadable: list[str] = []
        infos = sorted(self.entries(unreadable=unreadable), key=lambda e: e.used_ts)
        evicted = []
        for digest in unreadable:  # garbage: never loadable, and it must not stop the rest
            if digest != keep and self._delete_quietly(digest):
                evicted.append(digest)
        total = sum(e.size_bytes for e in infos)
        for info in infos:
            if total <= self.max_bytes:
                break
            if info.digest == keep:
                continue
            if self._delete_quietly(info.digest):
                total -= info.size_bytes
                evicted.append(info.digest)
        return evicted

    def _delete_quietly(self, digest: str) -> bool:
        try:
            self.delete(digest)
        except (OSError, ValueError) as exc:
            logger.warning("ettr: cannot evict compile store entry %s (%s)", digest, exc)
            return False
        return True

    def delete(self, digest: str) -> None:
        """Remove an entry: the manifest first (it stops existing), then its blobs."""
        self.backend.delete(f"{digest}/{MANIFEST}")
        for name in self.backend.list(digest):
            self.backend.delete(f"{digest}/{name}")
        self.backend.delete(digest)
