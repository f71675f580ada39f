"""A publish request: everything a publisher needs to turn one anchor checkpoint into an inference artifact.

The training job writes it (`ettr.publish.anchor`); the publisher (`ettr publish`) reads it from the queue.
It is plain JSON, so a publisher on another machine needs no state from the trainer: where the anchor is,
how to build the model (a factory named by import path, and its config), how the model's inputs are laid
out, the output dtype, and where the artifact and the publish job's ledger go. Its id is derived from the
training job, the anchor and the step, so enqueueing the same anchor twice names the same request.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from ettr.untrusted import loads_bounded

REQUEST_FORMAT = "ettr.publish-request/1"
DTYPES = ("float32", "bfloat16")
"""Dtypes an artifact can be published in (weights and exported program alike)."""

_FACTORY_PATTERN = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_UNSAFE_ID_CHARS = re.compile(r"[^A-Za-z0-9_.-]+")
MAX_REQUEST_BYTES = 1 << 20
"""A request file larger than this is refused unread (requests are a few KB)."""
MAX_JSON_DEPTH = 32
"""Nesting deeper than this is refused before parsing (a model config is a few levels deep)."""

ResolvedCheck = Callable[[str, Any], None]
"""Called with (import path, object) after each import of `ModelSpec.build`; raises PublishError to refuse."""


class PublishError(Exception):
    """Publishing cannot go on for a reason a retry would not fix; the message says what and what to do."""


def resolve(path: str, check: ResolvedCheck | None = None) -> Any:
    """The object named by `"package.module:attribute"` (the attribute may be dotted). Raises PublishError.

    `check(path, obj)` is called on the result (a publisher's policy refuses objects from elsewhere)."""
    module_name, _, attribute = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise PublishError(
            f"cannot import {module_name!r} for {path!r} ({exc}); is it on the pythonpath?"
        ) from None
    for part in attribute.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PublishError(f"{module_name!r} has no attribute {attribute!r} (from {path!r})") from None
    if check is not None:
        check(path, obj)
    return obj


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """How the publisher builds the plain (unsharded, single-process, CPU) model to load the anchor into."""

    factory: str
    """Import path `"module:callable"` of what builds the model: called as `factory(config_type(**config))`
    when `config_type` is given, else as `factory(**config)`."""
    config: Mapping[str, Any] = field(default_factory=dict)
    """The model's configuration, JSON-serialisable; saved as the artifact's `config.json` too."""
    config_type: str | None = None
    """Import path of a config class (e.g. a dataclass) built from `config`; JSON lists become tuples."""
    pythonpath: tuple[str, ...] = ()
    """Directories put on `sys.path` before importing (where the model code lives, e.g. `examples/`)."""

    def __post_init__(self) -> None:
        for name, value in (("factory", self.factory), ("config_type", self.config_type)):
            if value is not None and not _FACTORY_PATTERN.match(value):
                raise ValueError(
                    f"{name} must be an import path like 'package.module:build_model', got {value!r}"
                )
        try:
            json.dumps(dict(self.config), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"config must be JSON-serialisable ({exc})") from None
        object.__setattr__(self, "pythonpath", tuple(str(p) for p in self.pythonpath))

    def build(self, check: ResolvedCheck | None = None) -> Any:
        """Import the factory (and config type) and build the model. Raises PublishError.

        `check` vets each imported object (`PublishPolicy.check_resolved`)."""
        for entry in self.pythonpath:
            if entry not in sys.path:
                sys.path.insert(0, entry)
        factory = resolve(self.factory, check)
        config = dict(self.config)
        try:
            if self.config_type is None:
                return factory(**config)
            config_cls = resolve(self.config_type, check)
            if dataclasses.is_dataclass(config_cls):
                # JSON has no tuples; frozen configs use them for sequences.
                config = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}
            return factory(config_cls(**config))
        except (TypeError, ValueError) as exc:
            raise PublishError(f"{self.factory} could not build the model from its config ({exc})") from None

    def to_json(self) -> dict[str, Any]:
        return {
            "factory": self.factory,
            "config": dict(self.config),
            "config_type": self.config_type,
            "pythonpath": list(self.pythonpath),
        }

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> ModelSpec:
        config = _get(body, "config", dict, {})
        return cls(
            factory=_get(body, "factory", str),
            config=config,
            config_type=_get(body, "config_type", (str, type(None)), None),
            pythonpath=tuple(_strings(body, "pythonpath")),
        )


class InputKind(StrEnum):
    """How one positional input of the model is carried as plain tensors."""

    TENSOR = "tensor"
    """A tensor, passed as it is; its first dimension is the batch."""
    JAGGED = "jagged"
    """A TorchRec `KeyedJaggedTensor` (key-major, one bag per key and sample): carried as its `values`,
    `lengths` (num_keys * batch) and, if weighted, `weights`; rebuilt with the recorded keys."""


@dataclass(frozen=True, kw_only=True)
class InputSpec:
    """One positional input of the model."""

    name: str
    """Its name; the plain tensors are called `name` (tensor) or `name.values`, `name.lengths`, ... (jagged)."""
    kind: InputKind = InputKind.TENSOR
    keys: tuple[str, ...] = ()
    """Jagged only: the feature keys, in the order of `lengths`."""
    weighted: bool = False
    """Jagged only: whether the input carries per-id weights."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", InputKind(self.kind))
        object.__setattr__(self, "keys", tuple(self.keys))
        if not self.name or "." in self.name:
            raise ValueError(f"an input name must be non-empty and have no '.', got {self.name!r}")
        if self.kind is InputKind.JAGGED and not self.keys:
            raise ValueError(f"jagged input {self.name!r} needs its keys")

    @property
    def tensor_names(self) -> tuple[str, ...]:
        """The plain tensors this input is carried as, in the exported program's argument order."""
        if self.kind is InputKind.TENSOR:
            return (self.name,)
        names = (f"{self.name}.values", f"{self.name}.lengths")
        return (*names, f"{self.name}.weights") if self.weighted else names

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind.value,
            "keys": list(self.keys),
            "weighted": self.weighted,
        }

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> InputSpec:
        return cls(
            name=_get(body, "name", str),
            kind=InputKind(_get(body, "kind", str, "tensor")),
            keys=tuple(_strings(body, "keys")),
            weighted=_get(body, "weighted", bool, False),
        )


def request_id_for(job_id: str, anchor_root: str, step: int) -> str:
    """The id of the request for the anchor of `step` under `anchor_root` written by `job_id` (stable)."""
    # the path's bytes (os.fsencode): a root whose name is not UTF-8 raised UnicodeEncodeError out of publish_at_end
    digest = hashlib.sha1(os.fsencode(f"{job_id}\0{anchor_root}\0{step}")).hexdigest()[:8]
    safe_job = _UNSAFE_ID_CHARS.sub("_", job_id)[:80] or "job"
    return f"{safe_job}-step{step:09d}-{digest}"


@dataclass(frozen=True, kw_only=True)
class PublishRequest:
    """One anchor checkpoint to publish, and how. Immutable once enqueued."""

    request_id: str
    job_id: str
    """The training job that wrote the anchor (the publish job is linked to it)."""
    anchor_root: str
    """Checkpoint root the anchor lives under (a path or fsspec URL); the anchor is `step_<N>` in it."""
    step: int
    """The global step the anchor holds the model of."""
    world_size: int
    """Ranks that wrote the anchor (for the record; loading reshards to one process whatever it is)."""
    model: ModelSpec
    inputs: tuple[InputSpec, ...]
    """The model's positional inputs, in order."""
    artifact_dir: str
    """Where the artifact directory appears (atomically, once, whole)."""
    run_dir: str | None = None
    """The publish job's run directory (its ledger); None records nothing (publishing inside the job)."""
    train_run_dir: str | None = None
    """The training job's run directory, if it had one (for the record)."""
    dtype: str = "float32"
    """`float32`, or `bfloat16` for the weights and the exported program."""
    state_key: str = "model"
    """Top-level key of the model's state dict in the anchor."""
    rtol: float | None = None
    """Relative tolerance of the verification (None: by dtype, see `ettr.publish.sample.tolerances`)."""
    atol: float | None = None
    """Absolute tolerance of the verification (None: by dtype)."""
    created_ts: float = 0.0
    """When the training job enqueued it (Unix seconds): the publish job's submission time."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        if self.step < 0:
            raise ValueError(f"step must be >= 0, got {self.step}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not self.inputs:
            raise ValueError("a request needs at least one model input")
        if len({i.name for i in self.inputs}) != len(self.inputs):
            raise ValueError("input names must be unique")
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if not self.request_id or _UNSAFE_ID_CHARS.search(self.request_id):
            raise ValueError(
                f"request_id must be non-empty and use only [A-Za-z0-9_.-], got {self.request_id!r}"
            )

    @property
    def publish_job_id(self) -> str:
        """The job id of the publish job (its run directory's SUPERVISOR_START says it)."""
        return f"publish-{self.request_id}"

    def to_json(self) -> bytes:
        body = {
            "format": REQUEST_FORMAT,
            "request_id": self.request_id,
            "job_id": self.job_id,
            "anchor_root": self.anchor_root,
            "step": self.step,
            "world_size": self.world_size,
            "model": self.model.to_json(),
            "inputs": [i.to_json() for i in self.inputs],
            "artifact_dir": self.artifact_dir,
            "run_dir": self.run_dir,
            "train_run_dir": self.train_run_dir,
            "dtype": self.dtype,
            "state_key": self.state_key,
            "rtol": self.rtol,
            "atol": self.atol,
            "created_ts": self.created_ts,
        }
        return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> PublishRequest:
        """Parse a request. Raises PublishError (and nothing else) for anything that is not a valid request:
        wrong types, missing fields, non-finite or huge numbers, deep nesting, an unknown format."""
        try:
            body = parse_json(data)
            if not isinstance(body, dict):
                raise PublishError(f"not a publish request (a JSON {type(body).__name__}, not an object)")
            if body.get("format") != REQUEST_FORMAT:
                raise PublishError(f"not a publish request (format {str(body.get('format'))[:80]!r})")
            model = _get(body, "model", dict)
            inputs = _get(body, "inputs", list)
            if not all(isinstance(i, dict) for i in inputs):
                raise ValueError("inputs must be a list of objects")
            return cls(
                request_id=_get(body, "request_id", str),
                job_id=_get(body, "job_id", str),
                anchor_root=_get(body, "anchor_root", str),
                step=_get(body, "step", int),
                world_size=_get(body, "world_size", int),
                model=ModelSpec.from_json(model),
                inputs=tuple(InputSpec.from_json(i) for i in inputs),
                artifact_dir=_get(body, "artifact_dir", str),
                run_dir=_get(body, "run_dir", (str, type(None)), None),
                train_run_dir=_get(body, "train_run_dir", (str, type(None)), None),
                dtype=_get(body, "dtype", str, "float32"),
                state_key=_get(body, "state_key", str, "model"),
                rtol=_number(body, "rtol"),
                atol=_number(body, "atol"),
                created_ts=_number(body, "created_ts") or 0.0,
            )
        except PublishError:
            raise
        except Exception as exc:  # noqa: BLE001 - a request is untrusted input: any failure is "unreadable"
            raise PublishError(
                f"unreadable publish request ({type(exc).__name__}: {str(exc)[:300]})"
            ) from None


_MISSING: Any = object()


def parse_json(data: bytes | str) -> Any:
    """`untrusted.loads_bounded` of a request's bytes, refused first when larger than `MAX_REQUEST_BYTES`:
    no NaN/Infinity, no overflowing number, nesting at most `MAX_JSON_DEPTH` (checked before parsing: a
    request of 5,000 brackets raised RecursionError out of `json.loads` before the depth was walked).
    Raises ValueError (or PublishError for an oversized body)."""
    if len(data) > MAX_REQUEST_BYTES:
        raise PublishError(f"a request of {len(data)} bytes is too large (at most {MAX_REQUEST_BYTES})")
    return loads_bounded(data, max_depth=MAX_JSON_DEPTH)


def _get(body: Mapping[str, Any], key: str, kinds: type | tuple[type, ...], default: Any = _MISSING) -> Any:
    """`body[key]`, checked to be of `kinds` (bool is not an int here); `default` when absent."""
    if key not in body:
        if default is _MISSING:
            raise ValueError(f"missing field {key!r}")
        return default
    value = body[key]
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if isinstance(value, bool) and bool not in kinds:
        raise ValueError(f"field {key!r} must be {' or '.join(k.__name__ for k in kinds)}, got a bool")
    if not isinstance(value, kinds):
        raise ValueError(
            f"field {key!r} must be {' or '.join(k.__name__ for k in kinds)}, got {type(value).__name__}"
        )
    return value


def _strings(body: Mapping[str, Any], key: str) -> list[str]:
    values = _get(body, key, (list, type(None)), None) or []
    if not all(isinstance(v, str) for v in values):
        raise ValueError(f"field {key!r} must be a list of strings")
    return values


def _number(body: Mapping[str, Any], key: str) -> float | None:
    value = _get(body, key, (int, float, type(None)), None)
    return None if value is None else float(value)
