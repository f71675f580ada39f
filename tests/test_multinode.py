"""Two nodes on one machine: two `ettr run` supervisors of one torchrun job (c10d rendezvous, gloo over
loopback) sharing one ledger URL. Attempts are job-wide; a crash on node 1 and a SIGKILL of node 1's
supervisor both end in one correct report."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ettr.events import EventKind
from ettr.ledger.url import open_url
from ettr.supervisor import peers

pytestmark = pytest.mark.slow

DDP = str(Path(__file__).parent / "scripts" / "train_ddp.py")
ETTR = [sys.executable, "-m", "ettr.cli"]
JOB = "two-nodes"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def _node(tmp: Path, url: str, rank: int, *extra: str, steps: int = 10) -> subprocess.Popen[str]:
    # Each node names its own address: the rendezvous orders nodes by it, so node 1 holds global rank 1.
    torchrun = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={rank}",
        "--nproc-per-node=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29400",
        f"--local-addr=127.0.0.{rank + 1}", DDP, "--ckpt-dir", str(tmp / "ckpt"), "--num-steps", str(steps),
        "--save-every", "4", "--step-s", "0.1",
    ]  # fmt: skip
    argv = [*ETTR, "run", "--run-dir", str(tmp / f"node{rank}"), "--ledger", url, "--job-id", JOB]
    argv += ["--peer-timeout", "4", *extra, "--", *torchrun]
    return subprocess.Popen(argv, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen[str], timeout: float = 240) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def _report(url: str) -> dict[str, Any]:
    done = subprocess.run(
        [*ETTR, "report", "--ledger", url, "--job-id", JOB, "--json"],
        capture_output=True, text=True, timeout=120, env=_env(), check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rep = json.loads(done.stdout)
    assert math.fsum(rep["buckets_s"].values()) == pytest.approx(rep["wall_s"], rel=1e-6, abs=1e-6)
    assert rep["ett_pct"] + rep["idleness_pct"] + rep["failure_pct"] == pytest.approx(100.0)
    return rep


def _events(url: str) -> list[Any]:
    ledger = open_url(url, job_id=JOB)
    try:
        return ledger.read()
    finally:
        ledger.close()


def _marks(events: list[Any], name: str) -> list[tuple[int, int]]:
    return sorted(
        (e.attempt, e.data["node_rank"])
        for e in events
        if e.kind is EventKind.MARK and e.rank < 0 and (e.data or {}).get("name") == name
    )


def _summary(rep: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [(a["outcome"], a["resumed_from_step"], a["last_step"]) for a in rep["attempts"]]


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """One ledger both nodes write to: a shared SQLite file, or the session's PostgreSQL server."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    return str(request.getfixturevalue("postgres_url"))


def test_a_crash_on_node_1_restarts_both_nodes_together(tmp_path: Path, ledger_url: str) -> None:
    url = ledger_url
    leader = _node(tmp_path, url, 0)
    follower = _node(tmp_path, url, 1, "--inject", "crash@step=6,rank=1")
    (status0, err0), (status1, err1) = _finish(leader), _finish(follower)
    assert (status0, status1) == (0, 0), err0 + err1
    rep = _report(url)
    # Rank 1 (node 1) crashed after step 6; rank 0 saved step 4; the job's one restart resumed there.
    assert _summary(rep) == [("failed", None, 6), ("completed", 4, 10)]
    assert rep["num_failures"] == 1
    events = _events(url)
    assert _marks(events, peers.NODE_ATTEMPT_START) == [(0, 1), (1, 1)]  # node 1 joined both attempts
    assert _marks(events, peers.NODE_ATTEMPT_END) == [(0, 1), (1, 1)]
    ports = {e.attempt: e.data["port"] for e in events if (e.data or {}).get("name") == peers.RENDEZVOUS}
    assert len(set(ports.values())) == 2  # a fresh rendezvous per attempt, the same on both nodes
    starts = [e for e in events if e.kind is EventKind.ATTEMPT_START]
    assert [e.attempt for e in starts] == [0, 1]  # one job-wide start per attempt (the leader's)
    failure = next(e for e in events if e.kind is EventKind.FAILURE)
    assert (failure.attempt, failure.rank, failure.data["exception"]) == (0, 1, "InjectedCrash")


def _wait_step(url: str, step: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if any(e.kind is EventKind.STEP and (e.step or 0) >= step for e in _events(url)):
                return
        except Exception:
            pass  # the ledger may not exist yet
        time.sleep(0.2)  # another process makes this true; nothing to await on
    raise AssertionError(f"no step {step} within {timeout_s} s")


def test_a_sigkilled_supervisor_on_node_1_is_detected_and_the_job_continues(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    leader = _node(tmp_path, url, 0)
    follower = _node(tmp_path, url, 1)
    _wait_step(url, 5)
    follower.send_signal(signal.SIGKILL)
    follower.communicate(timeout=30)
    replacement = _node(tmp_path, url, 1)  # the node's supervisor comes back (a requeue, an operator)
    (status0, err0), (status1, err1) = _finish(leader), _finish(replacement)
    assert (status0, status1) == (0, 0), err0 + err1
    rep = _report(url)
    outcomes = [a["outcome"] for a in rep["attempts"]]
    assert outcomes[-1] == "completed" and "failed" in outcomes[:-1]
    assert rep["attempts"][-1]["resumed_from_step"] in (4, 8)
    assert rep["attempts"][-1]["last_step"] == 10
    events = _events(url)
    first_end = next(e for e in events if e.kind is EventKind.ATTEMPT_END)
    assert first_end.attempt == 0 and first_end.data["outcome"] == "failed"
    # The replacement did not rejoin the attempt its predecessor died in, and joined the next one.
    joined = _marks(events, peers.NODE_ATTEMPT_START)
    assert (0, 1) in joined and joined.count((0, 1)) == 1 and (rep["attempts"][-1]["index"], 1) in joined


def test_a_silent_supervisor_is_lost_after_the_peer_timeout(tmp_path: Path) -> None:
    # SIGSTOP: node 1's supervisor stops writing heartbeats while its processes train on; only the peer
    # timeout can tell. Then it is SIGKILLed (its processes die with it) and a new one takes its place.
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    leader = _node(tmp_path, url, 0, steps=150)
    follower = _node(tmp_path, url, 1, steps=150)
    _wait_step(url, 5)
    follower.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 60
    while not any(e.kind is EventKind.ATTEMPT_END for e in _events(url)):
        assert time.monotonic() < deadline, "node 0 never noticed node 1's silence"
        time.sleep(0.2)  # another process makes this true; nothing to await on
    follower.send_signal(signal.SIGKILL)
    follower.communicate(timeout=30)
    replacement = _node(tmp_path, url, 1, steps=150)
    (status0, err0), (status1, err1) = _finish(leader), _finish(replacement)
    assert (status0, status1) == (0, 0), err0 + err1
    end = next(e for e in _events(url) if e.kind is EventKind.ATTEMPT_END)
    assert end.data["outcome"] == "failed"
    assert "node 1's supervisor is silent for over 4 s (lost)" in end.data["reason"]
    rep = _report(url)
    assert [a["outcome"] for a in rep["attempts"]] == ["failed", "completed"]
    assert rep["attempts"][-1]["resumed_from_step"] is not None and rep["attempts"][-1]["last_step"] == 150
