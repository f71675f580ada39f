"""Replay against reality: real jobs under `ettr run` (an unmodified PyTorch script, injected crashes and a
preemption with a requeue), then `ettr simulate --from RUN_DIR --replay` must predict the measured ETT%
within 2 points and every bucket within 5% of wall time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

PLAIN = str(Path(__file__).parent / "scripts" / "train_plain.py")
ETTR = [sys.executable, "-m", "ettr.cli"]


def ettr(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    return subprocess.run([*ETTR, *args], capture_output=True, text=True, timeout=300, env=env, check=False)


def plain(ckpt: Path) -> list[str]:
    return [
        sys.executable, PLAIN, "--ckpt-dir", str(ckpt), "--num-steps", "40", "--save-every", "8",
        "--step-s", "0.05", "--init-s", "0.5", "--first-batch-s", "0.3",
    ]  # fmt: skip


def replayed(run_dir: Path) -> dict[str, Any]:
    done = ettr("simulate", "--from", str(run_dir), "--replay", "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def assert_close(out: dict[str, Any]) -> None:
    measured = out["measured"]
    assert abs(out["ett_pct"] - measured["ett_pct"]) <= 2.0, (out["ett_pct"], measured["ett_pct"])
    for bucket, pct in measured["buckets_pct"].items():
        assert abs(out["buckets_pct"][bucket] - pct) <= 5.0, (bucket, out["buckets_pct"][bucket], pct)
    assert out["wall_s"] == pytest.approx(measured["wall_s"], rel=0.05)


def test_replay_of_two_crashes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = ettr("run", "--run-dir", str(run_dir), "--inject", "crash@step=13",
                "--inject", "crash@step=29,attempt=1", "--", *plain(tmp_path / "ckpt"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = replayed(run_dir)
    assert out["num_failures_mean"] == 2
    assert out["profile"]["interval_steps"] == 8
    assert_close(out)


def test_replay_of_a_preemption_requeue_and_a_crash(tmp_path: Path) -> None:
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    first = ettr("run", "--run-dir", str(run_dir), "--inject", "preempt@step=11", "--", *plain(ckpt))
    assert first.returncode == 143, first.stderr
    again = ettr("run", "--run-dir", str(run_dir), "--inject", "crash@step=27,attempt=1", "--", *plain(ckpt))
    assert again.returncode == 0, again.stderr
    out = replayed(run_dir)
    assert out["num_failures_mean"] == 2 and out["num_preemptions_mean"] == 1
    assert_close(out)
