"""The trainer's side of publishing: one call at the end of training, then the job shuts down.

    spec = ModelSpec(factory="dlrm.model:Dlrm", config_type="dlrm.model:DlrmConfig", config=asdict(cfg),
                     pythonpath=(examples_dir,))
    config = PublishConfig(anchor_root="ckpt/anchor", queue_dir="publish", model=spec,
                           input_names=("dense", "sparse"))
    publish_at_end(model, step=last_step, config=config, sample_inputs=(dense, kjt))   # collective

`publish_at_end` runs the trained model once on a sample batch (the reference the artifact is verified
against), writes the **anchor checkpoint** — the model's state dict through DCP, every rank its shards,
committed with the checkpoint package's protocol (data durable first, then a manifest, written last and
renamed into place) — and enqueues a publish request. In `standalone` mode that is all: the job ends, and
`ettr publish` builds the artifact in its own process and run directory. In `inside` mode (the baseline
the benchmark compares against) rank 0 builds the artifact before returning while the other ranks wait.
The whole call is recorded as a `Phase.PUBLISH` span of the training job, so its `shutdown` bucket holds
exactly what the job still does.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ettr.constants import SECONDS_PER_DAY
from ettr.events import Phase
from ettr.publish.request import DTYPES, ModelSpec, PublishError, PublishRequest, request_id_for
from ettr.publish.sample import SAMPLE_FILE, encode_sample, flatten_inputs, flatten_outputs, infer_inputs
from ettr.recorder import EventSink
from ettr.run_env import RunEnv

if TYPE_CHECKING:
    from ettr.checkpoint.base import CommittedCheckpoint
    from ettr.publish.queue import PublishQueue

logger = logging.getLogger("ettr")

ANCHOR_STATE_KEY = "model"


class PublishMode(StrEnum):
    """Where the artifact is built."""

    STANDALONE = "standalone"
    """By a separate publisher (`ettr publish`): the training job ends once the anchor is committed."""
    INSIDE = "inside"
    """By rank 0 of the training job before it ends, the other ranks waiting (what standalone replaces)."""


@dataclass(frozen=True, kw_only=True)
class PublishConfig:
    """Where the anchor, the request and the artifact go, and how the publisher rebuilds the model."""

    anchor_root: str | os.PathLike[str]
    """Checkpoint root of anchors (a path or fsspec URL); the anchor of step N is `step_<N>` under it.
    Keep it apart from the periodic checkpoints' root, whose retention would delete it."""
    queue_dir: str | os.PathLike[str]
    """The publish queue directory (`ettr publish QUEUE_DIR`)."""
    model: ModelSpec
    """How the publisher builds the plain model (factory, config) to load the anchor into."""
    input_names: tuple[str, ...] = ()
    """Names of the model's positional inputs (default input0, input1, ...): the program's argument names."""
    mode: PublishMode | str = PublishMode.STANDALONE
    """`standalone` (enqueue and end) or `inside` (build the artifact before returning)."""
    dtype: str = "float32"
    """`float32`, or `bfloat16` for the published weights and program."""
    artifact_root: str | os.PathLike[str] | None = None
    """Where artifacts go, one directory per request (default `QUEUE_DIR/artifacts`)."""
    run_root: str | os.PathLike[str] | None = None
    """Where publish jobs' run directories go, one per request (default `QUEUE_DIR/runs`)."""
    rtol: float | None = None
    """Verification tolerance, relative (None: the dtype's default)."""
    atol: float | None = None
    """Verification tolerance, absolute (None: the dtype's default)."""
    job_id: str | None = None
    """The training job's id (default: the recorder's, `ETTR_JOB_ID`, else "job")."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for a remote `anchor_root`."""
    secret: bytes | None = field(default=None, repr=False)
    """HMAC key the anchor's manifest is signed with (None: `ETTR_CHECKPOINT_SECRET` if set, else the
    user's own key ring, `ettr.checkpoint.keys`). A publisher run by the same user finds the key in the same
    ring; one run by another user needs the key (`ETTR_CHECKPOINT_SECRET`) or `--allow-unsigned`."""

    def __post_init__(self) -> None:
        if not os.fspath(self.anchor_root) or not os.fspath(self.queue_dir):
            raise ValueError("anchor_root and queue_dir must name directories")
        try:
            object.__setattr__(self, "mode", PublishMode(self.mode))
        except ValueError:
            raise ValueError(f"mode must be 'standalone' or 'inside', got {self.mode!r}") from None
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.model, ModelSpec):
            raise ValueError(f"model must be a ModelSpec, got {type(self.model).__name__}")
        object.__setattr__(self, "input_names", tuple(self.input_names))


@dataclass(frozen=True)
class AnchorResult:
    """What `publish_at_end` did (the same on every rank)."""

    request_id: str
    step: int
    anchor_path: str
    reused_anchor: bool
    """The anchor of this step was already committed (a job restarted after writing it): not rewritten."""
    artifact_dir: str
    publish_run_dir: str | None
    """The publish job's run directory (`ettr report` it once published); None in inside mode."""
    built: bool
    """Inside mode: rank 0 built the artifact (or found it built). Always False in standalone mode."""
    anchor_made: str = "written"
    """`written`, `linked` (from the committed checkpoint of the step: `checkpoint=`) or `reused`."""
    anchor_fallback: str = ""
    """Why the checkpoint given was not used and the anchor was written ("" otherwise)."""


def _default_recorder() -> EventSink:
    from ettr.runtime import get_recorder

    return get_recorder()


def _plain_keys(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """State-dict keys as the plain model names them: no DDP `module.` or torch.compile `_orig_mod.`."""
    from torch.nn.parallel import DistributedDataParallel

    strip_module = isinstance(model, DistributedDataParallel)
    out = {}
    for key, value in state.items():
        plain = key.removeprefix("module.") if strip_module else key
        plain = plain.replace("._orig_mod.", ".").removeprefix("_orig_mod.")
        out[plain] = value
    return out


@dataclass(frozen=True)
class AnchorMade:
    """How `make_anchor` made the anchor (the same on every rank)."""

    path: str
    how: str
    """`reused` (committed already), `linked` (from the checkpoint: `linked_anchor`) or `written`."""
    fallback: str = ""
    """Why a checkpoint given was not used, and the anchor written instead ("" otherwise)."""
    linked_files: int = 0
    linked_tensors: int = 0
    linked_bytes: int = 0


def write_anchor(
    state: dict[str, Any],
    *,
    step: int,
    anchor_root: str | os.PathLike[str],
    sample: bytes | None,
    extra: dict[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
    secret: bytes | None = None,
) -> tuple[str, bool]:
    """Write and commit the anchor of `step` (`make_anchor` without a checkpoint); (path, reused)."""
    made = make_anchor(
        state,
        step=step,
        anchor_root=anchor_root,
        sample=sample,
        extra=extra,
        storage_options=storage_options,
        secret=secret,
    )
    return made.path, made.how == "reused"


def make_anchor(
    state: dict[str, Any],
    *,
    step: int,
    anchor_root: str | os.PathLike[str],
    sample: bytes | None,
    extra: dict[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
    secret: bytes | None = None,
    checkpoint: CommittedCheckpoint | None = None,
) -> AnchorMade:
    """Make and commit the anchor of `step` (collective when torch.distributed is initialised).

    With `checkpoint` (the committed checkpoint of the same step, `CheckpointManager.committed(step)`) the
    anchor is made from it by hard links (`ettr.publish.linked_anchor`), every tensor proven bit-identical
    to `state`; if anything there does not hold, it is written as below and `fallback` says why.

    Every rank saves its part of `state` (its shards) under key `model`; rank 0 adds `sample` (its
    sample batch file) and commits with a manifest written last (`ettr.checkpoint.commit.commit`). An
    anchor of `step` that is already committed is kept, not rewritten. Returns (path, reused); every
    rank returns only after the commit. The manifest names the job (`extra["job_id"]`) and the root, and
    is signed with `secret` (default: `ETTR_CHECKPOINT_SECRET`, else the user's own key: see
    `ettr.checkpoint.keys`); an anchor already there is reused only if it passes the same admission a
    publisher applies.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ettr.checkpoint.admission import Admission
    from ettr.checkpoint.base import MANIFEST_NAME, CheckpointInvalid, describe_error, step_dir_name
    from ettr.checkpoint.commit import LEASE_PREFIX, commit, root_identity, verify
    from ettr.checkpoint.keys import KeyRing
    from ettr.checkpoint.storage import open_storage

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world_size = dist.get_world_size() if distributed else 1
    storage = open_storage(anchor_root, storage_options)
    name = step_dir_name(step)
    root = root_identity(storage.url)
    ring = KeyRing.open(secret, create=True) if rank == 0 else KeyRing(signing=None)
    decision = [False]
    if rank == 0:
        try:
            verify(storage, name, checksums=False, admit=Admission(ring=ring, root=root, what="anchor"))
            decision[0] = True
        except CheckpointInvalid:
            if storage.list_dir(name):
                logger.warning("ettr: replacing the anchor %s (incomplete or not ours)", storage.path(name))
                storage.remove_tree(name)
    if distributed and world_size > 1:
        dist.broadcast_object_list(decision, src=0)
    if decision[0]:
        return AnchorMade(storage.path(name), "reused")
    fallback = ""
    extra = {"kind": "publish-anchor", **(extra or {})}
    job_id = extra.get("job_id")
    if distributed and world_size > 1:  # every rank must offer the checkpoint, or none links
        offered: list[Any] = [None] * world_size
        dist.all_gather_object(offered, checkpoint is not None)
        if checkpoint is not None and not all(offered):
            checkpoint = None
            fallback = "not every rank has the committed checkpoint of this step"
    if checkpoint is not None:
        from ettr.publish.linked_anchor import link_anchor

        linked = link_anchor(
            state,
            step=step,
            storage=storage,
            source=checkpoint,
            sample=sample,
            extra=extra,
            ring=ring,
            job_id=job_id if isinstance(job_id, str) else None,
        )
        if linked.linked:
            return AnchorMade(
                storage.path(name),
                "linked",
                linked_files=linked.num_files,
                linked_tensors=linked.num_tensors,
                linked_bytes=linked.num_bytes,
            )
        fallback = linked.reason
    try:
        dcp.save({ANCHOR_STATE_KEY: state}, storage_writer=storage.dcp_writer(name), no_dist=not distributed)
    except (Exception, CheckpointException) as exc:  # DCP gathers every rank's failure (a BaseException)
        raise PublishError(
            f"cannot write the anchor {storage.path(name)}: {describe_error(exc)[:500]}"
        ) from exc
    if rank == 0:
        if sample is not None:
            storage.write_atomic(f"{name}/{SAMPLE_FILE}", sample)
        files = [
            entry
            for entry, size in storage.list_dir(name).items()
            if size is not None
            and entry != MANIFEST_NAME
            and not entry.startswith(LEASE_PREFIX)
            and not entry.endswith(".tmp")
        ]
        commit(
            storage,
            step,
            files,
            world_size=world_size,
            extra=extra,
            secret=ring.signing,
            job_id=job_id if isinstance(job_id, str) else None,
        )
        if ring.signing is not None:
            ring.register_root(root)
    if distributed and world_size > 1:
        dist.barrier()  # no rank reports the anchor before it is committed
    return AnchorMade(storage.path(name), "written", fallback=fallback)


def _job_id(config: PublishConfig, recorder: EventSink) -> str:
    """The configured id, else the recorder's, else the run's (`RunEnv`), else "job"."""
    run_env = RunEnv.from_environ()
    return config.job_id or recorder.job_id or (run_env.job_id if run_env else "") or "job"


def publish_at_end(
    model: torch.nn.Module,
    *,
    step: int,
    config: PublishConfig,
    sample_inputs: Sequence[Any],
    recorder: EventSink | None = None,
    state_dict: dict[str, Any] | None = None,
    checkpoint: CommittedCheckpoint | None = None,
) -> AnchorResult:
    """Write the anchor checkpoint of `model` after `step`, enqueue its publish request, and (inside mode)
    build the artifact. Call once, at the end of training, on every rank (collective).

    `sample_inputs` are the model's positional arguments for one batch (tensors and KeyedJaggedTensors);
    every rank passes its own (a sharded model's forward is collective) and rank 0's are kept with the
    trained model's outputs on them. `state_dict` overrides `model.state_dict()` (sharded tensors and
    DTensors are fine: DCP reshards them at load). `checkpoint`: the committed checkpoint of `step` that
    holds this state (`CheckpointManager.committed(step)`, after its final save): the anchor is then made
    from its files by hard links, nothing written twice, once every tensor is proven bit-identical
    (`linked_anchor`); otherwise, or where that fails, it is written (the PUBLISH phase's data says which:
    `anchor_made` = linked / written / reused, `anchor_fallback` = why). Raises PublishError if the anchor cannot be written
    or, inside mode, the artifact cannot be built — training is over, so this is the job's outcome.
    """
    rec = recorder if recorder is not None else _default_recorder()
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    specs = infer_inputs(sample_inputs, config.input_names)
    job_id = _job_id(config, rec)
    anchor_root = _absolute_root(config.anchor_root)
    request_id = request_id_for(job_id, anchor_root, step)
    queue_dir = Path(config.queue_dir)
    artifact_dir = Path(config.artifact_root or queue_dir / "artifacts") / request_id
    inside = config.mode is PublishMode.INSIDE
    run_dir = None if inside else Path(config.run_root or queue_dir / "runs") / request_id
    with rec.phase(Phase.PUBLISH, step=step, mode=str(config.mode)) as span:
        began = time.time()
        outputs = _trained_outputs(model, sample_inputs)
        sample = encode_sample(flatten_inputs(sample_inputs, specs), outputs) if rank == 0 else None
        state = _plain_keys(model, state_dict if state_dict is not None else model.state_dict())
        made = make_anchor(
            state,
            step=step,
            anchor_root=anchor_root,
            sample=sample,
            extra={"job_id": job_id, "request_id": request_id},
            storage_options=config.storage_options,
            secret=config.secret,
            checkpoint=checkpoint,
        )
        anchor_path, reused = made.path, made.how == "reused"
        anchor_s = time.time() - began
        found: dict[str, Any] = {"anchor_made": made.how, "anchor_s": anchor_s}
        if made.fallback:
            found["anchor_fallback"] = made.fallback
        if made.how == "linked":
            found.update(linked_files=made.linked_files, linked_bytes=made.linked_bytes)
        add = getattr(span, "add", None)  # a Recorder's span; another sink's may not take data
        if callable(add):
            add(**found)
        built = False
        failure: BaseException | None = None
        if rank == 0:
            request = PublishRequest(
                request_id=request_id,
                job_id=job_id,
                anchor_root=anchor_root,
                step=step,
                world_size=dist.get_world_size() if distributed else 1,
                model=config.model,
                inputs=specs,
                artifact_dir=os.fspath(artifact_dir.absolute()),
                run_dir=os.fspath(run_dir.absolute()) if run_dir is not None else None,
                train_run_dir=os.fspath(rec.run_dir) if rec.run_dir is not None else None,
                dtype=config.dtype,
                rtol=config.rtol,
                atol=config.atol,
                created_ts=time.time(),
            )
            queue = _enqueue(
                rec,
                queue_dir,
                request,
                anchor_path=anchor_path,
                reused=reused,
                mode=PublishMode(config.mode),
                anchor=found,
            )
            if inside:
                try:
                    built = _build_inside(queue, request)
                except Exception as exc:  # noqa: BLE001 - raised below, after the other ranks are released
                    failure = exc
        if inside and distributed and dist.get_world_size() > 1:
            dist.barrier()  # the other ranks wait for rank 0's build: the idle time inside mode costs
        if failure is not None:
            raise failure
    rec.flush()
    return AnchorResult(
        request_id=request_id,
        step=step,
        anchor_path=anchor_path,
        reused_anchor=reused,
        artifact_dir=os.fspath(artifact_dir.absolute()),
        publish_run_dir=os.fspath(run_dir.absolute()) if run_dir is not None else None,
        built=built,
        anchor_made=made.how,
        anchor_fallback=made.fallback,
    )


def _absolute_root(root: str | os.PathLike[str]) -> str:
    """The anchor root as the publisher must see it: a local path made absolute (it may run elsewhere)."""
    text = os.fspath(root)
    return text if "://" in text else os.path.abspath(text)


def _trained_outputs(model: torch.nn.Module, sample_inputs: Sequence[Any]) -> Any:
    """The trained model's flattened outputs on the sample batch (eval mode, no grad; mode restored)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return flatten_outputs(model(*sample_inputs))
    finally:
        model.train(was_training)


def _enqueue(
    rec: EventSink,
    queue_dir: Path,
    request: PublishRequest,
    *,
    anchor_path: str,
    reused: bool,
    mode: PublishMode,
    anchor: dict[str, Any],
) -> PublishQueue:
    """Enqueue `request` (idempotent) and record a `publish_enqueued` mark; the queue."""
    from ettr.publish.queue import PublishQueue

    queue = PublishQueue(queue_dir)
    enqueued = queue.enqueue(request)
    rec.mark(
        "publish_enqueued",
        request_id=request.request_id,
        anchor=anchor_path,
        queue=os.fspath(queue_dir.absolute()),
        publish_run_dir=request.run_dir,
        enqueued=enqueued,
        reused_anchor=reused,
        mode=str(mode),
        **anchor,
    )
    return queue


def _build_inside(queue: PublishQueue, request: PublishRequest) -> bool:
    """Build the artifact in this process, holding the request's claim so no publisher duplicates it."""
    from ettr.publish.artifact import build_artifact
    from ettr.publish.queue import RequestState

    claim = queue.try_claim(request.request_id, ttl_s=SECONDS_PER_DAY)
    if claim is None:
        return queue.status(request.request_id) is RequestState.DONE
    try:
        result = build_artifact(request)
    except BaseException as exc:
        queue.fail(claim, f"{type(exc).__name__}: {exc}")
        raise
    queue.complete(claim, {"artifact_dir": result.path, "created": result.created, "inside": True})
    return True
