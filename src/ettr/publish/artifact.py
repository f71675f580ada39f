"""Building the inference artifact of one publish request, and loading one.

An artifact is a directory:

    model.pt2            torch.export program: plain tensors in (config.json says which), outputs out
    model.safetensors    the trained weights under the model's own names (optionally bfloat16)
    config.json          the model's config, factory, inputs, dtype, and where it came from
    publish-sample.safetensors   the sample batch and the trained model's outputs on it
    artifact.json        written last: every file's size and SHA-256, and how the program verified

`build_artifact` loads the anchor into the plain model on CPU (DCP reshards whatever the ranks wrote),
checks it reproduces the trained model's outputs, exports it, runs the exported program — reloaded from
disk — on the sample and compares again, writes everything into a temporary directory and renames that
into place. The rename is the commit: an artifact appears whole or not at all, and a second build of the
same request finds it there (or loses the rename race) and yields the same single artifact.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ettr.atomic import atomic_write, fsync_dir, fsync_file
from ettr.procs import pid_alive
from ettr.publish.request import PublishError, PublishRequest, ResolvedCheck
from ettr.publish.sample import (
    SAMPLE_FILE,
    Comparison,
    batch_size,
    compare,
    decode_sample,
    flatten_outputs,
    slice_batch,
    tolerances,
)
from ettr.untrusted import loads_bounded, open_regular, remove_tree, whole_number

logger = logging.getLogger("ettr")

ARTIFACT_FORMAT = "ettr.publish-artifact/1"
PROGRAM_FILE = "model.pt2"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
MANIFEST_FILE = "artifact.json"
MAX_JSON_FILE_BYTES = 16 << 20
"""An artifact's manifest or config larger than this is not one ettr wrote (they are a few KB): refused
unread. The artifact directory lies under the publisher's roots, which requesters can write."""

Stage = Callable[[str], AbstractContextManager[Any]]
"""Called around each stage of a build (`load`, `export`, `verify`, `write`, `commit`): records it."""


@contextlib.contextmanager
def _no_stage(name: str) -> Iterator[None]:
    yield


class LostClaim(Exception):
    """Another publisher took the request over while this one built it; this build was discarded."""


@dataclass(frozen=True, kw_only=True)
class ArtifactResult:
    """What a build produced."""

    path: str
    created: bool
    """True if this build wrote the artifact; False if it was already there (an earlier or parallel build)."""
    manifest: dict[str, Any]


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The manifest of a complete artifact directory, or None if there is none."""
    try:
        body = loads_bounded(_read(Path(path) / MANIFEST_FILE, MAX_JSON_FILE_BYTES))
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None  # not JSON, NaN, nested 100,000 deep (a RecursionError out of the publisher): none
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EFBIG):  # a FIFO, device or directory, or 10 GB: no manifest
            return None
        raise
    return body if isinstance(body, dict) and body.get("format") == ARTIFACT_FORMAT else None


def _read(path: Path, max_bytes: int | None = None) -> bytes:
    """The bytes of the regular file `path` (never a wait in a FIFO someone put in the artifact); more than
    `max_bytes` of them raise OSError (EFBIG) without being read."""
    with os.fdopen(open_regular(path, follow_symlinks=True), "rb") as f:
        data = f.read() if max_bytes is None else f.read(max_bytes + 1)
    if max_bytes is not None and len(data) > max_bytes:
        raise OSError(errno.EFBIG, f"larger than {max_bytes} bytes", str(path))
    return data


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _metadata(reader: Any) -> Any:
    from ettr.checkpoint.base import CheckpointInvalid

    try:
        return reader.read_metadata()
    except (CheckpointInvalid, OSError) as exc:
        raise PublishError(f"anchor metadata refused: {exc}") from None


def load_anchor(
    request: PublishRequest, check_resolved: ResolvedCheck | None = None, *, allow_unsigned: bool = False
) -> tuple[torch.nn.Module, dict[str, torch.Tensor], dict[str, torch.Tensor], list[str]]:
    """Build the plain model and load the anchor into it (resharded to this one process, on CPU).

    The anchor must verify (sizes, CRC-32s) and be signed with a key of the publisher's ring
    (`ETTR_CHECKPOINT_SECRET`, or its key directory), unless `allow_unsigned`
    (or `ETTR_CHECKPOINT_ALLOW_UNSIGNED=1`); either way nothing in it is unpickled as code (the exact
    allow-list of `.metadata`, `weights_only=True` for every pickled object). Returns (model in eval
    mode, sample inputs, the trained model's outputs, anchor keys the model did not use). Holds a lease
    on the anchor while reading it, so retention cannot delete it underneath.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ettr.checkpoint.admission import ALLOW_UNSIGNED_ENV, Admission, env_flag
    from ettr.checkpoint.base import CheckpointInvalid, describe_error, step_dir_name
    from ettr.checkpoint.commit import lease, root_identity, verify
    from ettr.checkpoint.keys import KeyRing
    from ettr.checkpoint.storage import open_storage
    from ettr.checkpoint.trust import SafeLoadPlanner, verified_reader

    storage = open_storage(request.anchor_root)
    name = step_dir_name(request.step)
    admission = Admission(
        ring=KeyRing.open(create=False),
        root=root_identity(storage.url),
        allow_unsigned=allow_unsigned or env_flag(ALLOW_UNSIGNED_ENV),
        resume_foreign=True,  # the request names the anchor's root: where it was written is not asked
        what="anchor",
    )
    if name not in storage.list_dir(""):  # taking the lease would make an empty anchor directory there
        raise PublishError(
            f"anchor {storage.path(name)} is not usable: it does not exist (deleted, e.g. by the retention "
            "of periodic checkpoints sharing its root, or never written)"
        )
    with lease(storage, name):
        try:
            manifest = verify(storage, name, checksums=True, admit=admission)
        except (CheckpointInvalid, OSError) as exc:
            raise PublishError(f"anchor {storage.path(name)} is not usable: {exc}") from None
        model = request.model.build(check_resolved)
        if not isinstance(model, torch.nn.Module):
            raise PublishError(f"{request.model.factory} returned a {type(model).__name__}, not an nn.Module")
        model = model.to("cpu").eval()
        target = model.state_dict()
        reader = verified_reader(storage, name, manifest)
        prefix = f"{request.state_key}."
        saved = {
            fqn[len(prefix) :] for fqn in _metadata(reader).state_dict_metadata if fqn.startswith(prefix)
        }
        try:
            dcp.load(
                {request.state_key: target},
                storage_reader=verified_reader(storage, name, manifest),
                planner=SafeLoadPlanner(),
                no_dist=True,
            )
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException; say it in one line
            raise PublishError(
                f"cannot load anchor {storage.path(name)} into the model of {request.model.factory}: "
                f"{describe_error(exc)[:500]}"
            ) from None
        model.load_state_dict(target)
        inputs, expected = decode_sample(storage.read_bytes(f"{name}/{SAMPLE_FILE}"))
    unused = sorted(saved - set(target))
    return model, inputs, expected, unused


def _weights_for_safetensors(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, value in state.items():
        tensor = value.detach()
        if tensor.is_floating_point():
            tensor = tensor.to(dtype)
        tensor = tensor.contiguous()
        if tensor.data_ptr() in seen:  # safetensors refuses tensors that share memory
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        out[key] = tensor
    return out


def build_artifact(
    request: PublishRequest,
    *,
    stage: Stage = _no_stage,
    still_owner: Callable[[], bool] = lambda: True,
    check_resolved: ResolvedCheck | None = None,
    allow_unsigned: bool = False,
) -> ArtifactResult:
    """Publish `request`: the artifact directory at `request.artifact_dir`, built once.

    If a complete artifact is already there, returns it (`created=False`) without building. Raises
    PublishError when the anchor or model is unusable or the exported program does not reproduce the
    trained model's outputs; LostClaim if `still_owner()` turns False before the commit (nothing is
    written then). `check_resolved` vets the imported factory and config type (a publisher's policy);
    `allow_unsigned` loads an anchor the publisher's key ring cannot authenticate (`load_anchor`).
    """
    from ettr.publish.torchrec_export import (
        PlainInputs,
        detach_views,
        export_program,
        set_output_dtype,
        to_exportable,
    )

    final = Path(request.artifact_dir)
    existing = read_manifest(final)
    if existing is not None:
        return ArtifactResult(path=str(final), created=False, manifest=existing)
    dtype = torch.bfloat16 if request.dtype == "bfloat16" else torch.float32
    rtol, atol = tolerances(request.dtype, request.rtol, request.atol)
    begin_ts = time.time()

    with stage("load"):
        model, inputs, expected, unused, loaded = _load_checked(
            request, check_resolved, allow_unsigned=allow_unsigned
        )
        specs = request.inputs
        args = [inputs[name] for spec in specs for name in spec.tensor_names]
        weights = _weights_for_safetensors(model.state_dict(), dtype)

    with stage("export"):
        exportable = to_exportable(model)
        if dtype != torch.float32:
            exportable = exportable.to(dtype)
            set_output_dtype(exportable, dtype)
        for parameter in exportable.parameters():
            parameter.requires_grad_(False)
        detach_views(exportable)
        wrapper = PlainInputs(exportable, specs, dtype).eval()
        num_samples = batch_size(inputs, specs)
        with torch.no_grad():
            program, static_reason = export_program(
                wrapper, args, specs, dynamic_batch=num_samples is not None and num_samples >= 2
            )

    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_builds(final)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        with stage("verify"):
            # The program is reloaded from the bytes this build wrote, never from the file: the file lies
            # under the roots, which requesters can write, and torch.export.load unpickles.
            saved = io.BytesIO()
            torch.export.save(program, saved)
            atomic_write(tmp / PROGRAM_FILE, saved.getvalue())
            exported, sub_batch = _verify_saved_program(
                io.BytesIO(saved.getvalue()),
                wrapper,
                inputs,
                expected,
                specs,
                num_samples,
                static_reason,
                rtol,
                atol,
            )

        with stage("write"):
            _write_files(tmp, request, weights, inputs, expected, specs, static_reason)
            verification = {
                "loaded_model": loaded.to_json(),
                "exported_program": exported.to_json(),
                "sub_batch": sub_batch.to_json() if sub_batch is not None else None,
                "num_samples": num_samples,
            }
            manifest = _write_manifest(tmp, request, verification, unused, time.time() - begin_ts)

        with stage("commit"):
            if not still_owner():
                raise LostClaim(f"request {request.request_id} was taken over by another publisher")
            try:
                os.rename(tmp, final)
            except OSError:
                existing = read_manifest(final)
                if existing is None:
                    raise
                # A parallel build committed first.
                return ArtifactResult(path=str(final), created=False, manifest=existing)
            fsync_dir(final.parent)
    finally:
        if tmp.exists():
            _remove_quietly(tmp)
    return ArtifactResult(path=str(final), created=True, manifest=manifest)


def _load_checked(
    request: PublishRequest, check_resolved: ResolvedCheck | None = None, *, allow_unsigned: bool = False
) -> tuple[torch.nn.Module, dict[str, torch.Tensor], dict[str, torch.Tensor], list[str], Comparison]:
    """The model rebuilt from the anchor, checked against the trained model's outputs on the sample."""
    model, inputs, expected, unused = load_anchor(request, check_resolved, allow_unsigned=allow_unsigned)
    with torch.no_grad():
        outputs = flatten_outputs(model(*_model_args(inputs, request.inputs)))
    rtol32, atol32 = tolerances("float32")
    loaded = compare(outputs, expected, rtol=rtol32, atol=atol32)
    if not loaded.ok:
        raise PublishError(
            f"the model built by {request.model.factory} from the anchor does not reproduce the trained "
            f"model's outputs ({loaded.detail}); does the factory build the model that was trained?"
        )
    return model, inputs, expected, unused, loaded


def _verify_saved_program(
    path: Path | io.BytesIO,
    wrapper: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    specs: Any,
    num_samples: int | None,
    static_reason: str | None,
    rtol: float,
    atol: float,
) -> tuple[Comparison, Comparison | None]:
    """The saved program, loaded back, against the trained outputs (and on half the batch when dynamic)."""
    args = [inputs[name] for spec in specs for name in spec.tensor_names]
    reloaded = torch.export.load(path).module()
    with torch.no_grad():
        exported = compare(flatten_outputs(reloaded(*args)), expected, rtol=rtol, atol=atol)
        sub_batch = _check_sub_batch(reloaded, wrapper, inputs, specs, num_samples, static_reason, rtol, atol)
    if not exported.ok:
        raise PublishError(
            f"the exported program does not reproduce the trained model's outputs ({exported.detail}; "
            f"rtol {rtol}, atol {atol})"
        )
    if sub_batch is not None and not sub_batch.ok:
        raise PublishError(f"the exported program is wrong on a smaller batch ({sub_batch.detail})")
    return exported, sub_batch


def _remove_dead_builds(final: Path) -> None:
    """Delete temporary directories of builds of `final` whose process is gone (a publisher that died)."""
    for leftover in final.parent.glob(f".{final.name}.tmp-*"):
        pid = whole_number(leftover.name.rsplit(".tmp-", 1)[1].split("-", 1)[0])
        if pid is not None and not pid_alive(pid, None):
            _remove_quietly(leftover)


def _remove_quietly(path: Path) -> None:
    """Delete a build's directory if it can be, without recursion (`ettr.untrusted.remove_tree`): whoever
    writes the publish root could plant a leftover nested thousands deep, and `shutil.rmtree`'s
    RecursionError then failed every request for that artifact."""
    with contextlib.suppress(OSError):
        remove_tree(path)


def _model_args(inputs: dict[str, torch.Tensor], specs: Any) -> list[Any]:
    from ettr.publish.sample import unflatten_inputs

    return unflatten_inputs(inputs, specs)


def _check_sub_batch(
    program: Any,
    wrapper: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    specs: Any,
    num_samples: int | None,
    static_reason: str | None,
    rtol: float,
    atol: float,
) -> Comparison | None:
    """The dynamic-batch program on half the sample vs the eager model on it (None if the batch is static)."""
    if static_reason is not None or num_samples is None or num_samples < 2:
        return None
    half = slice_batch(inputs, specs, num_samples // 2)
    args = [half[name] for spec in specs for name in spec.tensor_names]
    return compare(flatten_outputs(program(*args)), flatten_outputs(wrapper(*args)), rtol=rtol, atol=atol)


def _write_files(
    tmp: Path,
    request: PublishRequest,
    weights: dict[str, torch.Tensor],
    inputs: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    specs: Any,
    static_reason: str | None,
) -> None:
    from safetensors.torch import save_file

    from ettr.publish.sample import encode_sample

    save_file(weights, str(tmp / WEIGHTS_FILE), metadata={"dtype": request.dtype, "step": str(request.step)})
    atomic_write(tmp / SAMPLE_FILE, encode_sample(inputs, expected))
    program_inputs = [
        {
            "name": name,
            "dtype": str(inputs[name].dtype).removeprefix("torch."),
            "shape": list(inputs[name].shape),
        }
        for spec in specs
        for name in spec.tensor_names
    ]
    config = {
        "format": ARTIFACT_FORMAT,
        "model": request.model.to_json(),
        "dtype": request.dtype,
        "inputs": [spec.to_json() for spec in specs],
        "program_inputs": program_inputs,
        "outputs": sorted(expected, key=int),
        "dynamic_batch": static_reason is None,
        "static_reason": static_reason,
        "source": {
            "job_id": request.job_id,
            "step": request.step,
            "anchor_root": request.anchor_root,
            "world_size": request.world_size,
            "request_id": request.request_id,
        },
    }
    atomic_write(tmp / CONFIG_FILE, json.dumps(config, indent=1) + "\n")


def _write_manifest(
    tmp: Path, request: PublishRequest, verification: dict[str, Any], unused: list[str], build_s: float
) -> dict[str, Any]:
    files = {}
    for path in sorted(tmp.iterdir()):
        fsync_file(path)  # the files the libraries wrote (program, weights); ours are fsync'd already
        files[path.name] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    manifest = {
        "format": ARTIFACT_FORMAT,
        "request_id": request.request_id,
        "job_id": request.job_id,
        "step": request.step,
        "dtype": request.dtype,
        "files": files,
        "verification": verification,
        "unused_anchor_keys": unused,
        "build_s": build_s,
        "created_ts": time.time(),
    }
    atomic_write(tmp / MANIFEST_FILE, json.dumps(manifest, indent=1) + "\n")  # fsyncs it and `tmp`
    return manifest


@dataclass
class PublishedModel:
    """A loaded artifact: needs torch and safetensors only (no training code, no TorchRec)."""

    path: Path
    program: torch.export.ExportedProgram
    weights: dict[str, torch.Tensor]
    config: dict[str, Any]
    manifest: dict[str, Any]
    sample_inputs: list[torch.Tensor]
    """The sample batch, in the program's argument order."""
    expected_outputs: dict[str, torch.Tensor]
    """The trained model's outputs on the sample batch."""

    def __call__(self, *tensors: torch.Tensor) -> Any:
        """Run the program on plain tensors (in `config["program_inputs"]` order)."""
        with torch.no_grad():
            return self.program.module()(*tensors)

    def check(self) -> Comparison:
        """Run the sample batch and compare with the trained model's outputs (the build's tolerances)."""
        rtol, atol = tolerances(self.config["dtype"])
        tolerance = self.manifest["verification"]["exported_program"]
        return compare(
            flatten_outputs(self(*self.sample_inputs)),
            self.expected_outputs,
            rtol=tolerance.get("rtol", rtol),
            atol=tolerance.get("atol", atol),
        )


def load_artifact(path: str | os.PathLike[str], *, check_files: bool = True) -> PublishedModel:
    """Load a published artifact. With `check_files`, every file's SHA-256 is checked against the manifest.

    Raises PublishError for a directory that is not a complete artifact or whose files were changed.
    """
    from safetensors.torch import load_file

    root = Path(path)
    manifest = read_manifest(root)
    if manifest is None:
        raise PublishError(f"{root} is not a published artifact (no valid {MANIFEST_FILE})")
    if check_files:
        for name, entry in manifest["files"].items():
            if not (root / name).is_file() or _sha256(root / name) != entry["sha256"]:
                raise PublishError(f"{root / name} is missing or changed since it was published")
    config = json.loads(_read(root / CONFIG_FILE))
    inputs, expected = decode_sample(_read(root / SAMPLE_FILE))
    return PublishedModel(
        path=root,
        program=torch.export.load(root / PROGRAM_FILE),
        weights=load_file(str(root / WEIGHTS_FILE)),
        config=config,
        manifest=manifest,
        sample_inputs=[inputs[entry["name"]] for entry in config["program_inputs"]],
        expected_outputs=expected,
    )
