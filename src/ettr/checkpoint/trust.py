"""What a checkpoint must prove before any of it is unpickled, and how transient read errors are retried.

* The HMAC key (`CheckpointConfig.secret`, else the `ETTR_CHECKPOINT_SECRET` environment variable):
  with a key, every manifest is signed on commit and a manifest whose HMAC-SHA256 does not verify is
  refused. Without one, the manifest's CRC-32 protects against corruption only: anyone who can write the
  checkpoint root can rewrite a file and recompute its CRC (docs/checkpointing.md).
* `VerifiedReader` wraps the DCP reader of a checkpoint whose manifest verified. DCP's own
  `read_metadata` unpickles `.metadata` with `pickle.load`; this one reads its bytes first, checks their
  size and CRC-32 against the (verified) manifest, and only then unpickles them with an allow-list of the
  classes DCP's metadata is made of. A `.metadata` swapped in after verification is refused too.
* `retry_transient` retries an operation on EIO / EAGAIN / ETIMEDOUT (bounded, with back-off) so that
  one transient error does not quarantine an intact checkpoint.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import time
import zlib
from collections.abc import Callable
from typing import Any, TypeVar

from torch.distributed.checkpoint.storage import StorageReader

from ettr.checkpoint.base import CheckpointInvalid, CheckpointStorage
from ettr.checkpoint.commit import TRANSIENT_ERRNOS

logger = logging.getLogger("ettr")

SECRET_ENV = "ETTR_CHECKPOINT_SECRET"
"""The environment variable the HMAC key of checkpoint manifests (and publish anchors) is read from."""

METADATA_NAME = ".metadata"
"""DCP's pickled metadata file in each checkpoint directory."""

T = TypeVar("T")


def resolve_secret(secret: bytes | None) -> bytes | None:
    """The HMAC key: `secret` when given, else `ETTR_CHECKPOINT_SECRET` (UTF-8), else None."""
    if secret is not None:
        return secret
    text = os.environ.get(SECRET_ENV, "")
    return text.encode() if text else None


def is_transient(exc: BaseException) -> bool:
    """Whether `exc` (or what it wraps) is an I/O error that may go away on a retry."""
    failures = getattr(exc, "failures", None)  # DCP's CheckpointException: one error per rank
    if isinstance(failures, dict) and failures:
        inner = [w[0] if isinstance(w, tuple) else w for w in failures.values()]
        return all(isinstance(e, BaseException) and is_transient(e) for e in inner)
    seen = 0
    current: BaseException | None = exc
    while current is not None and seen < 8:
        if isinstance(current, OSError) and current.errno in TRANSIENT_ERRNOS:
            return True
        current = current.__cause__ or current.__context__
        seen += 1
    return False


def retry_transient(
    operation: Callable[[], T],
    *,
    what: str,
    attempts: int = 4,
    first_delay_s: float = 0.05,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Run `operation`; on a transient I/O error retry it up to `attempts` times in all, doubling the
    delay each time. Other errors, and the last transient one, are raised."""
    delay = first_delay_s
    for attempt in range(1, attempts + 1):
        try:
            return operation()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            if attempt == attempts or not is_transient(exc):
                raise
            logger.warning(
                "ettr: %s: transient I/O error (%s); retry %d of %d", what, exc, attempt, attempts - 1
            )
            sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")  # pragma: no cover


# -- DCP's metadata, unpickled only after verification and only from an allow-list ----------------------

_ALLOWED_MODULE_PREFIXES = ("torch.distributed.checkpoint.",)
_ALLOWED_GLOBALS = {
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("builtins", "getattr"),  # torch.dtype / layout / memory_format pickle as getattr(torch, name)
    ("torch", "Size"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch.storage", "_load_from_bytes"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}
_TORCH_ATTRS = (
    "float",
    "double",
    "half",
    "bfloat",
    "int",
    "uint",
    "bool",
    "complex",
    "strided",
    "sparse_coo",
    "contiguous_format",
    "preserve_format",
    "channels_last",
)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (
            module.startswith(_ALLOWED_MODULE_PREFIXES)
            or (module, name) in _ALLOWED_GLOBALS
            or (module == "torch" and name.startswith(_TORCH_ATTRS))
        ):
            return super().find_class(module, name)
        raise CheckpointInvalid(f"{METADATA_NAME} names {module}.{name}, which DCP metadata never holds")


def load_metadata_bytes(data: bytes) -> Any:
    """DCP's `Metadata` from the bytes of a verified `.metadata` (allow-listed classes only)."""
    try:
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointInvalid:
        raise
    except Exception as exc:
        raise CheckpointInvalid(f"{METADATA_NAME} cannot be read ({type(exc).__name__}: {exc})") from None


class VerifiedReader(StorageReader):
    """A DCP reader whose `read_metadata` checks `.metadata` against the verified manifest before it
    unpickles it; every other call goes to the storage's own reader.

    Args:
        inner: the storage's DCP reader of the checkpoint directory.
        storage: where the checkpoint is.
        name: the checkpoint directory (`step_<N>`).
        expected: (size, CRC-32) of `.metadata` in the manifest that verified.
    """

    def __init__(
        self, inner: StorageReader, *, storage: CheckpointStorage, name: str, expected: tuple[int, int]
    ) -> None:
        self.inner = inner
        self.storage = storage
        self.name = name
        self.expected = expected

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rel = f"{self.name}/{METADATA_NAME}"
        data = retry_transient(lambda: self.storage.read_bytes(rel), what=f"reading {rel}")
        size, crc = self.expected
        if len(data) != size or zlib.crc32(data) != crc:
            raise CheckpointInvalid(f"{rel} does not match its manifest entry (changed after verification?)")
        metadata = load_metadata_bytes(data)
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        if not isinstance(metadata, Metadata):
            raise CheckpointInvalid(f"{rel} holds a {type(metadata).__name__}, not DCP metadata")
        storage_meta = metadata.storage_meta
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = getattr(self.inner, "load_id", None)
        return metadata

    def reset(self, checkpoint_id: Any = None) -> None:
        self.inner.reset(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.inner.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: Any) -> Any:
        return self.inner.prepare_local_plan(plan)

    def prepare_global_plan(self, plans: Any) -> Any:
        return self.inner.prepare_global_plan(plans)

    def read_data(self, plan: Any, planner: Any) -> Any:
        return self.inner.read_data(plan, planner)


def verified_reader(storage: CheckpointStorage, name: str, manifest: Any) -> VerifiedReader:
    """The DCP reader of checkpoint `name` whose manifest `manifest` verified."""
    entry = manifest.files.get(METADATA_NAME)
    if entry is None:
        raise CheckpointInvalid(f"the manifest of {name} does not list {METADATA_NAME}")
    return VerifiedReader(
        storage.dcp_reader(name), storage=storage, name=name, expected=(entry.size, entry.crc32)
    )
