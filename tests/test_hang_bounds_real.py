"""Hang detection that follows the job, with real processes (slow): a fast-step job that hangs is caught by
its step bound, and a long evaluation in the same job (explicit `ettr.Phase.EVAL`, or zero-code detected from
`model.eval()`) sleeping far past that bound is not a hang. No timing is asserted: only what the supervisor
decided and which bound it applied (and that each evaluation's sleep is booked as evaluation)."""

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

# One job holds every case (each run of a real job under `ettr run` costs the suite tens of seconds): attempt 0
# runs a long explicit evaluation (`ettr.Phase.EVAL`) at step 10 and a long zero-code one (`model.eval()` and
# `torch.no_grad()`) at step 20, saves at step 25 and hangs at step 30 (injected); attempt 1 resumes from the save,
# so the evaluations before it are kept (not lost progress) and booked as evaluation.
JOB = textwrap.dedent(
    """
    import os, sys, time
    import torch
    import ettr

    first = os.environ.get("ETTR_ATTEMPT", "0") == "0"
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    if os.path.exists(sys.argv[1]):
        saved = torch.load(sys.argv[1])
        model.load_state_dict(saved["model"])
        start = saved["step"] + 1
    for step in range(start, 40):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.05)
        if first and step == 10:
            with ettr.phase(ettr.Phase.EVAL):
                time.sleep(EVAL_S)  # the training thread does not move: no heartbeat
        if first and step == 20:
            model.eval()
            with torch.no_grad():
                model(torch.ones(2, 4))  # the zero-code evaluation begins at its first pass
                time.sleep(EVAL_S)
            model.train()
        if step == 25:
            torch.save({"model": model.state_dict(), "step": step}, sys.argv[1])
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


def test_long_evaluations_are_not_hangs_and_a_hang_is_caught_by_the_step_bound(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    run_dir = tmp_path / "run"
    done = run_ettr(
        "run", "--run-dir", str(run_dir), "--inject", "hang@step=30,attempt=0", "--", sys.executable, str(script),
        str(tmp_path / "ckpt.pt"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rep = report(run_dir)
    assert [a["outcome"] for a in rep["attempts"]] == ["hung", "completed"], done.stderr
    # attempt 0 got past both evaluations (steps 10 and 20) to the injected hang: neither was called a hang
    assert rep["attempts"][0]["last_step"] >= 29, rep["attempts"][0]
    # the save after 26 optimizer steps (0..25)
    assert rep["attempts"][1]["resumed_from_step"] == 26, rep["attempts"][1]
    assert rep["failures"][0]["detail"] == "hung" and "step bound" in rep["failures"][0]["evidence"]
    # both evaluations are booked as evaluation: each sleeps EVAL_S inside it
    assert rep["buckets_s"]["evaluation"] >= 2 * EVAL_S - 1, rep["buckets_s"]
