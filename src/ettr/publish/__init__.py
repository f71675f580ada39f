"""Standalone model publishing: the training job writes an anchor checkpoint and ends; a publisher turns it
into an inference artifact in its own process. See `docs/publishing.md`.

Trainer side: `publish_at_end` (with a `PublishConfig` and a `ModelSpec`). Publisher side: `PublishWorker`
(what `ettr publish` runs) over a `PublishQueue`, within a `PublishPolicy` (docs/trust.md). Artifacts: `load_artifact`.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ettr.publish.anchor import AnchorResult, PublishConfig, PublishMode, publish_at_end, write_anchor
    from ettr.publish.artifact import ArtifactResult, PublishedModel, build_artifact, load_artifact
    from ettr.publish.policy import PublishPolicy
    from ettr.publish.queue import Claim, PublishQueue
    from ettr.publish.request import InputKind, InputSpec, ModelSpec, PublishError, PublishRequest
    from ettr.publish.worker import PublishOutcome, PublishWorker, WorkerConfig

_EXPORTS = {
    "ettr.publish.anchor": ("AnchorResult", "PublishConfig", "PublishMode", "publish_at_end", "write_anchor"),
    "ettr.publish.artifact": ("ArtifactResult", "PublishedModel", "build_artifact", "load_artifact"),
    "ettr.publish.policy": ("PublishPolicy",),
    "ettr.publish.queue": ("Claim", "PublishQueue"),
    "ettr.publish.request": ("InputKind", "InputSpec", "ModelSpec", "PublishError", "PublishRequest"),
    "ettr.publish.worker": ("PublishOutcome", "PublishWorker", "WorkerConfig"),
}
"""Each public name by the module it lives in (as the type checker's imports above): imported on first use, so
`ettr publish` (and a queue's tools) check their arguments before the trainer side's torch is imported."""

_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'ettr.publish' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [  # static, for the type checker and linters: the names of `_EXPORTS`
    "AnchorResult",
    "ArtifactResult",
    "Claim",
    "InputKind",
    "InputSpec",
    "ModelSpec",
    "PublishConfig",
    "PublishError",
    "PublishMode",
    "PublishOutcome",
    "PublishPolicy",
    "PublishQueue",
    "PublishRequest",
    "PublishWorker",
    "PublishedModel",
    "WorkerConfig",
    "build_artifact",
    "load_artifact",
    "publish_at_end",
    "write_anchor",
]
