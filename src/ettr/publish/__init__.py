"""Standalone model publishing: the training job writes an anchor checkpoint and ends; a publisher turns it
into an inference artifact in its own process. See `docs/publishing.md`.

Trainer side: `publish_at_end` (with a `PublishConfig` and a `ModelSpec`). Publisher side: `PublishWorker`
(what `ettr publish` runs) over a `PublishQueue`, within a `PublishPolicy` (docs/trust.md). Artifacts: `load_artifact`.
"""

from ettr.publish.anchor import AnchorResult, PublishConfig, PublishMode, publish_at_end, write_anchor
from ettr.publish.artifact import ArtifactResult, PublishedModel, build_artifact, load_artifact
from ettr.publish.policy import PublishPolicy
from ettr.publish.queue import Claim, PublishQueue
from ettr.publish.request import InputKind, InputSpec, ModelSpec, PublishError, PublishRequest
from ettr.publish.worker import PublishOutcome, PublishWorker, WorkerConfig

__all__ = [
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
