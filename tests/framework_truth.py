"""Shared by the framework tests: run a script under `ettr run`, read its report, and check the report
against the timeline the script observed itself (`tests/scripts/observed.py`).

Checked exactly: the attempts, each one's resumed step, last step and lost steps, the number of failures and
of checkpoints. Checked within 5% + 0.25 s: effective training, which must lie between the steps' own time
(the script's clock around each step) and the time between the kept steps' ends.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from observed import read_truth  # noqa: E402

SCRIPTS = Path(__file__).parent / "scripts"
ETTR = [sys.executable, "-m", "ettr.cli"]


def run_ettr(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    return subprocess.run(
        [*ETTR, *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def report(run_dir: Path) -> dict[str, Any]:
    done = run_ettr("report", str(run_dir), "--json", timeout=120)
    assert done.returncode == 0, done.stderr
    rep = json.loads(done.stdout)
    assert math.fsum(rep["buckets_s"].values()) == pytest_approx(rep["wall_s"])
    return rep


def pytest_approx(value: float) -> Any:
    import pytest

    return pytest.approx(value, rel=1e-6, abs=1e-6)


def summary(rep: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [(a["outcome"], a["resumed_from_step"], a["last_step"], a["lost_steps"]) for a in rep["attempts"]]


def expected(observed: Path, outcomes: list[str]) -> tuple[list[tuple[Any, ...]], int, float, float]:
    """From what the script saw: the summary rows, the number of checkpoints, and the lower and upper
    bounds of effective training (seconds)."""
    truth = read_truth(observed)
    indices = sorted(truth)
    assert len(indices) == len(outcomes), truth
    rows, lower, upper = [], 0.0, 0.0
    for position, index in enumerate(indices):
        seen = truth[index]
        steps = seen["steps"]
        later = truth[indices[position + 1]]["resumed"] if position + 1 < len(indices) else None
        keep = math.inf if position + 1 == len(indices) else (later if later is not None else -math.inf)
        lost = sum(1 for step, _, _ in steps if step > keep)
        rows.append((outcomes[position], seen["resumed"], max(s for s, _, _ in steps), lost))
        kept = [(t0, t1) for step, t0, t1 in steps if step <= keep]
        lower += math.fsum(t1 - t0 for t0, t1 in kept)
        if kept:
            ends = [t1 for _, t1 in kept]
            upper += (ends[0] - kept[0][0]) + (ends[-1] - ends[0])
    num_checkpoints = sum(len(truth[i]["checkpoints"]) for i in indices)
    return rows, num_checkpoints, lower, upper


def check_against_truth(rep: dict[str, Any], observed: Path, outcomes: list[str]) -> None:
    rows, num_checkpoints, lower, upper = expected(observed, outcomes)
    assert summary(rep) == rows
    assert len(rep["checkpoint_commits"]) == num_checkpoints
    assert rep["num_failures"] == sum(1 for o in outcomes if o != "completed")
    effective = rep["buckets_s"]["effective_training"]
    assert lower * 0.95 - 0.25 <= effective <= upper * 1.05 + 0.25, (lower, effective, upper)
    assert rep["buckets_s"]["checkpoint_blocking"] > 0
    for attempt in rep["attempts"][1:]:
        if attempt["resumed_from_step"]:
            assert attempt["buckets_s"]["restore"] > 0, attempt
