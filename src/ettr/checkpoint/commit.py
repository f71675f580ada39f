"""The commit protocol: a checkpoint is visible only once its manifest, written last, says so.

A checkpoint is the directory `step_<N>` under the root. Its data files are written and made durable
first; then `ettr-manifest.json` — the size and CRC-32 of every file, and a CRC-32 of the manifest itself —
is written to a temporary name, fsync'd, and renamed into place (the directory fsync'd after). So:

* a directory without a manifest is incomplete (a crash mid-persist) and is never loaded;
* "latest" is the newest directory whose manifest verifies: it parses, its own checksum matches, and every
  file it lists has the recorded size (and, by default, CRC-32); newer ones that fail are skipped with a
  warning naming them, and the previous one is used;
* retention keeps the newest `keep_last` committed checkpoints, deletes older committed ones and abandoned
  incomplete ones, and never deletes the newest committed one, one that may still be in flight, or one a
  reader holds a lease on.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import logging
import os
import socket
import time
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ettr.checkpoint.base import (
    MANIFEST_NAME,
    CheckpointInvalid,
    CheckpointStorage,
    describe_os_error,
    iter_chunks,
    parse_step_dir,
    step_dir_name,
)

logger = logging.getLogger("ettr")

MANIFEST_FORMAT = "ettr.checkpoint/1"
LEASE_PREFIX = ".ettr-lease-"
_PICKLED_SUFFIXES = (".metadata",)
"""Files that are unpickled on load: always checksummed before a load, whatever `checksums` says."""
TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR})
"""I/O errors retried (bounded, with back-off) before a checkpoint is declared unreadable."""
VERIFY_ATTEMPTS = 4


@dataclass(frozen=True, kw_only=True)
class FileEntry:
    """One data file of a checkpoint, as the manifest records it."""

    size: int
    crc32: int


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """The commit record of one checkpoint."""

    step: int
    files: dict[str, FileEntry]
    created_ts: float
    world_size: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return step_dir_name(self.step)

    @property
    def num_bytes(self) -> int:
        return sum(entry.size for entry in self.files.values())

    def to_json(self, secret: bytes | None = None) -> bytes:
        """The manifest's bytes; with `secret`, signed (an HMAC-SHA256 of the body, under the CRC)."""
        body: dict[str, Any] = {
            "format": MANIFEST_FORMAT,
            "step": self.step,
            "created_ts": self.created_ts,
            "world_size": self.world_size,
            "files": {name: {"size": e.size, "crc32": e.crc32} for name, e in sorted(self.files.items())},
            "extra": self.extra,
        }
        if secret is not None:
            body["hmac"] = _body_hmac(body, secret)
        body["manifest_crc32"] = _body_crc(body)
        return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, secret: bytes | None = None) -> Manifest:
        """Parse and self-check a manifest; with `secret`, also check its signature. Raises
        CheckpointInvalid (an unsigned manifest is refused when a key is given)."""
        try:
            body = json.loads(data)
            claimed = body.pop("manifest_crc32")
            if body.get("format") != MANIFEST_FORMAT:
                raise CheckpointInvalid(f"unknown manifest format {body.get('format')!r}")
            if claimed != _body_crc(body):
                raise CheckpointInvalid("the manifest's own checksum does not match (corrupt manifest)")
            if secret is not None:
                signature = body.pop("hmac", None)
                if not isinstance(signature, str) or not hmac.compare_digest(
                    signature, _body_hmac(body, secret)
                ):
                    raise CheckpointInvalid(
                        "the manifest's HMAC does not verify with this job's key (unsigned or forged)"
                    )
            files = {
                str(name): FileEntry(size=int(e["size"]), crc32=int(e["crc32"]))
                for name, e in body["files"].items()
            }
            return cls(
                step=int(body["step"]),
                files=files,
                created_ts=float(body["created_ts"]),
                world_size=int(body.get("world_size", 1)),
                extra=dict(body.get("extra") or {}),
            )
        except CheckpointInvalid:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointInvalid(f"unreadable manifest ({type(exc).__name__}: {exc})") from None


def _body_crc(body: dict[str, Any]) -> int:
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _body_hmac(body: dict[str, Any], secret: bytes) -> str:
    unsigned = {k: v for k, v in body.items() if k not in ("hmac", "manifest_crc32")}
    canonical = json.dumps(unsigned, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(secret, canonical, hashlib.sha256).hexdigest()


def file_crc32(storage: CheckpointStorage, rel: str) -> tuple[int, int]:
    """(size, CRC-32) of one stored file, read in chunks (zlib releases the GIL while it sums)."""
    crc, size = 0, 0
    with storage.open_read(rel) as stream:
        for chunk in iter_chunks(stream):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc


def commit(
    storage: CheckpointStorage,
    step: int,
    file_names: Iterable[str],
    *,
    world_size: int = 1,
    extra: dict[str, Any] | None = None,
    fault_hook: Callable[[str], None] | None = None,
    secret: bytes | None = None,
) -> Manifest:
    """Make the checkpoint of `step` visible: sum its files, then write its manifest durably, last.

    Call only after every file in `file_names` is complete and durable. Returns the manifest written
    (signed with `secret` when given).
    """
    hook = fault_hook or (lambda point: None)
    name = step_dir_name(step)
    storage.make_durable(name)  # the data files' names and the directory's own entry
    files = {}
    for file_name in sorted(set(file_names)):
        size, crc = file_crc32(storage, f"{name}/{file_name}")
        files[file_name] = FileEntry(size=size, crc32=crc)
    manifest = Manifest(
        step=step, files=files, created_ts=time.time(), world_size=world_size, extra=dict(extra or {})
    )
    hook("manifest_begin")
    storage.write_atomic(
        f"{name}/{MANIFEST_NAME}", manifest.to_json(secret), on_partial=lambda: hook("manifest_partial")
    )
    hook("manifest_renamed")
    return manifest


def verify(
    storage: CheckpointStorage, name: str, *, checksums: bool = True, secret: bytes | None = None
) -> Manifest:
    """The manifest of checkpoint directory `name` if the checkpoint is complete and intact.

    Raises CheckpointInvalid saying what is wrong (no manifest, corrupt or, with `secret`, unsigned or
    forged manifest, a missing, truncated or changed file). Pickled files (DCP's `.metadata`) have their
    CRC-32 checked even without `checksums`.
    """
    step = parse_step_dir(name)
    if step is None:
        raise CheckpointInvalid(f"{name!r} is not a checkpoint directory name")
    try:
        raw = storage.read_bytes(f"{name}/{MANIFEST_NAME}")
    except FileNotFoundError:
        raise CheckpointInvalid("no manifest (incomplete: the save never committed)") from None
    manifest = Manifest.from_json(raw, secret)
    if manifest.step != step:
        raise CheckpointInvalid(f"the manifest is for step {manifest.step}, not {step}")
    if not manifest.files:
        raise CheckpointInvalid("the manifest lists no files")
    present = storage.list_dir(name)
    for file_name, entry in manifest.files.items():
        size = present.get(file_name, -1)
        if size is None or size < 0:
            raise CheckpointInvalid(f"{file_name} is missing")
        if size != entry.size:
            raise CheckpointInvalid(
                f"{file_name} has {size} bytes, the manifest says {entry.size} (truncated?)"
            )
    for file_name, entry in manifest.files.items():
        if checksums or file_name.endswith(_PICKLED_SUFFIXES):
            size, crc = file_crc32(storage, f"{name}/{file_name}")
            if size != entry.size or crc != entry.crc32:
                raise CheckpointInvalid(f"{file_name} fails its CRC-32 check (corrupt data)")
    return manifest


@dataclass(frozen=True)
class CheckpointDir:
    """A `step_<N>` directory under the root, as listed (not verified)."""

    step: int
    name: str
    has_manifest: bool


def list_checkpoints(storage: CheckpointStorage) -> list[CheckpointDir]:
    """Every checkpoint directory under the root, oldest step first."""
    found = []
    for entry, size in storage.list_dir("").items():
        step = parse_step_dir(entry)
        if step is None or size is not None:
            continue
        has_manifest = MANIFEST_NAME in storage.list_dir(entry)
        found.append(CheckpointDir(step=step, name=entry, has_manifest=has_manifest))
    return sorted(found, key=lambda c: c.step)


@dataclass(frozen=True)
class Resolution:
    """What `find_latest` found: the checkpoint to resume from (None: none usable) and what it skipped."""

    latest: Manifest | None
    skipped: tuple[tuple[str, str], ...] = ()
    """(directory name, reason) of each newer directory that was not usable."""


def find_latest(
    storage: CheckpointStorage,
    *,
    checksums: bool = True,
    at_most: int | None = None,
    secret: bytes | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> Resolution:
    """The newest checkpoint that verifies (at step <= `at_most` if given; signed with `secret` if given).

    Each newer directory that does not verify is skipped with a warning naming it and the reason. A
    transient I/O error (EIO, EAGAIN, ETIMEDOUT) is retried with back-off before the directory is skipped.
    """
    skipped: list[tuple[str, str]] = []
    for ckpt in reversed(list_checkpoints(storage)):
        if at_most is not None and ckpt.step > at_most:
            continue
        try:
            manifest = _verify_retrying(storage, ckpt.name, checksums=checksums, secret=secret, sleep=sleep)
        except CheckpointInvalid as exc:
            logger.warning(
                "ettr: skipping checkpoint %s in %s: %s; trying an older one", ckpt.name, storage.url, exc
            )
            skipped.append((ckpt.name, str(exc)))
            continue
        except OSError as exc:
            logger.warning(
                "ettr: skipping checkpoint %s in %s: cannot read it (%s)", ckpt.name, storage.url, exc
            )
            skipped.append((ckpt.name, f"unreadable: {describe_os_error(exc)}"))
            continue
        return Resolution(manifest, tuple(skipped))
    return Resolution(None, tuple(skipped))


def _verify_retrying(
    storage: CheckpointStorage,
    name: str,
    *,
    checksums: bool,
    secret: bytes | None,
    sleep: Callable[[float], None],
) -> Manifest:
    delay = 0.05
    for attempt in range(1, VERIFY_ATTEMPTS + 1):
        try:
            return verify(storage, name, checksums=checksums, secret=secret)
        except OSError as exc:
            if attempt == VERIFY_ATTEMPTS or exc.errno not in TRANSIENT_ERRNOS:
                raise
            logger.warning(
                "ettr: reading checkpoint %s: transient error (%s); retry %d of %d",
                name,
                describe_os_error(exc),
                attempt,
                VERIFY_ATTEMPTS - 1,
            )
            sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")  # pragma: no cover


# -- readers' leases --------------------------------------------------------------------------------------


def _lease_is_live(storage: CheckpointStorage, rel: str, now_s: float, ttl_s: float) -> bool:
    try:
        taken_ts = float(json.loads(storage.read_bytes(rel))["ts"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return False
    return now_s - taken_ts < ttl_s


def is_leased(storage: CheckpointStorage, name: str, *, ttl_s: float, now_s: float | None = None) -> bool:
    """Whether a reader holds a live lease on checkpoint directory `name`."""
    now_s = time.time() if now_s is None else now_s
    return any(
        _lease_is_live(storage, f"{name}/{entry}", now_s, ttl_s)
        for entry in storage.list_dir(name)
        if entry.startswith(LEASE_PREFIX)
    )


@contextlib.contextmanager
def lease(storage: CheckpointStorage, name: str) -> Iterator[None]:
    """Hold a lease on checkpoint `name` while the block runs: retention (in any process) will not delete it.

    A lease that cannot be written (read-only storage) is skipped with a debug message.
    """
    rel = f"{name}/{LEASE_PREFIX}{uuid.uuid4().hex}"
    body = json.dumps({"ts": time.time(), "pid": os.getpid(), "host": socket.gethostname()}).encode()
    try:
        storage.write_atomic(rel, body)
        taken = True
    except OSError as exc:
        logger.debug("ettr: cannot take a lease on %s (%s)", name, exc)
        taken = False
    try:
        yield
    finally:
        if taken:
            with contextlib.suppress(OSError):
                storage.remove(rel)


# -- retention --------------------------------------------------------------------------------------------


def apply_retention(
    storage: CheckpointStorage,
    keep_last: int,
    *,
    protected_steps: Iterable[int] = (),
    lease_ttl_s: float = 3600.0,
    now_s: float | None = None,
) -> list[str]:
    """Delete what is no longer needed; returns the names deleted.

    Keeps the newest `keep_last` (>= 1) committed checkpoints, every directory newer than the newest
    committed one (a save may be writing it), `protected_steps` (being loaded here) and leased ones.
    Deletes older committed checkpoints and incomplete directories older than the newest committed one.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    now_s = time.time() if now_s is None else now_s
    protected = set(protected_steps)
    checkpoints = list_checkpoints(storage)
    committed = [c for c in checkpoints if c.has_manifest]
    if not committed:
        return []
    keep = {c.step for c in committed[-keep_last:]}
    newest = committed[-1].step
    removed = []
    for ckpt in checkpoints:
        if ckpt.step in keep or ckpt.step in protected or ckpt.step >= newest:
            continue
        if is_leased(storage, ckpt.name, ttl_s=lease_ttl_s, now_s=now_s):
            logger.info("ettr: keeping checkpoint %s: a reader holds a lease on it", ckpt.name)
            continue
        try:
            storage.remove_tree(ckpt.name)
        except OSError as exc:
            logger.warning("ettr: cannot delete old checkpoint %s (%s)", ckpt.name, exc)
            continue
        removed.append(ckpt.name)
    return removed


def quarantine(storage: CheckpointStorage, name: str) -> str | None:
    """Move a corrupt or abandoned checkpoint aside (`<name>.bad-<unix time>`) so that its step can be
    saved again; it is kept for inspection and never loaded or deleted by ettr. Returns the new name."""
    new_name = f"{name}.bad-{int(time.time())}"
    try:
        storage.rename(name, new_name)
    except OSError as exc:
        logger.warning("ettr: cannot move checkpoint %s aside (%s); deleting it", name, exc)
        with contextlib.suppress(OSError):
            storage.remove_tree(name)
        return None
    return new_name
