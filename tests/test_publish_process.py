"""Real publisher processes: one killed mid-build (the next one retries), two racing on a queue, a watcher.

A publisher is killed with SIGKILL at a named point of its build (`PublishWorker(fault_hook=...)` in a
child process), the way a machine failure would; then the real `ettr publish` command picks the request up.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from ettr.ledger import open_ledger
from ettr.publish import ModelSpec, PublishConfig, PublishQueue, PublishWorker, WorkerConfig, publish_at_end
from ettr.publish.policy import PublishPolicy
from ettr.recorder import Recorder

ETTR = str(Path(sys.executable).with_name("ettr"))
ALLOW = ("--allow-factory", "torch.nn.*")
"""The one flag these publishers need: the requests' model is a torch.nn layer."""

KILL_AT = """
import os, signal, sys
from ettr.publish.policy import PublishPolicy
from ettr.publish.worker import PublishWorker

def hook(point):
    if point == sys.argv[2]:
        os.kill(os.getpid(), signal.SIGKILL)

policy = PublishPolicy.for_queue(sys.argv[1], allow=["torch.nn.*"])
PublishWorker(sys.argv[1], fault_hook=hook, policy=policy).drain()
"""


def enqueue_linear(tmp_path: Path, step: int = 5) -> tuple[str, PublishConfig]:
    """A Linear layer's anchor and publish request, as a training job leaves them; returns the request id."""
    torch.manual_seed(0)
    config = PublishConfig(
        anchor_root=tmp_path / "anchors",
        queue_dir=tmp_path / "queue",
        model=ModelSpec(factory="torch.nn:Linear", config={"in_features": 4, "out_features": 3}),
        input_names=("x",),
    )
    recorder = Recorder(open_ledger(tmp_path / "train"), run_dir=tmp_path / "train", job_id="train-1")
    try:
        result = publish_at_end(
            torch.nn.Linear(4, 3),
            step=step,
            config=config,
            sample_inputs=(torch.randn(6, 4),),
            recorder=recorder,
        )
    finally:
        recorder.close()
    return result.request_id, config


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}


def kill_publisher_at(queue_dir: Path, point: str) -> None:
    proc = subprocess.run([sys.executable, "-c", KILL_AT, str(queue_dir), point], env=_env(), timeout=120)
    assert proc.returncode == -signal.SIGKILL


def report(run_dir: str) -> dict:
    out = subprocess.run([ETTR, "report", run_dir, "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("point, status", [("write", "published"), ("committed", "existing")])
def test_a_killed_publisher_is_retried_by_the_next_and_one_artifact_results(tmp_path, point, status):
    request_id, config = enqueue_linear(tmp_path)
    queue = PublishQueue(config.queue_dir)
    kill_publisher_at(Path(config.queue_dir), point)
    assert queue.status(request_id) == "claimed"  # its owner is dead: the claim is stale
    artifacts = Path(config.queue_dir) / "artifacts"
    if point == "write":  # died mid-build: a temporary directory and no artifact
        assert [p.name.split(".tmp-")[0] for p in artifacts.iterdir()] == [f".{request_id}"]
    else:  # died after the commit rename, before recording it
        assert [p.name for p in artifacts.iterdir()] == [request_id]

    out = subprocess.run(
        [ETTR, "publish", str(config.queue_dir), "--json", *ALLOW],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    (outcome,) = json.loads(out.stdout)["outcomes"]
    assert outcome["status"] == status and outcome["attempt"] == 1
    assert queue.status(request_id) == "done"
    assert [p.name for p in artifacts.iterdir()] == [request_id]  # one artifact, no temporary left

    publish_job = report(outcome["run_dir"])
    assert [a["outcome"] for a in publish_job["attempts"]] == ["failed", "completed"]
    assert publish_job["num_failures"] == 1 and publish_job["buckets_s"]["restart"] > 0
    assert sum(publish_job["buckets_s"].values()) == pytest.approx(publish_job["wall_s"])
    events = open_ledger(outcome["run_dir"]).read()
    closed = [e for e in events if e.kind.value == "attempt_end" and e.attempt == 0]
    assert len(closed) == 1 and closed[0].data["closed_from_ledger"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_request_whose_publishers_keep_dying_is_given_up(tmp_path):
    request_id, config = enqueue_linear(tmp_path)
    kill_publisher_at(Path(config.queue_dir), "load")
    (outcome,) = PublishWorker(
        config.queue_dir,
        WorkerConfig(max_attempts=1),
        policy=PublishPolicy.for_queue(config.queue_dir, allow=["torch.nn.*"]),
    ).drain()
    assert outcome.status == "failed" and "died" in outcome.error
    queue = PublishQueue(config.queue_dir)
    assert queue.status(request_id) == "failed"
    events = open_ledger(outcome.run_dir).read()
    assert [e.data["exit_status"] for e in events if e.kind.value == "job_end"] == [1]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_publishers_racing_on_one_queue_build_one_artifact(tmp_path):
    request_id, config = enqueue_linear(tmp_path)
    procs = [
        subprocess.Popen(
            [ETTR, "publish", str(config.queue_dir), "--json", *ALLOW],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [r[1][-2000:] for r in results]
    outcomes = [o for stdout, _ in results for o in json.loads(stdout)["outcomes"]]
    assert [o["status"] for o in outcomes] == ["published"]
    assert [p.name for p in (Path(config.queue_dir) / "artifacts").iterdir()] == [request_id]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_watching_publisher_publishes_requests_as_they_arrive_and_stops_on_sigterm(tmp_path):
    queue_dir = tmp_path / "queue"
    PublishQueue(queue_dir, create=True)
    watcher = subprocess.Popen(
        [ETTR, "publish", str(queue_dir), "--watch", "--poll-interval", "0.2", *ALLOW],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
    )  # fmt: skip
    timer = threading.Timer(150, watcher.kill)  # a hung watcher fails the test instead of hanging it
    timer.start()
    try:
        assert watcher.stdout.readline().startswith("watching")
        request_id, _ = enqueue_linear(tmp_path)
        line = watcher.stdout.readline()  # blocks until the watcher reports the request
        assert line.startswith(f"published {request_id}"), line + watcher.stderr.read()[-2000:]
        watcher.send_signal(signal.SIGTERM)
        assert watcher.wait(timeout=60) == 0
    finally:
        timer.cancel()
        if watcher.poll() is None:
            watcher.kill()
    assert PublishQueue(queue_dir).status(request_id) == "done"
