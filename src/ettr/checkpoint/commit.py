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
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ettr.checkpoint.base import (
    MANIFEST_NAME,
    CheckpointError,
    CheckpointInvalid,
    CheckpointRefused,
    CheckpointStorage,
    ReadableStorage,
    describe_error,
    describe_os_error,
    iter_chunks,
    parse_step_dir,
    step_dir_name,
)
from ettr.checkpoint.checksums import crc32
from ettr.checkpoint.keys import key_id
from ettr.untrusted import whole_number

logger = logging.getLogger("ettr")

MANIFEST_FORMAT = "ettr.checkpoint/1"
LEASE_PREFIX = ".ettr-lease-"
_PICKLED_SUFFIXES = (".metadata",)
"""Files that are unpickled on load: always checksummed before a load, whatever `checksums` says."""
TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR})
"""I/O errors retried (bounded, with back-off) before a checkpoint is declared unreadable."""
VERIFY_ATTEMPTS = 4
MAX_MANIFEST_BYTES = 64 << 20
"""A manifest larger than this is damage or a forgery (one is about 100 bytes a file: 64 MiB lists over
half a million files): it is refused unread, never read whole into a training rank's memory."""
MAX_LEASE_BYTES = 4096
METADATA_MAX_BYTES_ENV = "ETTR_CHECKPOINT_METADATA_MAX_BYTES"
DEFAULT_METADATA_MAX_BYTES = 256 << 20
"""The most of a pickled file (DCP's `.metadata`) ettr reads (`METADATA_MAX_BYTES_ENV` sets another): it is read
whole into memory, then unpickled, before the checkpoint loads. DCP's index of a job's checkpoint is a few MB
(about 100 bytes a stored chunk: 256 MiB is over two million chunks); an unsigned root's manifest and
`.metadata` may be anyone's, and a forged 2 GB one was read whole into the rank (its peak memory 0.36 -> 2.35 GB)."""


def metadata_max_bytes() -> int:
    """The bound on a `.metadata` (`METADATA_MAX_BYTES_ENV`, bytes; the default where unset or not a positive
    whole number)."""
    value = whole_number(os.environ.get(METADATA_MAX_BYTES_ENV, "").strip())
    return value if value else DEFAULT_METADATA_MAX_BYTES


"""A reader's lease is one short JSON object; anything larger is not one."""


@dataclass(frozen=True, kw_only=True)
class FileEntry:
    """One data file of a checkpoint, as the manifest records it."""

    size: int
    crc32: int


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """The commit record of one checkpoint: its files, and who wrote it where (job, root, signing key)."""

    step: int
    files: dict[str, FileEntry]
    created_ts: float
    world_size: int = 1
    extra: dict[str, Any] = field(default_factory=dict)
    job_id: str | None = None
    """The job that wrote it (None: not recorded, as by ettr before it named jobs)."""
    root: str | None = None
    """The checkpoint root it was written into (`root_identity`; None: not recorded)."""
    key_id: str | None = None
    """The id of the key that signed it (`keys.key_id`; None: unsigned, or signed without an id)."""
    signature: str | None = field(default=None, repr=False)
    """Its HMAC-SHA256 (hex), as read; checked by `admission`, or by `from_json` given a key."""
    signed_body: bytes = field(default=b"", repr=False, compare=False)
    """The canonical bytes the signature covers."""
    digest: str = field(default="", compare=False)
    """SHA-256 of the manifest file's bytes (which manifest was admitted, for the other ranks)."""

    @property
    def name(self) -> str:
        return step_dir_name(self.step)

    @property
    def num_bytes(self) -> int:
        return sum(entry.size for entry in self.files.values())

    def to_json(self, secret: bytes | None = None) -> bytes:
        """The manifest's bytes; with `secret`, signed (an HMAC-SHA256 of the body, the key's id in it)."""
        body: dict[str, Any] = {
            "format": MANIFEST_FORMAT,
            "step": self.step,
            "created_ts": self.created_ts,
            "world_size": self.world_size,
            "files": {name: {"size": e.size, "crc32": e.crc32} for name, e in sorted(self.files.items())},
            "extra": self.extra,
        }
        if self.job_id is not None:
            body["job_id"] = self.job_id
        if self.root is not None:
            body["root"] = self.root
        if secret is not None:
            body["key_id"] = key_id(secret)
            body["hmac"] = _body_hmac(body, secret)
        body["manifest_crc32"] = _body_crc(body)
        return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()

    def signed_with(self, key: bytes) -> bool:
        """Whether the signature read is the HMAC of its body under `key`."""
        if not isinstance(self.signature, str):
            return False
        expected = hmac.new(key, self.signed_body, hashlib.sha256).hexdigest()
        return hmac.compare_digest(self.signature, expected)

    @classmethod
    def from_json(cls, data: bytes, secret: bytes | None = None) -> Manifest:
        """Parse and self-check a manifest; with `secret`, also check that it is signed with that key.
        Raises CheckpointInvalid (an unsigned manifest is refused when a key is given)."""
        try:
            body = json.loads(data)
            if not isinstance(body, dict):
                raise TypeError("not a JSON object")
            claimed = body.pop("manifest_crc32")
            if body.get("format") != MANIFEST_FORMAT:
                raise CheckpointInvalid(f"unknown manifest format {body.get('format')!r}")
            if claimed != _body_crc(body):
                raise CheckpointInvalid("the manifest's own checksum does not match (corrupt manifest)")
            signature = body.get("hmac")
            files = {
                str(name): FileEntry(size=_count(e["size"]), crc32=_count(e["crc32"]))
                for name, e in body["files"].items()
            }
            manifest = cls(
                step=_count(body["step"]),
                files=files,
                created_ts=float(body["created_ts"]),
                world_size=_count(body.get("world_size", 1)),
                extra=dict(body.get("extra") or {}),
                job_id=_optional_text(body.get("job_id")),
                root=_optional_text(body.get("root")),
                key_id=_optional_text(body.get("key_id")),
                signature=signature if isinstance(signature, str) else None,
                signed_body=_canonical_unsigned(body),
                digest=hashlib.sha256(data).hexdigest(),
            )
        except CheckpointInvalid:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError) as exc:
            # OverflowError: a created_ts of 10**400 (no key needed: the CRC is anyone's) stopped every
            # attempt's restore, whatever the root's signatures
            raise CheckpointInvalid(f"unreadable manifest ({type(exc).__name__}: {exc})") from None
        if secret is not None and not manifest.signed_with(secret):
            raise CheckpointInvalid(
                "the manifest's HMAC does not verify with this job's key (unsigned or forged)"
            )
        return manifest


def read_at_most(storage: ReadableStorage, rel: str, max_bytes: int) -> bytes:
    """The bytes of file `rel`, refused (CheckpointInvalid) past `max_bytes` without reading the rest: the
    one way to read a small file of a checkpoint root (a manifest, a lease), which whoever writes the root
    may have made a 10 GB sparse file. Raises FileNotFoundError, other OSErrors as met."""
    with storage.open_read(rel) as stream:
        data = stream.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise CheckpointInvalid(f"{rel} is larger than {max_bytes} bytes (damaged or forged)")
    return data


def read_manifest_bytes(storage: ReadableStorage, name: str) -> bytes:
    """The bytes of checkpoint directory `name`'s manifest, at most `MAX_MANIFEST_BYTES` (`read_at_most`)."""
    return read_at_most(storage, f"{name}/{MANIFEST_NAME}", MAX_MANIFEST_BYTES)


def _count(value: Any) -> int:
    """A non-negative integer from JSON (not a bool, not a float)."""
    if type(value) is not int or value < 0:
        raise ValueError(f"{value!r} is not a non-negative integer")
    return value


def _optional_text(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is not a string")
    return value


def _body_crc(body: dict[str, Any]) -> int:
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _canonical_unsigned(body: dict[str, Any]) -> bytes:
    unsigned = {k: v for k, v in body.items() if k not in ("hmac", "manifest_crc32")}
    return json.dumps(unsigned, sort_keys=True, separators=(",", ":")).encode()


def _body_hmac(body: dict[str, Any], secret: bytes) -> str:
    return hmac.new(secret, _canonical_unsigned(body), hashlib.sha256).hexdigest()


def root_identity(url: str) -> str:
    """How a manifest names its root: the real path of a local root (symlinks resolved), else its URL."""
    if "://" in url and not url.startswith("file://"):
        return url.rstrip("/")
    return os.path.realpath(url.removeprefix("file://"))


def file_crc32(storage: ReadableStorage, rel: str) -> tuple[int, int]:
    """(size, CRC-32) of one stored file, read in chunks (`checksums.crc32`: the GIL is released while it sums)."""
    crc, size = 0, 0
    with storage.open_read(rel) as stream:
        for chunk in iter_chunks(stream):
            crc = crc32(chunk, crc)
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
    job_id: str | None = None,
    sums: Mapping[str, tuple[int, int]] | None = None,
) -> Manifest:
    """Make the checkpoint of `step` visible: sum its files, then write its manifest durably, last.

    Call only after every file in `file_names` is complete and durable. `sums`: (size, CRC-32) of files
    as they were written (`checksums.Sums`); those are not read back, only their size on storage is
    checked (CheckpointError where it differs); every other file is read and summed here. Returns the
    manifest written (naming `job_id` and this root; signed with `secret` when given).
    """
    hook = fault_hook or (lambda point: None)
    name = step_dir_name(step)
    storage.make_durable(name)  # the data files' names and the directory's own entry
    sums = sums or {}
    stored = storage.list_dir(name) if sums else {}
    files = {}
    for file_name in sorted(set(file_names)):
        if file_name in sums:
            size, crc = sums[file_name]
            if stored.get(file_name) != size:
                raise CheckpointError(
                    f"{name}/{file_name} has {stored.get(file_name)} bytes in storage, {size} were written"
                )
        else:
            size, crc = file_crc32(storage, f"{name}/{file_name}")
        files[file_name] = FileEntry(size=size, crc32=crc)
    manifest = Manifest(
        step=step,
        files=files,
        created_ts=time.time(),
        world_size=world_size,
        extra=dict(extra or {}),
        job_id=job_id,
        root=root_identity(storage.url),
    )
    hook("manifest_begin")
    storage.write_atomic(
        f"{name}/{MANIFEST_NAME}", manifest.to_json(secret), on_partial=lambda: hook("manifest_partial")
    )
    hook("manifest_renamed")
    return manifest


def verify(
    storage: ReadableStorage,
    name: str,
    *,
    checksums: bool = True,
    secret: bytes | None = None,
    admit: Callable[[Manifest], Any] | None = None,
) -> Manifest:
    """The manifest of checkpoint directory `name` if the checkpoint is complete and intact.

    Raises CheckpointInvalid saying what is wrong (no manifest, corrupt or, with `secret`, unsigned or
    forged manifest, a missing, truncated or changed file). Pickled files (DCP's `.metadata`) have their
    CRC-32 checked even without `checksums`. `admit` (an `admission.Admission`) is asked about the
    manifest before any file is read: it raises CheckpointRefused for one this job does not load.
    """
    step = parse_step_dir(name)
    if step is None:
        raise CheckpointInvalid(f"{name!r} is not a checkpoint directory name")
    try:
        raw = read_manifest_bytes(storage, name)
    except FileNotFoundError:
        raise CheckpointInvalid("no manifest (incomplete: the save never committed)") from None
    manifest = Manifest.from_json(raw, secret)
    if manifest.step != step:
        raise CheckpointInvalid(f"the manifest is for step {manifest.step}, not {step}")
    if admit is not None:
        admit(manifest)
    verify_files(storage, name, manifest, checksums=checksums)
    return manifest


def verify_files(storage: ReadableStorage, name: str, manifest: Manifest, *, checksums: bool = True) -> None:
    """Check that every file `manifest` lists is in directory `name` with its size (and CRC-32: with
    `checksums`, and always for pickled files). Raises CheckpointInvalid."""
    if not manifest.files:
        raise CheckpointInvalid("the manifest lists no files")
    present = storage.list_dir(name)
    for file_name, entry in manifest.files.items():
        if "/" in file_name or file_name in ("", ".", ".."):
            raise CheckpointInvalid(
                f"the manifest lists {file_name!r}, which is not a file of the checkpoint"
            )
        size = present.get(file_name, -1)
        if size is None or size < 0:
            raise CheckpointInvalid(f"{file_name} is missing (or not a regular file)")
        if size != entry.size:
            raise CheckpointInvalid(
                f"{file_name} has {size} bytes, the manifest says {entry.size} (truncated?)"
            )
    bound = metadata_max_bytes()
    for file_name, entry in manifest.files.items():
        if file_name.endswith(_PICKLED_SUFFIXES) and entry.size > bound:
            raise CheckpointRefused(
                f"its {file_name} has {entry.size} bytes, more than the {bound} ettr reads of one before it loads "
                f"(it is read whole into memory; {METADATA_MAX_BYTES_ENV}=BYTES raises the bound for a checkpoint "
                "you trust)"
            )
    for file_name, entry in manifest.files.items():
        if checksums or file_name.endswith(_PICKLED_SUFFIXES):
            size, crc = file_crc32(storage, f"{name}/{file_name}")
            if size != entry.size or crc != entry.crc32:
                raise CheckpointInvalid(f"{file_name} fails its CRC-32 check (corrupt data)")


@dataclass(frozen=True)
class CheckpointDir:
    """A `step_<N>` directory under the root, as listed (not verified)."""

    step: int
    name: str
    has_manifest: bool


def list_checkpoints(storage: ReadableStorage) -> list[CheckpointDir]:
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
    """What `find_latest` found: the checkpoint to resume from (None: none usable) and what it passed over."""

    latest: Manifest | None
    skipped: tuple[tuple[str, str], ...] = ()
    """(directory name, reason) of each newer directory that was not usable (incomplete or corrupt)."""
    refused: tuple[tuple[str, str], ...] = ()
    """(directory name, reason) of each newer intact checkpoint `admit` refused (left where it is)."""
    verdict: Any = None
    """What `admit` said of `latest` (an `admission.Verdict`; None without `admit`)."""


def find_latest(
    storage: ReadableStorage,
    *,
    checksums: bool = True,
    at_most: int | None = None,
    secret: bytes | None = None,
    admit: Callable[[Manifest], Any] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> Resolution:
    """The newest checkpoint that verifies (at step <= `at_most` if given; signed with `secret` if given;
    admitted by `admit` if given).

    Each newer directory that does not verify is skipped with a warning naming it and the reason. A
    transient I/O error (EIO, EAGAIN, ETIMEDOUT) is retried with back-off before the directory is skipped.
    """
    skipped: list[tuple[str, str]] = []
    refused: list[tuple[str, str]] = []
    verdicts: list[Any] = []

    def admitting(manifest: Manifest) -> None:
        verdicts.append(admit(manifest) if admit is not None else None)

    for ckpt in reversed(list_checkpoints(storage)):
        if at_most is not None and ckpt.step > at_most:
            continue
        verdicts.clear()
        try:
            manifest = _verify_retrying(
                storage, ckpt.name, checksums=checksums, secret=secret, admit=admitting, sleep=sleep
            )
        except CheckpointRefused as exc:
            logger.warning("ettr: not resuming from checkpoint %s in %s: %s", ckpt.name, storage.url, exc)
            refused.append((ckpt.name, str(exc)))
            continue
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
        return Resolution(manifest, tuple(skipped), tuple(refused), verdicts[-1] if verdicts else None)
    return Resolution(None, tuple(skipped), tuple(refused))


def _verify_retrying(
    storage: ReadableStorage,
    name: str,
    *,
    checksums: bool,
    secret: bytes | None,
    admit: Callable[[Manifest], Any] | None,
    sleep: Callable[[float], None],
) -> Manifest:
    delay = 0.05
    for attempt in range(1, VERIFY_ATTEMPTS + 1):
        try:
            return verify(storage, name, checksums=checksums, secret=secret, admit=admit)
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


def _lease_is_live(storage: ReadableStorage, rel: str, now_s: float, ttl_s: float) -> bool:
    try:
        taken_ts = float(json.loads(read_at_most(storage, rel, MAX_LEASE_BYTES))["ts"])
    except (OSError, CheckpointInvalid, ValueError, KeyError, TypeError, RecursionError, OverflowError):
        return (
            False  # gone, or not a lease (a directory, a FIFO, 100,000 nested brackets): no reader holds it
        )
    # A lease taken further ahead of this clock than its ttl (the year 3000, 1e300, a flipped exponent bit) is
    # damage or a forgery, not a reader: it held its checkpoint from retention for ever (NaN: never live).
    return -ttl_s < now_s - taken_ts < ttl_s


def is_leased(storage: ReadableStorage, name: str, *, ttl_s: float, now_s: float | None = None) -> bool:
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


def quarantine(storage: CheckpointStorage, name: str, label: str = "bad") -> str | None:
    """Move a corrupt or abandoned checkpoint aside (`<name>.<label>-<unix time>`) so that its step can be
    saved again; it is kept for inspection and never loaded or deleted by ettr. Returns the new name."""
    new_name = f"{name}.{label}-{int(time.time())}"
    try:
        storage.rename(name, new_name)
    except OSError as exc:
        try:
            storage.remove_tree(name)
        except OSError:  # a read-only root: it stays, and is skipped again by the next restore
            logger.warning(
                "ettr: cannot move checkpoint %s aside or delete it (%s); left in place, never loaded",
                name,
                describe_error(exc),
            )
        else:
            logger.warning(
                "ettr: cannot move checkpoint %s aside (%s); deleted it", name, describe_error(exc)
            )
        return None
    return new_name
