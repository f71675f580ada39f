"""What a checkpoint must prove before any of it is unpickled, and how transient read errors are retried.

Nothing read from a checkpoint runs as code, with a key or without one (docs/trust.md):

* `.metadata` (DCP's pickled index of the checkpoint) is read only through `VerifiedReader`: its bytes
  are checked against the manifest that verified, then unpickled by `load_metadata_bytes`, which resolves
  no global outside an exact list of (module, name) pairs — DCP's metadata classes, `torch.Size`, the
  dtypes, a layout lookup, paths, sets — with no module prefixes and no dotted names, and nothing that
  unpickles again. The result is then checked: every data file it names is a plain file name the
  manifest lists, every read lies inside that file, no stream transform is asked for.
* Every pickled object of the state (DCP's BYTE_IO items: the scheduler, step, RNG and data position, user
  `extra` values) is loaded by `SafeLoadPlanner` with `torch.load(weights_only=True)`, never with DCP's
  default `weights_only=False`; `VerifiedReader` refuses to read for any other planner. Tensors are read
  by DCP with `weights_only=True`.
* `retry_transient` retries an operation on EIO / EAGAIN / ETIMEDOUT (bounded, with back-off) so that
  one transient error does not quarantine an intact checkpoint.

Who wrote a checkpoint (its signature and origin) is `ettr.checkpoint.admission`'s question; this module
makes sure that whatever the answer, reading it runs nothing.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import pickle
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from ettr import torch_compat
from ettr.checkpoint import raw
from ettr.checkpoint.base import CheckpointError, CheckpointInvalid, CheckpointRefused, ReadableStorage
from ettr.checkpoint.checksums import crc32
from ettr.checkpoint.commit import TRANSIENT_ERRNOS, metadata_max_bytes

logger = logging.getLogger("ettr")

SECRET_ENV = "ETTR_CHECKPOINT_SECRET"
"""The environment variable the HMAC key of checkpoint manifests (and publish anchors) is read from."""

METADATA_NAME = ".metadata"
"""DCP's pickled metadata file in each checkpoint directory."""

T = TypeVar("T")


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


# -- DCP's metadata: an exact allow-list of globals, then a check of what it says ---------------------

_METADATA_CLASSES = (
    "Metadata",
    "MetadataIndex",
    "StorageMeta",
    "TensorProperties",
    "TensorStorageMetadata",
    "ChunkStorageMetadata",
    "BytesStorageMetadata",
    "_MEM_FORMAT_ENCODING",
)


def _layout(name: str) -> torch.layout:
    """`torch.serialization._get_layout`'s job, from an exact table (a layout pickles as its name)."""
    layouts = {str(obj): obj for obj in vars(torch).values() if isinstance(obj, torch.layout)}
    try:
        return layouts[name]
    except (KeyError, TypeError):
        raise CheckpointInvalid(f"{METADATA_NAME} names an unknown tensor layout {name!r}") from None


@functools.cache
def _allowed_globals() -> dict[tuple[str, str], Any]:
    """Every global `.metadata` may name, as exact (module, name) pairs, and the object each resolves to."""
    from torch.distributed.checkpoint import filesystem, metadata

    allowed: dict[tuple[str, str], Any] = {
        (metadata.__name__, name): getattr(metadata, name) for name in _METADATA_CLASSES
    }
    allowed[(filesystem.__name__, "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = _layout
    for name, obj in vars(torch).items():
        if isinstance(obj, torch.dtype):
            allowed[("torch", name)] = obj
    allowed[("collections", "OrderedDict")] = __import__("collections").OrderedDict
    allowed[("builtins", "set")] = set
    allowed[("builtins", "frozenset")] = frozenset
    import pathlib

    for module in ("pathlib", "pathlib._local"):  # StorageMeta.checkpoint_id (3.13 moved the classes)
        for name in ("PosixPath", "PurePosixPath"):
            allowed[(module, name)] = getattr(pathlib, name)
    return allowed


def _mutable_allowed() -> list[Any]:
    """The allowed objects whose attributes a pickle's BUILD could set (Python classes)."""
    return [obj for obj in _allowed_globals().values() if isinstance(obj, type) and hasattr(obj, "__dict__")]


@contextlib.contextmanager
def _classes_unchanged() -> Iterator[None]:
    """Refuse (and undo) a pickle that set attributes on an allowed class instead of building an
    instance of it (BUILD applied to the class itself)."""
    before = {id(cls): dict(vars(cls)) for cls in _mutable_allowed()}
    try:
        yield
    finally:
        changed = []
        for cls in _mutable_allowed():
            now = dict(vars(cls))
            if now != before[id(cls)]:
                changed.append(cls.__qualname__)
                for key in set(now) - set(before[id(cls)]):
                    with contextlib.suppress(AttributeError, TypeError):
                        delattr(cls, key)
                for key, value in before[id(cls)].items():
                    if now.get(key, _MISSING) is not value:
                        with contextlib.suppress(AttributeError, TypeError):
                            setattr(cls, key, value)
        if changed:
            raise CheckpointInvalid(f"{METADATA_NAME} sets attributes of {', '.join(changed)}")


_MISSING = object()


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _allowed_globals().get((module, name))
        if found is None:
            raise CheckpointInvalid(f"{METADATA_NAME} names {module}.{name}, which DCP metadata never holds")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointInvalid(
            f"{METADATA_NAME} holds a persistent reference, which DCP metadata never does"
        )


def load_metadata_bytes(data: bytes, files: Mapping[str, int] | None = None) -> Any:
    """DCP's `Metadata` from the bytes of a verified `.metadata`: exact allow-listed globals only, then
    checked by `check_metadata` (against `files`, the manifest's file name -> size, when given).
    Raises CheckpointInvalid."""
    try:
        with _classes_unchanged():
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointInvalid:
        raise
    except Exception as exc:
        raise CheckpointInvalid(f"{METADATA_NAME} cannot be read ({type(exc).__name__}: {exc})") from None
    check_metadata(metadata, files)
    return metadata


def check_metadata(metadata: Any, files: Mapping[str, int] | None = None) -> None:
    """Raise CheckpointInvalid unless `metadata` is DCP `Metadata` of the expected shape whose every read
    stays inside a file the manifest lists (`files`: name -> size; None: names are checked for shape only)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    if not isinstance(metadata, Metadata):
        raise CheckpointInvalid(f"{METADATA_NAME} holds a {type(metadata).__name__}, not DCP metadata")
    items = metadata.state_dict_metadata
    if not isinstance(items, dict) or not all(
        isinstance(k, str) and isinstance(v, (TensorStorageMetadata, BytesStorageMetadata))
        for k, v in items.items()
    ):
        raise CheckpointInvalid(f"{METADATA_NAME}: state_dict_metadata is not a map of keys to DCP items")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise CheckpointInvalid(f"{METADATA_NAME}: storage_data is not a map")
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise CheckpointInvalid(f"{METADATA_NAME}: storage_data holds {type(info).__name__}")
        where = info.relative_path
        if not isinstance(where, str) or not _plain_name(where):
            raise CheckpointInvalid(
                f"{METADATA_NAME}: item {index.fqn!r} is read from {where!r}, outside its checkpoint"
            )
        if files is not None and where not in files:
            raise CheckpointInvalid(
                f"{METADATA_NAME}: item {index.fqn!r} is read from {where}, which the manifest does not list"
            )
        offset, length = info.offset, info.length
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
            raise CheckpointInvalid(f"{METADATA_NAME}: item {index.fqn!r} has a bad offset or length")
        if files is not None and offset + length > files[where]:
            raise CheckpointInvalid(f"{METADATA_NAME}: item {index.fqn!r} reads past the end of {where}")
        if info.transform_descriptors and not (
            raw.is_raw(info) and isinstance(items.get(index.fqn), TensorStorageMetadata)
        ):
            raise CheckpointInvalid(
                f"{METADATA_NAME}: item {index.fqn!r} asks for stream transforms, which ettr never writes"
            )


def _plain_name(name: str) -> bool:
    return (
        bool(name) and "/" not in name and "\\" not in name and name not in (".", "..") and "\0" not in name
    )


# -- pickled objects of the state: weights_only=True, always ------------------------------------------


def _numpy_safe_globals() -> list[Any]:
    """What NumPy's random state needs under `weights_only=True` (arrays and their dtypes)."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        return []
    found: list[Any] = [np.ndarray, np.dtype]
    reconstruct = getattr(getattr(np, "_core", None), "multiarray", None)
    if reconstruct is not None:
        found.append(reconstruct._reconstruct)
    found.extend(type(np.dtype(name)) for name in ("uint32", "int64", "float64", "bool"))
    return found


@contextlib.contextmanager
def safe_globals(extra: tuple[Any, ...] = ()) -> Iterator[None]:
    """While the block runs, `weights_only=True` loads also accept NumPy's RNG state and `extra` (the
    classes a job allowed in `CheckpointConfig.safe_globals`; never anything named by the checkpoint).
    Adds only what is not allowed already and removes only what it added (torch's list is process-wide:
    the user's own `add_safe_globals` stay, and nested blocks do not undo each other)."""
    present = set(torch.serialization.get_safe_globals())
    added = [obj for obj in dict.fromkeys([*_numpy_safe_globals(), *extra]) if obj not in present]
    with torch.serialization.safe_globals(added):
        yield


class UnsafePickle(CheckpointInvalid):
    """A pickled part of a checkpoint holds a type `weights_only=True` refuses."""


def load_pickled(stream: Any, allowed: tuple[Any, ...] = ()) -> Any:
    """One pickled object of a checkpoint, loaded with `torch.load(weights_only=True)`: tensors,
    containers, numbers, strings, NumPy's RNG state and the classes in `allowed`. Raises UnsafePickle
    for anything else."""
    try:
        with safe_globals(allowed):
            return torch.load(stream, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        said = next((line for line in lines if "GLOBAL" in line), lines[-1] if lines else "")
        raise UnsafePickle(
            "a pickled part of the checkpoint holds a type weights_only=True refuses "
            f"({said[:200]}); if your job saves it, allow the class: CheckpointConfig(safe_globals=(...,))"
        ) from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that pickled objects (BYTE_IO items) load with
    `weights_only=True` (`load_pickled`, accepting also the classes in `allowed`) instead of DCP's
    `weights_only=False`."""

    def __init__(self, *, allowed: tuple[Any, ...] = (), allow_partial_load: bool = False) -> None:
        super().__init__(allow_partial_load=allow_partial_load)
        self.allowed = tuple(allowed)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = load_pickled(value, self.allowed)
        if self.flatten_state_dict:
            torch_compat.set_element(
                self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded
            )
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class VerifiedReader(StorageReader):
    """A DCP reader of a checkpoint whose manifest verified: `read_metadata` checks `.metadata` against
    the manifest and unpickles it from the exact allow-list (`load_metadata_bytes`), and `read_data` reads
    only for a `SafeLoadPlanner`; every other call goes to the storage's own reader.

    Args:
        inner: the storage's DCP reader of the checkpoint directory.
        storage: where the checkpoint is.
        name: the checkpoint directory (`step_<N>`).
        expected: (size, CRC-32) of `.metadata` in the manifest that verified.
        files: every file of the manifest, name -> size (the only files a read may touch).
    """

    def __init__(
        self,
        inner: StorageReader,
        *,
        storage: ReadableStorage,
        name: str,
        expected: tuple[int, int],
        files: Mapping[str, int] | None = None,
    ) -> None:
        self.inner = inner
        self.storage = storage
        self.name = name
        self.expected = expected
        self.files = dict(files) if files is not None else None
        self._metadata: Any = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rel = f"{self.name}/{METADATA_NAME}"
        size, crc = self.expected
        bound = metadata_max_bytes()
        if size > bound:  # verify refused it already; a caller that did not verify: the same line
            raise CheckpointRefused(f"{rel} has {size} bytes, more than the {bound} ettr reads of one")

        def read() -> (
            bytes
        ):  # never more than the manifest says: a file grown since the check is not read whole
            with self.storage.open_read(rel) as stream:
                return stream.read(size + 1)

        data = retry_transient(read, what=f"reading {rel}")
        if len(data) != size or crc32(data) != crc:
            raise CheckpointInvalid(f"{rel} does not match its manifest entry (changed after verification?)")
        metadata = load_metadata_bytes(data, self.files)
        from torch.distributed.checkpoint.metadata import StorageMeta

        storage_meta = metadata.storage_meta
        if storage_meta is None or not isinstance(storage_meta, StorageMeta):
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = getattr(self.inner, "load_id", None)
        return metadata

    def reset(self, checkpoint_id: Any = None) -> None:
        self.inner.reset(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        check_metadata(metadata, self.files)  # what DCP hands back must be what read_metadata checked
        self._metadata = metadata
        self.inner.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: Any) -> Any:
        return self.inner.prepare_local_plan(plan)

    def prepare_global_plan(self, plans: Any) -> Any:
        return self.inner.prepare_global_plan(plans)

    def read_data(self, plan: Any, planner: Any) -> Any:
        if not isinstance(planner, SafeLoadPlanner):
            raise CheckpointError(
                "ettr reads checkpoints only with ettr.checkpoint.trust.SafeLoadPlanner "
                f"(dcp.load(..., planner=SafeLoadPlanner())), not {type(planner).__name__}"
            )
        rest, records = raw.split(plan, self._metadata)
        if records:  # ettr's raw tensor records (`raw`): read here; everything else by DCP's reader
            if not (hasattr(self.inner, "fs") and hasattr(self.inner, "path")):
                raise CheckpointInvalid(f"{self.name}: raw tensor records need a file reader")
            raw.read_raw(self.inner, records, self._metadata, planner)
        return self.inner.read_data(rest, planner)


def verified_reader(storage: ReadableStorage, name: str, manifest: Any) -> VerifiedReader:
    """The DCP reader of checkpoint `name` whose manifest `manifest` verified."""
    entry = manifest.files.get(METADATA_NAME)
    if entry is None:
        raise CheckpointInvalid(f"the manifest of {name} does not list {METADATA_NAME}")
    return VerifiedReader(
        storage.dcp_reader(name),
        storage=storage,
        name=name,
        expected=(entry.size, entry.crc32),
        files={file_name: e.size for file_name, e in manifest.files.items()},
    )
