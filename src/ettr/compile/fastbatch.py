"""Fast batches: synthetic batches with the shapes, dtypes and value ranges of real ones.

Compiling needs only a batch of the right shape, not the real data, so compilation can start while
the data loader's workers are still warming up. A `BatchSpec` describes a batch (any nesting of dicts,
lists and tuples of tensors, and plain Python values kept as they are); `spec_of` takes one from a real
batch, `synthesize` builds a batch from it, and `save_spec`/`load_spec` keep it as JSON (in the run
directory and the compile store) so the next attempt and later jobs can start compiling at once. The
data itself is never stored. A kept spec is untrusted input (an earlier job's model may have changed, or
someone else wrote the file): it is read bounded and refused past `MAX_SPEC_NUMEL` elements.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ettr.atomic import atomic_write
from ettr.errors import unreadable
from ettr.untrusted import make_dirs_below, read_json_file

SCHEMA = "ettr.batch-spec/1"
FILENAME = "batch_spec.json"
MAX_SPEC_NUMEL = 1 << 28
"""The most elements (all tensors together, ~268 M: 1 GiB of float32) a kept spec may ask to synthesize."""
MAX_SPEC_FILE_BYTES = 1 << 20
"""The largest kept spec file read (a spec is a few hundred bytes per tensor)."""


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    """One tensor of a batch. Values are drawn uniformly from [low, high] (integers: inclusive)."""

    shape: tuple[int, ...]
    """Size of each dimension."""
    dtype: str
    """torch dtype name without the `torch.` prefix (`float32`, `int64`, `bool`)."""
    low: float = 0.0
    """Smallest value (an embedding index range starts at 0)."""
    high: float = 1.0
    """Largest value (for indices: the number of embeddings - 1)."""
    device: str = "cpu"
    """Device type of the real tensor (`cpu`, `cuda`); `synthesize` may override it."""

    def __post_init__(self) -> None:
        if any(not isinstance(d, int) or d < 0 for d in self.shape):
            raise ValueError(f"TensorSpec.shape must be non-negative ints, got {self.shape}")
        if self.high < self.low:
            raise ValueError(f"TensorSpec.high ({self.high}) must be >= low ({self.low})")
        if not self.dtype or self.dtype.startswith("torch."):
            raise ValueError(f"TensorSpec.dtype is a name like 'float32', got {self.dtype!r}")


BatchSpec = Any
"""A `TensorSpec`, or a dict / list / tuple of specs (nested), or a plain value kept as is."""


def spec_of(batch: Any) -> BatchSpec:
    """The spec of a real batch: its structure, shapes, dtypes and observed value ranges."""
    import torch

    if isinstance(batch, torch.Tensor):
        if batch.numel() == 0:
            low = high = 0.0
        elif batch.dtype == torch.bool:
            low, high = 0.0, 1.0
        else:
            detached = batch.detach()
            low, high = float(detached.min()), float(detached.max())
        return TensorSpec(
            shape=tuple(int(d) for d in batch.shape),
            dtype=str(batch.dtype).removeprefix("torch."),
            low=low,
            high=high,
            device=batch.device.type,
        )
    if isinstance(batch, Mapping):
        return {k: spec_of(v) for k, v in batch.items()}
    if isinstance(batch, tuple) and not hasattr(batch, "_fields"):
        return tuple(spec_of(v) for v in batch)
    if isinstance(batch, list):
        return [spec_of(v) for v in batch]
    if batch is None or isinstance(batch, (bool, int, float, str)):
        return batch
    raise TypeError(
        f"cannot describe a batch element of type {type(batch).__name__} (use tensors, dicts, lists)"
    )


def synthesize(spec: BatchSpec, *, device: Any = None, seed: int = 0) -> Any:
    """A batch built from `spec`: random values in each tensor's range (deterministic for a seed).
    `device` overrides the devices recorded in the spec."""
    import torch

    generator = torch.Generator().manual_seed(seed)

    def build(node: Any) -> Any:
        if isinstance(node, TensorSpec):
            dtype = getattr(torch, node.dtype, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"TensorSpec.dtype {node.dtype!r} is not a torch dtype")
            target = device if device is not None else node.device
            if dtype == torch.bool:
                values = torch.randint(0, 2, node.shape, generator=generator).bool()
            elif dtype.is_floating_point or dtype.is_complex:
                values = torch.rand(node.shape, generator=generator, dtype=torch.float64)
                values = (values * (node.high - node.low) + node.low).to(dtype)
            else:
                values = torch.randint(int(node.low), int(node.high) + 1, node.shape, generator=generator).to(
                    dtype
                )
            return values.to(target)
        if isinstance(node, Mapping):
            return {k: build(v) for k, v in node.items()}
        if isinstance(node, tuple):
            return tuple(build(v) for v in node)
        if isinstance(node, list):
            return [build(v) for v in node]
        return node

    return build(spec)


def _to_json(node: Any) -> Any:
    if isinstance(node, TensorSpec):
        return {
            "__tensor__": True,
            "shape": list(node.shape),
            "dtype": node.dtype,
            "low": node.low,
            "high": node.high,
            "device": node.device,
        }
    if isinstance(node, Mapping):
        return {"__dict__": [[k, _to_json(v)] for k, v in node.items()]}
    if isinstance(node, tuple):
        return {"__tuple__": [_to_json(v) for v in node]}
    if isinstance(node, list):
        return [_to_json(v) for v in node]
    return node


def _from_json(node: Any) -> Any:
    if isinstance(node, dict):
        if node.get("__tensor__"):
            return TensorSpec(
                shape=tuple(int(d) for d in node["shape"]),
                dtype=str(node["dtype"]),
                low=float(node["low"]),
                high=float(node["high"]),
                device=str(node.get("device", "cpu")),
            )
        if "__dict__" in node:
            return {k: _from_json(v) for k, v in node["__dict__"]}
        if "__tuple__" in node:
            return tuple(_from_json(v) for v in node["__tuple__"])
        raise ValueError("unknown batch spec node")
    if isinstance(node, list):
        return [_from_json(v) for v in node]
    return node


def spec_to_json(spec: BatchSpec) -> dict[str, Any]:
    """A JSON-ready document for `spec` (keeps dict key order, tuples vs lists)."""
    return {"schema": SCHEMA, "spec": _to_json(spec)}


def numel(spec: BatchSpec) -> int:
    """How many elements `synthesize(spec)` makes, all tensors together."""
    if isinstance(spec, TensorSpec):
        count = 1
        for dim in spec.shape:  # stops past the bound: a forged shape of 400-digit sizes is no bignum product
            count *= dim
            if count > MAX_SPEC_NUMEL:
                return 0 if 0 in spec.shape else MAX_SPEC_NUMEL + 1
        return count
    if isinstance(spec, Mapping):
        return sum(numel(v) for v in spec.values())
    if isinstance(spec, (list, tuple)):
        return sum(numel(v) for v in spec)
    return 0


def spec_from_json(document: Mapping[str, Any]) -> BatchSpec:
    """Inverse of `spec_to_json`. Raises `ValueError` for anything else, and for a spec of more than
    `MAX_SPEC_NUMEL` elements (synthesizing it could exhaust memory)."""
    if not isinstance(document, Mapping) or document.get("schema") != SCHEMA:
        raise ValueError("not an ettr batch spec")
    try:
        spec = _from_json(document["spec"])
    except (KeyError, TypeError, OverflowError) as exc:  # OverflowError: a bound of 10**400 as a float
        raise ValueError(f"malformed batch spec: {exc}") from None
    if numel(spec) > MAX_SPEC_NUMEL:
        raise ValueError(f"batch spec of {numel(spec)} elements (at most {MAX_SPEC_NUMEL} are synthesized)")
    return spec


def job_file(run_dir: str | os.PathLike[str]) -> Path:
    """Where a job keeps the spec of its first real batch."""
    return Path(run_dir) / "compile" / FILENAME


def save_spec(path: str | os.PathLike[str], spec: BatchSpec) -> None:
    """Write `spec` to `path` atomically."""
    target = Path(path)
    make_dirs_below(target.parent.parent, target.parent)  # RUN_DIR/compile, never a symlink there
    atomic_write(target, json.dumps(spec_to_json(spec), indent=1))


def load_spec(path: str | os.PathLike[str]) -> BatchSpec | None:
    """The spec kept at `path`, or None when missing, unreadable, or refused by `spec_from_json`."""
    return read_spec(path)[0]


def read_spec(path: str | os.PathLike[str]) -> tuple[BatchSpec | None, str | None]:
    """`load_spec`, and why the file could not be read (None when it was, or when there is none): a report
    says an unreadable spec as such, not as no spec."""
    try:  # never through a symlink, never a wait on a FIFO, bounded in size and depth
        return spec_from_json(read_json_file(path, MAX_SPEC_FILE_BYTES)), None
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError, RecursionError) as exc:
        return None, unreadable(path, exc)
