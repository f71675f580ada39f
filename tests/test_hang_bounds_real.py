"""Hang detection that follows the job, with real processes (slow): a fast-step job that hangs is caught by
its step bound, and a long evaluation in the same job (explicit `ettr.Phase.EVAL`, or zero-code detected from
`model.eval()`) sleeping far past that bound is not a hang. No timing is asserted: only what the supervisor
decided and which bound it applied."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

EVAL_S = 25.0
"""Longer than the step bound of this job (its 10 s floor): without the phase bound, a hang."""

JOB = textwrap.dedent(
    """
    import sys, time
    import torch
    import ettr

    how = sys.argv[1]
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(40):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.05)
        if step == 20:
            if how == "api":
                with ettr.phase(ettr.Phase.EVAL):
                    time.sleep(EVAL_S)  # the training thread does not move: no heartbeat
            else:
                model.eval()
                with torch.no_grad():
                    model(torch.ones(2, 4))  # the zero-code evaluation begins at its first pass
                    time.sleep(EVAL_S)
                model.train()
    """
).replace("EVAL_S", repr(EVAL_S))


def run_ettr(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    return subprocess.run(
        [sys.executable, "-m", "ettr", *args],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
        check=False,
    )


def report(run_dir: Path) -> dict:
    done = run_ettr("report", str(run_dir), "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("how", ["api", "zero_code"])
def test_a_long_evaluation_in_a_fast_step_job_is_not_a_hang(tmp_path: Path, how: str) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    run_dir = tmp_path / "run"
    done = run_ettr("run", "--run-dir", str(run_dir), "--", sys.executable, str(script), how)
    assert done.returncode == 0, done.stderr
    assert "hung" not in done.stderr
    rep = report(run_dir)
    assert [a["outcome"] for a in rep["attempts"]] == ["completed"]
    assert rep["buckets_s"]["evaluation"] > 0


def test_a_hang_in_a_fast_step_job_is_caught_by_its_step_bound(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    run_dir = tmp_path / "run"
    done = run_ettr(
        "run", "--run-dir", str(run_dir), "--inject", "hang@step=30", "--", sys.executable, str(script), "api"
    )
    assert done.returncode == 0, done.stderr
    rep = report(run_dir)
    assert [a["outcome"] for a in rep["attempts"]] == ["hung", "completed"]
    assert rep["failures"][0]["detail"] == "hung" and "step bound" in rep["failures"][0]["evidence"]
