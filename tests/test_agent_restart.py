"""A real 2-rank restart through ettr's own torchrun agent (`ettr.supervisor.agent`, `workers.py`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ettr.compile.config import private_cache_dir
from ettr.events import EventKind
from ettr.ledger import read_run_events

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
PROBE = ROOT / "tests" / "scripts" / "agent_probe.py"


def run_ettr(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env or {})}
    full.pop("OMP_NUM_THREADS", None)
    # An earlier test's compile in this pytest process leaves inductor's default directory here (inductor
    # writes it into os.environ): the job must choose its cache directory itself, as a user's would.
    full.pop("TORCHINDUCTOR_CACHE_DIR", None)
    return subprocess.run(
        [sys.executable, "-m", "ettr.cli", *args], env=full, capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize("zygote", [False, True])
def test_a_failed_rank_restarts_both_ranks_in_their_warm_standbys(tmp_path: Path, zygote: bool) -> None:
    """With `ETTR_ZYGOTE=0` attempt 1 runs in the standbys; with the zygote every rank of both attempts is
    forked from it (and no standby is started), each seeing what a cold start would."""
    out = tmp_path / "out"
    out.mkdir()
    run_dir = tmp_path / "run"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    args = ["run", "--run-dir", str(run_dir), "--max-restarts", "1", "--", *torchrun, str(PROBE), str(out)]
    done = run_ettr(*args, env={} if zygote else {"ETTR_ZYGOTE": "0"})
    assert done.returncode == 0, done.stderr
    assert "runs the real torchrun" not in done.stderr
    seen = {
        name: json.loads((out / name).read_text())
        for name in ("0-0.json", "0-1.json", "1-0.json", "1-1.json")
    }
    ports = set()
    for attempt in (0, 1):
        for rank in (0, 1):
            probe = seen[f"{attempt}-{rank}.json"]
            env = probe["env"]
            assert probe["argv"] == [str(PROBE), str(out)] and probe["name"] == "__main__"
            assert (env["RANK"], env["LOCAL_RANK"], env["ROLE_RANK"], env["GROUP_RANK"]) == (
                str(rank),
            ) * 3 + ("0",)
            assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["ROLE_WORLD_SIZE"]) == ("2", "2", "2")
            assert env["TORCHELASTIC_RESTART_COUNT"] == env["ETTR_ATTEMPT"] == str(attempt)  # never stale
            assert env["TORCHELASTIC_MAX_RESTARTS"] == "1" and env["TORCHELASTIC_USE_AGENT_STORE"] == "False"
            assert env["OMP_NUM_THREADS"] == "1" and env["ROLE_NAME"] == "default"
            assert env["TORCHELASTIC_ERROR_FILE"].startswith(str(run_dir / "agent" / f"attempt-{attempt}"))
            # The workload's own inductor cache directory, in the standby too: its warm-up imported
            # torch._dynamo, which left inductor's default directory (every workload's) in its environment.
            assert env["TORCHINDUCTOR_CACHE_DIR"] == private_cache_dir(str(PROBE))
            ports.add((attempt, env["MASTER_PORT"]))
    assert len({port for _, port in ports}) == 2  # a fresh rendezvous port per attempt
    events = read_run_events(run_dir)
    starts = [e for e in events if e.kind is EventKind.ATTEMPT_START]
    assert [(e.data or {}).get("agent") for e in starts] == ["ettr", "ettr"]
    marks = [e for e in events if e.kind is EventKind.MARK]
    paths = [e.data["path"] for e in marks if e.data.get("name") == "relaunch"]
    if zygote:
        forked = sorted((e.attempt, e.rank, e.data["pid"]) for e in marks if e.data.get("name") == "zygote")
        assert forked == sorted((a, r, seen[f"{a}-{r}.json"]["pid"]) for a in (0, 1) for r in (0, 1))
        assert paths == ["forked", "forked"]
        assert not [e for e in marks if e.data.get("name") == "standby"]
    standby = {e.rank: e.data["pid"] for e in marks if e.data.get("name") == "standby"}
    assert zygote or standby == {
        0: seen["1-0.json"]["pid"],
        1: seen["1-1.json"]["pid"],
    }  # attempt 1 ran in the standbys
    assert all(e.attempt == 1 for e in marks if e.data.get("name") == "standby")
    ranks = sorted((e.attempt, e.rank, e.data["pid"]) for e in events if e.kind is EventKind.PROCESS_START)
    assert ranks == sorted((a, r, seen[f"{a}-{r}.json"]["pid"]) for a in (0, 1) for r in (0, 1))
    end = next(e.data for e in events if e.kind is EventKind.ATTEMPT_END and e.attempt == 0)
    assert (end["outcome"], end["exit_code"]) == ("failed", 3)  # the failed rank's status; rank 0 was stopped


DDP = ROOT / "tests" / "scripts" / "train_ddp.py"


@pytest.mark.parametrize(
    ("inject", "extra", "status", "first"),
    [
        ("kill@step=6,rank=1", [], 0, ("failed", 137)),  # the dead rank's SIGKILL, not a torchrun exit 1
        ("hang@step=6,rank=1", ["--hang-timeout", "30"], 0, ("hung", None)),  # 30: a loaded import torch
        ("preempt@step=6", [], 143, ("preempted", None)),
    ],
)
def test_faults_hangs_and_preemption_under_the_agent(
    tmp_path: Path, inject: str, extra: list[str], status: int, first: tuple
) -> None:
    run_dir = tmp_path / "run"
    torchrun = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(DDP),
        "--ckpt-dir", str(tmp_path / "ckpt"), "--num-steps", "10", "--save-every", "4", "--step-s", "0.05",
    ]  # fmt: skip
    done = run_ettr("run", "--run-dir", str(run_dir), "--inject", inject, *extra, "--", *torchrun)
    assert done.returncode == status, done.stderr
    events = read_run_events(run_dir)
    ends = [e.data for e in events if e.kind is EventKind.ATTEMPT_END]
    assert ends[0]["outcome"] == first[0] and (first[1] is None or ends[0]["exit_code"] == first[1])
    if status == 0:
        assert [e["outcome"] for e in ends] == [first[0], "completed"]
        resumed = [e for e in events if e.kind is EventKind.RESUMED and e.attempt == 1]
        assert resumed  # from the checkpoint of step 4, by both ranks
    else:
        assert len(ends) == 1 and "forwarding it to the job" in done.stderr
    assert {(e.attempt, e.rank) for e in events if e.kind is EventKind.PROCESS_START} >= {(0, 0), (0, 1)}
