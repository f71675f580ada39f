"""The complete training state: what must be saved so that a resumed job ends bit-identical.

`TrainState` bundles the model, optimizer, LR scheduler, the step, this rank's RNG states (Python,
NumPy's global generator, torch CPU and CUDA) and this rank's data position (any object with
`state_dict`/`load_state_dict`: `ettr.checkpoint.sampler.ResumableSampler`, torchdata's
`StatefulDataLoader`). Model and optimizer go through `torch.distributed.checkpoint.state_dict`, so
DDP/FSDP-sharded modules work and large tensors are written by DCP — except TorchRec's
`DistributedModelParallel` and `KeyedOptimizer`s (`CombinedOptimizer`, the fused optimizer), which that module
does not know (it looks parameters up by name on the wrapper): their own `state_dict()`s are already what
DCP saves (fully qualified names, `ShardedTensor`s for the tables and their optimizer state) and are used
as they are; the small per-rank and scalar parts
are pickled into opaque byte strings (DCP would otherwise deduplicate same-named values across ranks).

Layout of the saved state dict (top-level keys):
    model        DCP model state dict
    optim        DCP optimizer state dict (or `optim_plain`: the pickled `optimizer.state_dict()` of an
                 optimizer that has no state yet — asking DCP for it would run a zero step and change it)
    scheduler    pickled `lr_scheduler.state_dict()`
    meta         pickled {"step", "world_size"}
    extra        user Statefuls (replicated across ranks), through DCP as they are
    rank_<r>     pickled {"rng", "data"} of rank r
"""

from __future__ import annotations

import io
import logging
import random
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from ettr.checkpoint.trust import load_pickled

logger = logging.getLogger("ettr")

STATE_FORMAT = 1


def _is_torchrec(obj: Any, class_name: str) -> bool:
    """Whether `obj` is an instance of TorchRec's class `class_name` (by its MRO: TorchRec is not imported)."""
    return any(
        cls.__name__ == class_name and cls.__module__.startswith("torchrec.") for cls in type(obj).__mro__
    )


def _native_model(model: torch.nn.Module) -> bool:
    """TorchRec's DistributedModelParallel: `get_state_dict` fails on it, its own state_dict is DCP's form."""
    return _is_torchrec(model, "DistributedModelParallel")


def _native_optimizer(optimizer: Any) -> bool:
    """A TorchRec KeyedOptimizer: state keyed by parameter name (ShardedTensors for the tables), always
    allocated, loaded in place by its own `load_state_dict`."""
    return _is_torchrec(optimizer, "KeyedOptimizer")


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _loads(data: bytes, allowed: tuple[Any, ...] = ()) -> Any:
    """Unpickle one of the small pickled parts with `weights_only=True` (tensors, containers, numbers,
    strings, NumPy's RNG state, and the classes in `allowed`: `CheckpointConfig.safe_globals`). Anything
    else is refused (`trust.UnsafePickle`), whoever signed the checkpoint: nothing in it runs as code."""
    return load_pickled(io.BytesIO(data), allowed)


def capture_rng() -> dict[str, Any]:
    """The global random states of this process: Python, NumPy (if installed), torch CPU and CUDA."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Set the global random states captured by `capture_rng`."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _require_stateful(what: str, obj: Any) -> None:
    """Refuse, at construction, a part that cannot be saved or restored: otherwise every save fails at run
    time (`checkpoint ... could not start (AttributeError ...)`) while training goes on, and a restart
    resumes from nothing. torch's `DistributedSampler`, the usual one in DDP scripts, is such a part."""
    if obj is None:
        return
    missing = [m for m in ("state_dict", "load_state_dict") if not callable(getattr(obj, m, None))]
    if missing:
        hint = (
            "; for a sampler use ettr.checkpoint.ResumableSampler(len(dataset), seed=..., rank=..., "
            "world_size=...) (its position is saved), or torchdata's StatefulDataLoader"
            if what == "data"
            else ""
        )
        raise TypeError(
            f"TrainState({what}=...): {type(obj).__name__} has no {' or '.join(missing)}, so it cannot be "
            f"checkpointed{hint}"
        )


class TrainState:
    """Everything a training job needs to continue exactly where it was.

    Args:
        model: the module (plain, DDP, FSDP, or TorchRec's DistributedModelParallel).
        optimizer: its optimizer (for TorchRec, a KeyedOptimizer such as CombinedOptimizer), or None.
        lr_scheduler: an LR scheduler (anything with state_dict/load_state_dict), or None.
        data: this rank's data position (a `ResumableSampler`, a `StatefulDataLoader`, ...), or None.
        extra: more Statefuls saved as they are (replicated: every rank holds the same values).
        rank: this process's rank (default: torch.distributed's, else 0).
        capture_rng_states: save and restore the global RNG states (turn off only if the job seeds its
            own generators and keeps them in `data`/`extra`).
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any = None,
        data: Stateful | None = None,
        extra: Mapping[str, Stateful] | None = None,
        rank: int | None = None,
        capture_rng_states: bool = True,
    ) -> None:
        for what, obj in (
            ("lr_scheduler", lr_scheduler),
            ("data", data),
            *((f"extra[{name!r}]", v) for name, v in (extra or {}).items()),
        ):
            _require_stateful(what, obj)
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.data = data
        self.extra = dict(extra or {})
        self._rank = rank
        self.capture_rng_states = capture_rng_states

    @property
    def rank(self) -> int:
        if self._rank is not None:
            return self._rank
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def _rank_key(self) -> str:
        return f"rank_{self.rank}"

    def state_dict(self, step: int, *, world_size: int = 1) -> dict[str, Any]:
        """The state to save after optimizer step `step` (tensors are the live ones: stage before mutating)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        state: dict[str, Any] = {}
        if _native_model(self.model):
            state["model"] = self.model.state_dict()
            if self.optimizer is not None and _native_optimizer(self.optimizer):
                state["optim"] = self.optimizer.state_dict()
            elif self.optimizer is not None:
                state["optim_plain"] = _dumps(self.optimizer.state_dict())
        elif self.optimizer is not None and self.optimizer.state:
            state["model"], state["optim"] = get_state_dict(self.model, self.optimizer)
        else:
            state["model"] = get_model_state_dict(self.model)
            if self.optimizer is not None:
                state["optim_plain"] = _dumps(self.optimizer.state_dict())
        if self.lr_scheduler is not None:
            state["scheduler"] = _dumps(self.lr_scheduler.state_dict())
        state["meta"] = _dumps({"step": step, "world_size": world_size, "format": STATE_FORMAT})
        if self.extra:
            state["extra"] = {name: obj.state_dict() for name, obj in self.extra.items()}
        per_rank: dict[str, Any] = {}
        if self.capture_rng_states:
            per_rank["rng"] = capture_rng()
        if self.data is not None:
            per_rank["data"] = self.data.state_dict()
        state[self._rank_key()] = _dumps(per_rank)
        return state

    def load_target(self, saved_keys: set[str]) -> dict[str, Any]:
        """The state dict DCP loads into, given the top-level keys the checkpoint holds.

        Tensors in it are the live ones (DCP loads in place); byte strings are placeholders DCP replaces.
        """
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        target: dict[str, Any] = {}
        if _native_model(self.model):
            target["model"] = self.model.state_dict()
            if self.optimizer is not None and "optim" in saved_keys and _native_optimizer(self.optimizer):
                target["optim"] = self.optimizer.state_dict()
            elif self.optimizer is not None and "optim_plain" in saved_keys:
                target["optim_plain"] = b""
        elif self.optimizer is not None and "optim" in saved_keys:
            # Allocates the optimizer's state (a zero step at lr 0) so that DCP has tensors to load into.
            target["model"], target["optim"] = get_state_dict(self.model, self.optimizer)
        else:
            target["model"] = get_model_state_dict(self.model)
            if self.optimizer is not None and "optim_plain" in saved_keys:
                target["optim_plain"] = b""
        if self.lr_scheduler is not None and "scheduler" in saved_keys:
            target["scheduler"] = b""
        target["meta"] = b""
        if self.extra and "extra" in saved_keys:
            target["extra"] = {name: obj.state_dict() for name, obj in self.extra.items()}
        if self._rank_key() in saved_keys:
            target[self._rank_key()] = b""
        return target

    def load(self, loaded: dict[str, Any], *, allowed: tuple[Any, ...] = ()) -> int:
        """Apply a state dict DCP loaded into `load_target`'s result; returns the step it was saved at.
        Its pickled parts load with `weights_only=True`, accepting also the classes in `allowed`."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if _native_model(self.model):
            self.model.load_state_dict(loaded["model"])
            if "optim" in loaded and self.optimizer is not None and _native_optimizer(self.optimizer):
                self.optimizer.load_state_dict(loaded["optim"])
            elif "optim_plain" in loaded and self.optimizer is not None:
                self.optimizer.load_state_dict(_loads(loaded["optim_plain"], allowed))
        elif "optim" in loaded and self.optimizer is not None:
            set_state_dict(
                self.model, self.optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
            )
        else:
            set_model_state_dict(self.model, loaded["model"])
            if "optim_plain" in loaded and self.optimizer is not None:
                self.optimizer.load_state_dict(_loads(loaded["optim_plain"], allowed))
        if "scheduler" in loaded and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(_loads(loaded["scheduler"], allowed))
        if "extra" in loaded:
            for name, obj in self.extra.items():
                if name in loaded["extra"]:
                    obj.load_state_dict(loaded["extra"][name])
        meta = _loads(loaded["meta"], allowed)
        key = self._rank_key()
        if key in loaded:
            per_rank = _loads(loaded[key], allowed)
            if self.data is not None and "data" in per_rank:
                self.data.load_state_dict(per_rank["data"])
            if self.capture_rng_states and "rng" in per_rank:
                restore_rng(per_rank["rng"])
        else:
            logger.warning(
                "ettr: the checkpoint has no RNG state or data position for rank %d (saved with %s ranks); "
                "this rank starts them afresh",
                self.rank,
                meta.get("world_size"),
            )
        return int(meta["step"])


def saved_top_level_keys(metadata: Any) -> set[str]:
    """Top-level keys of a DCP checkpoint, from its `Metadata` (keys are flattened as `model.layer.weight`)."""
    return {fqn.split(".", 1)[0] for fqn in metadata.state_dict_metadata}
