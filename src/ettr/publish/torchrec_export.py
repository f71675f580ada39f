"""Turning a trained model into a `torch.export` program with plain-tensor inputs that runs on torch alone.

Two steps. `to_exportable` swaps each TorchRec `EmbeddingBagCollection` for `PlainEmbeddingBags`: the same
pooled lookups in plain torch ops (one `embedding_bag` per group of tables of one width and pooling, over
their rows concatenated), returning the same `KeyedTensor`, so the model's own forward runs unchanged and
no fbgemm operator ends up in the program. `PlainInputs` wraps the model so that the program takes plain
tensors — a tensor input as it is, a KeyedJaggedTensor as its values and lengths — and rebuilds what the
model expects inside the trace. `export_program` exports that with a dynamic batch size where it can.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ettr.publish.request import InputKind, InputSpec, PublishError
from ettr.publish.sample import unflatten_inputs

logger = logging.getLogger("ettr")


@dataclass(frozen=True)
class _Lookup:
    """One (table, feature) pooled lookup of an EmbeddingBagCollection."""

    feature: str
    group: int
    row_offset: int
    """First row of the table in its group's concatenated weight."""


class PlainEmbeddingBags(nn.Module):
    """An unsharded `EmbeddingBagCollection` for inference, in plain torch ops (export-friendly).

    Takes the same KeyedJaggedTensor (key-major, the same batch for every key) and returns the same
    KeyedTensor (keys and widths in the collection's order). Tables of one embedding width, pooling and
    dtype share one `embedding_bag` call over their concatenated rows plus a zero row that the ids of
    other keys are sent to. Build it with `from_collection`; its weights are copies of the collection's.
    """

    def __init__(
        self,
        *,
        weights: Sequence[torch.Tensor],
        modes: Sequence[str],
        lookups: Sequence[_Lookup],
        embedding_names: Sequence[str],
        lengths_per_embedding: Sequence[int],
        weighted: bool,
    ) -> None:
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(w, requires_grad=False) for w in weights])
        self._modes = list(modes)
        self._lookups = list(lookups)
        self._embedding_names = list(embedding_names)
        self._lengths_per_embedding = list(lengths_per_embedding)
        self._weighted = weighted
        self.output_dtype = torch.float32
        """Dtype of the pooled embeddings (TorchRec's is float32; a bfloat16 publish sets bfloat16)."""
        # A key looked up in two tables of one group needs two passes over that group.
        self._passes: list[tuple[int, list[int]]] = []
        for position, lookup in enumerate(self._lookups):
            for group, members in self._passes:
                if group == lookup.group and all(self._lookups[m].feature != lookup.feature for m in members):
                    members.append(position)
                    break
            else:
                self._passes.append((lookup.group, [position]))

    @classmethod
    def from_collection(cls, collection: Any) -> PlainEmbeddingBags:
        """The plain equivalent of an unsharded TorchRec `EmbeddingBagCollection` (weights copied; typed
        `Any`: torchrec ships no type information)."""
        configs = collection.embedding_bag_configs()
        groups: dict[tuple[int, str, torch.dtype], list[Any]] = {}
        for config in configs:
            bag = collection.embedding_bags[config.name]
            groups.setdefault((config.embedding_dim, bag.mode, bag.weight.dtype), []).append(config)
        group_index = {key: i for i, key in enumerate(groups)}
        weights, modes, offsets = [], [], {}
        for (dim, mode, dtype), members in groups.items():
            rows = 0
            for config in members:
                offsets[config.name] = rows
                rows += config.num_embeddings
            parts = [collection.embedding_bags[c.name].weight.detach() for c in members]
            weights.append(torch.cat([*parts, torch.zeros(1, dim, dtype=dtype)]))
            modes.append(mode)
        lookups = []
        for config in configs:
            bag = collection.embedding_bags[config.name]
            group = group_index[(config.embedding_dim, bag.mode, bag.weight.dtype)]
            if collection.is_weighted() and bag.mode != "sum":
                raise PublishError(f"table {config.name}: per-id weights need sum pooling, not {bag.mode}")
            for feature in config.feature_names:
                lookups.append(_Lookup(feature=feature, group=group, row_offset=offsets[config.name]))
        return cls(
            weights=weights,
            modes=modes,
            lookups=lookups,
            embedding_names=collection._embedding_names,
            lengths_per_embedding=collection._lengths_per_embedding,
            weighted=collection.is_weighted(),
        )

    def forward(self, features: Any) -> Any:
        from torchrec.sparse.jagged_tensor import KeyedTensor

        keys = list(features.keys())
        index = {key: i for i, key in enumerate(keys)}
        missing = sorted({lookup.feature for lookup in self._lookups} - set(index))
        if missing:
            raise KeyError(f"the input has no feature {', '.join(missing)}")
        values, lengths = features.values(), features.lengths()
        num_keys = len(keys)
        batch = lengths.size(0) // num_keys
        key_of_bag = torch.arange(num_keys, device=values.device).repeat_interleave(batch)
        key_of_value = torch.repeat_interleave(key_of_bag, lengths.long(), output_size=values.size(0))
        offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]).long()
        per_id = features.weights() if self._weighted else None
        pooled: list[torch.Tensor | None] = [None] * len(self._lookups)
        for group, members in self._passes:
            weight = self.weights[group]
            zero_row = weight.size(0) - 1
            scale, shift = [0] * num_keys, [zero_row] * num_keys
            for m in members:
                i = index[self._lookups[m].feature]
                scale[i], shift[i] = 1, self._lookups[m].row_offset
            ids = values.long() * torch.tensor(scale)[key_of_value] + torch.tensor(shift)[key_of_value]
            out = nn.functional.embedding_bag(
                ids,
                weight,
                offsets,
                mode=self._modes[group],
                include_last_offset=True,
                per_sample_weights=per_id,
            ).view(num_keys, batch, -1)
            for m in members:
                pooled[m] = out[index[self._lookups[m].feature]]
        return KeyedTensor(
            keys=self._embedding_names,
            values=torch.cat(pooled, dim=1).to(self.output_dtype),  # type: ignore[arg-type]
            length_per_key=self._lengths_per_embedding,
        )


def to_exportable(model: nn.Module) -> nn.Module:
    """Swap every TorchRec EmbeddingBagCollection in `model` (in place) for `PlainEmbeddingBags`.

    Returns the model (or the replacement, if `model` is itself a collection). Raises PublishError for
    TorchRec modules it cannot translate (sharded modules, sequence `EmbeddingCollection`s).
    """
    try:
        from torchrec import EmbeddingBagCollection, EmbeddingCollection
    except ImportError:  # no TorchRec: nothing to translate
        return model
    if type(model) is EmbeddingBagCollection:
        return PlainEmbeddingBags.from_collection(model)
    for name, module in list(model.named_modules()):
        if isinstance(module, EmbeddingCollection):
            raise PublishError(f"{name}: EmbeddingCollection (sequence embeddings) cannot be exported yet")
        if type(module).__module__.startswith("torchrec.distributed"):
            raise PublishError(f"{name}: a sharded TorchRec module; build the plain model to publish it")
        if type(module) is EmbeddingBagCollection:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, PlainEmbeddingBags.from_collection(module))
    return model


def detach_views(model: nn.Module) -> None:
    """Give every buffer that is a view of another tensor its own storage (in place).

    `torch.export.save` stores tensors by storage; two buffers that are views of one tensor (e.g. the
    rows and columns of one `triu_indices`) leave it with no complete tensor for that storage.
    """
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer._base is not None:
                module._buffers[name] = buffer.clone()


def set_output_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Make every `PlainEmbeddingBags` in `model` pool into `dtype` (for a bfloat16 publish)."""
    for module in model.modules():
        if isinstance(module, PlainEmbeddingBags):
            module.output_dtype = dtype


class PlainInputs(nn.Module):
    """`model` behind plain-tensor arguments: what gets exported.

    Called with the tensors of `specs` in order (`InputSpec.tensor_names`); floating inputs are cast to
    `dtype`, jagged inputs rebuilt as KeyedJaggedTensors, and floating outputs returned as float32.
    """

    def __init__(self, model: nn.Module, specs: Sequence[InputSpec], dtype: torch.dtype) -> None:
        super().__init__()
        self.model = model
        self._specs = tuple(specs)
        self._names = [name for spec in self._specs for name in spec.tensor_names]
        self._dtype = dtype

    def forward(self, *tensors: torch.Tensor) -> Any:
        flat = {
            name: t.to(self._dtype) if t.is_floating_point() else t
            for name, t in zip(self._names, tensors, strict=True)
        }
        out = self.model(*unflatten_inputs(flat, self._specs))
        return pytree.tree_map(
            lambda x: x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x, out
        )


def dynamic_shapes(specs: Sequence[InputSpec]) -> tuple[dict[int, Any], ...]:
    """A dynamic batch for every input: dim 0 of tensors, `num_keys * batch` bags, any number of ids."""
    from torch.export import Dim

    batch = Dim("batch", min=1, max=1 << 24)
    shapes: list[dict[int, Any]] = []
    for spec in specs:
        if spec.kind is InputKind.TENSOR:
            shapes.append({0: batch})
            continue
        num_ids = Dim(f"{spec.name}_num_ids", min=1, max=1 << 31)
        shapes.append({0: num_ids})
        shapes.append({0: len(spec.keys) * batch})
        if spec.weighted:
            shapes.append({0: num_ids})
    return tuple(shapes)


def export_program(
    wrapper: PlainInputs,
    args: Sequence[torch.Tensor],
    specs: Sequence[InputSpec],
    *,
    dynamic_batch: bool = True,
) -> tuple[torch.export.ExportedProgram, str | None]:
    """Export `wrapper` on `args`; with a dynamic batch if asked and possible, else with static shapes.

    Returns the program and, if the dynamic export failed and a static one was made instead, why.
    Raises PublishError if the model cannot be exported at all.
    """
    fallback_reason = None
    if dynamic_batch:
        try:
            # The wrapper takes *tensors: its one variadic parameter gets the per-tensor specs as a tuple.
            shapes = (dynamic_shapes(specs),)
            program = torch.export.export(wrapper, tuple(args), dynamic_shapes=shapes, strict=False)
            return program, None
        except Exception as exc:  # noqa: BLE001 - any tracing failure: a static program is still useful
            fallback_reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
            logger.warning(
                "ettr: dynamic-batch export failed (%s); exporting with static shapes", fallback_reason
            )
    try:
        return torch.export.export(wrapper, tuple(args), strict=False), fallback_reason
    except Exception as exc:
        first_line = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        raise PublishError(f"torch.export failed on the model: {type(exc).__name__}: {first_line}") from exc
