"""The real thing: a 2-rank TorchRec DLRM job under `ettr run`, tables sharded column-wise, replicated and
table-wise over gloo, publishes standalone; `ettr publish` reshards its anchor into one CPU process and
builds the artifact; a clean process with no TorchRec, no ettr and no model code loads it and predicts
what the trained model predicted; `ettr report TRAIN PUBLISH` shows both jobs.

The training job is `benchmarks/publish_shutdown.py job` (the job the shutdown benchmark measures).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ettr.checkpoint.commit import verify
from ettr.checkpoint.storage import open_storage
from ettr.events import EventKind, Phase
from ettr.ledger import open_ledger
from ettr.publish import PublishQueue

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "benchmarks" / "publish_shutdown.py"
ETTR = str(Path(sys.executable).with_name("ettr"))

# Loads the artifact with torch and safetensors alone: any import of the training stack fails.
LOAD_WITHOUT_TRAINING_CODE = """
import importlib.abc, json, sys

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torchrec", "fbgemm_gpu", "dlrm", "ettr", "examples"):
            raise ImportError("the artifact must load without " + name)

sys.meta_path.insert(0, Refuse())
import torch
from safetensors.torch import load_file

root = sys.argv[1]
config = json.load(open(root + "/config.json"))
program = torch.export.load(root + "/model.pt2").module()
sample = load_file(root + "/publish-sample.safetensors")
weights = load_file(root + "/model.safetensors")
args = [sample["input." + spec["name"]] for spec in config["program_inputs"]]
with torch.no_grad():
    logits = program(*args)
expected = sample["output.0"]
print(json.dumps({
    "max_abs_err": (logits - expected).abs().max().item(),
    "same_clicks": ((logits > 0) == (expected > 0)).float().mean().item(),
    "num_samples": logits.shape[0],
    "weights": sorted(weights),
    "loaded": sorted(m for m in sys.modules if m.split(".")[0] in ("torchrec", "fbgemm_gpu", "dlrm", "ettr")),
}))
"""


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}


def _run(command: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(command, capture_output=True, text=True, env=_env(), timeout=timeout_s)
    assert proc.returncode == 0, (
        f"{command[:3]} -> {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    return proc


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_sharded_two_rank_dlrm_publishes_standalone_and_the_artifact_predicts_like_the_trained_model(
    tmp_path,
):
    train_run, queue_dir, anchors = tmp_path / "train", tmp_path / "queue", tmp_path / "anchors"
    _run(
        [
            ETTR, "run", "--run-dir", str(train_run), "--job-id", "dlrm-train", "--max-restarts", "0", "--",
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(JOB),
            "job", "--mode", "standalone", "--steps", "8", "--queue", str(queue_dir), "--anchor-root", str(anchors),
            "--summary-out", str(tmp_path / "summary.json"),
        ],
        timeout_s=240,
    )  # fmt: skip
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (
        "column_wise" in summary["plan"]
        and "data_parallel" in summary["plan"]
        and "table_wise" in summary["plan"]
    )

    # The training job ended with the anchor committed and the request queued, and built nothing itself.
    queue = PublishQueue(queue_dir)
    assert queue.status(summary["request_id"]) == "pending"
    assert not Path(summary["artifact_dir"]).exists()
    manifest = verify(open_storage(anchors), "step_000000008")
    assert manifest.world_size == 2 and {"__0_0.distcp", "__1_0.distcp"} <= set(manifest.files)
    train_events = open_ledger(train_run).read()
    publish_spans = [
        e for e in train_events if e.kind is EventKind.PHASE_END and e.phase is Phase.PUBLISH and e.rank == 0
    ]
    job_end = next(e for e in train_events if e.kind is EventKind.JOB_END)
    assert len(publish_spans) == 1 and publish_spans[0].ts <= job_end.ts

    allow = ["--allow-factory", "dlrm.*", "--allow-pythonpath", str(ROOT / "examples")]
    out = _run([ETTR, "publish", str(queue_dir), "--json", *allow], timeout_s=240)
    (outcome,) = json.loads(out.stdout)["outcomes"]
    assert outcome["status"] == "published"
    assert outcome["verification"]["loaded_model"]["max_abs_err"] < 1e-4  # resharded = trained, sharded model
    assert outcome["verification"]["sub_batch"]["ok"]

    loaded = json.loads(
        _run(
            [sys.executable, "-c", LOAD_WITHOUT_TRAINING_CODE, summary["artifact_dir"]], timeout_s=120
        ).stdout
    )
    assert loaded["loaded"] == []
    assert loaded["max_abs_err"] < 1e-4 and loaded["same_clicks"] == 1.0 and loaded["num_samples"] == 128
    assert "sparse_arch.embedding_bags.t0.weight" in loaded["weights"]  # the column-wise table, whole again

    both = json.loads(
        _run([ETTR, "report", str(train_run), outcome["run_dir"], "--json"], timeout_s=60).stdout
    )
    train, publish = both
    assert train["job_id"] == "dlrm-train" and publish["job_id"] == f"publish-{summary['request_id']}"
    publish_start = next(
        e for e in open_ledger(outcome["run_dir"]).read() if e.kind is EventKind.SUPERVISOR_START
    )
    assert publish_start.data["linked_job"] == "dlrm-train"
    # The training job's shutdown holds its publish span (anchor + enqueue) and its teardown, no build.
    publish_s = publish_spans[0].ts - publish_spans[0].value
    assert train["buckets_s"]["shutdown"] >= publish_s
    assert publish_s < publish["wall_s"] - publish["buckets_s"]["scheduling"]
    assert [a["outcome"] for a in publish["attempts"]] == ["completed"]
    assert publish["buckets_s"]["restore"] > 0


def _train_and_publish(tmp_path: Path, ckpt_mode: str) -> tuple[Path, dict]:
    """The reference job (`examples/dlrm/train.py`, 2 ranks, tables sharded) with `--publish standalone`,
    then `ettr publish` of its queue; (its directory, the outcome)."""
    out = tmp_path / ckpt_mode
    _run(
        [
            ETTR, "run", "--run-dir", str(out / "run"), "--job-id", "dlrm-train", "--max-restarts", "0", "--",
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(ROOT / "examples" / "dlrm" / "train.py"), "--steps", "12", "--ckpt-every", "6",
            "--ckpt-mode", ckpt_mode, "--ckpt-dir", str(out / "ckpt"), "--publish", "standalone",
            "--publish-dir", str(out / "publish"), "--no-compile", "--num-rows", "2000", "--num-workers", "0",
            "--fast-exit", "--log-every", "6",
        ],
        timeout_s=240,
    )  # fmt: skip
    allow = ["--allow-factory", "dlrm.*", "--allow-pythonpath", str(ROOT / "examples")]
    out_pub = _run([ETTR, "publish", str(out / "publish" / "queue"), "--json", *allow], timeout_s=240)
    (outcome,) = json.loads(out_pub.stdout)["outcomes"]
    assert outcome["status"] == "published"
    return out, outcome


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_anchor_linked_from_the_final_checkpoint_publishes_what_a_written_anchor_does(tmp_path):
    from safetensors.torch import load_file

    linked_dir, linked = _train_and_publish(tmp_path, "ettr")  # ettr's checkpoints: the anchor is linked
    written_dir, written = _train_and_publish(tmp_path, "sync")  # torch.save rank files: it is written

    spans = {
        d: [
            e.data
            for e in open_ledger(d / "run").read()
            if e.kind is EventKind.PHASE_END and e.phase is Phase.PUBLISH
        ]
        for d in (linked_dir, written_dir)
    }
    assert [s["anchor_made"] for s in spans[linked_dir]] == ["linked", "linked"]  # both ranks
    assert spans[linked_dir][0]["linked_files"] == 2 and "anchor_fallback" not in spans[linked_dir][0]
    assert [s["anchor_made"] for s in spans[written_dir]] == ["written", "written"]
    anchor = linked_dir / "publish" / "anchors" / "step_000000012"
    for rank_file in ("__0_0.distcp", "__1_0.distcp"):  # the checkpoint's own files, one inode each
        assert (anchor / rank_file).stat().st_ino == (
            linked_dir / "ckpt" / "step_000000012" / rank_file
        ).stat().st_ino
    assert linked["verification"]["loaded_model"]["max_abs_err"] == 0.0

    # The same artifact from either anchor: the trained weights bit for bit (column-wise tables whole again).
    a = load_file(Path(linked["artifact_dir"]) / "model.safetensors")
    b = load_file(Path(written["artifact_dir"]) / "model.safetensors")
    assert a.keys() == b.keys() and "sparse_arch.embedding_bags.t0.weight" in a
    for key in a:
        assert torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8)), key
