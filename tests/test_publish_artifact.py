"""Publishing in one process: the anchor, the artifact, idempotency, verification, and the publish job's books.

Small models (a Linear layer, an unsharded DLRM) keep these fast; the multi-rank sharded case and real
publisher processes are in `test_publish_dlrm.py` and `test_publish_process.py`.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from ettr.accounting import compute
from ettr.checkpoint.commit import verify
from ettr.checkpoint.storage import open_storage
from ettr.events import EventKind, Phase
from ettr.ledger import open_ledger
from ettr.publish import (
    ModelSpec,
    PublishConfig,
    PublishError,
    PublishQueue,
    PublishWorker,
    build_artifact,
    load_artifact,
    publish_at_end,
)
from ettr.publish.artifact import LostClaim, read_manifest
from ettr.publish.policy import PublishPolicy
from ettr.publish.sample import SAMPLE_FILE
from ettr.recorder import Recorder

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def allow_torch_nn(queue_dir) -> PublishPolicy:
    """The publisher's policy these tests run under: torch.nn layers, paths under the queue's parent."""
    return PublishPolicy.for_queue(queue_dir, allow=["torch.nn.*"], entry_points=False)


LINEAR = ModelSpec(factory="torch.nn:Linear", config={"in_features": 4, "out_features": 3})


def linear_job(tmp_path: Path, *, mode: str = "standalone", spec: ModelSpec = LINEAR, step: int = 5):
    """A trained Linear 'job' that publishes at its end; returns (result, config, training run dir)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    run_dir = tmp_path / "train-run"
    recorder = Recorder(open_ledger(run_dir), run_dir=run_dir, job_id="train-1")
    config = PublishConfig(
        anchor_root=tmp_path / "anchors",
        queue_dir=tmp_path / "queue",
        model=spec,
        input_names=("x",),
        mode=mode,
    )
    try:
        result = publish_at_end(
            model, step=step, config=config, sample_inputs=(torch.randn(6, 4),), recorder=recorder
        )
    finally:
        recorder.close()
    return result, config, run_dir, model


def test_standalone_publish_leaves_the_work_to_the_publisher_and_builds_one_artifact(tmp_path):
    result, config, train_run, model = linear_job(tmp_path)
    queue = PublishQueue(config.queue_dir)
    # The training side only wrote the anchor and the request: nothing was built yet.
    assert queue.status(result.request_id) == "pending" and not Path(result.artifact_dir).exists()
    storage = open_storage(config.anchor_root)
    manifest = verify(storage, "step_000000005")
    assert SAMPLE_FILE in manifest.files and manifest.extra["kind"] == "publish-anchor"

    events = open_ledger(train_run).read()
    spans = [e for e in events if e.kind is EventKind.PHASE_END and e.phase is Phase.PUBLISH]
    assert len(spans) == 1 and spans[0].step == 5
    marks = [e.data for e in events if e.kind is EventKind.MARK]
    assert marks[0]["name"] == "publish_enqueued" and marks[0]["request_id"] == result.request_id

    worker = PublishWorker(config.queue_dir, policy=allow_torch_nn(config.queue_dir))
    (outcome,) = worker.drain()
    assert outcome.status == "published" and outcome.artifact_dir == result.artifact_dir
    assert worker.drain() == []  # processed once: nothing left
    published = load_artifact(result.artifact_dir)
    assert published.check().ok
    x = torch.randn(9, 4)  # any batch size: the program's batch is dynamic
    torch.testing.assert_close(published(x), model(x).detach(), rtol=1e-5, atol=1e-6)
    assert torch.equal(published.weights["weight"], model.weight.detach())

    # Processing the same request again, or enqueueing its anchor again, yields the same single artifact.
    request = queue.load(result.request_id)
    again = build_artifact(request)
    assert again.created is False and again.manifest == read_manifest(result.artifact_dir)
    assert queue.enqueue(request) is False
    assert sorted(p.name for p in Path(result.artifact_dir).parent.iterdir()) == [result.request_id]

    # The publish job's books: its own job, linked to the training job, with the build's stages.
    publish_events = open_ledger(result.publish_run_dir).read()
    start = next(e for e in publish_events if e.kind is EventKind.SUPERVISOR_START)
    assert start.data["job_id"] == f"publish-{result.request_id}" and start.data["linked_job"] == "train-1"
    stages = [e.data["stage"] for e in publish_events if e.kind is EventKind.PHASE_END]
    assert stages == ["load", "export", "verify", "write", "commit"]
    report = compute(publish_events, max(e.ts for e in publish_events), job_id=start.data["job_id"])
    assert [a.outcome for a in report.attempts] == ["completed"] and report.num_failures == 0
    assert report.buckets_s["restore"] > 0
    assert sum(report.buckets_s.values()) == pytest.approx(report.wall_s)


def test_inside_mode_builds_before_returning_and_no_publisher_repeats_it(tmp_path):
    result, config, _, _ = linear_job(tmp_path, mode="inside")
    assert result.built and result.publish_run_dir is None
    assert load_artifact(result.artifact_dir).check().ok
    assert PublishQueue(config.queue_dir).status(result.request_id) == "done"
    assert PublishWorker(config.queue_dir, policy=allow_torch_nn(config.queue_dir)).drain() == []


def test_an_anchor_already_committed_is_reused_and_an_incomplete_one_replaced(tmp_path):
    first, config, _, _ = linear_job(tmp_path)
    second, _, _, _ = linear_job(tmp_path)
    assert not first.reused_anchor and second.reused_anchor and second.request_id == first.request_id
    storage = open_storage(config.anchor_root)
    # A crash mid-write left step 6 without a manifest: it is written afresh, and committed.
    (Path(storage.path("step_000000006"))).mkdir()
    (Path(storage.path("step_000000006")) / "__0_0.distcp").write_bytes(b"half")
    third, _, _, _ = linear_job(tmp_path, step=6)
    assert not third.reused_anchor
    assert verify(storage, "step_000000006").step == 6


def test_losing_the_claim_before_the_commit_discards_the_build(tmp_path):
    result, config, _, _ = linear_job(tmp_path)
    request = PublishQueue(config.queue_dir).load(result.request_id)
    with pytest.raises(LostClaim):
        build_artifact(request, still_owner=lambda: False)
    assert list(Path(result.artifact_dir).parent.iterdir()) == []  # no artifact, no temporary left


def test_a_parallel_build_that_commits_first_wins_and_ours_is_dropped(tmp_path):
    result, config, _, _ = linear_job(tmp_path)
    request = PublishQueue(config.queue_dir).load(result.request_id)
    winner = {}

    def stage(name):
        if name == "commit":  # another publisher commits the same request while we are about to
            winner["result"] = build_artifact(request)
        return torch.no_grad()  # any context manager

    ours = build_artifact(request, stage=stage)
    assert winner["result"].created and not ours.created
    assert ours.manifest == winner["result"].manifest
    assert sorted(p.name for p in Path(result.artifact_dir).parent.iterdir()) == [result.request_id]


def test_a_model_that_does_not_reproduce_the_trained_outputs_fails_with_the_reason(tmp_path):
    wrong = ModelSpec(factory="torch.nn:Linear", config={"in_features": 4, "out_features": 3, "bias": False})
    result, config, _, _ = linear_job(tmp_path, spec=wrong)
    (outcome,) = PublishWorker(config.queue_dir, policy=allow_torch_nn(config.queue_dir)).drain()
    assert outcome.status == "failed" and "does not reproduce the trained model's outputs" in outcome.error
    queue = PublishQueue(config.queue_dir)
    assert queue.status(result.request_id) == "failed"
    assert not Path(result.artifact_dir).exists()
    events = open_ledger(result.publish_run_dir).read()
    end = next(e for e in events if e.kind is EventKind.ATTEMPT_END)
    assert end.data["outcome"] == "failed" and "reproduce" in end.data["reason"]
    assert next(e for e in events if e.kind is EventKind.JOB_END).data["exit_status"] == 1


def test_a_model_whose_shapes_differ_from_the_anchor_is_a_clear_error(tmp_path):
    wrong = ModelSpec(factory="torch.nn:Linear", config={"in_features": 5, "out_features": 3})
    result, config, _, _ = linear_job(tmp_path, spec=wrong)
    request = PublishQueue(config.queue_dir).load(result.request_id)
    with pytest.raises(PublishError, match="cannot load anchor"):
        build_artifact(request)


# -- TorchRec ---------------------------------------------------------------------------------------------
torchrec = pytest.importorskip("torchrec")


def _collection(*, weighted: bool = False):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

    tables = [
        EmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=20, feature_names=["f0", "f1"]),
        EmbeddingBagConfig(name="b", embedding_dim=16, num_embeddings=30, feature_names=["f2"]),
        EmbeddingBagConfig(
            name="c",
            embedding_dim=8,
            num_embeddings=10,
            feature_names=["f1"],  # f1 is looked up in two tables of the same width
            pooling=PoolingType.SUM if weighted else PoolingType.MEAN,
        ),
    ]
    torch.manual_seed(0)
    return EmbeddingBagCollection(tables=tables, is_weighted=weighted)


@pytest.mark.parametrize("weighted", [False, True])
def test_plain_embedding_bags_pool_exactly_like_torchrec_and_export(weighted):
    from torchrec import KeyedJaggedTensor

    from ettr.publish.torchrec_export import PlainEmbeddingBags

    collection = _collection(weighted=weighted)
    batch = 5
    lengths = torch.tensor([1, 0, 3, 2, 1] * 3, dtype=torch.int32)  # includes an empty bag
    values = torch.randint(0, 10, (int(lengths.sum()),))
    weights = torch.rand(values.numel()) if weighted else None
    keys = ["f2", "f0", "f1"]  # not the collection's order: lookups go by key
    kjt = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights)
    plain = PlainEmbeddingBags.from_collection(collection)
    want, got = collection(kjt), plain(kjt)
    assert got.keys() == want.keys() and got.length_per_key() == want.length_per_key()
    torch.testing.assert_close(got.values(), want.values())
    assert got.values().shape == (batch, 8 + 8 + 16 + 8)

    class Pool(torch.nn.Module):  # plain tensors in, pooled values out: what a published program does
        def __init__(self) -> None:
            super().__init__()
            self.bags = plain

        def forward(self, values, lengths, weights=None):
            return self.bags(
                KeyedJaggedTensor(keys=["f2", "f0", "f1"], values=values, lengths=lengths, weights=weights)
            ).values()

    args = (values, lengths, weights) if weighted else (values, lengths)
    program = torch.export.export(Pool(), args, strict=False)
    assert not [n for n in program.graph.nodes if n.op == "call_function" and "fbgemm" in str(n.target)]
    torch.testing.assert_close(program.module()(*args), want.values())


def dlrm_spec(config) -> ModelSpec:
    return ModelSpec(
        factory="dlrm.model:Dlrm",
        config_type="dlrm.model:DlrmConfig",
        config=asdict(config),
        pythonpath=(str(EXAMPLES),),
    )


@pytest.mark.timeout(180)
def test_a_dlrm_publishes_in_bfloat16_with_a_dynamic_batch(tmp_path, monkeypatch):
    import sys

    monkeypatch.syspath_prepend(str(EXAMPLES))
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    from dlrm.data import ClickDataConfig, HiddenClickModel
    from dlrm.model import Dlrm, DlrmConfig
    from torchrec import KeyedJaggedTensor

    config = DlrmConfig(num_tables=3, num_rows=50, embedding_dim=8, bottom_mlp=(16, 8), over_mlp=(16,))
    torch.manual_seed(1)
    model = Dlrm(config)
    batch = HiddenClickModel(ClickDataConfig(num_tables=3, num_rows=50, batch_size=16)).batch(rank=0, index=0)
    kjt = KeyedJaggedTensor(keys=config.feature_names, values=batch.values, lengths=batch.lengths)
    publish = PublishConfig(
        anchor_root=tmp_path / "anchors",
        queue_dir=tmp_path / "queue",
        model=dlrm_spec(config),
        input_names=("dense", "sparse"),
        dtype="bfloat16",
    )
    result = publish_at_end(
        model, step=3, config=publish, sample_inputs=(batch.dense, kjt), recorder=Recorder(None)
    )
    (outcome,) = PublishWorker(
        publish.queue_dir,
        policy=PublishPolicy.for_queue(publish.queue_dir, allow=["dlrm.*"], pythonpath_roots=[str(EXAMPLES)]),
    ).drain()
    assert outcome.status == "published", outcome.error
    published = load_artifact(result.artifact_dir)
    assert published.config["dtype"] == "bfloat16" and published.config["dynamic_batch"]
    assert [i["name"] for i in published.config["program_inputs"]] == [
        "dense",
        "sparse.values",
        "sparse.lengths",
    ]
    assert all(w.dtype == torch.bfloat16 for w in published.weights.values())
    check = published.check()
    assert check.ok and 0 < check.max_abs_err < check.atol + check.rtol * 10
    assert outcome.verification["sub_batch"]["ok"]
    # Same predictions as the trained model (bfloat16 tolerance), on another batch size too.
    other = HiddenClickModel(ClickDataConfig(num_tables=3, num_rows=50, batch_size=7)).batch(rank=0, index=4)
    with torch.no_grad():
        want = model(
            other.dense,
            KeyedJaggedTensor(keys=config.feature_names, values=other.values, lengths=other.lengths),
        )
    got = published(other.dense, other.values, other.lengths)
    torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)
    assert ((got > 0) == (want > 0)).float().mean() >= 6 / 7
    assert "torchrec" in sys.modules  # (the no-TorchRec load is checked in a clean process elsewhere)


def test_request_tolerances_and_dtype_reach_the_artifact(tmp_path):
    spec = replace(LINEAR)
    result, config, _, _ = linear_job(tmp_path, spec=spec)
    queue = PublishQueue(config.queue_dir)
    request = queue.load(result.request_id)
    strict = replace(request, rtol=0.0, atol=0.0, artifact_dir=str(tmp_path / "strict"))
    built = build_artifact(strict)
    body = json.loads((Path(built.path) / "artifact.json").read_text())
    assert body["verification"]["exported_program"]["rtol"] == 0.0
    assert os.path.isfile(Path(built.path) / "model.pt2")


@pytest.mark.parametrize("kind", ["deep", "huge", "nan"])
def test_a_forged_artifact_manifest_is_no_manifest(tmp_path, kind):
    """An `artifact.json` under the roots (requesters can write there) nested 100,000 levels raised
    RecursionError out of the publisher, and a 10 GB sparse one was read whole: neither is a manifest."""
    manifest = tmp_path / "artifact.json"
    if kind == "deep":
        manifest.write_text("[" * 100_000 + "]" * 100_000)
    elif kind == "nan":
        manifest.write_text('{"format": "ettr.publish-artifact/1", "files": {}, "x": NaN}')
    else:
        with open(manifest, "wb") as f:
            f.truncate(10 << 30)
    assert read_manifest(tmp_path) is None


def test_an_anchor_root_whose_name_is_not_utf8_publishes(tmp_path):
    # A path is bytes: `\xff` in it (a surrogate in Python) raised UnicodeEncodeError out of publish_at_end
    # (the request's id hashed the root's text); a UTF-8 root's id is what it was.
    import hashlib

    from ettr.publish.request import request_id_for

    base = tmp_path / os.fsdecode(b"job-\xff")
    base.mkdir()
    _result, config, _run, _model = linear_job(base)
    (outcome,) = PublishWorker(config.queue_dir, policy=allow_torch_nn(config.queue_dir)).drain()
    assert outcome.status == "published", outcome.error
    digest = hashlib.sha1("j\0/r/\u00fc\x005".encode()).hexdigest()[:8]
    assert request_id_for("j", "/r/\u00fc", 5) == f"j-step000000005-{digest}"
