"""What a torch.save/torch.load target is, for the checkpoint hooks: a file (by path, open file or fsspec file),
an in-memory buffer, or neither; what a loaded object holds (training state or data, its own step); and the
in-memory save waiting for the file it will be written to.

Pure helpers and one small state holder; the hooks in `checkpoint_hooks` decide what to record.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

STEP_KEYS = ("global_step", "step", "iteration", "iter_num")
"""Top-level keys of a loaded checkpoint that name its global step (Lightning, nanoGPT and plain scripts)."""

_WRITE_MODES = frozenset("wax+")

STATE_KEYS = frozenset(
    {
        "model", "model_state", "model_state_dict", "state_dict", "module", "net", "network", "ema", "model_ema",
        "optimizer", "optimizer_state", "optimizer_state_dict", "optimizer_states", "optim", "opt",
    }
)  # fmt: skip
"""Keys under which a checkpoint keeps a model's or an optimizer's state, whatever its parameters are named."""

PARAMETER_NAMES = frozenset({"weight", "bias", "running_mean", "running_var", "num_batches_tracked"})
"""Names of module parameters and buffers: a state dict's keys are these, or dotted paths ending in a name."""

DATA_NAMES = frozenset(
    {
        "x", "y", "data", "target", "targets", "label", "labels", "input", "inputs", "input_ids",
        "attention_mask", "token_type_ids", "tokens", "ids", "image", "images", "feature", "features", "text",
        "mask", "index", "indices", "train", "val", "valid", "validation", "test",
    }
)  # fmt: skip
"""Keys under which a saved dict keeps data (samples, labels, splits), never a model's parameters."""

_MAX_DEPTH = 3
_MAX_ITEMS = 64  # per container: a dataset saved as a list of a million tensors is not walked through


def path_of(target: Any) -> str | None:
    """The real path of a save/load target that is a file: a path, an open file (`name`), an fsspec file
    (`path`); None for anything else (buffers, file descriptors, objects without a file name)."""
    if isinstance(target, (str, os.PathLike)):
        candidate: Any = target
    elif isinstance(target, io.IOBase) or hasattr(target, "read") or hasattr(target, "write"):
        candidate = getattr(target, "path", None)  # fsspec's file objects name their target here
        if not isinstance(candidate, str):
            candidate = getattr(target, "name", None)
        if not isinstance(candidate, str) or not candidate or candidate.startswith("<"):
            return None
        if "://" in candidate:
            return candidate  # a remote fsspec file: its URL is its identity
    else:
        return None
    try:
        return os.path.realpath(os.fspath(candidate))
    except (TypeError, ValueError):
        return None


def is_buffer(target: Any) -> bool:
    """Whether a save target is an in-memory buffer (its bytes may be written to a file afterwards)."""
    return isinstance(target, (io.BytesIO, bytearray, memoryview))


def is_binary_write(mode: Any) -> bool:
    """Whether an `open` mode writes bytes ("wb", "xb", "ab", "r+b", ...)."""
    return isinstance(mode, str) and "b" in mode and any(c in _WRITE_MODES for c in mode)


def step_in(loaded: Any) -> tuple[str, int] | None:
    """(key, step) when a loaded checkpoint names its own global step at the top level, else None."""
    if not isinstance(loaded, Mapping):
        return None
    for key in STEP_KEYS:
        value = loaded.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return key, value
    return None


def holds_training_state(loaded: Any) -> bool:
    """Whether a loaded object may carry a model's or an optimizer's state (a checkpoint, pretrained weights)
    rather than data (tensors, a dataset, tokenizer tables, metrics).

    State: a module or a parameter; an optimizer or its state dict (`state` and `param_groups`); a tensor under
    a parameter path (`layer.0.weight`) or name (`weight`); any mapping of tensors under a key such as `model`,
    `state_dict` or `optimizer`; found at the top level or up to three levels down (the first 64 items of each
    container, the attributes of an object). Data: tensors and arrays alone or in lists, objects with no
    state (a `Dataset`), mappings with no tensor or only under data names (`x`, `labels`, `input_ids`...).
    A tensor under any other name (`{"w": t}`) may be either: it counts as state, so that a resume is never
    lost to the guess (the cost of a wrong guess is a data load booked as `restore`).
    """
    return _kind(loaded, 0) is not _DATA


_STATE, _DATA, _EITHER = "state", "data", "either"


def _kind(value: Any, depth: int) -> str:
    kind = type(value)
    if kind.__name__ in ("Parameter", "UninitializedParameter") or (
        hasattr(kind, "named_parameters") and hasattr(kind, "state_dict")  # an nn.Module
    ):
        return _STATE
    if hasattr(kind, "state_dict") and isinstance(getattr(value, "param_groups", None), list):  # an optimizer
        return _STATE
    if isinstance(value, (str, bytes, bytearray, int, float, bool)) or value is None or _is_tensor(value):
        return _DATA
    if depth > _MAX_DEPTH:
        return _EITHER
    if isinstance(value, Mapping):
        if "state" in value and "param_groups" in value:  # an optimizer's state dict
            return _STATE
        found = _DATA
        for key, item in _first(value.items()):
            if _is_tensor(item):
                if _is_parameter_path(key):
                    return _STATE
                if not (isinstance(key, str) and key.lower() in DATA_NAMES):
                    found = _EITHER
                continue
            inner = _kind(item, depth + 1)
            if inner is _STATE or (inner is _EITHER and key in STATE_KEYS):
                return _STATE
            if inner is _EITHER:
                found = _EITHER
        return found
    if isinstance(value, (list, tuple)):
        kinds = {_kind(item, depth + 1) for item in _first(value)}
        return _STATE if _STATE in kinds else _EITHER if _EITHER in kinds else _DATA
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict):  # an object (a Dataset...): state only if it holds some
        kinds = {_kind(item, depth + 1) for item in _first(attributes.values()) if not _is_tensor(item)}
        return _STATE if _STATE in kinds else _DATA
    return _DATA


def _is_tensor(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype") and type(value).__name__ != "Parameter"


def _first(items: Any) -> Any:
    for i, item in enumerate(items):
        if i >= _MAX_ITEMS:
            return
        yield item


def _is_parameter_path(key: Any) -> bool:
    if not isinstance(key, str) or not key or key.startswith(".") or key.endswith("."):
        return False
    return "." in key or key in PARAMETER_NAMES


@dataclass(slots=True)
class BufferSave:
    """A torch.save into an in-memory buffer at `step`, waiting to learn which file its bytes went to."""

    step: int
    begin_ts: float
    end_ts: float
    thread_id: int
    target: str | None = None  # the file opened for writing after it (renamed: its new name)

    def opened_for_write(self, path: str | None) -> None:
        if self.target is None and path is not None:
            self.target = path

    def renamed(self, src: str | None, dst: str | None) -> None:
        if self.target is not None and src == self.target and dst is not None:
            self.target = dst

    def written_until(self) -> float:
        """When the target was last written (its mtime), never before the buffer save ended."""
        if self.target is None:
            return self.end_ts
        try:
            return max(self.end_ts, os.stat(self.target).st_mtime)
        except OSError:
            return self.end_ts
