"""The sample batch: model inputs as plain named tensors, the trained model's outputs, and the comparison.

The training job runs its trained model once on a sample batch and commits inputs and outputs with the
anchor; the publisher checks both the resharded model and the exported program against those outputs.
Inputs are carried as plain tensors so that the exported program, and anyone loading the artifact, needs
no TorchRec: a tensor input stays itself, a `KeyedJaggedTensor` becomes `name.values`, `name.lengths`
(and `name.weights`) and is rebuilt with its recorded keys where the model needs one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ettr.publish.request import InputKind, InputSpec, PublishError

SAMPLE_FILE = "publish-sample.safetensors"
"""The sample batch's file name, in the anchor checkpoint and in the artifact."""
INPUT_PREFIX = "input."
OUTPUT_PREFIX = "output."

_DEFAULT_TOLERANCES = {"float32": (1e-4, 1e-5), "bfloat16": (5e-2, 5e-2)}
"""(rtol, atol) by dtype: float32 allows for a different summation order (sharded fused kernels in training,
plain embedding bags in the export); bfloat16 for its 8-bit mantissa through a few layers."""


def tolerances(dtype: str, rtol: float | None = None, atol: float | None = None) -> tuple[float, float]:
    """The (rtol, atol) a published program must meet: given values, else the dtype's defaults."""
    default_rtol, default_atol = _DEFAULT_TOLERANCES[dtype]
    return (default_rtol if rtol is None else rtol, default_atol if atol is None else atol)


def _is_jagged(value: Any) -> bool:
    return type(value).__name__ == "KeyedJaggedTensor" and hasattr(value, "lengths")


def infer_inputs(args: Sequence[Any], names: Sequence[str] = ()) -> tuple[InputSpec, ...]:
    """Input specs for the positional arguments `args` (tensors and KeyedJaggedTensors), named by `names`
    (default `input0`, `input1`, ...). Raises PublishError for anything else."""
    if names and len(names) != len(args):
        raise PublishError(f"{len(names)} input names for {len(args)} sample inputs")
    specs = []
    for i, value in enumerate(args):
        name = names[i] if names else f"input{i}"
        if isinstance(value, torch.Tensor):
            specs.append(InputSpec(name=name, kind=InputKind.TENSOR))
        elif _is_jagged(value):
            if getattr(value, "variable_stride_per_key", lambda: False)():
                raise PublishError(
                    f"input {name!r}: a KeyedJaggedTensor with a variable batch per key is not supported"
                )
            specs.append(
                InputSpec(
                    name=name,
                    kind=InputKind.JAGGED,
                    keys=tuple(value.keys()),
                    weighted=value.weights_or_none() is not None,
                )
            )
        else:
            raise PublishError(
                f"input {name!r} is a {type(value).__name__}: only tensors and KeyedJaggedTensors"
            )
    return tuple(specs)


def flatten_inputs(args: Sequence[Any], specs: Sequence[InputSpec]) -> dict[str, torch.Tensor]:
    """The plain tensors of `args`, by tensor name, in the exported program's argument order."""
    flat: dict[str, torch.Tensor] = {}
    for spec, value in zip(specs, args, strict=True):
        if spec.kind is InputKind.TENSOR:
            flat[spec.name] = value
            continue
        flat[f"{spec.name}.values"] = value.values()
        flat[f"{spec.name}.lengths"] = value.lengths()
        if spec.weighted:
            flat[f"{spec.name}.weights"] = value.weights()
    return flat


def unflatten_inputs(flat: Mapping[str, torch.Tensor], specs: Sequence[InputSpec]) -> list[Any]:
    """The model's positional arguments from plain tensors (KeyedJaggedTensors rebuilt with their keys)."""
    args: list[Any] = []
    for spec in specs:
        if spec.kind is InputKind.TENSOR:
            args.append(flat[spec.name])
            continue
        from torchrec import KeyedJaggedTensor

        args.append(
            KeyedJaggedTensor(
                keys=list(spec.keys),
                values=flat[f"{spec.name}.values"],
                lengths=flat[f"{spec.name}.lengths"],
                weights=flat.get(f"{spec.name}.weights") if spec.weighted else None,
            )
        )
    return args


def flatten_outputs(outputs: Any) -> dict[str, torch.Tensor]:
    """A model's output (a tensor, or a tuple/list/dict of them) as `{"0": ..., "1": ...}` in pytree order.

    `None` entries are left out: many models return `(logits, None)` at inference (a loss without targets,
    nanoGPT's `GPT`, Hugging Face's `loss`), and the exported program returns the same `None` there."""
    leaves = [leaf for leaf in pytree.tree_flatten(outputs)[0] if leaf is not None]
    if not leaves or not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
        raise PublishError("the model's output must be a tensor or a tuple/list/dict of tensors")
    return {str(i): leaf.detach() for i, leaf in enumerate(leaves)}


def batch_size(flat: Mapping[str, torch.Tensor], specs: Sequence[InputSpec]) -> int | None:
    """The batch size all inputs agree on (first dim of tensors, lengths / num_keys), None if they do not."""
    sizes = set()
    for spec in specs:
        if spec.kind is InputKind.TENSOR:
            tensor = flat[spec.name]
            if tensor.dim() == 0:
                return None
            sizes.add(tensor.shape[0])
        else:
            num_bags = flat[f"{spec.name}.lengths"].numel()
            if num_bags % len(spec.keys):
                return None
            sizes.add(num_bags // len(spec.keys))
    return sizes.pop() if len(sizes) == 1 else None


def slice_batch(
    flat: Mapping[str, torch.Tensor], specs: Sequence[InputSpec], size: int
) -> dict[str, torch.Tensor]:
    """The first `size` samples of a batch of plain inputs (jagged inputs keep each key's first bags)."""
    full = batch_size(flat, specs)
    if full is None or not 0 < size <= full:
        raise ValueError(f"cannot take {size} samples of a batch of {full}")
    out: dict[str, torch.Tensor] = {}
    for spec in specs:
        if spec.kind is InputKind.TENSOR:
            out[spec.name] = flat[spec.name][:size]
            continue
        lengths = flat[f"{spec.name}.lengths"].view(len(spec.keys), full)
        keep_bag = torch.zeros_like(lengths, dtype=torch.bool)
        keep_bag[:, :size] = True
        keep_value = torch.repeat_interleave(keep_bag.reshape(-1), lengths.reshape(-1).long())
        out[f"{spec.name}.values"] = flat[f"{spec.name}.values"][keep_value]
        out[f"{spec.name}.lengths"] = lengths[:, :size].reshape(-1).contiguous()
        if spec.weighted:
            out[f"{spec.name}.weights"] = flat[f"{spec.name}.weights"][keep_value]
    return out


@dataclass(frozen=True)
class Comparison:
    """How far one set of outputs is from the reference."""

    ok: bool
    max_abs_err: float
    """Largest |actual - expected| over every output element (inf on a shape mismatch)."""
    rtol: float
    atol: float
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "max_abs_err": self.max_abs_err, "rtol": self.rtol, "atol": self.atol}


def compare(
    actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], *, rtol: float, atol: float
) -> Comparison:
    """Whether every output matches: |actual - expected| <= atol + rtol * |expected|, element-wise."""
    if set(actual) != set(expected):
        return Comparison(
            False, math.inf, rtol, atol, f"outputs {sorted(actual)} vs expected {sorted(expected)}"
        )
    worst, ok, detail = 0.0, True, ""
    for name, want in expected.items():
        got = actual[name].detach().float()
        want = want.detach().float()
        if got.shape != want.shape:
            return Comparison(
                False, math.inf, rtol, atol, f"output {name}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
            )
        if want.numel() == 0:
            continue
        diff = (got - want).abs()
        err = float(diff.max())
        worst = max(worst, err) if not math.isnan(err) else math.inf
        if not bool((diff <= atol + rtol * want.abs()).all()):
            ok = False
            detail = detail or f"output {name}: max |diff| {err:.3g}"
    return Comparison(ok, worst, rtol, atol, detail)


def encode_sample(inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor]) -> bytes:
    """One safetensors blob holding the plain inputs (`input.*`) and the reference outputs (`output.*`)."""
    from safetensors.torch import save

    tensors = {f"{INPUT_PREFIX}{k}": v.detach().cpu().contiguous() for k, v in inputs.items()}
    tensors.update({f"{OUTPUT_PREFIX}{k}": v.detach().cpu().contiguous() for k, v in outputs.items()})
    return save(tensors)


def decode_sample(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(inputs, outputs) of a blob written by `encode_sample`."""
    from safetensors.torch import load

    tensors = load(data)
    inputs = {k[len(INPUT_PREFIX) :]: v for k, v in tensors.items() if k.startswith(INPUT_PREFIX)}
    outputs = {k[len(OUTPUT_PREFIX) :]: v for k, v in tensors.items() if k.startswith(OUTPUT_PREFIX)}
    return inputs, outputs
